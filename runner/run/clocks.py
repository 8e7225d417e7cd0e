"""The clocks a rank's phases and step timeline are measured on; the device policy (runner.run.device) picks one.

A clock changes with how a device reports time (CPU time, wall time, CUDA events), the policy with which device a
rank runs on: CPU ranks time phases by CPU time and the step by the wall clock, CUDA ranks both by events.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class CpuClock:
    """Phase times from the process's CPU time: a rank blocked in a gloo collective accrues none, so a
    slow rank is not hidden by the peers that wait for it, and time-sharing of the cores does not count."""

    measures_cpu_time = True

    def now(self) -> float:
        return time.process_time()

    def start(self) -> float:
        return time.process_time()

    def stop(self, started: float) -> float:
        return time.process_time() - started

    def resolve(self, value: Any) -> float:
        return value


class WallClock:
    """The step's timeline on a CPU rank: wall-clock seconds, waits and stops included (a rank stopped from outside
    accrues none of CPU time, but all of this)."""

    measures_cpu_time = False

    def now(self) -> float:
        return time.perf_counter()

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, started: float) -> float:
        return time.perf_counter() - started

    def resolve(self, value: Any) -> float:
        return value


class CudaEventClock:
    """Phase times from CUDA events recorded on the current stream: kernels run asynchronously, so the
    host clock would time the launches, not the work. Elapsed times are read at the end of each step (`resolve`), after
    the step's one host synchronization (DevicePolicy.read): its events have completed, so reading them waits for nothing."""

    measures_cpu_time = False

    def now(self) -> float:
        return time.perf_counter()  # host time, for the test-only busy loop only

    def start(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, started: torch.cuda.Event) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return started, end

    def resolve(self, value: Any) -> float:
        if isinstance(value, float):
            return value
        start, end = value
        end.synchronize()  # returns at once after the step's read; an event recorded after it (the host collective's) is near
        return start.elapsed_time(end) / 1000
