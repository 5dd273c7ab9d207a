"""The Attribution page's runs without Streamlit (app.topics.attribution_runs): a typed token becomes the
target, the attribution splits the target's logit at the position, the causal check removes the
largest parts at that position, and the pickers and the block fit each new trace."""

from __future__ import annotations

import pytest

from app.core.models import open_model
from app.core.traces import TraceKey, trace_prompt
from app.topics import attribution_runs as runs
from tracing.analyses.attribution import AttributionRequest, removable
from tracing.errors import InputError
from tracing.runner import TraceRequest

PROMPT = "It is a truth universally acknowledged"


@pytest.fixture(scope="module")
def om(app_checkpoint):
    return open_model(app_checkpoint, "bfloat16")


@pytest.fixture(scope="module")
def plain(om):
    return trace_prompt(om, PROMPT)


def test_a_typed_token_is_the_target_and_none_is_no_contrast(om):
    (word,) = om.encode(TraceRequest(prompt=" truth"))[1:]
    assert runs.request_of(om, 2, 5, runs.NONE) == AttributionRequest(2, 5, None)
    assert runs.request_of(om, 2, 5, 7, typed=" truth") == AttributionRequest(2, word, 7)
    assert runs.request_of(om, 2, 5, 7, typed_contrast=str(word)) == AttributionRequest(2, 5, word)
    with pytest.raises(InputError, match="Contrast 999999"):
        runs.request_of(om, 2, 5, 7, typed_contrast="999999")


def test_the_attribution_splits_the_logit_and_the_causal_check_removes_the_largest_parts(om, plain):
    last = plain.trace.n_tokens - 1
    top = int(plain.trace["next.topk_indices"][last, 0])
    entry = runs.attributed(om, plain.key, AttributionRequest(last))
    assert entry.key.plain == plain.key
    assert entry.trace.extra["attribution"] == {"position": last, "target": top, "contrast": None}
    assert float(entry.trace["attribution.total"][0]) == pytest.approx(float(plain.trace["logits.last"][top]), abs=1e-6)
    table = runs.causal(om, plain.key, entry, 2)
    largest = max(removable(entry.trace), key=lambda p: abs(p[0]))[0]
    assert len(table) == 2 and table["removed"].str.endswith(f"at position {last}").all()
    assert table.iloc[0]["attributed"] == pytest.approx(largest, abs=1e-6)
    assert runs.causal(om, plain.key, entry, 2) is table  # made once per trace


def test_pickers_and_block_fit_each_new_trace(om, plain):
    n = plain.trace.n_tokens
    state = {"attr_position": 2, "attr_target": 9}  # a link's values: kept on the session's first trace
    runs.fit_pickers(state, plain.key, n)
    assert state["attr_position"] == 2 and state["attr_target"] == 9
    other = TraceKey.for_prompt(om, PROMPT + " that")
    runs.fit_pickers(state, other, n + 1)  # another trace: the last position's top prediction
    assert state == {"attr_position": n, "attr_target": None, "attr_contrast": None, "attr_picked_for": other}
    entry = runs.attributed(om, plain.key, AttributionRequest(n - 1))
    runs.fit_block(state, entry, 0)
    assert state["attr_block"] == topic_strongest(entry.trace)
    state["attr_block"] = 0  # the reader's choice stays for this trace
    runs.fit_block(state, entry, 0)
    assert state["attr_block"] == 0


def topic_strongest(trace) -> int:
    return max(removable(trace), key=lambda p: abs(p[0]))[2]
