"""The step loop's device handling, in-process: what it hands the model and the pipeline schedule."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import torch

from runner.run import train
from runner.run.loader import Prefetch, SyntheticData


def test_microbatches_reach_the_model_on_the_policys_compute_device(monkeypatch):
    """The data streams make CPU tensors; on CUDA the model and the loss need them on the GPU (labels too, which
    FSDP's forward would not move). A policy whose compute device is `meta` shows where they go."""
    seen = []
    monkeypatch.setattr(train, "forward_backward", lambda built, loss_fn, mbs, tokens, mon: seen.extend(mbs) or torch.zeros(()))
    monkeypatch.setattr(train.titan, "clip_grad_norm", lambda parts, max_norm, pd: 0.0)
    data = SyntheticData(seed=0, seq_len=8, vocab=64, global_batch=4, microbatch=2, dp_rank=0, dp=1)
    loop = SimpleNamespace(
        data=data,
        feed=Prefetch(data),
        integrity=SimpleNamespace(replay_due=lambda step: False),
        policy=SimpleNamespace(compute_device=lambda: torch.device("meta")),
        built=SimpleNamespace(schedule=None, parts=[], parallel_dims=None),
        mon=SimpleNamespace(phase=lambda name: nullcontext()),
        hooks=train.Hooks(),
        cfg=SimpleNamespace(training=SimpleNamespace(max_norm=1.0)),
        loss_fn=None,
        global_tokens=torch.tensor(32.0),
    )
    train._train_step(loop, 1)
    assert len(seen) == 2 and all(t.device.type == "meta" for mb in seen for t in mb)
    assert [tuple(t.shape) for t in seen[0]] == [(2, 8), (2, 8)]
