"""Working copies: the notebooks a student opens and edits, in ``work/`` (ignored by git).

Opening a notebook marks it changed, and Jupyter's autosave writes outputs into it. If students
opened the tracked ``notebooks/*.ipynb``, their clone would show changed files and the next
``git pull`` of a course update would conflict. So ``make lab`` opens copies instead: student
copies (solutions removed, :mod:`course_utils.exercises`), or answer copies for an instructor.

``make update`` (after ``git pull``) refreshes them without losing work. A copy whose cells the
student has not changed (outputs do not count) is replaced by the new version. A copy the student
edited is kept as it is, and the new version is written beside it as ``NAME.updated.ipynb``.
``work/.copies.json`` remembers, per notebook, the cells as they were handed out.

    python -m course_utils workspace --dir work [--kind student|answers]
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

MANIFEST = ".copies.json"


@dataclass
class Change:
    name: str
    action: str
    """``"created"``, ``"updated"``, ``"unchanged"``, or ``"kept"`` (edited: new version beside it)."""
    path: Path


def cells_digest(nb) -> str:
    """SHA-256 of a notebook's cell types and sources: what a student writes, not outputs."""
    h = hashlib.sha256()
    for cell in nb.cells:
        h.update(cell.cell_type.encode())
        h.update(b"\0")
        h.update(cell.source.encode())
        h.update(b"\1")
    return h.hexdigest()


def prepare(work: str | Path, kind: str = "student", src: str | Path | None = None) -> list[Change]:
    """Create or refresh the working copies in ``work``; return what happened to each notebook."""
    import nbformat

    from .course import NOTEBOOK_DIR, find_notebooks
    from .exercises import copy

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    manifest_path = work / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    changes = []
    found = find_notebooks(Path(src) if src else NOTEBOOK_DIR)
    if not found:
        raise FileNotFoundError(
            f"no course notebooks in {Path(src) if src else NOTEBOOK_DIR}; set COURSE_NOTEBOOKS "
            "to the folder that holds 01_single_gpu.ipynb ..."
        )
    for path in found:
        fresh = copy(nbformat.read(path, as_version=4), path.stem, kind)
        new_digest = cells_digest(fresh)
        target = work / path.name
        handed_out = manifest.get(path.name, {}).get("cells")  # as last written here
        if not target.exists():
            nbformat.write(fresh, target)
            action, handed_out = "created", new_digest
        else:
            current = cells_digest(nbformat.read(target, as_version=4))
            if current == new_digest:
                action, handed_out = "unchanged", new_digest
            elif current == handed_out:  # no cell changed since it was handed out: take the update
                nbformat.write(fresh, target)
                action, handed_out = "updated", new_digest
            elif handed_out == new_digest:
                action = "unchanged"  # the course did not change; the edits are the student's
            else:  # edited, and the course changed too: never overwrite the student's work
                target = target.with_suffix(".updated.ipynb")
                nbformat.write(fresh, target)
                action = "kept"
        manifest[path.name] = {"cells": handed_out, "kind": kind}
        changes.append(Change(path.name, action, target))
    manifest_path.write_text(json.dumps(manifest, indent=2))
    return changes


def report(changes: list[Change]) -> str:
    lines = []
    for c in changes:
        if c.action == "kept":
            lines.append(
                f"{c.name}: you edited it, so it was kept as it is; the course's new version is "
                f"{c.path.name} beside it"
            )
        else:
            lines.append(f"{c.name}: {c.action}")
    return "\n".join(lines)


__all__ = ["Change", "cells_digest", "prepare", "report"]
