"""Hugging Face's side of an export: the family's TorchTitan `state_dict_adapter` and the `transformers` config with
the run's numbers (runner.config.hf_export names the architecture of each family).

The architecture numbers come from model.*; what the schema does not name (RoPE theta and scaling, norm epsilon,
router settings) from the TorchTitan flavor the run was built from (runner.run.titan.model.model_spec).
"""

from __future__ import annotations

from typing import Any

from runner.config import flops, hf_export
from runner.config.schema import ModelConfig
from runner.run.titan.model import model_spec


def model_and_adapter(m: ModelConfig):
    """(TorchTitan's model config with m's numbers, the family's state_dict_adapter for it; no HF assets folder)."""
    spec = model_spec(m)
    return spec.model, spec.state_dict_adapter(spec.model, None)


def mismatches(m: ModelConfig, model_config) -> list[str]:
    """What `transformers`' class of the family would compute differently from the TorchTitan model (empty: nothing)."""
    out = []
    if hf_export.key(m) == "deepseek_v3":
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

    arch = hf_export.ARCHITECTURES[hf_export.key(m)]
    cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    fields = {**_common(m, model_config), **_FIELDS[hf_export.key(m)](m, model_config), **token_ids}
    return cls(architectures=[arch], **fields)
