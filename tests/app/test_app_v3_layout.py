"""The app on a checkpoint in DeepSeek-V3's layout (no lightning indexer): every page renders, and
every indexer view says in one line that the model has none instead of failing or staying blank."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from app.core import pages
from tests.app.apptest import messages, raised_nothing, start
from tests.devcheckpoint import make_dev_checkpoint
from tracing.sites import INDEXER_MISSING

NO_INDEXER = INDEXER_MISSING[0].upper() + INDEXER_MISSING[1:]


@pytest.fixture(scope="module")
def v3_checkpoint(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("v3") / "checkpoint"
    make_dev_checkpoint(directory, v3=True)
    return str(directory)


@pytest.fixture()
def app(v3_checkpoint, monkeypatch) -> AppTest:
    return start(monkeypatch, v3_checkpoint)


def test_every_page_renders(app):
    for page in pages.PAGES:
        raised_nothing(app.switch_page(page.path).run())
        assert not app.error, (page.name, messages(app.error))


@pytest.mark.parametrize("tab", ["Index scores", "Indexer recall", "One query", "Sinks"])
def test_the_attention_pages_indexer_views_say_there_is_none(app, tab):
    app.switch_page("views/attention.py").run()
    app.session_state["attention_tab"] = tab
    raised_nothing(app.run())
    assert NO_INDEXER in messages(app.info) and not app.get("plotly_chart")


def test_the_attention_pattern_is_drawn_over_every_causal_key(app):
    app.switch_page("views/attention.py").run()
    app.session_state["attention_tab"] = "Attention"
    raised_nothing(app.run())
    assert app.get("plotly_chart") and NO_INDEXER not in messages(app.info)


def test_the_model_map_and_the_indexer_cards_say_there_is_none(app):
    raised_nothing(app.switch_page("views/model_map.py").run())
    assert NO_INDEXER in messages(app.info)
    app.session_state["model_map_tab"] = "Config"
    raised_nothing(app.run())
    assert INDEXER_MISSING in app.dataframe[0].value.to_string()
    app.switch_page("views/anatomy.py").run()
    for card in ("indexer", "sparse_mask", "mla"):
        raised_nothing(app.button_group(key="anatomy_component").set_value(card).run())
        said = NO_INDEXER in messages(app.info)
        assert said == (card != "mla"), card
        assert bool(app.get("plotly_chart")) == (card == "mla"), card
