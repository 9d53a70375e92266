"""Working copies: the notebooks a student opens and edits, in ``work/`` (ignored by git).

Opening a notebook marks it changed, and Jupyter's autosave writes outputs into it. If students
opened the tracked ``notebooks/*.ipynb``, their clone would show changed files and the next
``git pull`` of a course update would conflict. So ``make lab`` opens copies instead: student
copies (solutions removed, :mod:`course_utils.tooling.exercises`), or answer copies for an instructor.

``make update`` (after ``git pull``) refreshes them without losing work. A copy whose cells the
student has not changed (outputs do not count) is replaced by the new version. A copy the student
edited is kept as it is, and the new version is written beside it as ``NAME.updated.ipynb``. That
copy is the student's too once written: it is refreshed only while its cells are as written here;
if the student edited it, it is kept and a later course version goes to a fresh name
(``NAME.updated-2.ipynb``, ...). ``work/.copies.json`` remembers, per notebook, the cells as they
were handed out, and the name and cells of the new version last written beside an edited copy.

    python -m course_utils workspace --dir work [--kind student|answers]
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from .course import NOTEBOOK_DIR, find_notebooks
from .exercises import copy

MANIFEST = ".copies.json"


@dataclass
class Change:
    name: str
    action: str
    """``"created"``, ``"updated"``, ``"unchanged"``, ``"kept"`` (edited: the course's new version
    is at ``path``, beside it), or ``"edited"`` (edited, and so is the new version at ``path``; the
    course has nothing newer, so nothing was written)."""
    path: Path
    also_kept: list[Path] = field(default_factory=list)
    """Copies of an earlier new version that the student edited: left as they are."""


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
        entry = dict(manifest.get(path.name, {}))
        handed_out = entry.get("cells")  # as last written here
        also_kept: list[Path] = []
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
                target, edited, also_kept = _write_beside(
                    fresh, new_digest, target, entry.get("beside")
                )
                entry["beside"] = {"file": target.name, "cells": new_digest}
                action = "edited" if edited else "kept"
        entry.update(cells=handed_out, kind=kind)
        manifest[path.name] = entry
        changes.append(Change(path.name, action, target, also_kept))
    manifest_path.write_text(json.dumps(manifest, indent=2))
    return changes


def _write_beside(
    fresh, digest: str, target: Path, last: dict | None
) -> tuple[Path, bool, list[Path]]:
    """Put the course's new version beside an edited ``target``, overwriting nothing edited.

    ``last`` is the manifest's record of the file last written beside ``target``: its name and its
    cells then. That file is reused while it holds this version, or while its cells are as written
    (outputs do not count). Otherwise the student may have moved to it and edited it: it is kept,
    and the new version goes to the first name no file has (``NAME.updated-2.ipynb``, ...), unless
    it is this very version the student edited, in which case there is nothing new to write.

    Returns the file that holds the new version, whether the student edited that file (nothing was
    written then), and the edited copies of an earlier version that were left alone.
    """
    import nbformat

    last = last or {}
    first = target.with_suffix(".updated.ipynb")
    written = target.parent / last.get("file", first.name)
    kept = []
    if written.exists():
        now = cells_digest(nbformat.read(written, as_version=4))
        if now == digest:  # already holds this version: leave it, and its outputs, alone
            return written, False, []
        if now == last.get("cells"):  # cells as written here, only outputs added: refresh it
            nbformat.write(fresh, written)
            return written, False, []
        if last.get("cells") == digest:  # the student edited this version: nothing newer to write
            return written, True, []
        kept = [written]
    n = 1
    while True:
        free = first if n == 1 else target.with_suffix(f".updated-{n}.ipynb")
        if not free.exists():
            nbformat.write(fresh, free)
            return free, False, kept
        n += 1


def report(changes: list[Change]) -> str:
    lines = []
    for c in changes:
        if c.action == "kept":
            line = (
                f"{c.name}: you edited it, so it was kept as it is; the course's new version is "
                f"{c.path.name} beside it"
            )
            if c.also_kept:
                names = ", ".join(p.name for p in c.also_kept)
                line += f" ({names}: you edited it too, so it was kept as it is)"
            lines.append(line)
        elif c.action == "edited":
            lines.append(
                f"{c.name}: you edited it and {c.path.name}, the course's latest version beside "
                "it; both kept as they are, nothing new to write"
            )
        else:
            lines.append(f"{c.name}: {c.action}")
    return "\n".join(lines)


__all__ = ["Change", "cells_digest", "prepare", "report"]
