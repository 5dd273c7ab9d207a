"""What an analysis needs of the other ranks when the model is split over them (model.parallel):
a block's heads are split (each rank holds H / W of them, and its columns of ``wo``), the head's
vocabulary may be split. The attribution and the contribution graph gather what they read, so a
W-rank run gives the one-process values (within float32 summation order); every rank computes them,
each call is a collective every rank makes in the same order. In one process every method returns
what it is given.
"""

from __future__ import annotations

import torch


class Ranks:
    def __init__(self, plan=None):
        self.plan = plan if plan is not None and plan.world > 1 else None

    def _split(self, block: int) -> bool:
        return self.plan is not None and block in self.plan.split_attention

    def heads(self, value: torch.Tensor, block: int, dim: int = 0) -> torch.Tensor:
        """Every head's ``value`` (this rank's heads along ``dim``), in head order."""
        if not self._split(block):
            return value
        import torch.distributed as dist

        value = value.contiguous()
        parts = [torch.empty_like(value) for _ in range(self.plan.world)]
        dist.all_gather(parts, value, group=self.plan.group)
        return torch.cat(parts, dim=dim)

    def heads_sum(self, value: torch.Tensor, block: int) -> torch.Tensor:
        """A sum over every head's part of ``value`` (this rank's heads summed already)."""
        if not self._split(block):
            return value
        import torch.distributed as dist

        value = value.contiguous()
        dist.all_reduce(value, group=self.plan.group)
        return value

    def own_heads(self, value: torch.Tensor, block: int, dim: int) -> torch.Tensor:
        """This rank's heads of ``value``, which holds every head of the block along ``dim`` (a
        patch from a one-process trace): the contiguous range of heads the rank computes."""
        if not self._split(block):
            return value
        n = value.shape[dim] // self.plan.world
        return value.narrow(dim, self.plan.rank * n, n)

    def heads_mean(self, value: torch.Tensor, block: int, dim: int) -> torch.Tensor:
        """The mean over every head of the block of ``value``, whose dim ``dim`` holds this rank's
        heads: their sum here, the ranks' sums added (one all-reduce of the reduced value, never the
        heads themselves), divided by the heads' count. In one process ``value.mean(dim)``."""
        if not self._split(block):
            return value.mean(dim)
        return self.heads_sum(value.sum(dim), block) / (value.shape[dim] * self.plan.world)  # heads split evenly

    @property
    def vocab_split(self) -> bool:
        return self.plan is not None and "head.weight" in self.plan.parts

    def vocab_rows(self, weight: torch.Tensor, ids: list[int]) -> torch.Tensor:
        """Rows ``ids`` of the whole head weight (V, D), from this rank's rows of it: each row is
        on one rank and zero on the others, so the sum is exact."""
        if not self.vocab_split:
            return weight[ids]
        import torch.distributed as dist

        part = self.plan.parts["head.weight"]
        out = weight.new_zeros(len(ids), weight.shape[1])
        for k, i in enumerate(ids):
            if part.start <= i < part.stop:
                out[k] = weight[i - part.start]
        dist.all_reduce(out, group=self.plan.group)
        return out

    def vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary (..., V) from this rank's columns of it."""
        if not self.vocab_split:
            return logits
        import torch.distributed as dist

        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.plan.world)]
        dist.all_gather(parts, logits, group=self.plan.group)
        return torch.cat(parts, dim=-1)
