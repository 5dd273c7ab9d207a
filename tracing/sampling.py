"""Choosing the next token: greedy, or sampled with a temperature and nucleus (top-p), reproducibly."""

from __future__ import annotations

import math
import secrets
from dataclasses import asdict, dataclass

import torch

from .errors import InputError
from .sites import next_topk

SEEDS = (0, 2**64 - 1)  # what torch.Generator.manual_seed takes
# the smallest temperature: logits are divided by it in float32, where a subnormal (1e-320) is 0
MIN_TEMPERATURE = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class Sampling:
    """How a generation picks each token. ``temperature`` 0 is greedy (the most likely token, as
    ``next.topk_indices`` lists it first); otherwise tokens are drawn from softmax(logits / T),
    restricted to the smallest set of most likely tokens whose probabilities reach ``top_p``,
    with a generator seeded by ``seed`` (the same seed gives the same tokens)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf):  # also refuses NaN
            least = f"{MIN_TEMPERATURE:.3g}"
            raise InputError(f"--temperature must be 0 (greedy) or a finite number of at least {least}, not {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"--top-p must be in (0, 1], not {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> dict:
        return {k: v for k, v in asdict(self).items() if not (self.greedy and k in ("top_p", "seed"))}

    def seeded(self) -> Sampling:
        """This sampling with a concrete seed (drawn when none was given), so the trace records one."""
        if self.greedy or self.seed is not None:
            return self
        return Sampling(self.temperature, self.top_p, secrets.randbelow(2**31))

    def generator(self) -> torch.Generator | None:
        if self.greedy:
            return None
        gen = torch.Generator()
        gen.manual_seed(self.seeded().seed)
        return gen


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """The next token id from one position's float32 logits (V,)."""
    if sampling.greedy:
        return int(next_topk(logits)[0][0])
    logits = logits.float().cpu()
    # shifted so the largest is 0: a small temperature makes the others -inf, never inf - inf
    probs = ((logits - logits.max()) / sampling.temperature).softmax(dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(descending=True, stable=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of the more likely tokens
        sorted_probs[before >= sampling.top_p] = 0  # keep the smallest set that reaches top_p
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
