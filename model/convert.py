"""A V3.2 checkpoint rewritten in DeepSeek-V3's layout (V3, R1, V3.1): the same weights without the
lightning indexer, the comparison `diff --checkpoint A --against B` makes of dense against sparse
attention on one set of weights.

The layout is names.FAMILIES' ``deepseek_v3``: the config's model_type ``deepseek_v3`` without its
``index_*`` keys, no ``self_attn.indexer.*`` tensors, and the norm gains stored in bfloat16 (V3's
checkpoints store them so; a float32 gain is rounded). Every other tensor is copied as it is. The
shards are read and written one at a time, so a 671B checkpoint needs one shard's memory.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from .checkpoint import INDEX, CheckpointError, SafetensorsSource, check_tensor, expected_specs, has_mtp
from .config import INDEX_KEYS, ModelArgs
from .files import CONFIG_BYTES, FileError, read_json

INDEXER = ".self_attn.indexer."  # in every indexer tensor's checkpoint name
KEPT_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")  # copied when present


def v3_config(config: dict) -> dict:
    """A V3.2 ``config.json`` as DeepSeek-V3's: its model_type and architecture, no ``index_*`` keys,
    every other key as it is."""
    out = {key: value for key, value in config.items() if key not in INDEX_KEYS}
    out["model_type"] = "deepseek_v3"
    out["architectures"] = ["DeepseekV3ForCausalLM"]
    return out


def write_v3_layout(
    source: SafetensorsSource,
    staging: Path,
    on_shard: Callable[[int, int, str, int], None] | None = None,
) -> ModelArgs:
    """Write ``source`` (a checkpoint with the indexer) in V3's layout into the empty directory
    ``staging``: config.json, the index, its shards under their own names (less the indexer's
    tensors) and the tokenizer's files. ``on_shard(done, total, name, bytes_written)``: progress.
    Returns the written checkpoint's ModelArgs; CheckpointError when the source has no indexer."""
    if not source.args.has_indexer:
        raise CheckpointError(f"{source.directory}: already in DeepSeek-V3's layout (no indexer)")
    try:
        config = v3_config(read_json(source._path("config.json"), CONFIG_BYTES))
    except FileError as exc:
        raise CheckpointError(f"{source.directory / 'config.json'}: {exc}") from None
    args = source.args.replace(indexer=False)
    want = expected_specs(args, mtp=has_mtp(source))
    shards: dict[str, list[str]] = {}
    for name, shard in source.weight_map.items():
        if INDEXER not in name:
            shards.setdefault(shard, []).append(name)
    weight_map, total, written = {}, 0, 0
    for done, (shard, names) in enumerate(sorted(shards.items()), start=1):
        tensors = {}
        for name in sorted(names):
            tensor = source.load(name)
            spec = want.get(name)
            if spec is not None and tensor.is_floating_point() and spec.dtype in (torch.bfloat16, torch.float32):
                tensor = tensor.to(spec.dtype)  # the norm gains: bfloat16 in V3's layout
            tensors[name] = tensor
        save_file(tensors, str(staging / shard), metadata={"format": "pt"})
        shutil.copymode(source._path(shard), staging / shard)  # readable by whom the source's shard is
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        total += nbytes
        written += nbytes
        weight_map.update(dict.fromkeys(names, shard))
        del tensors
        if on_shard is not None:
            on_shard(done, len(shards), shard, written)
    (staging / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in KEPT_FILES:
        if (source.directory / name).is_file():
            shutil.copyfile(source._path(name), staging / name)
    written = SafetensorsSource(staging)  # read back: the tensors V3's layout expects, of their shapes and dtypes
    got = written.specs()
    for name, spec in expected_specs(written.args, mtp=has_mtp(written)).items():
        if name in got:
            check_tensor(name, got[name], spec, str(staging))
        elif name in source.weight_map:
            raise CheckpointError(f"{staging}: the copy lacks tensor {name}")
    return written.args
