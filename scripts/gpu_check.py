#!/usr/bin/env python3
"""The course on a real GPU in one prepared run: ``make gpu-check``.

    python scripts/gpu_check.py --out build/gpu-check                 # a GPU node with the venv
    python3 scripts/gpu_check.py --out /tmp/gc --wheels .whl --bundle "$OUT"
                                                                      # a lent machine (no Jupyter)
    python scripts/gpu_check.py --out DIR --dry                       # the same steps, CPU, ci size

GPUs are lent rarely and briefly (about 15 minutes, start-up included, one command of at most 10),
so everything a GPU can teach us is measured in one command. Each step runs in its own process
group with its own time limit: a hang costs that step's limit, never the run. The report,
``gpu_check.json`` and ``gpu_check.md`` in ``--out``, is rewritten after every step, so a run cut
off still leaves what it measured. The steps, their limits and what each took on one H100 with 16
cores on 2026-11-26 (benchmarks/RESULTS.md; torch 2.11, whose NCCL cannot share the GPU):

==========  =====  ======  ==================================================================
step        limit  H100    what
==========  =====  ======  ==================================================================
wheels      60 s   3 s     ``--wheels DIR``: ``pip install --no-index --no-deps --target`` (the
                           machine's image has no Jupyter; ``scripts/gpu_wheels.sh`` fetches them)
versions    30 s   14 s    GPU, driver, CUDA, torch, NCCL, whether ranks can share the GPU (NCCL
                           >= 2.30), compute capability against ``torch.cuda.get_arch_list()``
tests       120 s  39 s    the cuda-marked tests; with sharing, the multi-rank parity tests too
notebooks   270 s  ~260 s  every notebook at the ``ci`` size (nbclient), 4 at a time, each on 4
                           cores; executed copies kept; status, time and first error of each
throughput  60 s   34 s    notebook 01's table: fp32, channels_last, bf16 autocast, both, then
                           ``torch.compile`` (the ``gpu`` size, interleaved rounds, quartiles)
memory      30 s   10 s    the CUDA allocator against the formulas: 01's 16Ψ with Adam, 06's
                           activations of one layer (Korthikanti et al., Table 2)
trace       30 s   16 s    a profiled DDP run: the course's breakdown and HTA's side by side
zero        90 s   > 60 s  ``bench zero`` at a small size, the allocator beside the ZeRO formula
ddp         50 s   36 s    from-scratch ``BucketedDDP`` against torch DDP on NCCL, alternating
tp          30 s   17 s    ``bench tp`` at a small size (ratio where two ranks fit on the GPUs)
==========  =====  ======  ==================================================================

The tests run beside the notebooks; the other steps one at a time, so that the timed figures have
the GPU and the cores to themselves. About 490 s in all; ``--budget`` (default 540 s, 9 minutes)
caps the run: a step gets ``min(limit, what is left)`` and is skipped, and said so, when too
little is left. ``--only STEP ...`` and ``--notebooks 01 05 ...`` rerun a part; ``--scale`` gives
a slower machine longer limits. ``--dry`` runs the same steps on the CPU at the ``ci`` size (one
notebook, fewer rounds), in about a minute on 2 cores: CI runs it so that this script cannot rot.

Where ranks cannot share the GPU (NCCL older than 2.30, such as torch 2.11's 2.28), multi-rank
work runs as CPU processes, as it would for a student with that torch; the report says so, and
the GPU figures that need ranks run with one rank on the GPU instead.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
KERNEL = "distributed-course"  # the kernel every notebook names

# Seconds each notebook took at the ci size on 2 CPU cores (README): the longest start first.
NOTEBOOK_WEIGHT = {"07": 98, "03b": 79, "08": 62, "03": 57, "05": 47, "04": 34, "09": 34,
                   "06": 33, "11": 42, "10": 29, "01": 21, "02": 19}  # fmt: skip
DRY_NOTEBOOKS = ["02"]
_IMAGE = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio
h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-ml-py onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pyre-extensions
pygments pyparsing pyproject-hooks pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp"""
DEVICE_IMAGE = _IMAGE.split()
"""Python packages of the lent machines' image ('cuda', as the device tool's KINDS.md lists them,
read 2026-11-17): Python 3.12, torch 2.11.0+cu130. What the course needs beyond these travels as
wheels (scripts/gpu_wheels.sh); tests/test_gpu_check.py checks that the two cover every import."""
NOTEBOOK_LIMIT = 200  # seconds for one notebook, whatever the step has left
LANE_CORES = 4


@dataclass(frozen=True)
class Step:
    name: str
    limit: float
    """Seconds this step may take on one H100 (its share of the 9 minutes)."""
    target: str
    """A step function here (``"versions"``) or an importable ``"module:function"``."""
    what: str


STEPS = [
    Step("versions", 30, "versions", "GPU, driver, CUDA, torch, NCCL, sharing, architectures"),
    Step("tests", 120, "tests", "cuda-marked tests (and multi-rank tests where ranks share)"),
    Step("notebooks", 270, "notebooks", "every notebook at the ci size"),
    Step("throughput", 60, "throughput", "notebook 01's throughput table"),
    Step("memory", 30, "memory", "CUDA allocator against the formulas (01, 06)"),
    Step("trace", 30, "trace", "a DDP step's trace: the course's analysis and HTA"),
    Step("zero", 90, "zero", "bench zero at a small size, allocator against the formula"),
    Step("ddp", 50, "ddp", "from-scratch DDP against torch DDP"),
    Step("tp", 30, "tp", "bench tp at a small size"),
]
GROUPS = [["versions"], ["tests", "notebooks"], ["throughput"], ["memory"], ["trace"], ["zero"],
          ["ddp"], ["tp"]]  # fmt: skip
"""Steps in one group run at the same time (tests beside the notebooks); groups run in turn, so
that the timed figures have the GPU and the cores to themselves."""


# ------------------------------------------------------------------ the runner (stdlib only)


def _tree(pid: int) -> list[int]:
    """``pid`` and every live process below it, read from /proc (children first found last)."""
    parent_of = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent_of[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = [pid], [pid]
    while frontier:
        kids = [c for c, p in parent_of.items() if p in frontier]
        found += kids
        frontier = kids
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """Stop ``proc``, its process group and every process below it (a Jupyter kernel starts its
    own session, and its ranks theirs): the tree is read before anything is killed, so that no
    orphan escapes by being re-parented."""
    pids = _tree(proc.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(timeout=5)


def run_limited(cmd, limit: float, log: Path, env=None, cores=None, cwd=REPO) -> tuple[str, float]:
    """Run ``cmd`` in its own session, output to ``log``; ``("ok" | "failed: exit N" | "timed out",
    seconds)``. At the limit the whole process tree is killed."""
    t0 = time.perf_counter()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
        )
        if cores:  # pinned before the interpreter has started anything: its children inherit it
            with contextlib.suppress(OSError):
                os.sched_setaffinity(proc.pid, cores)
        try:
            rc = proc.wait(timeout=max(limit, 1))
            status = "ok" if rc == 0 else f"failed: exit {rc}"
        except subprocess.TimeoutExpired:
            status = f"timed out after {limit:.0f} s"
        finally:
            kill_tree(proc)  # also what a step left running on success
    return status, time.perf_counter() - t0


def tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Runner:
    """Runs the steps against a budget and keeps the report on disk as it goes."""

    def __init__(self, out: Path, args, steps=STEPS, groups=GROUPS):
        self.out, self.args = out, args
        self.steps = {s.name: s for s in steps}
        self.groups = groups
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + args.budget
        for sub in ("steps", "logs", "notebooks", "runs", "jupyter"):
            (out / sub).mkdir(parents=True, exist_ok=True)
        self.env = self._env()
        self.report = {
            "kind": "dry run on the CPU" if args.dry else "GPU check",
            "host": socket.gethostname(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "budget_s": args.budget,
            "seconds": 0.0,
            "steps": {},
        }
        self.lock = threading.Lock()

    def _env(self) -> dict:
        env = dict(os.environ)
        paths = [str(REPO)]
        if self.args.wheels:
            paths.insert(0, str(self.out / "site"))
        env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
        spec = self.out / "jupyter" / "kernels" / KERNEL
        spec.mkdir(parents=True, exist_ok=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Distributed training course (gpu_check)", "language": "python",
        }))  # fmt: skip
        env["JUPYTER_PATH"] = os.pathsep.join(
            [str(self.out / "jupyter")] + [p for p in [env.get("JUPYTER_PATH")] if p]
        )
        env["JUPYTER_RUNTIME_DIR"] = str(self.out / "jupyter" / "runtime")
        env["IPYTHONDIR"] = str(self.out / "jupyter" / "ipython")
        env["MPLCONFIGDIR"] = str(self.out / "jupyter" / "matplotlib")
        env["MPLBACKEND"] = "Agg"
        env["COURSE_RUNS_DIR"] = str(self.out / "runs")
        env["COURSE_SIZE"] = "ci"  # the notebooks and tests; the figures pick their own sizes
        env["PYTHONUNBUFFERED"] = "1"
        env["GPU_CHECK_CONFIG"] = str(self.out / "config.json")
        return env

    def say(self, line: str) -> None:
        stamp = f"[{time.perf_counter() - self.t0:5.0f} s] {line}"
        print(stamp, flush=True)
        with open(self.out / "gpu_check.log", "a") as f:
            f.write(stamp + "\n")

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def config(self, **extra) -> dict:
        path = self.out / "config.json"
        cfg = json.loads(path.read_text()) if path.exists() else {}
        cfg.update(extra)
        path.write_text(json.dumps(cfg, indent=1))
        return cfg

    def install_wheels(self) -> None:
        wheels = sorted(Path(self.args.wheels).glob("*.whl"))
        log = self.out / "logs" / "wheels.log"
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
               "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(self.out / "site"),
               *map(str, wheels)]  # fmt: skip
        self.say(f"installing {len(wheels)} wheels from {self.args.wheels} ...")
        status, secs = run_limited(cmd, min(60, self.left()), log) if wheels else ("no wheels", 0)
        self.record("wheels", {"status": status if wheels else f"failed: no *.whl in {self.args.wheels}",
                               "seconds": round(secs, 1), "limit": 60, "log": tail(log),
                               "summary": f"{len(wheels)} wheels"})  # fmt: skip

    def record(self, name: str, entry: dict) -> None:
        with self.lock:
            steps = {**self.report["steps"], name: entry}
            order = ["wheels", *self.steps]  # steps side by side finish in any order
            self.report["steps"] = {n: steps[n] for n in order if n in steps}
            self.save()

    def run_step(self, step: Step) -> None:
        limit = min(step.limit * self.args.scale, self.left())
        if limit < min(5, step.limit * self.args.scale):  # too little left to be worth starting
            self.record(step.name, {"status": "skipped: the budget was spent", "seconds": 0,
                                    "limit": step.limit, "what": step.what})  # fmt: skip
            self.say(f"{step.name}: skipped, the budget was spent")
            return
        self.say(f"{step.name}: {step.what} (limit {limit:.0f} s) ...")
        result = self.out / "steps" / f"{step.name}.json"
        result.unlink(missing_ok=True)
        log = self.out / "logs" / f"{step.name}.log"
        cmd = [sys.executable, str(SCRIPT), "--_step", step.target, "--_name", step.name,
               "--out", str(self.out)]  # fmt: skip
        status, secs = run_limited(cmd, limit, log, env=self.env)
        data = {}
        if result.exists():
            with contextlib.suppress(ValueError):
                data = json.loads(result.read_text())
        if status == "ok" and data.get("problems"):
            status = "problems: " + "; ".join(data["problems"])
        elif status != "ok" and data:
            data["summary"] = f"cut off; so far: {data.get('summary', '')}"
        entry = {"status": status, "seconds": round(secs, 1), "limit": step.limit,
                 "what": step.what, **data}  # fmt: skip
        if not status.startswith("ok"):
            entry["log"] = tail(log)
        self.record(step.name, entry)
        self.say(
            f"{step.name}: {status} in {secs:.0f} s"
            + (f" ({data['summary']})" if data.get("summary") else "")
        )

    def run(self, only: list[str] | None = None) -> dict:
        only = None if not only else ["versions", *only]  # later steps need what it finds
        self.report["planned"] = (["wheels"] if self.args.wheels else []) + [
            n for group in self.groups for n in group if not only or n in only
        ]
        if self.args.wheels:
            self.install_wheels()
        cores = sorted(os.sched_getaffinity(0))
        # the notebooks in lanes of LANE_CORES cores each (every lane a notebook at a time, its
        # ranks splitting the lane's cores); the tests beside them, unpinned: they mostly wait
        # for CUDA and NCCL to start
        self.config(dry=self.args.dry, cores=len(cores), scale=self.args.scale,
                    notebooks=self.args.notebooks or (DRY_NOTEBOOKS if self.args.dry else None),
                    lanes=max(1, len(cores) // LANE_CORES))  # fmt: skip
        for group in self.groups:
            group = [n for n in group if not only or n in only]
            threads = [threading.Thread(target=self.run_step, args=(self.steps[n],)) for n in group]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if group == ["versions"]:
                v = self.report["steps"]["versions"]
                self.config(sharing=bool(v.get("sharing")), gpu=bool(v.get("gpu")))
        self.report["seconds"] = round(time.perf_counter() - self.t0, 1)
        self.save()
        return self.report

    def save(self) -> None:
        self.report["seconds"] = round(time.perf_counter() - self.t0, 1)
        (self.out / "gpu_check.json").write_text(json.dumps(self.report, indent=1, default=str))
        (self.out / "gpu_check.md").write_text(render(self.report))
        if self.args.bundle:
            bundle(self.out, Path(self.args.bundle))


def bundle(out: Path, dest: Path, max_file: int = 8 << 20) -> None:
    """What comes back from a lent machine (at most 8 files): the report, the log, and one archive
    of everything else (executed notebooks, step results, logs, traces), files over ``max_file``
    left out."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("gpu_check.json", "gpu_check.md", "gpu_check.log"):
        if (out / name).exists():
            shutil.copy(out / name, dest / name)
    tmp = dest / "gpu_check.tar.gz.part"
    with tarfile.open(tmp, "w:gz", compresslevel=6) as tar:
        for sub in ("steps", "logs", "notebooks", "traces", "tests.xml"):
            path = out / sub
            if not path.exists():
                continue
            for f in sorted([path] if path.is_file() else path.rglob("*")):
                if f.is_file() and f.stat().st_size <= max_file:
                    tar.add(f, arcname=str(f.relative_to(out)))
    tmp.replace(dest / "gpu_check.tar.gz")


# ------------------------------------------------------------------ the report


def render(r: dict) -> str:
    steps = r["steps"]
    bad = [n for n, s in steps.items() if not str(s.get("status", "")).startswith("ok")]
    v = steps.get("versions", {})
    planned = r.get("planned") or [s.name for s in STEPS]
    done = all(n in steps for n in planned)
    lines = [f"# {r['kind']} of {r['host']}: " + (f"problems in {', '.join(bad)}" if bad else
             "every step passed" if done else "running, or cut off"),
             "", f"{r['date']}, {r['seconds']:.0f} s of a {r['budget_s']:.0f} s budget. "
             f"Command: `{r['command']}`", ""]  # fmt: skip
    if v.get("lines"):
        lines += ["## Machine", "", *(f"- {x}" for x in v["lines"]), ""]
    lines += ["## Steps", "", "| step | status | seconds | limit | result |",
              "| --- | --- | ---: | ---: | --- |"]  # fmt: skip
    for name, s in steps.items():
        status = str(s.get("status", "")).replace("|", "/").replace("\n", " ")
        lines.append(f"| {name} | {status} | {s.get('seconds', 0):.0f} | {s.get('limit', 0):.0f} | "
                     f"{s.get('summary', '')} |")  # fmt: skip
    for name, s in steps.items():
        if s.get("markdown") and name != "versions":
            lines += ["", f"## {name}", "", s["markdown"]]
        if s.get("log") and not str(s.get("status", "")).startswith("ok"):
            lines += ["", f"{name}: the end of its log", "", "```", s["log"], "```"]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ steps (run in child processes)


def _cfg() -> dict:
    path = os.environ.get("GPU_CHECK_CONFIG")
    return json.loads(Path(path).read_text()) if path and Path(path).exists() else {}


def _md_table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def step_versions(out: Path) -> dict:
    import torch

    from course_utils.launcher.placement import SHARING_NCCL, nccl_version, place_ranks

    gpu = torch.cuda.is_available()
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if gpu else None,
        "gpu": gpu,
        "cores": len(os.sched_getaffinity(0)),
    }
    with contextlib.suppress(ImportError):
        import torchvision

        info["torchvision"] = torchvision.__version__
    lines = [f"Python {info['python']}, torch {info['torch']}, CUDA {info['cuda']}, cuDNN "
             f"{info['cudnn']}, {info['cores']} cores"]  # fmt: skip
    problems = []
    if gpu:
        props = torch.cuda.get_device_properties(0)
        cap = torch.cuda.get_device_capability(0)
        arch = torch.cuda.get_arch_list()
        sm = f"sm_{cap[0]}{cap[1]}"
        ptx = [a for a in arch if a.startswith("compute_") and int(a[8:]) <= cap[0] * 10 + cap[1]]
        cubin = [a for a in arch if a.startswith("sm_") and a[3:].isdigit()
                 and int(a[3:]) // 10 == cap[0] and int(a[3:]) <= cap[0] * 10 + cap[1]]  # fmt: skip
        info.update(
            gpu_name=props.name, gpus=torch.cuda.device_count(),
            memory_gib=round(props.total_memory / 2**30, 1), capability=f"{cap[0]}.{cap[1]}",
            arch_list=arch, kernels_for_this_gpu=bool(cubin or ptx),
        )  # fmt: skip
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            )  # fmt: skip
            info["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, IndexError):
            info["driver"] = None
        nccl = nccl_version()
        info["nccl"] = ".".join(map(str, nccl)) if nccl else None
        info["sharing"] = bool(nccl and nccl >= SHARING_NCCL and not torch.version.hip)
        where = (
            "machine code for it" if cubin else "PTX only, compiled at first use" if ptx else "none"
        )
        lines += [
            f"{info['gpus']} x {props.name}, {info['memory_gib']} GiB, compute capability "
            f"{info['capability']}, driver {info['driver']}",
            f"torch's kernels for {sm}: {where} (arch list: {' '.join(arch)})",
            f"NCCL {info['nccl']}: "
            + ("ranks can share one GPU (>= 2.30)" if info["sharing"] else
               "ranks cannot share one GPU (that needs NCCL >= 2.30): multi-rank notebooks and "
               "tests run as CPU processes here, as for a student with this torch; the figures "
               "that need ranks put one rank on the GPU"),
        ]  # fmt: skip
        if not (cubin or ptx):
            problems.append(f"torch has no kernels for {sm}")
    else:
        info["sharing"] = False
        lines.append("no CUDA GPU visible: every step runs on the CPU")
    info["placement"] = {n: place_ranks(n).describe() for n in (1, 2, 4, 8)}
    lines += [f"launch of {n}: {d}" for n, d in info["placement"].items()]
    packages = {}
    for name in ("nbclient", "ipykernel", "hta", "msgspec", "numpy", "matplotlib", "cloudpickle"):
        try:
            mod = importlib.import_module(name)
            packages[name] = getattr(mod, "__version__", "installed")
        except ImportError as e:
            packages[name] = f"missing ({e})"
            problems.append(f"{name} cannot be imported")
    info["packages"] = packages
    lines.append("packages: " + ", ".join(f"{k} {v}" for k, v in packages.items()))
    summary = (f"{info.get('gpu_name', 'no GPU')}, torch {info['torch']}, NCCL {info.get('nccl')}, "
               f"sharing {'yes' if info['sharing'] else 'no'}")  # fmt: skip
    return {**info, "lines": lines, "summary": summary, "problems": problems}


def step_tests(out: Path) -> dict:
    import xml.etree.ElementTree as ET

    cfg = _cfg()
    files = ["tests/test_cuda.py"]
    marks = "cuda and not notebook"  # notebooks 03 and 04 on a shared GPU: the notebooks step
    if cfg.get("sharing") and not cfg.get("dry"):
        files += ["tests/test_ddp_parity.py", "tests/test_tensor_parallel.py", "tests/test_zero.py",
                  "tests/test_pipeline.py", "tests/test_context_parallel.py",
                  "tests/test_expert_parallel.py", "tests/test_parallel3d.py"]  # fmt: skip
        marks = "(cuda and not notebook) or (multiprocess and not slow)"
    xml = out / "tests.xml"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
    cmd = [sys.executable, "-m", "pytest", *files, "-m", marks, "-q", "-p", "no:cacheprovider",
           f"--junitxml={xml}", "--timeout=200", "-o", "addopts="]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    (out / "logs" / "tests.pytest.log").write_text(proc.stdout + proc.stderr)
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures, skips = [], set()
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                counts["failed"] += 1
                failures.append(f"{name}: {(bad.get('message') or '').splitlines()[0][:200]}")
            elif case.find("skipped") is not None:
                counts["skipped"] += 1
                skips.add((case.find("skipped").get("message") or "")[:160])
            else:
                counts["passed"] += 1
    summary = ", ".join(f"{v} {k}" for k, v in counts.items())
    md = [f'`pytest {" ".join(files)} -m "{marks}"`: {summary}.']
    md += [f"- FAILED {f}" for f in failures] + [f"- skipped: {s}" for s in sorted(skips)]
    problems = [f"{counts['failed']} test(s) failed"] if counts["failed"] else []
    if proc.returncode not in (0, 5) and not counts["failed"]:
        problems.append(f"pytest exited {proc.returncode}: " + (proc.stdout + proc.stderr)[-300:])
    return {**counts, "failures": failures, "summary": summary, "markdown": "\n".join(md),
            "problems": problems}  # fmt: skip


def step_notebooks(out: Path) -> dict:
    from course_utils.tooling.course import find_notebooks, notebook_number

    cfg = _cfg()
    notebooks = find_notebooks(REPO / "notebooks", only=cfg.get("notebooks"))
    cores = sorted(os.sched_getaffinity(0))
    lanes = max(1, min(cfg.get("lanes", 1), len(notebooks)))
    per = max(1, len(cores) // lanes)
    rows: dict[str, dict] = {}
    lock = threading.Lock()
    queue = sorted(notebooks, key=lambda p: -NOTEBOOK_WEIGHT.get(notebook_number(p.name), 60))

    def report() -> dict:
        """The step's result as it stands; written after every notebook, so that a step cut off
        at its limit still reports the notebooks that finished (and which did not)."""
        ordered = [rows.get(p.stem) or {"notebook": p.stem, "status": "not finished",
                                        "seconds": 0, "error": "the step's limit came first"}
                   for p in notebooks]  # fmt: skip
        ok = sum(r["status"] == "ok" for r in ordered)
        table = _md_table(["notebook", "status", "seconds", "first error"],
                          [[r["notebook"], r["status"], f"{r['seconds']:.0f}",
                            r["error"].replace("|", "/")] for r in ordered])  # fmt: skip
        md = (f"Every notebook top to bottom at the `ci` size, {lanes} at a time ({per} cores "
              f"each); executed copies in `notebooks/`.\n\n{table}")  # fmt: skip
        problems = [f"{r['notebook']}: {r['error'] or r['status']}" for r in ordered
                    if r["status"] != "ok"]  # fmt: skip
        return {"notebooks": ordered, "summary": f"{ok} of {len(ordered)} ran", "markdown": md,
                "problems": problems}  # fmt: skip

    def lane(i: int):
        mine = cores[i * per : (i + 1) * per] if lanes > 1 else None
        while True:
            with lock:
                if not queue:
                    return
                nb = queue.pop(0)
            result = out / "notebooks" / f"{nb.stem}.result.json"
            progress = out / "notebooks" / f"{nb.stem}.progress"
            cmd = [sys.executable, str(SCRIPT), "--_notebook", str(nb), "--out", str(out)]
            limit = NOTEBOOK_LIMIT * cfg.get("scale", 1.0)
            status, secs = run_limited(cmd, limit, out / "logs" / f"{nb.stem}.log",
                                       env=dict(os.environ), cores=mine)  # fmt: skip
            row = {"notebook": nb.stem, "status": "FAILED", "seconds": round(secs, 1), "error": ""}
            if result.exists():
                row.update(json.loads(result.read_text()))
            if status != "ok" and not result.exists():
                cell = progress.read_text().strip() if progress.exists() else "?"
                row["error"] = f"{status} (in cell {cell})"
            with lock:
                rows[nb.stem] = row
                (out / "steps" / "notebooks.json").write_text(json.dumps(report(), indent=1))

    threads = [threading.Thread(target=lane, args=(i,)) for i in range(lanes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return report()


def run_notebook(path: Path, out: Path) -> None:
    """One notebook in a fresh kernel (its own process: the notebooks step can kill it)."""
    from course_utils.tooling.course import execute

    progress = out / "notebooks" / f"{path.stem}.progress"
    status, seconds, error = execute(
        path, out / "notebooks", timeout=int(NOTEBOOK_LIMIT * _cfg().get("scale", 1.0)), html=False,
        on_cell=lambda i: progress.write_text(str(i + 1)),
    )  # fmt: skip
    (out / "notebooks" / f"{path.stem}.result.json").write_text(json.dumps(
        {"notebook": path.stem, "status": status, "seconds": round(seconds, 1), "error": error}
    ))  # fmt: skip


def _device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def step_throughput(out: Path) -> dict:
    """Notebook 01's section 5 table, the same step functions, at the gpu size on a GPU."""
    import contextlib as cl
    import copy
    import time as _time
    from functools import partial

    import torch
    from torch import nn

    from course_utils.compiling import compile_or_eager
    from course_utils.measure import (
        allocated_memory,
        compare,
        peak_memory,
        reset_peak_memory,
        saved_activations,
        verdict,
    )
    from course_utils.models import SmallResNet
    from course_utils.precision import choose
    from course_utils.sizes import get_size

    dry = _cfg().get("dry")
    device = _device()
    size = get_size("ci" if dry else "gpu")
    torch.manual_seed(0)
    base = SmallResNet(num_classes=10, width=size.width).to(device)
    xb = torch.randn(size.batch_size, 3, 32, 32, device=device)
    yb = torch.randint(10, (size.batch_size,), device=device)
    loss_fn = nn.CrossEntropyLoss()
    amp = choose(device)

    def amp_step(model, opt, x, y, dtype=None, scaler=None):
        ctx = torch.autocast(device.type, dtype=dtype) if dtype else cl.nullcontext()
        with ctx:
            loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        return loss.detach()

    configs = [("fp32", None, False), ("fp32 + channels_last", None, True),
               (f"{amp.name} autocast", amp.dtype, False),
               (f"{amp.name} + channels_last", amp.dtype, True)]  # fmt: skip
    steps, extra = {}, {}
    for name, dtype, cl_ in configs:
        m, x = copy.deepcopy(base), xb
        if cl_:
            m, x = (
                m.to(memory_format=torch.channels_last),
                xb.contiguous(memory_format=torch.channels_last),
            )
        o = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        scaler = amp.grad_scaler() if dtype is not None and amp.needs_scaler else None
        autocast = torch.autocast(device.type, dtype=dtype) if dtype else cl.nullcontext()
        with autocast, saved_activations() as act:
            loss_fn(m(x), yb)
        reset_peak_memory(device)
        held = allocated_memory(device)  # the configurations built so far stay allocated
        amp_step(m, o, x, yb, dtype, scaler)
        peak = None if held is None else peak_memory(device) - held
        extra[name] = {"activations": act["bytes"], "peak": peak}
        steps[name] = partial(amp_step, m, o, x, yb, dtype, scaler)
    rounds, per = (2, 2) if dry else (5, 10)
    warm = 1 if dry else 3

    def result(timing, compile_note, compiled=None) -> dict:
        ref = timing["fp32"]
        rows, table = [], []
        for name, t in timing.items():
            said = verdict(t, ref)
            e = extra.get(name, {})
            rows.append({"config": name, "images_per_s": t.rate(size.batch_size),
                         "median_ms": t.median * 1e3, "q1_ms": t.q1 * 1e3, "q3_ms": t.q3 * 1e3,
                         "vs_fp32": ref.median / t.median,
                         "verdict": said if name != "fp32" else "-", **e})  # fmt: skip
            table.append([name, f"{t.rate(size.batch_size):,.0f}",
                          f"{t.median * 1e3:.2f} [{t.q1 * 1e3:.2f}, {t.q3 * 1e3:.2f}]",
                          f"{ref.median / t.median:.2f}x", rows[-1]["verdict"],
                          f"{e['activations'] / 2**20:.1f}" if e else "-",
                          f"{e['peak'] / 2**20:.0f}" if e.get("peak") else "-"])  # fmt: skip
        md = (f"SmallResNet(width={size.width}) on {device} ({_gpu_name()}), batch "
              f"{size.batch_size} of 3x32x32, SGD with momentum; `compare`: {rounds} interleaved "
              f"rounds of {per} timed steps each after {warm} warm-up; 16-bit type {amp.name} "
              f"({amp.reason}). A config is called faster or slower than fp32 only when the "
              "quartiles do not overlap; step peak: the most memory one step added above what was "
              "already allocated.\n\n"
              + _md_table(["config", "images/s", "step ms: median [quartiles]", "vs fp32",
                           "verdict", "activations MiB", "step peak MiB"], table))  # fmt: skip
        md += f"\n\ntorch.compile: {compile_note}"
        if compiled:
            e, c = compiled["eager"], compiled["compiled"]
            md += (f" In its own interleaved run, fp32 eager {e.median * 1e3:.2f} ms "
                   f"[{e.q1 * 1e3:.2f}, {e.q3 * 1e3:.2f}], compiled {c.median * 1e3:.2f} ms "
                   f"[{c.q1 * 1e3:.2f}, {c.q3 * 1e3:.2f}]: {e.median / c.median:.2f}x the "
                   "images/s.")  # fmt: skip
        best = max(rows, key=lambda r: r["images_per_s"])
        out = {"rows": rows, "compile": compile_note, "markdown": md,
               "summary": f"fastest: {best['config']}, {best['vs_fp32']:.2f}x fp32"}  # fmt: skip
        if compiled:
            out["compiled_vs_eager"] = compiled["eager"].median / compiled["compiled"].median
            out["summary"] += f"; compiled {out['compiled_vs_eager']:.2f}x eager"
        return out

    timing = compare(steps, rounds=rounds, per_round=per, warmup=warm, device=device)
    if not size.compile:
        return result(timing, "not tried at the ci size (size.compile is False).")
    # the eager table is kept before compiling: a compile that outlasts the step's limit loses
    # only the compiled row
    partial_out = result(timing, "compiling when this was written.")
    (out / "steps" / "throughput.json").write_text(json.dumps(partial_out, indent=1))
    mc = copy.deepcopy(base)
    oc = torch.optim.SGD(mc.parameters(), lr=0.05, momentum=0.9)
    t0 = _time.perf_counter()
    got = compile_or_eager(mc, lambda m: amp_step(m, oc, xb, yb))
    compile_s = _time.perf_counter() - t0
    if not got.compiled:
        return result(timing, f"failed here ({got.why_not}).")
    both = compare({"eager": steps["fp32"], "compiled": partial(amp_step, got.model, oc, xb, yb)},
                   rounds=rounds, per_round=per, warmup=warm, device=device)  # fmt: skip
    return result(timing, f"the first call (forward and backward) compiled in {compile_s:.1f} s.",
                  compiled=both)  # fmt: skip


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"


def step_memory(out: Path) -> dict:
    """The allocator's growth against the formulas: notebook 01's model states (16Ψ with Adam) and
    notebook 06's activations of one transformer layer (Table 2 + LayerNorm statistics)."""
    import torch
    from torch import nn

    from course_utils.measure import allocated_memory, saved_activations
    from course_utils.models import Block, GPTConfig, SmallResNet
    from course_utils.sizes import get_size
    from course_utils.tensor_parallel.measure import activation_bytes_per_layer, dropout_mask_bytes
    from course_utils.zero.memory import count_model_states

    device = _device()
    size = get_size("ci" if _cfg().get("dry") else "gpu")
    problems, rows = [], []

    def allocated() -> int | None:
        return allocated_memory(device)

    # The first convolution, matrix product and Adam step of a process can leave memory behind
    # (the libraries' workspaces: on the H100 run of 2026-11-26, measured without this warm-up,
    # the allocator grew 70 MB more than the model states): a throwaway model's step takes it
    # first, and it is reported apart.
    first = allocated()
    warm = SmallResNet(num_classes=10, width=size.width).to(device)
    x = torch.randn(8, 3, 32, 32, device=device)
    y = torch.randint(10, (8,), device=device)
    warm_adam = torch.optim.Adam(warm.parameters(), lr=1e-3)
    nn.functional.cross_entropy(warm(x), y).backward()
    warm_adam.step()
    del warm, warm_adam
    workspaces = None if first is None else allocated() - first
    # 01: build a model, one Adam step on a small batch (its activations are freed by backward)
    torch.manual_seed(0)
    before = allocated()
    m = SmallResNet(num_classes=10, width=size.width).to(device)
    params_alloc = None if before is None else allocated() - before
    adam = torch.optim.Adam(m.parameters(), lr=1e-3)
    nn.functional.cross_entropy(m(x), y).backward()
    adam.step()
    held = None if before is None else allocated() - before
    states = count_model_states(m, adam)
    adam_tensors = len(adam.state)
    psi = sum(p.numel() for p in m.parameters())
    na = "n/a (CPU)"
    rows.append(["01: what a throwaway model's first step left (library workspaces)", "-", "-",
                 na if workspaces is None else f"{workspaces:,}"])  # fmt: skip
    rows.append(["01: parameters after .to(device)", f"{4 * psi:,} (4Ψ)",
                 f"{states.bytes('parameters'):,}", na if params_alloc is None else f"{params_alloc:,}"])  # fmt: skip
    rows.append(["01: parameters + gradients + Adam after one step", f"{16 * psi:,} (16Ψ)",
                 f"{states.total:,}", na if held is None else f"{held:,}"])  # fmt: skip
    if held is not None and held < 16 * psi:
        problems.append(
            f"the allocator held {held:,} B after an Adam step, under 16Ψ = {16 * psi:,}"
        )
    del m, adam
    # 06: one transformer layer's forward, dropout on
    cfg = GPTConfig(vocab=128, seq_len=128, d_model=256, n_heads=4, n_layers=1, dropout=0.1)
    b = 4
    layer = Block(cfg).to(device)
    xl = torch.randn(b, cfg.seq_len, cfg.d_model, device=device)
    with torch.no_grad():
        layer(xl)  # CUDA libraries allocate their workspaces at first use
    before = allocated()
    with saved_activations() as act:
        out_t = layer(xl)
    grown = None if before is None else allocated() - before
    mask = dropout_mask_bytes(device)
    table2 = activation_bytes_per_layer(cfg.seq_len, b, cfg.d_model, cfg.n_heads, t=1, act_bytes=4,
                                        mask_bytes=mask)  # fmt: skip
    ln = 2 * 2 * cfg.seq_len * b * 4
    # the allocator's growth: what was saved, less the input (saved by the first LayerNorm, but
    # allocated before the forward), plus the output (kept by us, saved by nobody)
    io = xl.numel() * xl.element_size()
    output = out_t.numel() * out_t.element_size()
    expect = int(table2 + ln) - io + output
    rows.append([f"06: one layer's saved activations (h={cfg.d_model}, s={cfg.seq_len}, b={b}, "
                 f"dropout masks of {mask} B)", f"{int(table2 + ln):,} (Table 2 + LN stats)",
                 f"{act['bytes']:,}", na if grown is None else
                 f"{grown:,} (expected {expect:,}: less the input, plus the output)"])  # fmt: skip
    if act["bytes"] != int(table2 + ln):
        problems.append(f"06: saved {act['bytes']:,} B, formula {int(table2 + ln):,} B")
    result = {"psi": psi, "adam_states": states.total, "adam_tensors": adam_tensors,
              "adam_allocated": held, "workspaces_allocated": workspaces,
              "params_allocated": params_alloc, "layer_saved": act["bytes"],
              "layer_formula": int(table2 + ln), "layer_allocated": grown,
              "layer_allocated_expected": expect, "mask_bytes": mask}  # fmt: skip
    md = (f"On {device} ({_gpu_name()}). Counted: storage of the tensors themselves; allocator: "
          "`torch.cuda.memory_allocated` growth (blocks rounded up to 512 B).\n\n"
          + _md_table(["what", "formula B", "counted B", "CUDA allocator B"], rows))  # fmt: skip
    summary = ("allocator n/a on the CPU" if held is None else
               f"Adam step {held / (16 * psi):.3f}x of 16Ψ (workspaces {workspaces / 2**20:.1f} MiB "
               f"apart); layer {grown / expect:.3f}x of the formula")  # fmt: skip
    return {**result, "markdown": md, "summary": summary, "problems": problems}


def profiled_ddp_worker(ctx, steps: int = 6, width: int = 32, batch: int = 64):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from course_utils.models import SmallResNet

    torch.manual_seed(0)
    net = SmallResNet(width=width).to(ctx.device)
    ids = [ctx.device] if ctx.device.type == "cuda" else None
    model = DistributedDataParallel(net, device_ids=ids)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(batch, 3, 32, 32, device=ctx.device)
    y = torch.randint(10, (batch,), device=ctx.device)
    for _ in range(steps):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        ctx.step()


def _ranks() -> tuple[int, str]:
    """Ranks and device for the figures that need ranks: 2 sharing the GPU where NCCL can; one rank
    on the GPU where it cannot; 2 CPU ranks without a GPU."""
    cfg = _cfg()
    if cfg.get("gpu"):
        return (2, "cuda") if cfg.get("sharing") else (1, "cuda")
    return 2, "cpu"


def step_trace(out: Path) -> dict:
    from course_utils import launch
    from course_utils.profiling import ProfileConfig
    from course_utils.profiling.analysis import analyse
    from course_utils.profiling.hta import summary as hta_summary
    from course_utils.profiling.trace import load_traces

    world, device = _ranks()
    res = launch(profiled_ddp_worker, world, device=device,
                 profile=ProfileConfig(wait=1, warmup=1, active=3, tensorboard=False),
                 echo=False, progress=False)  # fmt: skip
    keep = out / "traces"
    keep.mkdir(exist_ok=True)
    for rank, path in res.traces.items():
        shutil.copy(path, keep / f"rank{rank}.{Path(path).name.split('.', 1)[1]}")
    traces = load_traces(res.traces)
    a = analyse(traces)
    ours = a.per_rank()
    problems = []
    gpu = {r: t.has_gpu for r, t in traces.items()}
    if device == "cuda" and not all(gpu.values()):
        problems.append("a GPU rank's trace holds no CUDA kernels")
    hta = hta_summary(res.traces)
    rows = [[r["rank"], f"{r['step_ms']:.2f}", f"{r['compute']:.2f}", f"{r['memory']:.2f}",
             f"{r['communication']:.2f}", f"{r['comm_total']:.2f}", f"{r['data']:.2f}",
             f"{r['optimizer']:.2f}", f"{r['idle']:.2f}", f"{r['overlap']:.0%}"] for r in ours]  # fmt: skip
    md = [f"torch DDP, SmallResNet(width=32), batch 64, {world} rank(s) on {res.device} with "
          f"{res.backend}; 3 profiled steps; the traces are in `traces/`.", "",
          "The course's breakdown (`profiling.analysis`, ms per step, mean over steps):", "",
          _md_table(["rank", "step", "compute", "memory", "comm exposed", "comm total", "data",
                     "optimizer", "idle", "hidden"], rows),
          ""]  # fmt: skip
    result = {"world_size": world, "device": res.device, "backend": res.backend, "ours": ours,
              "has_gpu": gpu}  # fmt: skip
    if "why" in hta:
        md.append(f"HTA: {hta['why']}")
        result["hta"] = hta["why"]
        if device == "cuda":
            problems.append(f"HTA: {hta['why']}")
    else:
        temporal = hta["temporal"].to_dict("records")
        overlap = hta["overlap"].to_dict("records")
        result["hta"] = {"temporal": temporal, "overlap": overlap}
        md += ["HTA's temporal breakdown (GPU time) and communication/computation overlap:", "",
               "```", hta["temporal"].to_string(), "", hta["overlap"].to_string(), "```"]  # fmt: skip
    return {**result, "markdown": "\n".join(md), "problems": problems,
            "summary": f"{world} rank(s) on {res.device}; HTA " + ("ran" if "why" not in hta else "did not run")}  # fmt: skip


def step_ddp(out: Path) -> dict:
    from course_utils.bench import ddp

    dry = _cfg().get("dry")
    world, device = _ranks()
    r = ddp.run(world, rounds=1 if dry else 3, device=device, steps=3 if dry else 20,
                warmup=1 if dry else 5)  # fmt: skip
    return {"result": r, "markdown": ddp.table(r),
            "summary": f"ours / torch throughput {r['throughput_ratio']:.2f}x on {world} {r['backend']} rank(s)"}  # fmt: skip


def step_tp(out: Path) -> dict:
    from course_utils.bench import tp

    cfg = _cfg()
    dry = cfg.get("dry")
    sizes = [1, 2] if (cfg.get("sharing") or not cfg.get("gpu")) else [1]
    r = tp.run(sizes, rounds=1 if dry else 3, device="auto", steps=2 if dry else 10,
               warmup=1 if dry else 3)  # fmt: skip
    ratios = {row["t"]: row["ratio"] for row in r["rows"] if row["ratio"]}
    md = tp.table(r)
    if sizes == [1]:
        md += (
            "\n\nNo ratio: it needs two ranks on the GPU, and this NCCL cannot put two ranks on "
            "one GPU. The t = 1 row is the layer on the GPU, its activations against Table 2."
        )
    summary = ", ".join(f"t={t}: {q:.2f}x" for t, q in ratios.items()) or "t=1 only"
    return {"result": r, "markdown": md, "summary": summary}


def step_zero(out: Path) -> dict:
    from course_utils.bench import zero

    cfg = _cfg()
    dry = cfg.get("dry")
    world, _ = _ranks()
    # one round at one rank: its step times are not what this step is for (each launch starts
    # CUDA and NCCL, about 4 s on the H100 machine: two rounds of 7 methods outran 60 s)
    rounds = 1 if dry or world == 1 else 2
    r = zero.run([world], rounds=rounds, steps=2 if dry else 6, warmup=1 if dry else 2)
    q = zero.ratio(r, world)
    md = zero.table(r)
    if world == 1:
        md += (
            "\n\nOne rank: every method holds the whole 16Ψ (n = 1 in the formulas), and there "
            "is no ZeRO-3/FSDP2 ratio worth reading; what this shows is each method's step and "
            "the allocator against the formula on the GPU."
        )
    return {"result": r, "markdown": md,
            "summary": f"n={world}" + (f", ZeRO-3 / FSDP2 throughput {q:.2f}x" if q else "")}  # fmt: skip


def run_step_child(target: str, name: str, out: Path) -> int:
    """In the step's own process: run it, write what it returned to ``steps/NAME.json``."""
    if ":" in target:
        mod, fn = target.split(":")
        func = getattr(importlib.import_module(mod), fn)
    else:
        func = globals()[f"step_{target}"]
    data = func(out)
    (out / "steps" / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the report and everything it keeps")
    p.add_argument("--dry", action="store_true", help="the same steps on the CPU at the ci size")
    p.add_argument("--budget", type=float, default=540, help="seconds for the whole run")
    p.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply every step's limit (a slower machine; a rehearsal on 2 cores)",
    )
    p.add_argument("--wheels", default=None, help="a folder of wheels to install first (--target)")
    p.add_argument(
        "--bundle",
        default=os.environ.get("GPU_CHECK_BUNDLE"),
        help="also copy the report and one archive here (a lent machine's $OUT)",
    )
    p.add_argument("--only", nargs="*", default=None, help="run only these steps")
    p.add_argument("--notebooks", nargs="*", default=None, help="notebook prefixes (default: all)")
    p.add_argument("--_step", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_name", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_notebook", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    if args._step:
        return run_step_child(args._step, args._name or args._step, out)
    if args._notebook:
        run_notebook(Path(args._notebook), out)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("gpu_check.log", "config.json"):
        (out / stale).unlink(missing_ok=True)
    runner = Runner(out, args)
    report = runner.run(args.only)
    print(render(report))
    bad = [n for n, s in report["steps"].items() if not str(s["status"]).startswith("ok")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
