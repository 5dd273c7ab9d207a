"""The app's pages, in the order the navigation lists them; the first is the default. A new page is
a module in app/views ending in ``if __name__ == "__main__": page()`` and one row here."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

VIEWS = Path(__file__).resolve().parents[1] / "views"


class Page(NamedTuple):
    name: str  # its module in app/views
    title: str
    icon: str
    traced: bool = True  # shows the session's trace (False: reads something else, as the atlas)

    @property
    def file(self) -> Path:
        return VIEWS / f"{self.name}.py"

    @property
    def path(self) -> str:
        """Relative to app/, as AppTest.switch_page takes it."""
        return f"views/{self.name}.py"


PAGES = (
    Page("model_map", "Model map", ":material/account_tree:"),
    Page("anatomy", "Block anatomy", ":material/biotech:"),
    Page("residual", "Residual stream", ":material/stacked_line_chart:"),
    Page("attention", "Attention & indexer", ":material/grid_on:"),
    Page("router", "Router & experts", ":material/hub:"),
    Page("generation", "Generation", ":material/edit_note:"),
    Page("interventions", "Interventions", ":material/science:"),
    Page("attribution", "Attribution", ":material/call_split:"),
    Page("patching", "Patching", ":material/swap_horiz:"),
    Page("atlas", "Atlas", ":material/public:", traced=False),
    Page("features", "Features", ":material/category:", traced=False),
    Page("export", "Export", ":material/download:"),
)
