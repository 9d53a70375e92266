"""``make gpu-check`` (scripts/gpu_check.py): its dry run on the CPU, its time limits, its budget,
what comes back from a lent machine, and the wheels that machine lacks."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import pid_alive

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_check", mod)
    spec.loader.exec_module(mod)
    return mod


gc = _module()


# ---------------------------------------------------------------- steps used by the runner tests


def quick_step(out: Path) -> dict:
    return {"summary": "quick"}


def hang_step(out: Path) -> dict:
    """Writes what it has so far, starts a process in its own session (as a Jupyter kernel does),
    and never returns."""
    (out / "steps" / "hang.json").write_text(json.dumps({"summary": "3 of 9 done"}))
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    )
    (out / "hang.pid").write_text(str(child.pid))
    time.sleep(600)


def failing_step(out: Path) -> dict:
    raise RuntimeError("this step is broken on purpose")


def problem_step(out: Path) -> dict:
    return {"summary": "ran", "problems": ["2 of 11 notebooks failed"]}


def _runner(tmp_path, steps, groups, budget=60.0, **kw):
    args = SimpleNamespace(budget=budget, dry=True, wheels=None, bundle=kw.get("bundle"),
                           notebooks=None, scale=1.0)  # fmt: skip
    return gc.Runner(tmp_path / "out", args, steps=steps, groups=groups)


def test_a_hung_step_is_stopped_at_its_limit_with_everything_it_started(tmp_path):
    steps = [
        gc.Step("hang", 3, "tests.test_gpu_check:hang_step", "hangs"),
        gc.Step("after", 60, "tests.test_gpu_check:quick_step", "runs after it"),
    ]
    runner = _runner(tmp_path, steps, [["hang"], ["after"]])
    t0 = time.perf_counter()
    report = runner.run()
    assert time.perf_counter() - t0 < 30
    hang = report["steps"]["hang"]
    assert hang["status"].startswith("timed out after 3 s")
    assert hang["summary"] == "cut off; so far: 3 of 9 done"  # what it wrote before the limit
    pid = int((tmp_path / "out" / "hang.pid").read_text())
    deadline = time.monotonic() + 5
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(pid), "a process the hung step started in its own session survived"
    assert report["steps"]["after"]["status"] == "ok"
    on_disk = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert on_disk["steps"]["hang"]["status"] == hang["status"]
    assert "| hang | timed out after 3 s |" in (tmp_path / "out" / "gpu_check.md").read_text()


def test_the_budget_shortens_a_step_and_skips_the_rest(tmp_path):
    steps = [
        gc.Step("first", 60, "tests.test_gpu_check:quick_step", "quick"),
        gc.Step("hang", 60, "tests.test_gpu_check:hang_step", "hangs"),
        gc.Step("last", 60, "tests.test_gpu_check:quick_step", "never reached"),
    ]
    runner = _runner(tmp_path, steps, [["first"], ["hang"], ["last"]], budget=8)
    t0 = time.perf_counter()
    report = runner.run()
    assert time.perf_counter() - t0 < 20
    assert report["steps"]["first"]["status"] == "ok"
    assert report["steps"]["hang"]["status"].startswith("timed out")  # given what was left
    assert report["steps"]["last"]["status"] == "skipped: the budget was spent"


def test_a_failing_step_and_a_step_with_problems_are_reported_with_their_reasons(tmp_path):
    steps = [
        gc.Step("broken", 30, "tests.test_gpu_check:failing_step", "raises"),
        gc.Step("problems", 30, "tests.test_gpu_check:problem_step", "finds problems"),
    ]
    report = _runner(tmp_path, steps, [["broken", "problems"]]).run()  # side by side
    broken = report["steps"]["broken"]
    assert broken["status"] == "failed: exit 1"
    assert "this step is broken on purpose" in broken["log"]  # the end of its log, in the report
    assert report["steps"]["problems"]["status"] == "problems: 2 of 11 notebooks failed"
    md = (tmp_path / "out" / "gpu_check.md").read_text()
    assert md.startswith("# dry run on the CPU of ") and "problems in broken, problems" in md


def test_the_bundle_is_what_comes_back_from_a_lent_machine(tmp_path):
    """At most 8 files, two folders down, plain names; the archive holds the rest."""
    out = tmp_path / "out"
    (out / "notebooks").mkdir(parents=True)
    (out / "notebooks" / "01_single_gpu.ipynb").write_text("{}")
    (out / "steps").mkdir()
    (out / "steps" / "big.json").write_bytes(b"x" * (9 << 20))  # over the per-file cap: left out
    (out / "gpu_check.json").write_text("{}")
    (out / "gpu_check.md").write_text("# report")
    gc.bundle(out, tmp_path / "back")
    files = sorted(p.name for p in (tmp_path / "back").iterdir())
    assert files == ["gpu_check.json", "gpu_check.md", "gpu_check.tar.gz"]
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files)
    with tarfile.open(tmp_path / "back" / "gpu_check.tar.gz") as tar:
        assert tar.getnames() == ["notebooks/01_single_gpu.ipynb"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dry_run_does_every_step_on_the_cpu(tmp_path):
    """``make gpu-check DRY=1``: the GPU run's steps on the CPU at the ci size, so that the script
    cannot rot between the rare sessions that have a GPU."""
    out, back = tmp_path / "out", tmp_path / "back"
    env = {k: v for k, v in os.environ.items() if k not in ("COURSE_RUNS_DIR",)}
    venv = REPO / ".venv"
    if (venv / ".setup-stamp").exists() and Path(sys.prefix).resolve() == venv.resolve():
        cmd = [
            "make",
            "-s",
            "gpu-check",
            "DRY=1",
            f"GPU_CHECK_OUT={out}",
        ]  # as CI and people run it
        env["GPU_CHECK_BUNDLE"] = str(back)
    else:  # another environment (the floor's): the script itself
        cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--dry", "--bundle", str(back)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=REPO)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert seconds < 180, f"the dry run took {seconds:.0f} s; it must stay under 3 minutes"
    r = json.loads((out / "gpu_check.json").read_text())
    assert list(r["steps"]) == [s.name for s in gc.STEPS]
    assert all(s["status"] == "ok" for s in r["steps"].values()), r["steps"]
    s = r["steps"]
    assert s["versions"]["sharing"] is False and s["versions"]["packages"]["nbclient"]
    assert s["tests"]["failed"] == 0 and s["tests"]["skipped"] >= 1  # cuda tests skip here
    [nb] = s["notebooks"]["notebooks"]
    assert nb["notebook"] == "02_data_parallel" and nb["status"] == "ok"
    executed = json.loads((out / "notebooks" / "02_data_parallel.ipynb").read_text())
    assert any(c.get("outputs") for c in executed["cells"] if c["cell_type"] == "code")
    configs = [row["config"] for row in s["throughput"]["rows"]]
    assert configs == ["fp32", "fp32 + channels_last", "bf16 autocast", "bf16 + channels_last"]
    assert all(row["images_per_s"] > 0 for row in s["throughput"]["rows"])
    mem = s["memory"]  # 16Ψ plus Adam's float32 step counter per parameter tensor
    assert mem["adam_states"] == 16 * mem["psi"] + 4 * mem["adam_tensors"]
    assert s["memory"]["layer_saved"] == s["memory"]["layer_formula"]
    assert [row["rank"] for row in s["trace"]["ours"]] == [0, 1]
    assert "no GPU kernels" in s["trace"]["hta"]
    assert s["ddp"]["result"]["throughput_ratio"] > 0
    assert [row["t"] for row in s["tp"]["result"]["rows"]] == [1, 2]
    assert {row["method"] for row in s["zero"]["result"]["rows"]} >= {"zero1", "zero2", "zero3"}
    md = (out / "gpu_check.md").read_text()
    assert md.startswith("# dry run on the CPU of ") and "every step passed" in md
    for name in ("notebooks", "throughput", "memory", "trace", "ddp", "tp", "zero"):
        assert f"\n## {name}\n" in md
    files = sorted(p.name for p in back.iterdir())
    assert files == ["gpu_check.json", "gpu_check.log", "gpu_check.md", "gpu_check.tar.gz"]
    with tarfile.open(back / "gpu_check.tar.gz") as tar:
        names = tar.getnames()
    assert "notebooks/02_data_parallel.ipynb" in names and "steps/zero.json" in names
    assert any(n.startswith("traces/rank0.") for n in names)


# ---------------------------------------------------------------- the wheels a lent machine lacks


def _wheel_pins() -> dict[str, str]:
    text = (REPO / "scripts" / "gpu_wheels.sh").read_text()
    block = text.split("WHEELS=(", 1)[1].split("\n)", 1)[0]
    pins = re.findall(r"([A-Za-z0-9_.-]+)==([^\s]+)", block)
    return {_norm(name): version for name, version in pins}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imports(source: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


NOT_ON_THE_GPU_RUN = {
    "nbconvert": "HTML copies (make course); the GPU check writes executed .ipynb only",
}


def test_the_machine_image_and_the_wheels_cover_every_import_of_the_course():
    """Every package the course, its notebooks and the GPU check import is in the lent machine's
    image or among the wheels that travel, each wheel once and at the version requirements.txt
    pins (where it pins one)."""
    modules = set()
    sources = [*(REPO / "course_utils").rglob("*.py"), SCRIPT, REPO / "conftest.py",
               REPO / "tests" / "conftest.py", REPO / "tests" / "test_cuda.py"]  # fmt: skip
    for path in sources:
        modules |= _imports(path.read_text())
    for nb in (REPO / "notebooks").glob("*.ipynb"):
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] == "code":
                code = "".join(cell["source"])
                code = "\n".join(
                    line for line in code.splitlines() if not line.lstrip().startswith(("%", "!"))
                )
                modules |= _imports(code)
    modules -= set(sys.stdlib_module_names) | {"course_utils", "tests", "gpu_check"}
    dists = importlib.metadata.packages_distributions()
    image = {_norm(n) for n in gc.DEVICE_IMAGE}
    wheels = _wheel_pins()
    missing = []
    for mod in sorted(modules):
        names = {_norm(d) for d in dists.get(mod, [mod])}
        if not names & (image | set(wheels)) and mod not in NOT_ON_THE_GPU_RUN:
            missing.append(f"{mod} ({', '.join(sorted(names))})")
    assert not missing, f"imported by the course but neither in the image nor a wheel: {missing}"
    assert not set(wheels) & image, "a wheel the image already has would shadow its version"
    pinned = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        m = re.match(r"([A-Za-z0-9_.-]+)==(\S+)", line)
        if m:
            pinned[_norm(m.group(1))] = m.group(2)
    wrong = {n: (v, pinned[n]) for n, v in wheels.items() if n in pinned and pinned[n] != v}
    assert not wrong, f"wheels at another version than requirements.txt pins: {wrong}"


def _pypi_unreachable(output: str) -> bool:
    return any(s in output for s in ("Name or service not known", "Failed to establish a new "
                                     "connection", "Network is unreachable", "Temporary failure"))  # fmt: skip


@pytest.mark.slow
def test_the_wheels_script_fetches_installable_wheels_under_the_limit(tmp_path):
    """scripts/gpu_wheels.sh fetches one wheel per pin for Python 3.12 on x86-64, under the size
    that may travel, and pip installs them the way the check does (--no-index --no-deps
    --target), for that Python."""
    whl = tmp_path / "whl"
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_wheels.sh"), str(whl)],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHON=sys.executable))  # fmt: skip
    if proc.returncode and _pypi_unreachable(proc.stdout + proc.stderr):
        pytest.skip("PyPI cannot be reached from here: the wheels cannot be fetched")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheels = sorted(whl.glob("*.whl"))
    assert len(wheels) == len(_wheel_pins())
    assert sum(w.stat().st_size for w in wheels) < 56 << 20
    assert all(re.search(r"-(py3|py2\.py3|cp312|cp3\d+-abi3)-", w.name) for w in wheels), wheels
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
         "--no-compile", "--target", str(site), "--python-version", "3.12",
         "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64",
         "--platform", "manylinux_2_17_x86_64", *map(str, wheels)],
        check=True, timeout=300,
    )  # fmt: skip
    for pkg in ("nbclient", "ipykernel", "hta", "msgspec", "zmq", "nbval", "plotly"):
        assert (site / pkg).is_dir(), f"{pkg} was not installed from the wheels"
