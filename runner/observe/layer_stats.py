"""Per-block statistics where a spike started: at logged steps and on every step the loss guard flags.

Per transformer block (the model's `layers`, keyed by the block's index in every pipeline stage): the gradient norm
(before the clip), the largest absolute value of the block's output activation and of its weights, and a non-finite
count: the block's tensors holding a non-finite value (its output, once per microbatch, and each parameter's gradient and
weight), read off their norms and maxima: per-element counts would cost a pass of their own over each. Gathered on
the device and read once, with the step's own host read (DevicePolicy.read):
forward hooks keep a running max and count of each block's output while the step is armed; after the backward each
rank reduces its shards into one (blocks x 2) table of sums and one of maxima, and two device all-reduces over the world
make them the job's. No host synchronization per block, none at all outside armed steps.

Ranks hold copies of a shard (a DTensor replicated over some mesh dims, the ranks of a stage outside its mesh, DDP's
replicas): each rank divides its squared gradient norms and counts by the number of copies, so the sum over ranks counts
every element once. A flagged step's statistics come from its attribution replay (runner.observe.attribution), and the
verdict line names the block whose gradient norm rose most against its running median over accepted logged steps.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

FIELDS = ("grad_norm", "act_max", "weight_max", "nonfinite")
"""metrics.jsonl's `layers`: one list per field, one value per block (block b at index b)."""
WINDOW = 20
"""Accepted logged steps in each block's running median of its gradient norm."""


def copies(ranks_per_stage: int, mesh_size: int, replicated: int) -> int:
    """How many ranks hold the same local shard: the ranks of the stage outside the tensor's mesh times the size of the
    mesh dims it is replicated over (a plain tensor: mesh_size 1, every rank of its stage)."""
    return ranks_per_stage // mesh_size * replicated


def _replicated(t: torch.Tensor) -> int:
    """How many ranks of a DTensor's mesh hold the same shard of it (1 for a plain tensor)."""
    if not isinstance(t, DTensor):
        return 1
    return math.prod(t.device_mesh.size(d) for d, pl in enumerate(t.placements) if pl.is_replicate())


def _copies_of(p: torch.Tensor, ranks_per_stage: int) -> int:
    if not isinstance(p, DTensor):
        return ranks_per_stage
    return copies(ranks_per_stage, p.device_mesh.size(), _replicated(p))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class LayerStats:
    """Forward hooks on this rank's blocks, and the step's per-block table on the device."""

    def __init__(self, parts: list[torch.nn.Module], num_blocks: int, ranks_per_stage: int, device: torch.device):
        self.n, self.device = num_blocks, device
        self.blocks = [(int(k), b) for part in parts for k, b in getattr(part, "layers", {}).items()]
        # every block's parameters, flat; a rank's empty shard (FSDP's uneven split) holds nothing to measure
        self.params = [(p, i) for i, b in self.blocks for p in b.parameters() if _local(p).numel()]
        self.block_of = torch.tensor([i for _, i in self.params], dtype=torch.int64, device=device)
        self.inv = torch.tensor([1 / _copies_of(p, ranks_per_stage) for p, _ in self.params], device=device)
        self.armed = False
        self.act: torch.Tensor | None = None  # (blocks, 2): max |output|, non-finite outputs / copies
        self.pending: list[torch.Tensor] = []  # the reduced table, read with the step's host read
        self.medians: list[deque[float]] = [deque(maxlen=WINDOW) for _ in range(num_blocks)]
        self.handles = [b.register_forward_hook(self._hook(i)) for i, b in self.blocks]

    def arm(self, on: bool) -> None:
        """Collect this step (a logged step, or a flagged step's replay); off: the hooks return at once."""
        self.armed, self.pending = on, []

    def begin(self) -> None:
        """A forward/backward starts (a replay check or an attribution runs a second): its own maxima and counts."""
        if self.armed:
            self.act = torch.zeros(self.n, 2, dtype=torch.float32, device=self.device)

    def _hook(self, i: int):
        def hook(module, args, out):
            if not self.armed or self.act is None or not isinstance(out, torch.Tensor):
                return
            x = _local(out).detach()
            if not x.numel():
                return
            peak = torch.linalg.vector_norm(x, math.inf).float()  # max |x| in one pass, no copy of |x|
            bad = ~torch.isfinite(peak)  # the output holds a non-finite value: counted off its max, no pass of its own
            self.act[i, 0] = torch.maximum(self.act[i, 0], torch.nan_to_num(peak, nan=math.inf))
            self.act[i, 1] += bad / _replicated(out)  # an output replicated over TP is counted once

        return hook

    def gather(self) -> None:
        """After the backward, before the clip: this rank's shards into the job's table (two device all-reduces)."""
        if not self.armed:
            return
        if self.act is None:  # no forward ran here (a stage without blocks): every rank joins the all-reduces
            self.begin()
        sums = torch.zeros(self.n, 2, dtype=torch.float32, device=self.act.device)
        maxes = torch.zeros(self.n, 2, dtype=torch.float32, device=self.act.device)
        maxes[:, 0], sums[:, 1] = self.act[:, 0], self.act[:, 1]
        if self.params:
            self._shards(sums, maxes)
        dist.all_reduce(sums)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        self.pending = [torch.cat([sums[:, 0].sqrt(), maxes[:, 0], maxes[:, 1], sums[:, 1]])]

    def remove(self) -> None:
        """The run ends: its hooks leave the model (a model built once may train again, as the tests' do)."""
        for h in self.handles:
            h.remove()

    def _shards(self, sums: torch.Tensor, maxes: torch.Tensor) -> None:
        """This rank's shards into the tables: one pass over the gradients (their norms) and one over the weights (max |w|),
        each a single foreach call over every block. A tensor holding a non-finite value has a non-finite norm, so such
        tensors are counted from the norms without a pass of their own."""
        # private_api: torch_foreach_norm
        peaks = torch.stack(torch._foreach_norm([_local(p.detach()) for p, _ in self.params], math.inf)).float()
        sums[:, 1].index_add_(0, self.block_of, (~torch.isfinite(peaks)) * self.inv)
        maxes[:, 1].scatter_reduce_(0, self.block_of, torch.nan_to_num(peaks, nan=math.inf), "amax")
        held = [k for k, (p, _) in enumerate(self.params) if p.grad is not None]
        if not held:
            return
        norms = torch.stack(torch._foreach_norm([_local(self.params[k][0].grad) for k in held])).float()
        at = self.block_of if len(held) == len(self.params) else self.block_of[held]
        inv = self.inv if len(held) == len(self.params) else self.inv[held]
        sums[:, 0].index_add_(0, at, norms.square() * inv)
        sums[:, 1].index_add_(0, at, (~torch.isfinite(norms)) * inv)

    def take(self) -> list[torch.Tensor]:
        """The table to read with the step's host read (empty when the step was not armed); disarms."""
        out, self.pending, self.armed, self.act = self.pending, [], False, None
        return out

    def row(self, values: list[float]) -> dict[str, Any]:
        """metrics.jsonl's `layers` from the read table: 4 significant digits, counts as integers."""
        n = self.n
        cols = [values[k * n : (k + 1) * n] for k in range(len(FIELDS))]
        out = {f: [float(f"{v:.4g}") for v in col] for f, col in zip(FIELDS[:-1], cols, strict=False)}
        return out | {"nonfinite": [round(v) for v in cols[-1]]}

    def accept(self, layers: dict[str, Any]) -> None:
        """An accepted step's gradient norms join each block's running median."""
        for median, v in zip(self.medians, layers["grad_norm"], strict=True):
            if math.isfinite(v):
                median.append(v)

    def blame(self, layers: dict[str, Any]) -> dict[str, Any]:
        """The block where a flagged step started (runner.observe.attribution's line): the first block whose output holds a
        non-finite value; else the block whose gradient norm rose most against its running median (a non-finite norm
        counts as the largest rise; ties go to the later block, where the backward starts)."""
        bad = [i for i, v in enumerate(layers["act_max"]) if not math.isfinite(v)]
        if bad:
            return {"block": bad[0], "why": "output", "nonfinite": layers["nonfinite"][bad[0]]}
        rises = []
        for i, v in enumerate(layers["grad_norm"]):
            m = statistics.median(self.medians[i]) if self.medians[i] else math.nan
            rises.append((math.inf if not math.isfinite(v) else v / m if m > 0 else math.nan, i))
        known = [(r, i) for r, i in rises if not math.isnan(r)]
        if not known:
            i = max(range(self.n), key=lambda b: (layers["grad_norm"][b], b))
            return {"block": i, "why": "largest", "grad_norm": layers["grad_norm"][i]}
        rise, i = max(known)
        return {"block": i, "why": "rise", "grad_norm": layers["grad_norm"][i], "rise": rise}


def describe(b: dict[str, Any]) -> str:
    """The verdict line's words for `LayerStats.blame`."""
    if b["why"] == "output":
        return f"block {b['block']}'s output is the first non-finite ({b['nonfinite']} non-finite tensors)"
    if b["why"] == "largest":
        return f"block {b['block']} has the largest gradient norm ({b['grad_norm']:.4g}; no running median yet)"
    if not math.isfinite(b["rise"]):
        return f"block {b['block']}'s gradient norm is non-finite"
    return f"block {b['block']}'s gradient norm rose most: {b['grad_norm']:.4g}, {b['rise']:.3g} x its running median"


def wandb_keys(layers: dict[str, Any]) -> dict[str, float]:
    """Flat W&B keys: layers/block<b>_<field>."""
    return {f"layers/block{b}_{f}": v for f in FIELDS for b, v in enumerate(layers[f])}


class Off:
    """monitor.layer_stats=false, or a model without `layers`: nothing armed, nothing read."""

    n = 0

    def arm(self, on: bool) -> None:
        pass

    def begin(self) -> None:
        pass

    def gather(self) -> None:
        pass

    def take(self) -> list[torch.Tensor]:
        return []

    def remove(self) -> None:
        pass


OFF = Off()


def of(cfg, lay, parts: list[torch.nn.Module], device: torch.device) -> LayerStats | Off:
    """From the config alone, so every rank decides alike (a stage without blocks still joins the all-reduces)."""
    if not cfg.monitor.layer_stats:
        return OFF
    return LayerStats(parts, cfg.model.num_layers, lay.world_size // lay.pp, device)
