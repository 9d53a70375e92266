"""The cores a process may use: cgroup v1 and v2 CPU quotas on fake cgroup trees, the affinity mask,
and what the launcher, DataLoaders and doctor make of them."""

from __future__ import annotations

import os

import pytest

from course_utils import cpus
from course_utils.cpus import CpuBudget, cgroup_cpu_limit, loader_workers, threads_per_rank


def mountinfo(*mounts):
    """Lines of /proc/self/mountinfo: (root, mount point, fs type, super options)."""
    return "\n".join(
        f"{30 + i} 23 0:{28 + i} {root} {point} rw,relatime - {fs} {fs} rw,{opts}"
        for i, (root, point, fs, opts) in enumerate(mounts)
    )


def write(folder, **files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("__", ".")).write_text(text)


def test_v2_limit(tmp_path):
    write(tmp_path, cpu__max="200000 100000\n")
    mi = mountinfo(("/", str(tmp_path), "cgroup2", "nsdelegate"))
    assert cgroup_cpu_limit(mi, "0::/\n") == 2.0


def test_v2_no_limit(tmp_path):
    write(tmp_path, cpu__max="max 100000\n")
    mi = mountinfo(("/", str(tmp_path), "cgroup2", "nsdelegate"))
    assert cgroup_cpu_limit(mi, "0::/\n") is None


def test_v2_fractional_limit_and_the_tightest_ancestor(tmp_path):
    """A pod limited to 1.5 cores; its container inside it has no limit of its own."""
    write(tmp_path / "kubepods" / "pod1", cpu__max="150000 100000\n")
    write(tmp_path / "kubepods" / "pod1" / "ctr", cpu__max="max 100000\n")
    mi = mountinfo(("/", str(tmp_path), "cgroup2", "nsdelegate"))
    assert cgroup_cpu_limit(mi, "0::/kubepods/pod1/ctr\n") == 1.5


def test_v2_inside_a_cgroup_namespace(tmp_path):
    """In a container the mount's root is the container's own cgroup: /proc/self/cgroup says '/'."""
    write(tmp_path, cpu__max="50000 100000\n")
    mi = mountinfo(("/kubepods/pod1/ctr", str(tmp_path), "cgroup2", "nsdelegate"))
    assert cgroup_cpu_limit(mi, "0::/\n") == 0.5


def test_v1_limit(tmp_path):
    cpu = tmp_path / "cpu,cpuacct"
    write(cpu / "docker" / "abc", cpu__cfs_quota_us="300000\n", cpu__cfs_period_us="100000\n")
    mi = mountinfo(("/", str(cpu), "cgroup", "cpu,cpuacct"))
    assert cgroup_cpu_limit(mi, "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n") == 3.0


def test_v1_no_limit(tmp_path):
    cpu = tmp_path / "cpu"
    write(cpu, cpu__cfs_quota_us="-1\n", cpu__cfs_period_us="100000\n")
    mi = mountinfo(("/", str(cpu), "cgroup", "cpu"))
    assert cgroup_cpu_limit(mi, "1:cpu:/\n") is None


def test_hybrid_host_reads_the_v1_cpu_controller(tmp_path):
    """systemd's hybrid layout mounts v1 controllers and an empty v2 tree: v1's cpu holds the quota."""
    write(tmp_path / "cpu", cpu__cfs_quota_us="250000\n", cpu__cfs_period_us="100000\n")
    write(tmp_path / "unified", cgroup__controllers="")
    mi = mountinfo(
        ("/", str(tmp_path / "cpu"), "cgroup", "cpu"),
        ("/", str(tmp_path / "unified"), "cgroup2", "nsdelegate"),
    )
    assert cgroup_cpu_limit(mi, "2:cpu:/\n0::/\n") == 2.5


def test_no_cgroup_at_all():
    assert cgroup_cpu_limit("", "") is None


@pytest.mark.parametrize(
    "affinity, quota, usable",
    [(64, None, 64), (64, 2.0, 2), (64, 1.5, 1), (64, 0.5, 1), (4, 16.0, 4), (8, 7.99, 7)],
)
def test_usable_is_the_tighter_limit_rounded_down(affinity, quota, usable):
    assert CpuBudget(64, affinity, quota).usable == usable


def test_threads_and_workers_per_rank():
    assert threads_per_rank(4, cores=2) == 1
    assert threads_per_rank(2, cores=8) == 4
    assert loader_workers(4, ranks_on_node=2, cores=8) == 3  # 4 cores a rank: itself + 3 workers
    assert loader_workers(4, ranks_on_node=4, cores=4) == 0  # a core a rank: none to spare
    assert loader_workers(2, ranks_on_node=1, cores=64) == 2  # never more than asked


def test_a_quota_reaches_the_launcher_and_the_doctor(monkeypatch):
    """A pod limited to 2 cores on a 64-core node: 4 ranks get 1 thread, not 16."""
    from course_utils.launcher.context import cpu_threads_per_rank

    monkeypatch.setattr(cpus, "cpu_budget", lambda *a: CpuBudget(64, 64, 2.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # what the machine shows, quota unseen
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert cpu_threads_per_rank(4) == 1
    assert cpu_threads_per_rank(1) == 2
    assert "2 usable (64 in the machine, 64 in the affinity mask, a cgroup quota of 2 cores)" in (
        cpus.cpu_report()
    )


def test_this_machine_reads_without_error():
    b = cpus.cpu_budget()
    assert 1 <= b.usable <= b.affinity <= b.machine
