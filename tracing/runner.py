"""One traced run: a :class:`TraceRequest` in, a :class:`~tracing.trace.Trace` out.

The request holds everything a run is asked (the prompt or its token ids, the chat framing, the
sites, the decode path, generation and sampling, attribution, interventions, patches) and is
checked in one place (:meth:`TraceRequest.check`); :func:`run` carries it out on a model. The
command line builds one from its flags, the app from its sidebar, the server receives one as
JSON: an option behaves the same everywhere.

    trace = run(model, TraceRequest(prompt="It is a truth", generate=8), tokenizer)

:func:`trace_tokens` is the engine below: token ids already resolved, interventions as objects.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from model import fp8, kernels
from model.config import ModelArgs
from model.stream import Streamer
from model.transformer import Transformer

from .analyses.attribution import AttributionRequest
from .analyses.graph import Graph, GraphRun, check_graph, graph_of
from .analyses.intervention_specs import check_positions, from_spec, parse_positions
from .analyses.interventions import HookFunctions, Intervention, PassContext, PatchAt
from .analyses.mtp import acceptance
from .analyses.mtp import note as mtp_note
from .chat import encode_chat
from .errors import InputError
from .nonfinite import first_nonfinite, intervention_masks
from .sampling import SEEDS, Sampling, choose
from .tokenizer import Tokenizer
from .trace import Trace
from .tracer import Tracer

# what tracing.analyses.intervention_specs.from_spec reads
INTERVENTION_KEYS = ("ablate", "zero_experts", "ablate_heads", "no_bias", "attention", "no_act_fp8", "at", "features")


@dataclass(frozen=True)
class TraceRequest:
    """What one run is asked, every option of ``python -m tracing run`` (docs/cli.md).

    The input is ``prompt`` (text the checkpoint's tokenizer encodes; ``chat`` frames it as a user
    turn of DeepSeek-V3.2's conversation, ``thinking`` opens the answer in thinking mode) or
    ``token_ids``. ``record``: site patterns (tracing.sites.select). ``prefill``: the first N
    positions as one prefill, each later one through the decode path. ``generate`` new tokens,
    greedy or sampled (``temperature``, ``top_p``, ``seed``). ``attribute``: the direct logit
    attribution at ``position`` for ``target`` (minus ``contrast``): a token id, or a token's text.
    ``interventions``: the spec tracing.analyses.intervention_specs.from_spec reads (``ablate``,
    ``zero_experts``, ``ablate_heads``: "LAYER:ID,..."; ``no_bias``: "all" or [blocks];
    ``attention``: "dense" or an index_topk; ``no_act_fp8``: true; the removals may name positions, ``"3:17@5"``, or
    ``at``: "A:B" for the ``{block: [ids]}`` forms). ``patches``: site name -> value (not part of the
    JSON form: it travels as safetensors), put in whole, or only at ``patch_positions`` ("P", "A:B")
    with the other positions the model's own. ``graph``: an intervention graph
    (tracing.analyses.graph.Graph, or its JSON object), applied after the other interventions at
    every pass; its constant tensors travel beside the JSON as the patches do. ``gradient_of`` (target, contrast token ids): a
    backward pass after the forward records the gradient of the last position's logit difference
    with respect to the ``grad.*`` sites (all of them unless ``record`` names some;
    tracing.analyses.patching's ``method="gradient"``). ``dictionaries``: sparse dictionaries
    (tracing.dictionary) to apply where they read: their directories (on a server: the names of the
    server's own), or Dictionary objects (not part of the JSON form); their features are recorded
    (``<site>.features.*``) and ``interventions["features"]`` edits them
    (tracing.dictionary.features).

    A setting that belongs to another is refused without it (sampling without ``generate``, a
    position without ``attribute``, ``thinking`` without ``chat``): one rule, so nothing is ignored
    silently.
    """

    prompt: str | None = None
    token_ids: tuple[int, ...] | None = None
    chat: bool = False
    thinking: bool = False
    record: tuple[str, ...] = ("default",)
    prefill: int | None = None
    generate: int = 0
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    attribute: bool = False
    position: int | None = None
    target: int | str | None = None
    contrast: int | str | None = None
    interventions: Mapping[str, Any] = field(default_factory=dict, hash=False)
    patch_positions: str | None = None
    gradient_of: tuple[int, int] | None = None
    patches: Mapping[str, torch.Tensor] | None = field(default=None, compare=False, hash=False, repr=False)
    graph: Graph | None = field(default=None, hash=False)
    dictionaries: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "graph", graph_of(self.graph))
        if isinstance(self.record, str):
            object.__setattr__(self, "record", tuple(p.strip() for p in self.record.split(",") if p.strip()))
        object.__setattr__(self, "dictionaries", tuple(self.dictionaries or ()))
        for name in ("token_ids", "gradient_of"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))

    # checks before any model work --------------------------------------------------------------
    def check(self) -> TraceRequest:
        """Every check that needs no model; InputError names what is wrong. Returns the request."""
        if (self.prompt is None) == (self.token_ids is None):
            raise InputError("give a prompt or token ids (one of them)")
        if self.prompt is not None and not self.prompt.strip():
            raise InputError("the prompt is empty: nothing to trace")
        if self.token_ids is not None and not self.token_ids:
            raise InputError("--token-ids is empty: nothing to trace")
        if self.token_ids is not None and not all(isinstance(i, int) and not isinstance(i, bool) for i in self.token_ids):
            raise InputError("token ids must be integers")
        if self.chat and self.prompt is None:
            raise InputError("--chat wraps a --prompt; token ids are used as they are")
        if self.thinking and not self.chat:
            raise InputError("--thinking applies to --chat")
        if not self.record:
            raise InputError("--record names no site: give patterns like 'default' or 'layers.*.ffn.gate.*'")
        if not isinstance(self.generate, int) or self.generate < 0:
            raise InputError(f"--generate must be 0 or more, not {self.generate}")
        for flag, value in (("--temperature", self.temperature), ("--top-p", self.top_p), ("--seed", self.seed)):
            if value is not None and not self.generate:
                raise InputError(f"{flag} applies to --generate")
        if self.seed is not None and not SEEDS[0] <= self.seed <= SEEDS[1]:
            raise InputError(f"--seed {self.seed}: must be between {SEEDS[0]} and {SEEDS[1]}")
        for flag, value in (("--temperature", self.temperature), ("--top-p", self.top_p)):
            if value is not None and not math.isfinite(value):
                raise InputError(f"{flag} {value}: must be a finite number")
        self.sampling()
        if not self.attribute:
            for flag, value in (("--position", self.position), ("--target", self.target), ("--contrast", self.contrast)):
                if value is not None:
                    raise InputError(f"{flag} applies to --attribute")
        unknown = [key for key in self.interventions if key not in INTERVENTION_KEYS]
        if unknown:
            raise InputError(f"unknown intervention {unknown[0]!r}: choose from {', '.join(INTERVENTION_KEYS)}")
        from_spec(self.interventions)  # a malformed LAYER:ID list is refused here, its numbers when the model runs
        if self.patch_positions is not None:
            if not self.patches:
                raise InputError("--positions applies to --patch or --patch-from")
            parse_positions("--positions", self.patch_positions)
        if self.gradient_of is not None:
            pair = self.gradient_of
            if len(pair) != 2 or not all(isinstance(i, int) and not isinstance(i, bool) for i in pair):
                raise InputError("gradient_of: give two token ids, the target and the contrast")
            if pair[0] == pair[1]:
                raise InputError(f"gradient_of: target and contrast are both token {pair[0]}: the logit difference would be 0")
            if self.generate or self.prefill is not None:
                what = "--generate" if self.generate else "--prefill"
                raise InputError(f"gradient_of applies to one prefill of every position: it cannot be combined with {what}")
        if self.patches and (self.generate or self.prefill is not None):
            what = "--generate" if self.generate else "--prefill"
            raise InputError(f"--patch applies to one prefill of every position: it cannot be combined with {what}")
        if self.graph is not None:
            self.graph.check()
        from .dictionary.features import MAX_DICTIONARIES

        if len(self.dictionaries) > MAX_DICTIONARIES:
            raise InputError(f"{len(self.dictionaries)} dictionaries: a run takes at most {MAX_DICTIONARIES}")
        return self

    def sampling(self) -> Sampling:
        """How a generation chooses its tokens (greedy unless a temperature is given)."""
        return Sampling(
            0.0 if self.temperature is None else self.temperature, 1.0 if self.top_p is None else self.top_p, self.seed
        )

    @property
    def analyses(self) -> set[str]:
        """The analyses asked for ("attribution", "flow"): what torchrun refuses before loading."""
        return ({"attribution"} if self.attribute else set()) | (set(self.record) & {"attribution", "flow"})

    # the JSON form (the server's wire) ---------------------------------------------------------
    def to_json(self) -> str:
        """Every field but the patches (and the graph's tensors), as JSON."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("patches", "graph")}
        data.pop("dictionaries")
        if self.dictionaries:  # only when named: a request without them reads as it did on any server
            data["dictionaries"] = [_dictionary_name(d) for d in self.dictionaries]
        if self.graph is not None:
            data["graph"] = self.graph.to_dict()
        try:
            return json.dumps(data, allow_nan=False)
        except ValueError:
            raise InputError("the request holds a number JSON cannot carry (NaN or infinity)") from None

    @classmethod
    def from_json(
        cls,
        text: str | bytes,
        patches: Mapping[str, torch.Tensor] | None = None,
        graph_tensors: Mapping[str, torch.Tensor] | None = None,
    ) -> TraceRequest:
        """A request from its JSON form; InputError for a field that is unknown or of the wrong type.
        ``graph_tensors``: the constant tensors its graph names (they travel beside the JSON)."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise InputError(f"the request is not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise InputError("the request must be a JSON object")
        fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "patches"}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise InputError(f"unknown request field {unknown[0]!r}")
        for name, kinds in _TYPES.items():
            value = data.get(name)
            if value is not None and not (isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)):
                raise InputError(f"request field {name!r} has the wrong type ({type(value).__name__})")
        for name in ("token_ids", "record", "gradient_of", "dictionaries"):
            if data.get(name) is not None:
                item = str if name in ("record", "dictionaries") else int
                if not all(isinstance(v, item) and not isinstance(v, bool) for v in data[name]):
                    raise InputError(f"request field {name!r} must be a list of {item.__name__}")
                data[name] = tuple(data[name])
        if not isinstance(data.get("interventions", {}), dict):
            raise InputError("request field 'interventions' must be an object")
        if data.get("graph") is not None:
            data["graph"] = Graph.from_dict(data["graph"], graph_tensors)
        elif graph_tensors:
            raise InputError("the request holds graph tensors but no graph")
        return cls(**data, patches=patches)


_TYPES = {
    "prompt": (str,),
    "token_ids": (list,),
    "chat": (bool,),
    "thinking": (bool,),
    "record": (list,),
    "prefill": (int,),
    "generate": (int,),
    "temperature": (int, float),
    "top_p": (int, float),
    "seed": (int,),
    "attribute": (bool,),
    "position": (int,),
    "target": (int, str),
    "contrast": (int, str),
    "interventions": (dict,),
    "patch_positions": (str,),
    "graph": (dict,),
    "gradient_of": (list,),
    "dictionaries": (list,),
}


def _dictionary_name(entry: Any) -> str:
    """How a dictionary travels in JSON: its name (a server's) or directory; an object has neither."""
    if isinstance(entry, str | os.PathLike):
        return os.fspath(entry)
    raise InputError("a Dictionary object does not travel as JSON: name the server's dictionary (or its directory)")


def token_id(flag: str, value: int | str | None, tokenizer: Tokenizer | None) -> int | None:
    """A token id from its number, or from its text (one token of the tokenizer, or a token's own name)."""
    if value is None or isinstance(value, int):
        return value
    text = value
    if text.strip().lstrip("-").isascii() and text.strip().lstrip("-").isdigit():
        return int(text)
    if tokenizer is None:
        raise InputError(f"{flag} {text!r}: no tokenizer to encode it with; pass a token id")
    known = tokenizer.token_id(text)
    if known is not None:
        return known
    ids = tokenizer.encode(text, add_bos=False)
    if not ids:
        raise InputError(f"{flag} {text!r} is not a token of this tokenizer")
    if len(ids) > 1:
        hint = ""
        for variant in (" " + text, text.strip()):
            if variant != text and (one := tokenizer.encode(variant, add_bos=False)) and len(one) == 1:
                hint = f"; {variant!r} is one token ({one[0]})"
                break
        raise InputError(f"{flag} {text!r} is {len(ids)} tokens ({', '.join(map(str, ids))}); give one token{hint}")
    return ids[0]


def encode(request: TraceRequest, tokenizer: Tokenizer | None) -> list[int]:
    """The request's token ids: its own, or its prompt through the tokenizer (as a chat turn when asked)."""
    if request.token_ids is not None:
        return list(request.token_ids)
    if tokenizer is None:
        raise InputError("this model has no tokenizer.json: pass token ids instead of a prompt")
    if request.chat:
        return encode_chat(tokenizer, request.prompt, request.thinking)
    return tokenizer.encode(request.prompt)


def run(
    model: Transformer,
    request: TraceRequest,
    tokenizer: Tokenizer | None = None,
    *,
    on_block: Callable[[int], None] | None = None,
    on_step: Callable[[int, int], None] | None = None,
    extra: dict[str, Any] | None = None,
    max_tokens: int | None = None,
    device: torch.device | str | None = None,
    context: AbstractContextManager | None = None,
    plan=None,
    hooks: Mapping[str, Callable[[torch.Tensor, PassContext], torch.Tensor | None]] | None = None,
    dictionaries: Mapping[str, Any] | None = None,
) -> Trace:
    """Carry out ``request`` on ``model`` (its tokenizer encodes a prompt and names the tokens):
    checked, encoded, its target and contrast resolved, its interventions built, then traced
    (:func:`trace_tokens`, whose keyword arguments these are). Over several ranks (``plan``) a
    sampled generation without a seed takes rank 0's draw on every rank.

    ``hooks``: your functions at hook points, ``{site: fn}``, ``fn(value, ctx)`` returning None or
    the value the model uses instead (tracing.analyses.interventions.HookFunctions); they run after
    the request's patches and interventions, and the trace records what they return.

    ``dictionaries``: the catalogue the request's dictionaries are named from (a server's: names,
    never paths); without it they are directories (or Dictionary objects)."""
    request.check()
    sampling = request.sampling().seeded()
    if plan is not None and plan.world > 1 and not sampling.greedy and request.seed is None:
        from model.parallel import broadcast_int

        sampling = dataclasses.replace(sampling, seed=broadcast_int(sampling.seed))
    ids = encode(request, tokenizer)
    attribution = attribution_of(request, tokenizer)
    chosen = dictionaries_of(request, model, dictionaries, device)
    interventions, patches = interventions_of(request, chosen, model)
    if hooks:
        interventions.append(HookFunctions(hooks))
    check_positions(interventions, len(ids) + request.generate)
    if request.graph is not None:
        check_graph(request.graph, model.args, len(ids), request.generate, request.prefill)
    return trace_tokens(
        model,
        ids,
        prompt=request.prompt or "",
        record=list(request.record),
        patches=patches,
        on_block=on_block,
        extra=extra,
        max_tokens=max_tokens,
        token_strings=tokenizer.token_strings if tokenizer is not None else None,
        interventions=interventions,
        device=device,
        context=context,
        plan=plan,
        prefill=request.prefill,
        generate=request.generate,
        sampling=sampling,
        attribution=attribution,
        on_step=on_step,
        gradient=request.gradient_of,
        dictionaries=chosen,
        dictionary_names=request.dictionaries,
    )


def dictionaries_of(request: TraceRequest, model, catalogue: Mapping[str, Any] | None = None, device=None) -> dict[str, Any]:
    """The request's dictionaries by the site each reads, loaded and checked against the model."""
    if not request.dictionaries:
        return {}
    from .dictionary.features import resolve

    if device is None and model.embed.weight.device.type != "meta":
        device = model.embed.weight.device
    return resolve(request.dictionaries, model.args, catalogue, device)


def attribution_of(request: TraceRequest, tokenizer: Tokenizer | None) -> AttributionRequest | None:
    """The attribution a request asks for, its target and contrast resolved to token ids."""
    if not request.attribute:
        return None
    target, contrast = (token_id(f"--{k}", getattr(request, k), tokenizer) for k in ("target", "contrast"))
    if contrast is not None and target == contrast:
        raise InputError(f"--target and --contrast are both token {target}: the difference of a logit with itself is 0")
    return AttributionRequest(request.position, target, contrast)


def interventions_of(
    request: TraceRequest, dictionaries: Mapping[str, Any] | None = None, model=None
) -> tuple[list[Intervention], Mapping[str, torch.Tensor] | None]:
    """A request's interventions, and the patches put in whole (those at chosen positions are a PatchAt);
    its feature edits given the run's ``dictionaries`` (by site) and ``model``'s FFN norms."""
    interventions, patches = from_spec(request.interventions), request.patches
    if "features" in request.interventions:
        from .dictionary.features import bind

        interventions = bind(interventions, dictionaries or {}, model)
    if patches and request.patch_positions is not None:  # only there: the model's own elsewhere
        interventions.append(PatchAt(patches, parse_positions("--positions", request.patch_positions)))
        patches = None
    if request.graph is not None:  # after the others: it reads what they made
        interventions.append(GraphRun(request.graph))
    return interventions, patches


def check_prefill(n_prefill: int, n_ids: int) -> None:
    if not 1 <= n_prefill <= n_ids:
        raise InputError(f"--prefill {n_prefill}: must be between 1 and {n_ids}, the number of tokens")


def check_token_ids(ids: list[int], args: ModelArgs, max_tokens: int | None = None, generate: int = 0) -> None:
    """The prompt's ids, and the positions a generation of ``generate`` tokens adds, fit the model."""
    limit = max_tokens or args.max_seq_len
    if not ids:
        raise InputError("the prompt is empty: nothing to trace")
    if len(ids) > limit:
        raise InputError(f"the prompt has {len(ids)} tokens; this model takes at most {limit}")
    if generate < 0:
        raise InputError(f"--generate must be 0 or more, not {generate}")
    if len(ids) + generate > limit:
        raise InputError(f"{len(ids)} prompt tokens + {generate} generated exceed the {limit} this model takes")
    bad = [i for i in ids if not 0 <= i < args.vocab_size]
    if bad:
        raise InputError(f"token id {bad[0]} is outside the vocabulary (0..{args.vocab_size - 1})")


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
    on_step: Callable[[int, int], None] | None = None,
    gradient: tuple[int, int] | None = None,
    dictionaries: Mapping[str, Any] | None = None,
    dictionary_names: Sequence[Any] = (),
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

    ``on_step(step, steps)`` is called before each pass after the prefill (a decode position or a
    generated token; ``steps`` counts them all, a generation that stops early at its end-of-sequence
    token runs fewer). ``on_block`` and ``on_step`` may raise to stop the run there (a server's
    cancellation): the hooks come off, the exception goes on.

    ``attribution``: record the direct logit attribution (tracing.analyses.attribution) at its position for
    its target; the resolved position, target and contrast go to ``extra["attribution"]``. With
    ``prefill`` or ``generate`` the position is read in the pass that ran it (the default, the
    last, is the run's last position); a position a generation did not reach (it stopped at the
    end-of-sequence token) is an InputError.

    ``gradient``: (target, contrast) token ids; the forward runs with autograd recording (inside
    model.fp8.straight_through, the same values bit for bit) and one backward pass after it records
    the ``grad.*`` sites (tracing.tracer.Tracer.backward). One prefill, with the weights held; over
    several ranks (``plan``) every rank runs the backward pass.

    ``dictionaries``: by the site each reads (tracing.dictionary.features.resolve); their features
    are recorded, and what they are goes to ``extra["dictionaries"]`` (named by ``dictionary_names``).
    """
    check_token_ids(ids, model.args, max_tokens, generate)
    if attribution is not None:
        attribution.check(len(ids) + generate, model.args.vocab_size)
    sampling = (sampling or Sampling()).seeded()
    n_prefill = len(ids) if prefill is None else prefill
    check_prefill(n_prefill, len(ids))
    if patches and (n_prefill < len(ids) or generate):
        what = "--generate" if generate else "--prefill"
        raise InputError(f"--patch applies to one prefill of every position: it cannot be combined with {what}")
    if gradient is not None:
        check_gradient(gradient, model.args, n_prefill < len(ids) or bool(generate), plan, context is not None)
    if device is None:
        device = model.embed.weight.device
        device = torch.device("cpu") if device.type == "meta" else device
    with grad_mode(gradient is not None), kernels.serial_passes():  # this thread's CPU threads, as they were after
        batch = torch.tensor([ids], dtype=torch.long, device=device)
        ids = list(ids)
        n_prompt, stopped = len(ids), None
        tracer = Tracer(model, record, patches, on_block, interventions, plan, attribution, gradient, dictionaries)
        with tracer, context or nullcontext():
            tracer.token_ids = ids  # the tracer reads each position's following token (appended as chosen)
            cache = model.new_cache()
            every = "logits.all" in tracer.sites  # the head at every position: the model's all_logits

            def forward(tokens: torch.Tensor, start_pos: int = 0) -> torch.Tensor:  # (B, V): the last position's
                out = model(tokens, start_pos=start_pos, cache=cache, all_logits=every)
                return out[:, -1] if every else out

            logits = forward(batch[:, :n_prefill])
            steps = len(ids) - n_prefill + generate
            for pos in range(n_prefill, len(ids)):  # the decode path, one position at a time
                if on_step is not None:
                    on_step(pos - n_prefill + 1, steps)
                tracer.next_pass(pos)
                logits = forward(batch[:, pos : pos + 1], pos)
            generator = sampling.generator()
            for step in range(generate):
                if on_step is not None:
                    on_step(n_prompt - n_prefill + step + 1, steps)
                ids.append(choose(logits[0], sampling, generator))
                tracer.next_pass(len(ids) - 1)
                logits = forward(torch.tensor([ids[-1:]], device=device), len(ids) - 1)
                if model.args.is_eos(ids[-1]):
                    stopped = "eos"
                    break
            tracer.backward()
        values = tracer.merged(len(ids))
        for intervention in interventions:
            values.update(intervention.recorded())
    if tracer.attributes and not tracer.attribution_info:
        raise InputError(f"--position {attribution.position}: the run ended after {len(ids)} positions (end of sequence)")
    if (info := tracer.attribution_info) and info.get("contrast") is not None and info["target"] == info["contrast"]:
        raise InputError(f"--contrast {info['contrast']} is the top prediction, the default target: give a --target")
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
        if "mtp.topk_indices" in values and not values["mtp.topk_indices"].is_meta:  # its drafts (meta: tracing.plan)
            info["generation"]["mtp_acceptance"] = acceptance(ids, values["mtp.topk_indices"], n_prompt)
    if (said := mtp_note(model)) is not None:
        info["mtp"] = said
    if fp8.sums_inexactly():
        info["fp8_sums"] = fp8.INEXACT_SUMS
    if (bad := first_nonfinite(values, model.args, len(ids), intervention_masks(interventions))) is not None:
        info["nonfinite"] = bad.as_dict()
    if patches:
        info["patched"] = sorted(patches)
    config = model.args
    if interventions:
        info["interventions"] = [i.describe() for i in interventions]
        for intervention in interventions:
            config = intervention.config(config)
            if isinstance(intervention, GraphRun):
                info["graph"] = intervention.graph.record()
    if tracer.attribution_info:
        info["attribution"] = tracer.attribution_info
    if tracer.gradient_info:
        info["gradient"] = tracer.gradient_info
    if dictionaries:
        from .dictionary.features import dictionary_info

        info["dictionaries"] = dictionary_info(dictionaries, dictionary_names)
    if isinstance(context, Streamer):  # where the weights of its passes came from (model.tiers)
        info["stream"] = context.stats.accounting()
    if token_strings is not None:
        attributed = [tracer.attribution_info.get(key) for key in ("target", "contrast")]
        shown = sorted({*_predicted_ids(values), *(i for i in attributed if i is not None)})
        info["vocab"] = dict(zip(map(str, shown), token_strings(shown), strict=True))
        tokens = tokens if tokens is not None and len(tokens) == len(ids) else token_strings(ids)
    info.update(extra or {})
    if tokens is None or len(tokens) != len(ids):
        tokens = [f"<{i}>" for i in ids]
    return Trace(values, config, tokens, prompt, info)


def check_gradient(gradient: tuple[int, int], args: ModelArgs, passes: bool, plan, streamed: bool) -> None:
    """What a gradient run needs: two tokens of the vocabulary, one prefill, the weights held (over
    ranks, model.parallel's collectives carry the backward pass)."""
    bad = [i for i in gradient if not 0 <= i < args.vocab_size]
    if bad:
        raise InputError(f"gradient_of: token id {bad[0]} is outside the vocabulary (0..{args.vocab_size - 1})")
    if passes:
        raise InputError("gradient_of applies to one prefill of every position")
    if streamed:
        raise InputError("gradient_of: the backward pass needs the weights held, not streamed")


def grad_mode(gradient: bool) -> AbstractContextManager:
    """How a run's forward records: not at all (inference mode), or for one backward pass after it
    (autograd on, FP8 roundings passed straight through: model.fp8.straight_through)."""
    if not gradient:
        return torch.inference_mode()
    stack = ExitStack()
    for context in (torch.inference_mode(False), torch.enable_grad(), fp8.straight_through()):
        stack.enter_context(context)
    return stack


def _predicted_ids(values: dict[str, torch.Tensor], top: int = 20) -> list[int]:
    ids: set[int] = set()
    for name, value in values.items():
        if name.endswith(("logit_lens.topk_indices", "next.topk_indices", "expert_lens.ids", "mtp.topk_indices")):
            ids.update(i for i in value.flatten().tolist() if i >= 0)
    if "logits.last" in values:
        ids.update(values["logits.last"].topk(min(top, values["logits.last"].numel())).indices.tolist())
    return sorted(ids)
