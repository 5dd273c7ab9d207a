"""One traced prefill: prompt or token ids in, a Trace out. The CLI and the app both call this."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from model.transformer import Transformer

from .errors import InputError
from .interventions import Intervention
from .sites import LOGIT_LENS_TOPK, select
from .trace import Trace
from .tracer import Tracer


def check_token_ids(ids: list[int], model: Transformer, max_tokens: int | None = None) -> None:
    limit = max_tokens or model.args.max_seq_len
    if not ids:
        raise InputError("the prompt is empty: nothing to trace")
    if len(ids) > limit:
        raise InputError(f"the prompt has {len(ids)} tokens; this model takes at most {limit}")
    bad = [i for i in ids if not 0 <= i < model.args.vocab_size]
    if bad:
        raise InputError(f"token id {bad[0]} is outside the vocabulary (0..{model.args.vocab_size - 1})")


def trace_tokens(
    model: Transformer,
    ids: list[int],
    tokens: list[str] | None = None,
    prompt: str = "",
    record: Iterable[str] | str | None = None,
    patches: Mapping[str, torch.Tensor] | None = None,
    on_block: Callable[[int], None] | None = None,
    extra: dict[str, Any] | None = None,
    max_tokens: int | None = None,
    token_strings: Callable[[list[int]], list[str]] | None = None,
    interventions: Sequence[Intervention] = (),
) -> Trace:
    """Run ``ids`` through ``model`` once, recording the chosen sites (default: DESIGN.md's table).

    ``token_strings`` (a tokenizer's) names the prompt's tokens and the predicted ones the tables
    show (logit lens, next token), so a trace file reads without the tokenizer.
    """
    check_token_ids(ids, model, max_tokens)
    sites = select(model.args, record)
    # the logit lens reads each block's output: record it for the lens even when not asked to keep it
    lens_inputs = [
        f"layers.{i}.resid_post"
        for i in range(len(model.layers))
        if f"layers.{i}.logit_lens.topk_indices" in sites or f"layers.{i}.logit_lens.topk_probs" in sites
    ]
    hidden = [name for name in lens_inputs if name not in sites]
    device = model.embed.weight.device
    with torch.inference_mode():
        batch = torch.tensor([ids], dtype=torch.long, device=device)
        with Tracer(model, sites + hidden, patches, on_block, interventions) as tracer:
            model(batch)
        values = tracer.values
        _logit_lens(model, values, sites)
        for name in hidden:
            values.pop(name, None)
    values["tokens"] = torch.tensor(ids, dtype=torch.int64)
    info = {"dtype": str(model.dtype).removeprefix("torch.")}  # nothing run-dependent: same prompt, same bytes
    if patches:
        info["patched"] = sorted(patches)
    config = model.args
    if interventions:
        info["interventions"] = [i.describe() for i in interventions]
        for intervention in interventions:
            config = intervention.config(config)
    if token_strings is not None:
        shown = _predicted_ids(values)
        info["vocab"] = dict(zip(map(str, shown), token_strings(shown), strict=True))
        tokens = tokens or token_strings(ids)
    info.update(extra or {})
    return Trace(values, config, tokens or [f"<{i}>" for i in ids], prompt, info)


def _predicted_ids(values: dict[str, torch.Tensor], top: int = 20) -> list[int]:
    ids: set[int] = set()
    for name, value in values.items():
        if name.endswith("logit_lens.topk_indices"):
            ids.update(value.flatten().tolist())
    if "logits.last" in values:
        ids.update(values["logits.last"].topk(min(top, values["logits.last"].numel())).indices.tolist())
    return sorted(ids)


def _logit_lens(model: Transformer, values: dict[str, torch.Tensor], sites: list[str]) -> None:
    """Final norm and head applied to each block's output (resid_post): top tokens and probabilities."""
    device = model.embed.weight.device
    for i in range(len(model.layers)):
        want_ids = f"layers.{i}.logit_lens.topk_indices"
        want_probs = f"layers.{i}.logit_lens.topk_probs"
        if want_ids not in sites and want_probs not in sites:
            continue
        stream = values[f"layers.{i}.resid_post"]
        h = model.norm(stream.to(device), model.dtype)
        probs = model.head(h.float()).softmax(dim=-1)  # (T, V)
        top = probs.topk(LOGIT_LENS_TOPK, dim=-1)
        if want_ids in sites:
            values[want_ids] = top.indices.cpu()
        if want_probs in sites:
            values[want_probs] = top.values.float().cpu()
