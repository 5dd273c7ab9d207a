"""Training a TopK dictionary on a site's values over a corpus, and its report on held-out text.

``python -m tracing dictionary train`` (tracing.cli.dictionary) and the Python API::

    report = train(tracing.load("demo"), ["corpus.txt"], "dict-out", site="layers.2.resid_post",
                   features=1024, k=16)           # writes cfg.json, sae_weights.safetensors, report.json

The corpus is cut and batched as the atlas cuts it (tracing.atlas.corpus): a fixed order of batches
of equal-length sequences. Every ``1 / heldout``-th batch is held out for the report; the others
are run through the model (tracing.dictionary.sources), their rows appended to the activation
buffer on disk (tracing.dictionary.buffer) until it holds ``buffer_bytes``, then read back shuffled
for a phase of optimiser steps, and the buffer is emptied for the next. A corpus that fits in the
buffer is gathered once and read ``epochs`` times.

The dictionary (Gao et al. 2024, "Scaling and evaluating sparse autoencoders"): TopK of ReLU'd
pre-activations, decoder rows of unit norm (the gradient along each row projected out, the rows
renormalised after every step), b_dec started at the data's mean, the encoder at the decoder's
transpose. The rows are scaled so that their mean squared norm is their width (the scale is folded
into the saved biases and encoder, exactly: TopK and ReLU commute with a positive scale) and the
loss is the squared error over the data's variance. Features that fired on none of the last
``dead_tokens`` rows are dead; the auxiliary loss (coefficient 1/32) has the ``aux_k`` largest of
their pre-activations reconstruct the main reconstruction's error, which gives them gradient again.
Adam at ``2e-4 / sqrt(features / 2**14)``, Gao's scaling with width.

After each phase the training state (the dictionary, Adam's moments, the step, the corpus batch
reached, the random generator, the dead-feature counts) is written to ``train_state.safetensors``
in the output directory: a run stopped and started again with the same settings continues from
there (the rows of the interrupted phase are gathered again). The report (fraction of variance
explained, L0, dead share, next-token loss with the reconstruction spliced in) is printed and
written to ``report.json``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.optim.adam import adam

from ..atlas.corpus import Corpus, Source, Survey
from ..cli.output import check_directory, write_file
from ..cli.progress import ProgressBar
from ..errors import InputError
from .buffer import ActivationBuffer
from .dictionary import CFG_NAME, KINDS, WEIGHTS_NAME, Dictionary, save, site_layer
from .sources import LocalModel, ServerModel

STATE = "train_state.safetensors"
REPORT = "report.json"
BUFFER = "buffer"
STATE_FORMAT = "deepseek-v32-dictionary-train-state"
AUX_COEFFICIENT = 1 / 32
DEFAULT_SEQ_LEN = 256


@dataclass
class Settings:
    """What a training run is asked; a resumed run must be asked the same."""

    site: str
    kind: str = "sae"
    features: int = 1024
    k: int = 16
    seed: int = 0
    lr: float | None = None  # None: 2e-4 / sqrt(features / 2**14)
    rows_per_step: int = 1024
    epochs: int = 1
    seq_len: int | None = None  # None: 256, or fewer where the model takes fewer
    batch_size: int = 8  # sequences per forward pass
    max_tokens: int | None = None
    heldout: float = 0.1  # the share of the corpus batches held out for the report
    buffer_bytes: int = 256 << 20
    aux_k: int | None = None  # None: 2 k
    dead_tokens: int = 100_000  # a feature silent for this many rows is dead

    def check(self) -> None:
        if self.kind not in KINDS:
            raise InputError(f"--kind {self.kind!r}: choose {' or '.join(KINDS)}")
        site_layer(self.kind, self.site)
        for name in ("features", "k", "rows_per_step", "epochs", "batch_size", "dead_tokens"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be at least 1")
        if self.k > self.features:
            raise InputError(f"--k {self.k}: at most the {self.features} features")
        if self.aux_k is not None and not 1 <= self.aux_k <= self.features:
            raise InputError(f"--aux-k {self.aux_k}: between 1 and the {self.features} features")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise InputError(f"--lr {self.lr}: must be a positive number")
        if not 0 < self.heldout < 1:
            raise InputError(f"--heldout {self.heldout}: a share between 0 and 1")
        if self.buffer_bytes < 1 << 16:
            raise InputError(f"--buffer-mb: at least 64 KiB ({self.buffer_bytes} bytes given)")

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else 2e-4 / math.sqrt(self.features / 2**14)


@dataclass
class TrainJob:
    """One training run, checked before any model runs: the settings, the texts (read and counted
    once), the output directory and, when it holds one, the state to continue from."""

    sources: list[Source]
    tokenizer: object
    args: object  # the model's ModelArgs
    out: str | os.PathLike
    settings: Settings
    label: str = ""
    weights: list | None = None  # the checkpoint's weight files (tracing.atlas.build.shard_fingerprint)
    state: dict | None = field(default=None, init=False)

    def __post_init__(self):
        s = self.settings
        s.check()
        layer = site_layer(s.kind, s.site)
        if layer >= self.args.n_layers:
            raise InputError(f"--site {s.site}: the model has {self.args.n_layers} blocks")
        limit = self.args.max_seq_len
        s.seq_len = s.seq_len or min(DEFAULT_SEQ_LEN, limit)
        if s.seq_len > limit:
            raise InputError(f"--seq-len {s.seq_len}: this model takes at most {limit} positions")
        if self.tokenizer is None:
            raise InputError("training reads text: it needs the checkpoint's tokenizer.json (or --tokenizer)")
        self.out = check_directory(self.out)
        self._check_ours()
        self.corpus = Corpus(self.sources, self.tokenizer, s.seq_len, s.batch_size, s.max_tokens)
        self.survey, self.split = self._survey()
        self.skip_first = self.tokenizer.bos_id is not None
        self.fingerprint = {
            "checkpoint": self.label,
            "weights": self.weights,
            "inputs": [i["sha256"] for i in self.survey.inputs],
            "settings": asdict(s),
        }
        if (self.out / STATE).exists():
            self.state = self._read_state()

    # the corpus -------------------------------------------------------------------------------------
    def _survey(self) -> tuple[Survey, dict]:
        """Every input read and counted (tracing.atlas.corpus); the batches split into training and held out."""
        survey = Survey()
        bos = self.tokenizer.bos_id is not None
        rows = []  # per batch
        for batch in self.corpus.batches(survey):
            rows.append(len(batch) * (len(batch[0]) - bos))
            survey.batches += 1
            survey.sequences += len(batch)
            survey.tokens += len(batch) * len(batch[0])
        # every (1 / heldout)-th batch; with fewer batches than that, the last
        every = max(2, min(round(1 / self.settings.heldout), len(rows)))
        split = {"train_batches": 0, "train_rows": 0, "heldout_batches": 0, "heldout_rows": 0, "every": every}
        for index, n in enumerate(rows):
            part = "heldout" if self.held_out(index, every) else "train"
            split[f"{part}_batches"] += 1
            split[f"{part}_rows"] += n
        if not split["heldout_batches"] or not split["train_batches"] or not split["train_rows"]:
            raise InputError(
                f"the texts make {survey.batches} batches of {self.settings.batch_size} sequences: too few to train on "
                "and hold some out (give more text, or a smaller --batch-size)"
            )
        return survey, split

    @staticmethod
    def held_out(index: int, every: int) -> bool:
        return index % every == every - 1

    def _check_ours(self) -> None:
        try:
            names = [n for n in os.listdir(self.out) if not n.startswith(".")]
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as exc:
            raise InputError(f"{self.out}: cannot list the directory ({exc.strerror or exc})") from None
        ours = {STATE, BUFFER, REPORT, CFG_NAME, WEIGHTS_NAME}
        if set(names) - ours or (names and STATE not in names and set(names) != {BUFFER}):
            raise InputError(f"{self.out}: holds files and no {STATE}; refusing to write into it (give a new or empty one)")

    # the state ----------------------------------------------------------------------------------------
    def _read_state(self) -> dict:
        from safetensors import SafetensorError, safe_open

        path = self.out / STATE
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
            if meta.get("format") != STATE_FORMAT:
                raise ValueError(f"not a {STATE_FORMAT}")
            run, progress = json.loads(meta["run"]), json.loads(meta["progress"])
        except (SafetensorError, OSError, ValueError, KeyError, RecursionError) as exc:
            raise InputError(f"{path}: not a readable training state ({exc})") from None
        if run != json.loads(json.dumps(self.fingerprint)):
            differ = sorted(k for k in self.fingerprint if run.get(k) != json.loads(json.dumps(self.fingerprint[k])))
            raise InputError(f"{path}: the state of a run with other {', '.join(differ)}; give a new --out to start another")
        return {"tensors": tensors, "progress": progress}

    def _write_state(self, trainer: Trainer, progress: dict) -> None:
        from safetensors.torch import save as to_bytes

        meta = {"format": STATE_FORMAT, "run": json.dumps(self.fingerprint), "progress": json.dumps(progress)}
        write_file(self.out / STATE, to_bytes(trainer.state_tensors(), metadata=meta))

    # the run ------------------------------------------------------------------------------------------
    def run(self, model, progress: bool = False) -> dict:
        """Train (or continue) on ``model`` (a Loaded, or a tracing.client.Client), then write the
        dictionary and report.json into the output directory; returns the report."""
        s = self.settings
        source = _source(model, s, self.skip_first)
        d_out = None if s.kind == "sae" else self.args.dim
        trainer = Trainer(s, self.args.dim, self.args.dim)
        where = {"epoch": 0, "batch": 0, "seconds": 0.0, "finished": False}
        if self.state is not None:
            trainer.load_state(self.state["tensors"], self.state["progress"])
            where.update(self.state["progress"]["where"])
            print(f"note: continuing the run in {self.out} from step {trainer.step}", file=sys.stderr)
        if where["finished"] and (self.out / REPORT).is_file():
            return json.loads((self.out / REPORT).read_text(encoding="utf-8"))
        buffer = ActivationBuffer(self.out / BUFFER, self.args.dim, d_out, s.buffer_bytes)
        every = self.split["every"]
        steps_per_epoch = math.ceil(self.split["train_rows"] / s.rows_per_step)
        bar = ProgressBar(steps_per_epoch * s.epochs, enabled=progress)
        started, seconds0 = time.perf_counter(), where["seconds"]

        def elapsed() -> float:
            return seconds0 + time.perf_counter() - started

        def phase() -> None:
            for batch in buffer.batches(s.rows_per_step, trainer.generator):
                trainer.step_on(*batch)
                bar.update(min(trainer.step, bar.total), f"loss {trainer.last_loss:.4f}  dead {trainer.dead_share():.1%}")

        reuse = False  # the whole training split sits in the buffer: read it again, not gathered again
        while where["epoch"] < s.epochs:
            if not reuse:
                buffer.clear()
                for index, batch in enumerate(self.corpus.batches()):
                    if index < where["batch"] or self.held_out(index, every):
                        continue
                    buffer.add(*source.rows(batch))
                    bar.update(min(trainer.step, bar.total), f"gathering: {buffer.rows:,} positions in the buffer")
                    if buffer.full:
                        phase()
                        buffer.clear()
                        where["batch"] = index + 1
                        where["seconds"] = elapsed()
                        self._write_state(trainer, {"where": where, **trainer.progress()})
                reuse = where["batch"] == 0 and buffer.rows > 0
            phase()
            where.update(epoch=where["epoch"] + 1, batch=0, seconds=elapsed())
            self._write_state(trainer, {"where": where, **trainer.progress()})
        bar.close()
        buffer.clear()
        try:
            buffer.directory.rmdir()
        except OSError:
            pass
        seconds = elapsed()
        d = trainer.dictionary(metadata={"trained_on": self.label, "site": s.site})
        report = self.evaluate(source, d)
        report.update(
            site=s.site,
            kind=s.kind,
            features=s.features,
            k=s.k,
            steps=trainer.step,
            loss_start=sum(trainer.first) / len(trainer.first) if trainer.first else None,  # the first ten steps'
            loss_end=sum(trainer.recent) / len(trainer.recent) if trainer.recent else None,  # the last ten steps'
            train_rows=self.split["train_rows"] * s.epochs,
            train_seconds=round(seconds, 1),
            dead_share_training=trainer.dead_share(),
            buffer_peak_bytes=buffer.peak_bytes,
            checkpoint=self.label,
            texts=self.survey.inputs,
            settings=asdict(s),
        )
        d.metadata.update(
            {key: report[key] for key in ("variance_explained", "l0", "dead_share", "loss_increase") if key in report}
        )
        save(d, self.out)
        write_file(self.out / REPORT, (json.dumps(report, indent=1, allow_nan=False) + "\n").encode())
        where.update(finished=True, seconds=seconds)
        self._write_state(trainer, {"where": where, **trainer.progress()})
        return report

    @torch.no_grad()
    def evaluate(self, source, d: Dictionary) -> dict:
        """On the held-out batches: fraction of variance explained, L0, the share of features that
        never fired, and the next-token loss clean and with the reconstruction spliced in."""
        every = self.split["every"]
        n, sse, total, total_sq, l0 = 0, 0.0, None, 0.0, 0
        fired = torch.zeros(d.n_features, dtype=torch.bool)
        clean = spliced = 0.0
        predicted = 0
        for index, batch in enumerate(self.corpus.batches()):
            if not self.held_out(index, every):
                continue
            x, y, nll_clean, nll_spliced = source.losses(batch, d)
            target = x if y is None else y
            acts = d.encode(x)  # (N, n)
            sse += float((target - d.decode(acts)).double().pow(2).sum())
            total = target.double().sum(0) if total is None else total + target.double().sum(0)
            total_sq += float(target.double().pow(2).sum())
            active = acts > 0
            l0 += int(active.sum())
            fired |= active.any(0)
            n += len(x)
            clean += float(nll_clean.sum())
            spliced += float(nll_spliced.sum())
            predicted += nll_clean.numel()
        variance = total_sq - float(total.pow(2).sum()) / n
        fvu = sse / variance
        return {
            "heldout_rows": n,
            "variance_explained": 1 - fvu,
            "fvu": fvu,
            "l0": l0 / n,
            "dead_share": 1 - float(fired.float().mean()),
            "clean_loss": clean / predicted,
            "spliced_loss": spliced / predicted,
            "loss_increase": (spliced - clean) / predicted,
            "heldout_predictions": predicted,
        }


def _source(model, s: Settings, skip_first: bool):
    from ..client import Client

    if isinstance(model, Client):
        return ServerModel(model, s.kind, s.site, skip_first)
    return LocalModel(model, s.kind, s.site, site_layer(s.kind, s.site), skip_first)


class Trainer:
    """The dictionary in training, in the scaled space (rows scaled to mean squared norm = width),
    Adam, the dead-feature counts and the random generator."""

    def __init__(self, s: Settings, d_in: int, d_out: int):
        self.s = s
        self.d = Dictionary(s.kind, s.site, d_in, s.features, s.k, d_out)
        self.generator = torch.Generator().manual_seed(s.seed)
        # Adam's state per parameter, for torch's functional Adam (the Optimizer class would import
        # torch._dynamo on construction: seconds of a short run)
        self.adam = {
            n: {"step": torch.zeros(()), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            for n, p in self.d.named_parameters()
        }
        self.step = 0
        self.scale_in = self.scale_out = self.variance = None  # from the first rows seen
        self.since_fired = torch.zeros(s.features, dtype=torch.long)  # rows since each feature last fired
        self.last_loss = float("nan")
        self.first: list[float] = []  # the first ten steps' losses, and the last ten, for the report
        self.recent: deque[float] = deque(maxlen=10)
        self.aux_k = s.aux_k or min(2 * s.k, s.features)

    def _start(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Scales, variance and b_dec from the first rows (a shuffled batch of the buffer)."""
        self.scale_in = float(math.sqrt(x.shape[1]) / x.norm(dim=1).pow(2).mean().sqrt().clamp_min(1e-12))
        self.scale_out = float(math.sqrt(y.shape[1]) / y.norm(dim=1).pow(2).mean().sqrt().clamp_min(1e-12))
        y = y * self.scale_out
        mean = y.mean(0)
        self.variance = float((y - mean).pow(2).sum(1).mean().clamp_min(1e-12))
        self.d.init_weights(self.generator, b_dec=mean)

    def step_on(self, x: torch.Tensor, y: torch.Tensor | None = None) -> None:
        """One optimiser step on rows (N, d_in) [and targets (N, d_out)], unscaled."""
        y = x if y is None else y
        if self.scale_in is None:
            self._start(x, y)
        x, y = x * self.scale_in, y * self.scale_out
        d = self.d
        pre = d.pre_acts(x)  # (N, n)
        values, indices = pre.topk(d.k, dim=-1, sorted=False)  # (N, k): the decoder reads k rows a position
        values = values.relu()
        error = y - (F.embedding_bag(indices, d.W_dec, per_sample_weights=values, mode="sum") + d.b_dec)  # (N, d_out)
        loss = error.pow(2).sum(1).mean() / self.variance
        dead = self.since_fired >= self.s.dead_tokens
        if dead.any():
            k_aux = min(self.aux_k, int(dead.sum()))
            aux = _topk(pre.masked_fill(~dead, float("-inf")), k_aux)  # (N, n): dead features only
            aux_error = error.detach() - aux @ d.W_dec
            loss = loss + AUX_COEFFICIENT * aux_error.pow(2).sum(1).mean() / self.variance
        params = dict(d.named_parameters())
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))
        with torch.no_grad():  # no gradient along a decoder row: its norm is held at 1
            w, g = d.W_dec, grads["W_dec"]
            g -= (g * w).sum(1, keepdim=True) * w
            self._adam(params, grads)
        d.normalize_decoder()
        fired = torch.zeros_like(dead)
        fired[indices[values > 0]] = True
        self.since_fired += len(x)
        self.since_fired[fired] = 0
        self.step += 1
        self.last_loss = float(loss.detach())
        if len(self.first) < 10:
            self.first.append(self.last_loss)
        self.recent.append(self.last_loss)

    def _adam(self, params: dict, grads: dict) -> None:
        names = list(params)
        adam(
            [params[n] for n in names],
            [grads[n] for n in names],
            [self.adam[n]["exp_avg"] for n in names],
            [self.adam[n]["exp_avg_sq"] for n in names],
            [],
            [self.adam[n]["step"] for n in names],
            foreach=False,
            capturable=False,
            differentiable=False,
            fused=None,
            grad_scale=None,
            found_inf=None,
            has_complex=False,
            amsgrad=False,
            beta1=0.9,
            beta2=0.999,
            lr=self.s.learning_rate,
            weight_decay=0.0,
            eps=6.25e-10,
            maximize=False,
        )

    def dead_share(self) -> float:
        return float((self.since_fired >= self.s.dead_tokens).float().mean())

    def dictionary(self, metadata: dict) -> Dictionary:
        """The trained dictionary for unscaled rows: the scales folded into b_enc, b_dec and W_enc
        (exact, see the module's docstring); decoder rows stay unit-norm."""
        d = Dictionary(self.s.kind, self.s.site, self.d.d_in, self.d.n_features, self.d.k, self.d.d_out, metadata=metadata)
        with torch.no_grad():
            ratio = self.scale_in / self.scale_out
            d.W_enc.copy_(self.d.W_enc * ratio)
            d.b_enc.copy_(self.d.b_enc / self.scale_out)
            d.W_dec.copy_(self.d.W_dec)
            d.b_dec.copy_(self.d.b_dec / self.scale_out)
        return d

    def progress(self) -> dict:
        return {
            "step": self.step,
            "scale_in": self.scale_in,
            "scale_out": self.scale_out,
            "variance": self.variance,
            "first": self.first,
            "recent": list(self.recent),
        }

    def state_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {f"dictionary.{n}": p.detach().clone() for n, p in self.d.named_parameters()}
        for n, state in self.adam.items():
            for key, value in state.items():
                tensors[f"adam.{n}.{key}"] = value.clone().reshape(value.shape or (1,))
        tensors["since_fired"] = self.since_fired.clone()
        tensors["generator"] = self.generator.get_state()
        return tensors

    def load_state(self, tensors: dict[str, torch.Tensor], progress: dict) -> None:
        try:
            with torch.no_grad():
                for n, p in self.d.named_parameters():
                    value = tensors[f"dictionary.{n}"]
                    if value.shape != p.shape or not torch.isfinite(value).all():
                        raise ValueError(f"dictionary.{n} is not a finite {list(p.shape)} tensor")
                    p.copy_(value)
                    for key, state in self.adam[n].items():
                        state.copy_(tensors[f"adam.{n}.{key}"].reshape(state.shape))
            since = tensors["since_fired"]
            if since.shape != self.since_fired.shape:
                raise ValueError("since_fired has another width")
            self.since_fired = since.clone()
            self.generator.set_state(tensors["generator"])
            self.step = int(progress["step"])
            self.scale_in, self.scale_out, self.variance = progress["scale_in"], progress["scale_out"], progress["variance"]
            self.first, self.recent = list(progress["first"]), deque(progress["recent"], maxlen=10)
        except (KeyError, ValueError, RuntimeError, TypeError) as exc:
            raise InputError(f"the training state cannot be used ({exc})") from None


def _topk(pre: torch.Tensor, k: int) -> torch.Tensor:
    """TopK of ReLU, with the gradient flowing to the chosen pre-activations."""
    values, indices = pre.topk(k, dim=-1, sorted=False)
    return torch.zeros_like(pre).scatter(-1, indices, values.relu())


def train(
    model,
    texts,
    out,
    *,
    site: str,
    kind: str = "sae",
    features: int = 1024,
    k: int = 16,
    tokenizer=None,
    progress=False,
    **settings,
) -> dict:
    """Train a dictionary for ``site`` on ``texts`` (paths of UTF-8 text files) with ``model`` (a
    Loaded, ``tracing.load(...)``, or a tracing.client.Client, which needs ``tokenizer``: a
    tracing.tokenizer.Tokenizer), written into ``out``; returns the report. ``settings``:
    :class:`Settings`' other fields (seed, lr, epochs, max_tokens, buffer_bytes, ...)."""
    from model.config import ModelArgs

    from ..client import Client

    s = Settings(site=site, kind=kind, features=features, k=k, **settings)
    if isinstance(model, Client):
        args, label = ModelArgs.from_json(model.info()["config"]), model.url
    else:
        args, label, tokenizer = model.model.args, model.label, tokenizer or model.tokenizer
    job = TrainJob([Source(Path(t)) for t in texts], tokenizer, args, out, s, label=label)
    return job.run(model, progress=progress)
