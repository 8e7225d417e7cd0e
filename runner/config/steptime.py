"""The step-time predictor: seconds per training step of a layout, as a sum of named terms.

Torch-free and pure arithmetic (mode=search prices thousands of candidates with it). Every
term is seconds per step on the slowest rank; `binding` names the largest. Without a machine
profile (`cluster.profile`, written by `python -m runner.calibrate`) the cluster's datasheet
figures are used and the prediction says so ("datasheet, not calibrated").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runner.config import flops, layout, pipeline, precision
from runner.config.layout import Layout
from runner.config.plan_comm import communication
from runner.config.schema import RunConfig

DATASHEET = "datasheet, not calibrated"


@dataclass(frozen=True)
class StepPrediction:
    step_s: float | None
    """Predicted seconds per step (None when the cluster lacks a peak or a link bandwidth)."""
    terms: dict[str, float] = field(default_factory=dict)
    """Exposed seconds per step by term: compute, non_matmul, recompute, overhead, bubble, tp, pp, cp, ep, dp."""
    binding: str = ""
    """The largest term's name: what to attack first."""
    calibrated: bool = False
    """True when the figures come from a machine profile measured by `python -m runner.calibrate`."""
    source: str = DATASHEET
    """Where the machine figures come from: the profile's path, or DATASHEET."""


def _micro(cfg: RunConfig, lay: Layout) -> int:
    return cfg.training.global_batch_size // (lay.dp * cfg.training.microbatch_size)


def _virtual(cfg: RunConfig, lay: Layout) -> int:
    return cfg.parallelism.pp_virtual_stages if lay.pp > 1 else 1


def _ideal_compute_s(cfg: RunConfig, lay: Layout, peak_tflops: float | None) -> float | None:
    m, t = cfg.model, cfg.training
    flops_step = t.global_batch_size * t.seq_len * flops.flops_per_token(m, t.seq_len, cfg.plan.flops_convention)
    peak = peak_tflops if peak_tflops is not None else cfg.cluster.peak_tflops.get(precision.matmul_peak(cfg)[0])
    return flops_step / (lay.world_size * peak * 1e12) if peak else None


def _finish(terms: dict[str, float | None], calibrated: bool, source: str) -> StepPrediction:
    if any(v is None for v in terms.values()):
        return StepPrediction(None, {}, "", calibrated, source)
    clean = {k: float(v) for k, v in terms.items()}
    return StepPrediction(sum(clean.values()), clean, max(clean, key=clean.get), calibrated, source)


def predict(
    cfg: RunConfig,
    lay: Layout,
    profile=None,
    *,
    peak_tflops: float | None = None,
    link_gbs: dict[str, float] | None = None,
    matmul_efficiency: float | None = None,
) -> StepPrediction:
    """Seconds per step of `lay`: GEMMs at the cluster's matmul efficiency, stretched by the bubble, plus
    the traffic on the critical path (TP, PP, CP, EP whole; DP beyond what backward hides)."""
    c = cfg.cluster
    micro, v = _micro(cfg, lay), _virtual(cfg, lay)
    bubble = pipeline.bubble(lay.pp, micro, cfg.parallelism.pp_schedule, v)[0]
    gbs_of = link_gbs or {"intra-node": c.intra_node_bandwidth_gbs, "scale-out": c.inter_node_bandwidth_gbs}
    comm = communication(cfg, lay, micro, v, layout.devices_per_node(c, lay.world_size), gbs_of)
    ideal = _ideal_compute_s(cfg, lay, peak_tflops)
    eff = matmul_efficiency if matmul_efficiency is not None else c.matmul_efficiency
    compute = ideal / eff if ideal is not None else None
    terms: dict[str, float | None] = {
        "compute": compute,
        "bubble": compute * bubble / (1 - bubble) if compute is not None else None,
    }
    for axis in ("tp", "pp", "cp", "ep"):
        terms[axis] = comm[f"{axis}_comm_s"]
    dp = comm["dp_comm_s"]
    terms["dp"] = max(0.0, dp - (compute + terms["bubble"]) * 2 / 3) if dp is not None and compute is not None else None
    return _finish(terms, False, DATASHEET)
