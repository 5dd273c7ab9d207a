"""How a page declares the session keys it uses, beside its code (a ``KEYS`` tuple in its topic
module): what each holds, its value when a session starts, whether it is carried across pages, and
how its value reads from a link (the URL fields of app.core.links). app.core.session assembles every
page's keys into one schema.

A link is a visitor's input: each value is read by its own type and bound (a prompt of at most
LONGEST characters, numbers of ASCII digits in range, one of a few words); a reader raises
ValueError on a value that does not read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tracing.cli.inputs import parse_float, parse_int
from tracing.errors import InputError

LONGEST = 20_000  # characters of a prompt, as the sidebar's field takes
UNSET = object()

Reader = Callable[[str], Any]


@dataclass(frozen=True)
class Key:
    """One session-state key: what it holds, its value when a session starts (if any), and whether
    it is a widget value carried across pages (Streamlit forgets a widget's value while the widget
    is not drawn: on another page, under another source). A family is a prefix: the key is it plus
    an id (a block, a card, a table). ``link``: how its value reads from the URL, when a link
    carries it (what is written back is str(value), flags as 1/0)."""

    name: str
    what: str
    default: Any = UNSET
    kept: bool = False
    family: bool = False
    link: Reader | None = None


def integer(low: int, high: int) -> Reader:
    """The command line's integer rule (ASCII digits, in range)."""

    def read(text: str) -> int:
        try:
            return parse_int(text, "", low, high)
        except InputError:
            raise ValueError(text) from None

    return read


def number(low: float, high: float) -> Reader:
    """The command line's finite-float rule, in range."""

    def read(text: str) -> float:
        try:
            value = parse_float(text, "")
        except InputError:
            raise ValueError(text) from None
        if not low <= value <= high:
            raise ValueError(text)
        return value

    return read


def one_of(*words: str) -> Reader:
    def read(text: str) -> str:
        if text not in words:
            raise ValueError(text)
        return text

    return read


def flag(text: str) -> bool:
    return {"1": True, "0": False}[text]


def text(longest: int) -> Reader:
    def read(value: str) -> str:
        if len(value) > longest:
            raise ValueError(value[:20])
        return value

    return read


def optional(read: Reader) -> Reader:
    return lambda value: None if value == "" else read(value)


POSITION = optional(integer(0, 1 << 20))
TOKEN = optional(integer(-1, 1 << 24))
