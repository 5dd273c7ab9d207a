"""The Interventions page's runs as plain functions over an AppModel: the page's picks (plain values of
its session state) made into a spec (tracing.analyses.intervention_specs.from_spec reads it), the baseline
and the intervened trace of one prompt, their diff; and the prompt on a second checkpoint of the same
tokenizer, compared block by block. The page lays these out; nothing here draws."""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from pathlib import PurePath
from typing import Any

import pandas as pd

from app.core.keys import Key, flag, one_of, text
from app.core.models import AppModel, open_model
from app.core.traces import Entry, TraceKey, request_for, store, trace_prompt
from model.config import ModelArgs
from tracing.analyses.diff import check_shapes, check_tokenizers, diff_tables, summary
from tracing.analyses.graph import Graph
from tracing.analyses.intervention_specs import from_spec
from tracing.analyses.interventions import Intervention
from tracing.errors import InputError

from .interventions import ARRIVING, PER_BLOCK, PerBlock, moe_block_ids

PAIR_SITES = ("default", "logits.all", "layers.*.logit_lens.*")  # both checkpoints record these (the per-position KL)
PAIR = "checkpoint diff"  # the store's variant of a trace made for the comparison


# --- the picks: session values in, a spec out ---------------------------------------------------------------
def spec_of(state: Mapping, cfg: ModelArgs) -> dict[str, Any]:
    """The interventions the picks ask for: ``{"ablate" | "zero_experts" | "ablate_heads": {block: [ids]},
    "no_bias": None | "all" | [blocks], "attention": None | "dense" | k, "no_act_fp8": bool, "at": None | "P" |
    "A:B"}`` (the positions the removals act at). InputError when typed ids do not parse."""
    spec: dict[str, Any] = {kind.spec_key: kind.picked(state, cfg) for kind in PER_BLOCK}
    no_bias = None
    if state.get("iv_no_bias") and cfg.has_gate_bias:
        chosen = state.get("iv_no_bias_blocks") or []
        no_bias = sorted(int(b) for b in chosen) if chosen else "all"
    mode = state.get("iv_attention", "model") if cfg.has_indexer else "model"
    attention = "dense" if mode == "dense" else int(state.get("iv_topk") or 1) if mode == "topk" else None
    at = (state.get("iv_at") or "").strip()
    no_act_fp8 = bool(state.get("iv_no_act_fp8")) and cfg.dtype == "fp8" and cfg.has_indexer
    return {**spec, "no_bias": no_bias, "attention": attention, "no_act_fp8": no_act_fp8, "at": at or None}


def changes(spec: Mapping[str, Any]) -> list[Intervention]:
    """What ``spec`` changes (empty: nothing to run); InputError when it does not read."""
    return from_spec(spec)


def read_graph(files: Sequence[tuple[str, bytes]]) -> Graph | None:
    """The intervention graph of uploaded files (name, bytes): one ``.json`` graph, and the
    ``.safetensors`` file it names when it has tensor constants; None when no file is given."""
    if not files:
        return None
    graphs = [(name, data) for name, data in files if name.lower().endswith(".json")]
    if len(graphs) != 1:
        raise InputError(f"Upload one graph file (.json), and the .safetensors file it names; got {len(graphs)} .json files.")
    others = {PurePath(name).name: data for name, data in files if not name.lower().endswith(".json")}

    def beside(name: str) -> bytes:
        if name not in others:
            raise InputError(f"The graph's constants are in {name}: upload that file with the graph.")
        return others[name]

    name, data = graphs[0]
    return Graph.from_file(data, beside, name).check()


def add_expert(state: MutableMapping, key: str, expert: int) -> None:
    state[key] = sorted({*(state.get(key) or []), expert})


def clear(state: MutableMapping) -> None:
    """Every pick back to none: the model as it is."""
    for kind in PER_BLOCK:
        for key in [k for k in state if kind.block_of(k) is not None]:
            state[key] = []
        state[kind.text_key] = ""
    state["iv_no_bias"] = False
    state["iv_no_bias_blocks"] = []
    state["iv_attention"] = "model"
    state["iv_no_act_fp8"] = False
    state["iv_at"] = ""


def keep(state: MutableMapping, cfg: ModelArgs) -> None:
    """Carry the per-block picks across block switches (the page's other widgets are kept by the
    session's schema), dropping values this config lacks."""
    for kind in PER_BLOCK:
        _keep_picks(state, kind, cfg)
    blocks = moe_block_ids(cfg)
    state["iv_no_bias_blocks"] = [b for b in state.get("iv_no_bias_blocks", []) if b in blocks]
    state.setdefault("iv_no_bias", False)
    state.setdefault("iv_attention", "model")
    state.setdefault("iv_topk", max(1, cfg.index_topk // 2))
    state["iv_topk"] = min(max(1, int(state["iv_topk"])), cfg.max_seq_len)
    state.setdefault("iv_only_changed", True)
    state.setdefault("iv_at", "")


def _keep_picks(state: MutableMapping, kind: PerBlock, cfg: ModelArgs) -> None:
    blocks, ids = kind.blocks(cfg), kind.ids(cfg)
    for key in [k for k in state if kind.block_of(k) is not None]:
        if kind.block_of(key) not in blocks:
            del state[key]
        else:
            state[key] = [i for i in state[key] if i in ids]
    if kind.text_key in state:
        state[kind.text_key] = state[kind.text_key]
    block = state.get(kind.block_key)
    if block not in blocks:
        chosen = state.get("block", 0)
        block = chosen if chosen in blocks else (blocks[0] if blocks else None)
    state[kind.block_key] = block


def arrive(state: MutableMapping) -> bool:
    """Take a removal another page asked for (app.topics.interventions.ask_to_remove): it alone is picked.
    True when there was one, to run it now."""
    asked = state.pop(ARRIVING, None)
    if not asked:
        return False
    clear(state)
    for kind in PER_BLOCK:
        for block, ids in (asked.get(kind.spec_key) or {}).items():
            state[f"{kind.prefix}{block}"] = list(ids)
            state[kind.block_key] = block
    state["iv_at"] = asked.get("at") or ""
    return True


# --- the runs ---------------------------------------------------------------------------------------------------
def baseline(om: AppModel, key: TraceKey) -> Entry:
    """The plain trace of the prompt ``key`` names (also when it names an intervened one), writing the
    same tokens the same way when it generates: the intervened run generates with it."""
    entry = store().get(key.plain)
    if entry is not None:
        return entry
    return trace_prompt(om, key.prompt, generation=key.generation, chat=key.chat)


def intervened(
    om: AppModel,
    base: Entry,
    spec: Mapping[str, Any],
    on_block: Callable[[int], None] | None = None,
    graph: Graph | None = None,
) -> Entry:
    """The baseline's prompt run again with ``spec``'s interventions and ``graph`` (from the store when it
    has the run), generating as the baseline did."""
    key = base.key
    return trace_prompt(om, key.prompt, on_block, interventions=spec, generation=key.generation, chat=key.chat, graph=graph)


def diff(base: Entry, iv: Entry) -> tuple[dict[str, pd.DataFrame], dict]:
    """The diff tables of the two runs (tracing.analyses.diff) and their summary, each made once.
    InputError when the runs are not of the same tokens."""
    tables = iv.memo(("diff", base.key), lambda: diff_tables(base.trace, iv.trace))
    info = iv.memo(("diff_summary", base.key), lambda: summary(base.trace, iv.trace, tables))
    return tables, info


# --- another checkpoint -----------------------------------------------------------------------------------------
def open_other(om: AppModel, value: str) -> AppModel:
    """The checkpoint ``value`` names, in ``om``'s dtype, refused (the error says why) when it does not open
    (confined under the roots: app.core.paths) or its shapes differ from ``om``'s."""
    other = open_model(value, om.dtype)
    check_shapes(om.args, other.args, "the checkpoints are models")
    return other


def traced_pair(om: AppModel, base: Entry, other: AppModel) -> tuple[Entry, Entry]:
    """The baseline's prompt (without its generation) on both models, recording :data:`PAIR_SITES`; refused
    when the tokenizers make other tokens of the prompt (checked before the other model runs)."""
    key = base.key
    a = trace_prompt(om, key.prompt, variant=PAIR, record=PAIR_SITES, chat=key.chat)
    check_tokenizers(a.trace.token_ids, other.encode(request_for(other, key.prompt, chat=key.chat)))
    b = trace_prompt(other, key.prompt, variant=PAIR, record=PAIR_SITES, chat=key.chat)
    check_tokenizers(a.trace.token_ids, b.trace.token_ids, pieces_a=a.trace.tokens, pieces_b=b.trace.tokens)
    return a, b


def pair_diff(a: Entry, b: Entry) -> tuple[dict[str, pd.DataFrame], dict]:
    """The two checkpoints' diff tables and summary, each made once."""
    tables = b.memo(("checkpoint_diff", a.key), lambda: diff_tables(a.trace, b.trace))
    info = b.memo(("checkpoint_summary", a.key), lambda: summary(a.trace, b.trace, tables))
    return tables, info


# the Interventions page's session keys (app.core.session assembles every page's into its schema)
KEYS: tuple[Key, ...] = (
    Key("iv_result", "Interventions: the last run, {base: the baseline's key, spec: what was run}"),
    Key("iv_arriving", "Interventions: a removal another page asked for, run on arrival"),
    Key("iv_run", "Interventions: the Run button"),
    Key("iv_clear", "Interventions: the Clear button"),
    Key("iv_only_changed", "Interventions: show only what changed", kept=True),
    Key("iv_no_bias", "Interventions: route without the correction bias", kept=True, link=flag),
    Key("iv_no_bias_blocks", "Interventions: ... in these blocks", kept=True),
    Key(
        "iv_attention",
        "Interventions: the attention (sparse, dense, another top-k)",
        kept=True,
        link=one_of("model", "dense", "topk"),
    ),
    Key("iv_topk", "Interventions: the other index_topk", kept=True),
    Key("iv_no_act_fp8", "Interventions: FP8 products without the activations' rounding", False, kept=True, link=flag),
    Key("iv_at", "Interventions: the positions the removals act at (P, A:B; empty: every position)", kept=True, link=text(64)),
    Key("iv_graph", "Interventions: the intervention graph uploaded (a .json, and the .safetensors it names)"),
    Key("iv_load_block", "Interventions: the block whose expert load is shown"),
    Key("iv_add_busiest_", "Interventions: add the busiest experts (per kind)", family=True),
    Key("iv_experts_", "Interventions: experts ablated in a block", family=True),
    Key("iv_block", "Interventions: the block whose experts are being ablated"),
    Key("iv_ablate_text", "Interventions: experts to ablate, typed as LAYER:EXPERT,..."),
    Key("iv_zeroed_", "Interventions: experts zeroed in a block", family=True),
    Key("iv_zero_block", "Interventions: the block whose experts are being zeroed"),
    Key("iv_zero_text", "Interventions: experts to zero, typed"),
    Key("iv_heads_", "Interventions: heads ablated in a block", family=True),
    Key("iv_head_block", "Interventions: the block whose heads are being ablated"),
    Key("iv_head_text", "Interventions: heads to ablate, typed"),
    Key("iv_show", "Interventions: show the intervened trace in the other pages"),
    Key("iv_show_base", "Interventions: show the baseline again"),
    Key("iv_dl_trace", "Interventions: the intervened trace's download"),
    Key("iv_dl_zip", "Interventions: the comparison tables' download"),
    Key("iv_dl_csv_", "Interventions: a comparison table's CSV download (the table)", family=True),
    Key("iv_compare", "Interventions: compare with interventions or another checkpoint", "interventions", kept=True),
    Key("iv_other_dir", "Interventions: the other checkpoint's directory typed", "", kept=True),
    Key("iv_other_run", "Interventions: the Compare the checkpoints button"),
    Key("iv_other_result", "Interventions: the last checkpoint comparison, {base: the baseline's key, dir: as typed}"),
    Key("iv_other_zip", "Interventions: the checkpoint comparison's tables' download"),
    Key("iv_other_csv_", "Interventions: a checkpoint comparison table's CSV download (the table)", family=True),
)
