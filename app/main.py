"""DeepSeek-V3.2-Exp anatomy explorer: ``streamlit run app/main.py``.

A thin router: page setup, the sidebar (model source, prompt, Trace, block), then the chosen page.
Pages live in ``app/views/`` (one module each); PAGES below is the one list of them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning (spinning made a small model 75x slower on a busy
# 2-core machine); this must happen before torch is first imported in the process.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `streamlit run app/main.py` puts app/ on the path, not the repo
    sys.path.insert(0, str(REPO))

import streamlit as st  # noqa: E402

from app import sidebar, state, widgets  # noqa: E402

VIEWS = Path(__file__).resolve().parent / "views"
# (file in app/views, title, icon); the first is the default page. A new page is a module in
# app/views ending in `if __name__ == "__main__": page()` and one line here.
PAGES = (
    ("model_map.py", "Model map", ":material/account_tree:"),
    ("anatomy.py", "Block anatomy", ":material/biotech:"),
    ("residual.py", "Residual stream", ":material/stacked_line_chart:"),
    ("attention.py", "Attention & indexer", ":material/grid_on:"),
    ("router.py", "Router & experts", ":material/hub:"),
    ("interventions.py", "Interventions", ":material/science:"),
    ("export.py", "Export", ":material/download:"),
)
ABOUT = (
    "**DeepSeek-V3.2-Exp anatomy explorer.** Every component's equation, tensor shapes and code beside the "
    "live tensors of your prompt, block by block. Trace files: `python -m tracing run ... --out trace.safetensors`."
)


def main() -> None:
    st.set_page_config(
        page_title="DeepSeek-V3.2 anatomy",
        page_icon=":material/biotech:",
        layout="wide",
        menu_items={"About": ABOUT},
    )
    state.init()
    pages = [st.Page(VIEWS / file, title=title, icon=icon, default=i == 0) for i, (file, title, icon) in enumerate(PAGES)]
    page = st.navigation(pages)
    notices = st.container()
    widgets.guarded(lambda: sidebar.render(notices), "The sidebar")
    widgets.guarded(page.run, f"The page {page.title}")


main()
