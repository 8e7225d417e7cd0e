"""The step's one host collective: the global loss, the data digest and SLURM's stop flag in one all-reduce.

Each of them used to be a collective of its own every step (a loss all-reduce, an all-gather of the sample positions, a
MAX all-reduce of the flag, a barrier stamped for the arrival judge), with the device drained. Now each rank sums its
part into one small float64 tensor on the host group; the arrival judge reads the stamps taken around it
(StepMonitor.phase("loss")).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runner.run import loader
from runner.schema.layout import Layout


@dataclass
class Shared:
    """What every rank knows alike after the exchange."""

    loss: float
    """The global loss: the sum of the ranks' shares (the mean token loss)."""
    data_hash: str
    """The data digest of every sample the job read this step (runner.run.loader.digest_text)."""
    stop: bool
    """Some rank has SLURM's warning signal: every rank stops after this step (runner.run.preempt)."""
    extra: list[float]
    """The sums of the ranks' extra summands (at logged steps of an MoE model: the experts' token counts,
    runner.run.expert_load); empty without them."""


def parts(lay: Layout, rank: int, loss_share: float, lanes: tuple[float, float], stop: bool) -> list[float]:
    """This rank's summands. Ranks of a TP group hold the same loss share and read the same samples, as do the CP ranks
    and pipeline stages of a data-parallel rank: only its first rank adds them (non-last stages hold a zero share)."""
    c = lay.coords(rank)
    first = c["tp"] == 0 and c["cp"] == 0 and c["pp"] == 0
    loss = loss_share if c["tp"] == 0 else 0.0
    return [loss, *(lanes if first else (0.0, 0.0)), 1.0 if stop else 0.0]


def exchange(policy, lay: Layout, rank: int, loss_share: float, lanes: tuple[float, float], stop: bool, extra: list[float] = ()) -> Shared:
    """One SUM all-reduce on the host group; every rank returns the same Shared. `extra`: summands every rank adds as
    they are, the same number on every rank."""
    total = policy.all_reduce(torch.tensor(parts(lay, rank, loss_share, lanes, stop) + list(extra), dtype=torch.float64))
    loss, lane0, lane1, stops, *sums = total.tolist()  # a host tensor: reading it waits for no device
    return Shared(loss, loader.digest_text((lane0, lane1)), stops > 0, sums)
