"""How long this rank waits inside the runtime's collectives, so that stragglers are judged on each rank's own work.

Inside a step the TP and FSDP collectives keep the ranks in lockstep: a rank slowed from outside (stopped, descheduled,
a noisy neighbour) makes every peer's step as long as its own, and the peers' extra time is spent waiting in a
collective. A rank's own work is its step on the policy's timeline clock (wall clock on CPU, CUDA events on CUDA) less
those waits: the slowed rank's grows, the others' does not (NVRx scores kernels' own time for the same reason).

Two kinds of waits are timed, the two ways the runtime's collectives are waited for:
- functional collectives (DTensor's TP redistributes, async TP): `_c10d_functional.wait_tensor`, seen by a
  TorchDispatchMode. Ops on DTensors and AsyncCollectiveTensors are handed to the subclass with the mode still active
  (`NotImplemented`), so the waits their handlers issue are seen too;
- c10d collectives (FSDP2's all-gathers and reduce-scatters, the runner's host collectives): `Work.wait`, wrapped while
  a step runs, on the thread that runs the step (a checkpoint's background writer is not the step's).
On gloo the flight recorder's entries carry no durations, so it cannot be the source. Inside compiled regions the waits
are the compiled code's, not seen here: with `training.compile` the functional waits are not timed (Dynamo does not
trace under a Python dispatch mode), the c10d waits still are.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_WORK = torch._C._distributed_c10d.Work


def _waiting_subclasses() -> tuple[type, ...]:
    """The tensor subclasses whose handlers wait for collectives: DTensor (its redistributes) and AsyncCollectiveTensor.
    Others (FakeTensor inside DTensor's sharding propagation) are left to themselves."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    return DTensor, AsyncCollectiveTensor


_WAITING = _waiting_subclasses()


class Waits(TorchDispatchMode):
    """Collects one step's waits on `clock` (DevicePolicy.timeline_clock); `take()` resolves and resets them."""

    def __init__(self, clock, functional: bool = True):
        super().__init__()
        self.clock, self.functional = clock, functional
        self.pending: list[Any] = []
        self._thread = threading.get_ident()
        self._wait = None

    def timed(self, fn, *args, **kwargs):
        started = self.clock.start()
        try:
            return fn(*args, **kwargs)
        finally:
            self.pending.append(self.clock.stop(started))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, _WAITING) for t in types):
            return NotImplemented  # the subclass's handler runs with this mode active: its waits come back here
        if func is torch.ops._c10d_functional.wait_tensor.default:
            return self.timed(func, *args, **kwargs)
        return func(*args, **kwargs)

    def start(self) -> None:
        """Begin timing a step's waits (the step loop's begin_step)."""
        self.pending = []
        if self._wait is not None:  # still timing (a step that raised before its end): keep the one wrapper
            return
        original, waits = _WORK.wait, self

        def wait(work, *args, **kwargs):
            if threading.get_ident() != waits._thread:
                return original(work, *args, **kwargs)
            return waits.timed(original, work, *args, **kwargs)

        self._wait, _WORK.wait = original, wait
        if self.functional:
            self.__enter__()

    def stop(self) -> None:
        if self._wait is None:
            return
        if self.functional:
            self.__exit__(None, None, None)
        _WORK.wait, self._wait = self._wait, None

    def take(self) -> float:
        """Seconds waited since start (events resolved: call it after the step's host synchronization)."""
        total = sum(self.clock.resolve(v) for v in self.pending)
        self.pending = []
        return total
