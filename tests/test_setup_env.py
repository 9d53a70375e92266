"""The set-up paths of scripts/setup_env.py, built for real in temporary folders.

* a site's PyTorch module: a folder holding only torch and what torch needs (linked from this
  environment's own install), put on PYTHONPATH as a module does; ``--system-torch`` must build a
  venv that imports that torch, installs only what is missing, and never a second torch;
* a shared hub: ``make hub-env`` into a temporary PREFIX and KERNEL_PREFIX; the kernel it registers
  runs a notebook, and a student's working copies are made from the shipped notebooks;
* the guards: a site torch older than the floor, a torch index without the pinned versions.

The two builds install the course's other packages from the package registry (about a minute
each with pip's cache); they are marked slow.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from course_utils.tooling.course import find_notebooks

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "setup_env.py"
sys.path.insert(0, str(SCRIPT.parent))
import setup_env  # noqa: E402

sys.path.pop(0)


def _requirement_names(dist: md.Distribution) -> list[str]:
    names = []
    for req in dist.requires or []:
        if "extra ==" in req:
            continue
        marker = req.split(";", 1)[1] if ";" in req else ""
        if "platform_system" in marker and "Linux" not in marker and "==" in marker:
            continue
        names.append(re.split(r"[ <>=!~;\[(]", req, maxsplit=1)[0])
    return names


def make_site(folder: Path, roots: tuple[str, ...] = ("torch",), hardlink: bool = False) -> Path:
    """A site module's folder: torch (and ``roots``) and their dependencies only, linked from this
    environment: symbolic links, or with ``hardlink`` hard links to each file (other users can
    then read them through ``folder`` even when this checkout's path is closed to them, as a fresh
    clone under a 0700 temporary directory is; falls back to symbolic links across filesystems)."""
    folder.mkdir(parents=True)
    todo, seen = list(roots), set()
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # an optional or platform-specific dependency this install lacks
        base = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            src = base / top
            if src.exists() and not (folder / top).exists() and top not in ("bin", "__pycache__"):
                _link(src, folder / top, hardlink)
        todo += _requirement_names(dist)
    return folder


def _link(src: Path, dst: Path, hardlink: bool) -> None:
    if hardlink:
        try:
            if src.is_dir():
                shutil.copytree(src, dst, symlinks=True, copy_function=os.link)
            else:
                os.link(src, dst)
            return
        except OSError:  # another filesystem: symbolic links, as without hardlink
            shutil.rmtree(dst, ignore_errors=True)
    dst.symlink_to(src)


def site_env(site: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONHOME"))}
    env["PYTHONPATH"] = str(site)
    return env


def base_python() -> str:
    """The Python this venv was made from (a site's Python has no course packages)."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def build(venv: Path, *args: str, env: dict | None = None, timeout: int = 900):
    return subprocess.run(
        [base_python(), str(SCRIPT), "--venv", str(venv), "--python", base_python(), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def in_venv(venv: Path, code: str, env: dict) -> str:
    """``code``'s last line of output; run outside the checkout, since ``python -c`` puts the
    working folder first on sys.path."""
    r = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=venv.parent,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()[-1]


def test_floor_is_stated_alike_everywhere():
    from course_utils.compat import FLOOR

    assert tuple(int(x) for x in FLOOR.split(".")) == setup_env.FLOOR
    assert setup_env.FLOOR_PINS.startswith(f"torch=={FLOOR}.")
    assert f'"torch>={FLOOR}"' in (ROOT / "pyproject.toml").read_text()
    assert f"torch ≥ {FLOOR}" in (ROOT / "README.md").read_text()
    tv = setup_env.FLOOR_PINS.split()[1].split("==")[1]
    assert re.fullmatch(setup_env.torchvision_for(FLOOR + ".0").replace(".*", r"\.\d+"), tv)


def test_requirements_split_torch_from_the_rest():
    torch_pins, rest = setup_env.read_requirements(ROOT / "requirements.txt")
    assert [p.split("==")[0] for p in torch_pins] == ["torch", "torchvision"]
    assert rest and not any(r.startswith("torch") for r in rest)


def test_site_torch_older_than_the_floor_is_refused(tmp_path):
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("__version__ = '2.4.1+rocm6.1'\n")
    r = build(tmp_path / "venv", "--system-torch", env=site_env(site), timeout=120)
    assert r.returncode == 2
    assert "the site's torch is 2.4.1+rocm6.1" in r.stderr and "needs torch >= 2.6" in r.stderr
    # the failed set-up kept its choice: a later plain `make lab` must not fetch a private torch
    again = build(tmp_path / "venv", env=site_env(site), timeout=120)
    assert again.returncode == 2 and "the site's torch is 2.4.1" in again.stderr
    assert "torch==" not in again.stdout


def test_a_venv_it_did_not_make_is_never_deleted(tmp_path):
    venv = tmp_path / "theirs"
    subprocess.run([base_python(), "-m", "venv", "--without-pip", str(venv)], check=True)
    (venv / "their-work.txt").write_text("keep me")
    r = build(venv, "--torch-pins", "torch==2.6.0 torchvision==0.21.0", timeout=60)
    assert r.returncode == 2 and "did not make" in r.stderr
    assert (venv / "their-work.txt").read_text() == "keep me"


def test_no_site_torch_says_to_load_the_module(tmp_path):
    r = build(tmp_path / "venv", "--system-torch", env=site_env(tmp_path), timeout=120)
    assert r.returncode == 2 and "module load" in r.stderr


def test_torch_index_without_the_pins_says_what_to_do(tmp_path):
    index = tmp_path / "simple"
    index.mkdir()
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS="", PIP_NO_INDEX="0")
    r = build(tmp_path / "venv", "--torch-index", index.as_uri(), env=env, timeout=120)
    assert r.returncode == 2
    assert f"from {index.as_uri()}" in r.stderr and "TORCH_PINS=" in r.stderr


def test_pins_older_than_the_floor_are_refused(tmp_path):
    r = build(tmp_path / "venv", "--torch-pins", "torch==2.5.1 torchvision==0.20.1", timeout=120)
    assert r.returncode == 2 and "older than the course's floor" in r.stderr


def test_a_folder_that_is_not_a_venv_is_left_alone(tmp_path):
    venv = tmp_path / "notavenv"
    venv.mkdir()
    (venv / "thesis.tex").write_text("keep me")
    r = build(venv, timeout=60)
    assert r.returncode == 2 and "is not a venv" in r.stderr
    assert (venv / "thesis.tex").read_text() == "keep me"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return make_site(tmp_path_factory.mktemp("module") / "site-packages")


TORCH_WHERE = "import json, torch; print(json.dumps([torch.__version__, torch.__file__]))"
# {name: [version, folder]} of the distributions named on the command line that this Python has
WHERE = """
import importlib.metadata as m, json, sys
out = {}
for n in sys.argv[1:]:
    try:
        d = m.distribution(n)
    except m.PackageNotFoundError:
        continue
    out[n] = [d.version, str(d.locate_file(""))]
print(json.dumps(out))
"""


def where(python, names, env, cwd) -> dict:
    r = subprocess.run(
        [str(python), "-c", WHERE, *names], capture_output=True, text=True, env=env, cwd=cwd
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a venv from the registry: about 1 min here, 5 on a slow CI machine
def test_site_torch_venv_installs_only_what_is_missing(site, tmp_path):
    import torch

    # pip writes no bytecode for the packages it installs here (about 20 s of compileall on 2
    # cores): nothing below reads it. pip reads PIP_NO_COMPILE as the value of its "compile"
    # setting, so "0" is what turns compiling off (pip 23.2 here; were that ever read the other
    # way round, pip would compile again: slower, nothing else)
    env = site_env(site) | {"PIP_NO_COMPILE": "0"}
    _, rest = setup_env.read_requirements(ROOT / "requirements.txt")
    names = [re.split(r"[=<>!~\[; ]", r, maxsplit=1)[0] for r in rest]
    floors = setup_env.minimum_versions(ROOT / "pyproject.toml")
    before = where(base_python(), names, env, tmp_path)  # the site: base Python + module folder
    venv = tmp_path / "venv"
    r = build(venv, "--system-torch", env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"using the site's torch {torch.__version__}" in r.stdout
    version, torch_file = json.loads(in_venv(venv, TORCH_WHERE, env))
    assert version == torch.__version__
    assert torch_file.startswith(str(site)), torch_file  # the module's torch, not a copy
    own = (
        venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    )
    assert not list(own.glob("torch")) and not list(own.glob("torch-*.dist-info"))
    after = where(venv / "bin" / "python", names, env, tmp_path)
    installed = kept = 0
    for n in names:
        low = floors.get(n.lower())
        if n in before and not (low and setup_env.older(before[n][0], low)):
            assert after[n] == before[n], f"{n}: the site's {before[n]} was replaced by {after[n]}"
            kept += 1
        else:  # missing, or older than the course's range: installed into the venv, pinned
            assert after[n][1].startswith(str(venv)), (n, after[n])
            assert f"{n}=={after[n][0]}" in rest, (n, after[n])
            installed += 1
    assert installed and kept, (installed, kept)  # both kinds occur with this machine's Python
    # the course works in it: two gloo ranks through the launcher
    out = in_venv(
        venv,
        "from course_utils import launch; "
        "r = launch('course_utils.launcher.demo:hello', 2, echo=False, timeout=120); "
        "print([x['sum'] for x in r.results])",
        env,
    )
    assert out == "[3.0, 3.0]"
    # set-up again with no torch option keeps the choice, and rebuilds nothing
    again = build(venv, env=env)
    assert again.returncode == 0 and "rebuilding" not in again.stdout
    assert json.loads((venv / ".setup-config.json").read_text())["system_torch"] is True


@pytest.mark.slow
@pytest.mark.timeout(1200)  # as above
def test_hub_env_serves_every_user_from_one_place(hub_env, tmp_path):
    """``make hub-env`` (built once per session by conftest's ``hub_env``, which tests/test_hub.py
    runs a real JupyterHub on)."""
    r, site, env = hub_env["made"], hub_env["site"], hub_env["env"]
    prefix, kernels = hub_env["prefix"], hub_env["kernels"]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    venv = prefix / "venv"
    spec = json.loads(
        (kernels / "share/jupyter/kernels/distributed-course/kernel.json").read_text()
    )
    assert spec["argv"][0] == str(venv / "bin" / "python")
    assert spec["display_name"] == "Distributed training course"
    assert spec["env"]["PYTHONPATH"] == str(site)  # the module's path, kept for the hub's kernels
    assert spec["env"]["COURSE_DATA_DIR"] == str(hub_env["data"])
    # course_utils is a copy inside PREFIX, not a link to the instructor's checkout
    where = in_venv(venv, "import course_utils; print(course_utils.__file__)", env)
    assert where.startswith(str(venv)), where
    shipped = sorted(p.name for p in (venv / "share/distributed-course/notebooks").glob("*.ipynb"))
    assert shipped == sorted(p.name for p in find_notebooks(ROOT / "notebooks"))
    # readable and traversable by every user
    for p in [
        prefix,
        prefix / "bin" / "course-utils",
        Path(where),
        kernels / "share/jupyter/kernels/distributed-course/kernel.json",
    ]:
        assert p.stat().st_mode & 0o004, p
    assert (prefix / "bin" / "course-utils").stat().st_mode & 0o001
    # a student: working copies from the shipped notebooks, outside any checkout
    home = tmp_path / "student"
    # in a terminal, without the module loaded: PREFIX/bin/course-utils brings its environment
    bare = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    w = subprocess.run(
        [str(prefix / "bin" / "course-utils"), "workspace", "--dir", str(home / "distributed-course")],
        capture_output=True, text=True, env=bare, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert w.returncode == 0, w.stderr
    first = home / "distributed-course" / "01_single_gpu.ipynb"
    assert "NotImplementedError" in first.read_text()  # the student copy, solutions removed
    # the shared kernel runs the student's notebook's first code cells (found through KERNEL_PREFIX;
    # the kernel brings the module's PYTHONPATH itself)
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(first, as_version=4)
    nb.cells = [c for c in nb.cells if c.cell_type == "code"][:2]
    run_env = bare | {"JUPYTER_PATH": str(kernels / "share/jupyter"), "COURSE_SIZE": "ci"}
    old = dict(os.environ)
    os.environ.update(run_env)
    os.environ.pop("PYTHONPATH", None)
    try:
        NotebookClient(
            nb,
            timeout=300,
            kernel_name="distributed-course",
            resources={"metadata": {"path": str(first.parent)}},
        ).execute()
    finally:
        os.environ.clear()
        os.environ.update(old)
    text = "".join(o.get("text", "") for c in nb.cells for o in c.outputs)
    assert "Traceback" not in text


def test_default_torch_after_a_site_torch_venv_rebuilds_for_the_pinned_torch(tmp_path, monkeypatch):
    """`make setup USE_SYSTEM_TORCH=0` in a checkout whose venv was made for the site's torch: the
    venv is rebuilt without the system's packages and the pinned torch is what gets installed, not
    the site torch remembered in .setup-config.json. With no option at all, the choice stays."""
    import argparse

    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "pyvenv.cfg").write_text("include-system-site-packages = true\n")
    (venv / setup_env.CONFIG).write_text(
        json.dumps({"torch_index": None, "torch_pins": None, "system_torch": True})
    )
    (venv / "bin").mkdir()
    (venv / "bin" / "python").write_text("")
    made = []

    def fake_run(cmd, **kw):  # `python -m venv ...`: make the folder it would make
        made.append(cmd)
        (venv / "bin").mkdir(parents=True, exist_ok=True)
        (venv / "bin" / "python").write_text("")
        (venv / "pyvenv.cfg").write_text("")

    monkeypatch.setattr(setup_env, "run", fake_run)

    def args(**kw):
        base = dict(python="python3", torch_index=None, torch_pins=None, system_torch=False,
                    default_torch=False)  # fmt: skip
        return argparse.Namespace(**(base | kw))

    keep = args()
    setup_env.prepare_venv(keep, venv)  # no option: the venv keeps the site's torch
    assert made == [] and keep.system_torch is True

    back = args(default_torch=True)
    setup_env.prepare_venv(back, venv)
    assert len(made) == 1 and "--system-site-packages" not in made[0]
    assert back.system_torch is False  # install_torch then installs requirements.txt's torch
    assert json.loads((venv / setup_env.CONFIG).read_text())["system_torch"] is False
