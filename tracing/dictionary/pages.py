"""Feature pages: what a dictionary's features are, read from a corpus and from the model's weights,
joined with the router and the indexer. Plain functions and tables (pandas), for the CLI
(``python -m tracing dictionary features``), Python and the app's Features page.

A corpus runs in the atlas's batches (tracing.atlas.corpus: sequences of one length, nothing
padded). Hooks read, per batch, the dictionary's input (its site's value, or its block's FFN input)
and the routing and key selections of the blocks that read its features next; only running totals
and each feature's strongest contexts are kept, so memory follows the dictionary's width, never
the corpus.

* **contexts**: each feature's strongest positions, with the tokens around them;
* **logits**: its decoder direction through the final norm's gain and the head: the tokens it
  promotes and suppresses directly (the norm's 1/RMS, a positive number per position, rescales
  every logit alike and is left out);
* **experts**: the experts the next MoE block routes its positions to (where it is active), against
  that block's base rates over every position;
* **indexer**: of its strongest positions, the share of later queries (each with ``index_topk`` nearer
  keys to choose from, as the atlas's sinks count them) whose indexer keeps the position, against the
  share over every position;
* **expert features**: per expert of that block, the features its positions carry most.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from model.hooks import Hooks

from ..errors import InputError
from ..sites import hook_points, site_name
from ..tables.files import PAGE_TABLES
from .dictionary import Dictionary
from .features import read_site

TABLES = PAGE_TABLES


@dataclass(frozen=True)
class PageSettings:
    """How much of each page is kept."""

    contexts: int = 10  # strongest positions per feature
    window: int = 8  # tokens shown either side of a context's position
    logit_tokens: int = 10  # promoted and suppressed tokens per feature
    experts: int = 8  # experts per feature (most positions first)
    expert_features: int = 10  # features per expert

    def check(self) -> PageSettings:
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1000:
                raise InputError(f"--{name.replace('_', '-')} {value!r}: a whole number from 1 to 1000")
        return self


def next_blocks(d: Dictionary, args) -> tuple[int | None, int | None]:
    """(the MoE block that routes the dictionary's features next, the block whose indexer selects
    among them next): the stream entering a block (``resid_pre``) is read by that block's attention;
    what a block adds after its attention reaches its own FFN; its FFN's update and its output reach
    the next block."""
    block, reads = read_site(d.site)
    before_attention = reads == "resid_pre"
    before_ffn = reads in ("resid_pre", "attn_out", "resid_mid")
    moe = next((i for i in range(block + (not before_ffn), args.n_layers) if i >= args.n_dense_layers), None)
    attention = block + (not before_attention)
    return moe, attention if attention < args.n_layers and args.has_indexer else None


@dataclass
class FeatureCounts:
    """Running totals of one dictionary over a corpus (see the module's docstring)."""

    d: Dictionary
    args: object  # ModelArgs
    settings: PageSettings = field(default_factory=PageSettings)
    skip_first: bool = False  # a sequence's first position (BOS: the attention sink's stream) left out

    def __post_init__(self) -> None:
        n, top, width = self.d.n_features, self.settings.contexts, 2 * self.settings.window + 1
        self.moe, self.attention = next_blocks(self.d, self.args)
        e = self.args.n_routed_experts
        self.positions = 0  # every position read
        self.active = torch.zeros(n, dtype=torch.int64)  # positions where each feature is active
        self.act_sum = torch.zeros(n, dtype=torch.float64)
        self.best = torch.full((n, top), float("-inf"))  # each feature's strongest activations
        self.best_tokens = torch.full((n, top, width), -1, dtype=torch.int64)  # the tokens around them
        self.best_where = torch.full((n, top, 2), -1, dtype=torch.int64)  # (sequence, position)
        self.best_kept = torch.full((n, top), float("nan"))  # share of later queries keeping the position
        self.routed = torch.zeros(n, e, dtype=torch.int64)  # feature active and expert chosen, positions
        self.routed_mass = torch.zeros(n, e, dtype=torch.float64)  # ... the feature's activation summed
        self.base = torch.zeros(e, dtype=torch.int64)  # every position's experts: the block's base rates
        self.kept = torch.zeros(2, dtype=torch.float64)  # (kept, queries) over every position
        self.sequences = 0

    # a batch ------------------------------------------------------------------------------------------
    def add(self, ids: torch.Tensor, x: torch.Tensor, experts: torch.Tensor | None, keys: torch.Tensor | None) -> None:
        """One batch: ``ids`` (B, T), the dictionary's input ``x`` (B, T, d_in), the next MoE block's
        chosen experts (B*T, k) and the indexer's selected keys (B, T, K), where there are such blocks."""
        b, t = ids.shape
        acts = self.d.encode(x.reshape(b * t, -1).to(self.d.W_enc.device)).cpu()  # (N, n)
        counted = torch.ones(b, t, dtype=torch.bool)
        counted[:, : int(self.skip_first)] = False
        counted = counted.reshape(-1)  # (N,)
        rows, feats = (acts * counted[:, None]).nonzero(as_tuple=True)  # the active (position, feature) pairs
        values = acts[rows, feats]
        self.positions += int(counted.sum())
        self.active += torch.bincount(feats, minlength=self.d.n_features)
        self.act_sum.index_add_(0, feats, values.double())
        share = self._kept(keys, b, t)  # (N,) NaN where no later query could choose
        if experts is not None:
            experts = experts.cpu()
            e = self.args.n_routed_experts
            self.base += torch.bincount(experts[counted].reshape(-1), minlength=e)
            pair = (feats[:, None] * e + experts[rows]).reshape(-1)  # (pairs * k,)
            self.routed.view(-1).index_add_(0, pair, torch.ones_like(pair))
            self.routed_mass.view(-1).index_add_(0, pair, values.double().repeat_interleave(experts.shape[1]))
        self._keep_best(ids, rows, feats, values, share)
        self.sequences += b

    def _kept(self, keys: torch.Tensor | None, b: int, t: int) -> torch.Tensor:
        """Per position p: the share of queries q >= p + index_topk whose selection holds p."""
        if keys is None:
            return torch.full((b * t,), float("nan"))
        topk = self.args.index_topk
        keys = keys.cpu()  # (B, T, K), -1 for none
        held = torch.zeros(b, t, t + 1, dtype=torch.bool)  # [b, q, s]: s selected by q (column t: none)
        held.scatter_(2, keys.where(keys >= 0, torch.full_like(keys, t)), True)
        q = torch.arange(t)[:, None]
        far = q - torch.arange(t)[None, :] >= topk  # (T, T): query q had topk nearer keys than s
        kept = (held[:, :, :t] & far).sum(1).double()  # (B, T) over queries
        queries = far.sum(0).double().expand(b, t)
        self.kept += torch.stack([kept.sum(), queries.sum()])
        return (kept / queries).where(queries > 0, torch.tensor(float("nan"), dtype=torch.float64)).float().reshape(-1)

    def _keep_best(self, ids, rows, feats, values, share) -> None:
        """Each feature's strongest positions so far: this batch's best merged with the kept ones."""
        if not len(values):
            return
        top, w = self.settings.contexts, self.settings.window
        order = values.argsort(descending=True, stable=True)
        order = order[feats[order].argsort(stable=True)]  # by feature, strongest first within each
        f_sorted = feats[order]
        starts = torch.searchsorted(f_sorted, f_sorted, right=False)
        rank = torch.arange(len(order)) - starts
        keep = order[rank < top]
        f, r, slot = feats[keep], rows[keep], rank[rank < top]
        n = self.d.n_features
        cand = torch.full((n, top), float("-inf"))
        cand[f, slot] = values[keep]
        t = ids.shape[1]
        seq, pos = r // t, r % t
        offsets = torch.arange(-w, w + 1)
        at = pos[:, None] + offsets  # (M, 2w+1)
        inside = (at >= 0) & (at < t)
        tokens = torch.where(inside, ids.cpu()[seq[:, None], at.clamp(0, t - 1)], -1)
        cand_tokens = torch.full((n, top, 2 * w + 1), -1, dtype=torch.int64)
        cand_tokens[f, slot] = tokens
        cand_where = torch.full((n, top, 2), -1, dtype=torch.int64)
        cand_where[f, slot] = torch.stack([seq + self.sequences, pos], dim=1)
        cand_kept = torch.full((n, top), float("nan"))
        cand_kept[f, slot] = share[r]
        both = torch.cat([self.best, cand], dim=1)  # (n, 2top): kept first, so earlier wins a tie
        best = both.topk(top, dim=1, sorted=True)
        pick = best.indices
        self.best = best.values
        self.best_tokens = torch.cat([self.best_tokens, cand_tokens], 1).gather(1, pick[..., None].expand(-1, -1, 2 * w + 1))
        self.best_where = torch.cat([self.best_where, cand_where], 1).gather(1, pick[..., None].expand(-1, -1, 2))
        self.best_kept = torch.cat([self.best_kept, cand_kept], 1).gather(1, pick)


class _Reader:
    """Hooks that read, per batch, what :class:`FeatureCounts` adds."""

    def __init__(self, model: torch.nn.Module, counts: FeatureCounts, hooks: Hooks):
        self.got: dict[str, torch.Tensor] = {}
        d = counts.d
        block, reads = read_site(d.site)
        points = hook_points(model)
        if d.kind == "transcoder":
            hooks.before(model.layers[block].ffn, lambda m, args: self.got.__setitem__("x", args[0].float()))
        else:
            hooks.after(points[d.site], lambda m, i, out: self.got.__setitem__("x", out.float()))
        if counts.moe is not None:
            point = points[site_name(counts.moe, "ffn.gate.topk_indices")]
            hooks.after(point, lambda m, i, out: self.got.__setitem__("experts", out))
        if counts.attention is not None:
            point = points[site_name(counts.attention, "attn.indexer.topk_indices")]
            hooks.after(point, lambda m, i, out: self.got.__setitem__("keys", out))


def count_corpus(
    loaded,
    dictionaries: Iterable[Dictionary],
    batches: Iterable[list[list[int]]],
    settings: PageSettings | None = None,
    on_batch: Callable[[int], None] | None = None,
    skip_first: bool = False,
) -> list[FeatureCounts]:
    """Every dictionary's totals over the corpus's ``batches`` (tracing.atlas.corpus.Corpus.batches)
    run through ``loaded`` (tracing.cli.loading.Loaded): one forward per batch for all of them.
    ``skip_first``: leave each sequence's first position out (it is BOS, whose stream is the
    attention sink's: every dictionary's strongest "contexts" would be it)."""
    settings = (settings or PageSettings()).check()
    model = loaded.model
    if loaded.plan is not None:
        raise InputError("feature pages run on one process: load the model without torchrun")
    counts = [FeatureCounts(d, model.args, settings, skip_first) for d in dictionaries]
    with Hooks() as hooks, torch.inference_mode(), loaded.context() or nullcontext():
        readers = [_Reader(model, c, hooks) for c in counts]
        for index, batch in enumerate(batches):
            ids = torch.tensor(batch, dtype=torch.long, device=loaded.device)  # (B, T)
            model(ids)
            for c, reader in zip(counts, readers, strict=True):
                got = reader.got
                c.add(ids, got.pop("x"), got.pop("experts", None), got.pop("keys", None))
            if on_batch is not None:
                on_batch(index + 1)
    return counts


@torch.no_grad()
def logit_effects(
    model: torch.nn.Module, d: Dictionary, top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each feature's decoder direction through the final norm's gain and the head: (promoted ids,
    their logits, suppressed ids, their logits), each (n_features, top)."""
    norm, head = model.norm, model.head
    out = [], [], [], []
    for start in range(0, d.n_features, 256):  # (256, V) logits at a time
        direction = d.W_dec[start : start + 256].float().to(norm.weight.device) * norm.weight.float()  # (F, D)
        logits = type(head).forward(head, model.head_input(direction)).float()  # (F, V)
        k = min(top, logits.shape[-1])
        up, down = logits.topk(k, dim=-1), logits.topk(k, dim=-1, largest=False)
        for part, value in zip(out, (up.indices, up.values, down.indices, down.values), strict=True):
            part.append(value.cpu())
    return tuple(torch.cat(part) for part in out)


def page_tables(
    counts: FeatureCounts, model: torch.nn.Module, token_strings: Callable[[list[int]], list[str]] | None, name: str = ""
) -> dict[str, pd.DataFrame]:
    """The five tables of one dictionary's pages (TABLES), from its totals and the model's head."""
    d, s = counts.d, counts.settings
    name = name or d.site
    n = d.n_features
    strings = _Strings(token_strings)
    density = counts.active.double() / max(counts.positions, 1)
    mean = counts.act_sum / counts.active.clamp_min(1)
    base = counts.base.double() / counts.base.sum().clamp_min(1)  # each expert's share of the block's slots
    k = counts.args.n_activated_experts
    routed = counts.routed.double() / (counts.active.double()[:, None] * k).clamp_min(1)  # (n, E) share of its slots
    lift = routed - base[None, :]
    top_expert = routed.argmax(1)
    kept = np.where(np.isfinite(counts.best.numpy()), counts.best_kept.numpy(), np.nan)
    seen = np.isfinite(kept).sum(1)
    kept_mean = np.where(seen > 0, np.nan_to_num(kept).sum(1) / np.maximum(seen, 1), np.nan)
    overall = float(counts.kept[0] / counts.kept[1]) if counts.kept[1] > 0 else float("nan")
    summary = pd.DataFrame(
        {
            "dictionary": name,
            "site": d.site,
            "feature": np.arange(n),
            "active_positions": counts.active.numpy(),
            "density": density.numpy(),
            "mean_activation": mean.numpy(),
            "max_activation": np.where(np.isfinite(counts.best[:, 0].numpy()), counts.best[:, 0].numpy(), 0.0),
            "moe_block": -1 if counts.moe is None else counts.moe,
            "top_expert": top_expert.numpy() if counts.moe is not None else -1,
            "top_expert_share": routed.gather(1, top_expert[:, None])[:, 0].numpy() if counts.moe is not None else np.nan,
            "top_expert_base": base[top_expert].numpy() if counts.moe is not None else np.nan,
            "indexer_block": -1 if counts.attention is None else counts.attention,
            "indexer_kept_share": kept_mean,
            "indexer_base_share": overall,
        }
    )
    summary.loc[counts.active.numpy() == 0, ["top_expert_share", "top_expert_base"]] = np.nan
    # contexts: one row per kept strongest position
    fi, ri = np.nonzero(np.isfinite(counts.best.numpy()))
    tokens = counts.best_tokens.numpy()[fi, ri]  # (M, 2w+1)
    where = counts.best_where.numpy()[fi, ri]
    strings.want(tokens.ravel())
    contexts = pd.DataFrame(
        {
            "dictionary": name,
            "feature": fi,
            "rank": ri,
            "activation": counts.best.numpy()[fi, ri],
            "sequence": where[:, 0],
            "position": where[:, 1],
            "token": [strings(row[s.window]) for row in tokens],
            "context": [_context(row, s.window, strings) for row in tokens],
            "indexer_kept_share": counts.best_kept.numpy()[fi, ri],
        }
    )
    up_ids, up, down_ids, down = logit_effects(model, d, s.logit_tokens)
    strings.want(up_ids.numpy().ravel())
    strings.want(down_ids.numpy().ravel())
    frames = []
    for effect, ids, values in (("promoted", up_ids, up), ("suppressed", down_ids, down)):
        m = ids.shape[1]
        frames.append(
            pd.DataFrame(
                {
                    "dictionary": name,
                    "feature": np.repeat(np.arange(n), m),
                    "effect": effect,
                    "rank": np.tile(np.arange(m), n),
                    "token_id": ids.numpy().ravel(),
                    "logit": values.numpy().ravel(),
                }
            )
        )
    logits = pd.concat(frames, ignore_index=True)
    logits.insert(5, "token", [strings(i) for i in logits["token_id"]])
    tables = {"feature_summary": summary, "feature_contexts": contexts, "feature_logits": logits}
    if counts.moe is not None:
        m = min(s.experts, counts.args.n_routed_experts)
        best = counts.routed.topk(m, dim=1)
        f = np.repeat(np.arange(n), m)
        e = best.indices.numpy().ravel()
        experts = pd.DataFrame(
            {
                "dictionary": name,
                "feature": f,
                "block": counts.moe,
                "expert": e,
                "positions": best.values.numpy().ravel(),
                "share": routed.numpy()[f, e],
                "base_share": base.numpy()[e],
                "difference": lift.numpy()[f, e],
            }
        )
        tables["feature_experts"] = experts[experts["positions"] > 0].reset_index(drop=True)
        m = min(s.expert_features, n)
        mass = counts.routed_mass.T  # (E, n)
        best = mass.topk(m, dim=1)
        e = np.repeat(np.arange(mass.shape[0]), m)
        f = best.indices.numpy().ravel()
        carried = pd.DataFrame(
            {
                "dictionary": name,
                "block": counts.moe,
                "expert": e,
                "rank": np.tile(np.arange(m), mass.shape[0]),
                "feature": f,
                "activation_mass": best.values.numpy().ravel(),
                "positions": counts.routed.numpy()[f, e],
                "expert_positions": counts.base.numpy()[e],
            }
        )
        tables["expert_features"] = carried[carried["activation_mass"] > 0].reset_index(drop=True)
    return tables


class _Strings:
    """Token strings, each looked up once (a tokenizer's ``token_strings``; ``<id>`` without one)."""

    def __init__(self, token_strings):
        self.fn, self.known = token_strings, {}

    def want(self, ids) -> None:
        new = sorted({int(i) for i in ids if int(i) >= 0} - set(self.known))
        if new:
            names = self.fn(new) if self.fn is not None else [f"<{i}>" for i in new]
            self.known.update(zip(new, names, strict=True))

    def __call__(self, i) -> str:
        i = int(i)
        if i not in self.known:
            self.want([i])
        return self.known.get(i, "")


def _context(row: np.ndarray, window: int, strings: _Strings) -> str:
    """The tokens around a position as text, the position's own token in brackets."""
    left = "".join(strings(i) for i in row[:window] if i >= 0)
    right = "".join(strings(i) for i in row[window + 1 :] if i >= 0)
    return f"{left}[[{strings(row[window])}]]{right}"


def feature_pages(
    loaded,
    dictionaries: dict[str, Dictionary],
    batches: Iterable[list[list[int]]],
    settings: PageSettings | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> dict[str, pd.DataFrame]:
    """Every table of the pages of ``dictionaries`` (name -> Dictionary) over a corpus, the
    dictionaries' rows one after another (column ``dictionary``)."""
    from .dictionary import check_fits

    for d in dictionaries.values():
        check_fits(d, loaded.model.args)
    bos = loaded.tokenizer.bos_id if loaded.tokenizer is not None else None
    counts = count_corpus(loaded, dictionaries.values(), batches, settings, on_batch, skip_first=bos is not None)
    tokenizer = loaded.tokenizer
    strings = tokenizer.token_strings if tokenizer is not None else None
    out: dict[str, list[pd.DataFrame]] = {}
    for name, c in zip(dictionaries, counts, strict=True):
        for table, frame in page_tables(c, loaded.model, strings, name).items():
            out.setdefault(table, []).append(frame)
    return {table: pd.concat(frames, ignore_index=True) for table, frames in out.items()}
