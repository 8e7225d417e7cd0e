"""The step budget of a layout before anything launches (`mode=plan`).

Torch-free: every figure comes from the config (model shape, degrees, batch, cluster).
Per GPU unless a key says otherwise; SI units (GB = 1e9 bytes, seconds) and fractions.

Conventions, stated once and used throughout:
- Bandwidth: cluster figures are per device with both directions together, as NVIDIA
  quotes NVLink (H100: 900 GB/s). A ring collective sends one direction while it receives
  the other, so its time is bytes sent per device / (bandwidth / 2). This per-direction
  reading is what makes the worked example's TP traffic 0.67 s (300.6 GB at 450 GB/s).
- Ring volumes sent per device: all-reduce 2(n-1)/n x size; reduce-scatter and all-gather
  (n-1)/n x size each, so sequence parallelism (RS + AG in place of one all-reduce) moves
  the same bytes.
- Ranks are placed in mesh order (pp, dp_replicate, dp_shard, cp, tp), TP fastest, so an
  axis whose group fits inside a node uses the intra-node link and the others scale-out.
- Memory (runner.estimate.memory): what TorchTitan allocates on each pipeline stage at its peak (fp32
  master shards and Adam moments over dp_shard x cp, gathered param_dtype weights, fp32 gradients
  unsharded under PP, the activations its blocks save for backward, the loss's logits, RoPE tables);
  the keys describe the stage with the largest total, which mode=dryrun measures. The budget convention of
  the worked example (training-dtype weights and gradients, 12 B/param over dp_shard, Korthikanti et al. 2022
  activations) stays beside it under keys ending in `_worked_example`. With 1F1B-type schedules stage s holds
  min(m, p - s) microbatches in flight, with GPipe all m; under Interleaved1F1B each virtual stage holds its share of
  torch's warm-up (runner.estimate.pipeline_ranks.looped_held), under a V schedule what torch's action order leaves
  in flight (pipeline_ranks.v_held); an MoE block's memory by named term (runner.estimate.moe_memory).
- plan.json also carries those keys under their names before the rename (ending in `_seed`), read-only
  aliases for one release, listed in its `renamed_keys`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from runner.estimate import block_mask, flops, pipeline, precision
from runner.estimate.comm import communication
from runner.estimate.memory import memory
from runner.estimate.plan_render import one_line, render, rows  # noqa: F401  (the plan's printed forms)
from runner.estimate.predict import steptime
from runner.formats import checkpoint, runfiles
from runner.schema import ClusterConfig, RunConfig, layout
from runner.schema.layout import Layout, label


def _compute_time(cfg: RunConfig, lay: Layout, peak_tflops: float | None) -> dict[str, Any]:
    """Model FLOPs of a step and its time at the peak (ideal) and at the cluster's assumed MFU."""
    m, t, c = cfg.model, cfg.training, cfg.cluster
    conv = cfg.plan.flops_convention
    other = "titan" if conv == "6N" else "6N"
    fpt = flops.flops_per_token(m, t.seq_len, conv)
    flops_step = t.global_batch_size * t.seq_len * fpt
    gemm_dtype = precision.matmul_peak(cfg)[0]  # FP8 GEMMs run at the float8 peak; weights and activations stay in dtype
    gemm_peak = peak_tflops if peak_tflops is not None else c.peak_tflops.get(gemm_dtype)
    peak_dtype = precision.mfu_peak(cfg)  # MFU, the ideal compute and the assumed-MFU step: param_dtype's (bf16) peak
    peak = gemm_peak if peak_dtype == gemm_dtype else c.peak_tflops.get(peak_dtype)
    ideal_s = flops_step / (lay.world_size * peak * 1e12) if peak else None
    return {
        "gemm_peak_tflops": gemm_peak,
        "gemm_peak_dtype": gemm_dtype,
        "ideal_gemm_peak_s": flops_step / (lay.world_size * gemm_peak * 1e12) if gemm_peak else None,
        "flops_convention": conv,
        "flops_per_token": fpt,
        f"flops_per_token_{other}": flops.flops_per_token(m, t.seq_len, other),
        "model_flops_per_step": flops_step,
        "peak_tflops": peak,
        "peak_dtype": peak_dtype,
        "ideal_compute_s": ideal_s,
        "mfu_assumed": c.achievable_mfu,
        "step_time_s": ideal_s / c.achievable_mfu if ideal_s is not None else None,
    }


def _utilisation(cfg: RunConfig, lay: Layout, ct: dict[str, Any], step_s: float | None) -> flops.Utilisation:
    """The predicted step's MFU against the plan's peaks (per device in ct, times the world size)."""

    def total(tflops: float | None) -> float | None:
        return lay.world_size * tflops * 1e12 if tflops else None

    tokens = cfg.training.global_batch_size * cfg.training.seq_len
    return flops.utilisation(tokens, step_s, ct["flops_per_token"], total(ct["peak_tflops"]), total(ct["gemm_peak_tflops"]))


def _estimate(
    ct: dict[str, Any], comm: dict[str, Any], bubble: float, pred: steptime.StepPrediction, eff: float, u: flops.Utilisation
) -> dict[str, Any]:
    """The predictor's figures (runner/estimate/predict/steptime.py) in the plan's keys; `u`: their MFU."""
    step_s, dp_s = ct["step_time_s"], comm["dp_comm_s"]
    backward_s = step_s * (1 - bubble) * 2 / 3 if step_s is not None else None
    est_s = pred.step_s
    return {
        "matmul_efficiency": eff,
        "dp_hidden_behind_backward": dp_s <= backward_s if dp_s is not None and backward_s is not None else None,
        "tp_comm_share": comm["tp_comm_s"] / step_s if comm["tp_comm_s"] is not None and step_s else None,
        "compute_with_bubble_s": sum(pred.terms[k] for k in ("compute", "non_matmul", "recompute", "overhead", "bubble"))
        if est_s is not None
        else None,
        "dp_comm_exposed_s": pred.terms["dp"] if est_s is not None else None,
        "estimated_step_time_s": est_s,
        "estimated_mfu": u.mfu,
        "estimated_mfu_of_gemm_peak": u.mfu_of_gemm_peak,
        "predicted_terms_s": dict(pred.terms),
        "predicted_binding": pred.binding or None,
        "predicted_calibrated": pred.calibrated,
        "predicted_source": pred.source,
    }


def checkpoint_interval(num_params: int, c: ClusterConfig, step_s: float | None, nodes: int = 1) -> dict[str, Any]:
    """Young/Daly for each tier: interval = sqrt(2 x write time x MTBF). The shared tier writes the whole checkpoint at
    cluster.checkpoint_write_gbs; the local tier (checkpoint.local) writes each node's share, and with a partner node the
    copy of a partner's share too, at one node's cluster.local_write_gbs, all nodes at once."""
    ckpt_gb = checkpoint.size_estimate_gb(num_params)

    def tier(write_s: float | None) -> tuple[float | None, int | None]:
        interval_s = math.sqrt(2 * write_s * c.mtbf_hours * 3600) if write_s and c.mtbf_hours > 0 else None
        return interval_s, max(1, round(interval_s / step_s)) if interval_s and step_s else None

    write_s = ckpt_gb / c.checkpoint_write_gbs if c.checkpoint_write_gbs > 0 else None
    local_gb = ckpt_gb / nodes * (2 if nodes > 1 else 1)
    local_s = local_gb / c.local_write_gbs if c.local_write_gbs > 0 else None
    (interval_s, steps), (local_interval_s, local_steps) = tier(write_s), tier(local_s)
    return {
        "checkpoint_gb": ckpt_gb,
        "checkpoint_write_s": write_s,
        "mtbf_hours": c.mtbf_hours or None,
        "checkpoint_interval_s": interval_s,
        "checkpoint_interval_steps": steps,
        "local_checkpoint_gb_per_node": local_gb,
        "local_checkpoint_write_s": local_s,
        "local_checkpoint_interval_s": local_interval_s,
        "local_checkpoint_interval_steps": local_steps,
    }


def compute(
    cfg: RunConfig,
    lay: Layout,
    *,
    peak_tflops: float | None = None,
    link_gbs: dict[str, float] | None = None,
    device_memory_gb: float | None = None,
    matmul_efficiency: float | None = None,
    profile: str | None = None,
) -> dict[str, Any]:
    """Every figure of the budget. `peak_tflops` (per device), `link_gbs` ({'intra-node': x,
    'scale-out': y}, both directions together) and `device_memory_gb` override the cluster's,
    e.g. with figures measured on this machine; `profile` (a machine profile's path) cluster.profile."""
    m, t, p, c = cfg.model, cfg.training, cfg.parallelism, cfg.cluster
    micro = t.global_batch_size // (lay.dp * t.microbatch_size)
    v = p.pp_virtual_stages if lay.pp > 1 else 1
    bubble, bubble_text = pipeline.bubble(lay.pp, micro, p.pp_schedule, v)
    gbs_of = link_gbs or {"intra-node": c.intra_node_bandwidth_gbs, "scale-out": c.inter_node_bandwidth_gbs}
    dpn = layout.devices_per_node(c, lay.world_size)
    ct = _compute_time(cfg, lay, peak_tflops)
    comm = communication(cfg, lay, micro, v, dpn, gbs_of)
    eff = matmul_efficiency if matmul_efficiency is not None else c.matmul_efficiency
    pred = steptime.predict(cfg, lay, profile, peak_tflops=peak_tflops, link_gbs=link_gbs, matmul_efficiency=matmul_efficiency)
    speed_up = steptime.fp8_speed_up(cfg, lay, pred, profile, link_gbs=link_gbs, matmul_efficiency=matmul_efficiency)
    return {
        "model": f"{m.name} {m.flavor}",
        "params": flops.num_params(m),
        "active_params": flops.num_active_params(m),
        "layout": label(lay, p),
        "preset": p.name,
        "moe_comm_backend": p.moe_comm_backend.value,
        "device": c.device.value,
        "rank_overhead_gb": c.rank_overhead_gb,
        "degrees": lay.describe(),
        "world_size": lay.world_size,
        "precision": cfg.precision.name,
        "experts_precision": cfg.precision.experts.value,
        "routed_experts": precision.grouped_experts(cfg),  # the routed experts' precision in words; None for a dense model
        "tokens_per_step": t.global_batch_size * t.seq_len,
        "microbatches": micro,
        "virtual_stages_per_rank": v,
        "layers_per_stage": pipeline.stage_layers(m.num_layers, lay.pp * v, p.pp_first_stage_less_layers, p.pp_last_stage_less_layers),
        "bubble_fraction": bubble,
        "bubble_formula": bubble_text,
        **memory(cfg, lay, micro, device_memory_gb),
        **block_mask.plan(cfg, lay, micro),
        **ct,
        **comm,
        **_estimate(ct, comm, bubble, pred, eff, _utilisation(cfg, lay, ct, pred.step_s)),
        "fp8_speed_up": speed_up,  # the same layout's predicted param_dtype (bf16) step time over this FP8 one; None without FP8
        "fp8_speed_up_over": cfg.precision.param_dtype.value if speed_up is not None else None,
        **checkpoint_interval(flops.num_params(m), c, ct["step_time_s"], max(1, lay.world_size // dpn)),
    }


RENAMED_SUFFIX = ("_seed", "_worked_example")
"""The worked example's keys were named after the 'seed documents' until this release; plan.json keeps the old names
beside the new ones for one release, so that readers of it have time to move (remove the aliases after that)."""


def renamed_keys(plan: dict[str, Any]) -> dict[str, str]:
    """Old key -> new key of the worked example's figures."""
    old, new = RENAMED_SUFFIX
    return {k.removesuffix(new) + old: k for k in plan if k.endswith(new)}


def write(plan: dict[str, Any], run_dir: Path) -> Path:
    """plan.json: the plan, with the worked example's figures also under their old names (renamed_keys)."""
    renamed = renamed_keys(plan)
    aliases = {old: plan[new] for old, new in renamed.items()}
    return runfiles.write_json(run_dir / runfiles.PLAN, plan | aliases | {"renamed_keys": renamed})
