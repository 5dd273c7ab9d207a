"""The app in a real browser: `streamlit run` on a free local port, Debian's chromium driven through
Playwright's Python package (no browser download). Types a prompt, traces it, checks that a plot and
a card (KaTeX equation, code) rendered, downloads a CSV, and saves a screenshot to artifacts/app.png."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.devcheckpoint import demo_or_dev_checkpoint

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "artifacts"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PROMPT = "The lightning indexer chooses which earlier keys each query may attend to."

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
if not CHROMIUM.exists():
    pytest.skip("no /usr/bin/chromium (apt-get install chromium); the test never downloads a browser", allow_module_level=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoint = demo_or_dev_checkpoint(tmp_path_factory.mktemp("browser"))
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "streamlit.log"
    env = {**os.environ, "ANATOMY_CHECKPOINT": checkpoint, "PYTHONPATH": str(REPO)}
    command = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(REPO / "app" / "main.py"),
        "--server.headless=true",
        f"--server.port={port}",
        "--server.address=127.0.0.1",
        "--browser.gatherUsageStats=false",
        "--server.fileWatcherType=none",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"streamlit did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def open_page(server: str):
    """A page of the app in a fresh headless chromium (downloads accepted), closed afterwards."""
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1000}, accept_downloads=True)
            page.set_default_timeout(120_000)
            page.goto(server)
            yield page
        finally:
            browser.close()


@pytest.mark.flaky(reruns=1, reruns_delay=2)  # a real browser on a busy 2-core machine
def test_trace_a_prompt_in_the_browser(server):
    with open_page(server) as page:
        page.locator(".js-plotly-plot").first.wait_for()  # the default prompt, traced on first load

        prompt = page.locator('[data-testid="stSidebar"] [data-testid="stTextArea"] textarea')
        prompt.fill(PROMPT)
        page.get_by_role("button", name="Trace", exact=True).click()
        page.get_by_text(f"“{PROMPT}”").wait_for()  # the page header names the traced prompt
        page.locator(".js-plotly-plot").first.wait_for()

        page.get_by_role("link", name="Block anatomy").click()
        page.locator('[data-testid="stMain"] .katex-display').first.wait_for()  # the card's equations
        page.locator('[data-testid="stMain"] .js-plotly-plot').first.wait_for()  # its live plot
        # waits rather than counts: Streamlit may redraw the page once more after a page switch
        page.locator('[data-testid="stMain"] .katex-display').nth(1).wait_for()  # at least two equations
        page.locator('[data-testid="stCode"]', has_text="def forward").first.wait_for()
        page.set_viewport_size({"width": 1440, "height": 2400})  # the app scrolls inside: show more of it
        page.wait_for_timeout(1500)  # let plotly redraw at the new size before the picture
        page.screenshot(path=str(ARTIFACTS / "app.png"))
        page.set_viewport_size({"width": 1440, "height": 1000})

        page.get_by_role("link", name="Export").click()
        row = page.locator('[data-testid="stHorizontalBlock"]', has=page.get_by_text("router ·")).first
        row.wait_for()
        with page.expect_download() as download:
            row.get_by_role("button", name="CSV").click()
        path = download.value.path()
        text = Path(path).read_bytes().decode("utf-8")
        header = text.split("\r\n", 1)[0]
        assert header == "layer,position,token,expert,group,score,biased_score,group_chosen,selected,rank,weight"
        assert download.value.suggested_filename.endswith("-router.csv")


@pytest.mark.flaky(reruns=1, reruns_delay=2)  # a real browser on a busy 2-core machine
def test_generate_in_the_browser(server):
    """The sidebar's Generate control writes tokens; the Generation page draws the coloured text and its plots."""
    with open_page(server) as page:
        page.locator(".js-plotly-plot").first.wait_for()
        page.get_by_role("link", name="Generation").click()
        page.get_by_text("This trace only reads its prompt").wait_for()

        sidebar = page.locator('[data-testid="stSidebar"]')
        sidebar.locator('[data-testid="stTextArea"] textarea').fill(PROMPT)
        tokens = sidebar.get_by_label("Generate", exact=True).and_(sidebar.get_by_test_id("stNumberInputField"))
        tokens.fill("5")
        tokens.press("Enter")
        page.get_by_role("button", name="Trace", exact=True).click()
        page.locator(".generated-token").first.wait_for()
        page.wait_for_function("() => document.querySelectorAll('.generated-token').length >= 1")
        assert page.locator(".generated-token").count() <= 5
        main = page.locator('[data-testid="stMain"]')
        main.get_by_text("The ten most likely tokens", exact=False).first.wait_for()
        page.wait_for_function(
            "() => document.querySelectorAll('[data-testid=\"stMain\"] .js-plotly-plot .main-svg').length >= 7"
        )
        main.get_by_text("how far back the indexer", exact=False).first.wait_for()
        page.set_viewport_size({"width": 1440, "height": 2400})
        page.wait_for_timeout(1500)
        page.screenshot(path=str(ARTIFACTS / "generation.png"))
