"""Command line: ``python -m course_utils {doctor,data,bench,course}``.

python -m course_utils doctor [--json]
python -m course_utils data download --root DIR [--datasets cifar10 fashionmnist]
python -m course_utils bench launch --world-size 4 [--rounds 5]
python -m course_utils bench tp [--world-sizes 1 2 4] [--rounds 5] [--json]
python -m course_utils bench zero [--world-sizes 2 4] [--rounds 3] [--json]
python -m course_utils bench modelled [--json]
python -m course_utils bench cp [--world-sizes 2 4] [--rounds 3] [--json]
python -m course_utils bench moe [--world-sizes 2 4] [--rounds 3] [--json]
python -m course_utils bench ckpt [--world-sizes 1 2 4] [--rounds 5] [--mb 24] [--dir DIR] [--json]
python -m course_utils course --out build [--size ci|cpu|gpu] [--only 01]
python -m course_utils preflight --out DIR [--size gpu] [--only 01 03]
python -m course_utils copies --kind student|answers --out build/student
python -m course_utils workspace --dir work [--kind student|answers]
"""

import argparse
import contextlib
import functools
import json
import sys
from collections.abc import Callable


def _report(args, run: Callable[[], dict], table: Callable[[dict], str], *, quiet=True) -> None:
    """Run a benchmark and print its result: the JSON with ``--json``, else its table.

    With ``quiet`` and ``--json``, stdout carries only the JSON: the notices printed while the
    benchmark runs (launch's, for one) go to stderr."""
    with contextlib.redirect_stdout(sys.stderr if quiet and args.json else sys.stdout):
        result = run()
    print(json.dumps(result, indent=2) if args.json else table(result))


def _launch_args(b: argparse.ArgumentParser) -> None:
    b.add_argument("--world-size", type=int, default=4)
    b.add_argument("--rounds", type=int, default=5)
    b.add_argument("--later", type=int, default=5, help="later launches timed per fresh process")
    b.add_argument("--json", action="store_true")


def _launch_run(args) -> None:
    from .bench import launch as bench_launch

    run = functools.partial(bench_launch.run, args.world_size, args.rounds, args.later)
    _report(args, run, bench_launch.table, quiet=False)


def _collectives_args(c: argparse.ArgumentParser) -> None:
    c.add_argument("--world-size", type=int, default=2)
    c.add_argument(
        "--max-bytes", type=int, default=None, help="largest message (default: size preset's)"
    )
    c.add_argument("--iters", type=int, default=10)
    c.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    c.add_argument("--json", action="store_true")


def _collectives_run(args) -> None:
    from .bench import collectives

    run = functools.partial(
        collectives.run,
        args.world_size,
        args.max_bytes,
        iters=args.iters,
        backend=args.backend,
        echo=False,
    )
    _report(args, run, collectives.table)


def _ddp_args(dd: argparse.ArgumentParser) -> None:
    dd.add_argument("--world-size", type=int, default=2)
    dd.add_argument("--rounds", type=int, default=5)
    dd.add_argument("--json", action="store_true")


def _ddp_run(args) -> None:
    from .bench import ddp as bench_ddp

    _report(args, functools.partial(bench_ddp.run, args.world_size, args.rounds), bench_ddp.table)


def _pipeline_args(pp: argparse.ArgumentParser) -> None:
    pp.add_argument("--stages", type=int, default=2)
    pp.add_argument("--global-batch", type=int, default=1024)
    pp.add_argument("--rounds", type=int, default=5)
    pp.add_argument("--json", action="store_true")


def _pipeline_run(args) -> None:
    from .bench import pipeline as bench_pipeline

    run = functools.partial(bench_pipeline.run, args.stages, args.global_batch, rounds=args.rounds)
    _report(args, run, bench_pipeline.table)


def _world_sizes_args(default: list[int], metavar: str, rounds: int):
    """The arguments of the benchmarks that sweep world sizes (tp, zero, cp, moe)."""

    def add_arguments(b: argparse.ArgumentParser) -> None:
        b.add_argument("--world-sizes", type=int, nargs="+", default=default, metavar=metavar)
        b.add_argument("--rounds", type=int, default=rounds)
        b.add_argument("--json", action="store_true")

    return add_arguments


def _tp_run(args) -> None:
    from .bench import tp as bench_tp

    _report(args, functools.partial(bench_tp.run, args.world_sizes, args.rounds), bench_tp.table)


def _zero_run(args) -> None:
    from .bench import zero as bench_zero

    run = functools.partial(bench_zero.run, args.world_sizes, args.rounds)
    _report(args, run, bench_zero.table)


def _cp_run(args) -> None:
    from .bench import cp as bench_cp

    _report(args, functools.partial(bench_cp.run, args.world_sizes, args.rounds), bench_cp.table)


def _moe_run(args) -> None:
    from .bench import moe as bench_moe

    run = functools.partial(bench_moe.run, args.world_sizes, args.rounds)
    _report(args, run, bench_moe.table)


def _threed_args(b3: argparse.ArgumentParser) -> None:
    b3.add_argument("--rounds", type=int, default=1)
    b3.add_argument(
        "--tflops", type=float, default=None,
        help="time under modelled compute at this many TFLOP/s per rank (communication real)",
    )  # fmt: skip
    b3.add_argument("--json", action="store_true")


def _threed_run(args) -> None:
    from .bench import threed as bench_3d

    _report(args, functools.partial(bench_3d.run, args.rounds, tflops=args.tflops), bench_3d.table)


def _modelled_args(bm: argparse.ArgumentParser) -> None:
    bm.add_argument("--json", action="store_true")


def _modelled_run(args) -> None:
    from .bench import modelled as bench_modelled

    _report(args, bench_modelled.run, bench_modelled.table)


def _ckpt_args(b: argparse.ArgumentParser) -> None:
    b.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4], metavar="P")
    b.add_argument("--rounds", type=int, default=5)
    b.add_argument("--mb", type=float, default=24.0, help="MB of state: parameters, Adam moments")
    b.add_argument("--dir", default=None, help="where the checkpoints go (removed afterwards)")
    b.add_argument("--steps-after", type=int, default=0, metavar="K",
                   help="training steps after each save in the stall rounds (0: as many as last "
                   "twice a synchronous save)")  # fmt: skip
    b.add_argument("--json", action="store_true")


def _ckpt_run(args) -> None:
    from .bench import ckpt as bench_ckpt

    run = functools.partial(
        bench_ckpt.run,
        args.world_sizes,
        args.rounds,
        mb=args.mb,
        folder=args.dir,
        steps_after=args.steps_after,
    )
    _report(args, run, bench_ckpt.table)


def _traces_args(t: argparse.ArgumentParser) -> None:
    t.add_argument("--ranks", type=int, default=8)
    t.add_argument("--mb", type=float, default=50.0, help="size of each trace")
    t.add_argument("--keep", default=None, help="folder to keep the generated traces in")
    t.add_argument("--json", action="store_true")


def _traces_run(args) -> None:
    from .bench import traces as bench_traces

    run = functools.partial(bench_traces.run, args.ranks, args.mb, args.keep)
    _report(args, run, bench_traces.table, quiet=False)


# name: (help, add_arguments, run); `bench --help` lists them in this order
BENCHES: dict[str, tuple[str, Callable, Callable]] = {
    "launch": ("launch overhead: launch vs raw spawn vs torchrun", _launch_args, _launch_run),
    "collectives": (
        "all_reduce, all_gather, ... : time, algbw, busbw per size",
        _collectives_args,
        _collectives_run,
    ),
    "ddp": ("from-scratch overlapped DDP vs torch DDP: step time and ratio", _ddp_args, _ddp_run),
    "pipeline": (
        "pipeline bubble vs theory, throughput vs m, 1F1B vs torch's",
        _pipeline_args,
        _pipeline_run,
    ),
    "tp": (
        "from-scratch TP layer vs torch DTensor TP: step time, ratio, activation memory",
        _world_sizes_args([1, 2, 4], "T", rounds=5),
        _tp_run,
    ),
    "zero": (
        "DDP, ZeRO-1/2/3 from scratch, ZeroRedundancyOptimizer, FSDP2: time, memory, bytes",
        _world_sizes_args([2, 4], "N", rounds=3),
        _zero_run,
    ),
    "3d": (
        "every dp x pp x tp layout of 8 ranks: measured step time and memory vs the planner",
        _threed_args,
        _threed_run,
    ),
    "modelled": (
        "bubble, overlap and straggler under modelled compute, against theory",
        _modelled_args,
        _modelled_run,
    ),
    "cp": (
        "ring attention (contiguous, zig-zag) and Ulysses: step time, values sent",
        _world_sizes_args([2, 4], "P", rounds=3),
        _cp_run,
    ),
    "moe": (
        "expert parallelism vs one process vs replicated experts: time, values, load",
        _world_sizes_args([2, 4], "N", rounds=3),
        _moe_run,
    ),
    "ckpt": (
        "sharded save/load MB/s per rank (course's, DCP), async_save's stall against a sync save",
        _ckpt_args,
        _ckpt_run,
    ),
    "traces": (
        "parse + analyse speed on 8 generated ~50 MB rank traces",
        _traces_args,
        _traces_run,
    ),
}


def _add_bench_commands(sub) -> None:
    """``bench <name>``: one subcommand per entry of ``BENCHES``."""
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench_cmd", required=True)
    for name, (help_, add_arguments, _) in BENCHES.items():
        add_arguments(bsub.add_parser(name, help=help_))


def _build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand, in the order ``--help`` lists them."""
    parser = argparse.ArgumentParser(
        prog="python -m course_utils", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("doctor", help="check this node: GPUs, interconnect, backends, data, size")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-checks", action="store_true", help="skip the all_reduce runs")

    p = sub.add_parser("data", help="stage datasets")
    dsub = p.add_subparsers(dest="data_cmd", required=True)
    d = dsub.add_parser(
        "download", help="download datasets into a folder (run on a node with internet)"
    )
    d.add_argument("--root", required=True, help="target folder; point COURSE_DATA_DIR at it")
    d.add_argument(
        "--datasets", nargs="*", default=None, help="cifar10 cifar100 fashionmnist (default: all)"
    )

    _add_bench_commands(sub)

    p = sub.add_parser(
        "preflight", help="instructor's check of a node: doctor, all_reduce, bench, notebooks"
    )
    p.add_argument(
        "--out", required=True, help="folder for preflight.md, preflight.json, notebooks"
    )
    p.add_argument("--size", default=None, choices=["ci", "cpu", "gpu"], help="the students' size")
    p.add_argument("--only", nargs="*", default=None, help="notebook name prefixes, e.g. 01 03")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per notebook cell")

    p = sub.add_parser("course", help="execute every notebook into build/ with a timing table")
    p.add_argument("--out", default="build")
    p.add_argument("--size", choices=["ci", "cpu", "gpu"], default=None)
    p.add_argument("--only", nargs="*", default=None, help="notebook prefixes, e.g. 01 03")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per cell")

    p = sub.add_parser(
        "copies", help="notebook copies without solutions (student) or with (answers)"
    )
    p.add_argument("--kind", choices=["student", "answers"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--src", default=None, help="folder of source notebooks (default: notebooks/)")

    p = sub.add_parser("workspace", help="create or refresh the working copies students open")
    p.add_argument("--dir", default="work")
    p.add_argument("--kind", choices=["student", "answers"], default="student")

    return parser


def _data_download(args) -> int:
    from .data import data_root, download

    status = download(args.root, args.datasets)
    for name, st in status.items():
        print(f"{name}: {st}")
    print(f"Point the course at it: export COURSE_DATA_DIR={data_root(args.root)}")
    return 0 if all(s == "ok" for s in status.values()) else 1


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.cmd == "doctor":
        from .tooling import doctor

        return doctor.main(as_json=args.json, run_checks=not args.no_checks)
    if args.cmd == "data":
        return _data_download(args)
    if args.cmd == "bench":
        BENCHES[args.bench_cmd][2](args)
        return 0
    if args.cmd == "preflight":
        from .tooling import preflight

        return preflight.main(args.out, args.size, args.only, args.timeout)
    if args.cmd == "course":
        from .tooling import course

        return course.main(args.out, args.size, args.only, args.timeout)
    if args.cmd == "workspace":
        from .tooling.workspace import prepare, report

        print(report(prepare(args.dir, args.kind)))
        print(
            f"Your notebooks are in {args.dir}/ (git ignores them; `make update` refreshes them)."
        )
        return 0
    if args.cmd == "copies":
        from .tooling.exercises import write_copies

        for path in write_copies(args.kind, args.out, args.src):
            print(path)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
