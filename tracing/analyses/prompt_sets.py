"""Analyses over a set of prompts, each mean with its bootstrap interval (tracing.analyses.bootstrap):
patching over clean/corrupt pairs, the causal check over prompts, and the next-token loss of a
change (an intervention) against the plain run, paired prompt by prompt.

One pair or one prompt proves little: these run the single-prompt analysis on each item of a file
and say, per cell, how much the mean would move with another set of prompts like these. The files
(:func:`parse_pairs`, :func:`parse_prompts`) are read with every size bounded and every line
checked before any model runs; a bad line is named by its number.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..errors import InputError
from ..runner import TraceRequest
from ..trace import Trace
from .bootstrap import LEVEL, RESAMPLES, SEED, bootstrap, check

MAX_BYTES = 8 << 20  # a file of prompts: 8 MiB
MAX_LINES = 10_000  # each line costs at least one forward (a pair's sweep, hundreds)
MAX_LINE = 32 << 10  # characters of one line: a prompt far beyond any model's context in tokens
TOKEN_FIELDS = ("target", "contrast")  # a line's own token for the logit difference (text or id)


@dataclass(frozen=True)
class Pair:
    """A clean and a corrupt prompt from line ``line`` of a file, with the line's own target and
    contrast (None: the command's)."""

    line: int
    clean: str
    corrupt: str
    target: int | str | None = None
    contrast: int | str | None = None


@dataclass(frozen=True)
class Prompt:
    line: int
    prompt: str
    target: int | str | None = None
    contrast: int | str | None = None


@dataclass
class SetResult:
    """``table``: the mean per cell with its interval; ``each``: every item's own rows (its line in
    column ``line``); ``summary``: the settings, counts and figures of the whole set; ``parts``: the
    causal check's means per part."""

    table: pd.DataFrame
    each: pd.DataFrame
    summary: dict
    parts: pd.DataFrame | None = None


# reading a file ---------------------------------------------------------------------------------


def parse_pairs(data: bytes, name: str) -> list[Pair]:
    """Pairs from JSONL (one object a line: ``clean``, ``corrupt``, optional ``target``,
    ``contrast``) or CSV with those columns (a header line naming them)."""
    rows = _rows(data, name, ("clean", "corrupt"), plain=False)
    return [Pair(line, r["clean"], r["corrupt"], r.get("target"), r.get("contrast")) for line, r in rows]


def parse_prompts(data: bytes, name: str) -> list[Prompt]:
    """Prompts from JSONL (``prompt``, optional ``target``, ``contrast``), CSV with a ``prompt``
    column, or plain text: one prompt a line (blank lines skipped)."""
    rows = _rows(data, name, ("prompt",), plain=True)
    return [Prompt(line, r["prompt"], r.get("target"), r.get("contrast")) for line, r in rows]


def _rows(data: bytes, name: str, needed: tuple[str, ...], plain: bool) -> list[tuple[int, dict]]:
    if len(data) > MAX_BYTES:
        raise InputError(f"{name}: {len(data):,} bytes, more than a file of prompts may hold ({MAX_BYTES:,})")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"{name}: not UTF-8 text (byte {exc.start})") from None
    lines = text.splitlines()
    if len(lines) > MAX_LINES:
        raise InputError(f"{name}: {len(lines):,} lines, more than {MAX_LINES:,}: split the set")
    for number, line in enumerate(lines, 1):
        if len(line) > MAX_LINE:
            raise InputError(f"{name} line {number}: {len(line):,} characters, more than a line may hold ({MAX_LINE:,})")
    first = next((line.strip() for line in lines if line.strip()), None)
    if first is None:
        raise InputError(f"{name}: empty: no {'pairs' if 'clean' in needed else 'prompts'} in it")
    if first.startswith("{"):
        rows = _jsonl(lines, name, needed)
    elif name.lower().endswith(".csv") or not plain:
        rows = _csv(text, name, needed)
    else:
        rows = [(number, {"prompt": line}) for number, line in enumerate(lines, 1) if line.strip()]
    if not rows:
        raise InputError(f"{name}: no {'pairs' if 'clean' in needed else 'prompts'} in it")
    return rows


def _jsonl(lines: list[str], name: str, needed: tuple[str, ...]) -> list[tuple[int, dict]]:
    known = (*needed, *TOKEN_FIELDS)
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name} line {number}"
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise InputError(f"{where}: not a JSON object ({str(exc)[:80]})") from None
        if not isinstance(row, dict):
            raise InputError(f"{where}: not a JSON object with {', '.join(needed)}")
        if unknown := [key for key in row if key not in known]:
            raise InputError(f"{where}: unknown field {unknown[0][:40]!r}: the fields are {', '.join(known)}")
        rows.append((number, _fields(row, where, needed)))
    return rows


def _csv(text: str, name: str, needed: tuple[str, ...]) -> list[tuple[int, dict]]:
    known = (*needed, *TOKEN_FIELDS)
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    rows = []
    try:
        header = None
        for record in reader:
            if not any(cell.strip() for cell in record):
                continue
            where = f"{name} line {reader.line_num}"
            if header is None:
                header = [cell.strip() for cell in record]
                missing = [column for column in needed if column not in header]
                unknown = [column for column in header if column not in known]
                if missing or unknown or len(set(header)) < len(header):
                    raise InputError(
                        f"{where}: a CSV header naming the columns {', '.join(needed)} (and optionally "
                        f"{', '.join(TOKEN_FIELDS)}) comes first; found {', '.join(h[:40] for h in header)[:200]}"
                    )
                continue
            if len(record) != len(header):
                raise InputError(f"{where}: {len(record)} cells where the header names {len(header)}")
            rows.append((reader.line_num, _fields(dict(zip(header, record, strict=True)), where, needed, csv=True)))
    except csv.Error as exc:
        raise InputError(f"{name} line {reader.line_num}: not CSV ({exc})") from None
    return rows


def _fields(row: dict, where: str, needed: tuple[str, ...], csv: bool = False) -> dict:
    out = {}
    for key in needed:
        value = row.get(key)
        if not isinstance(value, str) or not value.strip():
            raise InputError(f"{where}: {key!r} must be a non-empty string")
        out[key] = value
    for key in TOKEN_FIELDS:
        value = row.get(key)
        if csv and isinstance(value, str) and not value:
            value = None  # an empty cell: the command's own
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, str)) or value == ""):
            raise InputError(f"{where}: {key!r} must be a token's text or id")
        if value is not None:
            out[key] = value
    return out


# patching over pairs ----------------------------------------------------------------------------


def patching_over_pairs(
    run: Callable[[TraceRequest], Trace],
    pairs: Sequence[Pair],
    request: Callable[[str], TraceRequest] = lambda text: TraceRequest(prompt=text),
    n_tokens: Callable[[TraceRequest], int] | None = None,
    target: int | str | None = None,
    contrast: int | str | None = None,
    on_pair: Callable[[int, int], None] | None = None,
    resamples: int = RESAMPLES,
    seed: int = SEED,
    **sweep_options,
) -> SetResult:
    """The patching sweep (tracing.analyses.patching.sweep, with ``sweep_options``: sites,
    positions, max_runs, token_id, ...) of every pair, and per cell the mean ``value`` over the
    pairs with its bootstrap interval.

    ``request`` makes a prompt's request; ``n_tokens`` counts a request's tokens (its tokenizer):
    given, every pair is checked for one length before the first sweep. A pair's own target and
    contrast beat ``target`` and ``contrast``. Cells align by their distance from the last position
    (``from_end``, -1 the last), so pairs of different lengths meet at the answer; ``position`` is
    the absolute one where every pair has one length (else -1). An expert that neither run of a
    pair chose at a position counts 0 there (patching it changes nothing). A pair whose clean and
    corrupt logit differences are equal has no ``value`` (0/0) and takes no part in the means."""
    from .patching import SITES, sweep

    if not pairs:
        raise InputError("no pairs to patch")
    check(resamples, seed, prompts=len(pairs))
    if n_tokens is not None:
        _check_lengths(pairs, request, n_tokens)
    if (resolve := sweep_options.get("token_id")) is not None:  # every line's tokens, before the first sweep
        pairs = [_resolved(pair, resolve) for pair in pairs]
    started, tables, each = time.perf_counter(), [], []
    for i, pair in enumerate(pairs):
        if on_pair is not None:
            on_pair(i, len(pairs))
        try:
            result = sweep(
                run,
                request(pair.clean),
                request(pair.corrupt),
                target=pair.target if pair.target is not None else target,
                contrast=pair.contrast if pair.contrast is not None else contrast,
                **sweep_options,
            )
        except InputError as exc:
            raise InputError(f"line {pair.line}: {exc}") from None
        s = result.summary
        table = result.table.assign(line=pair.line, from_end=result.table["position"] - s["tokens"])
        tables.append(table)
        each.append(
            {
                "line": pair.line,
                "tokens": s["tokens"],
                "target": s["target"],
                "contrast": s["contrast"],
                "clean_logit_diff": s["clean"]["logit_diff"],
                "corrupt_logit_diff": s["corrupt"]["logit_diff"],
                "swept": [p - s["tokens"] for p in s["positions"]],
                "runs": s["runs"],
            }
        )
    every = pd.concat(tables, ignore_index=True)
    keys = ["site", "block", "from_end", "index"]
    cells = every[keys].drop_duplicates()
    cells = cells.assign(order=cells["site"].map(SITES.index)).sort_values(["order", "block", "from_end", "index"])
    cells = cells.drop(columns="order").reset_index(drop=True)
    column = {tuple(key): j for j, key in enumerate(cells.itertuples(index=False, name=None))}
    value = np.full((len(pairs), len(cells)), np.nan)  # pairs x cells; NaN: the pair has no such cell
    logit = np.full_like(value, np.nan)
    experts = [(j, key[2]) for key, j in column.items() if key[0] == "experts"]
    for i, (table, info) in enumerate(zip(tables, each, strict=True)):
        # an expert neither run chose at a swept position: its patch is the corrupt run, bit for bit
        defined = info["clean_logit_diff"] != info["corrupt_logit_diff"]
        swept = set(info["swept"])
        for j, from_end in experts:
            if from_end in swept:
                value[i, j], logit[i, j] = (0.0 if defined else np.nan), info["corrupt_logit_diff"]
        at = [column[key] for key in table[keys].itertuples(index=False, name=None)]
        value[i, at], logit[i, at] = table["value"].to_numpy(), table["logit_diff"].to_numpy()
    stats = bootstrap(value, resamples=resamples, seed=seed)
    lengths = {info["tokens"] for info in each}
    one = lengths.pop() if len(lengths) == 1 else None
    with np.errstate(invalid="ignore"):
        logit_mean = np.nanmean(np.where(np.isfinite(logit), logit, np.nan), axis=0) if len(cells) else []
    table = cells.assign(
        position=(cells["from_end"] + one) if one is not None else -1,
        n=stats["n"],
        mean=stats["mean"],
        ci_low=stats["ci_low"],
        ci_high=stats["ci_high"],
        logit_diff_mean=logit_mean,
    )[["site", "block", "position", "from_end", "index", "n", "mean", "ci_low", "ci_high", "logit_diff_mean"]]
    per_pair = every[["line", "site", "block", "position", "from_end", "index", "logit_diff", "value"]]
    summary = {
        "pairs": len(pairs),
        "undefined": [info["line"] for info in each if info["clean_logit_diff"] == info["corrupt_logit_diff"]],
        "tokens": one,
        "runs": int(sum(info["runs"] for info in each)),
        "seconds": round(time.perf_counter() - started, 3),
        "resamples": resamples,
        "seed": seed,
        "level": LEVEL,
        "each": [{k: v for k, v in info.items() if k != "swept"} for info in each],
    }
    return SetResult(table, per_pair, summary)


def _resolved(item, resolve):
    """``item`` with its target and contrast as token ids (``resolve(flag, value)``), or InputError
    naming its line."""
    try:
        return dataclasses.replace(
            item,
            **{key: resolve(f"--{key}", value) for key in TOKEN_FIELDS if (value := getattr(item, key)) is not None},
        )
    except InputError as exc:
        raise InputError(f"line {item.line}: {exc}") from None


def _check_lengths(pairs: Sequence[Pair], request, n_tokens) -> None:
    """Every pair of one token length, before the first sweep: the first that is not named by its
    line (and how many more there are)."""
    bad = []
    for pair in pairs:
        a, b = n_tokens(request(pair.clean)), n_tokens(request(pair.corrupt))
        if a != b:
            bad.append(f"line {pair.line}: the clean prompt has {a} tokens and the corrupt one {b}")
    if bad:
        more = f" (and {len(bad) - 1} more pairs)" if len(bad) > 1 else ""
        raise InputError(f"{bad[0]}{more}: patching needs one length in each pair")


# the causal check over prompts ------------------------------------------------------------------


def causal_over_prompts(
    run: Callable[[TraceRequest], Trace],
    prompts: Sequence[Prompt],
    template: TraceRequest,
    n: int = 10,
    on_prompt: Callable[[int, int], None] | None = None,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> SetResult:
    """tracing.analyses.causal.causal_check of every prompt (``template`` with the prompt, and the
    line's target and contrast where it has them). ``table``: per measure over the prompts (the
    correlation of attributed and measured, the share of parts whose removal moved the logit the
    way the part's sign says, the mean effect), the mean and its interval; ``each``: every prompt's
    parts (its line), ``summary["parts"]``: per part (block, kind, index) the mean effect and
    attributed value over the prompts where it was among the ``n`` largest, with the effect's
    interval (such a part's mean is over the prompts that chose it: read its ``n``)."""
    from .causal import causal_check

    check(resamples, seed, prompts=len(prompts))
    if not template.attribute:
        raise InputError("--causal applies to --attribute: the check removes the attribution's parts")
    if not prompts:
        raise InputError("no prompts to check")
    started, tables = time.perf_counter(), []
    for i, prompt in enumerate(prompts):
        if on_prompt is not None:
            on_prompt(i, len(prompts))
        request = dataclasses.replace(
            template,
            prompt=prompt.prompt,
            token_ids=None,
            target=prompt.target if prompt.target is not None else template.target,
            contrast=prompt.contrast if prompt.contrast is not None else template.contrast,
        )
        try:
            table = causal_check(run, request.check(), n)
        except InputError as exc:
            raise InputError(f"line {prompt.line}: {exc}") from None
        tables.append(table.assign(line=prompt.line, correlation=table.attrs["correlation"], total=table.attrs["total"]))
    each = pd.concat(tables, ignore_index=True)
    each = each[["line", *[c for c in each.columns if c != "line"]]]
    agrees = np.sign(each["effect"]) == np.sign(each["attributed"])
    per_prompt = pd.DataFrame(
        {
            "correlation": [t.attrs["correlation"] for t in tables],
            "sign_agreement": each.assign(agrees=agrees).groupby("line", sort=False)["agrees"].mean().to_numpy(),
            "effect": [t["effect"].mean() for t in tables],
            "attributed": [t["attributed"].mean() for t in tables],
        }
    )
    table = bootstrap(per_prompt.to_numpy(), resamples=resamples, seed=seed)
    table.insert(0, "measure", list(per_prompt.columns))
    parts = _per_part(each, resamples, seed)
    summary = {
        "prompts": len(prompts),
        "parts_per_prompt": n,
        "removals": len(each),
        "seconds": round(time.perf_counter() - started, 3),
        "resamples": resamples,
        "seed": seed,
        "level": LEVEL,
    }
    return SetResult(table, each, summary, parts)


def _per_part(each: pd.DataFrame, resamples: int, seed: int) -> pd.DataFrame:
    keys = ["part", "block", "kind", "index"]
    parts = each[keys].drop_duplicates().reset_index(drop=True)
    column = {key: j for j, key in enumerate(parts.itertuples(index=False, name=None))}
    row = {line: i for i, line in enumerate(dict.fromkeys(each["line"]))}
    effect = np.full((len(row), len(parts)), np.nan)  # prompts x parts; NaN: not among the prompt's largest
    attributed = np.full_like(effect, np.nan)
    at = ([row[line] for line in each["line"]], [column[key] for key in each[keys].itertuples(index=False, name=None)])
    effect[at], attributed[at] = each["effect"].to_numpy(), each["attributed"].to_numpy()
    stats = bootstrap(effect, resamples=resamples, seed=seed)
    out = parts.assign(
        n=stats["n"],
        attributed_mean=_nanmean(attributed),
        effect_mean=stats["mean"],
        effect_ci_low=stats["ci_low"],
        effect_ci_high=stats["ci_high"],
    )
    order = ["n", "block", "kind", "index"]
    return out.sort_values(order, ascending=[False, True, True, True], kind="stable").reset_index(drop=True)


def _nanmean(x: np.ndarray) -> np.ndarray:
    count = np.isfinite(x).sum(axis=0)
    total = np.where(np.isfinite(x), x, 0.0).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


# the loss of a change, prompt by prompt ---------------------------------------------------------


def loss_over_prompts(
    run: Callable[[TraceRequest], Trace],
    prompts: Sequence[Prompt],
    template: TraceRequest | None = None,
    changed: Callable[[TraceRequest], TraceRequest] | None = None,
    on_prompt: Callable[[int, int], None] | None = None,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> SetResult:
    """The next-token loss (negative log-likelihood, nats) of each prompt teacher-forced, plain
        (``template``, default a plain request, with the prompt) and ``changed`` (the same request changed: interventions, ...),
        and their paired difference (changed - plain), each the mean per position over the set with its
        interval. Every position t < T - 1 is scored (it predicts token t + 1), and separately those
        past the config's ``index_topk`` (t >= index_topk: their query sees more keys than the indexer
        keeps, so sparse attention can matter there; a change asking fewer keys, ``attention``: N, moves the
    bound to N). Each prompt weighs by its positions; the prompts
        are the unit drawn. ``table``: one row per measure (``nll``, ``nll_changed``, ``difference``,
        each also ``_past_topk``) with ``n`` prompts, ``tokens``, ``mean``, ``ci_low``, ``ci_high``."""
    if not prompts:
        raise InputError("no prompts to score")
    check(resamples, seed, prompts=len(prompts))
    template = template or TraceRequest(prompt="-")
    started, rows, topk = time.perf_counter(), [], None
    for i, prompt in enumerate(prompts):
        if on_prompt is not None:
            on_prompt(i, len(prompts))
        request = dataclasses.replace(template, prompt=prompt.prompt, token_ids=None, record=("next.token_prob",))
        try:
            plain = run(request.check())
            nll = _nll(plain, prompt.line)
            other = _nll(run(changed(request).check()), prompt.line) if changed is not None else None
        except InputError as exc:
            raise InputError(f"line {prompt.line}: {exc}") from None
        topk = _index_topk(plain.config, changed(request) if changed is not None else request)
        past = slice(topk, None) if topk is not None else slice(0, 0)
        row = {"line": prompt.line, "tokens": len(nll), "nll": nll.mean() if len(nll) else np.nan}
        row["past_topk_tokens"] = len(nll[past])
        row["nll_past_topk"] = nll[past].mean() if len(nll[past]) else np.nan
        if other is not None:
            row["nll_changed"] = other.mean() if len(other) else np.nan
            row["difference"] = (other - nll).mean() if len(nll) else np.nan
            row["nll_changed_past_topk"] = other[past].mean() if len(nll[past]) else np.nan
            row["difference_past_topk"] = (other[past] - nll[past]).mean() if len(nll[past]) else np.nan
        rows.append(row)
    each = pd.DataFrame(rows)
    measures = ["nll", *(["nll_changed", "difference"] if changed is not None else [])]
    out = []
    for suffix, weight in (("", "tokens"), ("_past_topk", "past_topk_tokens")):
        names = [m + suffix for m in measures]
        stats = bootstrap(each[names].to_numpy(), each[weight].to_numpy(), resamples=resamples, seed=seed)
        stats.insert(0, "measure", names)
        stats.insert(2, "tokens", int(each.loc[each[weight] > 0, weight].sum()))
        out.append(stats)
    table = pd.concat(out, ignore_index=True)
    summary = {
        "prompts": len(prompts),
        "tokens": int(each["tokens"].sum()),
        "index_topk": topk,
        "past_topk_tokens": int(each["past_topk_tokens"].sum()),
        "seconds": round(time.perf_counter() - started, 3),
        "resamples": resamples,
        "seed": seed,
        "level": LEVEL,
    }
    return SetResult(table, each, summary)


def _index_topk(cfg, request: TraceRequest) -> int | None:
    """The keys the indexer keeps: the config's, or fewer where the request asks (``attention``: N)."""
    if not cfg.has_indexer:
        return None
    asked = request.interventions.get("attention")
    return min(int(cfg.index_topk), asked) if isinstance(asked, int) and not isinstance(asked, bool) else int(cfg.index_topk)


def _nll(trace: Trace, line: int) -> np.ndarray:
    """-log p(token t + 1) at every position t < T - 1 (the last has no following token)."""
    prob = trace["next.token_prob"][:-1].double().numpy()  # (T - 1,)
    if (prob <= 0).any():
        t = int(np.flatnonzero(prob <= 0)[0])
        raise InputError(f"position {t} gave its next token probability 0 in float32 (a loss beyond 103 nats)")
    return -np.log(prob)
