"""Benchmark the Streamlit app: cold start to the first complete render, re-tracing a new 64-token
prompt and re-rendering, switching block or page without re-tracing. Prints one JSON object.

    python scripts/bench_app.py                   # AppTest (the app's script runs as in the server)
    python scripts/bench_app.py --browser         # also the real server + Debian's chromium

Targets (issue 5, a 2-core machine, the bundled demo): cold start <= 8 s, re-trace <= 1.5 s,
switch <= 0.3 s. Uses assets/demo when it exists, else a tiny stand-in checkpoint (reported).
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

from app import pages as app_pages  # noqa: E402

APP = REPO / "app" / "main.py"
PAGES = [p.name for p in app_pages.PAGES if p.name != "interventions"]
TARGETS = {"cold_start_s": 8.0, "retrace_64_tokens_s": 1.5, "switch_s": 0.3}
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


def prompts_of(n_tokens: int, count: int, checkpoint: str) -> list[str]:
    """``count`` different prompts of exactly ``n_tokens`` tokens (BOS included) for this tokenizer."""
    from tracing.loading import resolve_checkpoint
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
        for page in PAGES:  # first visits after a new trace: every figure is built
            out["switch_page_first"].append(timed(lambda page=page: at.switch_page(f"views/{page}.py").run()))
            check()
            for block in (n_layers - 1, 0):  # a block not seen on this page yet, then back
                out["switch_block_first" if block else "switch_block_again"].append(
                    timed(lambda block=block: at.selectbox(key="block").set_value(block).run())
                )
                check()
        for page in PAGES:  # the same pages again: figures come from the trace's memo
            out["switch_page_again"].append(timed(lambda page=page: at.switch_page(f"views/{page}.py").run()))
            check()
    return {key: summary(values) for key, values in out.items()}


def summary(values: list[float]) -> dict:
    return {
        "median_s": round(statistics.median(values), 3),
        "max_s": round(max(values), 3),
        "n": len(values),
    }


def browser(checkpoint: str, env: dict, repeat: int) -> dict:
    """The real thing: `streamlit run` and chromium; times include the browser drawing the plots."""
    import socket
    import urllib.request

    from playwright.sync_api import sync_playwright

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="bench-streamlit-", suffix=".log", delete=False)
    prompts = prompts_of(64, repeat, checkpoint)
    out: dict[str, list[float]] = {"retrace": [], "switch_page": [], "switch_block": []}
    with sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path="/usr/bin/chromium",
            args=[
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        page = chromium.new_page(viewport={"width": 1440, "height": 1000})
        page.set_default_timeout(180_000)
        started = time.perf_counter()
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
            page.locator('[data-testid="stMain"] .js-plotly-plot').first.wait_for()
            cold = time.perf_counter() - started
            main = page.locator('[data-testid="stMain"]')
            for prompt in prompts:
                page.locator('[data-testid="stSidebar"] textarea').fill(prompt)
                t = time.perf_counter()
                page.get_by_role("button", name="Trace", exact=True).click()
                main.get_by_text(f"“{prompt[:60]}").wait_for()  # the page header names the traced prompt
                main.locator(".js-plotly-plot").first.wait_for()
                out["retrace"].append(time.perf_counter() - t)
                for name, title in (
                    ("Router & experts", "Router & experts"),
                    ("Residual stream", "Residual stream"),
                    ("Model map", "Model map"),
                ):
                    t = time.perf_counter()
                    page.get_by_role("link", name=name).click()
                    main.get_by_role("heading", name=title).wait_for()
                    main.locator(".js-plotly-plot").first.wait_for()
                    out["switch_page"].append(time.perf_counter() - t)
                for block in (1, 0):
                    t = time.perf_counter()
                    # the selectbox is a combobox: a click only focuses its input, the arrow key opens the list
                    page.locator('[data-testid="stSidebar"] [data-testid="stSelectbox"]').last.get_by_role("combobox").click()
                    page.keyboard.press("ArrowDown")
                    page.get_by_role("option").filter(has_text=f"{block} · ").first.click()
                    main.get_by_text(f"block {block} · ").first.wait_for()
                    out["switch_block"].append(time.perf_counter() - t)
        finally:
            proc.terminate()
            proc.wait(timeout=20)
            chromium.close()
    result = {key: summary(values) for key, values in out.items()}
    result.update(server_up_s=round(server_up, 3), cold_start_s=round(cold, 3))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="demo (default when present) or a checkpoint directory")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--browser", action="store_true", help="also measure the real server in chromium")
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
    a = report["apptest"]
    report["verdict"] = {
        "cold_start_s": [report["cold_start"]["in_process_s"], report["cold_start"]["in_process_s"] <= TARGETS["cold_start_s"]],
        "retrace_64_tokens_s": [
            max(a["retrace_model_map"]["median_s"], a["retrace_router"]["median_s"]),
            max(a["retrace_model_map"]["median_s"], a["retrace_router"]["median_s"]) <= TARGETS["retrace_64_tokens_s"],
        ],
        "switch_s": [
            max(a["switch_page_first"]["median_s"], a["switch_block_first"]["median_s"]),
            max(a["switch_page_first"]["median_s"], a["switch_block_first"]["median_s"]) <= TARGETS["switch_s"],
        ],
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
