"""Teacher-forced evaluation of a model on a text: next-token NLL, perplexity, top-1, bits per byte.

The one place this is computed (``python -m tracing eval``, the demo's model card and its tests).

The text is tokenised once (no BOS); the tokens are scored in windows of at most ``context``
positions, each window starting with BOS when the tokenizer has one, as the model saw text in
training. Windows advance by ``stride`` tokens and each token is scored once, in the first window
that reaches it, so every token after the first window has at least ``context - stride`` tokens of
context. Bits per byte are the summed NLL in bits over the UTF-8 bytes of the text scored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ..errors import InputError
from .interventions import applied

DEFAULT_MAX_CONTEXT = 2048  # longest default window (the 671B config allows 163840 positions)
LOGITS_BUDGET = 2**27  # float32 logits per forward pass (512 MB)


def _windows(n: int, span: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first_scored) per window over n targets: a window predicts targets start..end-1
    and scores those from first_scored on (the earlier ones were scored by the window before)."""
    end = min(span, n)
    windows = [(0, end, 0)]
    while end < n:
        new_end = min(end + stride, n)
        windows.append((max(new_end - span, 0), new_end, end))
        end = new_end
    return windows


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    tokenizer,
    text: str,
    context: int | None = None,
    stride: int | None = None,
    batch_size: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    interventions: Sequence = (),
    device: torch.device | None = None,
) -> dict:
    """Score ``text`` with ``model`` (a :class:`model.transformer.Transformer`).

    ``tokenizer`` is a :class:`tracing.tokenizer.Tokenizer` (``encode``, ``bos_id``, ``decode``).
    ``context``: positions per window including BOS (default: the model's ``max_seq_len``, at most
    2048); ``stride``: tokens a window advances (default ``context // 2``); ``batch_size``: windows
    per forward pass (default: as many as keep the float32 logits near 512 MB, at most 8).
    ``interventions`` (tracing.analyses.interventions: ablated experts, no correction bias, another
    index_topk, ...) apply to every window: the loss under an intervention. Returns tokens, mean_nll
    (nats per token), perplexity, top1_accuracy and bits_per_byte, with bytes, context and stride
    (and the interventions, described). ``device``: where the inputs go (default: the parameters'
    device; a streamed model's parameters are on the meta device, so its loader says where it runs).
    """
    if not text:
        raise InputError("evaluate: the text is empty")
    max_len = int(model.args.max_seq_len)
    context = context or min(max_len, DEFAULT_MAX_CONTEXT)
    if context > max_len:
        raise InputError(f"evaluate: context {context} exceeds the model's max_seq_len {max_len}")
    if context < 2:
        raise InputError("evaluate: context must be at least 2")
    bos = tokenizer.bos_id
    ids = tokenizer.encode(text, add_bos=False)
    n_bytes = len(text.encode("utf-8"))
    if bos is None:  # the first token has nothing to be predicted from: not scored, nor its bytes
        n_bytes -= len(tokenizer.decode(ids[:1]).encode("utf-8"))
        targets = ids[1:]
    else:
        targets = ids
    if not targets:
        raise InputError("evaluate: the text is too short to score")
    # a window of `context` inputs predicts `context` targets (the last input predicts the next token)
    stride = stride or max(context // 2, 1)
    if not 0 < stride <= context:
        raise InputError(f"evaluate: stride must be between 1 and the context ({context})")

    device = device if device is not None else next(model.parameters()).device
    if batch_size is None:
        batch_size = max(1, min(8, LOGITS_BUDGET // (context * int(model.args.vocab_size))))
    windows = _windows(len(targets), context, stride)
    total_nll = 0.0
    correct = 0
    count = 0
    # group windows of equal length into batches (all but perhaps the last are full)
    groups: dict[int, list[tuple[int, int, int]]] = {}
    for w in windows:
        groups.setdefault(w[1] - w[0], []).append(w)
    done = 0
    for length, group in groups.items():
        for i in range(0, len(group), batch_size):
            batch = group[i : i + batch_size]
            inputs, tgts, keep = [], [], []
            for start, end, first in batch:
                if bos is not None:  # inputs: BOS, t[start], ..., t[end-2] predict t[start..end-1]
                    inputs.append([bos] + targets[start : end - 1])
                else:  # inputs: ids[start], ..., ids[end-1] predict targets[start..end-1] = ids[start+1..end]
                    inputs.append(ids[start:end])
                tgts.append(targets[start:end])
                keep.append(first - start)  # positions before this were scored by an earlier window
            x = torch.tensor(inputs, dtype=torch.long, device=device)
            y = torch.tensor(tgts, dtype=torch.long, device=device)
            with applied(model, interventions):  # checked and hooked per batch: a few microseconds
                logits = model(x, all_logits=True).float()  # (B, T, V)
            nll = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")  # (B, T)
            hit = logits.argmax(dim=-1) == y
            for row, k in enumerate(keep):
                total_nll += float(nll[row, k:].double().sum())
                correct += int(hit[row, k:].sum())
                count += length - k
            done += len(batch)
            if progress is not None:
                progress(done, len(windows))
    mean_nll = total_nll / count
    return {
        "tokens": count,
        "mean_nll": mean_nll,
        "perplexity": math.exp(mean_nll),
        "top1_accuracy": correct / count,
        "bits_per_byte": total_nll / math.log(2) / n_bytes,
        "bytes": n_bytes,
        "context": context,
        "stride": stride,
        **({"interventions": [i.describe() for i in interventions]} if interventions else {}),
    }
