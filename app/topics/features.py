"""Features: a dictionary's feature pages (``python -m tracing dictionary features --out DIR``, whose
tables tracing.dictionary.pages makes), read and cut into the page's views; and the features of the
session's prompt under a dictionary, with one feature edited. Nothing is recomputed from a corpus here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from app.core.keys import Key, integer, number, one_of, text
from tracing.errors import InputError
from tracing.tables.files import PAGE_TABLES

from .figures import COLORS, figure

DICTIONARIES = Path(__file__).resolve().parents[2] / "assets" / "dictionaries"  # the demo's (scripts/demo_dictionaries.py)
BUNDLED = DICTIONARIES / "pages"  # their pages over the demo's held-out text (scripts/demo_feature_pages.py)
TYPED = "a directory"  # the choice of a dictionary typed, beside the bundled ones
SUMMARY = "feature_summary.csv"
SECTIONS = ("Features", "One feature", "Experts", "This prompt")
EDITS = ("zero", "scale", "add")
# the columns each view reads: a table without them is not a feature page's
NEEDED = {
    "feature_summary": ("dictionary", "site", "feature", "active_positions", "density", "mean_activation", "max_activation"),
    "feature_contexts": ("dictionary", "feature", "rank", "activation", "token", "context"),
    "feature_logits": ("dictionary", "feature", "effect", "rank", "token_id", "token", "logit"),
    "feature_experts": ("dictionary", "feature", "block", "expert", "positions", "share", "base_share", "difference"),
    "expert_features": ("dictionary", "block", "expert", "rank", "feature", "activation_mass"),
}
REQUIRED = ("feature_summary", "feature_contexts", "feature_logits")  # the experts' only with a MoE block after the site


class PagesError(InputError):
    """A directory that does not hold feature pages this app can read: one line."""


@dataclass(frozen=True)
class Pages:
    """The tables of a pages directory, by name (PAGE_TABLES), and the dictionaries they describe."""

    tables: dict[str, pd.DataFrame]

    @property
    def dictionaries(self) -> list[str]:
        return sorted(self.tables["feature_summary"]["dictionary"].astype(str).unique())

    def of(self, name: str, dictionary: str) -> pd.DataFrame:
        """Table ``name``'s rows of one dictionary (empty when the pages have no such table)."""
        frame = self.tables.get(name)
        if frame is None:
            return pd.DataFrame(columns=list(NEEDED[name]))
        return frame[frame["dictionary"].astype(str) == dictionary].drop(columns="dictionary")


def _files(folder: Path) -> dict[str, Path]:
    """Each table's file: its Parquet where there is one (typed, smaller: the bundled pages), else its CSV."""
    out = {}
    for name in PAGE_TABLES:
        for ext in ("parquet", "csv"):
            if (folder / f"{name}.{ext}").is_file():
                out[name] = folder / f"{name}.{ext}"
                break
    return out


def bundled_pages() -> bool:
    return "feature_summary" in _files(BUNDLED)


def stamp(path: str) -> tuple:
    """The tables' names, sizes and times: what tells rewritten pages from the ones read."""
    return tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in _files(Path(path)).values())


def read_pages(directory: str | os.PathLike, limit: int) -> Pages:
    """The pages in ``directory`` (their tables, Parquet or CSV), each checked for the columns its
    views read; nothing over ``limit`` bytes in all is read."""
    folder = Path(directory)
    files = _files(folder)
    missing = [name for name in REQUIRED if name not in files]
    if missing:
        raise PagesError(f"{folder.name or folder}: no {missing[0]}.csv (write pages with python -m tracing dictionary features)")
    if sum(f.stat().st_size for f in files.values()) > limit:
        raise PagesError(f"{folder.name}: its tables are over the {limit / 2**20:.3g} MiB this app reads")
    tables = {}
    for name, path in files.items():
        try:
            if path.suffix == ".parquet":
                frame = pd.read_parquet(path)
            else:
                frame = pd.read_csv(path, keep_default_na=False, na_values=[""])
        except Exception as exc:  # noqa: BLE001 - pyarrow raises its own error types for damaged files
            raise PagesError(f"{path.name}: not a readable table ({str(exc).splitlines()[0][:120]})") from None
        lacking = [c for c in NEEDED[name] if c not in frame.columns]
        if lacking:
            raise PagesError(f"{path.name}: no column {lacking[0]!r}: not a feature page's table")
        if "token" in frame.columns and path.suffix == ".csv":  # the CSV's guard against formulas, undone
            frame["token"] = _unguarded(frame["token"])
        tables[name] = frame
    return Pages(tables)


def _unguarded(column: pd.Series) -> pd.Series:
    values = column.astype(str)
    guarded = values.str.match(r"^'[=+\-@\t\r]")
    return values.where(~guarded, values.str[1:])


# --- the views --------------------------------------------------------------------------------------------
def search(pages: Pages, dictionary: str, query: str) -> pd.DataFrame:
    """The dictionary's features, strongest first; ``query``: a feature id, or text one of its
    strongest contexts' tokens or the tokens it promotes holds (any case)."""
    summary = pages.of("feature_summary", dictionary).sort_values("max_activation", ascending=False)
    query = query.strip()
    if not query:
        return summary.reset_index(drop=True)
    if query.isascii() and query.isdigit():
        return summary[summary["feature"] == int(query)].reset_index(drop=True)
    needle = query.lower()
    contexts, logits = pages.of("feature_contexts", dictionary), pages.of("feature_logits", dictionary)
    hits = set(contexts.loc[contexts["token"].astype(str).str.lower().str.contains(needle, regex=False), "feature"])
    promoted = logits[logits["effect"] == "promoted"]
    hits |= set(promoted.loc[promoted["token"].astype(str).str.lower().str.contains(needle, regex=False), "feature"])
    return summary[summary["feature"].isin(hits)].reset_index(drop=True)


def overview_figure(summary: pd.DataFrame, dictionary: str) -> go.Figure:
    """Each feature: how often it is active (x) against how much its positions favour one expert of
    the next MoE block over that expert's base rate (y: share / base), its strongest activation the size."""
    shown = summary[summary["active_positions"] > 0]
    routed = "top_expert_share" in shown.columns and shown["top_expert_share"].notna().any()
    y = (shown["top_expert_share"] / shown["top_expert_base"]) if routed else shown["mean_activation"]
    size = 4 + 12 * shown["max_activation"] / max(float(shown["max_activation"].max() or 1), 1e-9)
    points = {
        "type": "scatter",
        "mode": "markers",
        "x": shown["density"].tolist(),
        "y": y.tolist(),
        "text": [f"feature {int(f)}" for f in shown["feature"]],
        "marker": {"size": size.tolist(), "color": COLORS["moe"], "opacity": 0.6},
        "hovertemplate": "%{text}<br>density %{x:.3%}<br>%{y:.2f}<extra></extra>",
    }
    what = "its top expert's share over the base rate" if routed else "mean activation"
    return figure(
        [points],
        f"{dictionary}: each feature's density against {what}",
        xaxis={"title": {"text": "share of positions where it is active"}, "type": "log"},
        yaxis={"title": {"text": what}},
    )


def one_feature(pages: Pages, dictionary: str, feature: int) -> dict | None:
    """Everything the pages say of one feature, or None where the dictionary has no such feature."""
    summary = pages.of("feature_summary", dictionary)
    row = summary[summary["feature"] == feature]
    if row.empty:
        return None
    logits = pages.of("feature_logits", dictionary)
    mine = logits[logits["feature"] == feature].sort_values("rank")
    experts = pages.of("feature_experts", dictionary)
    contexts = pages.of("feature_contexts", dictionary)
    return {
        "summary": row.iloc[0].to_dict(),
        "contexts": contexts[contexts["feature"] == feature].sort_values("rank").drop(columns="feature"),
        "promoted": mine[mine["effect"] == "promoted"][["rank", "token_id", "token", "logit"]],
        "suppressed": mine[mine["effect"] == "suppressed"][["rank", "token_id", "token", "logit"]],
        "experts": experts[experts["feature"] == feature].sort_values("positions", ascending=False).drop(columns="feature"),
    }


def describe(summary: dict) -> str:
    """One line of a feature's summary row."""
    line = (
        f"active at {int(summary['active_positions']):,} positions ({summary['density'] * 100:.2f}% of the corpus), "
        f"mean activation {summary['mean_activation']:.3g}, strongest {summary['max_activation']:.3g}"
    )
    share = summary.get("indexer_kept_share")
    if share is not None and np.isfinite(share):
        base = summary.get("indexer_base_share", np.nan)
        line += (
            f"; block {int(summary['indexer_block'])}'s indexer keeps its strongest positions for {share * 100:.0f}% "
            f"of later queries (every position: {base * 100:.0f}%)"
        )
    return line


def experts_figure(experts: pd.DataFrame, feature: int) -> go.Figure:
    """Where the feature's positions are routed, against the block's base rates."""
    labels = [f"{int(e)}" for e in experts["expert"]]
    bars = [
        {"type": "bar", "x": labels, "y": experts["share"].tolist(), "name": "its positions", "marker": {"color": COLORS["moe"]}},
        {
            "type": "bar",
            "x": labels,
            "y": experts["base_share"].tolist(),
            "name": "every position",
            "marker": {"color": COLORS["norm"]},
        },
    ]
    title = f"Feature {feature}: the experts its positions are routed to, against the block's base rates"
    return figure(
        bars, title, barmode="group", xaxis={"title": {"text": "expert"}}, yaxis={"title": {"text": "share of routing slots"}}
    )


def expert_features(pages: Pages, dictionary: str, block: int, expert: int) -> pd.DataFrame:
    """The features an expert's positions carry most (activation mass), with each one's share."""
    frame = pages.of("expert_features", dictionary)
    frame = frame[(frame["block"] == block) & (frame["expert"] == expert)].sort_values("rank")
    return frame.drop(columns=["block", "expert"]).reset_index(drop=True)


def expert_blocks(pages: Pages, dictionary: str) -> list[int]:
    return sorted(int(b) for b in pages.of("expert_features", dictionary)["block"].unique())


# --- the session's prompt ----------------------------------------------------------------------------------
def bundled_dictionaries() -> list[str]:
    """The demo's bundled dictionaries, by directory name."""
    if not DICTIONARIES.is_dir():
        return []
    return sorted(p.name for p in DICTIONARIES.iterdir() if (p / "cfg.json").is_file())


def served_dictionaries(model) -> dict[str, dict] | None:
    """A model server's dictionaries by name (its /info: their site, kind and width), or None for a
    model loaded here (which reads directories)."""
    facts = getattr(model, "facts", None)
    if facts is None:
        return None
    served = facts.get("dictionaries")
    if not isinstance(served, dict):  # none, or what a server should not have said
        return {}
    return {str(name): info for name, info in served.items() if isinstance(info, dict) and isinstance(info.get("site"), str)}


def edit_spec(site: str, feature: int, edit: str, amount: float, positions: str) -> str:
    """A feature edit as the request's ``features`` text (tracing.dictionary.features.parse_edits)."""
    how = {"zero": "=0", "scale": f"*{amount:g}", "add": f"{amount:+g}"}[edit]
    at = f"@{positions.strip()}" if positions.strip() else ""
    return f"{site}:{int(feature)}{how}{at}"


def prompt_features(trace, site: str) -> pd.DataFrame:
    """The features table of a trace (tracing.tables.frames.features_table), one dictionary's rows."""
    from tracing.tables.frames import features_table

    frame = features_table(trace)
    return frame[frame["site"] == site].drop(columns=["site"]).reset_index(drop=True) if not frame.empty else frame


def next_tokens(plain, edited) -> pd.DataFrame:
    """The top next tokens after the last position, without and with the edit."""
    from tracing.tables.frames import next_token_table

    left, right = next_token_table(plain, 10), next_token_table(edited, 10)
    return pd.DataFrame(
        {
            "rank": np.arange(len(left)),
            "token": left["token"].to_numpy(),
            "probability": left["probability"].to_numpy(),
            "edited_token": right["token"].to_numpy()[: len(left)],
            "edited_probability": right["probability"].to_numpy()[: len(left)],
        }
    )


KEYS: tuple[Key, ...] = (
    Key("feat_source", "Features: the pages' source, bundled or a directory", kept=True, link=one_of("bundled", "dir")),
    Key("feat_dir", "Features: the pages directory typed", "", kept=True, link=text(4096)),
    Key("feat_dictionary", "Features: the dictionary shown", kept=True, link=text(200)),
    Key("feat_section", "Features: the view shown", SECTIONS[0], kept=True, link=one_of(*SECTIONS)),
    Key("feat_search", "Features: a feature id or token text searched", "", kept=True, link=text(200)),
    Key("feat_id", "Features: the feature shown", 0, kept=True, link=integer(0, 1 << 24)),
    Key("feat_block", "Features: the block whose expert is shown", kept=True, link=integer(0, 1 << 16)),
    Key("feat_expert", "Features: the expert shown", 0, kept=True, link=integer(0, 1 << 20)),
    Key("feat_prompt_dictionary", "Features: the dictionary the prompt is read with (bundled, or typed)", kept=True),
    Key("feat_dict_dir", "Features: the dictionary directory typed for the prompt", "", kept=True),
    Key("feat_edit", "Features: the edit of the prompt's feature: zero, scale or add", EDITS[0], kept=True, link=one_of(*EDITS)),
    Key("feat_amount", "Features: the edit's scale or amount", 2.0, kept=True, link=number(-1e6, 1e6)),
    Key("feat_positions", "Features: the positions the edit acts at (P, A:B; empty: all)", "", kept=True, link=text(40)),
    Key("feat_run", "Features: the button that traces the prompt with the dictionary"),
    Key("feat_traced", "Features: the prompt's plain and edited traces, and what they were asked"),
    Key("feat_experts_figure", "Features: the feature's experts figure"),
    Key("feat_overview", "Features: the features' density and routing figure"),
    Key("feat_csv_", "Features: a table's CSV button (the table)", family=True),
)
