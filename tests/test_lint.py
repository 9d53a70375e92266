"""Tooling from day one: the tree is ruff-clean (lint and format), notebooks included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True
    )


def test_ruff_check():
    out = ruff("check", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format():
    out = ruff("format", "--check", ".")
    assert out.returncode == 0, out.stdout + out.stderr + "\nRun `make format`."


def test_notebooks_are_committed_without_outputs():
    import nbformat

    for nb_path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(nb_path, as_version=4)
        dirty = [
            i
            for i, c in enumerate(nb.cells)
            if c.cell_type == "code" and (c.outputs or c.execution_count)
        ]
        assert not dirty, (
            f"{nb_path.name}: cells {dirty} carry outputs; clear them before committing"
        )


def test_import_layers():
    """The layers contract of .importlinter (make lint runs it too): no import goes up a layer, so
    no import cycle between the package's parts can come back."""
    out = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


# Functions allowed over 80 lines, and why (issue 39: the rest are split as their names suggest).
LONG_FUNCTIONS: dict[str, str] = {}


def test_no_long_functions():
    import ast

    long = []
    for path in sorted((ROOT / "course_utils").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                name = f"{path.relative_to(ROOT).as_posix()}:{node.name}"
                if n > 80 and name not in LONG_FUNCTIONS:
                    long.append(f"{name} ({n} lines)")
    assert not long, "split these functions (80 lines at most): " + ", ".join(long)


def readme_package_map() -> str:
    """The course_utils part of README's layout map: from its line to the next top-level folder."""
    block = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("```", 2)[1]
    return block.split("\ncourse_utils/", 1)[1].split("\ntrain/", 1)[0]


def test_readme_layout_names_every_module():
    """README's layout map lists every module of the package, and nothing that is not there."""
    import re

    block = readme_package_map()
    pkg = ROOT / "course_utils"
    listed_pkgs = dict(re.findall(r"\b(\w+)/\s+\(([^)]*)\)", block))
    missing, extra = [], []
    for p in sorted(pkg.iterdir()):
        if p.is_dir() and (p / "__init__.py").exists():
            if p.name not in listed_pkgs:
                missing.append(p.name + "/")
                continue
            names = set(re.findall(r"\w+", listed_pkgs[p.name]))
            have = {m.stem for m in p.glob("*.py") if m.stem != "__init__"}
            have |= {d.name for d in p.iterdir() if (d / "__init__.py").exists()}
            missing += [f"{p.name}/{m}" for m in sorted(have - names)]
            extra += [f"{p.name}/{m}" for m in sorted(names - have)]
        elif p.suffix == ".py" and p.stem not in ("__init__", "__main__"):
            listed = re.search(r"(?<![\w/])" + re.escape(p.name) + r"\b", block)
            missing += [] if listed else [p.name]
    for name in re.findall(r"(?<![\w/])(\w+)\.py\b", block):
        if not (pkg / f"{name}.py").exists():
            extra.append(f"{name}.py")
    assert not missing and not extra, (
        f"README layout map: missing {missing}, not in the tree {extra}"
    )
