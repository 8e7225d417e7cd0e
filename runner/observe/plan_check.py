"""Check the planner against a measurement: predicted vs measured step time and bubble.

After a run, the step-time predictor (runner/estimate/predict/steptime.py) is set beside the measured
medians: on the machine profile of `cluster.profile` (python -m runner.calibrate) when there is one; on CPU
without one on the newest profile of this machine that runner.calibrate cached, else nothing (the run
says how to make one); on GPUs without one on the datasheet model with what this run measured (the
matmul peak and an all-reduce bandwidth over the job's own process group), labelled "datasheet, not
calibrated". The measured bubble is the idle fraction of each pipeline rank: one
minus the time inside its stages' forward/backward chunks over the schedule's wall time.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from runner.estimate import plan
from runner.schema import RunConfig
from runner.schema.layout import Layout

CHUNK_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class StageTimer:
    """Seconds this rank spends computing inside its pipeline stages `stages` (wrapping the stage methods the
    torch.distributed.pipelining schedules call), on the policy's timeline clock (DevicePolicy.timeline_clock): CUDA
    events on CUDA, where the host clock would time the kernels' launches; the wall clock on CPU."""

    def __init__(self, stages, clock):
        self.clock, self.pending = clock, []
        # private_api: torch_stage_chunk_methods
        for stage in stages:
            for name in CHUNK_METHODS:
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(getattr(stage, name)))

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            started = self.clock.start()
            try:
                return fn(*args, **kwargs)
            finally:
                self.pending.append(self.clock.stop(started))

        return wrapper

    def take(self) -> float:
        """The busy seconds since the last take (CUDA events: read after the step's host synchronization)."""
        busy = sum(self.clock.resolve(v) for v in self.pending)
        self.pending = []
        return busy


def allreduce_gbs(policy, numel: int = 1 << 21, reps: int = 5) -> float:
    """Per-direction bandwidth of a ring all-reduce over the world group, GB/s: bytes each
    rank sends (2(n-1)/n x size) over the median time. Device tensors on the default group: the
    links the model's own collectives use."""
    n = dist.get_world_size()
    if n == 1:
        return 0.0
    x = policy.probe_tensor(numel)
    dist.all_reduce(x)  # warm-up: connections
    times = []
    for _ in range(reps):
        policy.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        policy.sync()
        times.append(time.perf_counter() - t0)
    return 2 * (n - 1) / n * x.numel() * x.element_size() / statistics.median(times) / 1e9


def mean_over_ranks(policy, value: float) -> float:
    t = policy.all_reduce(torch.tensor([value], dtype=torch.float64))
    return float(t) / dist.get_world_size()


def compare(
    cfg: RunConfig,
    lay: Layout,
    source: tuple[str | None, str],
    peak_tflops_per_rank: float,
    link_gbs: float,
    measured_step_s: float,
    bubble: float | None,
    measured_terms: dict | None = None,
):
    """Predicted beside measured figures. The predictor runs on the machine's profile (`source`: its path or None and
    where it came from, runner.run.peak.profile_source); on GPUs without one on the datasheet model, given this run's
    measured peak and all-reduce bandwidth."""
    links = {"intra-node": 2 * link_gbs, "scale-out": 2 * link_gbs}  # planner figures are both directions together
    profile, origin = source
    budget = plan.compute(cfg, lay, peak_tflops=peak_tflops_per_rank, link_gbs=links, profile=profile)
    predicted = budget["estimated_step_time_s"] if origin != "none" else None
    return {
        "peak_tflops_per_rank": peak_tflops_per_rank,
        "allreduce_gbs_per_direction": link_gbs,
        "step_time_predicted_s": predicted,
        "step_time_measured_s": measured_step_s,
        "step_time_ratio": measured_step_s / predicted if predicted else None,
        "profile": profile,
        "profile_from": origin,
        "prediction_source": budget["predicted_source"] if predicted is not None else None,
        "prediction_binding": budget["predicted_binding"],
        "tp_comm_predicted_s": budget["tp_comm_s"],
        "bubble_predicted": budget["bubble_fraction"],
        "bubble_measured": bubble,
        "terms_predicted_s": dict(budget["predicted_terms_s"]) if predicted is not None else None,
        "terms_measured_s": measured_terms["terms_s"] if measured_terms else None,
        "terms_measured_step_s": measured_terms["step_s"] if measured_terms else None,
    }
