"""The files of a Hugging Face export (runner.run.export decides what to export and where; this writes it)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch

from runner.config.schema import ModelConfig
from runner.run.titan import hf_export as hf

INDEX = "model.safetensors.index.json"
_LAYER = re.compile(r"layers\.(\d+)\.")


def _order(name: str) -> tuple[int, str]:
    """Embedding first, then block by block, then the final norm and head (HF's own shard order)."""
    found = _LAYER.search(name)
    if found:
        return 1 + int(found.group(1)), name
    return (0 if "embed" in name else 1 << 30), name


def _groups(meta, adapter, max_shard_bytes: int) -> list[list[str]]:
    """The model's DCP keys, in order, cut into groups whose HF tensors hold at most max_shard_bytes (a larger
    tensor alone). The adapter maps meta tensors to learn each key's HF bytes; a key it drops (the tied head, an
    expert bias the HF class lacks) rides along with its group, read only to be checked."""
    keys = sorted((k for k in meta.state_dict_metadata if k.startswith("model.")), key=_order)
    groups, size = [[]], 0
    for k in keys:
        md = meta.state_dict_metadata[k]
        got = adapter.to_hf({k[len("model.") :]: torch.empty(tuple(md.size), dtype=md.properties.dtype, device="meta")})
        nbytes = sum(v.numel() * v.element_size() for v in got.values())
        if nbytes and size and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += nbytes
    return groups


def _read(path: Path, meta, keys: list[str]) -> dict[str, torch.Tensor]:
    """The full tensors of `keys` (DCP assembles each from every rank's piece), in one process without a group."""
    import torch.distributed.checkpoint as dcp

    mds = {k[len("model.") :]: meta.state_dict_metadata[k] for k in keys}
    want = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in mds.items()}
    dcp.load({"model": want}, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return want


def weights(path: Path, m: ModelConfig, folder: Path, max_shard_bytes: int) -> dict[str, str]:
    """Every weight of the checkpoint at `path` as HF safetensors shards in `folder`, one shard in memory at a time;
    writes the index and returns its weight map."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    model_config, adapter = hf.model_and_adapter(m)
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    groups = _groups(meta, adapter, max_shard_bytes)
    weight_map, total = {}, 0
    for i, keys in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for key, value in _read(path, meta, keys).items():
            got = adapter.to_hf({key: value})
            if not got and value.count_nonzero() > 0 and not (m.weight_tying and key == "lm_head.weight"):
                print(f"WARNING: export: {key} has no place in transformers' model and is left out (nonzero values)", file=sys.stderr)
            shard.update({k: v.contiguous() for k, v in got.items()})
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        total += sum(v.numel() * v.element_size() for v in shard.values())
        weight_map.update(dict.fromkeys(shard, name))
        del shard
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return weight_map


def tokenizer(path: str, eos_token: str, folder: Path) -> dict[str, int | None]:
    """The run's tokenizer as transformers' fast tokenizer files; returns the bos/eos ids the configs name."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    eos_id = Tokenizer.from_file(path).token_to_id(eos_token) if eos_token else None
    tok = PreTrainedTokenizerFast(tokenizer_file=path, **({"eos_token": eos_token} if eos_id is not None else {}))
    tok.save_pretrained(str(folder))
    return {"bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": None}


def configs(m: ModelConfig, token_ids: dict[str, int | None], folder: Path) -> None:
    """config.json (the family's transformers architecture with the run's numbers) and generation_config.json."""
    from transformers import GenerationConfig

    model_config, _ = hf.model_and_adapter(m)
    ids = token_ids or {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    hf.config(m, model_config, ids).save_pretrained(str(folder))
    GenerationConfig(**ids).save_pretrained(str(folder))
