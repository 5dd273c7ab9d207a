"""The demo's model card (assets/demo/README.md), rendered from card.json by scripts/demo_measure.py."""

from __future__ import annotations

# (HF config key, what it is) in the order of the architecture table; tests/test_demo.py reads the
# table back and compares each demo value with config.json
ROWS = (
    ("vocab_size", "vocabulary"),
    ("hidden_size", "d, residual stream width"),
    ("num_hidden_layers", "blocks (without the MTP module)"),
    ("num_nextn_predict_layers", "MTP modules (multi-token prediction, stored after the blocks)"),
    ("first_k_dense_replace", "dense blocks first"),
    ("intermediate_size", "dense MLP hidden width"),
    ("num_attention_heads", "attention heads"),
    ("q_lora_rank", "query latent (LoRA) rank"),
    ("kv_lora_rank", "KV latent rank"),
    ("qk_nope_head_dim", "query/key dims without RoPE"),
    ("qk_rope_head_dim", "query/key RoPE dims"),
    ("v_head_dim", "value dims per head"),
    ("index_n_heads", "indexer heads"),
    ("index_head_dim", "indexer head dim"),
    ("index_topk", "keys each query attends to (DSA top-k)"),
    ("n_routed_experts", "routed experts per MoE block"),
    ("n_shared_experts", "shared experts"),
    ("num_experts_per_tok", "experts per token"),
    ("n_group", "expert groups"),
    ("topk_group", "groups a token may use"),
    ("moe_intermediate_size", "expert hidden width"),
    ("scoring_func", "router score"),
    ("topk_method", "routing (noaux_tc: correction bias)"),
    ("routed_scaling_factor", "routed scale"),
    ("max_position_embeddings", "longest context"),
    ("rope_theta", "RoPE base"),
    ("rms_norm_eps", "RMSNorm epsilon"),
    ("bos_token_id", "BOS id"),
    ("eos_token_id", "EOS id"),
)


def _fmt(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def atlas_section(measured_recall: list[float]) -> str:
    """The bundled atlas (assets/demo_atlas, scripts/demo_atlas.py): its command and per-block
    figures; ``measured_recall`` is the card's own recall per block, for comparison."""
    import json
    from pathlib import Path

    import pandas as pd
    from demo_atlas import ATLAS_COMMAND

    folder = Path(__file__).resolve().parent.parent / "assets" / "demo_atlas"
    if not (folder / "summary.json").is_file():
        return ""
    summary = json.loads((folder / "summary.json").read_text())
    recall = pd.read_parquet(folder / "indexer_recall.parquet").set_index("block")
    bias = pd.read_parquet(folder / "bias_effect.parquet").set_index("block")
    columns = ("block", "busiest / mean load", "CV of the load", "experts never chosen", "tokens the bias reroutes")
    rows = ["| " + " | ".join((*columns, "recall median", "recall mean")) + " |", "|---|---|---|---|---|---|---|"]
    for block in range(summary["n_layers"]):
        load = summary["imbalance"].get(str(block))
        moe = (
            f"{load['max_over_mean']:.2f} | {load['cv']:.3f} | {load['never_chosen']} | "
            f"{bias.loc[block, 'tokens_changed'] / bias.loc[block, 'tokens']:.1%}"
            if load
            else "dense | | |"
        )
        rows.append(f"| {block} | {moe} | {recall.loc[block, 'p50']:.3f} | {recall.loc[block, 'mean']:.3f} |")
    command = ATLAS_COMMAND.format(texts="/tmp/demo-atlas-texts", out="assets/demo_atlas")
    return f"""## Atlas

`assets/demo_atlas` is this model's atlas over the held-out texts (the last three chapters of
*Persuasion* and the Python FAQ): expert load, co-activation, each expert's most specific tokens,
group load, the correction bias's effect, the indexer's reach, recall and sinks, counted over
{summary["tokens"]:,} positions in {summary["sequences"]} sequences of at most {summary["settings"]["seq_len"]}
([docs/atlas.md](../../docs/atlas.md)). The app's Atlas page opens it at once. Made by:

```bash
python scripts/demo_atlas.py     # writes the held-out texts (scripts/demo_corpus.py), then runs:
{command}
```

{chr(10).join(rows)}

The recall here is over every window of the held-out texts; measured above on 48 windows it is
{", ".join(f"{x:.3f}" for x in measured_recall)}.

"""


def mtp_section(card: dict) -> str:
    """The MTP module's recipe and acceptance (card.json's ``mtp``, scripts/train_demo_mtp.py), or ""."""
    mtp = card.get("mtp")
    if not mtp:
        return ""
    rec, gen, held = mtp.get("recipe", {}), mtp["generation"], mtp["heldout_teacher_forced"]
    names = {"austen_heldout": "Austen, held out", "python_faq_heldout": "Python FAQ, held out"}
    rows = ["| text | tokens | draft top-1 = token after next | the most frequent token's share |", "|---|---|---|---|"]
    for key, got in held.items():
        rows.append(f"| {names.get(key, key)} | {got['tokens']:,} | {got['draft_top1']:.3f} | {got['most_frequent_token']:.3f} |")
    trained = (
        f"trained for {rec['train_minutes']:.1f} minutes on 2 CPU cores ({rec['steps']:,} steps of {rec['batch']} windows of "
        f"{rec['seq_len']} tokens, {rec['tokens_seen'] / 1e6:.1f}M tokens; final loss {rec['final_loss']:.2f} nats) by "
        f"`{rec['command']}`"
        if rec
        else "trained by `python scripts/train_demo_mtp.py`"
    )
    return f"""## Multi-token prediction (MTP)

The checkpoint carries one MTP module, as the real one does (`num_nextn_predict_layers` 1, stored as
block {card["config"]["num_hidden_layers"]} in `model-mtp.safetensors`): the draft of the token after next,
`head(norm(Block(eh_proj([enorm(e(token_{{t+1}})) ; hnorm(h_t)]))))` with h_t the main model's state after its
final norm (docs/cli.md). It was added after the main model, every other weight unchanged: {trained}. The
main model stayed frozen; the module's block started as a copy of the last block (its indexer kept
as copied: the LM loss never trains an indexer), `eh_proj` at random; the router's bias moved by the
same auxiliary-loss-free rule. FP8 e4m3 linears with ue8m0 scales, `eh_proj` in bfloat16, norms in
float32; the embedding and head are the main model's (the real checkpoint's copies under the MTP
layer are left out here). Its shard is {rec.get("shard_bytes", 0) / 2**20:.2f} MiB. Its training documents are the
corpus as `scripts/demo_corpus.py` built it for that run (sha256 `{rec.get("corpus_sha256", "?")}`), tokenized
by this tokenizer.

Measured on text it never saw, teacher-forced (`model(tokens, mtp=True)`; chance: {mtp["chance"]:.5f}):

{chr(10).join(rows)}

In greedy generation ({gen["prompts"]} fixed prompts x {gen["tokens_each"]} tokens, `tracing.run` through the
decode path): the draft equals the token the model then wrote **{gen["accepted"]} of {gen["drafts"]} times
({gen["rate"]:.1%})**, the acceptance a speculative decoder with this draft would see (about
{1 + gen["rate"]:.2f} tokens per main-model pass). Reproduce: `python scripts/train_demo_mtp.py --measure-only`,
or one prompt: `python -m tracing run --checkpoint demo --prompt "It is a truth" --generate 48 --out g.safetensors`
(the summary line prints the acceptance; the `steps` table has `mtp_draft` and `mtp_accepted`).

"""


def render(card: dict, counts: dict, size_bytes: int) -> str:
    import json
    from pathlib import Path

    demo = card["config"]
    real = json.loads((Path(__file__).resolve().parent.parent / "assets" / "configs" / "config_671B_hf.json").read_text())
    fig = card["figures"]
    rec = card["recipe"]
    ev = fig["eval"]
    ix = fig["indexer_and_experts"]

    arch = ["| field (config.json) | meaning | demo | DeepSeek-V3.2-Exp 671B |", "|---|---|---|---|"]
    for key, meaning in ROWS:
        arch.append(f"| `{key}` | {meaning} | {_fmt(demo.get(key))} | {_fmt(real.get(key))} |")
    yarn = real["rope_scaling"]
    arch.append(
        f"| `rope_scaling` | YaRN | none (plain RoPE, trained at {demo['max_position_embeddings']}) | "
        f"yarn, factor {yarn['factor']}, original {yarn['original_max_position_embeddings']:,} |"
    )
    q = demo["quantization_config"]
    arch.append(f"| `quantization_config` | weights | {q['fmt']} {q['weight_block_size']} blocks, {q['scale_fmt']} | same |")
    d, r = counts["demo"], counts["671B"]
    arch.append(f"| | total parameters | {d['total_params']:,} | {r['total_params']:,} |")
    arch.append(f"| | activated per token (no embedding) | {d['activated_params']:,} | {r['activated_params']:,} |")

    labels = {
        "fp8_bf16": "FP8 export, bf16 activations (CLI default)",
        "fp8_f32": "FP8 export, float32",
        "float_f32": "unquantised float32",
    }
    names = {
        "austen_heldout": "Austen, held out (last 3 chapters of *Persuasion*)",
        "python_faq_heldout": "Python FAQ, held out",
        "gpl3_out_of_domain": "GPL-3 text (out of domain)",
        "heldout_sample": "`heldout_sample.txt` (in the repo)",
    }
    evt = ["| text | tokens | model | bits per byte | top-1 | perplexity |", "|---|---|---|---|---|---|"]
    for name, per_model in ev.items():
        for label, res in per_model.items():
            evt.append(
                f"| {names.get(name, name)} | {res['tokens']:,} | {labels[label]} | {res['bits_per_byte']:.3f} | "
                f"{res['top1_accuracy']:.3f} | {res['perplexity']:.1f} |"
            )
    fp8_change = [
        "| text | bits per byte, float32 | FP8 export (bf16) | change | FP8 export (float32) | change |",
        "|---|---|---|---|---|---|",
    ]
    for name, per_model in ev.items():
        base = per_model["float_f32"]["bits_per_byte"]
        a, b = per_model["fp8_bf16"]["bits_per_byte"], per_model["fp8_f32"]["bits_per_byte"]
        fp8_change.append(
            f"| {names.get(name, name)} | {base:.4f} | {a:.4f} | {_pct(a / base - 1)} | {b:.4f} | {_pct(b / base - 1)} |"
        )

    idx = [
        "| model | recall per layer | mean | best possible top-k mass | recall of the top-2k "
        "| recall over all queries (mean) | least / most loaded expert (x uniform) |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, st in ix.items():
        oracle = st.get("oracle_topk_mass_per_layer", [])
        wide = st.get("recall_at_2k_per_layer", [])
        every = st.get("recall_all_queries_mean")
        idx.append(
            f"| {labels[label]} | {', '.join(f'{x:.3f}' for x in st['recall_per_layer'])} | **{st['recall_mean']:.3f}** | "
            f"{', '.join(f'{x:.3f}' for x in oracle)} | {', '.join(f'{x:.3f}' for x in wide)} | "
            f"{'' if every is None else f'{every:.3f}'} | {st['load_min']:.2f} / {st['load_max']:.2f} |"
        )
    main = ix["fp8_bf16"]
    loads = ["| block | share of routing slots per expert, x uniform (FP8 export, bf16) |", "|---|---|"]
    for layer, rel in main["load_relative_to_uniform"].items():
        loads.append(f"| {layer} | {' '.join(f'{x:.2f}' for x in rel)} |")
    lens = ["| after block | " + " | ".join(str(i) for i in range(len(main["logit_lens_top1"]))) + " |"]
    lens.append("|---|" + "---|" * len(main["logit_lens_top1"]))
    lens.append("| top-1 accuracy | " + " | ".join(f"{x:.3f}" for x in main["logit_lens_top1"]) + " |")
    lens.append("| bits per token | " + " | ".join(f"{x:.2f}" for x in main["logit_lens_bits_per_token"]) + " |")
    shift = ", ".join(f"block {i}: {v:.2f}" for i, v in main.get("routing_shift_between_texts", {}).items())
    sample = ev["heldout_sample"]["fp8_bf16"]
    train_cmd = rec.get("train_command") or rec["command"]
    run_note = (
        f"The shipped weights: `{train_cmd}` trained {rec['steps']:,} steps in {rec['train_minutes']:.0f} minutes on "
        f"{rec.get('threads', 2)} CPU cores ({60 * rec['train_minutes'] / max(rec['steps'], 1):.1f} s per step on average)"
    )
    if train_cmd != rec["command"]:
        run_note += f"; exported and measured by `{rec['command']}`, which continues from the trained weights."
    else:
        run_note += "."
    headline = {n: ev[n]["fp8_bf16"] for n in ev}
    recall = main["recall_mean"]
    best = sum(main["oracle_topk_mass_per_layer"]) / len(main["oracle_topk_mass_per_layer"])
    wide = sum(main["recall_at_2k_per_layer"]) / len(main["recall_at_2k_per_layer"])
    k = demo["index_topk"]
    recall_note = f"**The 0.9 target is {'met' if recall >= 0.9 else 'missed'}: {recall:.3f}.** " + (
        (
            f"The indexer is not what limits it: its top-{k} covers {recall / best:.1%} of what the "
            f"{k} heaviest keys hold ({best:.3f} on average). The attention itself is too diffuse in the "
            f"first blocks for any {k} keys to hold 90% of it (the sparse-trained model only ever uses "
            f"the selected keys, so nothing concentrates the rest); "
            if recall / best >= 0.95
            else f"The {k} heaviest keys hold {best:.3f} on average, of which the indexer's top-{k} covers {recall / best:.1%}; "
        )
        + f"the indexer's top-{2 * k} covers {wide:.3f}."
        if recall < 0.9
        else f"Its top-{k} covers {recall / best:.1%} of what the {k} heaviest keys hold ({best:.3f} on average)."
    )
    every = main.get("recall_all_queries_mean")
    if every is not None:
        recall_note += (
            f" The target is read in this strict sense (only queries that see more than {k} keys); averaged "
            f"over every query of the {main['window_tokens']}-token windows, where the first {k} queries keep all "
            f"their keys and so cover all of their mass, the recall is {every:.3f}."
        )
    ood = ev.get("gpl3_out_of_domain", {}).get("fp8_bf16")
    ood_note = (
        (f"the GPL-3 licence text (legal prose) gives {ood['bits_per_byte']:.2f} bits per byte; " if ood else "")
        + "Markdown with code and tables (this repository's README) about 3.9, and text indented with runs of "
        "spaces (which the corpus never has) more than plain prose"
    )
    bullets = "\n".join(
        f"- {names.get(n, n)}: **{r['bits_per_byte']:.3f} bits per byte**, top-1 accuracy {r['top1_accuracy']:.3f}"
        for n, r in headline.items()
    )
    window = headline["austen_heldout"]
    return f"""# The bundled demo: a tiny, trained DeepSeek-V3.2

A {d["total_params"] / 1e6:.1f}M-parameter model ({d["activated_params"] / 1e6:.1f}M activated per token) with
the architecture of DeepSeek-V3.2-Exp: MLA with a query LoRA, DeepSeek Sparse Attention's lightning
indexer, a dense first block, then MoE blocks of {demo["n_routed_experts"]} routed experts in
{demo["n_group"]} groups (group-limited sigmoid routing with the auxiliary-loss-free correction bias) and
a shared expert. It is stored exactly as the real checkpoint is: `config.json` (model_type
`deepseek_v32`, `quantization_config`), `model.safetensors.index.json` and two shards of FP8 e4m3
weights with float32 `weight_scale_inv` per 128x128 block (power-of-two ue8m0 scales), the real
tensor names, and a byte-level BPE `tokenizer.json` with `tokenizer_config.json`. It loads through the
same `model.checkpoint.load_model` as the 671B checkpoint; `--checkpoint demo` names it:

```bash
python -m tracing eval --checkpoint demo --text-file assets/demo/heldout_sample.txt
python -m tracing run --checkpoint demo --prompt "It is a truth universally acknowledged" --out trace.safetensors
```

It is a toy: {rec["tokens_seen"] / 1e6:.1f}M training tokens of 19th-century novels and Python
documentation, trained in {rec["train_minutes"]:.0f} minutes on 2 CPU cores. Its text is locally fluent
and globally meaningless; what it is for is real structure to look at: trained routers with
specialised experts, an indexer whose top-{demo["index_topk"]} keys carry nearly all the attention mass
that any {demo["index_topk"]} keys could, and a residual stream that a logit lens can read.

Limits: the figures below are for English prose like its corpus. Text of another kind costs more:
{ood_note}. Prompts are at most {demo["max_position_embeddings"]} tokens.

Directory size: {size_bytes / 2**20:.2f} MiB (limit 20 MiB).

## Architecture, beside the 671B model

{chr(10).join(arch)}

The widths keep every FP8 constraint of the real model: each linear layer's input width is a
multiple of 128 (the activation quantisation block), the indexer head dim is a power of two (its
Hadamard rotation) and at least the RoPE dims. `max_position_embeddings` equals the training
context, so there is no YaRN (the reference applies YaRN only when it exceeds
`original_max_position_embeddings`); prompts are limited to {demo["max_position_embeddings"]} tokens.

## Measured

All on text the model never saw in training, with `tracing.analyses.evaluate.evaluate` (what
`python -m tracing eval` prints): teacher-forced next-token NLL in windows of
{window["context"]} positions (BOS + text) advancing by {window["stride"]}; bits per byte are
the summed NLL in bits over the UTF-8 bytes of the text.

Headline (FP8 export as shipped, bfloat16 activations as the CLI runs it):
{bullets}

{chr(10).join(evt)}

### FP8 export

The change in bits per byte from rounding the trained float32 weights to FP8 (plus FP8 activation
quantisation in every linear layer, as the reference's `fp8_gemm` does); target within 3%:

{chr(10).join(fp8_change)}

### Indexer recall and expert load

Recall: for each query that sees more than `index_topk` = {demo["index_topk"]} keys (so DSA prunes), the
share of the dense attention mass that falls on the indexer's selected keys. The dense distribution
is the softmax of MLA's scaled logits (hook `layers.N.attn.scores`) under the causal mask, per head;
the share is averaged over heads (equivalently: the head-averaged distribution's mass), over queries
and then over layers. "Best possible" is the mass of the k heaviest keys of that distribution (what a
perfect indexer would cover); "top-2k" the mass the indexer's best 2k keys cover. Measured on
{main["windows"]} held-out windows of {main["window_tokens"]} tokens (Austen and Python FAQ),
{main["queries"]:,} queries per layer. Target at least 0.9.

{recall_note}

Expert load: each routed expert's share of the routing slots (tokens x experts per token) over the
same held-out windows, relative to the uniform share 1/{demo["n_routed_experts"]}. Target: none below 0.25.

{chr(10).join(idx)}

{chr(10).join(loads)}

Experts specialise: the total variation distance between the expert loads on held-out Austen and on
the held-out Python FAQ (0: routed alike, 1: disjoint experts) is {shift}.

### Logit lens

The final norm and head applied to the residual stream after each block (FP8 export, bf16, same
held-out windows): next-token top-1 accuracy and cross-entropy sharpen block by block.

{chr(10).join(lens)}

{mtp_section(card)}{atlas_section(main["recall_per_layer"])}## Corpus and licences

Both from Debian 12 (bookworm) main, fetched with `apt-get download` and unpacked with `dpkg-deb -x`
(no installation, no root needed), prepared by `scripts/demo_corpus.py`:

- `r-cran-janeaustenr` (1.0.0-1; the package is MIT, Julia Silge): Jane Austen's six novels as
  Project Gutenberg published them. The novels are in the **public domain**. Read from the package's
  R lazy-load database by a small reader of R's serialisation (no R needed).
- `python3.11-doc` (the Python 3.11 documentation's reStructuredText sources): **PSF License
  Version 2** (Copyright © 2001-2023 Python Software Foundation; all rights reserved), which allows
  derivative works with this notice. Only prose paragraphs are kept (no code, tables, directives,
  titles); sections tutorial, howto, library, reference, using, whatsnew (without the changelog) and
  the glossary.

{rec["corpus_characters"] / 1e6:.2f}M characters, {rec["corpus_tokens"] / 1e6:.2f}M tokens; sha256 of the prepared training
documents `{rec["corpus_sha256"]}`. A quarter of the documents (seeded choice) keep hard-wrapped lines
of 72 columns, the rest one line per paragraph, so that both layouts of English text are familiar.
Held out before anything was trained: the last three chapters of *Persuasion* and the whole Python
FAQ (`faq/`). `heldout_sample.txt` is the first ~2K characters of each (public domain;
PSF License), scored by `tests/test_demo.py`.

## Recipe

```bash
apt-get update                       # once, for apt-get download
python scripts/train_demo.py --out assets/demo --force
```

One command; fixed seeds (seed {rec["seed"]}); torch {rec["torch"]}, 2 threads. It builds the corpus, trains
the tokenizer (byte-level BPE, `tokenizers`, {demo["vocab_size"]:,} tokens, BOS `<｜begin▁of▁sentence｜>` = 0,
EOS `<｜end▁of▁sentence｜>` = 1, `add_bos_token` true), trains the model in float32 with the project's
own `model/` modules, exports, measures and writes this card
(`scripts/demo_measure.py`, `scripts/demo_card.py`). Training runs for a time budget (`--minutes`,
default 80: about 85 minutes in all; on 2 idle cores a step takes about 1.5 s, so some 3,000 steps); the
learning-rate schedule and the dense-to-sparse switch follow the elapsed share of it. `--steps N`
trains a fixed number of steps instead, with the schedule following the step count.

{run_note}

- Data: windows of {rec["seq_len"]} tokens (BOS + {rec["seq_len"]} tokens of the stream; documents end with EOS),
  batch {rec["batch"]}, {rec["steps"]:,} steps = {rec["tokens_seen"] / 1e6:.1f}M tokens (about
  {rec["tokens_seen"] / max(rec["corpus_tokens"], 1):.1f} passes over the corpus).
- AdamW (beta 0.9, 0.95; weight decay 0.1 on matrices), peak learning rate {rec["lr"]},
  {rec.get("warmup_steps", 100)} warm-up steps, cosine decay to a tenth; gradient clipping at 1.0.
- Auxiliary-loss-free balancing (DeepSeek-V3): after each step every router's correction bias moves by
  {rec["bias_gamma"]} x sign(mean load - expert load); the bias gets no gradient.
- Indexer (DeepSeek-V3.2): trained only by KL(p || softmax(I)), where p is the main attention's
  distribution (dense causal softmax of the scaled logits, summed over heads, L1-normalised per query,
  detached) and I the indexer's scores computed from its own modules in float32 without FP8 rounding;
  its inputs are detached, so the KL trains the indexer alone. Formed on {rec.get("kl_rows", 4)} of the
  {rec["batch"]} sequences of each batch (the top-k on all).
- Dense warm-up, then sparse training: the first {rec["dense_steps"]:,} steps attend densely (the indexer's
  top-k widened to the whole window) while the indexer learns; the rest train with DeepSeek Sparse
  Attention at top-{demo["index_topk"]}, the indexer still fitting the dense distribution.
- Export: linear weights to FP8 e4m3 with ue8m0 block scales (`model.fp8.weight_quant`); embedding,
  head, norms, router weight, the indexer's `weights_proj` and `k_norm` in bfloat16; scales and the
  router bias in float32; written by `model.checkpoint.save_checkpoint` in two shards.

## Tests

`tests/test_demo.py` loads this directory with `model.checkpoint.load_model`, checks that
`config.json` is the configuration in this card (`card.json` and the table above), that the FP8
weights and ue8m0 scales are there under the real names, that the directory is at most 20 MiB, and
that `evaluate` on `heldout_sample.txt` gives {sample["bits_per_byte"]:.3f} bits per byte (bf16) within 2%{
        "; `tests/model/test_mtp.py` that the MTP module's drafts are accepted far above chance" if card.get("mtp") else ""
    }.
"""
