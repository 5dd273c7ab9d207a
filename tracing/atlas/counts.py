"""What the atlas counts, batch by batch, at the model's hook points.

Forward hooks on the router's and the indexer's hook points turn each batch's selections, gate
weights and scores into counts as the model produces them and drop them: nothing of a batch
outlives it but its counts, so memory does not grow with the corpus. A batch's counts are held
apart until the batch completes (:meth:`AtlasCounts.commit`): an interrupted batch leaves the
totals as they were.

Every total is an integer, so totals add up exactly in any order: batch 1 or 4, one process or
several ranks, a run or its resumption give the same bits. Float sums (gate weights, recall) are
kept in units of 2^-24 (``FIXED``: each value rounded by at most 3e-8, room for 5e11 units of
weight per expert); recall's quantiles come from a histogram of ``RECALL_BINS`` equal bins over
[0, 1], so a quantile is known to half a bin (5e-5).

Only queries that see more keys than ``index_topk`` count for the indexer (the others keep every
key, so their recall is 1 and their picks say nothing): positions ``index_topk`` and later of each
sequence, which starts at position 0. Sinks count only picks from afar: a query and a key at least
``index_topk`` positions apart (the query has that many nearer keys, so nearness is not why the
key was picked), and what a key's picks are compared with depends on its distances too
(tracing.atlas.tables: the expected picks), which :func:`far_pairs` counts. The same queries give
the overlap of each block's selection with the block before's (a sum in units of 2^-24 and a
count of queries, so that a mean comes out of any merge). Every routing counts for the near-ties:
how often the router's margin, and its group margin, fall below NEAR_TIE (tracing.analyses.margins).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist

from model.config import ModelArgs
from model.hooks import Hooks
from model.moe import RouterRule, select_experts

from ..analyses.margins import NEAR_TIE, expert_margin, group_margin
from ..analyses.recall import head_recall, key_overlap
from ..errors import InputError
from ..sites import hook_points, site_name

FIXED = 2.0**24
RECALL_BINS = 10_000
_FLUSH = 1 << 22  # sparse keys gathered before they are merged into the sorted totals


def distance_bins(seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The first and last distance of each log2 bin up to seq_len - 1 back: bin j (the tables'
    distance_bin j - 1) holds the distances 2^(j-1) .. 2^j - 1; bin 0 the distance 0."""
    j = np.arange((seq_len - 1).bit_length() + 1)
    return np.where(j == 0, 0, 2 ** np.maximum(j - 1, 0)), 2**j - 1


def sink_bins(seq_len: int, per_octave: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Finer distance bins for the sinks' expected picks, a quarter octave each: the rate of picks
    from afar falls steeply with distance just past index_topk, and a key seen only from there
    (the last positions of a sequence) must be compared with that rate, not an octave's mean."""
    steps = np.arange(per_octave * seq_len.bit_length() + 1) / per_octave
    starts = np.unique(np.floor(2.0**steps).astype(np.int64))
    starts = starts[starts < seq_len]
    return np.concatenate([[0], starts]), np.concatenate([[0], starts[1:] - 1, [seq_len - 1]])


def far_pairs(sequences: np.ndarray, first: int) -> np.ndarray:
    """(P, bins): per key position p, the queries q >= p + ``first`` of the same sequence, by the
    :func:`sink_bins` bin of q - p, summed over sequences counted by length (``sequences[L]``, L = 0 .. P)."""
    n = len(sequences) - 1
    longer = np.cumsum(sequences[::-1])[::-1][1:]  # (P,): sequences long enough to hold position q
    prefix = np.concatenate([[0], np.cumsum(longer)])
    lo, hi = sink_bins(n)
    p = np.arange(n)[:, None]
    start, stop = np.minimum(p + np.maximum(lo, first), n), np.minimum(p + hi, n - 1)
    return np.where(stop >= start, prefix[np.minimum(stop + 1, n)] - prefix[start], 0)


def total_shapes(args: ModelArgs, seq_len: int) -> dict[str, tuple[int, ...]]:
    """Every dense total and its shape (int64 each), for a model of ``args`` and sequences of at most ``seq_len``."""
    e, v, n, m = args.n_routed_experts, args.vocab_size, args.n_layers, args.n_layers - args.n_dense_layers
    return {
        "tokens": (1,),
        "sequences": (1,),
        "token_count": (v,),
        "expert_count": (m, e),
        "weight_sum": (m, e),  # units of 2^-24
        "pair_count": (m, e * e),  # expert_a * E + expert_b, a < b
        "group_count": (m, args.n_expert_groups),
        "bias_tokens": (m,),
        "bias_selections": (m,),
        "near_ties": (m,),  # routings whose margin is below NEAR_TIE
        "group_near_ties": (m,),  # ... whose group margin is
        "distance": (n, seq_len),  # selected keys by query position - key position
        "recall_hist": (n, RECALL_BINS),
        "recall_sum": (n,),  # units of 2^-24
        "recall_queries": (n,),
        "overlap_sum": (n,),  # units of 2^-24: the selection's Jaccard overlap with the block before's
        "overlap_queries": (n,),
        "length_count": (seq_len + 1,),  # sequences by length
        "sink_position_selected": (n, seq_len),  # picks from afar, by key position
        "sink_token_selected": (n, v),  # picks from afar, by the key's token
        "sink_token_visible": (v, len(sink_bins(seq_len)[0])),  # pairs from afar, by token and sink_bins bin
    }


SPARSE = ("expert_token_keys", "expert_token_counts")
MAX_TOTAL = 1 << 62  # far above any corpus's count, and room to add batches without overflowing int64


def check_state(state: dict[str, torch.Tensor], args: ModelArgs, seq_len: int, where: str) -> None:
    """A checkpoint's totals, before any batch runs: each total of its shape, int64, none negative
    or near overflow (a table would show negative counts), the expert-token keys within their
    space. A damaged file is refused, never counted on."""
    shapes = total_shapes(args, seq_len)
    unknown = sorted(set(state) - set(shapes) - set(SPARSE))
    if unknown:
        raise InputError(f"{where}: holds {unknown[0]!r}, no total of an atlas checkpoint")
    for name, shape in shapes.items():
        got = state.get(name)
        if got is None:
            raise InputError(f"{where}: holds no {name} (written before the atlas counted it?); run again without --resume")
        if tuple(got.shape) != shape or got.dtype != torch.int64:
            raise InputError(f"{where}: {name} is missing or of another shape or type; not a checkpoint of this run")
    keys, counts = (state.get(name) for name in SPARSE)
    if keys is None or counts is None or keys.dtype != torch.int64 or counts.dtype != torch.int64:
        raise InputError(f"{where}: the expert-token counts are missing or not int64")
    if keys.dim() != 1 or keys.shape != counts.shape:
        raise InputError(f"{where}: the expert-token keys and counts are not two lists of one length")
    space = len(range(args.n_dense_layers, args.n_layers)) * args.n_routed_experts * args.vocab_size
    if keys.numel() and not (0 <= int(keys.min()) and int(keys.max()) < space):
        raise InputError(f"{where}: an expert-token key outside 0..{space - 1}")
    for name, value in state.items():
        if name != "expert_token_keys" and value.numel() and not 0 <= int(value.min()) <= int(value.max()) <= MAX_TOTAL:
            raise InputError(f"{where}: {name} holds a negative or impossibly large count")


class SparseCounts:
    """Counts keyed by int64, for key spaces too large to hold densely (block x expert x token of
    the 671B model: 1.9e9 keys): sorted unique keys and their counts, plus keys not merged yet."""

    def __init__(self, device: torch.device):
        self.keys = torch.zeros(0, dtype=torch.int64, device=device)
        self.counts = torch.zeros(0, dtype=torch.int64, device=device)
        self._pending: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._held = 0

    def add(self, keys: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        """Count ``keys`` once each (or ``counts`` times)."""
        self._pending.append((keys, counts))
        self._held += keys.numel()
        if self._held > _FLUSH:
            self.consolidate()

    def consolidate(self) -> None:
        if not self._pending:
            return
        keys = torch.cat([self.keys, *(k for k, _ in self._pending)])
        ones = [torch.ones_like(k) if c is None else c for k, c in self._pending]
        counts = torch.cat([self.counts, *ones])
        self.keys, inverse = torch.unique(keys, sorted=True, return_inverse=True)
        self.counts = torch.zeros_like(self.keys).index_add_(0, inverse, counts)
        self._pending, self._held = [], 0

    def clear(self) -> None:
        self.keys, self.counts = self.keys[:0], self.counts[:0]
        self._pending, self._held = [], 0


class AtlasCounts:
    """The atlas's totals for a model of ``args`` run on sequences of at most ``seq_len`` positions.

    ``watch(model)`` attaches the hooks; around each forward, ``begin(ids)`` names the batch's
    token ids (B, T) and ``commit()`` adds its counts (or ``discard()`` drops them). ``plan``: the
    tensor-parallel plan when the model's heads are split over ranks (recall is gathered over them).
    """

    def __init__(self, args: ModelArgs, seq_len: int, device: torch.device | str = "cpu", plan=None):
        self.args, self.seq_len, self.plan = args, seq_len, plan
        self.device = torch.device(device)
        self.moe = list(range(args.n_dense_layers, args.n_layers))
        self.rule = RouterRule.of(args)
        shapes = total_shapes(args, seq_len)
        self.totals = {name: torch.zeros(shape, dtype=torch.int64, device=self.device) for name, shape in shapes.items()}
        self.expert_tokens = SparseCounts(self.device)  # key (moe slot * E + expert) * V + token id
        pairs = torch.triu_indices(args.n_activated_experts, args.n_activated_experts, 1, device=self.device)
        self._pair_a, self._pair_b = pairs[0], pairs[1]
        self._ids: torch.Tensor | None = None
        self._pending: list[tuple[str, int, torch.Tensor]] = []
        self._pending_keys: list[torch.Tensor] = []
        self._seen: dict[tuple[str, int], torch.Tensor] = {}
        self._profiles: dict[int, torch.Tensor] = {}  # sequence length -> far_pairs of one such sequence

    # hooks ------------------------------------------------------------------------------------------
    @contextmanager
    def watch(self, model: torch.nn.Module) -> Iterator[AtlasCounts]:
        """Hooks on ``model``'s hook points for as long as the block runs; always removed."""
        points = hook_points(model)
        with Hooks() as hooks:
            for i in range(self.args.n_layers):
                if site_name(i, "attn.indexer.topk_indices") in points:  # none without an indexer (DeepSeek-V3)
                    hooks.after(points[site_name(i, "attn.indexer.topk_indices")], self._on_keys(i))
                    hooks.after(points[site_name(i, "attn.scores")], self._on_scores(i))
                if i not in self.moe:
                    continue
                stages = ("scores", "biased_scores", "group_scores", "groups", "topk_indices")
                for stage in (f"ffn.gate.{name}" for name in stages):
                    hooks.after(points[site_name(i, stage)], self._keep(stage.removeprefix("ffn.gate."), i))
                biased = model.layers[i].ffn.gate.bias is not None
                hooks.after(points[site_name(i, "ffn.gate.topk_weights")], self._on_route(i, biased))
            yield self

    def _add(self, name: str, row: int, value: torch.Tensor) -> None:
        self._pending.append((name, row, value))

    def _keep(self, stage: str, i: int):
        def hook(module, inputs, output):
            self._seen[stage, i] = output

        return hook

    def _on_route(self, i: int, biased: bool):
        e, v, m = self.args.n_routed_experts, self.args.vocab_size, self.moe.index(i)

        def hook(module, inputs, weights):
            chosen = self._seen.pop(("topk_indices", i))  # (N, k), N = B * T in batch order
            scores = self._seen.pop(("scores", i))  # (N, E)
            groups = self._seen.pop(("groups", i), None)  # (N, topk_groups); none with one group
            ranked, group_scores = self._seen.pop(("biased_scores", i)), self._seen.pop(("group_scores", i), None)
            margin = expert_margin(ranked, chosen, groups, self.args.n_expert_groups)  # (N,)
            self._add("near_ties", m, (margin < NEAR_TIE).sum())
            if groups is not None and (between := group_margin(group_scores, groups)) is not None:
                self._add("group_near_ties", m, (between < NEAR_TIE).sum())
            flat = chosen.flatten()
            self._add("expert_count", m, torch.bincount(flat, minlength=e))
            fixed = torch.round(weights.double() * FIXED).long().flatten()
            self._add("weight_sum", m, torch.zeros(e, dtype=torch.int64, device=flat.device).index_add_(0, flat, fixed))
            ordered = chosen.sort(dim=1).values
            pairs = ordered[:, self._pair_a] * e + ordered[:, self._pair_b]  # (N, k (k - 1) / 2)
            self._add("pair_count", m, torch.bincount(pairs.flatten(), minlength=e * e))
            self._pending_keys.append(((m * e + chosen) * v + self._ids.flatten()[:, None]).flatten())
            if groups is not None:
                self._add("group_count", m, torch.bincount(groups.flatten(), minlength=self.args.n_expert_groups))
            if biased:  # what the unbiased scores would choose, by the one routing rule
                unbiased = select_experts(scores, None, self.rule).topk_indices
                changed = ~(chosen[:, :, None] == unbiased[:, None, :]).any(dim=-1)  # (N, k)
                self._add("bias_selections", m, changed.sum())
                self._add("bias_tokens", m, changed.any(dim=1).sum())

        return hook

    def _on_keys(self, i: int):
        n_pos, v, first = self.seq_len, self.args.vocab_size, self.args.index_topk

        def hook(module, inputs, selected):
            if selected.shape[1] <= first:
                return
            keys = selected[:, first:]  # (B, T', K): the queries that see more than index_topk keys
            self._seen["keys", i] = keys
            self._seen["selected", i] = keys
            before = self._seen.pop(("selected", i - 1), None)
            if before is not None:  # the block before's selection for the same queries
                overlap = key_overlap(keys, before, selected.shape[1])  # (B, T')
                self._add("overlap_sum", i, torch.round(overlap.double() * FIXED).long().sum())
                self._add("overlap_queries", i, torch.tensor(overlap.numel(), device=overlap.device))
            ok = keys >= 0  # every slot of these rows names a key unless a score was NaN
            query = torch.arange(first, selected.shape[1], device=keys.device)[None, :, None]
            back = query - keys  # (B, T', K) distances
            self._add("distance", i, _count(torch.where(ok, back, n_pos), n_pos))
            far = ok & (back >= first)  # sinks: picked from at least index_topk positions away
            self._add("sink_position_selected", i, _count(torch.where(far, keys, n_pos), n_pos))
            tokens = self._ids.gather(1, keys.clamp(min=0).flatten(1))  # (B, T' K): each picked key's token
            self._add("sink_token_selected", i, _count(torch.where(far.flatten(1), tokens, v), v))

        return hook

    def _on_scores(self, i: int):
        def hook(module, inputs, scores):
            keys = self._seen.pop(("keys", i), None)
            if keys is None:
                return
            recall = head_recall(scores[:, -keys.shape[1] :], keys, distinct=True)  # (B, T', H): this rank's heads
            if self.plan is not None:
                from model.parallel import gather_heads

                recall = gather_heads(recall, self.plan, i)  # all heads (a collective on every rank)
            recall = recall.mean(dim=-1).clamp(0, 1)  # (B, T')
            self._add("recall_hist", i, _count((recall * RECALL_BINS).long().clamp(max=RECALL_BINS - 1), RECALL_BINS))
            self._add("recall_sum", i, torch.round(recall.double() * FIXED).long().sum())
            self._add("recall_queries", i, torch.tensor(recall.numel(), device=recall.device))

        return hook

    # batches ----------------------------------------------------------------------------------------
    def begin(self, ids: torch.Tensor) -> None:
        """The next forward runs ``ids`` (B, T), on the counts' device."""
        if ids.shape[1] > self.seq_len:
            raise InputError(f"a sequence of {ids.shape[1]} positions is longer than the atlas's {self.seq_len}")
        self.discard()
        self._ids = ids

    def discard(self) -> None:
        self._pending.clear()
        self._pending_keys.clear()
        self._seen.clear()

    def commit(self) -> None:
        """Add the batch's counts, and the ones that depend on its tokens alone, to the totals."""
        ids, t = self._ids, self.totals
        bsz, seqlen = ids.shape
        flat = ids.flatten()
        t["tokens"] += flat.numel()
        t["sequences"] += bsz
        t["token_count"] += _count(flat, self.args.vocab_size)
        if self.args.n_expert_groups == 1:
            t["group_count"][:, 0] += flat.numel()
        t["length_count"][seqlen] += bsz
        if seqlen > self.args.index_topk:  # each key's pairs from afar, by distance bin, to its token
            t["sink_token_visible"].index_add_(0, flat, self._profile(seqlen).repeat(bsz, 1))
        for name, row, value in self._pending:
            t[name][row] += value
        if self._pending_keys:
            self.expert_tokens.add(torch.cat(self._pending_keys))
        self.discard()

    def _profile(self, seqlen: int) -> torch.Tensor:
        if seqlen not in self._profiles:
            one = np.zeros(self.seq_len + 1, dtype=np.int64)
            one[seqlen] = 1
            pairs = far_pairs(one, self.args.index_topk)[:seqlen]  # (T, bins)
            self._profiles[seqlen] = torch.from_numpy(pairs).to(self.device)
        return self._profiles[seqlen]

    # state: checkpoints and ranks -------------------------------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        """Every total as CPU tensors (what a checkpoint holds)."""
        self.expert_tokens.consolidate()
        out = {name: value.cpu() for name, value in self.totals.items()}
        out["expert_token_keys"], out["expert_token_counts"] = self.expert_tokens.keys.cpu(), self.expert_tokens.counts.cpu()
        return out

    def load(self, state: dict[str, torch.Tensor], where: str) -> None:
        """Totals from :meth:`state` (a checkpoint's), replacing these."""
        check_state(state, self.args, self.seq_len, where)
        for name, value in self.totals.items():
            value.copy_(state[name])
        self.expert_tokens.clear()
        self.expert_tokens.add(state["expert_token_keys"].to(self.device), state["expert_token_counts"].to(self.device))
        self.expert_tokens.consolidate()

    def forget(self) -> None:
        """Start again from zero (a replica's other ranks: their counts are its first rank's)."""
        for value in self.totals.values():
            value.zero_()
        self.expert_tokens.clear()

    def reduce_to_first_rank(self, group=None) -> None:
        """Add every rank's totals into rank 0's (data parallel); the other ranks start again from zero."""
        first = dist.get_rank(group) == 0
        for value in self.totals.values():
            dist.reduce(value, dst=0, group=group)
            if not first:
                value.zero_()
        self.expert_tokens.consolidate()
        keys, counts = self.expert_tokens.keys, self.expert_tokens.counts
        size = torch.tensor([keys.numel()], device=keys.device)
        sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
        dist.all_gather(sizes, size, group=group)
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(2, longest, dtype=torch.int64, device=keys.device)
        padded[0, : keys.numel()], padded[1, : keys.numel()] = keys, counts
        parts = [torch.zeros_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        self.expert_tokens.clear()
        if first:
            for part, n in zip(parts, sizes, strict=True):
                self.expert_tokens.add(part[0, : int(n.item())], part[1, : int(n.item())])
            self.expert_tokens.consolidate()


def _count(values: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of 0 .. n - 1 occurs in ``values``; the value n is a bin for what is not counted."""
    return torch.bincount(values.flatten(), minlength=n + 1)[:n]
