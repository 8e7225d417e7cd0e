"""How long this rank waits inside the runtime's collectives, so that stragglers are judged on each rank's own work.

Inside a step the TP and FSDP collectives keep the ranks in lockstep: a rank slowed from outside (stopped, descheduled,
a noisy neighbour) makes every peer's step as long as its own, and the peers' extra time is spent waiting in a
collective. A rank's own work is its step on the policy's timeline clock (wall clock on CPU, CUDA events on CUDA) less
those waits: the slowed rank's grows, the others' does not (NVRx scores kernels' own time for the same reason).

Two kinds of waits are timed, the two ways the runtime's collectives are waited for, each by wrapping one Python
function while a step runs, on the thread that runs the step (a checkpoint's background writer is not the step's):
- functional collectives (DTensor's TP redistributes, TorchTitan's loss reductions): `wait_tensor` of
  `torch.distributed._functional_collectives`, through which an AsyncCollectiveTensor is waited for, both when it is
  waited explicitly and when another op first reads it. Wrapping the one function costs nothing on the step's other
  ops (a TorchDispatchMode, the first way this was done, ran Python on every op: 5 % of the default CPU run's step);
- c10d collectives (FSDP2's all-gathers and reduce-scatters, the runner's host collectives): `Work.wait`.
On gloo the flight recorder's entries carry no durations, so it cannot be the source. Inside compiled regions the waits
are the compiled code's, not seen here: with `training.compile` the functional waits are not timed (a wrapper would
break Dynamo's graphs), the c10d waits still are.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol  # private_api: torch_funcol, torch_funcol_wait_tensor

_WORK = torch._C._distributed_c10d.Work  # private_api: torch_work_wait


class Waits:
    """Collects one step's waits on `clock` (DevicePolicy.timeline_clock); `take()` resolves and resets them."""

    def __init__(self, clock, functional: bool = True):
        self.clock, self.functional = clock, functional
        self.pending: list[Any] = []
        self._thread = threading.get_ident()
        self._originals: list[tuple[Any, str, Any]] = []

    def timed(self, fn, *args, **kwargs):
        started = self.clock.start()
        try:
            return fn(*args, **kwargs)
        finally:
            self.pending.append(self.clock.stop(started))

    def _wrap(self, owner, name: str) -> None:
        original, waits = getattr(owner, name), self

        def wrapper(*args, **kwargs):
            if threading.get_ident() != waits._thread:
                return original(*args, **kwargs)
            return waits.timed(original, *args, **kwargs)

        self._originals.append((owner, name, original))
        setattr(owner, name, wrapper)

    def start(self) -> None:
        """Begin timing a step's waits (the step loop's begin_step)."""
        self.pending = []
        if self._originals:  # still timing (a step that raised before its end): keep the one set of wrappers
            return
        self._wrap(_WORK, "wait")
        if self.functional:
            self._wrap(funcol, "wait_tensor")

    def stop(self) -> None:
        while self._originals:
            owner, name, original = self._originals.pop()
            setattr(owner, name, original)

    def take(self) -> float:
        """Seconds waited since start (events resolved: call it after the step's host synchronization)."""
        total = sum(self.clock.resolve(v) for v in self.pending)
        self.pending = []
        return total
