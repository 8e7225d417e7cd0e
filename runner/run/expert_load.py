"""The step loop's side of the expert-load metrics (runner.observe.moe_load), at no extra host synchronization.

Each step adds this rank's token counts per expert (TorchTitan's `tokens_per_expert_E`) to a window on the device. At a
logged step the window rides on the step's one host read (DevicePolicy.read, beside the loss and grad norm) and on its
one host collective (runner.run.step_sync: each rank adds its counts at its MoE layers' rows of one layers x experts
table), and every rank then holds the job's counts; rank 0 logs them and the hot-expert judge's findings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from runner.formats import runfiles
from runner.observe import moe_load
from runner.run import titan
from runner.schema import RunConfig
from runner.schema.layout import Layout


class Off:
    """A model without routed experts, or monitor.moe_load.enable=false: nothing to read or add."""

    def collect(self, step: int) -> list[torch.Tensor]:
        return []

    def summands(self, step: int, values: list[float]) -> list[float]:
        return []

    def row(self, step: int, totals: list[float]) -> dict[str, Any]:
        return {}


OFF = Off()


class ExpertLoad:
    """The window's counts on the device, the layout of the summed table, and the judge."""

    def __init__(self, cfg: RunConfig, lay: Layout, rank: int, policy, parts: list[torch.nn.Module], run_dir: Path):
        self.cfg, self.lay, self.rank = cfg, lay, rank
        self.blocks = titan.moe_blocks(parts)
        self.local = [i for i, _ in self.blocks]
        self.layers = sorted({i for ids in policy.all_gather_object(self.local) for i in ids})  # every stage's, once
        self.experts = cfg.model.num_experts
        c = lay.coords(rank)
        # the ranks that add their counts, as TorchTitan's pre-hook sums them: over the batch and CP ranks, and over TP
        # only where EP splits the tokens across the TP ranks (else every TP rank counts the same tokens)
        self.adds = c["tp"] == 0 or (lay.ep > 1 and lay.tp > 1)
        self.window: torch.Tensor | None = None
        self.first = self.steps = 0
        self.judge = moe_load.HotExpertJudge(cfg.monitor.moe_load, lay.ep)
        self.path = run_dir / runfiles.MOE_LOAD

    def due(self, step: int) -> bool:
        """The steps logged at logging.log_every (and the last): a window ends there."""
        return step % self.cfg.logging.log_every == 0 or step == self.cfg.training.steps

    def collect(self, step: int) -> list[torch.Tensor]:
        """After the step's backward: add its counts to the window (device ops); at a logged step, the window to read."""
        if self.steps == 0:
            self.first = step
        self.steps += 1
        if not self.blocks:
            return []
        counts = titan.take_counts(self.blocks)
        self.window = counts if self.window is None else self.window + counts
        return [self.window] if self.due(step) else []

    def summands(self, step: int, values: list[float]) -> list[float]:
        """This rank's part of the host all-reduce at a logged step: its window at its layers' rows of the layers x experts
        table, zeros elsewhere (a stage without MoE layers, or a rank whose TP peer counts the same tokens)."""
        if not self.layers or not self.due(step):
            return []
        e, out = self.experts, [0.0] * (len(self.layers) * self.experts)
        if self.adds:
            for k, layer in enumerate(self.local):
                i = self.layers.index(layer)
                out[i * e : (i + 1) * e] = values[k * e : (k + 1) * e]
        return out

    def row(self, step: int, totals: list[float]) -> dict[str, Any]:
        """The job's counts of the window: metrics.jsonl's `moe`, and the judge's findings (`moe_flags`, also printed and
        written to moe_load.jsonl by rank 0)."""
        if not totals:
            return {}
        e = self.experts
        counts = [totals[i * e : (i + 1) * e] for i in range(len(self.layers))]
        steps, first = self.steps, self.first
        self.window, self.steps = None, 0
        found = self.judge.update(first, step, self.layers, counts)
        if found and self.rank == 0:
            moe_load.record(self.path, found)
        return {"moe": moe_load.summarize(self.layers, counts, self.lay.ep, steps)} | ({"moe_flags": found} if found else {})


def of(cfg: RunConfig, lay: Layout, rank: int, policy, parts: list[torch.nn.Module], run_dir: Path) -> ExpertLoad | Off:
    """An MoE model measures its experts' load unless monitor.moe_load.enable is off (every rank decides alike)."""
    if cfg.model.num_experts == 0 or not cfg.monitor.moe_load.enable:
        return OFF
    return ExpertLoad(cfg, lay, rank, policy, parts, run_dir)
