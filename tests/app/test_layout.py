"""The app's layout holds: pages only lay out (each view short, its runs in app.topics), app.topics never
imports Streamlit (its functions run and are tested without it), and app/ holds no loose module
besides the entry, the sidebar and the notebook's plots."""

import ast
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "app"
LONGEST_VIEW = 250  # lines


def imported(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_view_is_over_250_lines():
    long = {p.name: n for p in (APP / "views").glob("*.py") if (n := len(p.read_text().splitlines())) > LONGEST_VIEW}
    assert not long, f"views over {LONGEST_VIEW} lines (move their runs to app.topics, their parts to app.ui): {long}"


def test_topics_never_import_streamlit():
    drawing = [p.name for p in (APP / "topics").glob("*.py") if any(m.split(".")[0] == "streamlit" for m in imported(p))]
    assert not drawing, f"app.topics modules importing streamlit: {drawing}"


def test_app_holds_no_loose_module():
    loose = sorted(p.name for p in APP.glob("*.py"))
    assert loose == ["__init__.py", "main.py", "plots.py", "sidebar.py"], loose
