"""Starting the app under Streamlit's testing API, as every app test does."""

from __future__ import annotations

from pathlib import Path

from streamlit.testing.v1 import AppTest

from app.core import settings
from app.core.markup import JOINER

APP = str(Path(__file__).resolve().parents[2] / "app" / "main.py")
TIMEOUT = 120  # the first run loads the model and traces the default prompt


def messages(elements) -> str:
    """The elements' text as the browser draws it: Markdown escapes and the word joiners app.core.markup
    adds removed."""
    return " ".join(str(e.value) for e in elements).replace("\\", "").replace(JOINER, "")


def raised_nothing(at: AppTest) -> AppTest:
    assert not at.exception, [e.value for e in at.exception]
    return at


def start(monkeypatch, checkpoint: str, page: str | None = None, **env: str) -> AppTest:
    """The app on ``checkpoint`` (and ``page``), after its first run traced the default prompt."""
    monkeypatch.setenv(settings.ENV_CHECKPOINT, checkpoint)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    at = raised_nothing(AppTest.from_file(APP, default_timeout=TIMEOUT).run())
    return raised_nothing(at.switch_page(page).run()) if page else at
