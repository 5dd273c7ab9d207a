"""The app in a real browser: `streamlit run` on a free local port, Debian's chromium driven through
Playwright's Python package (no browser download). Types a prompt, traces it, checks that a plot and
a card (KaTeX equation, code) rendered, downloads a CSV, and saves a screenshot to artifacts/app.png;
generates and opens each of the Generation page's tabs; and draws every figure of the app in plotly.js
to check that it fits its margins (a figure that does not is drawn twice)."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.chromium import ARGS as CHROMIUM_ARGS
from tests.chromium import CHROMIUM
from tests.devcheckpoint import demo_or_dev_checkpoint

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts"
PROMPT = "The lightning indexer chooses which earlier keys each query may attend to."
GENERATED_TIP = r"position \d+ · p = [01]\.\d{3} · most likely: .+ \([01]\.\d{3}\)"  # app.topics.generation
ATTRIBUTED_TIP = r"position \d+ · [+-]\d+\.\d{4} through the attention"  # app.topics.attribution

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
# Streamlit loads each kind of widget as its own module on first use: on a busy machine a fresh page's
# text can show seconds before its widgets, so assertions wait as long as the pages' other waits.
sync_api.expect.set_options(timeout=120_000)
if not CHROMIUM.exists():
    pytest.skip("no /usr/bin/chromium (apt-get install chromium); the test never downloads a browser", allow_module_level=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def streamlit_app(tmp_path_factory, **env_vars):
    """``streamlit run app/main.py`` on a free port with these environment settings, once its health answers."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "streamlit.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), **env_vars}
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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoint = demo_or_dev_checkpoint(tmp_path_factory.mktemp("browser"))
    with streamlit_app(tmp_path_factory, ANATOMY_CHECKPOINT=checkpoint) as url:
        yield url


@pytest.fixture(scope="module")
def chromium():
    """One headless chromium for the module's pages (starting one costs seconds on 2 cores)."""
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@contextlib.contextmanager
def open_page(chromium, server: str, path: str = "/"):
    """A page of the app (``path``: a page and its query; the Model map by default) in a fresh browser
    context (no cookies or storage of another test's; downloads accepted), closed afterwards."""
    context = chromium.new_context(viewport={"width": 1440, "height": 1000}, accept_downloads=True)
    try:
        page = context.new_page()
        page.set_default_timeout(120_000)
        page.goto(f"{server}{path}")
        yield page
    finally:
        context.close()


def titles(locator) -> list[str]:
    """The tooltips (title attributes) of the elements a locator finds."""
    return locator.evaluate_all("els => els.map(e => e.title)")


def assert_drawn(plot) -> None:
    """A plotly chart that drew data (a trace or a heat map), not an empty frame."""
    plot.wait_for()
    assert plot.locator(".trace, .hm").count() > 0, plot.inner_html()[:500]


def assert_tokens(locator, most: int, tip: str) -> None:
    """Between one and ``most`` token spans, each showing text and its tooltip of the form ``tip``."""
    locator.first.wait_for()
    shown = locator.all_inner_texts()
    assert 1 <= len(shown) <= most and all(shown), shown
    assert all(re.fullmatch(tip, t) for t in titles(locator)), titles(locator)


@pytest.mark.flaky(reruns=1, reruns_delay=2)  # a real browser on a busy 2-core machine
def test_trace_a_prompt_in_the_browser(chromium, server):
    with open_page(chromium, server) as page:
        page.locator(".js-plotly-plot").first.wait_for()  # the default prompt, traced on first load

        prompt = page.locator('[data-testid="stSidebar"] [data-testid="stTextArea"] textarea')
        prompt.fill(PROMPT)
        page.get_by_role("button", name="Trace", exact=True).click()
        page.get_by_text(f"“{PROMPT}”").wait_for()  # the page header names the traced prompt
        assert_drawn(page.locator('[data-testid="stMain"] .js-plotly-plot').first)

        page.get_by_role("link", name="Block anatomy").click()
        page.locator('[data-testid="stMain"] .katex-display').first.wait_for()  # the card's equations
        assert_drawn(page.locator('[data-testid="stMain"] .js-plotly-plot').first)  # its live plot
        # waits rather than counts: Streamlit may redraw the page once more after a page switch
        page.locator('[data-testid="stMain"] .katex-display').nth(1).wait_for()  # at least two equations
        page.locator('[data-testid="stCode"]', has_text="def forward").first.wait_for()
        page.set_viewport_size({"width": 1440, "height": 2400})  # the app scrolls inside: show more of it
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
        assert header == "block,position,token,expert,group,score,biased_score,group_chosen,selected,rank,weight"
        assert download.value.suggested_filename.endswith("-router.csv")


@pytest.mark.flaky(reruns=1, reruns_delay=2)  # a real browser on a busy 2-core machine
def test_generate_in_the_browser(chromium, server):
    """The sidebar's Generate control writes tokens; the Generation page draws the coloured text and its plots."""
    with open_page(chromium, server, "/generation") as page:
        page.get_by_text("This trace only reads its prompt").wait_for()  # the default prompt, traced on first load

        sidebar = page.locator('[data-testid="stSidebar"]')
        tokens = sidebar.get_by_label("Generate", exact=True).and_(sidebar.get_by_test_id("stNumberInputField"))
        # the count first, committed (Enter) and kept by the rerun it starts; then the prompt, which
        # the Trace click commits: a rerun started by leaving the prompt could redraw the count typed meanwhile
        tokens.fill("5")
        tokens.press("Enter")
        sync_api.expect(tokens).to_have_value("5")
        sidebar.locator('[data-testid="stTextArea"] textarea').fill(PROMPT)
        page.get_by_role("button", name="Trace", exact=True).click()
        assert_tokens(page.locator(".generated-token"), 5, GENERATED_TIP)
        main = page.locator('[data-testid="stMain"]')
        main.get_by_text("The ten most likely tokens", exact=False).first.wait_for()
        for tab, title in (  # one view per tab, drawn when its tab opens
            ("Experts", "Experts chosen at position"),
            ("Indexer picks", "indexer scores over the cache"),
            ("Logit lens", "Logit lens at position"),
            ("As the text grows", "how far back the indexer"),
        ):
            main.get_by_role("tab", name=tab, exact=True).click()
            main.get_by_text(title, exact=False).first.wait_for()
        main.locator(".js-plotly-plot .main-svg").nth(1).wait_for()  # both plots of the last tab
        page.set_viewport_size({"width": 1440, "height": 2400})
        page.screenshot(path=str(ARTIFACTS / "generation.png"))


@pytest.mark.flaky(reruns=1, reruns_delay=2)  # a real browser on a busy 2-core machine
def test_attribution_in_the_browser(chromium, server):
    """The Attribution page splits the prediction (its plots and the coloured prompt), then draws the
    contribution graph on the button."""
    with open_page(chromium, server, "/attribution") as page:
        main = page.locator('[data-testid="stMain"]')
        main.get_by_text("The largest parts of", exact=False).first.wait_for()
        assert_tokens(page.locator(".attributed-token"), 256, ATTRIBUTED_TIP)
        main.get_by_text("each head's part", exact=False).first.wait_for()
        page.get_by_role("button", name="Compute the contribution graph").click()
        main.get_by_text("Contribution graph into position", exact=False).first.wait_for()
        page.set_viewport_size({"width": 1440, "height": 3000})
        page.screenshot(path=str(ARTIFACTS / "attribution.png"))


def drawn_figures() -> dict[str, dict]:
    """Every figure the app draws on a generated trace, as the JSON it sends: each page, each of its
    tabs, each anatomy card (AppTest, no server)."""
    import json

    from streamlit.testing.v1 import AppTest

    from app.topics import cards
    from tests.app.test_app import APP, TABS, open_tab

    at = AppTest.from_file(APP, default_timeout=120).run()
    at.number_input(key="gen_tokens").set_value(4)
    at.button(key="run").click().run()
    figures = {}

    def collect(where: str) -> None:
        assert not at.exception, (where, [e.value for e in at.exception])
        for chart in at.get("plotly_chart"):
            spec = json.loads(chart.proto.spec)
            figures[f"{where}: {spec['layout'].get('title', {}).get('text', '')}"] = spec

    generation = ("Alternatives", "Experts", "Indexer picks", "Logit lens", "As the text grows", "Probabilities")
    tabs = {page: (key, list(views)) for page, (key, views) in TABS.items()} | {"generation": ("generation_tab", generation)}
    for page, (key, labels) in tabs.items():
        at.switch_page(f"views/{page}.py").run()
        for label in labels:
            open_tab(at, key, label)
            collect(f"{page}/{label}")
    at.switch_page("views/anatomy.py").run()
    for card_id in cards.load_cards():
        at.button_group(key="anatomy_component").set_value(card_id).run()
        collect(f"anatomy/{card_id}")
    return figures


@pytest.mark.flaky(reruns=1, reruns_delay=2)
def test_every_figure_fits_its_margins(chromium, tmp_path_factory, monkeypatch):
    """Each figure comes with margins its labels, colour bars and legend fit in (app.topics.margins):
    plotly's automargin, which would otherwise grow a margin by drawing the figure a second time, finds
    nothing to grow, at a half-page and at a full-page width."""
    import plotly

    monkeypatch.setenv("ANATOMY_CHECKPOINT", demo_or_dev_checkpoint(tmp_path_factory.mktemp("figures")))
    figures = drawn_figures()
    assert len(figures) > 25
    script = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    grown = {}
    context = chromium.new_context(viewport={"width": 1440, "height": 1000})
    try:
        page = context.new_page()
        page.set_content("<html><body></body></html>")
        page.add_script_tag(path=str(script))
        for name, spec in figures.items():
            for width in (620, 1250):
                sizes = page.evaluate(
                    """async ([fig, width]) => {
                        const div = document.createElement('div'); document.body.appendChild(div);
                        await Plotly.newPlot(div, fig.data, {...fig.layout, width}, {displaylogo: false});
                        const s = div._fullLayout._size, m = fig.layout.margin;
                        const out = [[s.l, s.r, s.t, s.b], [m.l, m.r, m.t, m.b]];
                        Plotly.purge(div); div.remove(); return out;
                    }""",
                    [spec, width],
                )
                drawn, own = sizes
                if any(d > o + 0.5 for d, o in zip(drawn, own, strict=True)):
                    grown[f"{name} @{width}"] = (own, [round(d) for d in drawn])
    finally:
        context.close()
    assert not grown, grown


# slow: a model server and a second app (35 s under the suite); the app on a server is
# tests/app/test_app_server.py's, the browser's the other tests here
@pytest.mark.slow
@pytest.mark.flaky(reruns=1, reruns_delay=2)  # a real browser on a busy 2-core machine
def test_trace_on_a_model_server_in_the_browser(chromium, tmp_path_factory):
    """With ANATOMY_SERVER set the app opens on the model server: the sidebar names it, a prompt traced
    and generated there draws its plots and its written tokens, and the Attribution page attributes
    on the server."""
    from tests.tracing.test_server import start, stop

    checkpoint = demo_or_dev_checkpoint(tmp_path_factory.mktemp("browser-server"))
    model_server, url = start(["--checkpoint", checkpoint])
    try:
        with streamlit_app(tmp_path_factory, ANATOMY_SERVER=url) as app_url, open_page(chromium, app_url) as page:
            page.locator(".js-plotly-plot").first.wait_for()  # the default prompt, traced on the server
            sidebar = page.locator('[data-testid="stSidebar"]')
            # the URL as the sidebar draws it: escaped text, an invisible word joiner after each colon
            shown = re.compile("model server " + "".join(re.escape(c) + ("\u2060?" if c == ":" else "") for c in url))
            sidebar.get_by_text(shown).first.wait_for()
            page.get_by_role("link", name="Generation").click()
            tokens = sidebar.get_by_label("Generate", exact=True).and_(sidebar.get_by_test_id("stNumberInputField"))
            tokens.fill("3")
            tokens.press("Enter")
            sync_api.expect(tokens).to_have_value("3")
            sidebar.locator('[data-testid="stTextArea"] textarea').fill(PROMPT)
            page.get_by_role("button", name="Trace", exact=True).click()
            assert_tokens(page.locator(".generated-token"), 3, GENERATED_TIP)  # written on the server, drawn here
            page.get_by_role("link", name="Attribution", exact=True).click()
            assert_tokens(page.locator(".attributed-token"), 256, ATTRIBUTED_TIP)
    finally:
        stop(model_server)


# a file name made of what Streamlit's Markdown would turn into elements
HOSTILE_NAME = (
    "![x](http://127.0.0.1:9/x.png) [link](http://example.com) :red[red] **bold** _it_ $x^2$ <b>b</b> "
    ":smile: `code` ~~gone~~ www.example.com a@example.com.safetensors"
)
MARKUP = "img, a, strong, em, code, del, .katex, .stMarkdownColoredText"


def trace_bytes(checkpoint: str) -> bytes:
    """A trace of a short prompt on ``checkpoint``, as a trace file holds it."""
    from tracing.cli.loading import open_checkpoint, resolve_checkpoint
    from tracing.runner import TraceRequest, run

    loaded = open_checkpoint(resolve_checkpoint(checkpoint))
    return run(loaded.model, TraceRequest(prompt="Names are text."), loaded.tokenizer).to_bytes()


@pytest.mark.flaky(reruns=1, reruns_delay=2)  # a real browser on a busy 2-core machine
def test_a_file_name_creates_no_element(chromium, server, tmp_path_factory):
    """An uploaded trace file's name, drawn in the sidebar's caption and the page's badge, is text: no
    image fetched, no link, colour, emphasis, code or formula made from it."""
    data = trace_bytes(demo_or_dev_checkpoint(tmp_path_factory.mktemp("names")))
    fetched = []
    with open_page(chromium, server) as page:
        page.on("request", lambda request: fetched.append(request.url))
        page.locator(".js-plotly-plot").first.wait_for()
        sidebar, main = page.locator('[data-testid="stSidebar"]'), page.locator('[data-testid="stMain"]')
        sidebar.get_by_text("Trace file", exact=True).click()
        sidebar.locator('input[type="file"]').set_input_files(
            {"name": HOSTILE_NAME, "mimeType": "application/octet-stream", "buffer": data}
        )
        caption = sidebar.get_by_test_id("stCaptionContainer").filter(has_text="Showing").filter(has_text="trace file")
        caption.wait_for()
        badge = main.locator(".stMarkdownBadge", has_text="trace file")
        badge.wait_for()
        for where in (caption, badge):
            assert HOSTILE_NAME in where.inner_text().replace("\u2060", ""), where.inner_text()
            assert where.locator(MARKUP).count() == 0, where.inner_html()
        assert badge.locator("span").count() == 1  # its icon, nothing else
        assert not [url for url in fetched if "127.0.0.1:9/" in url or "example.com" in url]


@pytest.mark.flaky(reruns=1, reruns_delay=2)  # a real browser on a busy 2-core machine
def test_a_link_and_a_reload_reopen_the_same_view(chromium, server):
    """The URL holds the view: a shared link opens its prompt on its page, a reload keeps it, and a
    prompt traced here lands in the URL."""
    from urllib.parse import parse_qs, quote, urlparse

    shared = "Anne had not seen Captain"
    with open_page(chromium, server, f"/residual?prompt={quote(shared)}&block=1") as page:
        page.get_by_text(f"“{shared}”").wait_for()  # the page header names the traced prompt
        sync_api.expect(page.locator('[data-testid="stSidebar"] textarea')).to_have_value(shared)
        assert urlparse(page.url).path.endswith("/residual")
        page.reload()
        page.get_by_text(f"“{shared}”").wait_for()
        assert parse_qs(urlparse(page.url).query)["prompt"] == [shared]
        prompt = page.locator('[data-testid="stSidebar"] [data-testid="stTextArea"] textarea')
        prompt.fill(PROMPT)
        page.get_by_role("button", name="Trace", exact=True).click()
        page.get_by_text(f"“{PROMPT}”").wait_for()
        page.wait_for_function("(p) => new URLSearchParams(location.search).get('prompt') === p", arg=PROMPT)
