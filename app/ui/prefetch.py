"""Fetch the browser's plotting code while the server is still starting the model.

Streamlit's frontend loads plotly.js (a 4.7 MB module) the first time a page draws a chart, and on a
fresh session that is after the first run has imported torch and traced the prompt: seconds in which
the browser idles. A module script asks for the same file at the start of that first run; the
browser fetches and evaluates it once, and the chart component finds it loaded. Nothing here
imports torch, so main.py sends it before the heavy imports."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import streamlit as st

# the chunk file names carry a hash of the Streamlit build: looked up in the installed package
CHUNKS = Path(st.__file__).resolve().parent / "static" / "static" / "js"


@cache
def plotly_chunk() -> str | None:
    """The file name of the installed Streamlit's plotly chart module, if it has one."""
    found = sorted(CHUNKS.glob("PlotlyChart.*.js"))
    return found[0].name if found else None


def script() -> str | None:
    """A module script importing that file beside Streamlit's own index script (so the URL, and the
    module, is the one the chart component imports), and a style that takes its empty element out of
    the layout; None when the installed Streamlit has no such file."""
    name = plotly_chunk()
    if name is None:
        return None
    return (
        '<style>[data-testid="stElementContainer"]:has(script[data-prefetch]) {display: none}</style>'
        '<script type="module" data-prefetch>'
        "const index = document.querySelector('script[src*=\"static/js/index.\"]');"
        f'if (index) import(new URL("./{name}", index.src).href).catch(() => {{}});'
        "</script>"
    )


def plotly() -> None:
    """Send the script. Its JavaScript is this module's own constant text: no input reaches it."""
    body = script()
    if body is not None:
        st.html(body, unsafe_allow_javascript=True)
