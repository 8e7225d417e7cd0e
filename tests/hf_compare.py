"""The runner's TorchTitan model beside transformers' model of an export, shared by tests/test_hf_export.py (tiny
checkpoints saved in one process) and tests/test_checkpoint.py (the multi-rank layouts' checkpoints).

Logit tolerance: 1e-5 of the largest logit (measured: Llama 3 1.8e-7, Qwen3 0, Qwen3 MoE 4e-7, DeepSeek-V3 3e-6).
"""

from __future__ import annotations

import re
from pathlib import Path

LOGITS_RTOL = 1e-5
QK_WEIGHTS, QK_SCALE = r"attention\.(qkv_linear\.w[qk]|wq|wq_b|wkv_a|wkv_b)\.weight$", 8.0
"""Query and key projections (and MLA's latent ones) of the test models, times this."""
LATENT_WEIGHTS, LATENT_SCALE = r"attention\.(wq_a|wkv_a)\.weight$", 30.0
"""MLA's latent projections times this (on top of QK_SCALE): TorchTitan normalizes the q and kv latents with eps 1e-5,
transformers' DeepseekV3 with a fixed 1e-6; at init a latent's mean square is ~1e-2, where that differs by ~1e-4
relative; far above both, it does not show (a trained checkpoint's latents are O(1): ~1e-5)."""


def titan_model(cfg, expert_bias: bool):
    """The TorchTitan model of cfg.model on CPU (SDPA, float32 experts), initialized, norms (and expert biases) moved."""
    import torch

    import runner.run.titan.cpu as cpu
    from runner.run.titan.model import model_spec

    mcfg = model_spec(cfg.model).model
    cpu.use_sdpa(mcfg)
    cpu.use_float32_experts(mcfg)
    with torch.device("meta"):
        model = mcfg.build()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if re.search(QK_WEIGHTS, name):  # sharp attention: at init it is near uniform, and RoPE mistakes vanish in it
                p.mul_(QK_SCALE)
            if re.search(LATENT_WEIGHTS, name):  # MLA's latents far above either norm's eps (see LATENT_SCALE)
                p.mul_(LATENT_SCALE)
        for name, b in model.named_buffers():
            if "expert_bias" in name and expert_bias:
                b.add_(0.01 * torch.randn_like(b))
    return model.eval()


def titan_from_checkpoint(cfg, ckpt: Path):
    """The runner's model of cfg.model in one process, its weights read from the checkpoint `ckpt` (any layout's)."""
    import torch.distributed.checkpoint as dcp

    model = titan_model(cfg, expert_bias=False)
    state = model.state_dict()
    dcp.load({"model": state}, checkpoint_id=str(ckpt), no_dist=True)
    model.load_state_dict(state)
    return model


def load_hf(folder: Path):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def logits_gap(model, hf, tokens) -> tuple[float, float]:
    """(largest |logit difference| between the TorchTitan model and transformers' `hf`, largest |logit|) on `tokens`."""
    import torch

    with torch.no_grad():
        want, got = model(tokens), hf(tokens).logits
    return (got - want).abs().max().item(), want.abs().max().item()


def exported(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out |= load_file(shard)
    return out


def assert_round_trip(model, cfg, folder: Path) -> None:
    """The export holds every weight of `model` bitwise: mapped back through the adapter's from_hf, the exported
    tensors are the model's state (the expert-bias buffer of a model whose HF class has none aside)."""
    import torch

    from runner.run.titan import hf_adapter

    _, adapter = hf_adapter.model_and_adapter(cfg.model)
    back = adapter.from_hf(exported(folder))
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("tokens_per_expert_E")}
    if cfg.model.name == "qwen3":
        state = {k: v for k, v in state.items() if not k.endswith("expert_bias_E")}
    assert sorted(back) == sorted(state)
    assert [k for k in state if not torch.equal(back[k], state[k])] == []
