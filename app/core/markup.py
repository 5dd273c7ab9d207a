"""User- and file-derived strings drawn as themselves in Streamlit Markdown (captions, badges, labels,
help texts, errors): a file's name, a directory, a prompt, a token, a trace's metadata.

Streamlit's Markdown is more than CommonMark: ``:red[...]`` and badges are directives,
``:material/x:`` icons, ``:smile:`` emoji (applied to the text after escapes are undone), ``$...$``
KaTeX, and bare URLs, ``www.`` names and e-mail addresses become links (also after escapes). So every
ASCII punctuation character is backslash-escaped, and an invisible word joiner (U+2060) follows each
colon that a space does not, and precedes each ``@`` and the ``.`` after ``www``: the text reads the same and nothing in it
makes an element.
"""

from __future__ import annotations

import re
import string

JOINER = "\u2060"
_PUNCTUATION = re.compile("[" + re.escape(string.punctuation) + "]")
_COLON = re.compile(r"\\:(?=\S)")  # one that could open ":smile:", ":red[" or "http://"
_WWW = re.compile(r"(?i)(www)(\\\.)")


def escape_md(text: str) -> str:
    """``text`` as Markdown that draws exactly ``text`` (on one line) and creates no element."""
    text = _one_line(text)
    text = _PUNCTUATION.sub(lambda m: "\\" + m.group(), text)
    text = _COLON.sub("\\:" + JOINER, text).replace("\\@", JOINER + "\\@")
    return _WWW.sub(lambda m: m.group(1) + JOINER + m.group(2), text)


def code_md(text: str) -> str:
    """``text`` as an inline code span (a site name, a token): no directive, link or emoji inside, and a
    backtick in ``text`` cannot close it."""
    text = _one_line(text)
    if not text:
        return ""
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    # CommonMark strips one space from each side of a span padded on both: pad where that keeps the text
    spaced = text[0] == "`" or text[-1] == "`" or (text[0] == " " and text[-1] == " ")
    pad = " " if spaced else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _one_line(text: object) -> str:
    return re.sub(r"[\r\n\t\f\v]", " ", str(text))
