"""Benchmark the Streamlit app on the bundled demo: cold start, re-tracing a new 64-token prompt,
switching page or block without re-tracing. Prints one JSON object.

    python scripts/bench_app.py                   # AppTest: the app's script alone, as in the server
    python scripts/bench_app.py --browser         # also `streamlit run` in Debian's headless chromium

Targets (issue 16, in the browser, medians): a page or block switch at most 0.3 s from the click to
the last plot drawn, a re-trace of a 64-token prompt at most 0.5 s, cold start (launching `streamlit
run` to the first plot drawn) at most 5 s. The browser times every action in the page's own clock,
from the click to the last change in the main area (plotly drawing a figure changes its SVG); the
AppTest figures are the script's share. Uses assets/demo when it exists, else a tiny stand-in
checkpoint (reported).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from app.core import pages as app_pages  # noqa: E402

APP = REPO / "app" / "main.py"
# the pages that draw the session's trace without running the model (Interventions and Attribution
# trace on a button or on arrival, the Atlas reads a corpus, Export draws no plot)
VIEWS = [p for p in app_pages.PAGES if p.name in ("model_map", "anatomy", "residual", "attention", "router", "generation")]
TARGETS = {"cold_start_s": 5.0, "retrace_64_tokens_s": 0.5, "switch_page_s": 0.3, "switch_block_s": 0.3}
TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
    "of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered "
    "the rightful property of some one or other of their daughters. Python is an easy to learn, powerful "
    "programming language. It has efficient high-level data structures and a simple but effective approach to "
    "object-oriented programming. The interpreter and the extensive standard library are freely available in "
    "source or binary form for all major platforms. Emma Woodhouse, handsome, clever, and rich, with a "
    "comfortable home and happy disposition, seemed to unite some of the best blessings of existence; and had "
    "lived nearly twenty-one years in the world with very little to distress or vex her."
)

COLD = """
import json, sys, time
t0 = time.perf_counter()
from streamlit.testing.v1 import AppTest
at = AppTest.from_file(sys.argv[1], default_timeout=300).run()
t1 = time.perf_counter()
print(json.dumps({"seconds": t1 - t0, "exceptions": [str(e.value) for e in at.exception],
                  "errors": [str(e.value) for e in at.error], "plots": len(at.get("plotly_chart"))}))
"""

# Runs in the page before the app loads: the time of every click and of every change in the main area
# (plotly drawing a figure changes its SVG), in the page's own clock.
WATCH = """
window.__bench = {clicks: [], lastChange: 0, firstPlot: 0};
new MutationObserver(records => {
  for (const r of records) {
    const el = r.target.nodeType === 1 ? r.target : r.target.parentElement;
    if (el && el.closest && el.closest('[data-testid="stMain"]')) {
      window.__bench.lastChange = performance.now();
      if (!window.__bench.firstPlot && document.querySelector('[data-testid="stMain"] .js-plotly-plot .main-svg'))
        window.__bench.firstPlot = window.__bench.lastChange;
      return;
    }
  }
}).observe(document, {subtree: true, childList: true, attributes: true, characterData: true});
document.addEventListener('click', () => window.__bench.clicks.push(performance.now()), true);
"""
QUIET_MS = 500  # drawn: the script has finished and nothing in the main area changed for this long


def prompts_of(n_tokens: int, count: int, checkpoint: str) -> list[str]:
    """``count`` different prompts of exactly ``n_tokens`` tokens (BOS included) for this tokenizer."""
    from tracing.cli.loading import resolve_checkpoint
    from tracing.tokenizer import Tokenizer

    tok = Tokenizer(resolve_checkpoint(checkpoint))
    words = TEXT.split()
    out: list[str] = []
    start = 0
    while len(out) < count and start < len(words):
        for end in range(start + 1, len(words) + 1):
            text = " ".join(words[start:end])
            n = len(tok.encode(text))
            if n == n_tokens:
                out.append(text)
                break
            if n > n_tokens:
                break
        start += 7
    if len(out) < count:
        raise SystemExit(f"could not make {count} prompts of {n_tokens} tokens")
    return out


def cold_start(env: dict) -> dict:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", COLD, str(APP)], env=env, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - started
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "in_process_s": round(result["seconds"], 3),
        "with_interpreter_s": round(wall, 3),
        "plots": result["plots"],
        "errors": result["errors"] + result["exceptions"],
    }


def timed(action) -> float:
    t = time.perf_counter()
    action()
    return time.perf_counter() - t


def apptest(checkpoint: str, repeat: int) -> dict:
    """The script's share: each rerun as the server runs it, without the websocket and the browser."""
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(APP), default_timeout=300).run()
    prompts = prompts_of(64, repeat * 2, checkpoint)

    def check() -> None:
        if at.exception or at.error:
            raise SystemExit(f"the app failed: {[e.value for e in at.exception] + [e.value for e in at.error]}")

    def retrace(prompt: str) -> float:
        at.text_area(key="prompt").set_value(prompt)
        seconds = timed(lambda: at.button(key="run").click().run())
        check()
        return seconds

    out: dict[str, list[float]] = {
        "retrace_model_map": [],
        "retrace_router": [],
        "switch_page_first": [],
        "switch_page_again": [],
        "switch_block_first": [],
        "switch_block_again": [],
    }
    n_layers = None
    for r in range(repeat):
        at.switch_page("views/model_map.py").run()
        out["retrace_model_map"].append(retrace(prompts[2 * r]))
        at.switch_page("views/router.py").run()
        out["retrace_router"].append(retrace(prompts[2 * r + 1]))
        n_layers = n_layers or int(max(at.selectbox(key="block").options, key=lambda o: int(o.split()[0])).split()[0]) + 1
        for page in VIEWS:  # first visits after a new trace: every figure is built
            out["switch_page_first"].append(timed(lambda page=page: at.switch_page(page.path).run()))
            check()
            for block in (n_layers - 1, 0):  # a block not seen on this page yet, then back
                out["switch_block_first" if block else "switch_block_again"].append(
                    timed(lambda block=block: at.selectbox(key="block").set_value(block).run())
                )
                check()
        for page in VIEWS:  # the same pages again: figures come from the trace's memo
            out["switch_page_again"].append(timed(lambda page=page: at.switch_page(page.path).run()))
            check()
    return {key: summary(values) for key, values in out.items()}


def summary(values: list[float]) -> dict:
    return {
        "median_s": round(statistics.median(values), 3),
        "max_s": round(max(values), 3),
        "n": len(values),
    }


def drawn(page, since: float) -> float:
    """Seconds from the last click after ``since`` (the page's clock, ms) to the last change in the
    main area, once the script has finished and the page has been still for QUIET_MS."""
    page.wait_for_function(
        """([quiet]) => document.querySelector('[data-testid="stApp"]').getAttribute('data-test-script-state')
             === 'notRunning' && performance.now() - window.__bench.lastChange > quiet""",
        arg=[QUIET_MS],
        polling=50,
    )
    clicks, last = page.evaluate("[window.__bench.clicks, window.__bench.lastChange]")
    return max(0.0, last - max(c for c in clicks if c >= since)) / 1000


def choose_block(page, block: int) -> None:
    # the selectbox is a combobox: a click only focuses its input, the arrow key opens the list
    page.locator('[data-testid="stSidebar"] [data-testid="stSelectbox"]').last.get_by_role("combobox").click()
    page.keyboard.press("ArrowDown")
    page.get_by_role("option").filter(has_text=f"{block} · ").first.click()


def browser(checkpoint: str, env: dict, repeat: int) -> dict:
    """The real thing: `streamlit run` and chromium. Every switch is timed from the click to the last
    plot drawn (the last change in the page where no plot changes), in the browser's clock."""
    import socket
    import urllib.request

    from playwright.sync_api import sync_playwright

    from tests.chromium import ARGS as CHROMIUM_ARGS
    from tests.chromium import CHROMIUM

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="bench-streamlit-", suffix=".log", delete=False)
    prompts = prompts_of(64, repeat, checkpoint)
    out: dict[str, list[float]] = {"retrace": [], "switch_page": [], "switch_block": []}
    by_page: dict[str, list[float]] = {}
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = chromium.new_page(viewport={"width": 1440, "height": 1000})
        page.add_init_script(WATCH)
        page.set_default_timeout(180_000)
        started, launched = time.perf_counter(), time.time()
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamlit", "run", str(APP), "--server.headless=true", f"--server.port={port}",
             "--server.address=127.0.0.1", "--browser.gatherUsageStats=false", "--server.fileWatcherType=none"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            while True:
                try:
                    with urllib.request.urlopen(f"{url}/_stcore/health", timeout=1):
                        break
                except OSError:
                    if proc.poll() is not None:
                        raise SystemExit(f"streamlit exited; see {log.name}") from None
                    time.sleep(0.1)
            server_up = time.perf_counter() - started
            page.goto(url)
            main = page.locator('[data-testid="stMain"]')
            page.wait_for_function(
                "([quiet]) => window.__bench.firstPlot && performance.now() - window.__bench.lastChange > quiet",
                arg=[QUIET_MS],
                polling=50,
            )
            # the page's clock, in ms since its time origin; time.time() shares the machine's epoch
            origin, first, last = page.evaluate("[performance.timeOrigin, window.__bench.firstPlot, window.__bench.lastChange]")
            cold, cold_drawn = ((origin + t) / 1000 - launched for t in (first, last))

            def measure(action, ready) -> float:
                since = page.evaluate("performance.now()")
                action()
                ready()
                return drawn(page, since)

            sidebar = page.locator('[data-testid="stSidebar"]')
            for prompt in prompts:
                sidebar.locator("textarea").first.fill(prompt)
                out["retrace"].append(
                    measure(
                        lambda: page.get_by_role("button", name="Trace", exact=True).click(),
                        lambda prompt=prompt: main.get_by_text(f"“{prompt[:60]}").wait_for(),  # the header names it
                    )
                )
                for view in [*VIEWS[1:], VIEWS[0]]:
                    seconds = measure(
                        lambda view=view: sidebar.get_by_role("link", name=view.title, exact=True).click(),
                        lambda view=view: main.get_by_role("heading", name=view.title).wait_for(),
                    )
                    out["switch_page"].append(seconds)
                    by_page.setdefault(view.title, []).append(seconds)
                    for block in (1, 0):
                        out["switch_block"].append(
                            measure(
                                lambda block=block: choose_block(page, block),
                                lambda block=block: main.get_by_text(f"block {block} · ").first.wait_for(),
                            )
                        )
        finally:
            proc.terminate()
            proc.wait(timeout=20)
            chromium.close()
    result = {key: summary(values) for key, values in out.items()}
    result["switch_page_median_by_page_s"] = {title: summary(values)["median_s"] for title, values in by_page.items()}
    result.update(server_up_s=round(server_up, 3), cold_start_s=round(cold, 3), cold_all_drawn_s=round(cold_drawn, 3))
    return result


def verdict(browser_result: dict) -> dict:
    """Each target: [measured, met] from the browser's figures."""
    measured = {
        "cold_start_s": browser_result["cold_start_s"],
        "retrace_64_tokens_s": browser_result["retrace"]["median_s"],
        "switch_page_s": browser_result["switch_page"]["median_s"],
        "switch_block_s": browser_result["switch_block"]["median_s"],
    }
    return {key: [value, value <= TARGETS[key]] for key, value in measured.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="demo (default when present) or a checkpoint directory")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--browser", action="store_true", help="also measure the real server in chromium (the targets)")
    args = parser.parse_args(argv)

    from tests.devcheckpoint import demo_available, demo_or_dev_checkpoint

    checkpoint = args.checkpoint or demo_or_dev_checkpoint(Path(tempfile.gettempdir()) / "anatomy-bench")
    os.environ["ANATOMY_CHECKPOINT"] = checkpoint
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    import torch

    report: dict = {
        "checkpoint": checkpoint,
        "demo": checkpoint == "demo" and demo_available(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "targets": TARGETS,
    }
    report["cold_start"] = cold_start(env)
    report["apptest"] = apptest(checkpoint, args.repeat)
    if args.browser:
        report["browser"] = browser(checkpoint, env, args.repeat)
        report["verdict"] = verdict(report["browser"])
    else:
        report["verdict"] = "the targets are browser figures: run with --browser"
    report["load_average_after"] = os.getloadavg()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
