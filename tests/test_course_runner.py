"""`make course`'s engine: executes notebooks, writes ipynb + HTML, reports failures honestly."""

from __future__ import annotations

import nbformat
import pytest

from course_utils.tooling import course

pytestmark = pytest.mark.notebook


def write_nb(path, *sources):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, path)


def test_course_runner_writes_html_and_reports_failures(tmp_path, monkeypatch, capsys):
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    write_nb(nbs / "01_good.ipynb", "import os\nprint('size', os.environ['COURSE_SIZE'])")
    write_nb(nbs / "02_bad.ipynb", "x = 1", "assert x == 2, 'the check a student sees fail'")
    monkeypatch.setattr(course, "NOTEBOOK_DIR", nbs)
    monkeypatch.setenv("COURSE_SIZE", "ci")  # restored after the test; course.main sets it
    out = tmp_path / "build"
    rc = course.main(str(out), size="ci", timeout=120)
    assert rc == 1
    table = capsys.readouterr().out
    assert (
        "01_good  ok" in table
        and "02_bad   FAILED" in table
        and "the check a student sees fail" in table
    )
    good = nbformat.read(out / "01_good.ipynb", as_version=4)
    assert "size ci" in good.cells[0].outputs[0]["text"]
    assert (out / "01_good.html").read_text().count("size ci") >= 1
    assert (out / "02_bad.html").exists()  # a failed notebook still leaves its traceback to read
    assert (out / "logs" / "01_good.kernel.log").exists()  # the kernel's chatter goes here
    assert "Debugger warning" not in table and "frozen modules" not in table


def test_where_inside_a_notebook_is_shown_in_a_terminal():
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    where = course._Where("03_ddp", 5, term)
    for _ in range(3):
        where.cell()
    where.done()
    assert "03_ddp: cell 3 of 5" in term.getvalue()
    assert term.getvalue().endswith("\r\x1b[K")  # the line is wiped before the table
