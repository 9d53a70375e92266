"""The run directory on a shared node: no symlink followed, no foreign mode changed, no secret
left on disk, nothing listening beyond loopback."""

from __future__ import annotations

import getpass
import os
import re
import secrets
import stat
import tempfile

import pytest
import torch
import torch.distributed as dist

from course_utils import launch
from course_utils.launcher.rundir import RunDirError, new_run_dir
from tests.conftest import listening_sockets

is_root = hasattr(os, "geteuid") and os.geteuid() == 0
NOBODY = 65534


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def shared_tmp(tmp_path, monkeypatch):
    """A stand-in for a shared /tmp (mode 1777) that launch's default root lives under."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    monkeypatch.delenv("COURSE_RUNS_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


def test_default_root_is_created_private(shared_tmp):
    run = new_run_dir("x")
    assert run.parent == shared_tmp / f"course_utils-{getpass.getuser()}" / "runs"
    assert mode(run) == mode(run.parent) == mode(run.parent.parent) == 0o700


@pytest.mark.parametrize("planted", ["course_utils-{user}", "course_utils-{user}/runs"])
def test_planted_symlink_is_refused_not_followed(shared_tmp, tmp_path, planted):
    """Another user plants /tmp/course_utils-$USER (or its runs/) as a link to a folder of theirs."""
    victim = tmp_path / "attacker"
    victim.mkdir()
    victim.chmod(0o777)
    link = shared_tmp / planted.format(user=getpass.getuser())
    link.parent.mkdir(exist_ok=True, mode=0o700)
    link.symlink_to(victim)
    with pytest.raises(RunDirError, match="symbolic link") as info:
        launch("course_utils.launcher.demo:hello", 2, echo=False)
    assert "never follows" in str(info.value)
    assert list(victim.iterdir()) == [] and mode(victim) == 0o777  # nothing written, no chmod


def test_runs_env_does_not_chmod_its_parent(tmp_path, monkeypatch):
    parent = tmp_path / "home"
    parent.mkdir()
    parent.chmod(0o755)
    monkeypatch.setenv("COURSE_RUNS_DIR", str(parent / "runs"))
    run = new_run_dir("x")
    assert mode(parent) == 0o755  # the user's folder keeps its mode
    assert mode(parent / "runs") == mode(run) == 0o700  # what launch created is private


def test_runs_root_writable_by_others_is_refused_untouched(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    root.mkdir()
    root.chmod(0o777)
    monkeypatch.setenv("COURSE_RUNS_DIR", str(root))
    with pytest.raises(RunDirError, match="writable by other users") as info:
        new_run_dir("x")
    assert "chmod go-w" in str(info.value)
    assert mode(root) == 0o777 and list(root.iterdir()) == []


@pytest.mark.parametrize("bits", [0o770, 0o775, 0o720])
def test_runs_root_writable_by_its_group_is_refused_too(tmp_path, monkeypatch, bits):
    """On a shared node a group holds many users: group-writable is as open as world-writable."""
    root = tmp_path / "runs"
    root.mkdir()
    root.chmod(bits)
    monkeypatch.setenv("COURSE_RUNS_DIR", str(root))
    with pytest.raises(RunDirError, match="writable by other users"):
        new_run_dir("x")
    assert mode(root) == bits and list(root.iterdir()) == []


def test_parent_writable_by_its_group_without_sticky_bit_is_refused(tmp_path, monkeypatch):
    group_dir = tmp_path / "group"
    group_dir.mkdir()
    group_dir.chmod(0o775)
    monkeypatch.setenv("COURSE_RUNS_DIR", str(group_dir / "runs"))
    with pytest.raises(RunDirError, match="not sticky"):
        new_run_dir("x")
    assert list(group_dir.iterdir()) == []


def test_runs_root_readable_by_others_is_used_as_is(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    root.mkdir()
    root.chmod(0o755)
    monkeypatch.setenv("COURSE_RUNS_DIR", str(root))
    run = new_run_dir("x")
    assert mode(root) == 0o755 and mode(run) == 0o700  # launch did not create root: no chmod


def test_parent_writable_by_others_without_sticky_bit_is_refused(tmp_path, monkeypatch):
    open_dir = tmp_path / "shared"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    monkeypatch.setenv("COURSE_RUNS_DIR", str(open_dir / "runs"))
    with pytest.raises(RunDirError, match="not sticky"):
        new_run_dir("x")
    assert mode(open_dir) == 0o777 and list(open_dir.iterdir()) == []


@pytest.mark.skipif(not is_root, reason="needs root to give a folder to another user")
def test_runs_root_owned_by_someone_else_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    root.mkdir(mode=0o700)
    os.chown(root, NOBODY, NOBODY)
    monkeypatch.setenv("COURSE_RUNS_DIR", str(root))
    with pytest.raises(RunDirError, match="belongs to another user"):
        new_run_dir("x")
    assert mode(root) == 0o700 and os.stat(root).st_uid == NOBODY and list(root.iterdir()) == []


@pytest.mark.skipif(not is_root, reason="needs root to give a folder to another user")
def test_parent_owned_by_someone_else_is_refused(tmp_path, monkeypatch):
    """COURSE_RUNS_DIR=<their sticky dir>/runs: they could rename runs/ and plant their own."""
    shared = tmp_path / "scratch"
    shared.mkdir()
    os.chown(shared, NOBODY, NOBODY)
    shared.chmod(0o1777)
    monkeypatch.setenv("COURSE_RUNS_DIR", str(shared / "runs"))
    with pytest.raises(RunDirError, match="belongs to another user"):
        new_run_dir("x")
    assert mode(shared) == 0o1777 and list(shared.iterdir()) == []


@pytest.fixture
def foreign(monkeypatch):
    """``foreign(path)``: from now on, launch's ownership checks see ``path`` as owned by nobody.

    rundir compares ``os.fstat(fd).st_uid`` with ``os.getuid()``; only the uid of that one folder
    is changed, so any user can run the tests that need a folder of someone else's.
    """
    inodes = set()
    real_fstat = os.fstat

    def fstat(fd):
        st = real_fstat(fd)
        if (st.st_dev, st.st_ino) not in inodes:
            return st
        fields = list(st[:10])
        fields[4] = NOBODY  # st_uid
        return os.stat_result(fields)

    def mark(path) -> None:
        st = os.stat(path)
        inodes.add((st.st_dev, st.st_ino))

    monkeypatch.setattr(os, "fstat", fstat)
    assert os.getuid() != NOBODY
    return mark


def test_runs_root_owned_by_someone_else_is_refused_any_user(tmp_path, monkeypatch, foreign):
    root = tmp_path / "runs"
    root.mkdir(mode=0o700)
    foreign(root)
    monkeypatch.setenv("COURSE_RUNS_DIR", str(root))
    with pytest.raises(
        RunDirError, match=re.escape(f"{root} belongs to another user (uid {NOBODY})")
    ):
        new_run_dir("x")
    assert mode(root) == 0o700 and list(root.iterdir()) == []


def test_parent_owned_by_someone_else_is_refused_any_user(tmp_path, monkeypatch, foreign):
    """A sticky folder of theirs holding runs/: its owner could rename runs/ and plant their own."""
    shared = tmp_path / "scratch"
    shared.mkdir()
    shared.chmod(0o1777)
    foreign(shared)
    monkeypatch.setenv("COURSE_RUNS_DIR", str(shared / "runs"))
    with pytest.raises(
        RunDirError, match=re.escape(f"{shared} belongs to another user (uid {NOBODY})")
    ):
        new_run_dir("x")
    assert mode(shared) == 0o1777 and list(shared.iterdir()) == []


def sees_secret(ctx, name):
    return os.environ.get(name, "") != ""  # a bool: the value itself must not travel back


@pytest.mark.multiprocess
def test_environment_secret_reaches_ranks_but_no_file(runs_root, monkeypatch):
    token = "tok-" + secrets.token_hex(16)
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", token)
    res = launch(sees_secret, 2, name="JUPYTERHUB_API_TOKEN", echo=False)
    assert res.results == [True, True]
    for path in res.run_dir.rglob("*"):
        if path.is_file():
            assert token.encode() not in path.read_bytes(), f"the token is at rest in {path.name}"


def sockets_after_init(ctx, method):
    if method == "env":
        dist.init_process_group("gloo")  # env://: MASTER_ADDR / MASTER_PORT from launch
    t = torch.ones(1, device=ctx.device)
    dist.all_reduce(t)
    found = listening_sockets(os.getpid())
    dist.barrier()  # nobody leaves before everyone has looked
    if method == "env":
        dist.destroy_process_group()
    return {"sum": t.item(), "listening": found, "port": int(os.environ["MASTER_PORT"])}


@pytest.mark.multiprocess
@pytest.mark.parametrize("method", ["launch", "env"])
def test_rendezvous_and_backend_listen_on_loopback_only(runs_root, method):
    res = launch(
        sockets_after_init, 2, method=method, init_process_group=method == "launch", echo=False
    )
    loopback = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
    for rank, r in enumerate(res.results):
        assert r["sum"] == 2.0
        assert r["listening"], f"rank {rank}: gloo listens somewhere; found nothing to check"
        bad = [s for s in r["listening"] if s[0] not in loopback]
        assert not bad, f"rank {rank} listens beyond loopback: {bad}"
    if method == "env":  # rank 0 serves the env:// store on MASTER_PORT, on loopback
        assert ("127.0.0.1", res.results[0]["port"]) in res.results[0]["listening"]
