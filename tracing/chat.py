"""Chat prompts for the real model: DeepSeek-V3.2's conversation format.

A conversation starts with the begin-of-sentence token and an optional system text; the user's
turn follows the ``<｜User｜>`` token, the assistant's the ``<｜Assistant｜>`` token, and the model
is then put in thinking mode (``<think>``: it writes its reasoning, closes it with ``</think>``
and answers) or non-thinking mode (``</think>`` at once: it answers directly). The markers are
single tokens of the real vocabulary; a tokenizer without them cannot hold a chat.
"""

from __future__ import annotations

from .tokenizer import Tokenizer, TokenizerError

BOS = "<｜begin▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"


def _marker(tokenizer: Tokenizer, text: str) -> int:
    token = tokenizer.token_id(text)
    if token is None:
        raise TokenizerError(f"this tokenizer has no {text} token: --chat needs DeepSeek-V3.2's vocabulary")
    return token


def encode_chat(tokenizer: Tokenizer, prompt: str, thinking: bool = False, system: str = "") -> list[int]:
    """The token ids of a one-turn conversation whose assistant turn the model writes next."""
    ids = [_marker(tokenizer, BOS)]
    ids += tokenizer.encode(system, add_bos=False) if system else []
    ids += [_marker(tokenizer, USER), *tokenizer.encode(prompt, add_bos=False), _marker(tokenizer, ASSISTANT)]
    return ids + [_marker(tokenizer, THINK if thinking else END_THINK)]
