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

from runner.estimate import flops
from runner.formats import hf_folder
from runner.run.titan.model import model_spec
from runner.schema import ModelConfig


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


def model_and_adapter(m: ModelConfig):
    """(TorchTitan's model config with m's numbers, the family's state_dict_adapter for it; no HF assets folder)."""
    spec = model_spec(m)
    return spec.model, spec.state_dict_adapter(spec.model, None)


def mismatches(m: ModelConfig, model_config) -> list[str]:
    """What `transformers`' class of the family would compute differently from the TorchTitan model (empty: nothing)."""
    out = []
    if hf_folder.export_key(m) == "deepseek_v3":
        router = _moe(model_config).router
        if router.score_func != "sigmoid":
            out.append(
                f"transformers' DeepseekV3 scores experts with a sigmoid; TorchTitan's deepseek_v3 {m.flavor} uses {router.score_func}"
            )
    return out


def _moe(model_config):
    return next(layer.moe for layer in model_config.layers if layer.moe is not None)


def _rope(model_config) -> dict[str, Any]:
    r = model_config.layers[0].attention.rope
    if r.scaling == "llama":
        scaling = {
            "rope_type": "llama3",
            "factor": r.scaling_factor,
            "low_freq_factor": r.low_freq_factor,
            "high_freq_factor": r.high_freq_factor,
            "original_max_position_embeddings": r.original_max_position_embeddings,
        }
    elif r.scaling == "yarn" and r.rope_factor > 1.0:
        mscale = model_config.layers[0].attention.mscale
        scaling = {
            "rope_type": "yarn",
            "factor": r.rope_factor,
            "original_max_position_embeddings": r.original_seq_len,
            "beta_fast": r.beta_fast,
            "beta_slow": r.beta_slow,
            "mscale": mscale,  # equal to mscale_all_dim: no factor on cos/sin, the softmax scale times mscale^2 (as TorchTitan)
            "mscale_all_dim": mscale,
            "truncate": r.truncate,
        }
    else:
        scaling = {"rope_type": "default"}
    return {"rope_theta": float(r.theta), **scaling}


def _positions(m: ModelConfig, model_config) -> int:
    """Positions the model is meant for: YaRN's factor times its original length (DeepSeek-V3 publishes 40 x 4096, and
    transformers warns of any other), else the length of TorchTitan's RoPE table."""
    r = model_config.layers[0].attention.rope
    return int(r.rope_factor * r.original_seq_len) if r.scaling == "yarn" and r.rope_factor > 1.0 else m.rope_max_seq_len


def _common(m: ModelConfig, model_config) -> dict[str, Any]:
    return {
        "vocab_size": m.vocab_size,
        "hidden_size": m.dim,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "max_position_embeddings": _positions(m, model_config),
        "rms_norm_eps": model_config.norm.eps,
        "tie_word_embeddings": m.weight_tying,
        "rope_parameters": _rope(model_config),
        "dtype": "float32",
    }


def _llama3(m: ModelConfig, model_config) -> dict[str, Any]:
    return {"intermediate_size": m.ffn_hidden_dim, "num_key_value_heads": m.num_kv_heads, "head_dim": flops.head_dim(m)}


def _qwen3(m: ModelConfig, model_config) -> dict[str, Any]:
    return {"intermediate_size": m.ffn_hidden_dim, "num_key_value_heads": m.num_kv_heads, "head_dim": flops.head_dim(m)}


def _qwen3_moe(m: ModelConfig, model_config) -> dict[str, Any]:
    router = _moe(model_config).router
    return {
        **_qwen3(m, model_config),
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.num_experts_per_token,
        "moe_intermediate_size": m.moe_hidden_dim,
        "norm_topk_prob": router.route_norm,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _deepseek_v3(m: ModelConfig, model_config) -> dict[str, Any]:
    router = _moe(model_config).router
    return {
        "intermediate_size": m.ffn_hidden_dim,
        "moe_intermediate_size": m.moe_hidden_dim,
        "num_key_value_heads": m.num_heads,
        "n_shared_experts": m.num_shared_experts,
        "n_routed_experts": m.num_experts,
        "num_experts_per_tok": m.num_experts_per_token,
        "routed_scaling_factor": router.route_scale,
        "n_group": router.num_expert_groups or 1,
        "topk_group": router.num_limited_groups or 1,
        "norm_topk_prob": router.route_norm,
        "first_k_dense_replace": m.num_dense_layers,
        "kv_lora_rank": m.kv_lora_rank,
        "q_lora_rank": m.q_lora_rank or None,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "v_head_dim": m.v_head_dim,
        "num_nextn_predict_layers": len(model_config.mtp_layers or []),
        "rope_interleave": True,  # TorchTitan's complex RoPE rotates adjacent pairs; the adapter keeps that order
    }


_FIELDS = {"llama3": _llama3, "qwen3": _qwen3, "qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3}


def config(m: ModelConfig, model_config, token_ids: dict[str, int | None]):
    """The `transformers` config of the export: the family's architecture with m's numbers; `token_ids`: bos/eos/pad ids."""
    import transformers

    arch = hf_folder.ARCHITECTURES[hf_folder.export_key(m)]
    cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    fields = {**_common(m, model_config), **_FIELDS[hf_folder.export_key(m)](m, model_config), **token_ids}
    return cls(architectures=[arch], **fields)
