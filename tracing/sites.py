"""Trace sites: the hook points' names, the values derived from them, their shapes and the defaults.

A site is named by its module path (``layers.3.ffn.gate.topk_indices``); derived sites are computed
while tracing from hook-point values and named beside them (``layers.3.attn.indexer.recall``).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

from model.config import ModelArgs
from model.hooks import HookPoint

from .analyses.margins import expert_margin, group_margin
from .analyses.recall import head_recall, indexer_kl, key_overlap
from .errors import InputError


@dataclass(frozen=True)
class SiteSpec:
    """One row of the registry: a site pattern and everything the tracer, the interventions, the
    parallel runner, the app and the docs need to know about it."""

    pattern: str  # "layers.{i}.attn.indexer.scores" or a model-level name ("logits.last")
    legend: str  # shape letters (see dims); "B" is the batch dimension, dropped when recorded
    dtype: torch.dtype  # as recorded
    what: str  # one line for the docs
    blocks: str = "all"  # "all" blocks, "moe" blocks only, "model" (not per block), "mtp" (a model with an MTP module)
    default: bool = False  # recorded unless --record says otherwise
    derived_from: str | None = None  # computed while tracing from this hook point's value (same block)
    # how a derived site is computed: "derive" (its row's ``derive`` from derived_from's value, at that
    # hook point), "lens" (the final norm and head at each block's stream, when they run), "next" (every
    # position's next-token distribution, at the head), "attribution" (tracing.analyses.attribution,
    # for one position and target), "mtp" (the MTP module's draft at each position, tracing.tracer),
    # "flow" (tracing.analyses.flow, the contribution graph) or "features" (a dictionary's, when the run
    # has one for the site: tracing.dictionary.features): the
    # analyses are computed by their module's hooks and named (or --attribute, 'flow'), never by 'all'
    computed: str = ""
    # "derive": f(value, read, heads_mean) -> the recorded value (batch dropped), or None where the site
    # has none; value is derived_from's (batch first), read(suffix) a value of the same block and pass
    # that the row's ``reads`` keep, read(suffix, back=1) the block before's (``reads_prev``; None in
    # block 0), heads_mean(x, dim) the mean over every head of x's heads along dim: under tensor
    # parallelism a rank-local value holds this rank's heads, and the ranks add their sums
    # (tracing.analyses.ranks), so no rank gathers every head's value
    derive: Callable[..., torch.Tensor | None] | None = None
    reads: tuple[str, ...] = ()  # earlier sites of the pass its computation, or its replacement, reads
    reads_prev: tuple[str, ...] = ()  # sites of the block before that its derivation reads (read(suffix, back=1))
    rank_local: bool = False  # under tensor parallelism each rank holds its heads (dim 2): gathered when recorded
    patchable: bool = True  # a hook point whose value a patch or an intervention may replace
    # an integer site's values: "keys" (key positions, -1 for none), "experts", "groups", "tokens",
    # "tokens or none" (-1 for none): what a trace file's values are checked against
    values: str = ""
    # what the key columns (S) or slots (K) a pass did not have hold when passes are merged (a decode
    # step sees fewer keys than the run): -inf for scores, -1 for selections, 0 for shares and probabilities
    fill: float = 0.0

    @property
    def suffix(self) -> str:
        return self.pattern.removeprefix("layers.{i}.")

    @property
    def analysis(self) -> str:
        """The analysis that computes the site ("attribution", "flow"), or ""."""
        return self.computed if self.computed in ANALYSES else ""

    def index_range(self, args: ModelArgs, n_tokens: int) -> tuple[int, int] | None:
        """The values an integer site may hold, ``low <= v < high``, or None for a float site."""
        if not self.values:
            return None
        high = {
            "keys": n_tokens,
            "experts": args.n_routed_experts,
            "groups": args.n_expert_groups,
            "tokens": args.vocab_size,
            "tokens or none": args.vocab_size,
            "features or none": MAX_FEATURES,
        }[self.values]
        return (-1 if self.values.endswith(("keys", "or none")) else 0), high


ANALYSES = ("attribution", "flow", "gradient", "features")
# the hook points whose gradient a run records (``gradient``): what attribution patching multiplies
GRADIENT_OF = ("resid_pre", "attn_out", "attn.head_out", "ffn.routed_out", "ffn_out")


def _probs_mean(probs: torch.Tensor, read, heads_mean) -> torch.Tensor:
    return heads_mean(probs[0].float(), 1).cpu()  # (T, H, S) -> (T, S)


def _recall(scores: torch.Tensor, read, heads_mean) -> torch.Tensor:
    """The dense attention mass on the indexer's selection, mean over heads."""
    return heads_mean(head_recall(scores, read("attn.indexer.topk_indices"))[0], -1).cpu()  # (T, H) -> (T,)


def _kl(scores: torch.Tensor, read, heads_mean) -> torch.Tensor:
    """KL(dense attention, mean over heads || the indexer's softmax), per query."""
    return indexer_kl(scores, read("attn.indexer.scores"), heads_mean)[0].cpu()  # (T,)


def _overlap_prev(keys: torch.Tensor, read, heads_mean) -> torch.Tensor | None:
    """The Jaccard overlap of each query's selected keys with the block before's (none in block 0)."""
    before = read("attn.indexer.topk_indices", back=1)
    if before is None:
        return None
    n_keys = int(max(keys.max(), before.max())) + 1
    return key_overlap(keys, before, n_keys)[0].cpu()  # (T,)


def _margin(chosen: torch.Tensor, read, heads_mean) -> torch.Tensor:
    """The biased score of the k-th chosen expert minus the best expert not chosen inside the chosen
    groups (anywhere, when the chosen groups hold no other): how near the routing came to a change."""
    groups, n_groups = read("ffn.gate.groups"), read("ffn.gate.group_scores").shape[-1]  # (N, topk_groups), G
    return expert_margin(read("ffn.gate.biased_scores"), chosen, groups, n_groups).cpu()  # (N,)


def _group_margin(groups: torch.Tensor, read, heads_mean) -> torch.Tensor | None:
    """The weakest chosen group's score minus the best unchosen group's (none where every group is chosen)."""
    margin = group_margin(read("ffn.gate.group_scores"), groups)
    return None if margin is None else margin.cpu()  # (N,)


F32, I64 = torch.float32, torch.int64
# what a sparse dictionary (tracing.dictionary) may read: a sparse autoencoder one of these stream
# sites, a transcoder a block's FFN (its normed input, to predict its update ffn_out)
DICTIONARY_SITES = ("resid_pre", "attn_out", "resid_mid", "ffn_out", "resid_post")
TRANSCODER_SITE = "ffn"
FEATURES_TOPK = 16  # features recorded per position (a TopK dictionary's active ones, padded with -1)
MAX_FEATURES = 1 << 24  # the most features a dictionary may have (its ids are checked against it)
FEATURES = "features"  # the analysis that computes the feature sites (tracing.dictionary.features)


def feature_site(site: str, what: str) -> str:
    """The name of a dictionary's feature site (``what``: top_ids, top_acts, error_norm) for the
    site it reads (``layers.3.resid_post``, or a transcoder's ``layers.3.ffn``)."""
    return f"{site}.{FEATURES}.{what}"


def _feature_rows() -> tuple[SiteSpec, ...]:
    """Three rows per site a dictionary may read: its top features, their activations, its error."""
    rows = []
    for read in (*DICTIONARY_SITES, TRANSCODER_SITE):
        transcoder = read == TRANSCODER_SITE
        base = "layers.{i}." + read
        whose = (
            "a transcoder of the block's FFN (`--dictionary`; it reads the FFN's normed input and predicts `ffn_out`)"
            if transcoder
            else f"a sparse autoencoder of `{read}` (`--dictionary`)"
        )
        common = dict(derived_from="ffn_out" if transcoder else read, computed=FEATURES, patchable=False)
        rows += [
            SiteSpec(
                feature_site(base, "top_ids"),
                "T F",
                I64,
                f"{whose}: the position's most active features, strongest first, -1 past its active ones",
                values="features or none",
                **common,
            ),
            SiteSpec(feature_site(base, "top_acts"), "T F", F32, "their activations (0 past the active ones)", **common),
            SiteSpec(
                feature_site(base, "error_norm"),
                "T",
                F32,
                "the norm of the reconstruction error: `|" + ("ffn_out" if transcoder else read) + " - decode(encode(input))|`",
                **common,
            ),
        ]
    return tuple(rows)


# The one registry. Adding a site: a hook point in model/ (an identity module where the value
# exists) or a derivation in the tracer, plus one row here.
REGISTRY: tuple[SiteSpec, ...] = (
    SiteSpec(
        "layers.{i}.resid_pre",
        "B T D",
        F32,
        ("x_n, the residual stream entering the block: the float32 sum the reference forms inside the next RMSNorm"),
        default=True,
    ),
    SiteSpec("layers.{i}.attn.indexer.head_weights", "B T H", F32, "the indexer's per-head weights `w[t,h]`"),
    SiteSpec(
        "layers.{i}.attn.indexer.scores",
        "B T S",
        F32,
        "index scores `I[t,s]`, -inf where masked",
        default=True,
        fill=float("-inf"),
    ),
    SiteSpec(
        "layers.{i}.attn.indexer.topk_indices",
        "B T K",
        I64,
        (
            "selected keys, best first, -1 where fewer than K keys are visible; equal scores go to the "
            "lower position (CUDA's top-k order)"
        ),
        default=True,
        reads=("attn.indexer.scores",),
        values="keys",
        fill=-1,
    ),
    SiteSpec(
        "layers.{i}.attn.indexer.recall",
        "T",
        F32,
        "share of the dense attention mass (mean over heads) on the selected keys",
        default=True,
        derived_from="attn.scores",
        computed="derive",
        derive=_recall,
        reads=("attn.indexer.topk_indices",),
        patchable=False,
    ),
    SiteSpec(
        "layers.{i}.attn.indexer.kl",
        "T",
        F32,
        "KL(p || q) in nats: p the dense attention distribution (mean over heads, causal), q the softmax of the "
        "index scores: the indexer's training objective",
        derived_from="attn.scores",
        default=True,
        computed="derive",
        derive=_kl,
        reads=("attn.indexer.scores",),
        patchable=False,
    ),
    SiteSpec(
        "layers.{i}.attn.indexer.overlap_prev",
        "T",
        F32,
        "Jaccard overlap of the query's selected keys with the block before's (not in block 0)",
        derived_from="attn.indexer.topk_indices",
        default=True,
        computed="derive",
        derive=_overlap_prev,
        reads_prev=("attn.indexer.topk_indices",),
        patchable=False,
    ),
    SiteSpec(
        "layers.{i}.attn.scores",
        "B T H S",
        F32,
        "scaled attention logits before any mask (large: `all` only)",
        rank_local=True,
        fill=float("-inf"),
    ),
    SiteSpec(
        "layers.{i}.attn.probs",
        "B T H S",
        F32,
        "attention probabilities after the sparse and causal masks (large: `all` only)",
        rank_local=True,
    ),
    SiteSpec(
        "layers.{i}.attn.probs_mean",
        "T S",
        F32,
        "the attention probabilities, mean over heads",
        default=True,
        derived_from="attn.probs",
        computed="derive",
        derive=_probs_mean,
        patchable=False,
    ),
    SiteSpec(
        "layers.{i}.attn.head_out",
        "B T H Dv",
        F32,
        "each head's output `p v` before `wo` mixes the heads (what patching a head replaces)",
        rank_local=True,
    ),
    SiteSpec("layers.{i}.attn_out", "B T D", F32, "the attention update"),
    SiteSpec("layers.{i}.resid_mid", "B T D", F32, "x'_n = x_n + the attention update (float32 sum)", default=True),
    SiteSpec(
        "layers.{i}.ffn.gate.scores",
        "N E",
        F32,
        "router affinities after the sigmoid, before the bias",
        blocks="moe",
        default=True,
    ),
    SiteSpec(
        "layers.{i}.ffn.gate.biased_scores",
        "N E",
        F32,
        "plus the correction bias: what selection ranks",
        blocks="moe",
        default=True,
        reads=("ffn.gate.scores",),
    ),
    SiteSpec(
        "layers.{i}.ffn.gate.group_scores",
        "N G",
        F32,
        "group scores (sum of the top-2 biased scores)",
        blocks="moe",
        default=True,
        reads=("ffn.gate.biased_scores",),
    ),
    SiteSpec(
        "layers.{i}.ffn.gate.groups", "N topk_groups", I64, "the chosen groups", blocks="moe", default=True, values="groups"
    ),
    SiteSpec(
        "layers.{i}.ffn.gate.topk_indices", "N k", I64, "chosen experts, best first", blocks="moe", default=True, values="experts"
    ),
    SiteSpec(
        "layers.{i}.ffn.gate.topk_weights",
        "N k",
        F32,
        "their gating weights (normalised, times route_scale)",
        blocks="moe",
        default=True,
    ),
    SiteSpec(
        "layers.{i}.ffn.gate.margin",
        "N",
        F32,
        "the biased score of the k-th chosen expert minus the best unchosen one's inside the chosen groups: near 0, a near-tie",
        blocks="moe",
        derived_from="ffn.gate.topk_indices",
        default=True,
        computed="derive",
        derive=_margin,
        reads=("ffn.gate.biased_scores", "ffn.gate.group_scores", "ffn.gate.groups"),
        patchable=False,
    ),
    SiteSpec(
        "layers.{i}.ffn.gate.group_margin",
        "N",
        F32,
        (
            "the group score of the weakest chosen group minus the best unchosen group's (group scores as the "
            "router ranks them: the top-2 sum of biased scores): near 0, a near-tie of groups; none where every "
            "group is chosen"
        ),
        blocks="moe",
        derived_from="ffn.gate.groups",
        default=True,
        computed="derive",
        derive=_group_margin,
        reads=("ffn.gate.group_scores",),
        patchable=False,
    ),
    SiteSpec(
        "layers.{i}.ffn.expert_out",
        "N k D",
        F32,
        "each token's k weighted expert outputs (gate weight times output), experts ascending, before they are added",
        blocks="moe",
        reads=("ffn.gate.topk_indices",),
    ),
    SiteSpec("layers.{i}.ffn.routed_out", "N D", F32, "the routed experts' weighted sum (float32)", blocks="moe"),
    SiteSpec("layers.{i}.ffn.shared_out", "N D", F32, "the shared expert's output", blocks="moe"),
    SiteSpec("layers.{i}.ffn_out", "B T D", F32, "the FFN update"),
    SiteSpec("layers.{i}.resid_post", "B T D", F32, "x_{n+1} = x'_n + the FFN update (float32 sum)", default=True),
    SiteSpec(
        "layers.{i}.logit_lens.topk_indices",
        "T L",
        I64,
        ("final norm and head applied to `resid_post`: top tokens (on request: `layers.*.logit_lens.*`)"),
        derived_from="resid_post",
        computed="lens",
        patchable=False,
        values="tokens",
    ),
    SiteSpec(
        "layers.{i}.logit_lens.topk_probs",
        "T L",
        F32,
        "their probabilities",
        derived_from="resid_post",
        computed="lens",
        patchable=False,
    ),
    *_feature_rows(),
    SiteSpec(
        "layers.{i}.attn.attribution",
        "H",
        F32,
        "direct logit attribution (`--attribute`): each head's part of the target logit, through its columns of `wo`",
        derived_from="attn_out",
        patchable=False,
        computed="attribution",
    ),
    SiteSpec(
        "layers.{i}.ffn.attribution",
        "P",
        F32,
        (
            "direct logit attribution (`--attribute`): each routed expert's part (0 where not chosen), then the "
            "shared expert's; [1] in a dense block (the MLP)"
        ),
        derived_from="ffn_out",
        patchable=False,
        computed="attribution",
    ),
    SiteSpec(
        "layers.{i}.attn.attribution_src",
        "H S",
        F32,
        (
            "direct logit attribution (`--attribute`): each head's part split over the key positions it read "
            "(probability times that key's value through the head's columns of `wo`); 0 for keys not selected"
        ),
        derived_from="attn.probs",
        patchable=False,
        computed="attribution",
    ),
    SiteSpec(
        "layers.{i}.attn.attribution_src_rest",
        "H",
        F32,
        "each head's part less the sum of its sources: what rounding the head's output (bfloat16, then FP8 for `wo`) leaves",
        derived_from="attn.probs",
        patchable=False,
        computed="attribution",
    ),
    SiteSpec(
        "layers.{i}.attn.attribution_dropped",
        "H",
        F32,
        (
            "what the keys the indexer dropped would have added to each head's part (`--attribute`): the head's "
            "update under dense causal attention from the same scores and values, less under its own probabilities; "
            "exactly 0 where every visible key is selected"
        ),
        derived_from="attn.scores",
        patchable=False,
        computed="attribution",
    ),
    SiteSpec(
        "layers.{i}.ffn.expert_lens.ids",
        "E 2 L",
        I64,
        (
            "per-expert logit lens (`--attribute`): the tokens each routed expert chosen at the position promotes "
            "(row 0) and suppresses (row 1) most through the frozen final norm and the head; -1 for experts not chosen"
        ),
        blocks="moe",
        derived_from="ffn.expert_out",
        patchable=False,
        computed="attribution",
        values="tokens or none",
    ),
    SiteSpec(
        "layers.{i}.ffn.expert_lens.logits",
        "E 2 L",
        F32,
        "their logit changes (the expert's weighted output through the frozen norm and the head)",
        blocks="moe",
        derived_from="ffn.expert_out",
        patchable=False,
        computed="attribution",
    ),
    SiteSpec(
        "layers.{i}.attn.flow",
        "T S",
        F32,
        (
            "contribution graph (`--record flow`): the share of position t's stream after the attention that "
            "position s brought, all heads together; 0 for keys not selected (docs/attribution.md)"
        ),
        derived_from="attn.probs",
        patchable=False,
        computed="flow",
    ),
    SiteSpec(
        "layers.{i}.attn.flow_resid",
        "T",
        F32,
        "contribution graph: the share position t's own stream (`resid_pre`) keeps through the attention",
        derived_from="resid_mid",
        patchable=False,
        computed="flow",
    ),
    SiteSpec(
        "layers.{i}.ffn.flow",
        "T P",
        F32,
        (
            "contribution graph: the share of position t's stream after the FFN that each routed expert brought "
            "(0 where not chosen), then the shared expert; [T, 1] in a dense block (the MLP)"
        ),
        derived_from="resid_post",
        patchable=False,
        computed="flow",
    ),
    SiteSpec(
        "layers.{i}.ffn.flow_resid",
        "T",
        F32,
        "contribution graph: the share position t's stream before the FFN (`resid_mid`) keeps",
        derived_from="resid_post",
        patchable=False,
        computed="flow",
    ),
    *(
        SiteSpec(
            f"layers.{{i}}.grad.{suffix}",
            legend,
            F32,
            f"gradient of the last position's logit difference (`gradient_of`) with respect to `{suffix}`: FP8 "
            "roundings passed straight through, the indexer's and router's selections held fixed (docs/attribution.md)",
            blocks=blocks,
            derived_from=suffix,
            patchable=False,
            computed="gradient",
        )
        for suffix, legend, blocks in (
            ("resid_pre", "T D", "all"),
            ("attn_out", "T D", "all"),
            ("attn.head_out", "T H Dv", "all"),
            ("ffn.routed_out", "N D", "moe"),
            ("ffn_out", "T D", "all"),
        )
    ),
    SiteSpec("logits.last", "B V", F32, "logits at the last position", blocks="model", default=True),
    SiteSpec("logits.all", "B T V", F32, "every position's logits (large: on request)", blocks="model"),
    SiteSpec(
        "next.topk_indices",
        "T A",
        I64,
        "each position's 10 most likely next tokens, best first (the first is the greedy choice)",
        blocks="model",
        default=True,
        derived_from="logits.last",
        computed="next",
        patchable=False,
        values="tokens",
    ),
    SiteSpec(
        "next.topk_probs",
        "T A",
        F32,
        "their probabilities (softmax of the position's logits, temperature 1)",
        blocks="model",
        default=True,
        derived_from="logits.last",
        computed="next",
        patchable=False,
    ),
    SiteSpec(
        "next.entropy",
        "T",
        F32,
        "entropy of each position's next-token distribution, in nats",
        blocks="model",
        default=True,
        derived_from="logits.last",
        computed="next",
        patchable=False,
    ),
    SiteSpec(
        "next.token_prob",
        "T",
        F32,
        "the probability each position gave the token that follows it (after the last: its greedy choice)",
        blocks="model",
        default=True,
        derived_from="logits.last",
        computed="next",
        patchable=False,
    ),
    SiteSpec(
        "mtp.0.logits",
        "B T V",
        F32,
        (
            "the multi-token-prediction module's logits at each position t for token t+2: "
            "`head(norm(Block(eh_proj([enorm(e(token_{t+1})) ; hnorm(h_t)]))))`, h_t the main model's state "
            "after its final norm; at the last position token_{t+1} is the greedy next token (large: on request)"
        ),
        blocks="mtp",
    ),
    SiteSpec(
        "mtp.topk_indices",
        "T A",
        I64,
        (
            "the MTP draft of the token after next at each position, 10 best first (a model with an MTP module; "
            "in a generation the draft at step n reads the token just chosen)"
        ),
        blocks="mtp",
        default=True,
        derived_from="mtp.0.logits",
        computed="mtp",
        patchable=False,
        values="tokens",
    ),
    SiteSpec(
        "mtp.topk_probs",
        "T A",
        F32,
        "their probabilities (softmax of the draft logits, temperature 1)",
        blocks="mtp",
        default=True,
        derived_from="mtp.0.logits",
        computed="mtp",
        patchable=False,
    ),
    SiteSpec(
        "attribution.embed",
        "1",
        F32,
        "direct logit attribution (`--attribute`): the embedding's part of the target logit",
        blocks="model",
        derived_from="logits.last",
        patchable=False,
        computed="attribution",
    ),
    SiteSpec(
        "attribution.rest",
        "1",
        F32,
        "the total less every part: what the bfloat16 carry of the stream and the final rounding leave",
        blocks="model",
        derived_from="logits.last",
        patchable=False,
        computed="attribution",
    ),
    SiteSpec(
        "attribution.total",
        "1",
        F32,
        "the model's target logit at the attributed position (minus the contrast's)",
        blocks="model",
        derived_from="logits.last",
        patchable=False,
        computed="attribution",
    ),
)
# the logit lens costs a head product per block (more than the forward of a small model): on request
LOGIT_LENS = "layers.*.logit_lens.*"
LOGIT_LENS_TOPK = 5
NEXT_TOPK = 10  # alternatives recorded per position (next.topk_*)
DEFAULT_PATTERNS = tuple(row.pattern.replace("{i}", "*") for row in REGISTRY if row.default)
_BY_SUFFIX = {row.suffix: row for row in REGISTRY if row.blocks not in ("model", "mtp")}
_TOP = {row.pattern: row for row in REGISTRY if row.blocks == "model"}
_MTP = {row.pattern: row for row in REGISTRY if row.blocks == "mtp"}  # sites of a model with an MTP module
SAVED = "graph."  # a value an intervention graph saved into the trace: graph.<name> (tracing.analyses.graph)
INDEXER_MISSING = "this model has no indexer (DeepSeek-V3 layout)"
MTP_MISSING = (
    "this model has no multi-token-prediction module (the checkpoint has none, or it is not loaded: --no-mtp leaves it out)"
)


def hook_points(model: torch.nn.Module) -> dict[str, HookPoint]:
    return {name: m for name, m in model.named_modules() if isinstance(m, HookPoint)}


Site = tuple[str, torch.dtype]  # (shape legend, recorded dtype)
_LAYER_SITE = re.compile(r"layers\.(0|[1-9][0-9]{0,8})\.(.+)")  # canonical block indices only: one name per site


def next_topk(logits: torch.Tensor, lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The NEXT_TOPK most likely tokens of each row of float32 logits (..., V), best first, and their
    probabilities: what ``next.topk_*`` record, and the greedy choice (the first) of a generation.
    ``lse``: the rows' ``logsumexp(dim=-1, keepdim=True)`` where the caller formed it already."""
    top = logits.topk(min(NEXT_TOPK, logits.shape[-1]), dim=-1)
    lse = logits.logsumexp(dim=-1, keepdim=True) if lse is None else lse
    return top.indices, (top.values - lse).exp()


def site_name(block: int, suffix: str) -> str:
    """The name of block ``block``'s site ``suffix`` (a registry row's suffix): the one place a
    block's site name is made, so a suffix that is no row's fails here, not as a silent miss."""
    if suffix not in _BY_SUFFIX:
        raise KeyError(f"{suffix!r} is no trace site of a block (tracing.sites.REGISTRY)")
    return f"layers.{block}.{suffix}"


def part_name(block: int, path: str) -> str:
    """The module path of a part of block ``block`` (``layers.3.ffn.experts.7``): names an
    attribution part, not a trace site."""
    return f"layers.{block}.{path}"


def spec(name: str) -> SiteSpec | None:
    """The registry row of a site name (any block), or None."""
    where = layer_site(name)
    return (_TOP.get(name) or _MTP.get(name)) if where is None else _BY_SUFFIX.get(where[1])


_INDEXER_DERIVED = ("attn.attribution_dropped",)  # what the keys the indexer dropped would have added


def is_indexer_site(name: str) -> bool:
    """Whether a site (or pattern) is the indexer's or made from its selection, which a model without
    one (DeepSeek-V3) has none of."""
    return ".attn.indexer." in name or name.endswith(_INDEXER_DERIVED)


@lru_cache(maxsize=2)
def _templates(indexer: bool = True) -> tuple[dict[str, Site], dict[str, Site], dict[str, Site]]:
    """(model-level sites, a dense block's, a MoE block's), from the registry: a block's sites depend
    on its kind only (and whether the model has the indexer), never on a size, so reading the sites
    of a config costs the same for 3 blocks of 16 experts as for 2 million blocks of 262,144."""
    rows = {suffix: row for suffix, row in _BY_SUFFIX.items() if indexer or not is_indexer_site("." + suffix)}
    top = {row.pattern: (row.legend, row.dtype) for row in _TOP.values()}
    dense = {suffix: (row.legend, row.dtype) for suffix, row in rows.items() if row.blocks == "all"}
    moe = {suffix: (row.legend, row.dtype) for suffix, row in rows.items()}
    return top, dense, moe


def markdown_table() -> str:
    """The docs' table of sites (docs/cli.md holds this text; a test keeps them equal)."""
    lines = [
        "| site | shape | dtype | default | what |",
        "|---|---|---|---|---|",
        "| `tokens` | [T] | int64 | always | token ids |",
    ]
    for row in REGISTRY:
        shape = ", ".join(letter for letter in row.legend.split() if letter != "B").replace("N", "T")
        kind = "derived: " if row.derived_from else ""
        dtype = str(row.dtype).removeprefix("torch.")
        lines.append(f"| `{row.pattern}` | [{shape}] | {dtype} | {'yes' if row.default else ''} | {kind}{row.what} |")
    return "\n".join(lines) + "\n"


def layer_site(name: str) -> tuple[int, str] | None:
    """(block index, suffix) of a block's site name, or None for a model-level (or no) site."""
    m = _LAYER_SITE.fullmatch(name)
    return (int(m.group(1)), m.group(2)) if m else None


def site_legend(args: ModelArgs, name: str) -> Site | None:
    """A site's (shape legend, dtype) in a model of this config, or None when it has no such site;
    from the name alone, so checking a file's sites costs nothing per block of the config."""
    top, dense, moe = _templates(args.has_indexer)
    where = layer_site(name)
    if where is None:
        if args.n_mtp_layers and name in _MTP:
            return _MTP[name].legend, _MTP[name].dtype
        return None if name.startswith("layers.") else top.get(name)
    i, suffix = where
    if i >= args.n_layers:
        return None
    return (dense if i < args.n_dense_layers else moe).get(suffix)


@lru_cache(maxsize=16)
def _site_shapes_cached(args: ModelArgs) -> dict[str, Site]:
    top, dense, moe = _templates(args.has_indexer)
    out = dict(top)
    if args.n_mtp_layers:
        out.update((row.pattern, (row.legend, row.dtype)) for row in _MTP.values())
    for i in range(args.n_layers):
        for suffix, site in (dense if i < args.n_dense_layers else moe).items():
            out[f"layers.{i}.{suffix}"] = site
    return out


def site_shapes(args: ModelArgs) -> dict[str, Site]:
    """Every site name of a model of this config -> (shape legend, recorded dtype). One entry per
    site of every block: for a model that exists; a file's sites are checked with :func:`site_legend`."""
    return _site_shapes_cached(args)


def dims(args: ModelArgs, name: str, n_tokens: int) -> dict[str, int]:
    """Sizes of the letters in a site's shape legend, for a prefill of ``n_tokens``."""
    indexer = ".indexer." in name
    return {
        "B": 1,
        "T": n_tokens,
        "N": n_tokens,
        "S": n_tokens,
        "D": args.dim,
        "H": args.index_n_heads if indexer else args.n_heads,
        "K": min(args.index_topk, n_tokens),
        "E": args.n_routed_experts,
        "G": args.n_expert_groups,
        "k": args.n_activated_experts,
        "topk_groups": args.n_limited_groups,
        "Dv": args.v_head_dim,
        "V": args.vocab_size,
        "L": LOGIT_LENS_TOPK,
        "A": NEXT_TOPK,
        "F": FEATURES_TOPK,
        "P": _ffn_parts(args, name),
        "1": 1,
        "2": 2,
    }


def _ffn_parts(args: ModelArgs, name: str) -> int:
    """Parts of a block's FFN update in the attribution: each routed expert and the shared one, or the MLP."""
    where = layer_site(name)
    return args.n_routed_experts + 1 if where is not None and where[0] >= args.n_dense_layers else 1


def analysis(name: str) -> str:
    """The analysis that computes a site ("attribution", "flow"), or "" for the others."""
    row = spec(name)
    return "" if row is None else row.analysis


def site_shape(args: ModelArgs, name: str, legend: str, n_tokens: int) -> tuple[int, ...]:
    """The recorded shape (batch dropped) of a site."""
    sizes = dims(args, name, n_tokens)
    return tuple(sizes[letter] for letter in legend.split() if letter != "B")


def index_range(args: ModelArgs, name: str, n_tokens: int) -> tuple[int, int] | None:
    """The values an integer site may hold, ``low <= v < high`` (its row's ``values``), or None for
    a float site."""
    row = spec(name)
    return None if row is None else row.index_range(args, n_tokens)


def select(args: ModelArgs, patterns: str | tuple[str, ...] | list[str] | None) -> list[str]:
    """Site names matching glob patterns (``*`` crosses dots); 'default', 'attribution' (with its
    defaults: the last position's top prediction), 'flow' (the contribution graph), 'gradient' (with
    a request's ``gradient_of``), 'features' (a run's dictionaries') and 'all' are shorthands. A
    gradient's site (``grad.*``) matches only a pattern that names it (one that holds "grad"), a
    dictionary's (``*.features.*``) one that holds "features".

    Raises InputError for a pattern of the user's that matches nothing, so typos do not silently
    record nothing; the default patterns need not match (a model without a MoE block has no gate).
    ``tokens``, the prompt's ids, is a site of every trace and always recorded: it is accepted and
    not listed.
    """
    names = list(site_shapes(args))
    if patterns is None:
        patterns = "default"
    if isinstance(patterns, str):
        patterns = [p.strip() for p in patterns.split(",") if p.strip()]
    chosen: dict[str, None] = {}  # in the order first matched, each once
    for pattern in patterns:
        if pattern == "default":
            matched = list(_default_sites(args))
        elif pattern in ANALYSES:  # an analysis' sites (a model without MoE blocks has no expert lens)
            matched = [n for n in names if analysis(n) == pattern]
        elif pattern == "all":  # not the analyses: the attribution needs a position and a target, the graph is costly
            matched = [n for n in names if not analysis(n)]
        else:  # the gradient's and the dictionaries' sites only by a pattern that says so: 'layers.*' means the model's
            matched = [n for n in names if fnmatch.fnmatchcase(n, pattern) and _names_analysis(pattern, analysis(n))]
            if not matched and any(fnmatch.fnmatchcase(n, pattern) for n in _MTP):
                raise InputError(f"--record pattern {pattern!r}: {MTP_MISSING}")
            if not matched and not args.has_indexer and _indexer_only(pattern):
                raise InputError(f"--record pattern {pattern!r}: {INDEXER_MISSING}")
            if not matched and not fnmatch.fnmatchcase("tokens", pattern):
                raise InputError(f"--record pattern {pattern!r} matches no trace site (e.g. layers.*.ffn.gate.*)")
        chosen.update(dict.fromkeys(matched))
    return sorted(_with_groups(args, list(chosen)), key=site_order)


def _names_analysis(pattern: str, of: str) -> bool:
    """Whether a glob pattern takes a site of analysis ``of``: a gradient's (``grad.*``) and a
    dictionary's (``*.features.*``) only where the pattern says so."""
    return (of != "gradient" or "grad" in pattern) and (of != FEATURES or FEATURES in pattern)


# sites read together: a trace holding one of a group holds all of them (per block for BLOCK_GROUPS);
# selection completes them, so what a run records is a trace file that can be read back
SITE_GROUPS = (("next.topk_indices", "next.topk_probs"), ("attribution.total", "attribution.embed", "attribution.rest"))
BLOCK_GROUPS = (("attn.attribution", "ffn.attribution"),)


def _with_groups(args: ModelArgs, chosen: list[str]) -> list[str]:
    """``chosen`` and the rest of each chosen site's group."""
    out = dict.fromkeys(chosen)
    for name in chosen:
        where = layer_site(name)
        if where is None:
            out.update(dict.fromkeys(next((g for g in SITE_GROUPS if name in g), ())))
        elif group := next((g for g in BLOCK_GROUPS if where[1] in g), ()):
            out.update(dict.fromkeys(site_name(where[0], suffix) for suffix in group))
    return list(out)


@lru_cache(maxsize=16)
def _default_sites(args: ModelArgs) -> tuple[str, ...]:
    """The default patterns' sites of a config, matched once: every trace asks (1-2 ms of globbing a time)."""
    return tuple(n for n in site_shapes(args) if not analysis(n) and any(fnmatch.fnmatchcase(n, p) for p in DEFAULT_PATTERNS))


def _indexer_only(pattern: str) -> bool:
    """Whether a pattern names indexer sites of a model that has them (block 0's, as any block's)."""
    return any(
        fnmatch.fnmatchcase(f"layers.0.{row.suffix}", pattern) for row in _BY_SUFFIX.values() if is_indexer_site(row.pattern)
    )


def site_order(name: str) -> tuple:
    m = re.match(r"layers\.(\d+)\.(.*)", name)
    return (0, int(m.group(1)), m.group(2)) if m else (1, 0, name)


def estimate_bytes(args: ModelArgs, names: list[str], n_tokens: int) -> int:
    """The trace's size before the run: the recorded tensors' bytes."""
    shapes = site_shapes(args)
    total = 0
    for name in names:
        legend, dtype = shapes[name]
        if (where := layer_site(name)) and where[0] == 0 and spec(name).reads_prev:
            continue  # nothing in block 0 reads a block before it
        n = 1
        for size in site_shape(args, name, legend, n_tokens):
            n *= size
        total += n * dtype.itemsize
    return total + n_tokens * 8
