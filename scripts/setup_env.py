#!/usr/bin/env python3
"""Build the course's Python environment; ``make setup`` and ``make hub-env`` call this.

Three ways to get torch, one of them per environment:

* default: the pins in ``requirements.txt`` from PyPI (``torch==2.14.1``, a CUDA 13.0 build);
* ``--torch-index URL`` (``make setup TORCH_INDEX=...``): torch and torchvision from a PyTorch
  package index, for a CPU-only, an older-CUDA or a ROCm build; ``--torch-pins`` picks other
  versions (never older than the floor below);
* ``--system-torch`` (``make setup USE_SYSTEM_TORCH=1``): the torch this Python already sees (a
  site module, a container, conda). The venv sees the system's packages and installs only what
  is missing; torch itself is pinned to the version found, so no dependency can bring a second
  torch, and the script checks afterwards that the venv still imports the site's torch.

Everything else comes from ``requirements.txt`` with torch held at the installed version by a
constraint. The choice is remembered in ``<venv>/.setup-config.json``: asking for another torch
build later rebuilds the venv rather than leaving two builds mixed in it.

The script runs before anything is installed, so it uses the standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The oldest torch the course is tested with (CI's floor environment) and its torchvision.
FLOOR = (2, 6)
FLOOR_PINS = "torch==2.6.0 torchvision==0.21.0"
CONFIG = ".setup-config.json"


class SetupError(RuntimeError):
    pass


def torchvision_for(torch_version: str) -> str:
    """torchvision's release that pairs with a torch 2.x release: 2.N -> 0.(N+15)."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", torch_version)
    if not m or m.group(1) != "2":
        raise SetupError(f"cannot pair a torchvision with torch {torch_version}")
    return f"0.{int(m.group(2)) + 15}.*"


def version_tuple(v: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", v)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def read_requirements(path: Path) -> tuple[list[str], list[str]]:
    """(torch and torchvision pins, every other requirement) from a requirements file."""
    torch_pins, rest = [], []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name = re.split(r"[=<>!~\[; ]", line, maxsplit=1)[0].lower()
        (torch_pins if name in ("torch", "torchvision") else rest).append(line)
    return torch_pins, rest


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def pip(py: Path, *args: str) -> None:
    run([str(py), "-m", "pip", "install", "--disable-pip-version-check", *args])


def probe(py: Path, code: str, env: dict | None = None) -> str:
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, env=env)
    if r.returncode:
        raise SetupError(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "failed")
    return r.stdout.strip()


TORCH_PROBE = "import json, torch; print(json.dumps([torch.__version__, torch.__file__]))"


def installed_torch(py: Path) -> tuple[str, str] | None:
    try:
        version, path = json.loads(probe(py, TORCH_PROBE))
    except SetupError:
        return None
    return version, path


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


TORCH_KEYS = ("torch_index", "torch_pins", "system_torch")


def config_of(args) -> dict:
    return {
        "torch_index": getattr(args, "torch_index", None) or None,
        "torch_pins": getattr(args, "torch_pins", None) or None,
        "system_torch": bool(getattr(args, "system_torch", False)),
    }


def prepare_venv(args, venv: Path) -> Path:
    """Create the venv, or rebuild it when it was made for another torch build.

    With no torch option given, an existing venv keeps the build it was made with: a later
    ``make lab`` on a site-torch checkout must not turn it into a 6 GB private install. The choice
    is saved as soon as the venv exists, so that a set-up that fails half-way keeps it too. Only a
    venv this script made (or the checkout's own ``.venv``) is ever deleted for a rebuild.
    """
    cfg = venv / CONFIG
    if (venv / "pyvenv.cfg").exists():
        if cfg.exists():
            have = json.loads(cfg.read_text())
        else:  # made before choices were saved: a venv that sees the system's packages chose them
            system = "include-system-site-packages = true" in (venv / "pyvenv.cfg").read_text()
            have = config_of(argparse.Namespace(system_torch=system))
        asked = args.default_torch or any(getattr(args, k) for k in TORCH_KEYS)
        if not asked:
            for k in TORCH_KEYS:
                setattr(args, k, have[k])
        want = config_of(args)
        if have == want and venv_python(venv).exists():
            return venv_python(venv)
        if not cfg.exists() and venv.resolve() != (ROOT / ".venv").resolve():
            raise SetupError(
                f"{venv} is a venv this set-up did not make; it is left as it is. Remove it "
                "yourself, or choose another VENV / PREFIX."
            )
        print(f"setup: {venv} was built for {have}; rebuilding it for {want}", flush=True)
        shutil.rmtree(venv)
    elif venv.exists() and any(venv.iterdir()):
        raise SetupError(f"{venv} exists and is not a venv; choose another VENV")
    cmd = [args.python, "-m", "venv", str(venv)]
    if args.system_torch:
        cmd.insert(3, "--system-site-packages")
    run(cmd)
    cfg.write_text(json.dumps(config_of(args), indent=1) + "\n")
    return venv_python(venv)


def install_torch(args, py: Path) -> tuple[str, str]:
    req_torch, _ = read_requirements(args.requirements)
    if args.system_torch:
        found = installed_torch(py)
        if found is None:
            raise SetupError(
                f"USE_SYSTEM_TORCH=1, but {args.python} cannot import torch. Load the site's "
                "PyTorch module first (for example `module load pytorch`), or name its Python: "
                "make setup USE_SYSTEM_TORCH=1 PYTHON=/path/to/python"
            )
        version, path = found
        if version_tuple(version) < FLOOR:
            raise SetupError(
                f"the site's torch is {version} ({path}); the course needs torch >= "
                f"{FLOOR[0]}.{FLOOR[1]}. Load a newer module, or use `make setup` for a private torch."
            )
        print(f"setup: using the site's torch {version} from {path}", flush=True)
        try:
            tv = probe(py, "import torchvision; print(torchvision.__version__)")
            print(f"setup: using the site's torchvision {tv}", flush=True)
        except SetupError:
            spec = f"torchvision=={torchvision_for(version)}"
            extra = ["--index-url", args.torch_index] if args.torch_index else []
            # --no-deps: torchvision's dependency on torch must not pull a second torch
            pip(py, "--no-deps", *extra, spec, "pillow")
            try:
                probe(
                    py,
                    "import torch, torchvision; "
                    "torch.ops.torchvision.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)",
                )
            except SetupError as e:
                raise SetupError(
                    f"installed {spec} beside the site's torch {version}, but it does not load "
                    f"({e}). Ask the site for a torchvision built with its torch, or point "
                    "TORCH_INDEX at the index of this build (see the README)."
                ) from None
        return version, path
    pins = args.torch_pins.split() if args.torch_pins else req_torch
    for p in pins:
        m = re.match(r"torch==(\d+\.\d+)", p)
        if m and version_tuple(m.group(1)) < FLOOR:
            raise SetupError(f"{p} is older than the course's floor torch {FLOOR[0]}.{FLOOR[1]}")
    extra = ["--index-url", args.torch_index] if args.torch_index else []
    try:
        pip(py, *extra, *pins)
    except subprocess.CalledProcessError:
        where = args.torch_index or "PyPI"
        raise SetupError(
            f"pip could not install {' '.join(pins)} from {where}. If that index does not carry "
            "these versions, choose ones it has: make setup TORCH_INDEX=... "
            f'TORCH_PINS="torch==X torchvision==Y" (torch >= {FLOOR[0]}.{FLOOR[1]}).'
        ) from None
    found = installed_torch(py)
    if found is None:
        raise SetupError("torch was installed but does not import; see pip's output above")
    return found


def minimum_versions(pyproject: Path) -> dict[str, str]:
    """``{name: lowest version}`` from pyproject.toml's ``name>=X`` requirements (all of its ranges)."""
    found = re.findall(r'"([A-Za-z0-9_.-]+)>=([0-9][^",;]*)"', pyproject.read_text())
    return {name.lower(): version for name, version in found}


def older(have: str, floor: str) -> bool:
    def parts(v):
        return [int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3]]

    return parts(have) < parts(floor)


def missing_only(py: Path, requirements: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the requirements this Python lacks or has below the course's range, {kept: version})."""
    names = [re.split(r"[=<>!~\[; ]", r, maxsplit=1)[0] for r in requirements]
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {}\n"
        "for n in sys.argv[1:]:\n"
        "    try: out[n] = m.version(n)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(out))"
    )
    r = subprocess.run([str(py), "-c", code, *names], capture_output=True, text=True, check=True)
    have = json.loads(r.stdout)
    floors = minimum_versions(ROOT / "pyproject.toml")
    todo, kept = [], {}
    for req, n in zip(requirements, names):
        if n not in have:
            todo.append(req)
        elif n.lower() in floors and older(have[n], floors[n.lower()]):
            print(
                f"setup: the site's {n} {have[n]} is older than {floors[n.lower()]}: installing {req}"
            )
            todo.append(req)
        else:
            print(f"setup: keeping the site's {n} {have[n]}", flush=True)
            kept[n] = have[n]
    return todo, kept


def install_rest(args, py: Path, torch_found: tuple[str, str]) -> None:
    _, rest = read_requirements(args.requirements)
    kept: dict[str, str] = {}
    if args.system_torch:
        rest, kept = missing_only(py, rest)
        if not rest:
            return
    tv = probe(py, "import importlib.metadata as m; print(m.version('torchvision'))")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        # Whatever the other packages ask for, torch stays the one just installed or found, and
        # the site's own packages stay the site's (a dependency may not upgrade them).
        pins = {"torch": torch_found[0], "torchvision": tv} | kept
        f.write("".join(f"{n}=={v}\n" for n, v in pins.items()))
        constraints = f.name
    try:
        pip(py, "--quiet", "-c", constraints, *rest)
    finally:
        os.unlink(constraints)
    after = installed_torch(py)
    if after != torch_found:
        raise SetupError(
            f"installing the course's packages changed torch from {torch_found} to {after}; "
            "this should not happen; please report it with pip's output above"
        )


def install_course(args, py: Path) -> None:
    base = ["--quiet", "--no-deps"]
    # a shared copy is replaced on every run, so that a hub picks up the course's new code
    target = ["--force-reinstall", str(ROOT)] if args.no_editable else ["-e", str(ROOT)]
    try:
        pip(py, *base, "--no-build-isolation", *target)
    except subprocess.CalledProcessError:
        pip(py, *base, *target)


KERNEL = "distributed-course"
KERNEL_DISPLAY = "Distributed training course"


def others_can_run(path: Path) -> list[str]:
    """The folders and files on ``path``'s real path that other users cannot reach."""
    import stat

    blocked, p = [], Path(os.path.realpath(path))
    for d in reversed(p.parents):
        if not d.stat().st_mode & stat.S_IXOTH:
            blocked.append(str(d))
    if not p.stat().st_mode & stat.S_IROTH:
        blocked.append(str(p))
    return blocked


def hub_install(args, py: Path) -> None:
    """Notebooks beside the shared venv, a kernel for every user, everything readable by all."""
    share = args.venv / "share" / "distributed-course" / "notebooks"
    if share.exists():
        shutil.rmtree(share)
    share.mkdir(parents=True)
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        if not re.match(r"^\d\d[a-z]?_\w+\.ipynb$", nb.name):  # as course.NOTEBOOK_NAME
            continue
        shutil.copy2(nb, share / nb.name)
    env = {}
    if args.system_torch:
        # a hub starts kernels without `module load`: keep what the module set
        home = str(Path.home())
        for var in ("PYTHONPATH", "LD_LIBRARY_PATH"):
            if os.environ.get(var):
                env[var] = os.environ[var]
                personal = [e for e in env[var].split(os.pathsep) if e.startswith(home)]
                if personal:
                    print(
                        f"setup: WARNING: {var} holds folders in your home ({', '.join(personal)}); "
                        "every student's kernel will read them. Build from a clean `module load`.",
                        file=sys.stderr,
                    )
    if args.data_dir:
        env["COURSE_DATA_DIR"] = str(Path(args.data_dir).resolve())
    cmd = [
        str(py),
        "-m",
        "ipykernel",
        "install",
        "--name",
        KERNEL,
        "--display-name",
        KERNEL_DISPLAY,
    ]
    cmd += ["--prefix", str(args.kernel_prefix)]
    for k, v in env.items():
        cmd += ["--env", k, v]
    run(cmd, stdout=subprocess.DEVNULL)
    # The command students run in a terminal, with the same environment as the kernel.
    prefix = args.venv.parent
    (prefix / "bin").mkdir(exist_ok=True)
    wrapper = prefix / "bin" / "course-utils"
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
    wrapper.write_text(
        f"#!/bin/sh\n# the course's command, in the shared kernel's environment\n{exports}"
        f'exec {shlex.quote(str(args.venv / "bin" / "course-utils"))} "$@"\n'
    )
    kernel_dir = Path(args.kernel_prefix) / "share" / "jupyter" / "kernels" / KERNEL
    for top in (args.venv, prefix / "bin", kernel_dir):
        run(["chmod", "-R", "a+rX", str(top)])
    wrapper.chmod(0o755)
    for d in [prefix, *(kernel_dir.parents[i] for i in range(3))]:  # kernels/, jupyter/, share/
        if d.stat().st_mode & 0o005 != 0o005:
            try:
                d.chmod(d.stat().st_mode | 0o055)
            except PermissionError:
                print(f"setup: WARNING: other users cannot read {d}; make it a+rx", file=sys.stderr)
    blocked = others_can_run(Path(os.path.realpath(py)))
    if blocked:
        print(
            "setup: WARNING: other users cannot reach the base Python of this venv "
            f"({', '.join(blocked)}). Build the hub environment from a Python every user can "
            "run: make hub-env PYTHON=/usr/bin/python3 ...",
            file=sys.stderr,
        )
    print(
        f"\nShared environment ready: {args.venv}\n"
        f"Kernel '{KERNEL_DISPLAY}' for every user: {kernel_dir}\n"
        f"Command for students and for you: {wrapper} (doctor, workspace, course, data)\n"
        f"Notebooks: {share}\n"
        "Each student makes their own working copies once, from a terminal in JupyterLab:\n"
        f"    {wrapper} workspace --dir ~/distributed-course\n",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=ROOT / ".venv")
    ap.add_argument("--python", default=sys.executable, help="the Python the venv is made from")
    ap.add_argument("--requirements", type=Path, default=ROOT / "requirements.txt")
    ap.add_argument("--torch-index", default=os.environ.get("TORCH_INDEX") or None)
    ap.add_argument("--torch-pins", default=os.environ.get("TORCH_PINS") or None)
    ap.add_argument("--system-torch", action="store_true")
    ap.add_argument(
        "--default-torch", action="store_true", help="back to requirements.txt's torch from PyPI"
    )
    ap.add_argument("--no-editable", action="store_true", help="copy course_utils (a shared hub)")
    ap.add_argument("--hub", action="store_true", help="a shared environment for every hub user")
    ap.add_argument("--kernel-prefix", default="/usr/local", help="where the hub looks for kernels")
    ap.add_argument("--data-dir", default=None, help="shared datasets, set in the kernel")
    ap.add_argument("--print-floor", action="store_true", help="print the floor's pins and exit")
    args = ap.parse_args(argv)
    if args.print_floor:
        print(FLOOR_PINS)
        return 0
    args.venv = args.venv.absolute()
    if args.hub:
        args.no_editable = True
    if args.default_torch and (args.system_torch or args.torch_index or args.torch_pins):
        ap.error("USE_SYSTEM_TORCH=0 asks for the default torch: drop TORCH_INDEX / TORCH_PINS")
    if args.system_torch and args.torch_pins:
        ap.error("USE_SYSTEM_TORCH=1 uses the site's torch; TORCH_PINS does not apply")
    try:
        py = prepare_venv(args, args.venv)
        found = install_torch(args, py)
        install_rest(args, py, found)
        install_course(args, py)
        if args.hub:
            hub_install(args, py)
    except SetupError as e:
        print(f"setup: {e}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as e:
        print(f"setup: a command failed ({e}); see its output above", file=sys.stderr)
        return 2
    print(f"setup: torch {found[0]} from {found[1]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
