"""One recompute per weight pass of a split backward under activation checkpointing.

Schedules that split a stage's backward (ZBVZeroBubble, DualPipeV, InterleavedZeroBubble) run its weight half later
through torch's `stage_backward_weight`, which calls autograd once per parameter group. Each call is a graph task of
its own, and non-reentrant activation checkpointing recomputes a checkpointed block once per graph task: an MoE block
of DeepSeek-V3 has 16 parameter groups, so its weight half ran 16 forwards of the block and kept what each left
unread until the pass ended (the CUDA rehearsal of the DeepSeek-V3 DualPipeV layout's V bottom measured 152 GB; 98.8 GB
with one recompute per pass).
torch's `torch.utils.checkpoint.GraphExecGroup` makes every autograd call under one instance share one recompute
(its docstring: backward calls over non-overlapping regions of the graph, as one weight pass's groups are); the
runner runs each stage's weight pass inside one. The gradients are the same: the recompute is deterministic."""

from __future__ import annotations

import functools

from torch.utils.checkpoint import GraphExecGroup

from runner.run.titan.step import pipeline_stages
from runner.schema import ActivationCheckpoint, RunConfig


def recompute_once(cfg: RunConfig, schedule) -> int:
    """Wrap each of this rank's pipeline stages' `backward_weight_one_chunk` in a GraphExecGroup when blocks are
    checkpointed; the number of stages wrapped (0 without a schedule or without AC)."""
    if schedule is None or cfg.training.activation_checkpoint == ActivationCheckpoint.none:
        return 0
    stages = pipeline_stages(schedule)
    for stage in stages:  # private_api: torch_stage_weight_pass
        stage.backward_weight_one_chunk = _grouped(stage.backward_weight_one_chunk)
    return len(stages)


def _grouped(weight_pass):
    @functools.wraps(weight_pass)
    def run(*args, **kwargs):
        with GraphExecGroup():
            return weight_pass(*args, **kwargs)

    return run
