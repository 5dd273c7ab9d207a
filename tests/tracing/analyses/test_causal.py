"""The causal check of an attribution: each of the largest parts removed at the attributed
position only, its measured effect beside its attributed value."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from tracing import TraceRequest, run
from tracing.analyses.causal import causal_check
from tracing.cli.commands import main
from tracing.errors import InputError

IDS = [7, 3, 99, 41, 250, 18, 6, 77, 301, 12, 5, 64, 200, 9]


def test_each_part_is_removed_at_the_attributed_position_and_measured(tiny_model):
    request = TraceRequest(token_ids=IDS, attribute=True, position=9)
    table = causal_check(lambda r: run(tiny_model, r), request, n=4)
    assert len(table) == 4 and set(table["kind"]) <= {"head", "expert"}
    assert list(table["attributed"].abs()) == sorted(table["attributed"].abs(), reverse=True)  # the largest first
    assert table["removed"].str.endswith("at position 9").all()
    plain = run(tiny_model, request)
    total, target = float(plain["attribution.total"][0]), plain.extra["attribution"]["target"]
    for row in table.itertuples():  # effect = the plain total less the total with the part removed there, same target
        spec = {"ablate_heads" if row.kind == "head" else "zero_experts": f"{row.block}:{row.index}@9"}
        again = TraceRequest(token_ids=IDS, attribute=True, position=9, target=target, interventions=spec)
        without = run(tiny_model, again)
        assert row.effect == pytest.approx(total - float(without["attribution.total"][0]), abs=1e-6)
    assert -1 <= table.attrs["correlation"] <= 1 or math.isnan(table.attrs["correlation"])


def test_the_check_needs_an_attribution_and_a_positive_count(tiny_model):
    with pytest.raises(InputError, match="--attribute"):
        causal_check(lambda r: run(tiny_model, r), TraceRequest(token_ids=IDS), n=3)
    with pytest.raises(InputError, match="--causal"):
        causal_check(lambda r: run(tiny_model, r), TraceRequest(token_ids=IDS, attribute=True), n=0)


def test_run_causal_writes_the_table_and_says_the_correlation(tiny_checkpoint, tmp_path, capsys):
    ids = ",".join(map(str, IDS))
    argv = ["run", "--checkpoint", str(tiny_checkpoint), "--token-ids", ids, "--out", str(tmp_path / "t.safetensors")]
    assert main([*argv, "--attribute", "--causal", "3", "--csv", str(tmp_path / "csv")]) == 0
    table = pd.read_csv(tmp_path / "csv" / "causal.csv")
    assert list(table.columns) == ["part", "block", "kind", "index", "attributed", "effect", "removed"] and len(table) == 3
    assert "correlation" in capsys.readouterr().err
    assert main([*argv, "--causal", "3"]) == 2
    assert "--causal applies to --attribute" in capsys.readouterr().err
