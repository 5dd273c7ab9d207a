"""How near each routing came to another choice: the router's two margins, one computation for the
trace sites (``ffn.gate.margin``, ``ffn.gate.group_margin``) and the atlas's near-tie counts.

The reference routes in two steps (model.moe.select_experts): groups ranked by their group score
(the sum of their top-2 biased scores, their best one without a bias), then the top-k experts inside
the chosen groups by biased score. Each step has a margin: the last one chosen less the best one
left out. A margin below NEAR_TIE is a near-tie, where a rounding of the scores could change the
choice. Shapes: N routings (tokens), E experts, G groups.
"""

from __future__ import annotations

import torch

NEAR_TIE = 1e-3  # a margin below this is a near-tie: a rounding could change the choice


def expert_margin(biased: torch.Tensor, chosen: torch.Tensor, groups: torch.Tensor | None, n_groups: int) -> torch.Tensor:
    """(N,) the biased score of the k-th chosen expert minus the best expert not chosen inside the
    chosen groups (anywhere, when the chosen groups hold no other, or with one group). ``biased``
    (N, E), ``chosen`` (N, k), ``groups`` (N, topk_groups) or None."""
    biased = biased.float()
    kth = biased.gather(-1, chosen).amin(-1)  # (N,)
    free = torch.ones_like(biased, dtype=torch.bool).scatter_(-1, chosen, False)  # not chosen
    candidates = free
    if groups is not None:
        per_group = biased.shape[-1] // n_groups
        in_groups = torch.zeros(biased.shape[0], n_groups, dtype=torch.bool, device=biased.device).scatter_(-1, groups, True)
        inside = free & in_groups.repeat_interleave(per_group, dim=-1)
        candidates = torch.where(inside.any(-1, keepdim=True), inside, free)
    best = biased.masked_fill(~candidates, float("-inf")).amax(-1)  # (N,)
    return kth - best


def group_margin(group_scores: torch.Tensor, groups: torch.Tensor) -> torch.Tensor | None:
    """(N,) the group score of the weakest chosen group minus the best unchosen group's: how near the
    group step came to another choice; None where every group is chosen (nothing to lose to).
    ``group_scores`` (N, G), ``groups`` (N, topk_groups)."""
    scores = group_scores.float()
    if groups.shape[-1] >= scores.shape[-1]:
        return None
    weakest = scores.gather(-1, groups).amin(-1)  # (N,)
    best = scores.scatter(-1, groups, float("-inf")).amax(-1)  # (N,): the unchosen groups' best
    return weakest - best
