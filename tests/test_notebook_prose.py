"""The notebooks as committed: short markdown cells (one idea each, at most 250 words), unique cell
ids, no outputs, and the reference material in one "Going further" list at the end."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
LONGEST = 250  # words in one markdown cell (the course's style rule)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_markdown_cells_are_short(path):
    nb = nbformat.read(path, 4)
    long = [(i, len(c.source.split())) for i, c in enumerate(nb.cells)
            if c.cell_type == "markdown" and len(c.source.split()) > LONGEST]  # fmt: skip
    assert not long, f"{path.name}: markdown cells over {LONGEST} words (cell, words): {long}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_cells_have_unique_ids_and_no_outputs(path):
    nb = nbformat.read(path, 4)
    ids = [c.get("id") for c in nb.cells]
    assert None not in ids and len(ids) == len(set(ids)), f"{path.name}: missing or repeated ids"
    ran = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
           and (c.outputs or c.execution_count is not None)]  # fmt: skip
    assert not ran, (
        f"{path.name}: cells committed with outputs: {ran} (clear them before committing)"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_sources_are_listed_once_at_the_end(path):
    nb = nbformat.read(path, 4)
    heads = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "markdown" and c.source.lstrip().startswith("## Going further")]  # fmt: skip
    assert heads == [len(nb.cells) - 1], (
        f"{path.name}: one '## Going further' cell, the last, lists the sources; found at {heads}"
    )
