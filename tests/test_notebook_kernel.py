"""The notebook path for real: a Jupyter kernel whose cell defines a worker and an nn.Module."""

from __future__ import annotations

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = [pytest.mark.notebook, pytest.mark.multiprocess]

CELLS = [
    "import torch, torch.distributed as dist\nfrom torch import nn\nfrom course_utils import launch",
    """class Doubler(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.full((3,), 2.0))
    def forward(self, x):
        return self.w * x

def worker(ctx, steps=2):
    model = Doubler().to(ctx.device)
    x = torch.ones(3, device=ctx.device) * (ctx.rank + 1)
    for _ in range(steps):
        y = model(x)
        dist.all_reduce(y)
    print("rank", ctx.rank, "sum", y.sum().item())
    return {"sum": y.sum().item(), "cls": type(model).__name__}""",
    "res = launch(worker, world_size=2, steps=3)\nres.results",
    "assert res.results[1] == {'sum': 18.0, 'cls': 'Doubler'}, res.results\nassert res.run_dir.exists()",
]


def test_cell_defined_worker_and_module_run_as_ranks(runs_root, tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in CELLS]
    NotebookClient(
        nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    launch_out = "".join(
        o.get("text", "") for o in nb.cells[2].outputs if o.output_type == "stream"
    )
    assert "[rank 0] rank 0 sum 18.0" in launch_out and "[rank 1] rank 1 sum 18.0" in launch_out


def test_every_notebook_names_the_course_kernel_and_it_is_this_environment():
    """A student who opens a notebook lands in the course's environment without choosing a kernel.

    On a JupyterHub the default 'python3' kernel is the hub's own environment, without torch.
    """
    import os
    import sys
    from pathlib import Path

    from jupyter_client.kernelspec import KernelSpecManager

    names = {}
    for path in sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb")):
        names[path.name] = nbformat.read(path, as_version=4).metadata["kernelspec"]["name"]
    assert set(names.values()) == {"distributed-course"}, names
    spec = KernelSpecManager().get_kernel_spec("distributed-course")
    assert os.path.realpath(spec.argv[0]) == os.path.realpath(sys.executable), (
        f"the course kernel runs {spec.argv[0]}, not this environment's {sys.executable}: "
        "run `make setup`"
    )


QUIET = [
    "import torch, torch.distributed as dist\nfrom course_utils import launch",
    """def fails(ctx):
    def helper():
        raise ValueError("boom on purpose")
    if ctx.rank == 1:
        helper()
launch(fails, 2)""",
    """def hangs(ctx):
    t = torch.ones(2, device=ctx.device)
    if ctx.rank == 0:
        dist.all_reduce(t)
    else:
        dist.recv(t, src=0)
launch(hangs, 2, timeout=5)""",
]
INTERNALS = ("supervise.py", "api.py", "rank.py", "connection.py", "selectors.py", "threading.py")


def test_rank_errors_show_the_worker_not_the_launcher(runs_root, tmp_path):
    import re

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in QUIET]
    NotebookClient(
        nb,
        timeout=180,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(tmp_path)}},
    ).execute()
    for cell, name, own in (
        (nb.cells[1], "RankFailedError", "in helper"),
        (nb.cells[2], "RankTimeoutError", "in hangs"),
    ):
        (err,) = [o for o in cell.outputs if o.output_type == "error"]
        text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(err.traceback))
        assert err.ename == name and text.startswith(name), text[:300]
        assert own in text, text  # the worker's own frame
        for internal in INTERNALS:
            assert internal not in text, f"{internal} shown in {name}:\n{text}"


def test_an_interrupt_shows_launch_notice_not_its_internals(runs_root, tmp_path):
    """Kernel -> Interrupt during a launch: every rank stops, the cell shows one line."""
    import asyncio
    import re
    import time

    from tests.conftest import wait_dead

    pids = tmp_path / "pids"
    pids.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            f"import os, time\nfrom course_utils import launch\nPIDS = {str(pids)!r}"
        ),
        nbformat.v4.new_code_cell(
            """def sleeper(ctx):
    pid_file = os.path.join(PIDS, f"rank{ctx.rank}.pid")
    with open(pid_file + ".tmp", "w") as f:  # written whole, then renamed: the test never
        f.write(str(os.getpid()))  # reads a file the interrupt caught half written
    os.replace(pid_file + ".tmp", pid_file)
    time.sleep(300)
launch(sleeper, 2)"""
        ),
    ]
    client = NotebookClient(
        nb,
        timeout=240,  # per cell; pytest's own 300 s bounds the whole test
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(tmp_path)}},
    )

    async def run_and_interrupt() -> list[int]:
        async with client.async_setup_kernel():
            await client.async_execute_cell(nb.cells[0], 0)
            cell = asyncio.ensure_future(client.async_execute_cell(nb.cells[1], 1))
            deadline = time.monotonic() + 180  # two ranks import torch: slow on 2 busy cores
            while len(list(pids.glob("rank*.pid"))) < 2:  # both ranks are in their sleep
                assert not cell.done() and time.monotonic() < deadline, "the ranks never started"
                await asyncio.sleep(0.2)
            await client.km.interrupt_kernel()  # what Kernel -> Interrupt sends
            await asyncio.wait_for(cell, 30)  # launch stops the ranks in seconds
        return [int(p.read_text()) for p in pids.glob("rank*.pid")]

    client.reset_execution_trackers()
    ranks = asyncio.run(run_and_interrupt())
    outputs = nb.cells[1].outputs
    (err,) = [o for o in outputs if o.output_type == "error"]
    text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(err.traceback))
    assert text.startswith("KeyboardInterrupt: launch was interrupted; all 2 ranks were stopped")
    assert "\n" not in text, f"more than launch's one line:\n{text}"
    for internal in (*INTERNALS, "Traceback"):
        assert internal not in text, f"{internal} shown after the interrupt:\n{text}"
    stderr = "".join(o.get("text", "") for o in outputs if o.get("name") == "stderr")
    assert "launch: interrupted; all 2 ranks were stopped" in stderr, stderr
    assert wait_dead(ranks, within=10) == [], "a rank outlived the interrupt"
