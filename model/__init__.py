"""A faithful PyTorch DeepSeek-V3.2-Exp, named as the official inference code."""

import os

# Idle OpenMP threads sleep instead of spinning: on a busy 2-core machine spinning threads made a small
# model's forward 75x slower. libgomp reads this once, when torch loads it, so every entry point (the CLI,
# the app, the tests, the scripts) imports this package before torch; set OMP_WAIT_POLICY=ACTIVE to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .cache import Cache  # noqa: E402
from .config import TINY, ConfigError, ModelArgs  # noqa: E402
from .transformer import Block, Transformer  # noqa: E402

__all__ = ["Block", "Cache", "ConfigError", "ModelArgs", "TINY", "Transformer"]
