"""Starting torch for the entry points (the command line, the app, the benchmarks, the tests): its
idle OpenMP threads sleep instead of spinning.

libgomp reads ``OMP_WAIT_POLICY`` once, when torch loads it. Spinning threads made a small model's
forward up to 75x slower on a busy 2-core machine (another process on the other core), and the
thread policy (model.kernels.threads) wakes them only for large products. So an entry point calls
:func:`load_torch` before anything imports torch: the variable is set while torch loads and removed
after, so the process's environment, and so its children's, is as the user left it. A policy the
user set (``OMP_WAIT_POLICY=ACTIVE``) is kept. This module imports nothing of torch or the project.
"""

from __future__ import annotations

import os
import sys

POLICY = "OMP_WAIT_POLICY"


def load_torch() -> None:
    """Import torch with idle OpenMP threads sleeping, unless torch is loaded already or the user chose a policy."""
    if "torch" in sys.modules or POLICY in os.environ:
        import torch  # noqa: F401

        return
    os.environ[POLICY] = "PASSIVE"
    try:
        import torch  # noqa: F401
    finally:
        del os.environ[POLICY]
