"""The optimizer and its learning-rate schedule."""

from __future__ import annotations

import torch

from runner.config.schema import RunConfig


def build_optimizer(cfg: RunConfig, parts: list[torch.nn.Module]):
    t = cfg.training
    # fused, TorchTitan's default: foreach's ten kernels each paid DTensor's first sharding propagation (+0.4-0.7 s, update 1)
    params = [p for m in parts for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=t.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=t.weight_decay, fused=True)
    warmup = t.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    return opt, sched
