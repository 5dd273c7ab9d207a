"""The atlas's corpus: text files or JSONL records, cut into sequences, grouped into batches.

Each text is tokenised on its own and cut into windows of ``seq_len`` positions: BOS (when the
tokenizer has one, as the model saw text in training) and the next ``seq_len - 1`` tokens; the
last window of a text is shorter. Batches hold sequences of one length, so nothing is padded: full
windows fill one batch after another, shorter ones wait in a bucket of their length until it is
full or the corpus ends. The batches come in one fixed order for given texts and settings, so
"the first n batches" names the same sequences in every run (resuming, and splitting the batches
over ranks).

The corpus is read twice: :meth:`Corpus.survey` checks every input (readable, UTF-8, valid JSON
with the field present) and counts before the model loads, so bad input fails at once and the
progress bar knows its total; :meth:`Corpus.batches` then yields what the model runs. Only the
current text and the unfilled batches are held, whatever the size of the corpus.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..cli.inputs import regular_file
from ..errors import InputError

MARGIN = 64  # tokens past a text's budget, tokenised and dropped (see Corpus._encode)


@dataclass(frozen=True)
class Source:
    """One input file: plain text (one text), or JSON Lines (one text per record, in ``field``)."""

    path: Path
    field: str | None = None  # None: a plain text file

    def describe(self) -> str:
        return str(self.path) if self.field is None else f"{self.path} (JSON Lines, field {self.field!r})"


@dataclass
class Survey:
    """What the first pass found: per input its sha256, texts and tokens; in all, the sequences,
    positions (tokens, BOS included) and batches the run will have."""

    inputs: list[dict] = field(default_factory=list)
    sequences: int = 0
    tokens: int = 0
    batches: int = 0


def _cannot(path: Path, exc: OSError) -> InputError:
    return InputError(f"{path}: cannot read ({exc.strerror or exc})")


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except OSError as exc:
        raise _cannot(path, exc) from None
    return digest.hexdigest()


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{where}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


def _texts(source: Source) -> Iterator[str]:
    """The texts of one input, checked; JSON Lines are read a line at a time. Empty records are
    passed on (the caller counts and skips them)."""
    try:
        if source.field is None:
            data = source.path.read_bytes()
            text = _decode(data, str(source.path))
            if not text.strip():
                raise InputError(f"{source.path}: the file is empty" if not data else f"{source.path}: holds no text")
            yield text
            return
        blank = True
        with open(source.path, "rb") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                blank, where = False, f"{source.path} line {number}"
                try:
                    record = json.loads(_decode(line, where))
                except json.JSONDecodeError as exc:
                    raise InputError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
                except RecursionError:
                    raise InputError(f"{where}: JSON nested too deeply") from None
                if not isinstance(record, dict) or source.field not in record:
                    raise InputError(f"{where}: no field {source.field!r} (choose another with --field)")
                text = record[source.field]
                if not isinstance(text, str):
                    raise InputError(f"{where}: field {source.field!r} holds {type(text).__name__}, not text")
                yield text
    except OSError as exc:
        raise _cannot(source.path, exc) from None
    if source.field is not None and blank:
        raise InputError(f"{source.path}: the file is empty")


class Corpus:
    """The inputs of one atlas run, cut for a model by ``tokenizer`` (``encode``, ``bos_id``)."""

    def __init__(self, sources: list[Source], tokenizer, seq_len: int, batch_size: int, max_tokens: int | None = None):
        if not sources:
            raise InputError("no texts: give --text-file F (repeatable) or --jsonl F [--field text]")
        if seq_len < 2:
            raise InputError(f"--seq-len {seq_len}: a sequence needs at least 2 positions")
        if batch_size < 1:
            raise InputError(f"--batch-size {batch_size}: must be at least 1")
        if max_tokens is not None and max_tokens < 2:
            raise InputError(f"--max-tokens {max_tokens}: must be at least 2")
        for source in sources:
            regular_file(source.path, "text file" if source.field is None else "JSON Lines file")
        self.sources = sources
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.max_tokens = max_tokens

    def _sequences(self, survey: Survey | None = None) -> Iterator[list[int]]:
        """Every sequence in corpus order, at most ``max_tokens`` positions in all."""
        bos = self.tokenizer.bos_id
        span = self.seq_len - (bos is not None)
        left = self.max_tokens
        for source in self.sources:
            info = {"path": str(source.path), "sha256": _digest(source.path) if survey else None, "texts": 0, "tokens": 0}
            if source.field is not None:
                info.update(field=source.field, empty_records=0)
            for text in _texts(source):
                if not text.strip():
                    info["empty_records"] += 1
                    continue
                ids = self._encode(text, left)
                info["texts"] += 1
                for start in range(0, len(ids), span):
                    seq = ([bos] if bos is not None else []) + ids[start : start + span]
                    if left is not None:
                        seq = seq[:left]
                    if len(seq) < 2:  # one position attends to nothing but itself: not a prefill
                        continue
                    info["tokens"] += len(seq)
                    yield seq
                    if left is not None:
                        left -= len(seq)
                        if left < 2:
                            break
                if left is not None and left < 2:
                    break
            if survey is not None:
                if not info["texts"]:
                    raise InputError(f"{source.path}: no text in field {source.field!r}")
                survey.inputs.append(info)
            if left is not None and left < 2:
                break

    def _encode(self, text: str, budget: int | None) -> list[int]:
        """The text's token ids; with a budget, its first ``budget`` only, from a prefix of the text
        grown until it gives MARGIN tokens more (a cut can change only the last tokens), so a huge
        text costs what the budget needs. The same text and budget give the same ids every time."""
        if budget is None:
            return self.tokenizer.encode(text, add_bos=False)
        size = max(4 * (budget + MARGIN), 1 << 12)  # characters: a token rarely spans more than 4
        while size < len(text):
            ids = self.tokenizer.encode(text[:size], add_bos=False)
            if len(ids) > budget + MARGIN:
                return ids[:budget]
            size *= 4
        return self.tokenizer.encode(text, add_bos=False)[:budget]

    def batches(self, survey: Survey | None = None) -> Iterator[list[list[int]]]:
        """Batches of equal-length sequences, in the run's fixed order (see the module's docstring)."""
        buckets: dict[int, list[list[int]]] = {}
        for seq in self._sequences(survey):
            bucket = buckets.setdefault(len(seq), [])
            bucket.append(seq)
            if len(bucket) == self.batch_size:
                yield buckets.pop(len(seq))
        for length in sorted(buckets, reverse=True):
            yield buckets[length]

    def survey(self) -> Survey:
        """The first pass: every input checked, everything counted (see the module's docstring)."""
        survey = Survey()
        for batch in self.batches(survey):
            survey.batches += 1
            survey.sequences += len(batch)
            survey.tokens += len(batch) * len(batch[0])
        if not survey.sequences:
            raise InputError("the texts are too short: no sequence of 2 positions or more")
        return survey
