"""Tiny random `transformers` models of the families that train on CPU, saved with save_pretrained, and the runner
overrides that describe the same architecture (issue 29: start from and export to Hugging Face, no download).

Each TINY entry is (runner overrides, the transformers config class and its arguments). The numbers follow the runner's
debug flavors (conf/model/), cut where the parity tests cut them (tests/test_family_train.py: 2 blocks, 8 experts);
every RoPE, norm and router setting is the one TorchTitan's flavor uses, so the two forwards are the same function:

- llama3: the debug model's dims (dim 256, 6 blocks, 16 heads, SwiGLU 768, vocab 2048), RoPE theta 500000 with
  Llama 3.1's frequency scaling (factor 8, low 1, high 4, original 8192), RMSNorm eps 1e-5;
- llama3_gqa: the same with 4 KV heads (grouped-query attention);
- qwen3: Qwen3's debug model in 2 blocks (16 heads / 8 KV of 128, q/k RMSNorms, tied embeddings, theta 1e6, eps 1e-6);
- qwen3_moe: Qwen3 MoE's debug model in 2 blocks with 8 experts of 768, top-2, softmax router with normalized weights;
- deepseek_v3: latent attention (kv rank 512, direct q) with 2 shared experts and 16 routed experts of 256, top-4 of 8
  groups limited to 4, sigmoid scores with the correction bias, route scale 2.5 (TorchTitan's 671B router:
  transformers' DeepseekV3 has only the sigmoid router); YaRN RoPE factor 40 on 4096 positions (163840), theta 10000.

The weights are transformers' own initialization (seeded), with every norm weight and router bias moved off its
constant start so a swapped or dropped norm shows in the loss.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from runner.formats.hf_folder import CONFIG, INDEX

LLAMA3 = ["model=llama3_debugmodel"]
QWEN3 = ["model=qwen3_debugmodel", "model.num_layers=2"]
QWEN3_MOE = ["model=qwen3_debugmodel_moe", "model.num_layers=2", "model.num_experts=8", "model.num_experts_per_token=2"]
DEEPSEEK_V3 = ["model=deepseek_v3_debugmodel", "model.flavor=671B", "model.num_layers=2", "model.num_experts=16"]
DEEPSEEK_V3 += ["model.num_experts_per_token=4"]

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA3_ROPE["original_max_position_embeddings"] = 8192
_LLAMA3 = dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=16, intermediate_size=768, vocab_size=2048)
_LLAMA3 |= dict(rms_norm_eps=1e-5, max_position_embeddings=131072, rope_parameters=_LLAMA3_ROPE, tie_word_embeddings=False)
_QWEN3 = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=2048)
_QWEN3 |= dict(rms_norm_eps=1e-6, max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
_DSV3_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096}
_DSV3_ROPE |= {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
_DSV3 = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=16, vocab_size=2048)
_DSV3 |= dict(intermediate_size=1024, moe_intermediate_size=256, n_shared_experts=2, n_routed_experts=16, num_experts_per_tok=4)
_DSV3 |= dict(n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, num_mtp_layers=0)
_DSV3 |= dict(kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rms_norm_eps=1e-5)
_DSV3 |= dict(max_position_embeddings=163840, rope_parameters=_DSV3_ROPE, rope_interleave=True, tie_word_embeddings=False)

TINY: dict[str, tuple[list[str], str, dict]] = {
    "llama3": (LLAMA3, "LlamaConfig", _LLAMA3 | dict(num_key_value_heads=16)),
    "llama3_gqa": ([*LLAMA3, "model.num_kv_heads=4"], "LlamaConfig", _LLAMA3 | dict(num_key_value_heads=4)),
    "qwen3": (QWEN3, "Qwen3Config", _QWEN3 | dict(intermediate_size=3072, tie_word_embeddings=True)),
    "qwen3_moe": (
        QWEN3_MOE,
        "Qwen3MoeConfig",
        _QWEN3 | dict(moe_intermediate_size=768, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False),
    ),
    "deepseek_v3": (DEEPSEEK_V3, "DeepseekV3Config", _DSV3),
}
"""name -> (runner overrides, transformers config class, its arguments)."""

MOE = ("qwen3_moe", "deepseek_v3")
ROUTER_SCALE = 50.0
"""Router weights times this: transformers' init (std 0.02) puts every sigmoid score within 1e-3 of 0.5, so a rounding
difference between two correct forwards could flip a top-k choice."""
KV_LATENT_SCALE = 30.0
"""The latent rows of kv_a_proj times this: TorchTitan's MLA normalizes the KV latent with eps 1e-5, transformers'
DeepseekV3 with a fixed 1e-6; at init the latent's mean square is ~0.1, where that differs by ~5e-5 relative, and
at ~90 by ~5e-8 (a real checkpoint's latent is O(1): ~5e-6)."""


def hf_config(name: str):
    """The transformers config of TINY[name] (fp32, eager attention, no dropout)."""
    import transformers

    _, cls, kwargs = TINY[name]
    config = getattr(transformers, cls)(**kwargs, attention_dropout=0.0, torch_dtype="float32")
    config._attn_implementation = "eager"
    return config


def build(name: str, seed: int = 0):
    """A random transformers model of TINY[name] (the class AutoModelForCausalLM picks), in eval mode."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name), dtype=torch.float32)
    with torch.no_grad():
        for key, t in model.named_parameters():
            if "norm" in key:  # RMSNorm weights start at 1: move them so a swapped or lost norm changes the loss
                t.add_(0.1 * torch.randn_like(t))
            if key.endswith("mlp.gate.weight"):  # scores far apart: a 1e-7 rounding difference never flips a routing choice
                t.mul_(ROUTER_SCALE)
            if key.endswith("kv_a_proj_with_mqa.weight"):  # the latent's RMS far above either norm eps (see KV_LATENT_SCALE)
                t[: hf_config(name).kv_lora_rank].mul_(KV_LATENT_SCALE)
        for key, t in model.named_buffers():
            if key.endswith("e_score_correction_bias"):
                t.copy_(0.01 * torch.randn_like(t))
    return model.eval()


def save(name: str, folder: Path, seed: int = 0, max_shard_size: str | None = None) -> Path:
    """save_pretrained a random TINY[name] into folder (safetensors; sharded with an index when max_shard_size is
    given, e.g. "2MB"); returns the folder."""
    model = build(name, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return Path(folder)


def overrides(name: str, folder: Path | None = None) -> list[str]:
    """The runner overrides of TINY[name]'s architecture; with a folder, also the ones that start from it."""
    out = list(TINY[name][0])
    return [*out, f"model.init_from={folder}", "model.init_format=hf"] if folder is not None else out


def hf_loss(model, tokens, labels) -> float:
    """transformers' mean next-token cross-entropy of `model` on `tokens` [batch, seq] against `labels` [batch, seq]
    (the runner's labels: the inputs shifted by one, every position counted), in float64 from fp32 logits."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), labels.flatten()))


PUBLISHED = {  # meta-llama/Llama-3.1-8B and -70B config.json
    "8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
    "70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8),
}


def published_llama(folder: Path, size: str) -> Path:
    """config.json of Llama 3.1 `size` from transformers' LlamaConfig with the published values, a 4-shard index and
    its shards as safetensors headers of no tensor (the weights are not written: validation reads the headers only)."""
    import transformers

    config = transformers.LlamaConfig(
        **PUBLISHED[size], vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_parameters=_LLAMA3_ROPE
    )
    config.architectures, config.torch_dtype = ["LlamaForCausalLM"], "bfloat16"
    folder.mkdir(parents=True)
    config.to_json_file(folder / CONFIG)
    shards = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    weight_map = {"model.embed_tokens.weight": shards[0], "lm_head.weight": shards[3]}
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": 16060522496}, "weight_map": weight_map}))
    for name in shards:
        (folder / name).write_bytes(struct.pack("<Q", 2) + b"{}")
    return folder
