"""The Tracer: forward hooks on hook points that copy chosen values to the CPU, or replace them.

Hooks belong to the thread that entered the tracer: a model shared by several threads (the app
serves every browser session from its own thread) records each thread's run into its own tracer,
and patches and interventions apply only to the run that asked for them. Hooks are removed on
exit, also after an exception.

At each hook point, in order: a patch (a fixed value) replaces the model's value, interventions
rewrite it, and what results is what the model uses downstream and what the trace records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from model.config import ModelArgs
from model.hooks import Hooks

from .analyses.attribution import AttributionRequest, Attributor
from .analyses.flow import Flow
from .analyses.heads import HeadReads
from .analyses.interventions import Intervention, PatchAt, Replace, check_patch, during, replaced, replacements_of
from .analyses.ranks import Ranks
from .analyses.recall import one_dense
from .errors import InputError
from .sites import (
    LOGIT_LENS_TOPK,
    analysis,
    hook_points,
    layer_site,
    next_topk,
    select,
    site_name,
    site_shapes,
    spec,
)


class Tracer:
    """Record sites of ``model`` while a forward pass runs in this thread.

    ``record``: site names or glob patterns (see :func:`tracing.sites.select`). ``patches``: site
    name -> value (the trace's shape, batch dimension dropped) that replaces the site's value.
    ``interventions``: rewrites computed from the pass itself (ablations, dense attention, ...).
    ``on_block``: called with the block index before each block runs (progress).
    ``plan``: a :class:`model.parallel.ParallelPlan` under tensor parallelism; values that a rank
    holds only its heads of are gathered (every rank must trace with the same sites).
    ``attribution``: the direct logit attribution's position and target (tracing.analyses.attribution); its
    sites are recorded with it, and with their defaults when named in ``record`` without it. The
    contribution graph (tracing.analyses.flow) is computed when its sites are recorded (``flow``).

    The logit lens (final norm and head applied to each block's output) is computed by hooks on
    the model's own ``norm`` and ``head`` while they run, so it works where weights are present
    only while used (streaming) and under tensor parallelism.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        record: Iterable[str] | str | None = None,
        patches: Mapping[str, torch.Tensor] | None = None,
        on_block: Callable[[int], None] | None = None,
        interventions: Sequence[Intervention] = (),
        plan=None,
        attribution: AttributionRequest | None = None,
        gradient: tuple[int, int] | None = None,
        dictionaries: Mapping | None = None,
    ):
        self.model = model
        self.plan = plan
        self._ranks = Ranks(plan)  # what the derived sites and the analyses need of the other ranks
        self.args: ModelArgs = model.args
        self.sites = select(self.args, record)
        if attribution is not None:
            self.sites = select(self.args, [*self.sites, "attribution"])
        self._dictionaries = dict(dictionaries or {})  # by the site each reads (tracing.dictionary.features)
        self.sites = self._with_features(self.sites)
        if gradient is not None and not any(analysis(name) == "gradient" for name in self.sites):
            self.sites = select(self.args, [*self.sites, "gradient"])
        analyses = {analysis(name) for name in self.sites} - {""}
        if "gradient" in analyses and gradient is None:
            raise InputError("the grad.* sites are a logit difference's gradient: give gradient_of (target, contrast)")
        self._gradient = gradient  # (target, contrast): the grad.* sites are d(logit difference)/d(value)
        self._wrt: dict[str, torch.Tensor] = {}  # hook point -> its value in this pass, in autograd's graph
        self._attribution = (attribution or AttributionRequest()) if "attribution" in analyses else None
        self._flow = "flow" in analyses
        self.attributes = self._attribution is not None
        self.attribution_info: dict = {}  # the attributed position, target and contrast, once the pass ran
        self.gradient_info: dict = {}  # the logit difference whose gradient the grad.* sites hold, once taken
        self._attributed: dict[str, torch.Tensor] = {}  # its values: from the pass that held the position
        # a patch of a per-head site holds every head; under tensor parallelism each rank puts in its own
        self.patches = {name: self._own_heads(name, value) for name, value in (patches or {}).items()}
        self.interventions = [
            dataclasses.replace(i, values={n: self._own_heads(n, v) for n, v in i.values.items()})
            if isinstance(i, PatchAt)
            else i
            for i in interventions
        ]
        self.on_block = on_block
        self.values: dict[str, torch.Tensor] = {}
        self._steps: list[dict[str, torch.Tensor]] = []  # earlier passes' values (decode steps)
        self._start_pos = 0  # position of this pass's first token
        # the run's token ids (a generation appends to them): next.token_prob reads the following one
        self.token_ids: list[int] = []
        self._pending: tuple[torch.Tensor, int, torch.Tensor] | None = None  # (next.token_prob, row, log-probs)
        self._seen: dict[str, torch.Tensor] = {}  # this pass's values that later hooks read
        # the MTP draft by position (mtp.*): a decode pass runs the entry of the position before it
        # again, with the token it feeds (the pass before drafted it from the greedy token)
        self._mtp = [name for name in self.sites if name.startswith("mtp.")]
        self._mtp_rows: dict[int, dict[str, torch.Tensor]] = {}
        self._hooks: Hooks | None = None
        self._during = None  # the interventions' contexts (Intervention.during) while entered

    def _with_features(self, sites: list[str]) -> list[str]:
        """The sites with the feature sites of the run's dictionaries, and no other (a pattern such as
        'features' matches every block's: only those a dictionary reads are computed)."""
        if not self._dictionaries:
            if any(analysis(name) == "features" for name in sites):
                raise InputError("the features.* sites are a dictionary's: give one (--dictionary DIR)")
            return sites
        from .dictionary.features import sites_of

        kept = [name for name in sites if analysis(name) != "features"]
        return select(self.args, [*kept, *sites_of(self._dictionaries)])

    def _own_heads(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """This rank's heads of a patch that holds every head of a block's per-head site (the value
        a one-process trace recorded); any other value as it is (a wrong shape is named where it is
        put in)."""
        row, where = spec(name), layer_site(name)
        if row is None or where is None or not row.rank_local:
            return value
        axes = row.legend.split()
        dim = axes.index("H") - len(axes)  # counted from the end: the patch may hold the batch dimension or not
        if value.dim() < -dim or value.shape[dim] != self.args.n_heads:
            return value
        if value.is_floating_point() and not torch.isfinite(value).all():  # every head: each rank decides alike
            raise InputError(f"patch {name!r} holds NaN or infinite values")
        return self._ranks.own_heads(value, where[0], dim)

    # context manager ---------------------------------------------------------------------
    def __enter__(self) -> Tracer:
        if self._hooks is not None:
            raise RuntimeError("a Tracer can be entered once at a time")
        self._hooks = Hooks()
        self.values.clear()
        self._seen.clear()
        self._mtp_rows.clear()
        try:
            self._register()
            self._during = during(self.interventions)
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._remove()

    # several passes: a prefill, then decode steps ----------------------------------------------
    def next_pass(self, start_pos: int) -> None:
        """Keep the values recorded so far as one pass; the next pass starts at ``start_pos``."""
        if self._attribution is not None:
            self._attributor.begin_pass(start_pos)
        self._steps.append(self.values)
        self.values = {}
        self._start_pos = start_pos
        self._settle()

    def merged(self, n_positions: int) -> dict[str, torch.Tensor]:
        """Every pass's values as one prefill of all ``n_positions`` would record them: rows
        concatenated; key columns (S) padded to all positions with -inf (scores) or 0
        (probabilities), selection columns (K) with -1; a last-position value from the last pass."""
        self._pending = None  # after the run's last position: the greedy token's probability stays
        steps = [*self._steps, self.values]
        out = self.values if len(steps) == 1 else self._concatenated(steps, n_positions)
        if self._mtp and self._mtp_rows:
            for name in self._mtp:
                out[name] = torch.stack([self._mtp_rows[p][name] for p in range(n_positions)])
        for name, value in self._attributed.items():  # the sources read the keys of their pass: padded to all
            out[name] = _pad(value, 1, n_positions, spec(name).fill) if spec(name).suffix == "attn.attribution_src" else value
        return out

    def _concatenated(self, steps: list[dict[str, torch.Tensor]], n_positions: int) -> dict[str, torch.Tensor]:
        legends = site_shapes(self.args)
        out = {}
        for name in steps[0]:
            axes = [a for a in legends[name][0].split() if a != "B"]
            parts = [step[name] for step in steps]
            if axes[0] not in ("T", "N"):  # logits.last: the last position's
                out[name] = parts[-1]
                continue
            fill = spec(name).fill  # what the keys or slots a pass did not have hold
            for axis in ("S", "K"):
                if axis in axes:
                    dim = axes.index(axis)
                    width = n_positions if axis == "S" else max(p.shape[dim] for p in parts)
                    parts = [_pad(p, dim, width, fill) for p in parts]
            out[name] = torch.cat(parts, dim=0)
        return out

    def _remove(self) -> None:
        if self._during is not None:
            self._during.close()
        self._during = None
        if self._hooks is not None:
            self._hooks.remove()
        self._hooks = None
        self._seen.clear()

    # hooks ---------------------------------------------------------------------------------
    def _register(self) -> None:
        hooks = self._hooks
        points = hook_points(self.model)
        for name, value in self.patches.items():
            if name not in points:
                raise InputError(f"patch {name!r} is not a trace site this model can patch")
            check_patch(name, value)
        replacers = replacements_of(self.interventions, self.args, points)
        derived: dict[str, list[str]] = {}  # hook point -> derived sites computed from its value
        keep: set[str] = set()  # hook points whose value later hooks of this pass read
        lens: set[int] = set()  # blocks whose logit lens is asked for: computed at the final norm and head
        for name in [*self.sites, *replacers]:
            row, where = spec(name), layer_site(name)
            if where is None:
                continue
            layer = where[0]
            keep.update(site_name(layer, read) for read in row.reads)  # read later in this pass
            keep.update(site_name(layer - 1, read) for read in row.reads_prev if layer > 0)  # ... by the next block
            if name in replacers:
                continue
            if row.computed == "lens":
                lens.add(layer)
            elif row.computed == "derive":
                derived.setdefault(site_name(layer, row.derived_from), []).append(name)
        self._lens = sorted(lens)
        keep.update(site_name(i, "resid_post") for i in self._lens)
        wanted = set(self.sites) - set(self._mtp)  # the MTP's sites are kept by position (_mtp_draft)
        for name, point in points.items():
            if name in wanted or name in self.patches or name in replacers or name in derived or name in keep:
                fn = self._hook(
                    name, name in wanted, self.patches.get(name), replacers.get(name, []), derived.get(name, []), name in keep
                )
                hooks.after(point, fn)
        if self.on_block is not None:
            for i, block in enumerate(self.model.layers):
                hooks.before(block, lambda module, args, i=i: self.on_block(i))
        if self._mtp:
            hooks.after(self.model.mtp[0].logits, self._mtp_draft)
        self._next = [n for n in self.sites if n.startswith("next.")]
        if self._lens or self._next:
            hooks.after(self.model.norm, self._lens_norm)
            hooks.after(self.model.head, self._lens_head)
        # the analyses' hooks come after the interventions': they read the values the model uses
        sources = any(spec(name).suffix == "attn.attribution_src" for name in self.sites)
        dropped = any(spec(name).suffix == "attn.attribution_dropped" for name in self.sites)
        reads = HeadReads(self.model, hooks) if sources or dropped or self._flow else None
        ranks = self._ranks  # under tensor parallelism the analyses gather the heads and vocabulary they read
        if self._attribution is not None:
            lens = any(".expert_lens." in name for name in self.sites)
            reads_for = reads if sources or dropped else None
            self._attributor = Attributor(
                self.model, self._attribution, hooks, self._record_attribution, reads_for, lens, ranks, dropped
            )
        if self._flow:
            Flow(self.model, reads, hooks, self._record, ranks)
        if self._dictionaries:
            from .dictionary.features import Features

            Features(self.model, self._dictionaries, hooks, self._record)
        if self._gradient is not None:  # last at their points: the value the model goes on with
            for name in self._gradient_sites():
                hooks.after(points[_gradient_point(name)], self._capture(_gradient_point(name)))
            hooks.after(points["logits.last"], self._capture("logits.last"))

    # gradients (grad.*) --------------------------------------------------------------------
    def _gradient_sites(self) -> list[str]:
        return [name for name in self.sites if analysis(name) == "gradient"]

    def _capture(self, name: str):
        def hook(module, inputs, output):
            value = output if output.requires_grad else output.detach().requires_grad_()  # a leaf where nothing before
            self._wrt[name] = value
            return None if value is output else value

        return hook

    def backward(self) -> None:
        """The grad.* sites: the gradient of the last position's logit difference (target minus
        contrast) with respect to each captured value, by one backward pass through the graph the
        forward recorded (model.fp8.straight_through: roundings passed, selections held)."""
        if self._gradient is None:
            return
        logits = self._wrt.pop("logits.last")  # (B, V)
        target, contrast = self._gradient
        difference = logits[0, target] - logits[0, contrast]
        names = self._gradient_sites()
        values = [self._wrt[_gradient_point(name)] for name in names]
        reached = difference.requires_grad  # None below: the value does not reach the logits
        grads = torch.autograd.grad(difference, values, allow_unused=True) if reached else [None] * len(values)
        for name, value, grad in zip(names, values, grads, strict=True):
            grad = torch.zeros_like(value) if grad is None else grad
            point = _gradient_point(name)
            if self.plan is not None and spec(point).rank_local:  # this rank's heads: all of them (a collective)
                from model.parallel import gather_heads

                grad = gather_heads(grad, self.plan, layer_site(point)[0])
            self.values[name] = _to_cpu(grad, spec(point).legend)
        self.gradient_info = {"target": target, "contrast": contrast, "logit_diff": float(difference.detach())}
        self._wrt.clear()
        self.values = {name: value.detach() for name, value in self.values.items()}  # the graph goes with the pass

    def _record(self, values: dict[str, torch.Tensor]) -> None:
        self.values.update((name, value) for name, value in values.items() if name in self.sites)

    def _record_attribution(self, values: dict[str, torch.Tensor]) -> None:
        self._attributed = {name: value for name, value in values.items() if name in self.sites}
        self.attribution_info = self._attributor.info

    def _mtp_draft(self, module, inputs, output):
        """mtp.*: the MTP module ran for positions max(start - 1, 0) onwards (model.Transformer.draft)."""
        logits = output[0].float()  # (T', V)
        values = {"mtp.0.logits": logits}
        if "mtp.topk_indices" in self._mtp or "mtp.topk_probs" in self._mtp:
            values["mtp.topk_indices"], values["mtp.topk_probs"] = next_topk(logits)  # (T', A) each
        values = {name: values[name].cpu() for name in self._mtp}  # one copy each
        first = max(self._start_pos - 1, 0)
        for i in range(logits.shape[0]):
            self._mtp_rows[first + i] = {name: value[i] for name, value in values.items()}

    def _lens_norm(self, module, inputs, output):
        self._seen["final_norm"] = output  # (B, T, D): what the head reads, at every position
        for i in self._lens:  # the module's forward, not its __call__: no hooks run again
            stream = self._seen.pop(site_name(i, "resid_post"))
            self._seen[f"lens.{i}"] = type(module).forward(module, stream, output.dtype)

    def _lens_head(self, module, inputs, output):
        normed = self._seen.pop("final_norm")
        if self._next:
            self._next_token(module, normed, output)
        for i in self._lens:
            probs = (
                type(module).forward(module, self._head_input(self._seen.pop(f"lens.{i}")[0])).float().softmax(dim=-1)
            )  # (T, V)
            top = probs.topk(LOGIT_LENS_TOPK, dim=-1)
            for site, value in (("topk_indices", top.indices), ("topk_probs", top.values.float())):
                if (name := site_name(i, f"logit_lens.{site}")) in self.sites:
                    self.values[name] = value.cpu()

    def _head_input(self, normed: torch.Tensor) -> torch.Tensor:
        """What the model's own head reads (its family's ``Transformer.head_input``), so every
        position's logits are formed as the last one's."""
        return self.model.head_input(normed)

    def _next_token(self, head, normed: torch.Tensor, output: torch.Tensor) -> None:
        """next.*: every position's next-token distribution. The last position's logits are the
        model's own (so a greedy choice equals next.topk_indices' first); the others are the same
        head applied to the same normalised states."""
        if output.dim() == 3:  # the model formed every position's logits (all_logits)
            logits = output[0].float()  # (T, V)
        else:
            rest = type(head).forward(head, self._head_input(normed[0, :-1])).float()  # (T - 1, V)
            logits = torch.cat([rest, output.float()], dim=0)  # (T, V)
        asked = {name.removeprefix("next.") for name in self._next}  # only what was asked for is formed
        lse = logits.logsumexp(dim=-1, keepdim=True)  # (T, 1): once, for the log-probabilities and the top-k's
        logprobs = logits - lse  # (T, V)
        values: dict[str, torch.Tensor] = {}
        if asked & {"topk_indices", "topk_probs", "token_prob"}:
            values["topk_indices"], values["topk_probs"] = next_topk(logits, lse)  # (T, A) each
        if "entropy" in asked:
            values["entropy"] = torch.special.entr(logprobs.exp()).sum(dim=-1)  # (T,)
        following = torch.tensor(self.token_ids[self._start_pos + 1 : self._start_pos + 1 + len(logits)], dtype=torch.long)
        if "token_prob" in asked:
            token_prob = logprobs[: len(following)].gather(1, following.to(logits.device)[:, None])[:, 0].exp()
            greedy = values["topk_probs"][len(following) :, 0]  # no following token yet: the greedy one's
            values["token_prob"] = torch.cat([token_prob, greedy])  # (T,)
        for site, value in values.items():
            if site in asked:
                self.values[f"next.{site}"] = value.float().cpu() if value.is_floating_point() else value.cpu()
        if len(following) < len(logits) and "next.token_prob" in self.values:  # settled when the token comes
            # a copy of the last row: a view would keep every position's log-probabilities until then
            self._pending = (self.values["next.token_prob"], len(logits) - 1, logprobs[-1].to("cpu", copy=True))

    def _settle(self) -> None:
        """The probability the last position of the pass before gave the token that came next (a
        generation appends it before the next pass)."""
        if self._pending is None:
            return
        value, row, logprobs = self._pending
        self._pending = None
        if self._start_pos < len(self.token_ids):
            value[row] = logprobs[self.token_ids[self._start_pos]].exp()

    def _hook(self, name: str, record: bool, patch, replacers: list[Replace], derived: list[str], keep: bool):
        def hook(module, inputs, output):
            value = output
            if patch is not None:
                value = _as_batched(patch, value, name)
            value = replaced(name, value, replacers, self._start_pos, self._seen)
            if value is not output and name.endswith("topk_indices"):
                _check_indices(name, value, self.args, self._start_pos)
            if keep:
                self._seen[name] = value
            if record:
                whole = value
                if self.plan is not None and spec(name).rank_local:
                    from model.parallel import gather_heads

                    whole = gather_heads(value, self.plan, layer_site(name)[0])  # all heads (a collective on every rank)
                self.values[name] = _to_cpu(whole, module.shape)
            if derived:  # from this rank's heads: the means over heads add the ranks' sums (Ranks.heads_mean)
                with one_dense():  # the recall and the KL of a block share one dense softmax
                    for target in derived:
                        if (got := self._derive(target, value)) is not None:  # None: the site has no value here
                            self.values[target] = got
            return None if value is output else value

        return hook

    def _derive(self, target: str, value: torch.Tensor) -> torch.Tensor | None:
        layer = layer_site(target)[0]

        def read(suffix: str, back: int = 0) -> torch.Tensor | None:  # back=1: the block before's (None before block 0)
            return self._seen[site_name(layer - back, suffix)] if layer - back >= 0 else None

        def heads_mean(x: torch.Tensor, dim: int) -> torch.Tensor:
            return self._ranks.heads_mean(x, layer, dim)

        return spec(target).derive(value, read, heads_mean)


def _gradient_point(name: str) -> str:
    """The hook point whose value a grad.* site is the gradient with respect to."""
    return site_name(layer_site(name)[0], spec(name).derived_from)


def _to_cpu(value: torch.Tensor, legend: str) -> torch.Tensor:
    out = value.detach()
    if legend.startswith("B"):
        if out.shape[0] != 1:
            raise InputError("tracing records batch size 1")
        out = out[0]
    dtype = torch.float32 if out.is_floating_point() else out.dtype
    return out.to("cpu", dtype, copy=True)  # one copy, widened on the way


def _as_batched(patch: torch.Tensor, output: torch.Tensor, name: str) -> torch.Tensor:
    value = patch.to(device=output.device)
    if value.dim() == output.dim() - 1:
        value = value.unsqueeze(0)
    if value.shape != output.shape:
        want = tuple(output.shape[1:]) if output.dim() == patch.dim() + 1 or output.shape[0] == 1 else tuple(output.shape)
        raise InputError(f"patch {name!r} has shape {list(patch.shape)}, this run needs {list(want)}")
    if value.is_floating_point() != output.is_floating_point():
        kind = "integer" if not output.is_floating_point() else "floating-point"
        raise InputError(f"patch {name!r} must hold {kind} values")
    return value.to(output.dtype)


def _pad(value: torch.Tensor, dim: int, width: int, fill: float) -> torch.Tensor:
    missing = width - value.shape[dim]
    if missing <= 0:
        return value
    shape = list(value.shape)
    shape[dim] = missing
    return torch.cat([value, value.new_full(shape, fill)], dim=dim)


def _check_indices(name: str, value: torch.Tensor, args: ModelArgs, start_pos: int = 0) -> None:
    """Forced selections must name real experts, or key positions (-1 for none)."""
    if ".ffn.gate." in name:
        low, high, what = 0, args.n_routed_experts, "experts"
    else:  # keys 0..start_pos+T-1; those after the query are dropped by the causal mask
        low, high, what = -1, start_pos + value.shape[-2], "key positions (or -1)"
    if value.numel() and (int(value.min()) < low or int(value.max()) >= high):
        raise InputError(f"{name}: forced values must be {what} in {low}..{high - 1}")
    if ".ffn.gate." in name and value.shape[-1] > 1:
        ordered = value.sort(dim=-1).values
        if (ordered[..., 1:] == ordered[..., :-1]).any():  # its weight would count twice, another expert not at all
            raise InputError(f"{name}: a position's forced {what} name one of them twice")


__all__ = ["Tracer"]
