"""Train the demo's multi-token-prediction (MTP) module, the main model frozen, and write it in.

    python scripts/train_demo_mtp.py --out assets/demo --minutes 6        # train, export, measure
    python scripts/train_demo_mtp.py --out assets/demo --measure-only     # the acceptance figures again

The demo (scripts/train_demo.py) was trained without an MTP module. This adds one the way DeepSeek-V3
trains it (technical report, section 2.2), scaled down, with every weight of the main model as it
is: for each window of the demo's corpus (scripts/demo_corpus.py, tokenized with the demo's own
tokenizer) the exported demo itself (FP8 weights, bfloat16 activations: what the MTP module reads
at inference) gives the normalised hidden states h_t, and the module, in float32, learns

    logits_t = head(norm(Block(eh_proj([enorm(e(token_{t+1})) ; hnorm(h_t)]))))  ->  token_{t+2}

by cross-entropy (model/mtp.py has the computation). The block starts as a copy of the demo's last
block (its router, experts and indexer, dequantised), ``eh_proj`` at random; the block's indexer
stays as copied (in the demo's recipe only a KL objective trains an indexer, never the LM loss) and
the router's correction bias moves by the demo's auxiliary-loss-free rule. The embedding and head
are the main model's and stay frozen.

The export adds one shard, ``model-mtp.safetensors`` (block ``num_hidden_layers`` in the Hugging
Face names; FP8 e4m3 linears with ue8m0 block scales, ``eh_proj`` bfloat16 as in the real
checkpoint, norms float32), its entries in the index and ``num_nextn_predict_layers: 1`` in
config.json; the other shards are not touched. The real checkpoint also stores copies of the
embedding and head under block 61; the demo leaves them out (the loader uses the main model's, as
SGLang does), which keeps the shard small.

Measured (written to card.json's ``mtp`` and printed): on the held-out text (the last chapters of
*Persuasion* and the Python FAQ), teacher-forced, how often the draft's best token is the token
after next, against chance (1 / vocabulary) and against the most frequent token; and in greedy
generations from fixed prompts through ``tracing.run`` (the decode path), the acceptance rate a
speculative decoder would see (tracing.analyses.mtp).
"""

from __future__ import annotations

import argparse
import json
import math
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

from model import fp8, kernels  # noqa: E402
from model.checkpoint import INDEX, expected_specs, load_model  # noqa: E402
from model.config import ModelArgs  # noqa: E402
from model.linear import Linear  # noqa: E402
from model.mtp import MTP  # noqa: E402
from model.names import to_hf  # noqa: E402

SEED = 4321
SHARD = "model-mtp.safetensors"
BATCH = 8
LR = 2e-3
WARMUP = 20
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
BIAS_GAMMA = 1e-3  # the demo's bias update speed
PROMPTS = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune",
    "Anne Elliot had been",
    "The Python interpreter is",
    "A list comprehension consists of",
    "Captain Wentworth",
    "Emma Woodhouse, handsome, clever, and rich,",
)
GENERATE = 48


def windows(stream: torch.Tensor, n: int, seq_len: int, bos: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - seq_len, (n,), generator=gen)
    rows = torch.stack([stream[s : s + seq_len - 1] for s in starts.tolist()]).long()
    return torch.cat([torch.full((n, 1), bos, dtype=torch.long), rows], dim=1)  # (n, seq_len)


def hidden_states(main, tokens: torch.Tensor) -> torch.Tensor:
    """The main model's normalised states (what its head reads and the MTP module is handed)."""
    got = {}
    handle = main.norm.register_forward_hook(lambda m, i, out: got.setdefault("h", out))
    try:
        with torch.inference_mode():
            main(tokens)
    finally:
        handle.remove()
    return got["h"].clone()


def trainable_mtp(main, args: ModelArgs) -> MTP:
    """The MTP module in float32 with plain linears, its block a dequantised copy of the main model's last."""
    train_args = args.replace(dtype="bf16")
    mtp = MTP(args.n_layers, train_args, dtype=torch.float32, weight_dtype=torch.float32)
    source = main.layers[args.n_layers - 1]
    with torch.no_grad():
        for name, module in mtp.block.named_modules():
            twin = source.get_submodule(name)
            if isinstance(module, Linear):
                module.weight.copy_(twin.dequantized(torch.float32) if twin.scale is not None else twin.weight.float())
        for name, p in mtp.block.named_parameters():
            if not name.endswith("weight") or not isinstance(mtp.block.get_submodule(name.rsplit(".", 1)[0]), Linear):
                p.copy_(source.get_parameter(name).float())
        gen = torch.Generator().manual_seed(SEED)
        mtp.eh_proj.weight.normal_(0.0, 0.02, generator=gen)
    indexer = mtp.block.attn.indexer
    for p in indexer.parameters():
        p.requires_grad_(False)
    forward = type(indexer).forward

    def detached(ix, x, qr, *rest, **kw):  # the LM loss never reaches the indexer (plain linears: no fp8.Rounded here)
        rest = tuple(r.detach() if isinstance(r, torch.Tensor) else r for r in rest)
        return forward(ix, x.detach(), qr.detach(), *rest, **kw)

    indexer.forward = types.MethodType(detached, indexer)
    mtp.block.ffn.gate.bias.requires_grad_(False)
    return mtp


def mtp_logits(mtp: MTP, main, tokens: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Logits (B, T-1, V) for tokens 2..T from states 0..T-2 and tokens 1..T-1 (no cache: a prefill)."""
    return mtp(h[:, :-1].float(), tokens[:, 1:], main.embed, main.head, 0)


def balance(mtp: MTP, chosen: torch.Tensor) -> None:
    gate = mtp.block.ffn.gate
    load = torch.bincount(chosen.flatten(), minlength=gate.bias.numel()).float()
    with torch.no_grad():
        gate.bias += BIAS_GAMMA * torch.sign(load.mean() - load)


def train(main, args, stream, minutes: float, log) -> dict:
    mtp = trainable_mtp(main, args)
    chosen = {}
    mtp.block.ffn.gate.topk_indices.register_forward_hook(lambda m, i, out: chosen.__setitem__("ids", out.detach()))
    params = [p for p in mtp.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() == 2]
    other = [p for p in params if p.dim() != 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": other, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95)
    )
    gen = torch.Generator().manual_seed(SEED)
    t0, step, budget = time.time(), 0, minutes * 60
    mtp.train()
    while (elapsed := time.time() - t0) < budget:
        progress = elapsed / budget
        lr = LR * min((step + 1) / WARMUP, 1.0) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = lr
        tokens = windows(stream, BATCH, args.max_seq_len, args.bos_token_id, gen)
        h = hidden_states(main, tokens)
        with kernels.plain():  # the plain products carry gradients (the frozen head's too)
            logits = mtp_logits(mtp, main, tokens, h)[:, :-1]  # the last entry has no token after next
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 2:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        opt.step()
        balance(mtp, chosen["ids"])
        if step % 10 == 0:
            log(f"step {step:4d}  mtp loss {loss.item():.4f}  lr {lr:.2e}  {elapsed / 60:.1f} min")
        step += 1
    log(f"stopped after {step} steps, {(time.time() - t0) / 60:.1f} min")
    return {
        "module": mtp.eval(),
        "steps": step,
        "minutes": round((time.time() - t0) / 60, 1),
        "final_loss": round(loss.item(), 4),
    }


def export(mtp: MTP, args: ModelArgs) -> dict[str, torch.Tensor]:
    """The module's tensors under the checkpoint's names, in the dtypes the real checkpoint stores."""
    specs = expected_specs(args.replace(n_mtp_layers=1), mtp=True)
    out = {}
    for name, p in mtp.named_parameters():
        hf = to_hf(f"mtp.0.{name}", args.n_layers)
        spec = specs[hf]
        value = p.detach().float()
        if spec.dtype == fp8.FP8:
            weight, scale = fp8.weight_quant(value, args.scale_fmt)
            out[hf], out[hf.replace(".weight", ".weight_scale_inv")] = weight, scale
        else:
            out[hf] = value.to(spec.dtype)
    shared = {to_hf(f"mtp.0.{n}", args.n_layers) for n in ("embed.weight", "head.weight")}
    missing = set(specs) - set(out) - shared
    wanted = {n for n in specs if n.startswith(f"model.layers.{args.n_layers}.")} - shared
    if missing & wanted or set(out) - wanted:
        raise RuntimeError(
            f"export: the MTP tensors differ from the expected ones ({sorted((missing & wanted) or set(out) - wanted)[:3]})"
        )
    return out


def write(out_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({n: t.contiguous() for n, t in sorted(tensors.items())}, str(out_dir / SHARD), metadata={"format": "pt"})
    index = json.loads((out_dir / INDEX).read_text())
    weight_map = {n: f for n, f in index["weight_map"].items() if f != SHARD}
    weight_map.update(dict.fromkeys(tensors, SHARD))
    index["weight_map"] = dict(sorted(weight_map.items()))
    total = 0
    from safetensors import safe_open

    for shard in sorted(set(weight_map.values())):
        with safe_open(str(out_dir / shard), framework="pt") as f:
            for n in f.keys():
                s = f.get_slice(n)
                total += math.prod(s.get_shape()) * {"F8_E4M3": 1, "BF16": 2, "F32": 4}[s.get_dtype()]
    index["metadata"] = {**index.get("metadata", {}), "total_size": total}
    (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((out_dir / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def measure(out_dir: Path, corpus, log, chars: int = 30000) -> dict:
    """Teacher-forced top-1 accuracy of the draft on held-out text, and generation acceptance."""
    from tracing.runner import TraceRequest, run
    from tracing.tokenizer import Tokenizer

    model = load_model(out_dir)
    tok = Tokenizer(out_dir)
    args = model.args
    heldout = {}
    for name, text in (("austen_heldout", corpus.heldout_austen), ("python_faq_heldout", corpus.heldout_pydoc)):
        ids = tok.encode(text[:chars])
        hits = n = 0
        freq = torch.zeros(args.vocab_size)
        for start in range(0, len(ids) - 2, args.max_seq_len - 1):
            window = torch.tensor([ids[start : start + args.max_seq_len]])
            if window.shape[1] < 3:
                break
            with torch.inference_mode():
                _, drafts = model(window, mtp=True)
            top = drafts[0, :-2].argmax(-1)  # entries with a token after next in the window
            target = window[0, 2:]
            hits += int((top == target).sum())
            n += len(target)
            freq += torch.bincount(target, minlength=args.vocab_size).float()
        heldout[name] = {"tokens": n, "draft_top1": round(hits / n, 4), "most_frequent_token": round(float(freq.max() / n), 4)}
        log(f"{name}: draft top-1 {hits / n:.3f} over {n} tokens (most frequent token {float(freq.max() / n):.3f})")
    runs, drafts, accepted = [], 0, 0
    for prompt in PROMPTS:
        trace = run(model, TraceRequest(prompt=prompt, generate=GENERATE), tok)
        got = trace.extra["generation"]["mtp_acceptance"]
        runs.append({"prompt": prompt, **got})
        drafts, accepted = drafts + got["drafts"], accepted + got["accepted"]
    rate = accepted / drafts if drafts else None
    log(f"greedy generation ({len(PROMPTS)} prompts x {GENERATE} tokens): {accepted}/{drafts} drafts accepted ({rate:.3f})")
    return {
        "heldout_teacher_forced": heldout,
        "chance": round(1 / args.vocab_size, 6),
        "generation": {
            "prompts": len(PROMPTS),
            "tokens_each": GENERATE,
            "drafts": drafts,
            "accepted": accepted,
            "rate": round(rate, 4),
        },
        "generation_runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "assets" / "demo"), help="the demo checkpoint to add the module to")
    parser.add_argument("--corpus", default="/tmp/demo-corpus", help="scratch folder for the corpus packages")
    parser.add_argument("--minutes", type=float, default=6.0, help="training time (default 6)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--measure-only", action="store_true", help="measure the module already in --out")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    out = Path(args.out)

    def log(msg: str) -> None:
        print(msg, flush=True)

    corpus = demo_corpus.build(demo_corpus.fetch(Path(args.corpus)))
    log(f"corpus: {len(corpus.train)} documents, sha256 {corpus.digest()}")
    recipe = {}
    if not args.measure_only:
        from tracing.tokenizer import Tokenizer

        main_model = load_model(out, mtp=False)
        tok = Tokenizer(out)
        eos = main_model.args.eos_token_id[0]
        ids: list[int] = []
        for doc in corpus.train:
            ids.extend(tok.encode(doc, add_bos=False))
            ids.append(eos)
        stream = torch.tensor(ids, dtype=torch.int32)
        log(f"stream of {len(stream) / 1e6:.2f} M tokens")
        result = train(main_model, main_model.args, stream, args.minutes, log)
        tensors = export(result["module"], main_model.args)
        write(out, tensors)
        recipe = {
            "command": "python scripts/train_demo_mtp.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "seed": SEED,
            "steps": result["steps"],
            "train_minutes": result["minutes"],
            "batch": BATCH,
            "seq_len": main_model.args.max_seq_len,
            "tokens_seen": result["steps"] * BATCH * main_model.args.max_seq_len,
            "lr": LR,
            "final_loss": result["final_loss"],
            "corpus_sha256": corpus.digest(),
            "shard_bytes": (out / SHARD).stat().st_size,
            "torch": torch.__version__,
            "threads": args.threads,
        }
    figures = measure(out, corpus, log)
    card_path = out / "card.json"
    card = json.loads(card_path.read_text())
    recipe = recipe or card.get("mtp", {}).get("recipe", {})  # --measure-only keeps the training's record
    card["mtp"] = {"recipe": recipe, **figures}
    card["config"] = json.loads((out / "config.json").read_text())
    card_path.write_text(json.dumps(card, indent=2) + "\n")
    import demo_card

    from model.params import count_params

    real = ModelArgs.from_file(REPO / "assets" / "configs" / "config_671B_hf.json")
    counts = {"demo": count_params(ModelArgs.from_file(out)), "671B": count_params(real)}
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file() and f.name != "README.md")
    (out / "README.md").write_text(demo_card.render(card, counts, size))
    log(f"card: {card_path}, {out / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
