"""``python -m course_utils bench launch``: what a student waits for per launch.

Times the same trivial 4-rank all_reduce job four ways, alternating the order
each round so that machine noise hits all of them alike:

- ``launch`` (first): the first :func:`course_utils.launch` call in a fresh
  process that already imported torch, as in a notebook's first launch;
- ``launch`` (later): later calls in that same process, as every further
  launch in a notebook;
- raw ``torch.multiprocessing.spawn`` of the same job, also timed inside a
  process that already imported torch;
- ``torchrun --standalone``: the whole command, as a terminal user runs it.

Prints the median of each and its ratio to raw spawn.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import provenance

SCRIPT = Path(__file__).with_name("allreduce_script.py")

LAUNCH_CODE = """
import json, sys, time, torch
from course_utils import launch
n, later = int(sys.argv[1]), int(sys.argv[2])
times = []
for _ in range(1 + later):
    t0 = time.perf_counter()
    launch("course_utils.launcher.demo:all_reduce_once", n, echo=False)
    times.append(time.perf_counter() - t0)
print(json.dumps(times))
"""

SPAWN_CODE = """
import json, socket, sys, time, torch
import torch.multiprocessing as mp
from course_utils.bench.allreduce_script import spawn_rank
n = int(sys.argv[1])
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
t0 = time.perf_counter()
mp.spawn(spawn_rank, args=(n, f"tcp://127.0.0.1:{port}"), nprocs=n, join=True)
print(json.dumps([time.perf_counter() - t0]))
"""


def _py(code: str, *args, env) -> list[float]:
    out = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"benchmark child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _torchrun(n: int, env) -> float:
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    cmd = (
        [exe, "--standalone", f"--nproc-per-node={n}", str(SCRIPT)]
        if exe
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={n}",
            str(SCRIPT),
        ]
    )
    t0 = time.perf_counter()
    subprocess.run(cmd, capture_output=True, timeout=600, env=env, check=True)
    return time.perf_counter() - t0


def run(world_size: int = 4, rounds: int = 5, later: int = 5) -> dict:
    """Time every path ``rounds`` times; return raw samples and medians (seconds)."""
    tmp = tempfile.mkdtemp(prefix="bench-launch-")
    env = {**os.environ, "COURSE_RUNS_DIR": tmp}
    samples: dict[str, list[float]] = {
        "launch_first": [],
        "launch_later": [],
        "spawn": [],
        "torchrun": [],
    }
    order = ["launch", "spawn", "torchrun"]
    for i in range(rounds):
        for mode in order[i % 3 :] + order[: i % 3]:
            if mode == "launch":
                t = _py(LAUNCH_CODE, world_size, later, env=env)
                samples["launch_first"].append(t[0])
                samples["launch_later"] += t[1:]
            elif mode == "spawn":
                samples["spawn"] += _py(SPAWN_CODE, world_size, env=env)
            else:
                samples["torchrun"].append(_torchrun(world_size, env))
        print(f"round {i + 1}/{rounds} done", file=sys.stderr)
    shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "world_size": world_size,
        "rounds": rounds,
        "samples": samples,
        "median": med,
        **provenance(),
    }


def table(result: dict) -> str:
    med, s = result["median"], result["samples"]
    base = med["spawn"]
    rows = [
        ("launch, first call in a fresh process", "launch_first", "<= 1.1"),
        ("launch, later call in the same process", "launch_later", "<= 0.3"),
        ("raw torch.multiprocessing.spawn", "spawn", "1 (reference)"),
        ("torchrun --standalone (whole command)", "torchrun", "-"),
    ]
    out = [
        f"{result['world_size']}-rank all_reduce job, {result['rounds']} alternating rounds, "
        f"{result['machine']}, {result['date']}",
        "| path | median s | min-max s | / raw spawn | target |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for label, key, target in rows:
        out.append(
            f"| {label} | {med[key]:.2f} | {min(s[key]):.2f}-{max(s[key]):.2f} | "
            f"{med[key] / base:.2f}x | {target} |"
        )
    return "\n".join(out)
