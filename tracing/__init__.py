"""Tracing DeepSeek-V3.2-Exp: hook points recorded into a Trace, tidy tables, and the command line.

    from tracing import TraceRequest, run
    trace = run(model, TraceRequest(prompt="It is a truth", generate=8), tokenizer)
    trace = tracing.load("demo").run("It is a truth", record="all")  # a notebook's one call

The core sits here (sites: the registry; tracer: the hooks; trace: the file; runner: one request, run);
the packages hold the analyses, the corpus atlas, the tables and the command line. Importing this
package loads nothing else (names load on first use), so an entry point can start torch first
(tracing.startup).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Trace": "tracing.trace",
    "TraceError": "tracing.trace",
    "Tracer": "tracing.tracer",
    "TraceRequest": "tracing.runner",
    "run": "tracing.runner",
    "trace_tokens": "tracing.runner",
    "InputError": "tracing.errors",
    "tables": "tracing.tables",
    "load": "tracing.cli.loading",
    "Loaded": "tracing.cli.loading",
    "PassContext": "tracing.analyses.interventions",
    "Graph": "tracing.analyses.graph",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tracing' has no attribute {name!r}")
    module = importlib.import_module(_EXPORTS[name])
    return module if name == "tables" else getattr(module, name)


__all__ = sorted(_EXPORTS)
