"""TorchTitan's model config built from the runner's ModelConfig (runner/schema/training.py).

The flavor in TorchTitan's registry gives everything the schema does not name (initializers,
RoPE scaling, router scoring, attention backend); every architecture number the schema names
(dim, layers, heads, FFN and expert sizes, latent-attention ranks, vocabulary, weight tying)
comes from the config, through the family's own layer builders. So `model.dim=512` trains a
model of width 512, and the parameter count and FLOPs that the run reports are the config's.
"""

from __future__ import annotations

import dataclasses
import importlib

from runner.estimate import flops
from runner.schema import ModelConfig

ATTN_BACKEND = "flex"
"""The attention backend asked of the registry and its builders (TorchTitan's default); on CPU the
inner attention is swapped for SDPA afterwards (runner.run.titan.cpu.use_sdpa)."""

DENSE_ONLY_FIELDS = ("num_experts", "num_experts_per_token", "num_shared_experts", "moe_hidden_dim", "num_dense_layers")
LATENT_ATTENTION_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
GPT_OSS_FIELDS = ("attention_bias", "attention_sinks", "sliding_window", "moe_bias")


REGISTRY_ONLY = ("qwen3_5",)
"""Families built as their registry flavor as it is (runner.config.family_support.Support.registry_only)."""


def model_spec(m: ModelConfig):
    """TorchTitan's ModelSpec for the family and flavor, its model config rebuilt with m's architecture."""
    family = importlib.import_module(f"torchtitan.models.{m.name}")
    spec = family.model_registry(m.flavor, attn_backend=ATTN_BACKEND)
    if m.name in REGISTRY_ONLY:  # validation holds model.* to the flavor's numbers (runner.config.family_support)
        return spec
    if m.name not in FAMILY_BUILDERS:
        raise ValueError(f"the runner builds TorchTitan's {', '.join(FAMILY_BUILDERS)} families, not {m.name}")
    spec.model = FAMILY_BUILDERS[m.name](m, spec.model, family)
    return spec


def _decoder(m: ModelConfig, flavor, layers: list, family) -> object:
    """The flavor's top-level config with m's width, vocabulary, tying and blocks (initializers kept; the
    head's depends on the width where the family scales it)."""
    # private_api: titan_output_linear_init
    head_init = family._output_linear_init(m.dim) if hasattr(family, "_output_linear_init") else flavor.lm_head.param_init
    return dataclasses.replace(
        flavor,
        dim=m.dim,
        vocab_size=m.vocab_size,
        enable_weight_tying=m.weight_tying,
        tok_embeddings=dataclasses.replace(flavor.tok_embeddings, num_embeddings=m.vocab_size, embedding_dim=m.dim),
        norm=dataclasses.replace(flavor.norm, normalized_shape=m.dim),
        lm_head=dataclasses.replace(flavor.lm_head, in_features=m.dim, out_features=m.vocab_size, param_init=head_init),
        layers=layers,
    )


def _rope(rope, dim: int, m: ModelConfig):
    """The flavor's RoPE config with m's head dims and, where it differs from the flavor's, m's rope_theta (the
    flavor's own number kept as the registry writes it, e.g. the int 500000)."""
    theta = {} if rope.theta == m.rope_theta else {"theta": m.rope_theta}
    return dataclasses.replace(rope, dim=dim, **theta)


def _refuse(m: ModelConfig, fields: tuple[str, ...], what: str) -> None:
    set_fields = [f"model.{f} = {getattr(m, f)}" for f in fields if getattr(m, f)]
    if set_fields:
        raise ValueError(f"TorchTitan's {m.name} is {what}; it has no {', '.join(set_fields)}")


def _llama3(m: ModelConfig, flavor, llama3):
    _refuse(m, (*DENSE_ONLY_FIELDS, *LATENT_ATTENTION_FIELDS, *GPT_OSS_FIELDS, "qk_norm"), "a dense model with grouped-query attention")
    attention = flavor.layers[0].attention
    hd = flops.head_dim(m)
    # private_api: titan_build_llama3_layers
    layers = llama3._build_llama3_layers(
        n_layers=m.num_layers,
        dim=m.dim,
        n_heads=m.num_heads,
        n_kv_heads=None if m.num_kv_heads == m.num_heads else m.num_kv_heads,  # as the registry writes a model without GQA
        hidden_dim=m.ffn_hidden_dim,
        rope=_rope(attention.rope, hd, m),
        fuse_qkv=m.fuse_qkv,
        attn_backend=ATTN_BACKEND,
    )
    return _decoder(m, flavor, layers, llama3)


def _qwen3(m: ModelConfig, flavor, qwen3):
    """Grouped-query attention with per-head q/k RMSNorms; a SwiGLU MLP in every block, or (num_experts > 0)
    routed experts without shared ones in every block."""
    _refuse(m, (*LATENT_ATTENTION_FIELDS, *GPT_OSS_FIELDS, "num_shared_experts", "num_dense_layers"), "Qwen3 (GQA, dense or all-MoE)")
    hd = flops.head_dim(m)
    common = dict(
        n_layers=m.num_layers,
        dim=m.dim,
        n_heads=m.num_heads,
        n_kv_heads=m.num_kv_heads,
        head_dim=hd,
        fuse_qkv=m.fuse_qkv,
        attn_backend=ATTN_BACKEND,
        rope=_rope(flavor.layers[0].attention.rope, hd, m),
    )
    if flops.is_moe(m):
        # private_api: titan_build_qwen3_moe_layers, titan_build_qwen3_layers
        layers = qwen3._build_qwen3_moe_layers(
            **common, moe_hidden_dim=m.moe_hidden_dim, num_experts=m.num_experts, top_k=m.num_experts_per_token, moe_comm_backend="standard"
        )
    else:
        layers = qwen3._build_qwen3_layers(**common, hidden_dim=m.ffn_hidden_dim)
    return _decoder(m, flavor, layers, qwen3)


def _mla_moe(m: ModelConfig, flavor, family):
    """DeepSeek-V3's blocks (Kimi reuses them with its own initializers): MLA + MoE; num_experts = 0 makes every
    block dense (ffn_hidden_dim), as runner.estimate.flops counts it. Kimi's vision encoder is dropped: the runner
    trains the text tower."""
    _refuse(m, (*GPT_OSS_FIELDS, "qk_norm"), "built from multi-head latent attention and MoE blocks")
    attention = flavor.layers[0].attention
    moe = next(layer.moe for layer in flavor.layers if layer.moe is not None)
    router = moe.router
    # private_api: titan_build_kimi_layers, titan_build_dsv3_layers
    build_layers = family._build_kimi_layers if m.name == "kimi_k2_7" else family._build_dsv3_layers
    layers = build_layers(
        n_layers=m.num_layers,
        n_dense_layers=m.num_dense_layers if flops.is_moe(m) else m.num_layers,
        dim=m.dim,
        n_heads=m.num_heads,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        mscale=attention.mscale,
        dense_hidden_dim=m.ffn_hidden_dim,
        moe_hidden_dim=m.moe_hidden_dim,
        num_experts=m.num_experts,
        num_shared_experts=m.num_shared_experts,
        router_top_k=m.num_experts_per_token,
        router_score_func=router.score_func,
        router_num_expert_groups=router.num_expert_groups,
        router_num_limited_groups=router.num_limited_groups,
        router_route_scale=router.route_scale,
        router_route_norm=router.route_norm,
        attn_backend=ATTN_BACKEND,
        moe_comm_backend="standard",  # the registry's defaults, which model_spec asked for
        non_blocking_capacity_factor=None,
        rope=_rope(attention.rope, m.qk_rope_head_dim, m),
    )
    out = _decoder(m, flavor, layers, family)
    if hasattr(out, "vision_encoder"):
        out.vision_encoder = None
    if m.num_mtp_layers:  # as model_registry(..., num_mtp_layers=D) builds them (deepseek_v3 only: model_rules.mtp)
        # private_api: titan_build_mtp_layers
        out.mtp_layers = family._build_mtp_layers(layers[-1], dim=m.dim, num_mtp_layers=m.num_mtp_layers)
    return out


def _gpt_oss(m: ModelConfig, flavor, gpt_oss):
    """gpt-oss: biased GQA with sinks, a sliding window in all but every full_attention_interval-th block,
    biased routed experts in every block. TorchTitan's layer builder fixes the heads and the window, so each
    block's attention is rebuilt with m's (the builder's own per-layer initializers)."""
    _refuse(m, (*LATENT_ATTENTION_FIELDS, "num_shared_experts", "num_dense_layers", "qk_norm"), "gpt-oss (GQA with sinks, all-MoE)")
    hd = flops.head_dim(m)
    rope = _rope(flavor.layers[0].attention.rope, hd, m)
    # private_api: titan_build_gptoss_layers, titan_make_gptoss_attn_config
    layers = gpt_oss._build_gptoss_layers(
        dim=m.dim,
        n_layers=m.num_layers,
        hidden_dim=m.moe_hidden_dim,
        num_experts=m.num_experts,
        top_k=m.num_experts_per_token,
        load_balance_coeff=flavor.layers[0].moe.load_balance_coeff,
        attn_backend=ATTN_BACKEND,
        fuse_qkv=m.fuse_qkv,
        moe_comm_backend="standard",
        rope=rope,
    )
    for i, layer in enumerate(layers):
        layer.attention = gpt_oss._make_gptoss_attn_config(
            dim=m.dim,
            layer_id=i,
            attn_backend=ATTN_BACKEND,
            n_heads=m.num_heads,
            n_kv_heads=m.num_kv_heads,
            head_dim=hd,
            sliding_window_size=m.sliding_window if _slides(m, i) else None,
            fuse_qkv=m.fuse_qkv,
            rope=rope,
        )
    return _decoder(m, flavor, layers, gpt_oss)


def _slides(m: ModelConfig, i: int) -> bool:
    """Block i attends over the sliding window (gpt-oss: 0, 2, 4, ... with full_attention_interval 2)."""
    return m.sliding_window > 0 and (i + 1) % m.full_attention_interval != 0


def check_size(m: ModelConfig, seq_len: int, num_params: int, flops_per_token: int) -> None:
    """The built model must be the one validation, the plan and MFU describe."""
    want = (flops.num_params(m), flops.flops_per_token(m, seq_len, "titan"))
    if (num_params, flops_per_token) != want:
        raise RuntimeError(
            f"TorchTitan built {m.name} {m.flavor} with {num_params:,} parameters and {flops_per_token:,} FLOPs per token; "
            f"runner.estimate.flops counts {want[0]:,} and {want[1]:,} for the config: the model config is out of date"
        )


FAMILY_BUILDERS = {
    "llama3": _llama3,
    "qwen3": _qwen3,
    "deepseek_v3": _mla_moe,
    "kimi_k2_7": _mla_moe,
    "gpt_oss": _gpt_oss,
}
"""The families whose blocks the runner rebuilds from model.*, each through its own TorchTitan layer builder."""
