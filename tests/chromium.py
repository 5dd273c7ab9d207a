"""Debian's chromium, as the browser tests and scripts/bench_app.py drive it through Playwright (no
browser download): where it is and the flags of a quiet headless run."""

from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
