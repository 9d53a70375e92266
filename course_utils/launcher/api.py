"""``launch``: run a function as N real ranks and bring back what each returned.

Taught in notebook 01 (first use) and notebook 03 (what it does for you).
Example, runnable as it stands::

    python -c "from course_utils import launch; print(launch('course_utils.launcher.demo:hello', 2).results)"
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle

from . import devicecheck as _devicecheck
from . import placement as _placement
from . import procs as _procs
from .context import cpu_threads_per_rank
from .errors import LaunchInterrupted
from .profiler import ProfileConfig
from .progress import Progress
from .rank import PAYLOAD, log_path, rank_main
from .rundir import new_run_dir, write_json
from .spec import build_spec
from .supervise import Tail, interrupted_notice, not_noise, read_record, stop, supervise

BACKENDS, DEVICES = _placement.BACKENDS, _placement.DEVICES
_notices: set[str] = set()


@dataclass
class LaunchResult:
    """What :func:`launch` brings back."""

    results: list
    """``results[rank]``: what the worker returned on that rank."""
    run_dir: Path
    """The run's folder (logs, results, traces), kept after the run."""
    world_size: int
    backend: str
    device: str
    """``"cuda"`` or ``"cpu"``."""
    wall_time: float
    """Seconds from the call to the last rank's exit, process start-up included."""
    logs: dict[int, Path] = field(default_factory=dict)
    """``logs[rank]``: that rank's stdout log (stderr beside it, ``.err``)."""
    traces: dict[int, Path] = field(default_factory=dict)
    """``traces[rank]``: that rank's profiler trace, with ``launch(..., profile=...)``."""

    def log(self, rank: int, stream: str = "out") -> str:
        """Full text a rank wrote to ``"out"`` (stdout) or ``"err"`` (stderr)."""
        return log_path(self.run_dir, rank, stream).read_text(errors="replace")

    def __repr__(self) -> str:
        return (
            f"LaunchResult(world_size={self.world_size}, backend={self.backend!r}, "
            f"wall_time={self.wall_time:.2f}s, run_dir='{self.run_dir}')"
        )


def load_results(run_dir: str | Path) -> dict[int, Any]:
    """Return values of the ranks that finished a run, read from its run dir (rank -> value)."""
    run_dir = Path(run_dir)
    out = {}
    for path in sorted(run_dir.glob("rank*.result.pkl")):
        rank = int(path.name[4:].split(".")[0])
        record = read_record(run_dir, rank)
        if record and record.get("ok"):
            out[rank] = record["value"]
    return out


def _collect_traces(
    run_dir: Path, world_size: int, profile: ProfileConfig | None
) -> dict[int, Path]:
    if profile is None:
        return {}
    traces = {}
    for r in range(world_size):
        found = sorted((run_dir / "traces").glob(f"rank{r}.*.pt.trace.json"))
        if found:
            traces[r] = found[-1]
    missing = sorted(set(range(world_size)) - set(traces))
    if missing:
        print(
            f"launch: ranks {missing} wrote no profiler trace. Call ctx.step() at the end of every "
            f"training step, at least wait+warmup+active = {profile.steps_needed} times.",
            file=sys.stderr,
        )
    return traces


def _outcome(run_dir: Path, world_size: int) -> dict[int, str]:
    """How each rank ended, for the progress display: done, failed, or stopped by the launcher."""
    out = {}
    for r in range(world_size):
        record = read_record(run_dir, r)
        out[r] = "stopped" if record is None else "done" if record.get("ok") else "failed"
    return out


def _notice(msg: str) -> None:
    if msg not in _notices:
        _notices.add(msg)
        print(msg)


def resolve_backend(
    world_size: int, backend: str = "auto", device: str = "auto"
) -> tuple[str, str]:
    """``(backend, device_type)`` for ``world_size`` ranks on this node, or say what to change.

    The whole answer, GPU per rank included, is :func:`.placement.place_ranks`; this is its short form.
    """
    p = _placement.place_ranks(world_size, backend, device)
    return p.backend, p.device_type


def _announce(p: _placement.Placement, backend: str, device: str) -> None:
    """One line when launch chose the place itself (``auto``), or when ranks share a GPU."""
    if (backend == "auto" and device == "auto") or p.shared:
        _notice(f"launch: {p.describe()}.")


def launch(
    worker: Callable | str | os.PathLike,
    world_size: int,
    *,
    backend: str = "auto",
    device: str = "auto",
    timeout: float = 900.0,
    init_process_group: bool = True,
    start_method: str = "auto",
    argv: list[str] | None = None,
    echo: bool = True,
    runs_root: str | Path | None = None,
    worker_kwargs: dict | None = None,
    extras: dict | None = None,
    profile: bool | ProfileConfig | None = None,
    check_devices: bool | None = None,
    progress: bool | None = None,
    **kwargs,
) -> LaunchResult:
    """Run ``worker(ctx, **kwargs)`` on ``world_size`` ranks, each a real process.

    ``worker`` is a callable (a notebook function works: it is sent by value),
    ``"package.module:function"``, or the path of a ``.py`` script (given
    ``argv``). Each rank's output is echoed live as ``[rank r] ...``. On success
    returns a :class:`LaunchResult`; if a rank raises, is killed or the job runs
    past ``timeout`` seconds, every rank is stopped and a
    :class:`~course_utils.launcher.errors.LaunchError` says which rank and why.

    A run that lasts more than a few seconds shows one compact status per rank (starting, step k
    of n through ``ctx.step(total=n)``, done, failed): a widget in Jupyter, one line in a terminal;
    ``progress=False`` hides it.

    Where the ranks run (:mod:`.placement`): one GPU each when there are enough; with fewer GPUs
    than ranks, the ranks *share* them round-robin (rank ``r`` on ``cuda:r % n``) through NCCL's
    multi-rank mode (NCCL >= 2.30, ``NCCL_MULTI_RANK_GPU_ENABLE=1`` set for the ranks only); with
    an older NCCL, or no GPU, CPU processes with gloo. Sharing is the default on purpose: a student
    with one GPU then sees real NCCL kernels, CUDA streams and device placement in every
    multi-rank notebook, instead of CPU ranks beside an idle GPU; what shared ranks cannot show is
    a speed-up, and the notebooks say so where they time. ``device="cpu"`` opts out;
    ``device="cuda"`` insists on GPUs and, where sharing is impossible, fails before any process
    starts with what to do. Each automatic choice prints one line saying where the ranks run.

    ``check_devices=True`` (default: ``$COURSE_CHECK_DEVICES``) makes CPU ranks fail where a GPU
    node would: on a tensor made without ``device=ctx.device`` meeting the rank's device, or a module
    never moved (:mod:`course_utils.launcher.devicecheck`).

    ``profile=True`` (or a :class:`~course_utils.profiling.ProfileConfig`) records a
    ``torch.profiler`` trace per rank, stepped by ``ctx.step()`` in the worker;
    ``res.traces[rank]`` is its path. ``init_process_group=False`` leaves ``dist.init_process_group`` to the
    worker (``ctx.init_method`` or ``env://`` both work; ``env://`` finds a store rank 0 serves on
    ``127.0.0.1``). Keywords that clash with launch's own names go in ``worker_kwargs``.

    Stopping is total. Each rank leads its own process group; however the run ends (success, a
    failed rank, a timeout, Ctrl-C), every group is stopped (SIGTERM, then SIGKILL), so a rank's
    DataLoader workers and subprocesses, at any depth, end with it. If this process dies, a pipe
    that only it holds closes and every rank kills its own group. Inside a rank, child processes
    start with ``fork``, so DataLoader workers are the rank's own children and a Dataset defined in
    a notebook cell reaches them (:mod:`course_utils.launcher.rank`, step 5, says why).
    """
    kwargs = {**kwargs, **(worker_kwargs or {})}
    if not timeout or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    where = _placement.place_ranks(world_size, backend, device)
    _announce(where, backend, device)
    spec, name = build_spec(worker, kwargs, argv)
    if spec["kind"] == "script":
        init_process_group = False  # the script calls course_utils.dist.init() itself
    kwargs_blob = _pickled_kwargs(kwargs)
    profile = _profile_config(profile)
    mp_ctx = _procs.get_context(start_method)
    run_dir = new_run_dir(name, runs_root)
    payload = _payload(
        where, spec, cloudpickle.loads(kwargs_blob), init_process_group, timeout, extras, profile
    )
    payload["check_devices"] = where.device_type == "cpu" and _devicecheck.wanted(check_devices)
    meta = _meta(name, where, mp_ctx)
    t0 = time.perf_counter()
    results = _run_ranks(mp_ctx, run_dir, payload, meta, timeout, echo, progress, t0)
    return _result(results, run_dir, where, profile, t0)


def _result(
    results: dict, run_dir: Path, where: _placement.Placement, profile: ProfileConfig | None, t0
) -> LaunchResult:
    """The :class:`LaunchResult` of a run whose every rank succeeded."""
    world_size = where.world_size
    return LaunchResult(
        traces=_collect_traces(run_dir, world_size, profile),
        results=[results[r] for r in range(world_size)],
        run_dir=run_dir,
        world_size=world_size,
        backend=where.backend,
        device=where.device_type,
        wall_time=time.perf_counter() - t0,
        logs={r: log_path(run_dir, r, "out") for r in range(world_size)},
    )


def _pickled_kwargs(kwargs: dict) -> bytes:
    """The worker's keywords, pickled now so that a value that cannot travel fails in the caller."""
    try:
        return cloudpickle.dumps(kwargs)
    except Exception as e:
        raise TypeError(f"the keyword arguments for the worker cannot be pickled: {e}") from e


def _meta(name: str, where: _placement.Placement, mp_ctx) -> dict:
    """The run's ``launch.json`` as it starts; the outcome is added when the ranks end."""
    return {
        "worker": name,
        "world_size": where.world_size,
        "backend": where.backend,
        "device": where.device_type,
        "gpus": list(where.gpus),
        "start_method": mp_ctx.get_start_method(),
        "started": time.time(),
        "status": "running",
    }


def _payload(
    where: _placement.Placement,
    spec: dict,
    kwargs: dict,
    init_process_group: bool,
    timeout: float,
    extras: dict | None,
    profile: ProfileConfig | None,
) -> dict:
    """What every rank reads from ``payload.pkl``: the worker, its keywords, where it runs."""
    world_size = where.world_size
    return {
        "spec": spec,
        "kwargs": kwargs,
        "world_size": world_size,
        "local_world_size": world_size,
        "backend": where.backend,
        "device_type": where.device_type,
        "gpus": list(where.gpus),
        "rank_env": where.rank_env(),
        "threads": cpu_threads_per_rank(world_size),
        "gloo_ifname": _procs.loopback_ifname(),
        "init_process_group": init_process_group,
        "pg_timeout": timeout + 60.0,
        "extras": extras or {},
        "profile": profile,
    }


def _profile_config(profile: bool | ProfileConfig | None) -> ProfileConfig | None:
    """``launch``'s ``profile`` argument as a :class:`ProfileConfig`, or ``None`` for no profiling."""
    if profile is True:
        return ProfileConfig()
    if profile is False:
        return None
    if profile is not None and not isinstance(profile, ProfileConfig):
        raise TypeError(
            f"profile must be True, False, None or a ProfileConfig, got {type(profile).__name__}"
        )
    return profile


def _tails(run_dir: Path, world_size: int, echo: bool, shown: Progress) -> list[Tail]:
    """Followers of each rank's stdout and stderr, echoing them as ``[rank r] ...`` when ``echo``."""
    tails = []
    for r in range(world_size):
        prefix = f"[rank {r}] "
        out, err = (sys.stdout, sys.stderr) if echo else (None, None)
        tails.append(Tail(log_path(run_dir, r, "out"), prefix, out, None, shown.clear_line))
        tails.append(Tail(log_path(run_dir, r, "err"), prefix, err, not_noise, shown.clear_line))
    return tails


def _start_ranks(
    mp_ctx, procs: dict, run_dir: Path, world_size: int, env: dict, alive_r, listener
) -> None:
    """Start one process per rank into ``procs`` (filled as they start, so a failure midway
    still stops those already running)."""
    with _procs.no_main_reimport():
        for r in range(world_size):
            procs[r] = mp_ctx.Process(
                target=rank_main,
                args=(str(run_dir), r, env, alive_r, listener if r == 0 else None),
                name=f"rank{r}",
                daemon=False,
            )
            procs[r].start()


def _run_ranks(
    mp_ctx, run_dir: Path, payload: dict, meta: dict, timeout: float, echo: bool, progress, t0
) -> dict[int, Any]:
    """Start the ranks, supervise them to the end and stop every one, however it ends; records
    the outcome in ``launch.json`` and returns each rank's value."""
    world_size = payload["world_size"]
    # The environment travels to the ranks as a process argument (memory), never in payload.pkl.
    env = dict(os.environ)
    procs: dict = {}
    status = "failed"
    with contextlib.ExitStack() as cleanup:
        listener = cleanup.enter_context(_procs.loopback_listener())  # rank 0 serves env:// on it
        alive_r, alive_w = mp_ctx.Pipe(
            duplex=False
        )  # closes when this process dies: ranks watch it
        cleanup.callback(alive_r.close)
        cleanup.callback(alive_w.close)
        payload["master_port"] = listener.getsockname()[1]
        (run_dir / PAYLOAD).write_bytes(cloudpickle.dumps(payload))
        write_json(run_dir / "launch.json", meta)
        shown = Progress(run_dir, world_size, mode=None if progress is not False else "off")
        tails = _tails(run_dir, world_size, echo, shown)
        try:
            _start_ranks(mp_ctx, procs, run_dir, world_size, env, alive_r, listener)
            alive_r.close()  # the ranks hold their copies; the launcher keeps only the write end
            listener.close()
            results = supervise(procs, run_dir, timeout, tails, shown)
            status = "ok"
        except KeyboardInterrupt:
            status = "interrupted"
            interrupted_notice(world_size, run_dir)
            interrupted = LaunchInterrupted(
                f"launch was interrupted; all {world_size} ranks were stopped (run dir {run_dir})"
            )
            raise interrupted from None
        except BaseException as e:
            status = type(e).__name__
            raise
        finally:
            stop(procs)
            shown.finish(_outcome(run_dir, world_size))
            meta.update(
                status=status,
                wall_time=time.perf_counter() - t0,
                pids={r: p.pid for r, p in procs.items() if p.pid is not None},
                exitcodes={r: p.exitcode for r, p in procs.items()},
            )
            write_json(run_dir / "launch.json", meta)
    return results


__all__ = ["LaunchResult", "launch", "load_results", "resolve_backend", "read_record"]
