"""The entry point of one launched rank (runs in the child process).

Order of events in a rank, each step there for a reason:

1. ``os.setsid()``: the rank leads a process group (and session) of its own. Every process it
   starts (DataLoader workers, ``subprocess.Popen`` children, their children) joins that group
   unless it leaves on purpose, so the whole tree stops with one ``killpg`` (:mod:`.groups`).
2. stdout/stderr (the file descriptors, so C++ and NCCL output too) go to
   ``rank{r}.out`` / ``rank{r}.err`` in the run dir; the launcher tails them.
3. The launcher's environment, handed over in memory (it never lies on disk: a JupyterHub
   kernel's environment holds API tokens), plus the usual ``RANK`` / ``WORLD_SIZE`` /
   ``LOCAL_RANK`` / ``MASTER_ADDR`` variables. Rendezvous and backends listen on loopback only.
4. ``faulthandler`` answers SIGUSR1 with every thread's Python stack, so a hung collective can be
   shown. A watchdog thread blocks on a pipe whose other end only the launcher holds: when the
   launcher dies, even as an unreaped zombie, the pipe closes and the rank kills its group.
5. Child processes of the rank start with ``fork``. A rank inherits ``forkserver`` as its default
   start method from the process it was forked from; its first DataLoader would then start a
   forkserver of its own (another interpreter importing torch, seconds per rank), and every
   worker would be that server's child, watching the server instead of the rank. Worse for a
   notebook: a Dataset class defined in a cell reaches forkserver and spawn workers only by
   reference to ``__main__``, which they cannot import. With ``fork`` the workers are the rank's
   own children, start in milliseconds and receive the Dataset as it is. They never touch CUDA, and
   torch sets one thread in each, which keeps OpenMP safe after the fork. A rank that needs CUDA
   in a subprocess of its own asks for ``multiprocessing.get_context("spawn")``.
6. Threads: ``torch.set_num_threads(cores // ranks_on_node)``.
7. The process group is initialised from a FileStore in the run dir. With
   ``init_process_group=False``, rank 0 serves a TCPStore on ``127.0.0.1:MASTER_PORT`` from a
   socket the launcher bound in advance, so a worker's own ``env://`` rendezvous finds it there
   instead of opening a port on every interface.
8. The worker runs; its return value (or its exception) is written atomically.
9. Whatever the rank started and left running is killed (:func:`.groups.kill_rest_of_my_group`).
10. The group launch created is destroyed; one the worker created itself is left to ``os._exit``
    (destroying it hung now and then on torch 2.6 with gloo). Rank 0, when it serves the store of
    such a group, waits until every rank is this far (``rank{r}.closed``) before its exit takes the
    store away.
11. ``os._exit``: gloo threads still alive after ``destroy_process_group`` can
    abort a normally ending interpreter (SIGABRT, "terminate called without an
    active exception"); the result is already on disk, so nothing is lost.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import cloudpickle
import torch
import torch.distributed as dist

from .context import RankContext, StatusFile
from .devicecheck import check_devices
from .groups import kill_rest_of_my_group
from .profiler import RankProfiler
from .spec import resolve_ref

PAYLOAD = "payload.pkl"
STORE = "rendezvous"


def result_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"rank{rank}.result.pkl"


def closed_path(run_dir: Path, rank: int) -> Path:
    """Written once the rank's result is saved and its process group is done with."""
    return Path(run_dir) / f"rank{rank}.closed"


def _outlive_the_others(run_dir: Path, world_size: int, timeout_s: float = 60.0) -> None:
    """Rank 0 serves the TCPStore of a worker's own ``env://`` group: it waits, before its exit
    takes the store away, until every rank has saved its result and is about to exit. Bounded:
    the launcher stops a stuck rank anyway."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(closed_path(run_dir, r).exists() for r in range(world_size)):
            return
        time.sleep(0.05)


def log_path(run_dir: Path, rank: int, stream: str = "out") -> Path:
    return Path(run_dir) / f"rank{rank}.{stream}"


def stacks_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"rank{rank}.stacks.txt"


def _redirect_output(run_dir: Path, rank: int) -> None:
    for fd, stream in ((1, "out"), (2, "err")):
        f = os.open(log_path(run_dir, rank, stream), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(f, fd)
        os.close(f)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115


def _watch_launcher(alive) -> None:
    """End this rank and its whole process group when the launcher is gone.

    ``alive`` is the read end of a pipe whose write end only the launching process holds. The
    kernel closes it when that process dies, zombie or not, so ``recv`` returns EOF: a check that a
    dead-but-unreaped parent cannot fool, unlike ``os.kill(pid, 0)``.
    """

    def loop() -> None:
        try:
            alive.recv()  # the launcher never sends: this returns only at EOF
        except (EOFError, OSError):
            pass
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=loop, name="course-launcher-watchdog", daemon=True).start()


def _serve_loopback_store(listener, port: int, timeout_s: float):
    """Rank 0: a multi-tenant TCPStore on the launcher's loopback socket, found by ``env://``.

    torch's ``env://`` rendezvous creates its store with ``multi_tenant=True``, which reuses a
    server this process already runs on the same port instead of binding ``[::]:port`` itself.
    """
    timeout = timedelta(seconds=timeout_s)
    attempts = ({"use_libuv": True}, {"use_libuv": False}, {})  # older torch: no libuv switch
    for extra in attempts:
        fd = os.dup(listener.fileno())
        try:
            return dist.TCPStore(
                "127.0.0.1",
                port,
                None,
                True,
                timeout,
                wait_for_workers=False,
                multi_tenant=True,
                master_listen_fd=fd,
                **extra,
            )
        except (TypeError, RuntimeError, ValueError):
            with contextlib.suppress(OSError):
                os.close(fd)
    raise RuntimeError(
        "this torch cannot serve a TCPStore from a bound socket; use launch(..., "
        "init_process_group=True) or init_method=ctx.init_method (a FileStore)"
    )


def _init_process_group(ctx: RankContext, timeout_s: float) -> None:
    store = dist.FileStore(str(ctx.run_dir / STORE), ctx.world_size)
    kwargs = dict(backend=ctx.backend, store=store, rank=ctx.rank, world_size=ctx.world_size)
    kwargs["timeout"] = timedelta(seconds=timeout_s)
    if ctx.device.type == "cuda":
        kwargs["device_id"] = ctx.device  # eager NCCL init, torch >= 2.3
    try:
        dist.init_process_group(**kwargs)
    except TypeError:  # older torch without device_id
        kwargs.pop("device_id", None)
        dist.init_process_group(**kwargs)


def _call(spec: dict, ctx: RankContext, kwargs: dict):
    kind = spec["kind"]
    if kind == "value":
        fn = cloudpickle.loads(spec["fn"])
        return fn(ctx, **kwargs)
    if kind == "ref":
        return resolve_ref(spec["ref"])(ctx, **kwargs)
    # a script, run as __main__ with its own argv
    sys.argv = [spec["path"], *spec["argv"]]
    try:
        runpy.run_path(spec["path"], run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    return None


_LAUNCHER = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _worker_traceback(e: BaseException) -> str:
    """The traceback of the worker's own code: without the launcher's frames above it
    (``rank_main``, ``_call``) or the device check's frames below it."""
    te = traceback.TracebackException.from_exception(e)
    frames = list(te.stack)
    while frames and frames[0].filename.startswith(_LAUNCHER):
        frames.pop(0)
    while frames and frames[-1].filename.startswith(_LAUNCHER + "devicecheck"):
        frames.pop()
    if frames:
        te.stack = traceback.StackSummary.from_list(frames)
    return "".join(te.format())


def _dumps_result(rank: int, record: dict) -> bytes:
    try:
        return cloudpickle.dumps(record)
    except Exception as e:  # any pickling failure is reported the same way
        value = record.get("value")
        msg = (
            f"rank {rank} returned a value of type {type(value).__module__}.{type(value).__qualname__} "
            f"that cannot be pickled ({type(e).__name__}: {e}). Return plain data instead: "
            "numbers, lists, dicts, numpy arrays or CPU tensors (tensor.detach().cpu())."
        )
        print(msg, file=sys.stderr)
        return cloudpickle.dumps(
            {
                "ok": False,
                "exc_type": "TypeError",
                "message": msg,
                "traceback": msg,
                "time": time.time(),
            }
        )


def _set_environment(run_dir: Path, rank: int, env: dict, payload: dict) -> int:
    """Step 3: the launcher's environment plus the rank's own variables; returns the local rank."""
    local_rank = rank % payload["local_world_size"]
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(payload["world_size"]),
        LOCAL_WORLD_SIZE=str(payload["local_world_size"]),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(payload["master_port"]),
        OMP_NUM_THREADS=str(payload["threads"]),
        COURSE_RUN_DIR=str(run_dir),
        COURSE_BACKEND=payload["backend"],
        COURSE_INIT_METHOD=f"file://{run_dir / STORE}",
    )
    os.environ.update(payload.get("rank_env", {}))  # NCCL_MULTI_RANK_GPU_ENABLE for shared GPUs
    if payload.get("gloo_ifname"):  # gloo and NCCL's bootstrap listen on loopback only
        os.environ.setdefault("GLOO_SOCKET_IFNAME", payload["gloo_ifname"])
        if payload["device_type"] == "cuda":
            os.environ.setdefault("NCCL_SOCKET_IFNAME", payload["gloo_ifname"])
    return local_rank


def _prepare_process(run_dir: Path, rank: int, payload: dict):
    """Steps 4 to 6: fork for children, SIGINT left to the launcher, stacks on SIGUSR1, threads.

    Returns the stacks file, which must stay open as long as the rank lives."""
    if "fork" in multiprocessing.get_all_start_methods():
        multiprocessing.set_start_method("fork", force=True)  # see step 5 above
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when ranks stop
    stacks = open(stacks_path(run_dir, rank), "w")  # noqa: SIM115 - must outlive this frame
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    torch.set_num_threads(payload["threads"])
    return stacks


def _rank_context(
    run_dir: Path, rank: int, local_rank: int, payload: dict, status: StatusFile
) -> RankContext:
    """The ``ctx`` the worker receives, on its GPU (round-robin when ranks share GPUs) or the CPU."""
    device = (
        torch.device("cuda", payload["gpus"][rank])  # round-robin when ranks share GPUs
        if payload["device_type"] == "cuda"
        else torch.device("cpu")
    )
    os.environ["COURSE_DEVICE"] = str(device)  # a script's course_utils.dist.init() uses it
    return RankContext(
        rank=rank,
        world_size=payload["world_size"],
        local_rank=local_rank,
        device=device,
        backend=payload["backend"],
        run_dir=run_dir,
        local_world_size=payload["local_world_size"],
        init_method=os.environ["COURSE_INIT_METHOD"],
        extras=dict(payload.get("extras", {})),
        status=status,
    )


def _run_worker(ctx: RankContext, payload: dict) -> tuple[dict, bool]:
    """Steps 7 and 8: the process group, then the worker (device-checked, profiled when asked).

    Returns the result record and whether the worker succeeded; every exception is recorded."""
    try:
        if ctx.device.type == "cuda":
            torch.cuda.set_device(ctx.device)
        if payload["init_process_group"]:
            _init_process_group(ctx, payload["pg_timeout"])
        ctx.status.write("running")
        checking = contextlib.nullcontext()
        if payload.get("check_devices"):
            checking = check_devices(ctx.rank, ctx.device)
        with checking:
            if payload.get("profile") is not None:
                with RankProfiler(payload["profile"], ctx.rank, ctx.run_dir, ctx.device) as prof:
                    ctx.on_step = prof.step
                    value = _call(payload["spec"], ctx, payload["kwargs"])
            else:
                value = _call(payload["spec"], ctx, payload["kwargs"])
        return {"ok": True, "value": value, "time": time.time()}, True
    except BaseException as e:  # report everything, SystemExit included
        tb = _worker_traceback(e)
        print(tb, file=sys.stderr, end="")
        record = {
            "ok": False,
            "exc_type": type(e).__name__,
            "message": str(e),
            "traceback": tb,
            "time": time.time(),
        }
        return record, False


def _save_result(run_dir: Path, rank: int, record: dict, ok: bool) -> bool:
    """Write the record atomically; returns whether the rank succeeded (an unpicklable value is
    a failure)."""
    blob = _dumps_result(rank, record)
    ok = ok and cloudpickle.loads(blob)["ok"]
    tmp = result_path(run_dir, rank).with_suffix(".tmp")
    tmp.write_bytes(blob)
    os.replace(tmp, result_path(run_dir, rank))
    return ok


def _close_process_group(payload: dict, ok: bool) -> None:
    """Step 10: destroy the group launch created; one the worker created is left to os._exit."""
    # A group the worker created itself (a script, init_process_group=False) is left to os._exit:
    # destroying it hung now and then on torch 2.6 with gloo, after all the work was done.
    if ok and payload["init_process_group"] and dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # the result is safe; say it in the log only
            print(f"destroy_process_group failed after the result was saved: {e}", file=sys.stderr)


def rank_main(run_dir: str, rank: int, env: dict, alive, listener=None) -> None:
    """Run one rank of the job stored in ``run_dir``; never returns.

    ``env``: the launcher's environment (in memory only). ``alive``: the read end of the
    launcher's liveness pipe. ``listener``: on rank 0, a socket bound to ``127.0.0.1:MASTER_PORT``.
    """
    os.setsid()  # first: everything this rank starts from now on is in its process group
    run_dir = Path(run_dir)
    status = StatusFile(run_dir / f"rank{rank}.status")  # for launch's progress display
    status.write("starting")
    _redirect_output(run_dir, rank)
    _watch_launcher(alive)
    payload = cloudpickle.loads((run_dir / PAYLOAD).read_bytes())
    local_rank = _set_environment(run_dir, rank, env, payload)
    stacks = _prepare_process(run_dir, rank, payload)  # noqa: F841 - open while the rank lives
    store = None  # rank 0's loopback TCPStore lives as long as the rank
    if listener is not None:
        if not payload["init_process_group"]:
            store = _serve_loopback_store(listener, payload["master_port"], payload["pg_timeout"])
        listener.close()

    ctx = _rank_context(run_dir, rank, local_rank, payload, status)
    record, ok = _run_worker(ctx, payload)
    ok = _save_result(run_dir, rank, record, ok)
    status.write("done" if ok else "failed")
    _close_process_group(payload, ok)
    closed_path(run_dir, rank).touch()
    if store is not None and ok:
        _outlive_the_others(run_dir, payload["world_size"])
    sys.stdout.flush()
    sys.stderr.flush()
    kill_rest_of_my_group()  # DataLoader workers, subprocesses: nothing outlives the rank
    del store  # served other ranks' env:// rendezvous until now
    os._exit(0 if ok else 1)
