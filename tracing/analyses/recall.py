"""The indexer's recall: the share of the dense attention mass that falls on the keys it selected.

One computation for the trace site ``layers.{i}.attn.indexer.recall`` and for the atlas. The dense
distribution is MLA's softmax of the scaled logits (``attn.scores``) under the causal mask alone, per
head, formed in float32 from the logits as they are (the softmax converts them on the fly); its
probabilities are gathered at the K selected keys and added, so no (T, S) mask of the selection is
built or multiplied in.
"""

from __future__ import annotations

import torch


def head_recall(scores: torch.Tensor, selected: torch.Tensor, distinct: bool = False) -> torch.Tensor:
    """Per query and head, the dense attention mass on the selected keys, float32.

    ``scores`` (B, T, H, S): scaled logits of the last T queries of S positions over every key;
    ``selected`` (B, T, K): key positions, -1 for none. A key after its query counts not at all and
    a key listed twice once, as the sparse mask treats them; ``distinct`` says no key is listed
    twice (the indexer's own top-k; a forced selection may repeat one), which saves a sort.
    """
    bsz, seqlen, heads, n_keys = scores.shape
    if seqlen > 1:  # one query (a decode step) is the last position: it sees every key
        causal = torch.ones(seqlen, n_keys, dtype=torch.bool, device=scores.device).tril(n_keys - seqlen)  # (T, S)
        scores = scores.masked_fill(~causal[:, None, :], float("-inf"))
    dense = scores.softmax(dim=-1, dtype=torch.float32)  # (B, T, H, S)
    keys = selected if distinct else selected.sort(dim=-1).values  # (B, T, K)
    query = torch.arange(n_keys - seqlen, n_keys, device=keys.device)[None, :, None]  # (1, T, 1)
    valid = (keys >= 0) & (keys <= query)
    if not distinct:
        valid[..., 1:] &= keys[..., 1:] != keys[..., :-1]
    picked = dense.gather(-1, keys.clamp(min=0)[:, :, None, :].expand(-1, -1, heads, -1))  # (B, T, H, K)
    return (picked * valid[:, :, None, :]).sum(dim=-1)  # (B, T, H)
