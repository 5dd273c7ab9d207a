"""The model map: which blocks are dense and which MoE, where the parameters sit, the config."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from app.core.keys import Key
from model.config import ModelArgs
from model.params import block_components, count_params
from tracing.sites import INDEXER_MISSING

from .figures import COLORS, figure, reversed_axis
from .tokens import show_token

COMPONENT_LABELS = {
    "embedding": "token embedding",
    "attention": "MLA attention",
    "indexer": "lightning indexer",
    "block_norms": "block RMSNorms",
    "dense_mlp": "dense MLP",
    "router": "router",
    "routed_experts": "routed experts",
    "shared_experts": "shared experts",
    "final_norm": "final RMSNorm",
    "head": "output head",
}


CONFIG_GROUPS = {
    "widths": ("vocab_size", "dim", "inter_dim", "moe_inter_dim", "n_layers", "n_dense_layers", "n_heads", "norm_eps"),
    "MLA": ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
    "lightning indexer": ("index_n_heads", "index_head_dim", "index_topk"),
    "MoE router": (
        "n_routed_experts",
        "n_shared_experts",
        "n_activated_experts",
        "n_expert_groups",
        "n_limited_groups",
        "score_func",
        "route_scale",
    ),
    "RoPE / YaRN": ("max_seq_len", "original_seq_len", "rope_theta", "rope_factor", "beta_fast", "beta_slow", "mscale"),
    "storage": ("dtype", "scale_fmt"),
}


@lru_cache(maxsize=8)
def _counts(args: ModelArgs) -> tuple[dict, list[dict[str, int]]]:
    return count_params(args), block_components(args)[1]


def block_params(args: ModelArgs, block: int) -> dict[str, int]:
    return _counts(args)[1][block]


@lru_cache(maxsize=8)
def params_by_block(args: ModelArgs) -> pd.DataFrame:
    """Parameters per block and component."""
    rows = [(b, c, n) for b in range(args.n_layers) for c, n in sorted(block_params(args, b).items())]
    return pd.DataFrame(rows, columns=["block", "component", "params"])


def param_counts(args: ModelArgs) -> dict:
    """Total and per-token activated parameters (model.params.count_params)."""
    return _counts(args)[0]


def params_table(args: ModelArgs) -> pd.DataFrame:
    """Per component: total parameters and those one token activates."""
    counts = param_counts(args)
    per_expert = counts["params_per_expert"]
    rows = []
    for name, total in counts["components"].items():
        if name == "embedding":
            active = 0
        elif name == "routed_experts":
            active = args.n_activated_experts * per_expert * args.n_moe_layers
        else:
            active = total
        rows.append({"component": COMPONENT_LABELS.get(name, name), "key": name, "total": total, "activated": active})
    frame = pd.DataFrame(rows)
    frame["share"] = frame["total"] / frame["total"].sum()
    return frame.sort_values("total", ascending=False, ignore_index=True)


def config_table(cfg: ModelArgs) -> pd.DataFrame:
    groups = CONFIG_GROUPS if cfg.has_indexer else {g: names for g, names in CONFIG_GROUPS.items() if g != "lightning indexer"}
    rows = [(group, name, str(getattr(cfg, name))) for group, names in groups.items() for name in names]
    if not cfg.has_indexer:
        rows.append(("lightning indexer", "indexer", INDEXER_MISSING))
    rows.append(("MoE router", "correction bias", "yes" if cfg.has_gate_bias else "no"))
    rows.append(("RoPE / YaRN", "YaRN", "on" if cfg.use_yarn else "off"))
    rows.append(("MLA", "softmax scale", f"{cfg.softmax_scale:.6f}"))
    return pd.DataFrame(rows, columns=["section", "field", "value"])


def human(n: int) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def token_strip(tokens: list[str]) -> str:
    """Tokens as Markdown badges, position first, whitespace made visible."""
    items = []
    for i, tok in enumerate(tokens):
        shown = show_token(tok, limit=20, html_escape=False).replace("`", "ˋ")
        items.append(f"`{i}`&nbsp;`{shown}`")
    return " ".join(items)


def block_map_figure(args: ModelArgs, per_block: pd.DataFrame, chosen: int | None = None) -> go.Figure:
    """One column per block, its four sub-layers as rows; colour tells dense from MoE."""
    rows = ["attn_norm", "MLA + indexer" if args.has_indexer else "MLA", "ffn_norm", "FFN"]
    n = args.n_layers
    kind = np.zeros((4, n))
    text = np.empty((4, n), dtype=object)
    hover = np.empty((4, n), dtype=object)
    counts = {(b, c): p for b, c, p in per_block.itertuples(index=False)}
    for b in range(n):
        moe = args.is_moe(b)
        mla, indexer = counts.get((b, "attention"), 0), counts.get((b, "indexer"), 0)
        norms = counts.get((b, "block_norms"), 0) // 2
        ffn_parts = ["router", "routed_experts", "shared_experts"] if moe else ["dense_mlp"]
        ffn = sum(counts.get((b, c), 0) for c in ffn_parts)
        if moe:
            ffn_info = (
                f"block {b} MoE<br>router {counts.get((b, 'router'), 0):,} · {args.n_routed_experts} routed experts "
                f"{counts.get((b, 'routed_experts'), 0):,} · shared {counts.get((b, 'shared_experts'), 0):,}"
                f"<br>{ffn:,} params, {args.n_activated_experts} routed experts active per token"
            )
        else:
            ffn_info = f"block {b} dense MLP<br>{ffn:,} params"
        cells = [
            (0.0, "norm", f"block {b} attn_norm<br>RMSNorm, {norms:,} params"),
            (1.0, "MLA", f"block {b} attention<br>MLA {mla:,} + indexer {indexer:,} = {mla + indexer:,} params")
            if args.has_indexer
            else (1.0, "MLA", f"block {b} attention<br>MLA {mla:,} params; {INDEXER_MISSING}"),
            (0.0, "norm", f"block {b} ffn_norm<br>RMSNorm, {norms:,} params"),
            (3.0 if moe else 2.0, "MoE" if moe else "MLP", ffn_info),
        ]
        for r, (value, label, info) in enumerate(cells):
            kind[r, b] = value
            text[r, b] = label if n <= 16 else ""
            hover[r, b] = info
    scale = [
        [0.0, COLORS["norm"]],
        [0.25, COLORS["norm"]],
        [0.25, COLORS["attention"]],
        [0.5, COLORS["attention"]],
        [0.5, COLORS["dense"]],
        [0.75, COLORS["dense"]],
        [0.75, COLORS["moe"]],
        [1.0, COLORS["moe"]],
    ]
    heat = {
        "type": "heatmap",
        "z": kind,
        "x": list(range(n)),
        "y": rows,
        "text": text,
        "texttemplate": "%{text}",
        "customdata": hover,
        "hovertemplate": "%{customdata}<extra></extra>",
        "colorscale": scale,
        "zmin": 0,
        "zmax": 3,
        "showscale": False,
        "xgap": 3,
        "ygap": 3,
    }
    shapes = []
    if chosen is not None:
        shapes.append(
            {
                "type": "rect",
                "x0": chosen - 0.5,
                "x1": chosen + 0.5,
                "y0": -0.5,
                "y1": 3.5,
                "line": {"color": "black", "width": 2},
            }
        )
    return figure(
        [heat],
        height=240,
        shapes=shapes,
        yaxis=reversed_axis(),
        xaxis={"title": {"text": "block (teal: dense MLP · red: MoE)"}, "dtick": 1 if n <= 32 else 5},
    )


def params_figure(frame: pd.DataFrame) -> go.Figure:
    """Total and per-token activated parameters per component, log scale."""
    traces = []
    for column, color, name in (("total", "#4C78A8", "total"), ("activated", "#F58518", "activated per token")):
        traces.append(
            {
                "type": "bar",
                "y": frame["component"],
                "x": frame[column].where(frame[column] > 0),
                "orientation": "h",
                "name": name,
                "marker": {"color": color},
                "customdata": np.stack([frame[column], frame["share"] * 100], axis=-1),
                "hovertemplate": "%{y}<br>"
                + name
                + ": %{customdata[0]:,}<br>%{customdata[1]:.2f}% of all parameters<extra></extra>",
            }
        )
    return figure(
        traces,
        height=60 + 34 * len(frame),
        barmode="group",
        xaxis={"type": "log", "title": {"text": "parameters (log scale)"}},
        yaxis=reversed_axis(),
    )


# the Model map page's session keys (app.core.session assembles every page's into its schema)
KEYS: tuple[Key, ...] = (Key("map_block", "Model map: the block whose parameters are listed"),)
