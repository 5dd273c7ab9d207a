"""Measure the exported demo checkpoint and write its model card (assets/demo/README.md, card.json).

    python scripts/demo_measure.py --out assets/demo --work /tmp/demo-work

Run by scripts/train_demo.py after the export; can be re-run alone (it needs the corpus and the
float weights left in --work). Figures, all on text the model never saw:

* bits per byte, top-1 accuracy, perplexity via tracing.analyses.evaluate (what ``python -m tracing eval``
  prints), for the FP8 export with bfloat16 activations (the CLI default) and float32 activations,
  and for the unquantised float32 model; on held-out Austen, the held-out Python FAQ, an
  out-of-domain text (the GPL-3 licence text every Debian system has) and the in-repo sample;
* the indexer's recall: per query that sees more than index_topk keys, the share of the dense
  attention mass (softmax of the scaled logits ``attn.scores`` under the causal mask, per head, then
  averaged over heads) that falls on the keys the indexer selected; averaged over queries, then
  over layers;
* expert load over the held-out text: each routed expert's share of the routing slots, relative to
  the uniform share 1/E.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from model.checkpoint import load_model  # noqa: E402
from model.config import ModelArgs  # noqa: E402
from model.params import count_params  # noqa: E402
from tracing.analyses.evaluate import evaluate  # noqa: E402
from tracing.tokenizer import Tokenizer  # noqa: E402

OOD_TEXT = Path("/usr/share/common-licenses/GPL-3")
SAMPLE_CHARS = 2400  # of each held-out source in heldout_sample.txt
MEASURE_CHARS = 40_000  # of each held-out text scored for the card (bounds the time)


def heldout_sample(corpus) -> str:
    """A few KB of held-out prose for the repository's test: the start of Persuasion's last
    chapters and of the Python FAQ, cut at paragraph ends."""

    def head(text: str) -> str:
        cut = text[:SAMPLE_CHARS]
        return cut[: cut.rfind("\n\n")] if "\n\n" in cut else cut

    return head(corpus.heldout_austen) + "\n\n" + head(corpus.heldout_pydoc) + "\n"


@torch.no_grad()
def recall_and_load(model, tokenizer: Tokenizer, texts: dict[str, str], seq_len: int, windows_per_text: int = 24) -> dict:
    """Indexer recall, expert load (per text and together) and the logit lens of ``model``, on
    windows of seq_len tokens (BOS + text) from each text."""
    import torch.nn.functional as F

    args = model.args
    k = args.index_topk
    span = seq_len - 1
    windows: list[tuple[str, list[int]]] = []
    for name, text in texts.items():
        ids = tokenizer.encode(text, add_bos=False)
        starts = range(0, len(ids) - span, span)
        windows += [(name, [tokenizer.bos_id] + ids[s : s + span]) for s in starts][:windows_per_text]
    store: dict[str, torch.Tensor] = {}
    handles = []

    def keep(key: str):
        return lambda module, inputs, out: store.__setitem__(key, out)

    for i, layer in enumerate(model.layers):
        handles.append(layer.attn.scores.register_forward_hook(keep(f"scores.{i}")))
        handles.append(layer.attn.indexer.topk_indices.register_forward_hook(keep(f"topk.{i}")))
        handles.append(layer.attn.indexer.scores.register_forward_hook(keep(f"iscores.{i}")))
        handles.append(layer.resid_post.register_forward_hook(keep(f"resid.{i}")))
        if hasattr(layer.ffn, "gate"):
            handles.append(layer.ffn.gate.topk_indices.register_forward_hook(keep(f"experts.{i}")))
    recall_sum = torch.zeros(args.n_layers, dtype=torch.float64)
    oracle_sum = torch.zeros(args.n_layers, dtype=torch.float64)  # the best any k keys could cover
    recall2k_sum = torch.zeros(args.n_layers, dtype=torch.float64)  # the indexer's top-2k, for comparison
    recall_all_sum = torch.zeros(args.n_layers, dtype=torch.float64)  # over every query, pruned or not
    lens_nll = torch.zeros(args.n_layers, dtype=torch.float64)
    lens_hits = torch.zeros(args.n_layers, dtype=torch.float64)
    n_queries = n_targets = n_all_queries = 0
    moe_layers = range(args.n_dense_layers, args.n_layers)
    loads = {(name, i): torch.zeros(args.n_routed_experts, dtype=torch.float64) for name in texts for i in moe_layers}
    norm_w, head_w = model.norm, model.head.weight.float()
    try:
        for start in range(0, len(windows), 8):
            batch = windows[start : start + 8]
            x = torch.tensor([w for _, w in batch])
            model(x)
            seqlen = x.shape[1]
            causal = torch.full((seqlen, seqlen), float("-inf")).triu_(1)
            for i in range(args.n_layers):
                dense_all = (store[f"scores.{i}"].float() + causal[:, None, :]).softmax(dim=-1)  # (B, T, H, S)
                # a query that sees at most k keys selects them all: its -1 slots name no key (key 0
                # is among its selected keys anyway); past k every slot is a key
                top = store[f"topk.{i}"].clamp(min=0)  # (B, T, K)
                sel = torch.zeros_like(dense_all[..., 0, :], dtype=torch.bool).scatter_(-1, top, True)
                covered = (dense_all * sel[:, :, None, :]).sum(-1).mean(-1)  # (B, T): averaged over heads
                recall_sum[i] += covered[:, k:].double().sum()  # queries that see more than k keys
                recall_all_sum[i] += covered.double().sum()  # every query of the window
                dense = dense_all[:, k:]  # (B, T-k, H, S)
                mean = dense.mean(2)  # (B, T-k, S): the head-averaged distribution
                oracle_sum[i] += mean.topk(k, dim=-1)[0].sum(-1).double().sum()
                wide = store[f"iscores.{i}"][:, k:].topk(min(2 * k, seqlen), dim=-1)[1]
                recall2k_sum[i] += mean.gather(-1, wide).sum(-1).double().sum()
                # logit lens: the final norm and head applied to the stream after block i
                logits = F.linear(norm_w(store[f"resid.{i}"][:, :-1].float(), torch.float32), head_w)
                target = x[:, 1:]
                lens_nll[i] += F.cross_entropy(logits.transpose(1, 2), target, reduction="sum").double()
                lens_hits[i] += (logits.argmax(-1) == target).sum().double()
                if i in moe_layers:
                    experts = store[f"experts.{i}"].reshape(x.shape[0], -1)  # (B, T * k)
                    for row, (name, _) in enumerate(batch):
                        loads[name, i] += torch.bincount(experts[row], minlength=args.n_routed_experts).double()
            n_queries += x.shape[0] * (seqlen - k)
            n_all_queries += x.shape[0] * seqlen
            n_targets += x.shape[0] * (seqlen - 1)
    finally:
        for h in handles:
            h.remove()
    per_layer = (recall_sum / n_queries).tolist()
    total = {i: sum(loads[name, i] for name in texts) for i in moe_layers}
    load_rel = {i: (v / v.sum() * args.n_routed_experts).tolist() for i, v in total.items()}
    names = list(texts)
    # how differently the two texts are routed: total variation distance of their load distributions
    shift = (
        {
            str(i): round(
                float(
                    0.5
                    * (loads[names[0], i] / loads[names[0], i].sum() - loads[names[1], i] / loads[names[1], i].sum()).abs().sum()
                ),
                3,
            )
            for i in moe_layers
        }
        if len(names) == 2
        else {}
    )
    return {
        "windows": len(windows),
        "window_tokens": seq_len,
        "queries": n_queries,
        "recall_per_layer": [round(r, 4) for r in per_layer],
        "recall_mean": round(sum(per_layer) / len(per_layer), 4),
        "recall_all_queries_per_layer": [round(float(r), 4) for r in (recall_all_sum / n_all_queries)],
        "recall_all_queries_mean": round(float(recall_all_sum.sum() / n_all_queries / args.n_layers), 4),
        "oracle_topk_mass_per_layer": [round(float(r), 4) for r in (oracle_sum / n_queries)],
        "recall_at_2k_per_layer": [round(float(r), 4) for r in (recall2k_sum / n_queries)],
        "load_relative_to_uniform": {str(i): [round(v, 3) for v in rel] for i, rel in load_rel.items()},
        "load_min": round(min(min(v) for v in load_rel.values()), 3),
        "load_max": round(max(max(v) for v in load_rel.values()), 3),
        "load_by_text": {
            f"{name}.{i}": [round(float(v), 4) for v in (loads[name, i] / loads[name, i].sum()).tolist()]
            for name in texts
            for i in moe_layers
        },
        "routing_shift_between_texts": shift,
        "logit_lens_top1": [round(float(h / n_targets), 4) for h in lens_hits],
        "logit_lens_bits_per_token": [round(float(n / n_targets / math.log(2)), 3) for n in lens_nll],
    }


def _round(d: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}


def measure(out: Path, work: Path, corpus, log) -> dict:
    import train_demo

    tokenizer = Tokenizer(out)
    exported = ModelArgs.from_file(out)
    texts = {
        "austen_heldout": corpus.heldout_austen[:MEASURE_CHARS],
        "python_faq_heldout": corpus.heldout_pydoc[:MEASURE_CHARS],
    }
    if OOD_TEXT.is_file():
        texts["gpl3_out_of_domain"] = OOD_TEXT.read_text()[:MEASURE_CHARS]
    sample = (out / "heldout_sample.txt").read_text()
    texts["heldout_sample"] = sample
    models = {
        "fp8_bf16": lambda: load_model(out, dtype=torch.bfloat16),
        "fp8_f32": lambda: load_model(out, dtype=torch.float32),
        # the exported config (its index_topk), not this module's copy of train_demo's defaults
        "float_f32": lambda: train_demo.load_float(work / "float.safetensors", exported),
    }
    figures: dict = {"eval": {}, "indexer_and_experts": {}}
    seq_len = exported.max_seq_len
    for label, make in models.items():
        model = make()
        for name, text in texts.items():
            t = time.time()
            result = _round(evaluate(model, tokenizer, text))
            figures["eval"].setdefault(name, {})[label] = result
            bpb, top1 = result["bits_per_byte"], result["top1_accuracy"]
            log(f"eval {label:9s} {name:20s} bpb {bpb:.4f} top1 {top1:.4f} ({time.time() - t:.0f} s)")
        pair = {n: texts[n] for n in ("austen_heldout", "python_faq_heldout")}
        stats = recall_and_load(model, tokenizer, pair, seq_len)
        figures["indexer_and_experts"][label] = stats
        recall, loads = stats["recall_per_layer"], (stats["load_min"], stats["load_max"])
        log(f"indexer {label}: recall {stats['recall_mean']} per layer {recall}; load {loads[0]}..{loads[1]}")
        del model
    return figures


def write_card(out: Path, figures: dict, recipe: dict) -> None:
    from model.config import ModelArgs

    config = json.loads((out / "config.json").read_text())
    card = {"config": config, "figures": figures, "recipe": recipe}
    if (out / "card.json").exists() and "mtp" in (old := json.loads((out / "card.json").read_text())):
        card["mtp"] = old["mtp"]  # the MTP module's figures (scripts/train_demo_mtp.py) stay
    (out / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    import demo_card

    real = ModelArgs.from_file(REPO / "assets" / "configs" / "config_671B_hf.json")
    demo = ModelArgs.from_file(out / "config.json")
    counts = {"demo": count_params(demo), "671B": count_params(real)}
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file() and f.name != "README.md")
    (out / "README.md").write_text(demo_card.render(card, counts, size))


def run(out: Path, work: Path, corpus, recipe: dict, log) -> dict:
    (out / "heldout_sample.txt").write_text(heldout_sample(corpus))
    figures = measure(out, work, corpus, log)
    write_card(out, figures, recipe)
    return figures


def main() -> int:
    import demo_corpus

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "assets" / "demo"))
    parser.add_argument("--work", default="/tmp/demo-work")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--card-only", action="store_true", help="rewrite README.md from card.json, measure nothing")
    parser.add_argument("--measure-chars", type=int, help="characters of each held-out text to score")
    args = parser.parse_args()
    if args.measure_chars:
        globals()["MEASURE_CHARS"] = args.measure_chars
    torch.set_num_threads(args.threads)
    out, work = Path(args.out), Path(args.work)
    if args.card_only:
        card = json.loads((out / "card.json").read_text())
        write_card(out, card["figures"], card["recipe"])
        return 0
    import train_demo

    recipe = json.loads((work / "recipe.json").read_text())
    corpus = demo_corpus.build(demo_corpus.fetch(work / "corpus"), seed=recipe["seed"])
    run(out, work, corpus, recipe, lambda m: print(m, flush=True))
    del train_demo
    return 0


if __name__ == "__main__":
    sys.exit(main())
