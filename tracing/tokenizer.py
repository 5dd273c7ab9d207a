"""The checkpoint's tokenizer (``tokenizer.json``), read with the ``tokenizers`` library."""

from __future__ import annotations

import os
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from model.files import FileError, confined, read_json


class TokenizerError(ValueError):
    """A missing or unreadable tokenizer, or text it cannot encode."""


def _token_content(config: dict, key: str, path: Path) -> str | None:
    """A special token's text: a string, or an object with a "content" string (both Hugging Face forms)."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise TokenizerError(f"{path}: {key} must be a token's text, not {type(value).__name__} {str(value)[:40]}")
    return value or None


def _check_utf8(text: str) -> None:
    """Python hands undecodable bytes of argv over as lone surrogates, which the tokenizers
    library refuses with a TypeError; name the first such byte instead."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = text[exc.start]
        what = f"byte 0x{ord(char) - 0xDC00:02x}" if 0xDC80 <= ord(char) <= 0xDCFF else f"character U+{ord(char):04X}"
        raise TokenizerError(f"the prompt is not valid UTF-8 ({what} at character {exc.start})") from None


def _confined(directory: Path, name: str) -> Path:
    try:
        return confined(directory, name)
    except FileError as exc:
        raise TokenizerError(f"{directory}: {exc}") from None


def _read_config(path: Path) -> dict:
    try:
        config = read_json(path)
    except FileError as exc:
        raise TokenizerError(f"{path}: {exc}") from None
    if not isinstance(config, dict):
        raise TokenizerError(f"{path}: must be a JSON object, not {type(config).__name__}")
    return config


class Tokenizer:
    """Encode prompts and show tokens; prepends BOS when tokenizer_config.json asks for it."""

    def __init__(self, directory: str | os.PathLike):
        directory = Path(directory)
        path = _confined(directory, "tokenizer.json")
        if not path.is_file():
            raise TokenizerError(f"{path}: no tokenizer.json")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises bare Exceptions for malformed files
            raise TokenizerError(f"{path}: not a readable tokenizer ({exc})") from None
        config_path = _confined(directory, "tokenizer_config.json")
        config = _read_config(config_path) if config_path.is_file() else {}
        bos = _token_content(config, "bos_token", config_path)
        self.bos_id = self._tok.token_to_id(bos) if bos else None
        add_bos = config.get("add_bos_token") or False
        if not isinstance(add_bos, bool):
            raise TokenizerError(f"{config_path}: add_bos_token must be true or false, not {str(add_bos)[:40]}")
        self.add_bos = add_bos and self.bos_id is not None
        eos = _token_content(config, "eos_token", config_path)
        self.eos_id = self._tok.token_to_id(eos) if eos else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        _check_utf8(text)
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def token_id(self, text: str) -> int | None:
        """The id of a token by its text (a special token such as ``<｜User｜>``), or None."""
        return self._tok.token_to_id(text)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_strings(self, ids: list[int]) -> list[str]:
        """One readable string per token: its decoded text (bytes of a split character show as the
        byte-level symbol instead of a replacement character)."""
        out = []
        for i in ids:
            text = self._tok.decode([int(i)], skip_special_tokens=False)
            if "\ufffd" in text or text == "":
                text = self._tok.id_to_token(int(i)) or f"<{i}>"
            out.append(text)
        return out
