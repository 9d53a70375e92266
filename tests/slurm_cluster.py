"""A real SLURM cluster for the tests: Debian's slurm-wlm and munge, started in a temporary folder.

``Cluster.one_node(root)``: slurmctld and one slurmd on this machine (127.0.0.1).

``Cluster.two_nodes(root)``: slurmctld on this machine and two "nodes", ``cn1`` and ``cn2``, each a
slurmd in its own network namespace (its own ``eth0``, 10.x.y.11 and .12, joined to this machine by
veth pairs on a bridge), UTS namespace (its own hostname) and mount namespace (its own
``/etc/hosts`` naming the three machines). Ranks on different nodes talk over the bridge, as
between real nodes; only the filesystem is shared, as on a cluster.

Nothing is mocked: jobs go through ``sbatch``, ``srun`` and ``scontrol``. Needs root (network
namespaces, SlurmUser=root). :func:`unavailable` says why a machine cannot run it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "scontrol")
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}


def unavailable(namespaces: bool = False) -> str | None:
    """Why this machine cannot start the cluster, or ``None``."""
    if os.geteuid() != 0:
        return "needs root (slurmd runs jobs as root here; network namespaces need CAP_NET_ADMIN)"
    missing = [d for d in DAEMONS if not shutil.which(d)]
    if missing:
        return (
            f"SLURM is not installed ({', '.join(missing)} missing): "
            "apt-get install slurm-wlm munge (.ci/run does this)"
        )
    if namespaces:
        for tool in ("ip", "nsenter", "unshare"):
            if not shutil.which(tool):
                return f"needs {tool} for the two-node cluster (iproute2, util-linux)"
        probe = f"cprobe{os.getpid() % 10000}"
        r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if r.returncode:
            return f"cannot create a network namespace here: {r.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def short_host() -> str:
    """``hostname -s``: the name slurmctld expects to find in ``SlurmctldHost``."""
    return socket.gethostname().split(".")[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def ensure_munge() -> subprocess.Popen | None:
    """Start munged unless one answers already; returns it when this call started it."""
    if MUNGE_SOCKET.exists():
        ok = subprocess.run("munge -n | unmunge", shell=True, capture_output=True)
        if ok.returncode == 0:
            return None
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True)
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
    run = Path("/run/munge")
    run.mkdir(parents=True, exist_ok=True)
    shutil.chown(run, "munge", "munge")
    proc = subprocess.Popen(
        ["runuser", "-u", "munge", "--", "munged", "--foreground"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 15
    while not MUNGE_SOCKET.exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("munged did not start within 15 s")
        time.sleep(0.1)
    return proc


class Cluster:
    """One slurmctld and its slurmds; :meth:`stop` removes everything it made."""

    def __init__(self, root: Path, nodes: dict[str, str], namespaces: bool, cpus: int = 4):
        self.root, self.nodes, self.namespaces = Path(root), nodes, namespaces
        self.conf = self.root / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.links: list[str] = []
        self.netns: list[str] = []
        self.munge = None
        self.cpus = cpus
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # set-up -----------------------------------------------------------------------------------
    @classmethod
    def one_node(cls, root: Path) -> Cluster:
        name = re.sub(r"[^A-Za-z0-9-]", "-", short_host())[:40] or "localnode"
        c = cls(root, {name: "127.0.0.1"}, namespaces=False)
        c.start("127.0.0.1", short_host())
        return c

    @classmethod
    def two_nodes(cls, root: Path) -> Cluster:
        net = 100 + os.getpid() % 150
        nodes = {"cn1": f"10.{net}.7.11", "cn2": f"10.{net}.7.12"}
        c = cls(root, nodes, namespaces=True)
        head = f"10.{net}.7.1"
        try:
            c._network(head, net)
            c.start(head, short_host())  # slurmctld insists on its own host name
        except BaseException:
            c.stop()
            raise
        return c

    def _ip(self, *args: str, ns: str | None = None) -> None:
        cmd = ["ip", *args] if ns is None else ["ip", "-n", ns, *args]
        subprocess.run(cmd, check=True, capture_output=True, text=True)

    def _network(self, head: str, net: int) -> None:
        tag = f"c{os.getpid() % 100000}"
        bridge = f"{tag}br"
        self._ip("link", "add", bridge, "type", "bridge")
        self.links.append(bridge)
        self._ip("addr", "add", f"{head}/24", "dev", bridge)
        self._ip("link", "set", bridge, "up")
        for i, (name, addr) in enumerate(self.nodes.items()):
            ns, host_end = f"{tag}{name}", f"{tag}h{i}"
            self._ip("netns", "add", ns)
            self.netns.append(ns)
            self._ip("link", "add", host_end, "type", "veth", "peer", "name", f"{tag}n{i}")
            self.links.append(host_end)
            self._ip("link", "set", host_end, "master", bridge)
            self._ip("link", "set", host_end, "up")
            self._ip("link", "set", f"{tag}n{i}", "netns", ns)
            self._ip("link", "set", f"{tag}n{i}", "name", "eth0", ns=ns)
            self._ip("addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
            self._ip("link", "set", "eth0", "up", ns=ns)
            self._ip("link", "set", "lo", "up", ns=ns)
        hosts = ["127.0.0.1 localhost", f"{head} {short_host()}"]
        hosts += [f"{addr} {name}" for name, addr in self.nodes.items()]
        (self.root / "hosts").write_text("\n".join(hosts) + "\n")

    def _write_conf(self, head_addr: str, head_name: str, ctld_port: int, slurmd_port: int):
        r = self.root
        for d in ("state", *(f"spool/{n}" for n in self.nodes)):
            (r / d).mkdir(parents=True, exist_ok=True)
        lines = [
            "ClusterName=course",
            f"SlurmctldHost={head_name}({head_addr})",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "AuthType=auth/munge",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/slurmctld.log",
            f"SlurmdLogFile={r}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "KillWait=5",
            "MinJobAge=3600",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
        ]
        for name, addr in self.nodes.items():
            lines.append(
                f"NodeName={name} NodeAddr={addr} CPUs={self.cpus} RealMemory=4000 State=UNKNOWN"
            )
        lines.append(
            f"PartitionName=course Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE "
            "State=UP OverSubscribe=YES"
        )
        self.conf.write_text("\n".join(lines) + "\n")

    def start(self, head_addr: str, head_name: str) -> None:
        self.munge = ensure_munge()
        self._write_conf(head_addr, head_name, free_port(), free_port())
        log = open(self.root / "daemons.out", "ab")  # noqa: SIM115 - closed in stop()
        self._log = log
        self.procs.append(
            subprocess.Popen(
                ["slurmctld", "-D", "-i", "-f", str(self.conf)],
                env=self.env,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        )
        for name in self.nodes:
            cmd = ["slurmd", "-D", "-f", str(self.conf), "-N", name]
            if self.namespaces:
                ns = next(n for n in self.netns if n.endswith(name))
                setup = (
                    f"mount --bind {self.root / 'hosts'} /etc/hosts && hostname {name} && "
                    f"exec {' '.join(cmd)}"
                )
                cmd = [
                    "nsenter", f"--net=/var/run/netns/{ns}",
                    "unshare", "--uts", "--mount", "--propagation", "private",
                    "sh", "-c", setup,
                ]  # fmt: skip
            self.procs.append(
                subprocess.Popen(cmd, env=self.env, stdout=log, stderr=log, start_new_session=True)
            )
        # slurmd retries its registration with the controller; on 2 busy cores the first tries can
        # miss (CI, 2026-11-26: not idle after 60 s, idle when rerun), so it gets 3 minutes.
        wait = 180
        deadline = time.monotonic() + wait
        while True:
            out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if len(states) == len(self.nodes) and all(s == "idle" for s in states.values()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"SLURM nodes not idle after {wait} s: {states}\n{self.logs()}")
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a SLURM daemon exited ({p.args}):\n{self.logs()}")
            time.sleep(0.5)

    # use --------------------------------------------------------------------------------------
    def run(self, *cmd: str, check: bool = True, env: dict | None = None, timeout: float = 60):
        return subprocess.run(
            list(cmd),
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
        )

    def submit(self, argv: list[str], env: dict) -> int:
        """Run a submit command (``slurm_templates/submit ...``); return the job id."""
        out = self.run(*argv, env=env)
        m = re.search(r"Submitted batch job (\d+)", out.stdout)
        assert m, f"no job id in sbatch's answer:\n{out.stdout}\n{out.stderr}"
        return int(m.group(1))

    def job(self, job_id: int) -> dict:
        out = self.run("scontrol", "show", "job", "-o", str(job_id), check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: int, timeout: float = 300) -> dict:
        """Wait until the job ends; its scontrol record. On timeout the job is cancelled."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in FINAL:
                return info
            if time.monotonic() > deadline:
                self.run("scancel", str(job_id), check=False)
                raise AssertionError(f"job {job_id} still {info.get('JobState')} after {timeout} s")
            time.sleep(1)

    def logs(self) -> str:
        parts = []
        for f in sorted(self.root.glob("*.log")):
            parts.append(f"--- {f.name}\n" + "\n".join(f.read_text().splitlines()[-15:]))
        return "\n".join(parts)

    # tear-down --------------------------------------------------------------------------------
    def stop(self) -> None:
        if self.conf.exists():
            self.run("scancel", "--user=root", check=False)
        for p in reversed(self.procs):
            if p.poll() is None:
                with_suppress(os.killpg, p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                with_suppress(os.killpg, p.pid, signal.SIGKILL)
                p.wait(5)
        for ns in self.netns:
            subprocess.run(["ip", "netns", "pids", ns], capture_output=True)
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in pids.stdout.split():
                with_suppress(os.kill, int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for link in self.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        if self.munge is not None:
            self.munge.terminate()
            self.munge.wait(10)
        if getattr(self, "_log", None):
            self._log.close()


def with_suppress(fn, *args) -> None:
    try:
        fn(*args)
    except (ProcessLookupError, PermissionError):
        pass
