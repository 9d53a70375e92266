"""The course in a real JupyterLab, in headless Chromium, as a student uses it.

JupyterLab listens on 127.0.0.1 with a random token; Debian's ``chromium`` and
``chromium-driver`` drive it through selenium. A short notebook checks that rank output appears
while the cell still runs, that the progress display and the step picker render as widgets, and
that Kernel -> Interrupt stops every rank and shows one line, not the launcher's internals.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from tests.conftest import pid_alive, wait_dead

pytestmark = [pytest.mark.slow, pytest.mark.notebook]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
try:
    import selenium  # noqa: F401

    SELENIUM = True
except ImportError:
    SELENIUM = False

if not (CHROMIUM and DRIVER and SELENIUM):
    pytest.skip(
        "needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver; "
        ".ci/run installs them) and selenium (pip)",
        allow_module_level=True,
    )

FIXTURES = Path(__file__).parent / "fixtures" / "traces" / "gpu_minimal"

CELLS = [
    """import os, time
import torch
from course_utils import launch
from course_utils.profiling import draw
from course_utils.profiling.analysis import analyse
from course_utils.profiling.trace import load_traces""",
    """def ticking(ctx, steps=8):
    for i in range(steps):
        print(f"tick {i}", flush=True)
        time.sleep(0.6)
        ctx.step(total=steps)
    return ctx.rank

res = launch(ticking, 2)
print("finished", res.results)""",
    f"""picker = draw.step_picker(analyse(load_traces({str(FIXTURES)!r})))""",
    """def sleeper(ctx):
    pid_file = f"{ctx.run_dir}/../sleeper{ctx.rank}.pid"
    with open(pid_file + ".tmp", "w") as f:  # whole, then renamed: never read half written
        f.write(str(os.getpid()))
    os.replace(pid_file + ".tmp", pid_file)
    print("started", flush=True)
    time.sleep(300)

launch(sleeper, 2)""",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in CELLS]
    nb.metadata["kernelspec"] = {
        "name": "distributed-course",
        "display_name": "Distributed training course",
        "language": "python",
    }
    nbformat.write(nb, root / "course.ipynb")
    port, token = free_port(), secrets.token_hex(16)
    runs = root / "runs"
    env = {**os.environ, "COURSE_RUNS_DIR": str(runs), "COURSE_SIZE": "ci"}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            "--allow-root",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(root / "server.log", "w"),  # noqa: SIM115 - closed with the process
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
            break
        except OSError:
            assert server.poll() is None, (root / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "JupyterLab did not start within 90 s"
            time.sleep(0.5)
    yield {"base": base, "token": token, "root": root, "runs": runs}
    os.killpg(server.pid, 15)
    server.wait(20)


def chrome(user_data_dir: Path):
    """A headless Chromium driven by selenium, with its own profile (cookies) in ``user_data_dir``."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1400,1000",
        f"--user-data-dir={user_data_dir}",
    ):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(DRIVER), options=options)


@pytest.fixture(scope="module")
def browser(lab):
    driver = chrome(lab["root"] / "chromium")
    driver.get(f"{lab['base']}/lab/tree/course.ipynb?token={lab['token']}")
    yield driver
    driver.quit()


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def cells(driver):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-Cell.jp-CodeCell")


def prompt(cell) -> str:
    from selenium.webdriver.common.by import By

    return cell.find_element(By.CSS_SELECTOR, ".jp-InputPrompt").text


def output_text(cell) -> str:
    from selenium.webdriver.common.by import By

    return "\n".join(o.text for o in cell.find_elements(By.CSS_SELECTOR, ".jp-OutputArea"))


def kernel_idle(driver) -> bool:
    """The status bar says "<kernel name> | Idle": the kernel is started and connected.

    (Not "idle" anywhere in the page: the page's markup holds that word before any kernel runs,
    and a Shift+Enter sent before the kernel is connected can be lost.)
    """
    from selenium.webdriver.common.by import By

    bars = driver.find_elements(By.CSS_SELECTOR, "#jp-main-statusbar")
    return bool(bars) and "Distributed training course | Idle" in bars[0].text


def interrupt(driver) -> None:
    """Kernel -> Interrupt, with the notebook toolbar's stop button."""
    from selenium.webdriver.common.by import By

    driver.find_element(
        By.CSS_SELECTOR,
        "jp-button[data-command='notebook:interrupt-kernel'], [data-command='notebook:interrupt-kernel']",
    ).click()


def run_cell(driver, index: int) -> None:
    """Select cell ``index`` and run it with Shift+Enter, as a student does.

    If the cell has not started (its prompt still ``[ ]:``) 10 s later, the key press is sent
    again: the test is about what the course shows, not about a key press lost in a busy browser.
    """
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    for _ in range(3):
        cells(driver)[index].click()
        ActionChains(driver).key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT).perform()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if prompt(cells(driver)[index]) not in ("[ ]:", ""):
                return
            time.sleep(0.2)


def test_a_student_session(lab, browser):
    from selenium.webdriver.common.by import By

    driver = browser
    wait_for(lambda: len(cells(driver)) == len(CELLS), 120, "the notebook to open")
    wait_for(lambda: kernel_idle(driver), 120, "the course kernel to start")
    run_cell(driver, 0)
    wait_for(lambda: prompt(cells(driver)[0]) == "[1]:", 120, "the imports to run")

    # 1. rank output arrives while the cell is still running
    run_cell(driver, 1)
    seen_running = wait_for(
        lambda: (
            "[rank 0] tick 1" in output_text(cells(driver)[1])
            and prompt(cells(driver)[1]) == "[*]:"
        ),
        90,
        "[rank 0] lines while the cell still runs",
    )
    assert seen_running
    wait_for(lambda: "finished [0, 1]" in output_text(cells(driver)[1]), 120, "the launch to end")

    # 2. the progress display and the step picker are widgets that render
    out1 = cells(driver)[1]
    assert out1.find_elements(By.CSS_SELECTOR, ".widget-html, .jupyter-widgets"), (
        "no progress widget"
    )
    assert "rank 0: done" in output_text(out1)
    run_cell(driver, 2)
    wait_for(
        lambda: cells(driver)[2].find_elements(By.CSS_SELECTOR, ".widget-slider, .jupyter-widgets"),
        90,
        "the step picker's slider",
    )
    assert "Error displaying widget" not in driver.page_source

    # 3. Kernel -> Interrupt stops every rank and shows one line
    run_cell(driver, 3)
    wait_for(lambda: "[rank 1] started" in output_text(cells(driver)[3]), 90, "the sleepers")
    pids = wait_for(
        lambda: (
            [int(p.read_text()) for p in lab["runs"].glob("sleeper*.pid")]
            if len(list(lab["runs"].glob("sleeper*.pid"))) == 2
            else None
        ),
        30,
        "the sleepers' pids",
    )
    assert all(pid_alive(p) for p in pids)
    interrupt(driver)
    wait_for(lambda: prompt(cells(driver)[3]) != "[*]:", 60, "the interrupt to end the cell")
    text = output_text(cells(driver)[3])
    assert "ranks were stopped" in text and "KeyboardInterrupt" in text, text
    for internal in ("supervise.py", "api.py", "connection.py", "selectors.py", "Traceback"):
        assert internal not in text, f"{internal!r} shown after the interrupt:\n{text}"
    assert wait_dead(pids, within=10) == []
