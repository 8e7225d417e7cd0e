"""Start from Hugging Face weights: the family's TorchTitan state_dict_adapter over DCP's HuggingFaceStorageReader.

What TorchTitan's checkpointer does for `checkpoint.initial_load_in_hf` (CheckpointManager.dcp_load with
from_hf=True, torchtitan/components/checkpointer/dcp.py), with its own pieces: ModelWrapper's canonical state dict
of this rank's model parts (fused qkv split into wq/wk/wv; DTensor shards under FSDP, TP and EP; only this stage's
blocks under PP), `to_hf` to name and shape those tensors as the checkpoint does (RoPE permutation of q/k, experts
one by one), `dcp.load` reading into them only this rank's slices of the safetensors files, `from_hf` back and
`load_state_dict` in place. No rank holds the whole model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def adapter(spec, folder: Path):
    """The family's state_dict_adapter for this model config, reading `folder`'s index."""
    if spec.state_dict_adapter is None:
        raise ValueError(f"TorchTitan has no state_dict_adapter for {type(spec.model).__name__}")
    return spec.state_dict_adapter(spec.model, str(folder))


def load(parts: list[torch.nn.Module], spec, folder: Path) -> dict[str, Any]:
    """Load `folder`'s weights into this rank's parts in place; returns what was read: the HF keys and the number of
    elements this rank's tensors hold (its shards, not the full tensors)."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer.base import ModelWrapper

    ad, wrapper = adapter(spec, folder), ModelWrapper(parts)
    state = dict(wrapper.state_dict())
    hf_state = ad.to_hf(state)  # a tied head is dropped here and filled from the embedding by from_hf (no PP: validation)
    dcp.load(hf_state, storage_reader=ad.get_hf_storage_reader(str(folder)))
    loaded = ad.from_hf(dict(hf_state))
    missing = sorted(set(state) - set(loaded) - _not_in_hf(state))
    if missing:
        raise RuntimeError(f"{folder} gave no value for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    wrapper.load_state_dict(loaded)
    return {"keys": sorted(hf_state), "local_elements": sum(_local(t).numel() for t in hf_state.values())}


def load_hf(built, folder: Path) -> dict[str, Any]:
    """This rank's share of a Hugging Face folder's weights into a titan.Built's parts (load)."""
    return load(built.parts, built.spec, folder)


def _not_in_hf(state: dict[str, Any]) -> set[str]:
    """Model state with no Hugging Face counterpart, left at its initial value: the auxiliary-loss-free routing bias
    of MoE families whose checkpoints have none (Qwen3 MoE; DeepSeek-V3's is its e_score_correction_bias)."""
    return {k for k in state if k.endswith(("moe.expert_bias_E", "moe.tokens_per_expert_E"))}


def _local(t) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
