"""Tokens as the figures show them: whitespace made visible, HTML escaped (plotly renders some
tags), long ones shortened."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from tracing.trace import Trace

if TYPE_CHECKING:
    from app.core.session import View
    from app.core.traces import Entry


def show_token(token: str, limit: int = 24, html_escape: bool = True) -> str:
    text = token.replace("\n", "⏎").replace("\t", "⇥").replace("\r", "␍")
    if text.startswith(" "):
        text = "␣" + text[1:]
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    text = text or "∅"
    # plotly decodes numeric entities and only a few named ones (not &quot;): a quote as &#34;
    return html.escape(text).replace("&quot;", "&#34;") if html_escape else text


def token_texts(trace: Trace) -> list[str]:
    return [show_token(t) for t in trace.tokens]


def position_labels(trace: Trace) -> list[str]:
    """Axis labels ``3 ␣truth`` (long tokens shortened; hovers show them in full elsewhere)."""
    return [f"{i} {show_token(t, limit=14)}" for i, t in enumerate(trace.tokens)]


def labels(holder: View | Entry) -> list[str]:
    """The position labels of a view's (or a store entry's) trace, made once per trace."""
    return holder.memo("labels", lambda: position_labels(holder.trace))
