"""One traced prefill: prompt or token ids in, a Trace out. The CLI and the app both call this."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from model import kernels
from model.transformer import Transformer

from .analyses.attribution import AttributionRequest
from .analyses.interventions import Intervention
from .errors import InputError
from .nonfinite import first_nonfinite
from .sampling import Sampling, choose
from .trace import Trace
from .tracer import Tracer


def check_token_ids(ids: list[int], model: Transformer, max_tokens: int | None = None, generate: int = 0) -> None:
    """The prompt's ids, and the positions a generation of ``generate`` tokens adds, fit the model."""
    limit = max_tokens or model.args.max_seq_len
    if not ids:
        raise InputError("the prompt is empty: nothing to trace")
    if len(ids) > limit:
        raise InputError(f"the prompt has {len(ids)} tokens; this model takes at most {limit}")
    if generate < 0:
        raise InputError(f"--generate must be 0 or more, not {generate}")
    if len(ids) + generate > limit:
        raise InputError(f"{len(ids)} prompt tokens + {generate} generated exceed the {limit} this model takes")
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
    device: torch.device | str | None = None,
    context: AbstractContextManager | None = None,
    plan=None,
    prefill: int | None = None,
    generate: int = 0,
    sampling: Sampling | None = None,
    attribution: AttributionRequest | None = None,
) -> Trace:
    """Run ``ids`` through ``model``, recording the chosen sites (default: the default sites, docs/architecture.md).

    ``prefill``: the first ``prefill`` positions run as one prefill, each later one alone through
    the decode path (absorbed MQA attention over the cached latents, the indexer over the cached
    FP8 keys), as a generation feeds its tokens back; the trace has the sites and shapes of one
    prefill of every position. Default: one prefill of all.

    ``generate``: after the prompt, this many new tokens, each chosen from the last position's
    logits (``sampling``: greedy by default) and fed back through the decode path; the run stops
    early after the model's end-of-sequence token. The trace covers every position that ran.

    ``token_strings`` (a tokenizer's) names the prompt's tokens and the predicted ones the tables
    show (logit lens, next token), so a trace file reads without the tokenizer. ``context`` is
    entered around the forward after the tracer's hooks (a :class:`model.stream.Streamer`);
    ``plan`` is the tensor-parallel plan when the model is split over ranks.

    ``attribution``: record the direct logit attribution (tracing.analyses.attribution) at its position for
    its target; the resolved position, target and contrast go to ``extra["attribution"]``. With
    ``prefill`` or ``generate`` the position is read in the pass that ran it (the default, the
    last, is the run's last position); a position a generation did not reach (it stopped at the
    end-of-sequence token) is an InputError.
    """
    check_token_ids(ids, model, max_tokens, generate)
    if attribution is not None:
        attribution.check(len(ids) + generate, model.args.vocab_size)
    sampling = (sampling or Sampling()).seeded()
    n_prefill = len(ids) if prefill is None else prefill
    if not 1 <= n_prefill <= len(ids):
        raise InputError(f"--prefill {n_prefill}: must be between 1 and {len(ids)}, the number of tokens")
    if patches and (n_prefill < len(ids) or generate):
        what = "--generate" if generate else "--prefill"
        raise InputError(f"--patch applies to one prefill of every position: it cannot be combined with {what}")
    if device is None:
        device = model.embed.weight.device
        device = torch.device("cpu") if device.type == "meta" else device
    with torch.inference_mode(), kernels.serial_passes():  # this thread's CPU threads, as they were after
        batch = torch.tensor([ids], dtype=torch.long, device=device)
        ids = list(ids)
        n_prompt, stopped = len(ids), None
        tracer = Tracer(model, record, patches, on_block, interventions, plan, attribution)
        with tracer, context or nullcontext():
            tracer.token_ids = ids  # the tracer reads each position's following token (appended as chosen)
            cache = model.new_cache()
            logits = model(batch[:, :n_prefill], cache=cache)
            for pos in range(n_prefill, len(ids)):  # the decode path, one position at a time
                tracer.next_pass(pos)
                logits = model(batch[:, pos : pos + 1], start_pos=pos, cache=cache)
            generator = sampling.generator()
            for _ in range(generate):
                ids.append(choose(logits[0], sampling, generator))
                tracer.next_pass(len(ids) - 1)
                logits = model(torch.tensor([ids[-1:]], device=device), start_pos=len(ids) - 1, cache=cache)
                if ids[-1] == model.args.eos_token_id:
                    stopped = "eos"
                    break
        values = tracer.merged(len(ids))
    if tracer.attributes and not tracer.attribution_info:
        raise InputError(f"--position {attribution.position}: the run ended after {len(ids)} positions (end of sequence)")
    values["tokens"] = torch.tensor(ids, dtype=torch.int64)
    info = {"dtype": str(model.dtype).removeprefix("torch.")}  # nothing run-dependent: same prompt, same bytes
    if n_prefill < n_prompt:
        info["prefill"] = n_prefill  # positions n_prefill.. ran through the decode path
    if generate:
        info["generation"] = {
            "start": n_prompt,  # the first generated position
            "requested": generate,
            "generated": len(ids) - n_prompt,
            "stopped": stopped or "length",
            **sampling.describe(),
        }
    if (bad := first_nonfinite(values, model.args, len(ids))) is not None:
        info["nonfinite"] = bad.as_dict()
    if patches:
        info["patched"] = sorted(patches)
    config = model.args
    if interventions:
        info["interventions"] = [i.describe() for i in interventions]
        for intervention in interventions:
            config = intervention.config(config)
    if tracer.attribution_info:
        info["attribution"] = tracer.attribution_info
    if token_strings is not None:
        attributed = [tracer.attribution_info.get(key) for key in ("target", "contrast")]
        shown = sorted({*_predicted_ids(values), *(i for i in attributed if i is not None)})
        info["vocab"] = dict(zip(map(str, shown), token_strings(shown), strict=True))
        tokens = tokens if tokens is not None and len(tokens) == len(ids) else token_strings(ids)
    info.update(extra or {})
    if tokens is None or len(tokens) != len(ids):
        tokens = [f"<{i}>" for i in ids]
    return Trace(values, config, tokens, prompt, info)


def _predicted_ids(values: dict[str, torch.Tensor], top: int = 20) -> list[int]:
    ids: set[int] = set()
    for name, value in values.items():
        if name.endswith(("logit_lens.topk_indices", "next.topk_indices", "expert_lens.ids")):
            ids.update(i for i in value.flatten().tolist() if i >= 0)
    if "logits.last" in values:
        ids.update(values["logits.last"].topk(min(top, values["logits.last"].numel())).indices.tolist())
    return sorted(ids)
