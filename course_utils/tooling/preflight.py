"""The instructor's pre-flight: is this node ready for the session? One report, read in a minute.

    make preflight SIZE=gpu                 # on the node the students will use
    slurm_templates/submit preflight        # on a compute node, as a batch job

It runs, on the node it is started on:

1. ``doctor``: versions, GPUs and whether torch can use them, interconnect, data, the size;
2. a real ``all_reduce`` on every backend the node has (gloo always, NCCL/RCCL on GPUs), its sum
   checked;
3. the collective benchmark (``bench collectives``) on the ranks a notebook would start;
4. every notebook, top to bottom, at the size the students will use (as ``make course``).

and writes ``preflight.md`` (for people) and ``preflight.json`` (for scripts) into ``--out``, with
the executed notebooks beside them. The verdict is PASS only if every check and notebook passed.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from datetime import datetime, timezone
from pathlib import Path

from ..bench import collectives
from ..sizes import default_size_name, get_size
from . import course, doctor


def _collectives(world_size: int) -> dict:

    t0 = time.perf_counter()
    try:
        report = collectives.run(
            world_size=world_size,
            max_bytes=get_size().max_message_bytes,
            ops=("all_reduce", "all_gather", "reduce_scatter"),
            iters=5,
            echo=False,
            timeout=600,
        )
        status = "ok" if report["rows"] else "no sizes ran"
    except Exception as e:  # a broken backend is what the pre-flight is for: report it
        report, status = {"rows": [], "unsupported": {}}, f"failed: {type(e).__name__}: {e}"
    report["status"] = status
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def run(out: str | Path, size: str, only: list[str] | None = None, timeout: int = 1800) -> dict:
    """Run every step; write the report; return it as a dict."""
    os.environ["COURSE_SIZE"] = size  # the kernels and ranks inherit it

    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print(f"pre-flight of {socket.gethostname()} at size '{size}', writing {out}", flush=True)

    print("  doctor and all_reduce on every backend ...", flush=True)
    info = doctor.collect(run_checks=True)
    gpu = info["gpu_check"]
    checks = {"gpu": "ok" if (gpu["vendor"] is None or gpu["usable"]) else gpu["problem"]}
    if size == "gpu" and not (gpu["vendor"] and gpu["usable"]):
        checks["gpu"] = "the students' size is 'gpu' but this node has no GPU torch can use"
    for backend, result in info["checks"].items():
        checks[f"all_reduce ({backend}, {result['world_size']} ranks)"] = result["all_reduce"]

    report = {
        "verdict": "INCOMPLETE",
        "host": socket.gethostname(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "size": size,
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
        "seconds": 0.0,
        "versions": {
            k: info[k]
            for k in ("python", "torch", "torchvision", "cuda_runtime", "hip_runtime", "nccl")
        },
        "hardware": {
            "platform": platform.platform(),
            "cpu_cores": info["cpu_cores"],
            "cpu": info["cpu"]["described"],
            "placement": info["placement"],
            "compile": info.get("compile", {}),
            "gpus": info["gpus"],
            "interconnect": info["interconnect"],
        },
        "data": info["data"],
        "data_dir": info["data_dir"],
        "checks": checks,
        "collectives": {"rows": [], "status": "not run yet"},
        "notebooks": [],
    }

    def save() -> None:
        """Write the report as it stands: a job cut off by its time limit still leaves one."""
        report["seconds"] = round(time.perf_counter() - started, 1)
        (out / "preflight.json").write_text(json.dumps(report, indent=1, default=str))
        (out / "preflight.md").write_text(render(report))

    save()
    world = get_size().world_size  # placed as the notebooks' ranks are (shared GPUs included)
    print(f"  collective benchmark on {world} ranks ...", flush=True)
    bench = _collectives(world)
    checks[f"collective benchmark ({world} ranks, {bench.get('backend', '?')})"] = bench["status"]
    report["collectives"] = bench
    save()

    for nb in course.find_notebooks(only=only):
        print(f"  notebook {nb.stem} ...", flush=True)
        status, seconds, error = course.execute(nb, out / "notebooks", timeout)
        report["notebooks"].append(
            {"notebook": nb.stem, "status": status, "seconds": round(seconds, 1), "error": error}
        )
        print(f"    {status} in {seconds:.0f} s", flush=True)
        save()
    passed = all(v == "ok" for v in checks.values()) and all(
        n["status"] == "ok" for n in report["notebooks"]
    )
    report["verdict"] = "PASS" if passed else "FAIL"
    save()
    print(render(report))
    return report


def _mem(gpu: dict) -> str:
    mem = gpu.get("memory_gib") or gpu.get("memory")
    return f", {mem} GiB" if isinstance(mem, (int, float)) else ""


def render(r: dict) -> str:
    """The Markdown report: verdict first, then what failed, then the details."""
    v, hw = r["versions"], r["hardware"]
    gpus = hw["gpus"]
    lines = [
        f"# Pre-flight of {r['host']}: {r['verdict']}",
        "",
        f"{r['date']}, size `{r['size']}`"
        + (f", SLURM job {r['slurm_job']}" if r["slurm_job"] else "")
        + f", {r['seconds']:.0f} s in all.",
        "",
    ]
    failed = [k for k, s in r["checks"].items() if s != "ok"]
    failed += [f"notebook {n['notebook']}" for n in r["notebooks"] if n["status"] != "ok"]
    if r["verdict"] == "INCOMPLETE":
        lines += ["**Still running, or cut off** (a time limit?): what ran so far is below.", ""]
    if failed:
        lines += ["**Failed:** " + "; ".join(failed), ""]
    elif r["verdict"] == "PASS":
        lines += ["Everything passed.", ""]
    lines += [
        "## Machine",
        "",
        f"- Python {v['python']}, torch {v['torch']}, torchvision {v['torchvision']}"
        + (f", CUDA {v['cuda_runtime']}" if v["cuda_runtime"] else "")
        + (f", HIP {v['hip_runtime']}" if v["hip_runtime"] else "")
        + (f", NCCL {v['nccl']}" if v["nccl"] else ""),
        f"- CPU cores: {hw.get('cpu', hw['cpu_cores'])}; "
        + (
            ", ".join(f"{g.get('name', 'GPU')}{_mem(g)}" for g in gpus)
            if gpus
            else "no GPU (CPU ranks with gloo)"
        ),
        f"- {hw['platform']}",
        *(f"- ranks: {line}" for line in hw.get("placement", {}).values()),
        *(
            [
                "- torch.compile (notebook 01 falls back to eager mode where it fails): "
                + ", ".join(f"{d} {s}" for d, s in hw["compile"].items())
            ]
            if hw.get("compile")
            else []
        ),
        "- data: "
        + ", ".join(f"{k} {s}" for k, s in r["data"].items())
        + f" (under {r['data_dir']})",
        "",
        "## Checks",
        "",
        "| check | result |",
        "| --- | --- |",
    ]
    lines += [f"| {k} | {s} |" for k, s in r["checks"].items()]
    rows = [x for x in r["collectives"]["rows"] if x["op"] == "all_reduce"]
    if rows:
        big = max(rows, key=lambda x: x["bytes"])
        lines += [
            "",
            f"all_reduce of {big['bytes'] / 2**20:.1f} MiB on {r['collectives']['world_size']} "
            f"ranks: {big['time_us'] / 1e3:.2f} ms, bus bandwidth {big['busbw_GBps']:.2f} GB/s.",
        ]
    lines += ["", "## Notebooks", "", "| notebook | result | seconds |", "| --- | --- | ---: |"]
    for n in r["notebooks"]:
        result = n["status"] + (f": {n['error']}" if n["error"] else "")
        lines.append(f"| {n['notebook']} | {result} | {n['seconds']:.0f} |")
    total = sum(n["seconds"] for n in r["notebooks"])
    lines += ["", f"Notebooks in all: {total / 60:.1f} min.", ""]
    return "\n".join(lines)


def main(out: str, size: str | None, only: list[str] | None, timeout: int) -> int:

    report = run(out, size or default_size_name(), only, timeout)
    return 0 if report["verdict"] == "PASS" else 1
