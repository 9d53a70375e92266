"""The corpus of exercise solutions: how one is loaded and checked.

``tests/fixtures/solutions/<exercise>/`` holds solutions written from the student copy alone, by
people who had not read the package's answer or the model answer: ``correct_*.py`` must pass the
exercise's check, ``wrong_*.py`` must fail it with a message that names the mistake. Each file is
a module that defines what the exercise cell defines (the same names) and imports what it uses.
Its docstring says what it does; a wrong one's docstring has a line ``expect: <words>``: words of
the check's message that name its mistake (matched case-insensitively, any spacing between them).

Run one by hand, as a student would run the cell::

    python -m tests.corpus 03.2 tests/fixtures/solutions/03.2/correct_hooks.py
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import cloudpickle

from course_utils import checks

ROOT = Path(__file__).parent / "fixtures" / "solutions"

# exercise -> (the names its cell defines, the check called on them)
EXERCISES = {
    "01.1": (("state_bytes",), checks.check_state_bytes),
    "01.2": (("mlp_activation_bytes",), checks.check_mlp_activation_bytes),
    "01.3": (("accumulated_step",), checks.check_accumulated_step),
    "02.1": (("data_parallel_step",), checks.check_data_parallel_step),
    "02.2": (("local_loss_step",), checks.check_local_loss_step),
    "03.1": (("ring_all_reduce",), checks.check_ring_all_reduce),
    "03.2": (("OverlappedDDP",), checks.check_overlapped_ddp),
    "03b.1": (("sync_batch_stats",), checks.check_sync_batch_stats),
    "03b.2": (("train_with_uneven_data",), checks.check_train_with_uneven_data),
    "04.1": (("exposed_communication_ms",), checks.check_exposed_communication),
    "04.2": (("bus_bandwidth",), checks.check_bus_bandwidth),
    "05.1": (("one_f_one_b",), checks.check_one_f_one_b),
    "05.2": (("balanced_split",), checks.check_balanced_split),
    "05.3": (("Mailbox",), checks.check_mailbox),
    "06.1": (("CopyToTP", "ReduceFromTP"), checks.check_f_and_g),
    "06.2": (("qkv_shard",), checks.check_qkv_shard),
    "06.3": (("VocabParallelCrossEntropy",), checks.check_vocab_parallel_cross_entropy),
    "07.1": (("coords",), checks.check_coords),
    "07.2": (("links",), checks.check_links),
    "07.3": (("build_groups",), checks.check_groups),
    "08.1": (("shard_bounds",), checks.check_shard_bounds),
    "08.2": (("zero1_step",), checks.check_zero1_step),
    "08.3": (("Zero3",), checks.check_zero3),
    "09.1": (("merge",), checks.check_merge),
    "09.2": (("ring_forward",), checks.check_ring_forward),
    "09.3": (("seq_to_head",), checks.check_seq_to_head),
    "10.1": (("route",), checks.check_route),
    "10.2": (("dispatch_combine",), checks.check_dispatch_combine),
    "11.1": (("save_sharded", "load_sharded"), checks.check_sharded_checkpoint),
    "11.2": (("snapshot_state", "restore_state"), checks.check_resume),
    "11.3": (("checkpoint_interval",), checks.check_interval),
}


def solutions(exercise: str | None = None) -> list[Path]:
    folders = [ROOT / exercise] if exercise else sorted(p for p in ROOT.iterdir() if p.is_dir())
    return sorted(f for d in folders for f in d.glob("*.py") if not f.name.startswith("_"))


def verdict(path: Path) -> str:
    return "correct" if path.name.startswith("correct_") else "wrong"


def expected(path: Path) -> str | None:
    """The regex a wrong solution's failure must match: the words of its docstring's ``expect:``
    line, any spacing between them."""
    m = re.search(r"^expect:\s*(.+?)\s*$", path.read_text(), re.MULTILINE)
    return r"\s+".join(re.escape(w) for w in m.group(1).split()) if m else None


def load(path: Path):
    """The solution as a module, sent to the ranks by value (as a notebook's cell is)."""
    name = f"corpus_{path.parent.name.replace('.', '_')}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)
    return module


def run(exercise: str, path: Path) -> None:
    """Call the exercise's check on the solution in ``path``; raise what the check raises."""
    names, check = EXERCISES[exercise]
    module = load(path)
    check(*(getattr(module, n) for n in names))


if __name__ == "__main__":
    import os

    os.environ.setdefault("COURSE_SIZE", "ci")
    run(sys.argv[1], Path(sys.argv[2]))
