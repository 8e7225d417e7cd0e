"""TorchTitan's model config built from the runner's ModelConfig (runner/config/schema/training.py).

The flavor in TorchTitan's registry gives everything the schema does not name (initializers,
RoPE scaling, router scoring, attention backend); every architecture number the schema names
(dim, layers, heads, FFN and expert sizes, latent-attention ranks, vocabulary, weight tying)
comes from the config, through the family's own layer builders. So `model.dim=512` trains a
model of width 512, and the parameter count and FLOPs that the run reports are the config's.
"""

from __future__ import annotations

import dataclasses
import importlib

from runner.config import flops
from runner.config.schema import ModelConfig

ATTN_BACKEND = "flex"
"""The attention backend asked of the registry and its builders (TorchTitan's default); on CPU the
inner attention is swapped for SDPA afterwards (runner.run.titan.cpu.use_sdpa)."""

DENSE_ONLY_FIELDS = ("num_experts", "num_experts_per_token", "num_shared_experts", "moe_hidden_dim", "num_dense_layers")
LATENT_ATTENTION_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def model_spec(m: ModelConfig):
    """TorchTitan's ModelSpec for the family and flavor, its model config rebuilt with m's architecture."""
    family = importlib.import_module(f"torchtitan.models.{m.name}")
    spec = family.model_registry(m.flavor, attn_backend=ATTN_BACKEND)
    build = {"llama3": _llama3, "deepseek_v3": _deepseek_v3}[m.name]
    spec.model = build(m, spec.model)
    return spec


def _decoder(m: ModelConfig, flavor, layers: list, family) -> object:
    """The flavor's top-level config with m's width, vocabulary, tying and blocks (initializers kept)."""
    return dataclasses.replace(
        flavor,
        dim=m.dim,
        vocab_size=m.vocab_size,
        enable_weight_tying=m.weight_tying,
        tok_embeddings=dataclasses.replace(flavor.tok_embeddings, num_embeddings=m.vocab_size, embedding_dim=m.dim),
        norm=dataclasses.replace(flavor.norm, normalized_shape=m.dim),
        lm_head=dataclasses.replace(
            flavor.lm_head, in_features=m.dim, out_features=m.vocab_size, param_init=family._output_linear_init(m.dim)
        ),
        layers=layers,
    )


def _llama3(m: ModelConfig, flavor):
    from torchtitan.models import llama3

    set_fields = [f"model.{f} = {getattr(m, f)}" for f in (*DENSE_ONLY_FIELDS, *LATENT_ATTENTION_FIELDS) if getattr(m, f)]
    if set_fields:
        raise ValueError(f"TorchTitan's llama3 is a dense model with grouped-query attention; it has no {', '.join(set_fields)}")
    attention = flavor.layers[0].attention
    layers = llama3._build_llama3_layers(
        n_layers=m.num_layers,
        dim=m.dim,
        n_heads=m.num_heads,
        n_kv_heads=None if m.num_kv_heads == m.num_heads else m.num_kv_heads,  # as the registry writes a model without GQA
        hidden_dim=m.ffn_hidden_dim,
        rope=dataclasses.replace(attention.rope, dim=m.dim // m.num_heads),
        fuse_qkv=hasattr(attention, "qkv_linear"),
        attn_backend=ATTN_BACKEND,
    )
    return _decoder(m, flavor, layers, llama3)


def _deepseek_v3(m: ModelConfig, flavor):
    """MLA + MoE blocks; num_experts = 0 makes every block dense (ffn_hidden_dim), as runner.config.flops counts it."""
    from torchtitan.models import deepseek_v3

    attention = flavor.layers[0].attention
    moe = next(layer.moe for layer in flavor.layers if layer.moe is not None)
    router = moe.router
    layers = deepseek_v3._build_dsv3_layers(
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
        rope=dataclasses.replace(attention.rope, dim=m.qk_rope_head_dim),
    )
    out = _decoder(m, flavor, layers, deepseek_v3)
    out.mtp_layers = deepseek_v3._build_mtp_layers(layers[-1], dim=m.dim, num_mtp_layers=len(flavor.mtp_layers))
    return out


def check_size(m: ModelConfig, seq_len: int, num_params: int, flops_per_token: int) -> None:
    """The built model must be the one validation, the plan and MFU describe."""
    want = (flops.num_params(m), flops.flops_per_token(m, seq_len, "titan"))
    if (num_params, flops_per_token) != want:
        raise RuntimeError(
            f"TorchTitan built {m.name} {m.flavor} with {num_params:,} parameters and {flops_per_token:,} FLOPs per token; "
            f"runner.config.flops counts {want[0]:,} and {want[1]:,} for the config: the model config is out of date"
        )
