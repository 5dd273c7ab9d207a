"""DeepSeek-V3.2-Exp anatomy explorer: ``streamlit run app/main.py``.

A thin router, run only by Streamlit: page setup, the sidebar (model source, prompt, Trace, block),
then the chosen page. Pages live in ``app/views/`` (one module each); app.core.pages lists them.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `streamlit run app/main.py` puts app/ on the path, not the repo
    sys.path.insert(0, str(REPO))

import streamlit as st  # noqa: E402
from streamlit.runtime.scriptrunner import get_script_run_ctx  # noqa: E402

from app.ui import prefetch  # noqa: E402

if get_script_run_ctx(suppress_warning=True) is not None:
    prefetch.plotly()  # before torch loads below: the browser fetches plotly.js meanwhile

from tracing.startup import load_torch  # noqa: E402

load_torch()  # before anything imports torch: its idle OpenMP threads sleep (tracing.startup)

# isort: split
from app import sidebar  # noqa: E402
from app.core import links, session  # noqa: E402
from app.core.pages import PAGES  # noqa: E402
from app.ui import widgets  # noqa: E402

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
    session.init()
    dropped = links.restore(st.session_state, st.query_params)  # a reload or a shared link: the same view
    page = st.navigation([st.Page(p.file, title=p.title, icon=p.icon, default=i == 0) for i, p in enumerate(PAGES)])
    notices = st.container()
    if dropped:
        were = "was" if len(dropped) == 1 else "were"
        notices.warning(f"The link's {', '.join(dropped)} could not be read and {were} left out.", icon=":material/link_off:")
    widgets.guarded(lambda: sidebar.render(notices), "The sidebar")
    widgets.new_page(page.title)
    widgets.guarded(page.run, f"The page {page.title}")
    widgets.guarded(lambda: widgets.page_downloads(page.title), "The page's downloads")
    links.store(st.session_state, st.query_params, session.defaults())


if __name__ == "__main__":
    if get_script_run_ctx(suppress_warning=True) is None:
        raise SystemExit("the app runs under Streamlit: streamlit run app/main.py")
    main()
