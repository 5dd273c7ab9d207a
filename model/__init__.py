"""A faithful PyTorch DeepSeek-V3.2-Exp, named as the official inference code."""

from .cache import Cache
from .config import TINY, ConfigError, ModelArgs
from .transformer import Block, Transformer

__all__ = ["Block", "Cache", "ConfigError", "ModelArgs", "TINY", "Transformer"]
