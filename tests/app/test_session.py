"""The session's keys are declared in one schema (app.core.session.SCHEMA, assembled from each page's
KEYS): every key the app's code names is in it, and every key in it is used outside its declaration."""

import ast
import re
from pathlib import Path

from app.core.session import CARDED_PAGES, FAMILIES, SCHEMA, TABBED_PAGES, declared
from app.topics.interventions import ARRIVING, PER_BLOCK

APP = Path(__file__).resolve().parents[2] / "app"
# a key as the code names it: session_state[...] / .get(...) / .pop(...) / .setdefault(...) (or a topic's
# state, the session's values as a plain mapping), a widget's key=, or a constant the views keep; f-strings
# give their literal start (a family's prefix)
USES = re.compile(r"""(?:\b(?:session_)?state(?:\[|\.get\(|\.pop\(|\.setdefault\()|\bkey=|^[A-Z_]+ = )\s*(f?)"([^"{]*)""", re.M)


def named_keys() -> dict[str, bool]:
    """Every key literal in app/: name -> whether it is an f-string's start."""
    found = {}
    for path in APP.rglob("*.py"):
        for fstring, name in USES.findall(path.read_text()):
            # a key is a snake_case name (a constant's text may be anything); anatomy's "all" is a choice
            if re.fullmatch(r"[a-z][a-z0-9_]*", name) and name != "all":
                found[name] = found.get(name, False) or bool(fstring)
    for kind in PER_BLOCK:
        found.update({kind.prefix: True, kind.block_key: False, kind.text_key: False})
    found[ARRIVING] = False
    return found


def code_without_declarations() -> str:
    """The app's code less its Key(...) declarations: where a key is used."""
    kept = []
    for path in APP.rglob("*.py"):
        source = path.read_text()
        declared_at = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Key":
                declared_at.update(range(node.lineno, node.end_lineno + 1))
        kept += [line for i, line in enumerate(source.splitlines(), 1) if i not in declared_at]
    return "\n".join(kept)


def test_every_key_the_app_names_is_declared():
    for name, prefix in named_keys().items():
        if prefix:
            assert name in FAMILIES or declared(name + "0"), f"key family {name!r}... is not in app.core.session.SCHEMA"
        else:
            assert declared(name), f"session key {name!r} is not in app.core.session.SCHEMA"


def test_every_declared_key_is_used():
    names = named_keys()
    used = set(names) | {f"{page}_tab" for page in TABBED_PAGES} | {f"{page}_cards" for page in CARDED_PAGES}
    text = code_without_declarations()
    for key in SCHEMA:
        assert key.name in used or f'"{key.name}' in text, f"{key.name!r} is declared but never used"


def test_every_key_a_visit_of_every_page_leaves_is_declared(app_checkpoint, monkeypatch):
    """At run time too: a key the app sets by any route (a widget's positional key, a callback) is
    declared."""
    from streamlit.testing.v1 import AppTest

    from app.core import pages, settings
    from tests.app.test_app import APP, TIMEOUT

    monkeypatch.setenv(settings.ENV_CHECKPOINT, app_checkpoint)
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    seen = set()
    for page in pages.PAGES:
        at = at.switch_page(page.path).run()
        assert not at.exception, [e.value for e in at.exception]
        seen |= set(at.session_state._state._state.filtered_state)
    undeclared = sorted(key for key in seen if not declared(key))
    assert not undeclared, f"session keys not in app.core.session.SCHEMA: {undeclared}"
