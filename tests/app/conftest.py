"""Streamlit's testing API, as cheap as the app it runs.

Each ``AppTest.run`` makes a new component manager, which scans the metadata of every installed
distribution for Streamlit components (``scan_component_manifests``): about half a second per run
here, more than most of the app's own runs, and a served app does it once at start-up. The
distributions installed do not change during a test session, so the first scan's answer stands
for every later run.
"""

from __future__ import annotations

import functools

try:
    from streamlit.components.v2 import manifest_scanner
except ImportError:  # a Streamlit without components v2 scans nothing per run
    manifest_scanner = None

if manifest_scanner is not None and hasattr(manifest_scanner, "scan_component_manifests"):
    _scan = manifest_scanner.scan_component_manifests

    @functools.cache
    def _scanned_once() -> tuple:
        return tuple(_scan())

    def _scan_component_manifests(max_workers: int | None = None) -> list:
        return list(_scanned_once())

    manifest_scanner.scan_component_manifests = _scan_component_manifests
