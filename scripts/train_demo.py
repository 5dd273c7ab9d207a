"""Train the bundled demo: a tiny DeepSeek-V3.2 with every mechanism of the real one, on 2 CPU cores.

    apt-get update   # once: the corpus comes from two Debian packages (apt-get download, no install)
    python scripts/train_demo.py --out assets/demo --force

One command, fixed seeds: builds the corpus (scripts/demo_corpus.py: Jane Austen's novels and the
Python 3.11 documentation's prose, from two Debian packages), trains a byte-level BPE tokenizer on
it, trains the model in float32 with the project's own ``model/`` modules, exports it in the
Hugging Face FP8 layout of deepseek-ai/DeepSeek-V3.2-Exp, measures it (scripts/demo_measure.py) and
writes the model card. Training runs for a time budget (``--minutes``, default 80; the learning
rate schedule and the dense-to-sparse switch follow the elapsed share of it), so the whole recipe
takes about 85 minutes on 2 cores however fast they are; ``--steps N`` trains a fixed number of
steps instead (the schedule then follows the step count), for a run that does not depend on speed.

Training, as DeepSeek-V3 and V3.2 describe it, scaled down:

* LM loss: next-token cross-entropy on windows of ``SEQ_LEN`` tokens, each starting with BOS.
* Auxiliary-loss-free balancing: after each step every MoE router's correction bias moves by
  ``BIAS_GAMMA * sign(mean load - expert load)``; the bias is not trained by gradient.
* The lightning indexer is trained only by a KL objective: its scores, softmaxed over the causal
  keys, fit the main attention's distribution (the dense attention probabilities summed over heads
  and L1-normalised per query, detached); its inputs are detached, so the KL trains the indexer
  alone and the LM loss never reaches it. The indexer is computed in float32 from its own modules
  (no FP8 rounding, which has no useful gradient); the model's FP8 indexer runs at inference.
* Dense warm-up, then sparse training: for the first ``DENSE_SHARE`` of the run every query
  attends to all earlier keys (the indexer's top-k is widened to the whole window) while the
  indexer learns; then the model trains with DeepSeek Sparse Attention, each query attending only
  to the indexer's ``index_topk`` keys, the indexer still fitting the dense distribution.

The FP8 rounding happens at export: linear weights to e4m3 with one power-of-two (ue8m0) scale per
128x128 block (``model.fp8.weight_quant``); embedding, head, norms, router and the indexer's
head-weight projection in bfloat16; scales and the router bias in float32.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import demo_corpus  # noqa: E402

from model import fp8  # noqa: E402
from model.checkpoint import expected_specs, hf_state_dict, save_checkpoint  # noqa: E402
from model.config import ModelArgs  # noqa: E402
from model.indexer import Indexer  # noqa: E402
from model.moe import MoE  # noqa: E402
from model.rope import apply_rotary_emb  # noqa: E402
from model.transformer import Transformer  # noqa: E402

SEED = 1234
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

# The demo's architecture is its committed config: every V3.2 mechanism at widths that are multiples of the 128 FP8
# block; max_position_embeddings is the training window and there is no rope_scaling (plain RoPE, no YaRN: the model
# never saw longer text). Another architecture is another assets/demo/config.json.
DEMO_ARGS = ModelArgs.from_file(REPO / "assets" / "demo" / "config.json")
VOCAB = DEMO_ARGS.vocab_size
SEQ_LEN = DEMO_ARGS.max_seq_len

MINUTES = 80.0  # default training budget: about 85 minutes in all on an idle 2-core machine
BATCH = 16
KL_ROWS = 4  # sequences per batch on which the indexer's KL is formed (its top-k is formed on all)
LR = 3e-3
LR_MIN_SHARE = 0.1
WARMUP = 100
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
DENSE_SHARE = 0.5  # the first half of the steps with dense attention
BIAS_GAMMA = 1e-3  # DeepSeek-V3's bias update speed
KL_WEIGHT = 1.0


# --- tokenizer ------------------------------------------------------------------------------------------
def train_tokenizer(docs: list[str], directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    if tok.token_to_id(BOS) != DEMO_ARGS.bos_token_id or (tok.token_to_id(EOS),) != DEMO_ARGS.eos_token_id:
        raise RuntimeError("special tokens did not get ids 0 and 1")
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))

    def special(content: str) -> dict:
        return {
            "__type": "AddedToken",
            "content": content,
            "lstrip": False,
            "normalized": True,
            "rstrip": False,
            "single_word": False,
        }

    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": special(BOS),
        "eos_token": special(EOS),
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": SEQ_LEN,
        "pad_token": None,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def token_stream(docs: list[str], directory: Path) -> torch.Tensor:
    """All training documents as one stream of ids, each document followed by EOS."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(DEMO_ARGS.eos_token_id[0])
    return torch.tensor(ids, dtype=torch.int32)


# --- the model in training precision ----------------------------------------------------------------------
def train_args() -> ModelArgs:
    """The demo's config with plain (float) linear layers: the model trains in float32."""
    return DEMO_ARGS.replace(dtype="bf16")


def init_weights(model: Transformer, generator: torch.Generator) -> None:
    n_layers = model.args.n_layers
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        with torch.no_grad():
            if "norm" in name:
                p.fill_(0.0 if leaf == "bias" else 1.0)
            elif name.endswith("gate.bias"):
                p.zero_()
            elif p.dim() == 2:
                std = 0.02
                if name.endswith(("wo.weight", "w2.weight")):
                    std /= math.sqrt(2 * n_layers)  # output projections into the stream
                p.normal_(0.0, std, generator=generator)
            else:
                raise RuntimeError(f"no initialisation for {name}")


def float_index_scores(ix: Indexer, x: torch.Tensor, qr: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """I[t, s] = sum_h w[t, h] ReLU(q[t, h] . k[s]) as Indexer.forward forms it, in float32 and without
    the FP8 rounding of q and k (the FP8 scales cancel out: the product is the same up to rounding)."""
    bsz, seqlen, _ = x.shape
    q = ix.wq_b(qr).view(bsz, seqlen, ix.n_heads, ix.head_dim)
    q_pe, q_nope = torch.split(q, [ix.rope_head_dim, ix.head_dim - ix.rope_head_dim], dim=-1)
    q = torch.cat([apply_rotary_emb(q_pe, freqs_cis, interleaved=False), q_nope], dim=-1)
    k = ix.k_norm(ix.wk(x))
    k_pe, k_nope = torch.split(k, [ix.rope_head_dim, ix.head_dim - ix.rope_head_dim], dim=-1)
    k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis, interleaved=False).squeeze(2)
    k = torch.cat([k_pe, k_nope], dim=-1)
    q, k = fp8.hadamard(q.float()), fp8.hadamard(k.float())
    weights = ix.weights_proj(x.float()) * ix.n_heads**-0.5 * ix.softmax_scale  # (B, T, H)
    logits = torch.einsum("bthd,bsd->btsh", q, k).relu()  # (B, T, S, H)
    return torch.einsum("btsh,bth->bts", logits, weights)


class DemoTrainer:
    """The training model with its hooks: the attention logits and the router's choices are kept per
    step, and each indexer is replaced by its float32 form, whose top-k width is the phase's."""

    def __init__(self, seed: int = SEED, model: Transformer | None = None):
        torch.manual_seed(seed)
        if model is None:
            model = Transformer(train_args(), dtype=torch.float32, weight_dtype=torch.float32)
            init_weights(model, torch.Generator().manual_seed(seed))
        self.model = model
        self.topk = SEQ_LEN  # dense warm-up: every earlier key
        self.dense_steps = 0
        self.attn_scores: dict[int, torch.Tensor] = {}
        self.index_scores: dict[int, torch.Tensor] = {}
        self.expert_ids: dict[int, torch.Tensor] = {}
        self.gates = []
        for i, layer in enumerate(self.model.layers):
            layer.attn.scores.register_forward_hook(self._keep(self.attn_scores, i))
            layer.attn.indexer.forward = types.MethodType(self._indexer_forward(i), layer.attn.indexer)
            if isinstance(layer.ffn, MoE):
                layer.ffn.gate.bias.requires_grad_(False)  # moved by the balancing rule, not by gradient
                layer.ffn.gate.topk_indices.register_forward_hook(self._keep(self.expert_ids, i))
                self.gates.append((i, layer.ffn.gate))

    @staticmethod
    def _keep(store: dict, i: int):
        def hook(module, inputs, output):
            store[i] = output

        return hook

    def _indexer_forward(self, i: int):
        trainer = self

        def forward(ix, x, qr, start_pos, freqs_cis, mask, cache=None):
            bsz, seqlen, _ = x.shape
            rows = KL_ROWS if torch.is_grad_enabled() else 0
            parts = []
            if rows:  # with gradient, for the KL: from detached inputs
                scores = float_index_scores(ix, x[:rows].detach(), qr[:rows].detach(), freqs_cis)  # (b, T, S)
                if mask is not None:
                    scores = scores + mask
                trainer.index_scores[i] = scores
                parts.append(scores)
            with torch.no_grad():
                if trainer.topk >= seqlen:  # dense: every key (the causal mask removes the future ones)
                    return ix.topk_indices(torch.arange(seqlen).expand(bsz, seqlen, seqlen))
                if rows < bsz:
                    rest = float_index_scores(ix, x[rows:], qr[rows:], freqs_cis)
                    parts.append(rest + mask if mask is not None else rest)
                scores = torch.cat(parts)
                top_scores, top = scores.topk(min(trainer.topk, seqlen), dim=-1)
                top = top.masked_fill(top_scores == float("-inf"), -1)
            return ix.topk_indices(top)

        return forward

    def parameters(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def losses(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """LM loss, indexer KL (mean over layers and queries) and statistics for one batch."""
        x, y = tokens[:, :-1], tokens[:, 1:]
        logits = self.model(x, all_logits=True)
        lm = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        seqlen = x.shape[1]
        causal = torch.full((seqlen, seqlen), float("-inf")).triu_(1)
        kl_total = 0.0
        recall = []
        k = self.model.args.index_topk
        for i, scores in self.attn_scores.items():
            with torch.no_grad():
                dense = (scores[:KL_ROWS].float() + causal[:, None, :]).softmax(dim=-1).mean(dim=2)  # (b, T, S): heads, L1-normed
                # the share of the dense mass the indexer's top-k (of the demo's k) covers, where it prunes
                top = self.index_scores[i][:, k:].topk(k, dim=-1)[1]
                recall.append(dense[:, k:].gather(-1, top).sum(-1).mean())
            log_q = self.index_scores[i].log_softmax(dim=-1)  # -inf on future keys
            kl = torch.where(dense > 0, dense * (dense.clamp(min=1e-30).log() - log_q), torch.zeros_like(dense))
            kl_total = kl_total + kl.sum(-1).mean()
        kl_mean = kl_total / len(self.attn_scores)
        stats = {"recall": float(torch.stack(recall).mean())}
        return lm, kl_mean, stats

    @torch.no_grad()
    def balance(self, gamma: float = BIAS_GAMMA) -> float:
        """Move each router's bias towards equal load; return the least loaded expert's share of the
        uniform load (the minimum over layers)."""
        worst = float("inf")
        for i, gate in self.gates:
            load = torch.bincount(self.expert_ids[i].flatten(), minlength=gate.bias.numel()).float()
            gate.bias += gamma * torch.sign(load.mean() - load)
            worst = min(worst, float(load.min() / load.mean()))
        return worst


def lr_at(step: int, progress: float) -> float:
    """Linear warm-up over WARMUP steps, then cosine decay to LR_MIN_SHARE over the run's progress."""
    warm = min((step + 1) / WARMUP, 1.0)
    return warm * LR * (LR_MIN_SHARE + (1 - LR_MIN_SHARE) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def make_optimizer(model: Transformer) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() == 2 and "embed" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8)


def batches(stream: torch.Tensor, seed: int):
    """BATCH windows per step at random offsets: BOS followed by SEQ_LEN tokens (inputs and targets)."""
    gen = torch.Generator().manual_seed(seed + 1)
    span = SEQ_LEN  # BOS + SEQ_LEN - 1 inputs predict SEQ_LEN targets
    while True:
        starts = torch.randint(0, len(stream) - span, (BATCH,), generator=gen)
        rows = torch.stack([stream[s : s + span] for s in starts.tolist()]).long()
        bos = torch.full((BATCH, 1), DEMO_ARGS.bos_token_id, dtype=torch.long)
        yield torch.cat([bos, rows], dim=1)  # (BATCH, SEQ_LEN + 1)


def train(
    stream: torch.Tensor, steps: int, log, seed: int = SEED, minutes: float | None = None, checkpoint=None
) -> tuple[DemoTrainer, int]:
    """Train for ``steps`` steps, or, with ``minutes``, until that much time has passed (the learning
    rate schedule and the dense-to-sparse switch then follow the elapsed share of the time).
    Returns the trainer and the number of steps taken."""
    trainer = DemoTrainer(seed)
    model = trainer.model
    model.train()
    opt = make_optimizer(model)
    params = trainer.parameters()
    budget = minutes * 60 if minutes else None
    t0 = time.time()
    last_save = t0
    step = 0
    for tokens in batches(stream, seed):
        elapsed = time.time() - t0
        progress = elapsed / budget if budget else step / steps
        if progress >= 1:
            break
        trainer.topk = SEQ_LEN if progress < DENSE_SHARE else DEMO_ARGS.index_topk
        if trainer.topk == SEQ_LEN:
            trainer.dense_steps = step + 1
        lr = lr_at(step, progress)
        for group in opt.param_groups:
            group["lr"] = lr
        lm, kl, stats = trainer.losses(tokens)
        opt.zero_grad(set_to_none=True)
        (lm + KL_WEIGHT * kl).backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        opt.step()
        balance = trainer.balance()
        if step % 25 == 0:
            elapsed = time.time() - t0
            log(
                f"step {step:5d}  lm {lm.item():.4f}  kl {kl.item():.4f}  recall@{DEMO_ARGS.index_topk} "
                f"{stats['recall']:.3f}  min-load {balance:.2f}  |g| {gnorm:.2f}  lr {lr:.2e}  "
                f"{'dense' if trainer.topk == SEQ_LEN else 'sparse'}  {elapsed / 60:.1f} min  "
                f"{(step + 1) * BATCH * SEQ_LEN / max(elapsed, 1e-9):.0f} tok/s"
            )
        step += 1
        if checkpoint is not None and time.time() - last_save > 600:
            checkpoint(trainer, step)
            last_save = time.time()
    log(f"stopped after {step} steps, {(time.time() - t0) / 60:.1f} min")
    return trainer, step


# --- export -----------------------------------------------------------------------------------------------
def export_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """The trained float weights in the checkpoint's names and dtypes: FP8 e4m3 + ue8m0 block scales
    where the real checkpoint has FP8, bfloat16 or float32 elsewhere."""
    trained = hf_state_dict(model)
    specs = expected_specs(DEMO_ARGS)
    out = {}
    for name, spec in specs.items():
        if name.endswith("weight_scale_inv"):
            continue
        value = trained[name].float()
        if spec.dtype == fp8.FP8:
            weight, scale = fp8.weight_quant(value, DEMO_ARGS.scale_fmt)
            out[name] = weight
            out[name.replace(".weight", ".weight_scale_inv")] = scale
        else:
            out[name] = value.to(spec.dtype)
    missing = set(specs) - set(out)
    if missing:
        raise RuntimeError(f"export: no value for {sorted(missing)[:3]}")
    return out


def save_float(model: Transformer, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in hf_state_dict(model).items()}, str(path))


def load_float(path: Path, args: ModelArgs | None = None) -> Transformer:
    """The unquantised trained model (float32 weights and activations) from save_float's file;
    ``args``: the exported config (default: this run's)."""
    args = args.replace(dtype="bf16") if args else train_args()
    from safetensors import safe_open

    from model.checkpoint import TensorSpec, WeightSource, build_model, materialize

    class _File(WeightSource):
        def __init__(self):
            self.args = args
            self.handle = safe_open(str(path), framework="pt")

        def specs(self):
            return {n: TensorSpec(tuple(self.handle.get_slice(n).get_shape()), torch.float32) for n in self.handle.keys()}

        def load(self, name, device="cpu"):
            return self.handle.get_tensor(name).to(device)

    model = build_model(args, torch.float32, weight_dtype=torch.float32)
    materialize(model, _File())
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    global DEMO_ARGS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "assets" / "demo"), help="checkpoint directory to write")
    parser.add_argument("--work", default="/tmp/demo-work", help="scratch folder: corpus packages, tokenizer, float weights")
    parser.add_argument(
        "--minutes", type=float, default=MINUTES, help=f"training time (default {MINUTES:g}); the schedule follows elapsed time"
    )
    parser.add_argument("--steps", type=int, help="train this many steps instead (the schedule follows the step count)")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    parser.add_argument("--measure-chars", type=int, default=None, help="characters of each held-out text to score (card)")
    parser.add_argument("--measure-threads", type=int, help="threads for the measurements (default: --threads)")
    parser.add_argument("--index-topk", type=int, default=DEMO_ARGS.index_topk, help="the indexer's top-k (DSA)")
    parser.add_argument(
        "--from-trained",
        action="store_true",
        help="skip training: export and measure the trained weights a previous run left in --work (float.safetensors)",
    )
    args = parser.parse_args(argv)
    DEMO_ARGS = DEMO_ARGS.replace(index_topk=args.index_topk)
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.force:
        parser.error(f"{out} exists: pass --force to replace it")
    log_file = open(work / "train.log", "a")

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    t_start = time.time()
    log(f"train_demo: {' '.join(sys.argv[1:] if argv is None else argv)}")
    corpus = demo_corpus.build(demo_corpus.fetch(work / "corpus"), seed=args.seed)
    log(f"corpus: {len(corpus.train)} documents, {sum(map(len, corpus.train)) / 1e6:.2f} M characters, sha256 {corpus.digest()}")
    tok_dir = work / "tokenizer"
    train_tokenizer(corpus.train, tok_dir)
    stream = token_stream(corpus.train, tok_dir)
    log(f"tokenizer: {VOCAB} tokens; stream of {len(stream) / 1e6:.2f} M tokens ({time.time() - t_start:.0f} s)")

    def snapshot(trainer: DemoTrainer, step: int) -> None:
        save_float(trainer.model, work / "float.safetensors")
        log(f"saved float weights at step {step}")

    minutes = None if args.steps else args.minutes
    trained_file = work / "float.safetensors"
    if args.from_trained:
        facts = json.loads((work / "trained.json").read_text())
        trainer = DemoTrainer(args.seed, model=load_float(trained_file))
        log(f"continuing from {trained_file}: {facts['steps']} steps trained in {facts['train_minutes']} min")
    else:
        t_train = time.time()
        trainer, steps = train(stream, args.steps or 0, log, args.seed, minutes, snapshot)
        facts = {
            "steps": steps,
            "dense_steps": trainer.dense_steps,
            "train_minutes": round((time.time() - t_train) / 60, 1),
            "minutes_budget": minutes,
            "command": "python scripts/train_demo.py " + " ".join(sys.argv[1:] if argv is None else argv),
        }
        save_float(trainer.model, trained_file)
        (work / "trained.json").write_text(json.dumps(facts) + "\n")
    t_post = time.time()
    tensors = export_tensors(trainer.model)
    staging = work / "export"
    shutil.rmtree(staging, ignore_errors=True)
    files = {name: tok_dir / name for name in ("tokenizer.json", "tokenizer_config.json")}
    save_checkpoint(tensors, DEMO_ARGS, staging, n_shards=2, extra_files=files)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(staging, out)
    recipe = {
        "command": "python scripts/train_demo.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "seed": args.seed,
        "steps": facts["steps"],
        "minutes_budget": facts.get("minutes_budget", minutes),
        "train_command": facts.get("command"),
        "batch": BATCH,
        "kl_rows": KL_ROWS,
        "seq_len": SEQ_LEN,
        "tokens_seen": facts["steps"] * BATCH * SEQ_LEN,
        "lr": LR,
        "warmup_steps": WARMUP,
        "dense_steps": facts["dense_steps"],
        "bias_gamma": BIAS_GAMMA,
        "corpus_sha256": corpus.digest(),
        "corpus_characters": sum(map(len, corpus.train)),
        "corpus_tokens": len(stream),
        "train_minutes": facts["train_minutes"],
        "torch": torch.__version__,
        "threads": args.threads,
    }
    recipe["export_minutes_after_training"] = round((time.time() - t_post) / 60, 1)
    (work / "recipe.json").write_text(json.dumps(recipe, indent=2) + "\n")
    log(f"exported to {out}; measuring")
    import demo_measure

    if args.measure_chars:
        demo_measure.MEASURE_CHARS = args.measure_chars
    if args.measure_threads:
        torch.set_num_threads(args.measure_threads)
    demo_measure.run(out, work, corpus, recipe, log)
    log(f"done in {(time.time() - t_start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
