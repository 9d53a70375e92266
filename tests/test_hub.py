"""Two students at once on one node, through a real JupyterHub, in headless Chromium.

The hub runs as root on 127.0.0.1 (free ports) with its ``configurable-http-proxy`` (npm). Two
local users are created for the test (``useradd -m``, random ``crs…`` names) and removed with their
homes at the end, also when it fails. The hub spawns each user's ``jupyterhub-singleuser`` as that
user with JupyterHub's default ``LocalProcessSpawner``; it is the one in the shared environment that
``make hub-env`` builds (conftest's ``hub_env``, shared with tests/test_setup_env.py: from Debian's
``/usr/bin/python3``, which every user can run, and a stand-in for a site's torch module), and the
kernel is registered under its own ``KERNEL_PREFIX``, which the spawner puts on every user server's
``JUPYTER_PATH``. Logging in uses
JupyterHub's ``DummyAuthenticator`` with a password the test sets: any allowed name with that
password gets in; it stands for the site's real authenticator, which is not what is tested here.

Each student logs in through the hub's login page in a browser session of their own, makes
working copies with ``PREFIX/bin/course-utils workspace`` (run as that user), opens notebook 03 and
runs its imports and its first ``launch`` cell, both at the same time, with 4 ranks each and
``COURSE_SIZE=ci`` set by the spawner. Checked: both end with the cell's asserts passed and no
traceback, their launches overlapped in time, their run dirs differ and the other user can neither
list nor read them; what a rank prints reaches its own user's page only; Kernel -> Interrupt in one
browser stops that user's ranks and none of the other's; the hub and its proxy still answer after
that; and once the hub is stopped no process runs as either user.

Needs root, ``useradd``, ``configurable-http-proxy`` (``npm install -g configurable-http-proxy``;
.ci/run installs it), Debian's ``chromium`` and ``chromium-driver`` and selenium; it skips and says
which is missing. About 2 minutes on a 2-core machine, half of it ``make hub-env``.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from tests.conftest import pid_alive, wait_dead
from tests.test_browser import (
    cells,
    chrome,
    free_port,
    interrupt,
    kernel_idle,
    output_text,
    prompt,
    run_cell,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.notebook, pytest.mark.hub]

ROOT = Path(__file__).resolve().parents[1]
CHP = shutil.which("configurable-http-proxy")
USERADD, USERDEL, RUNUSER = (shutil.which(c) for c in ("useradd", "userdel", "runuser"))
SYSTEM_PYTHON = "/usr/bin/python3"  # the hub's environment must be built from a Python all can run
NOTEBOOK = "03_ddp.ipynb"


def unavailable() -> str | None:
    """Why the hub test cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root: the hub creates two local users and spawns a server as each"
    if not (USERADD and USERDEL and RUNUSER):
        return "needs useradd, userdel and runuser (Debian's passwd and util-linux)"
    if not CHP:
        return (
            "needs configurable-http-proxy: `npm install -g configurable-http-proxy` "
            "(.ci/run installs it when npm exists)"
        )
    if not shutil.which("pgrep"):
        return "needs pgrep (procps)"
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        return f"needs {SYSTEM_PYTHON} (a Python every user can run) for the hub's environment"
    try:
        import jupyterhub  # noqa: F401
    except ImportError:
        return "needs jupyterhub (pip install -r requirements.txt)"
    return None


# The cells the test adds at the end of each student's copy of notebook 03. The first makes the
# notebook's first launch cell start 4 ranks (the ci size starts 2); the second starts 2 ranks
# that print a line naming the student and then sleep, for the interrupt. Their pids go next to the
# run dirs, where root reads them.
FOUR_RANKS = "world_size = 4  # the hub test: 4 ranks for each of two students on the node"
SLEEPER = """import getpass, time

def sleeper(ctx, token):
    pid_file = f"{ctx.run_dir}/../sleeper{ctx.rank}.pid"
    with open(pid_file + ".tmp", "w") as f:  # whole, then renamed: never read half written
        f.write(str(os.getpid()))
    os.replace(pid_file + ".tmp", pid_file)
    print(f"started as {getpass.getuser()} {token}", flush=True)
    time.sleep(300)

launch(sleeper, 2, token=%r)"""


class Student:
    def __init__(self, name: str):
        self.name = name
        self.token = secrets.token_hex(6)  # what this student's ranks print
        # launch's default runs folder for this user
        self.runs = Path(tempfile.gettempdir()) / f"course_utils-{name}" / "runs"
        self.home_dir: Path | None = None  # set once the user exists
        self.driver = None
        self.code_cells: dict[str, int] = {}

    @property
    def home(self) -> Path:
        return Path(pwd.getpwnam(self.name).pw_dir)

    def run(self, *cmd: str, **kw) -> subprocess.CompletedProcess:
        env = {"HOME": str(self.home), "USER": self.name, "LOGNAME": self.name,
               "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}  # fmt: skip
        return subprocess.run(
            [RUNUSER, "-u", self.name, "--", *cmd],
            capture_output=True, text=True, env=env, cwd="/", timeout=120, **kw,
        )  # fmt: skip

    def pids(self) -> list[int]:
        r = subprocess.run(["pgrep", "-u", self.name], capture_output=True, text=True)
        return [int(p) for p in r.stdout.split()]


class Hub:
    """A JupyterHub with its proxy and two users, stopped and removed by :meth:`close`."""

    def __init__(self, top: Path):
        self.top = top
        self.students = [Student(f"crs{secrets.token_hex(3)}") for _ in range(2)]
        self.password = secrets.token_urlsafe(12)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.made: list[str] = []

    def add_users(self) -> None:
        for s in self.students:
            subprocess.run(
                [USERADD, "-m", "-s", "/bin/sh", s.name], check=True, capture_output=True
            )
            self.made.append(s.name)
            s.home_dir = s.home

    def start(self, hub_env: dict) -> None:
        prefix, site = hub_env["prefix"], hub_env["site"]
        kernels = hub_env["kernels"] / "share" / "jupyter"  # KERNEL_PREFIX's share/jupyter
        singleuser = prefix / "venv" / "bin" / "jupyterhub-singleuser"
        assert singleuser.exists(), "the hub environment has no jupyterhub-singleuser"
        config = self.top / "jupyterhub_config.py"
        config.write_text(
            f"""
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = {self.port}
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = {free_port()}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{free_port()}"
c.ConfigurableHTTPProxy.command = [{CHP!r}]
c.ConfigurableHTTPProxy.pid_file = {str(self.top / "proxy.pid")!r}
c.JupyterHub.db_url = "sqlite:///{self.top / "jupyterhub.sqlite"}"
c.JupyterHub.cookie_secret_file = {str(self.top / "cookie_secret")!r}
c.JupyterHub.cleanup_servers = True
c.JupyterHub.authenticator_class = "dummy"
c.DummyAuthenticator.password = {self.password!r}
c.Authenticator.allowed_users = {{{", ".join(repr(s.name) for s in self.students)}}}
c.JupyterHub.spawner_class = "localprocess"
c.Spawner.cmd = [{str(singleuser)!r}]
c.Spawner.default_url = "/lab"
c.Spawner.env_keep = ["PATH", "LANG"]
# the site module's path, as a hub whose servers start with the module loaded: the venv takes
# torch's own dependencies (jinja2, which the server needs too) from it; JUPYTER_PATH: where
# make hub-env registered the kernel (KERNEL_PREFIX), as a hub whose kernels live elsewhere sets it
c.Spawner.environment = {{"COURSE_SIZE": "ci", "PYTHONPATH": {str(site)!r},
                          "JUPYTER_PATH": {str(kernels)!r}}}
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120
"""
        )
        env = {"PATH": f"{Path(CHP).parent}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
        self.process = subprocess.Popen(
            [str(Path(sys.executable).parent / "jupyterhub"), "-f", str(config)],
            cwd=self.top,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(self.top / "hub.log", "w"),  # noqa: SIM115 - closed with the process
            start_new_session=True,
        )
        wait_for(lambda: self.api() or self.process.poll() is not None, 60, "the hub to answer")
        assert self.process.poll() is None, self.log()

    def api(self) -> dict | None:
        try:
            with urllib.request.urlopen(f"{self.base}/hub/api", timeout=3) as r:
                return json.loads(r.read())
        except OSError:
            return None

    def proxy_pid(self) -> int:
        return int((self.top / "proxy.pid").read_text())

    def log(self) -> str:
        return (self.top / "hub.log").read_text()[-4000:]

    def stop(self) -> None:
        """Stop the hub; with ``cleanup_servers`` it stops the user servers and the proxy."""
        for s in self.students:
            if s.driver is not None:
                s.driver.quit()
                s.driver = None
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)

    def close(self) -> None:
        """Stop everything, kill (by pid) what is left running as the users, delete them."""
        self.stop()
        for s in self.students:
            if s.name not in self.made:
                continue
            for _ in range(3):
                for pid in s.pids():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                if not s.pids():
                    break
                time.sleep(0.5)
            subprocess.run([USERDEL, "-r", s.name], capture_output=True)
            self.made.remove(s.name)
            shutil.rmtree(s.runs.parent, ignore_errors=True)
        try:  # the proxy, if the hub died before it could stop it
            os.kill(self.proxy_pid(), signal.SIGTERM)
        except (OSError, ValueError):
            pass


@pytest.fixture(scope="module")
def hub(request):
    why = unavailable()
    if why:
        pytest.skip(why)
    hub_env = request.getfixturevalue("hub_env")  # conftest: make hub-env, once per session
    made = hub_env["made"]
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    if hub_env["python"] != SYSTEM_PYTHON:
        pytest.skip(
            f"the hub environment must be built from {SYSTEM_PYTHON}, which every user runs"
        )
    top = Path(tempfile.mkdtemp(prefix="crs-hub-"))  # not under /root: every user reads it
    top.chmod(0o755)
    h = Hub(top)
    try:
        h.add_users()
        torch_init = next(hub_env["site"].glob("torch/__init__.py"))
        readable = h.students[0].run("test", "-r", str(torch_init))
        if readable.returncode != 0:  # symbolic links into a checkout closed to other users
            pytest.skip(f"the hub's users cannot read {torch_init}: put the checkout on a path "
                        "every user can traverse, or /tmp on the checkout's filesystem")  # fmt: skip
        h.start(hub_env)
        for s in h.students:
            w = s.run(str(hub_env["prefix"] / "bin" / "course-utils"), "workspace", "--dir",
                      str(s.home / "distributed-course"))  # fmt: skip
            assert w.returncode == 0, w.stdout + w.stderr
            add_test_cells(s)
        yield h
    finally:
        h.close()
        shutil.rmtree(top, ignore_errors=True)


def add_test_cells(s: Student) -> None:
    """Append FOUR_RANKS and SLEEPER to the student's copy of 03; note where the cells are."""
    path = s.home / "distributed-course" / NOTEBOOK
    nb = nbformat.read(path, as_version=4)
    assert "### BEGIN SOLUTION" not in path.read_text()  # the student copy
    code = [c for c in nb.cells if c.cell_type == "code"]
    first_launch = next(i for i, c in enumerate(code) if "launch(" in c.source)
    imports = next(i for i, c in enumerate(code) if "from course_utils import" in c.source)
    assert imports < first_launch
    nb.cells += [
        nbformat.v4.new_code_cell(FOUR_RANKS),
        nbformat.v4.new_code_cell(SLEEPER % s.token),
    ]
    s.code_cells = {
        "imports": imports,
        "launch": first_launch,
        "four": len(code),
        "sleeper": len(code) + 1,
    }
    nbformat.write(nb, path)
    st = path.parent.stat()
    os.chown(path, st.st_uid, st.st_gid)


def log_in(hub: Hub, s: Student) -> None:
    """A browser session of the student's own, logged in through the hub's login page."""
    from selenium.webdriver.common.by import By

    s.driver = driver = chrome(hub.top / f"chromium-{s.name}")
    driver.get(f"{hub.base}/hub/login")
    wait_for(lambda: driver.find_elements(By.ID, "username_input"), 30, "the login page")
    driver.find_element(By.ID, "username_input").send_keys(s.name)
    driver.find_element(By.ID, "password_input").send_keys(hub.password)
    driver.find_element(By.ID, "login_submit").click()


def open_notebook(hub: Hub, s: Student) -> None:
    driver = s.driver
    wait_for(lambda: f"/user/{s.name}/lab" in driver.current_url, 150, f"{s.name}'s server")
    driver.get(f"{hub.base}/user/{s.name}/lab/tree/distributed-course/{NOTEBOOK}")


def launch_json(run_dir: Path) -> dict:
    return json.loads((run_dir / "launch.json").read_text())


@pytest.mark.timeout(240)  # 2 min 10 s measured on 2 cores, most of it make hub-env
def test_two_students_on_one_hub(hub):
    a, b = hub.students
    for s in (a, b):
        log_in(hub, s)
    for s in (a, b):
        open_notebook(hub, s)
    for s in (a, b):
        wait_for(lambda s=s: len(cells(s.driver)) > s.code_cells["sleeper"], 120, "notebook 03")
        wait_for(lambda s=s: kernel_idle(s.driver), 120, f"{s.name}'s kernel")
        run_cell(s.driver, s.code_cells["imports"])
    for s in (a, b):
        imports = s.code_cells["imports"]
        wait_for(lambda s=s, i=imports: prompt(cells(s.driver)[i]) == "[1]:", 120, "the imports")
        assert "Traceback" not in output_text(cells(s.driver)[imports])
        run_cell(s.driver, s.code_cells["four"])
        wait_for(lambda s=s: prompt(cells(s.driver)[s.code_cells["four"]]) == "[2]:", 30, "4 ranks")

    # 1. both students' first launch cell, at the same time: right results, separate run dirs
    for s in (a, b):
        run_cell(s.driver, s.code_cells["launch"])
    for s in (a, b):
        n = s.code_cells["launch"]
        wait_for(lambda s=s, n=n: prompt(cells(s.driver)[n]) == "[3]:", 150, f"{s.name}'s launch")
        text = output_text(cells(s.driver)[n])
        assert "Traceback" not in text and "Error" not in text, text
        assert "'world_size': 4, 'sum': 10.0" in text, text  # the cell's own assert passed too
    run_dirs = {}
    for s in (a, b):
        found = sorted(s.runs.glob("*-hello_raw-*"))
        assert len(found) == 1, found
        run_dirs[s.name] = found[0]
        info = launch_json(found[0])
        assert info["status"] == "ok" and info["world_size"] == 4, info
        assert found[0].stat().st_uid == pwd.getpwnam(s.name).pw_uid
    assert run_dirs[a.name] != run_dirs[b.name]
    ja, jb = launch_json(run_dirs[a.name]), launch_json(run_dirs[b.name])
    assert max(ja["started"], jb["started"]) < min(
        ja["started"] + ja["wall_time"], jb["started"] + jb["wall_time"]
    ), "the two launches did not overlap in time"

    # 2. each run dir is private: the other student can neither list it nor read its files
    for s, other in ((a, b), (b, a)):
        d = run_dirs[s.name]
        for cmd in (["ls", str(d)], ["cat", str(d / "launch.json")], ["ls", str(s.runs)]):
            r = other.run(*cmd)
            assert r.returncode != 0 and "Permission denied" in r.stderr, (other.name, cmd, r)

    # 3. ranks that print and sleep in both; the lines reach their own student's page only
    for s in (a, b):
        run_cell(s.driver, s.code_cells["sleeper"])
    pids = {}
    for s in (a, b):
        n = s.code_cells["sleeper"]
        wait_for(
            lambda s=s, n=n: output_text(cells(s.driver)[n]).count(s.token) == 2,
            90,
            f"{s.name}'s sleepers to print",
        )
        pids[s.name] = wait_for(
            lambda s=s: (
                [int(p.read_text()) for p in sorted(s.runs.glob("sleeper*.pid"))]
                if len(list(s.runs.glob("sleeper*.pid"))) == 2
                else None
            ),
            30,
            f"{s.name}'s sleepers' pids",
        )
    for s, other in ((a, b), (b, a)):
        text = output_text(cells(s.driver)[s.code_cells["sleeper"]])
        assert f"started as {s.name} {s.token}" in text, text
        assert other.token not in text and other.name not in text, text
        assert owners(pids[s.name]) == {s.name}

    # 4. Kernel -> Interrupt in A's browser stops A's ranks, and none of B's
    interrupt(a.driver)
    n = a.code_cells["sleeper"]
    wait_for(lambda: prompt(cells(a.driver)[n]) != "[*]:", 60, "the interrupt to end A's cell")
    assert "ranks were stopped" in output_text(cells(a.driver)[n])
    assert wait_dead(pids[a.name], within=10) == []
    assert all(pid_alive(p) for p in pids[b.name]) and owners(pids[b.name]) == {b.name}
    assert prompt(cells(b.driver)[b.code_cells["sleeper"]]) == "[*]:"

    # 5. the hub and its proxy are still there and answer (through the proxy)
    assert hub.process.poll() is None and pid_alive(hub.proxy_pid())
    assert "version" in (hub.api() or {}), hub.log()

    # 6. stopping the hub stops both servers, their kernels and B's ranks; nothing runs as them
    hub.stop()
    assert wait_dead(pids[b.name], within=30) == []
    for s in (a, b):
        left = wait_for(lambda s=s: not s.pids() or None, 30, f"{s.name}'s processes to end")
        assert left, ps(s)
    hub.close()
    for s in (a, b):
        assert subprocess.run(["id", s.name], capture_output=True).returncode != 0
        assert not s.runs.parent.exists() and not s.home_dir.exists()


def owners(pids: list[int]) -> set[str]:
    r = subprocess.run(["ps", "-o", "user:32=", "-p", ",".join(map(str, pids))], capture_output=True,
                       text=True)  # fmt: skip
    return set(r.stdout.split())


def ps(s: Student) -> str:
    return subprocess.run(
        ["ps", "-u", s.name, "-o", "pid,cmd"], capture_output=True, text=True
    ).stdout
