"""The errors that mean bad input (a checkpoint, a prompt, a trace file): the app says them in one
line and carries on with what it showed before."""

from __future__ import annotations

from model.checkpoint import CheckpointError
from model.config import ConfigError
from tracing.errors import InputError
from tracing.tokenizer import TokenizerError
from tracing.trace import TraceError

BAD_INPUT = (CheckpointError, ConfigError, InputError, TraceError, TokenizerError)
