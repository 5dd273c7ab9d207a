"""The checkpoint's tokenizer (``tokenizer.json``), read with the ``tokenizers`` library."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class TokenizerError(ValueError):
    """A missing or unreadable tokenizer, or text it cannot encode."""


def _token_content(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _check_utf8(text: str) -> None:
    """Python hands undecodable bytes of argv over as lone surrogates, which the tokenizers
    library refuses with a TypeError; name the first such byte instead."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = text[exc.start]
        what = f"byte 0x{ord(char) - 0xDC00:02x}" if 0xDC80 <= ord(char) <= 0xDCFF else f"character U+{ord(char):04X}"
        raise TokenizerError(f"the prompt is not valid UTF-8 ({what} at character {exc.start})") from None


class Tokenizer:
    """Encode prompts and show tokens; prepends BOS when tokenizer_config.json asks for it."""

    def __init__(self, directory: str | os.PathLike):
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path}: no tokenizer.json")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises bare Exceptions for malformed files
            raise TokenizerError(f"{path}: not a readable tokenizer ({exc})") from None
        config = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except (OSError, ValueError) as exc:
                raise TokenizerError(f"{config_path}: not valid JSON ({exc})") from None
        bos = _token_content(config.get("bos_token"))
        self.bos_id = self._tok.token_to_id(bos) if bos else None
        self.add_bos = bool(config.get("add_bos_token", False)) and self.bos_id is not None
        eos = _token_content(config.get("eos_token"))
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
