"""TEST-ONLY fault injection (`monitor.inject`): every fault a test plants in a run, in one place.

The tests prove the monitors on faults they plant: a rank killed as a lost node is (SIGKILL), one that hangs before a
collective, a slower device, a corrupted batch, a transient arithmetic fault, a non-reproducible replay, a flipped bit
in a parameter, a lasting shift of the gradient norm, a node-local checkpoint tier partly destroyed before a restart.
`Faults` is one rank's set; the step loop and its observers call it where each fault strikes, and with the schema's
defaults (every switch off) each call changes nothing. Nothing here is for a real run. Torch-free at import, as
runner.observe.monitor is.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from runner.formats import local_checkpoint
from runner.schema import InjectConfig

if TYPE_CHECKING:
    import torch


class Faults:
    """One rank's planted faults (monitor.inject). `clock`: the monitor's phase clock, which the slowed forward's busy
    loop measures its forward on."""

    def __init__(self, c: InjectConfig, rank: int, clock=None):
        self.c, self.rank, self.clock = c, rank, clock
        self.step = 0
        self.replaying = False  # set by the replay check (runner.observe.integrity) while it recomputes a step
        self.attributing = False  # set while a flagged step is replayed (runner.observe.attribution)
        self._fault = "due"  # the transient compute fault: due | fired (this step) | done
        self._hung = self._flipped = False
        self._t0 = 0.0

    def begin_step(self, step: int) -> None:
        """At the start of a step: kill_rank dies at kill_at_step, as a lost node does (SIGKILL: no handler, no cleanup),
        first attempt only; the rank's log says when (the time the goodput's lost work is checked against)."""
        self.step = step
        self._fault = "done" if self._fault == "fired" else self._fault
        c = self.c
        if self.rank == c.kill_rank and step == c.kill_at_step and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            print(f"inject: SIGKILL rank {self.rank} at step {step}, time {time.time():.6f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def before_forward(self) -> None:
        """hang_rank sleeps at the start of a forward at hang_at_step, before its first collective, so peers wait;
        delay_rank's forward starts being measured for after_forward."""
        c = self.c
        if self.rank == c.hang_rank and self.step == c.hang_at_step and not self._hung:
            self._hung = True
            time.sleep(c.hang_s)
        if self.rank == c.delay_rank and c.delay_frac > 0:
            self._t0 = self.clock.now()

    def after_forward(self) -> None:
        """delay_rank's forward computes delay_frac longer, as a slower device would (busy, not sleeping)."""
        if self.rank == self.c.delay_rank and self.c.delay_frac > 0:
            end = self.clock.now() + self.c.delay_frac * (self.clock.now() - self._t0)
            while self.clock.now() < end:
                pass

    def corrupt(self, loss):
        """A corrupted batch's loss is multiplied by corrupt_scale on every rank; replay_rank's replayed forward is off by
        a relative 1e-6, as a device that does not compute reproducibly would be; fault_rank's loss at fault_at_step is
        multiplied by corrupt_scale on the first pass only (not in its attribution replay, nor when the step runs again
        after a rewind), as a transient arithmetic fault of one device would be."""
        c = self.c
        if self.replaying and self.rank == c.replay_rank:
            loss = loss * (1 + 1e-6)
        if self.rank == c.fault_rank and self.step == c.fault_at_step and not self.attributing and self._fault != "done":
            self._fault = "fired"
            loss = loss * c.corrupt_scale
        return loss * c.corrupt_scale if self.step in c.corrupt_steps else loss

    def flip(self, step: int, parts: list[torch.nn.Module]) -> None:
        """flip_rank flips bit 22 (a float32 mantissa's top bit) of its first parameter's first element at flip_at_step,
        once (a rewind replays the step without flipping again), as silent data corruption would."""
        if self.rank == self.c.flip_rank and step == self.c.flip_at_step and not self._flipped:
            import torch

            from runner.observe.integrity import INT_OF_WIDTH, local_shard

            self._flipped = True
            with torch.no_grad():
                t = local_shard(next(parts[0].parameters()))
                flat = t.view(INT_OF_WIDTH[t.element_size()]).view(-1)
                flat[0] ^= 1 << min(22, 8 * t.element_size() - 2)

    def shifted(self, step: int, grad_norm: float) -> float:
        """The grad norm the loss guard judges: times norm_shift_scale from norm_shift_step on (a lasting level shift)."""
        c = self.c
        return grad_norm * c.norm_shift_scale if c.norm_shift_step and step >= c.norm_shift_step else grad_norm


def loses_local(c: InjectConfig) -> bool:
    """Whether a restart destroys part of the local tier before reading it (lose_local)."""
    return bool(c.lose_local)


def lose_local(c: InjectConfig, root_of: Callable[[str], Path]) -> str:
    """monitor.inject.lose_local: destroy part of the local tier before a restart reads it, as a lost node, a lost shard
    or a flipped byte would. `root_of(node)`: that node's local root (nodes: monitor.inject.node_names). Returns what was
    done, in words."""
    what, _, arg = c.lose_local.partition(":")
    if what == "node":
        shutil.rmtree(root_of(arg), ignore_errors=True)
        return f"deleted node {arg}'s local folder {root_of(arg)}"
    rank = int(arg)
    own_root = root_of(c.node_names[rank])
    step = local_checkpoint.newest_step(own_root)
    copies = [p for n in sorted(set(c.node_names)) if (p := local_checkpoint.shard_path(root_of(n), step, rank)).is_dir()]
    if what == "shard":
        for p in copies:
            shutil.rmtree(p)
        return f"deleted {len(copies)} copies of rank {rank}'s step-{step} local shard"
    own = local_checkpoint.shard_path(own_root, step, rank)
    target = own / next(n for n in sorted(os.listdir(own)) if n.endswith(".distcp"))
    with open(target, "r+b") as f:
        f.seek(target.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    return f"flipped a byte of {target}"
