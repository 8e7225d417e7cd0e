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
- Memory follows TorchTitan's FSDP2: optimizer state (fp32 master + Adam moments, 12 B per
  parameter) is sharded over dp_shard (replicated over dp_replicate, i.e. HSDP). Weights
  and gradients (in the training dtype) are whole on every GPU of a stage while
  `fsdp_reshard_after_forward` keeps them (TorchTitan's default with PP), else sharded
  plus two gathered blocks (current and prefetched).
- Activations: Korthikanti et al. 2022, Table 2, bytes per layer per microbatch at 2-byte
  activations: s*b*h*(10 + 24/t + 5*a*s/(h*t)) with TP, s*b*h*(34/t + 5*a*s/(h*t)) with
  TP + sequence parallelism, 2*s*b*h (/t with SP) with full recomputation. TorchTitan uses
  fused attention (SDPA/FlexAttention), which stores no attention scores, so the 5*a*s/h
  term is dropped. The constants are for a GPT block (4h MLP); Llama's SwiGLU MLP and
  grouped-query attention shift them by a few percent. With 1F1B-type schedules the first
  stage holds min(m, p) microbatches in flight, with GPipe all m.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from runner.config import flops, pipeline, precision, runfiles, wording
from runner.config.layout import MESH_ORDER, Layout, label
from runner.config.schema import ActivationCheckpoint, RunConfig
from runner.config.wording import count

BYTES = {"float32": 4, "bfloat16": 2, "float8": 1}
OPTIMIZER_BYTES = 12  # fp32 master weight + Adam first and second moments


def link(lay: Layout, axis: str, devices_per_node: int) -> str:
    """'intra-node' when every group of `axis` sits inside one node, else 'scale-out'."""
    stride = 1
    for a in reversed(MESH_ORDER):
        if a == axis:
            break
        stride *= getattr(lay, a)
    extent = stride * getattr(lay, axis)
    return "intra-node" if extent <= devices_per_node and devices_per_node % extent == 0 else "scale-out"


def bubble_fraction(pp: int, microbatches: int, schedule: str, v: int = 1) -> tuple[float, str]:
    """Idle fraction of a pipeline step and the formula used (runner.config.pipeline.bubble)."""
    return pipeline.bubble(pp, microbatches, schedule, v)


def keeps_weights_gathered(cfg: RunConfig, lay: Layout) -> bool:
    """TorchTitan's reshard_after_forward policy: 'default' keeps gathered weights with PP."""
    policy = cfg.parallelism.fsdp_reshard_after_forward
    if lay.dp_shard == 1:  # no FSDP: nothing is sharded
        return True
    return policy == "never" or (policy == "default" and lay.pp > 1)


def activation_bytes_per_layer(cfg: RunConfig, lay: Layout, recompute: bool) -> float:
    """Korthikanti et al. 2022 (module docstring), scaled to the activation dtype."""
    t = cfg.training
    s, b, h, tp = t.seq_len / lay.cp, t.microbatch_size, cfg.model.dim, lay.tp
    sp = cfg.parallelism.sequence_parallel and tp > 1
    scale = BYTES[cfg.precision.param_dtype.value] / 2
    if recompute:
        per = 2 * s * b * h / (tp if sp else 1)
    else:
        per = s * b * h * (34 / tp if sp else 10 + 24 / tp)
    return per * scale


def _collective_s(nbytes: float, gbs: float) -> float | None:
    """Seconds to send `nbytes` per device over a link of `gbs` (both directions together)."""
    return nbytes / (gbs / 2 * 1e9) if gbs > 0 else None


def compute(
    cfg: RunConfig,
    lay: Layout,
    *,
    peak_tflops: float | None = None,
    link_gbs: dict[str, float] | None = None,
    device_memory_gb: float | None = None,
    matmul_efficiency: float | None = None,
) -> dict[str, Any]:
    """Every figure of the budget. `peak_tflops` (per device), `link_gbs` ({'intra-node': x,
    'scale-out': y}, both directions together) and `device_memory_gb` override the cluster's,
    e.g. with figures measured on this machine."""
    m, t, p, c = cfg.model, cfg.training, cfg.parallelism, cfg.cluster
    dtype, rdtype = cfg.precision.param_dtype.value, cfg.precision.reduce_dtype.value
    bw, br = BYTES[dtype], BYTES[rdtype]
    dpn = c.devices_per_node if c.devices_per_node != -1 else lay.world_size
    links = {a: link(lay, a, dpn) for a in MESH_ORDER}
    gbs_of = link_gbs or {"intra-node": c.intra_node_bandwidth_gbs, "scale-out": c.inter_node_bandwidth_gbs}

    n = flops.num_params(m)
    tokens = t.global_batch_size * t.seq_len
    micro = t.global_batch_size // (lay.dp * t.microbatch_size)
    v = p.pp_virtual_stages if lay.pp > 1 else 1
    bubble, bubble_text = bubble_fraction(lay.pp, micro, p.pp_schedule, v)
    split = pipeline.stage_layers(m.num_layers, lay.pp * v, p.pp_first_stage_less_layers, p.pp_last_stage_less_layers)

    # Memory
    params_gpu = n / (lay.tp * lay.pp)
    layer_params = flops.block_params(m)
    gathered = keeps_weights_gathered(cfg, lay)
    if gathered:
        weights_grads = params_gpu * 2 * bw
    else:
        weights_grads = params_gpu * 2 * bw / lay.dp_shard + 2 * layer_params / lay.tp * bw
    optimizer = params_gpu * OPTIMIZER_BYTES / lay.dp_shard
    layers_gpu = m.num_layers / lay.pp
    act_mb = activation_bytes_per_layer(cfg, lay, recompute=False) * layers_gpu
    act_mb_ac = activation_bytes_per_layer(cfg, lay, recompute=True) * layers_gpu
    in_flight = pipeline.microbatches_in_flight(p.pp_schedule, lay.pp, micro)
    ac = t.activation_checkpoint != ActivationCheckpoint.none
    activations = (act_mb_ac if ac else act_mb) * in_flight
    total = weights_grads + optimizer + activations
    memory_gb = device_memory_gb if device_memory_gb is not None else c.device_memory_gb

    # Compute
    conv = cfg.plan.flops_convention
    other = "titan" if conv == "6N" else "6N"
    fpt = flops.flops_per_token(m, t.seq_len, conv)
    flops_step = tokens * fpt
    peak_dtype = precision.matmul_peak(cfg)[0]  # FP8 GEMMs run at the float8 peak; weights and activations stay in dtype
    peak = peak_tflops if peak_tflops is not None else c.peak_tflops.get(peak_dtype)
    ideal_s = flops_step / (lay.world_size * peak * 1e12) if peak else None
    step_s = ideal_s / c.achievable_mfu if ideal_s is not None else None

    # TP: per layer 2 all-reduces forward + 2 backward (+2 when the forward is recomputed)
    act_bytes = t.microbatch_size * (t.seq_len / lay.cp) * m.dim * bw
    n_coll = 4 + (2 if ac else 0)
    tp_vol = layers_gpu * micro * n_coll * 2 * (lay.tp - 1) / lay.tp * act_bytes if lay.tp > 1 else 0.0
    tp_s = _collective_s(tp_vol, gbs_of[links["tp"]]) if lay.tp > 1 else 0.0

    # PP: each microbatch sends its activation forward and its gradient back at each of v stage edges
    sp = p.sequence_parallel and lay.tp > 1
    pp_vol = 2 * micro * v * act_bytes / (lay.tp if sp else 1) if lay.pp > 1 else 0.0
    pp_s = _collective_s(pp_vol, gbs_of[links["pp"]]) if lay.pp > 1 else 0.0

    # DP: FSDP all-gathers weights and reduce-scatters gradients; HSDP/DDP all-reduce over replicas
    syncs = 1 if lay.pp > 1 else micro  # the pipeline schedule syncs gradients once; accumulation every microbatch
    gathers = 1 if gathered else 2 * micro
    f, r = lay.dp_shard, lay.dp_replicate
    shard_vol = (gathers * params_gpu * bw + syncs * params_gpu * br) * (f - 1) / f if f > 1 else 0.0
    rep_vol = syncs * 2 * (r - 1) / r * params_gpu / f * br if r > 1 else 0.0
    dp_parts = [(shard_vol, links["dp_shard"]), (rep_vol, links["dp_replicate"])]
    dp_times = [_collective_s(vol, gbs_of[lk]) if vol else 0.0 for vol, lk in dp_parts]
    dp_s = None if any(x is None for x in dp_times) else sum(dp_times)
    backward_s = step_s * (1 - bubble) * 2 / 3 if step_s is not None else None

    # CP: ring attention passes K and V chunks cp-1 times forward; backward passes K, V, dK, dV
    kv_bytes = t.microbatch_size * (t.seq_len / lay.cp) * m.num_kv_heads * flops.head_dim(m) / lay.tp * bw
    cp_vol = layers_gpu * micro * (lay.cp - 1) * (6 + (2 if ac else 0)) * kv_bytes if lay.cp > 1 else 0.0
    cp_s = _collective_s(cp_vol, gbs_of[links["cp"]]) if lay.cp > 1 else 0.0

    # EP: each MoE block sends every token to num_experts_per_token experts and back (dispatch + combine
    # all-to-alls) forward and again backward (+ forward again under recomputation); (ep-1)/ep of it leaves
    # the rank. TorchTitan's sparse mesh (pp, dp_replicate, efsdp, ep) puts an EP group on consecutive ranks.
    ep_link = "intra-node" if lay.ep <= dpn and dpn % lay.ep == 0 else "scale-out"
    moe_layers_gpu = flops.num_moe_layers(m) / lay.pp
    routed_bytes = t.microbatch_size * (t.seq_len / lay.cp) * m.num_experts_per_token * m.dim * bw
    ep_vol = moe_layers_gpu * micro * (4 + (2 if ac else 0)) * routed_bytes * (lay.ep - 1) / lay.ep if lay.ep > 1 else 0.0
    ep_s = _collective_s(ep_vol, gbs_of[ep_link]) if lay.ep > 1 else 0.0

    # Bottom-up estimate: GEMMs at the cluster's matmul efficiency, stretched by the bubble,
    # plus the traffic that sits on the critical path (TP inside every layer, PP hand-offs,
    # CP ring passes and EP all-to-alls counted whole; DP only beyond what backward hides).
    eff = matmul_efficiency if matmul_efficiency is not None else c.matmul_efficiency
    parts = [tp_s, pp_s, cp_s, ep_s, dp_s]
    if ideal_s is not None and None not in parts:
        compute_s = ideal_s / eff / (1 - bubble)
        dp_exposed = max(0.0, dp_s - compute_s * 2 / 3)
        est_s = compute_s + tp_s + pp_s + cp_s + ep_s + dp_exposed
        est_mfu = ideal_s / est_s
    else:
        compute_s = dp_exposed = est_s = est_mfu = None

    # Checkpoint interval (Young/Daly): sqrt(2 x write time x MTBF)
    ckpt_gb = n * OPTIMIZER_BYTES / 1e9
    write_s = ckpt_gb / c.checkpoint_write_gbs if c.checkpoint_write_gbs > 0 else None
    interval_s = math.sqrt(2 * write_s * c.mtbf_hours * 3600) if write_s and c.mtbf_hours > 0 else None
    interval_steps = max(1, round(interval_s / step_s)) if interval_s and step_s else None

    def share(x: float | None) -> float | None:
        return x / step_s if x is not None and step_s else None

    return {
        "model": f"{m.name} {m.flavor}",
        "params": n,
        "layout": label(lay, p),
        "preset": p.name,
        "device": c.device.value,
        "rank_overhead_gb": c.rank_overhead_gb,
        "degrees": lay.describe(),
        "world_size": lay.world_size,
        "links": {a: links[a] for a in MESH_ORDER if getattr(lay, a) > 1},
        "precision": cfg.precision.name,
        "tokens_per_step": tokens,
        "microbatches": micro,
        "virtual_stages_per_rank": v,
        "layers_per_stage": split,
        "bubble_fraction": bubble,
        "bubble_formula": bubble_text,
        "params_per_gpu": params_gpu,
        "weights_gathered_during_step": gathered,
        "weights_grads_gb_per_gpu": weights_grads / 1e9,
        "optimizer_gb_per_gpu": optimizer / 1e9,
        "activations_gb_per_microbatch": act_mb / 1e9,
        "activations_gb_per_microbatch_recompute": act_mb_ac / 1e9,
        "microbatches_in_flight": in_flight,
        "activations_gb_per_gpu": activations / 1e9,
        "total_gb_per_gpu": total / 1e9,
        "device_memory_gb": memory_gb,
        "fits_memory": total / 1e9 <= memory_gb if memory_gb else None,
        "flops_convention": conv,
        "flops_per_token": fpt,
        f"flops_per_token_{other}": flops.flops_per_token(m, t.seq_len, other),
        "model_flops_per_step": flops_step,
        "peak_tflops": peak,
        "peak_dtype": peak_dtype,
        "ideal_compute_s": ideal_s,
        "mfu_assumed": c.achievable_mfu,
        "step_time_s": step_s,
        "matmul_efficiency": eff,
        "compute_with_bubble_s": compute_s,
        "dp_comm_exposed_s": dp_exposed,
        "estimated_step_time_s": est_s,
        "estimated_mfu": est_mfu,
        "tp_comm_gb": tp_vol / 1e9,
        "tp_comm_s": tp_s,
        "tp_comm_share": share(tp_s),
        "pp_comm_gb": pp_vol / 1e9,
        "pp_comm_s": pp_s,
        "dp_comm_gb": (shard_vol + rep_vol) / 1e9,
        "dp_comm_s": dp_s,
        "dp_hidden_behind_backward": dp_s <= backward_s if dp_s is not None and backward_s is not None else None,
        "cp_comm_gb": cp_vol / 1e9,
        "cp_comm_s": cp_s,
        "ep_comm_gb": ep_vol / 1e9,
        "ep_comm_s": ep_s,
        "ep_link": ep_link if lay.ep > 1 else None,
        "checkpoint_gb": ckpt_gb,
        "checkpoint_write_s": write_s,
        "mtbf_hours": c.mtbf_hours or None,
        "checkpoint_interval_s": interval_s,
        "checkpoint_interval_steps": interval_steps,
    }


def _layers(split: list[int]) -> str:
    """'0 | 1 x 6 | 0' style: stage sizes with runs collapsed."""
    runs: list[list[int]] = []
    for n in split:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return " | ".join(f"{n} x {k}" if k > 1 else str(n) for n, k in runs)


def _f(x: float | None, fmt: str, unit: str = "") -> str:
    return "n/a" if x is None else format(x, fmt) + unit


def rows(plan: dict[str, Any], configured_interval: int | None = None) -> list[tuple[str, str, str]]:
    """(row, value, note) lines of the printed table."""
    pct = lambda x: _f(None if x is None else 100 * x, ".1f", " %")  # noqa: E731
    mem = plan["device_memory_gb"]
    fit = {True: "fits", False: "DOES NOT FIT", None: "device memory unknown"}[plan["fits_memory"]]
    conv = plan["flops_convention"]
    unit = wording.device_unit(plan["device"])
    out = [
        ("model", f"{plan['model']}, {plan['params'] / 1e9:.2f} B params", ""),
        ("layout", f"{plan['layout']} [{plan['degrees']}]", count(plan["world_size"], unit)),
        ("links", ", ".join(f"{a}: {lk}" for a, lk in plan["links"].items()) or "-", "ranks placed TP fastest"),
        ("tokens per step", f"{plan['tokens_per_step']:,}", "global batch x seq_len"),
        ("microbatches per pipeline m", str(plan["microbatches"]), ""),
        ("pipeline bubble", pct(plan["bubble_fraction"]), plan["bubble_formula"]),
        ("layers per stage", _layers(plan["layers_per_stage"]), f"{count(plan['virtual_stages_per_rank'], 'stage')} per pipeline rank"),
        (f"parameters per {unit}", f"{plan['params_per_gpu'] / 1e9:.3f} B", "params / (tp x pp)"),
        (
            "weights + gradients",
            _f(plan["weights_grads_gb_per_gpu"], ".3g", " GB"),
            f"whole on each {unit} of the stage (FSDP keeps them gathered)" if plan["weights_gathered_during_step"] else "FSDP-sharded",
        ),
        ("optimizer state", _f(plan["optimizer_gb_per_gpu"], ".3g", " GB"), "fp32 master + Adam moments / dp_shard"),
        (
            "activations per microbatch",
            _f(plan["activations_gb_per_microbatch"], ".3g", " GB"),
            f"{plan['activations_gb_per_microbatch_recompute']:.3g} GB with full recomputation (Korthikanti 2022)",
        ),
        ("activations in flight", _f(plan["activations_gb_per_gpu"], ".3g", " GB"), count(plan["microbatches_in_flight"], "microbatch")),
        ("total memory", _f(plan["total_gb_per_gpu"], ".3g", " GB"), f"{fit}" + (f" in {mem:.3g} GB" if mem else "")),
        ("model FLOPs per step", f"{plan['model_flops_per_step']:.3e}", f"{conv} convention"),
        (
            "ideal compute",
            _f(plan["ideal_compute_s"], ".3f", " s"),
            f"at {plan['peak_tflops']:g} TFLOP/s {plan['peak_dtype']} dense peak"
            if plan["peak_tflops"]
            else "no peak in the cluster config (a CPU peak is measured at launch)",
        ),
        ("step time", _f(plan["step_time_s"], ".3f", " s"), f"at {100 * plan['mfu_assumed']:.0f} % MFU ({conv})"),
        (
            "bottom-up step estimate",
            _f(plan["estimated_step_time_s"], ".3f", " s"),
            f"GEMMs at {100 * plan['matmul_efficiency']:.0f} % of peak / (1 - bubble) + TP + PP + CP + exposed DP; "
            f"MFU {pct(plan['estimated_mfu'])}",
        ),
        ("TP traffic", _f(plan["tp_comm_s"], ".3f", " s"), f"{plan['tp_comm_gb']:.1f} GB, {pct(plan['tp_comm_share'])} of the step"),
        ("PP traffic", _f(plan["pp_comm_s"], ".4f", " s"), f"{plan['pp_comm_gb']:.2f} GB point-to-point"),
        (
            "DP traffic",
            _f(plan["dp_comm_s"], ".3f", " s"),
            f"{plan['dp_comm_gb']:.1f} GB; "
            + {True: "hides behind backward", False: "LONGER THAN BACKWARD", None: "overlap unknown"}[plan["dp_hidden_behind_backward"]],
        ),
    ]
    if plan["cp_comm_gb"]:
        out.append(("CP traffic", _f(plan["cp_comm_s"], ".3f", " s"), f"{plan['cp_comm_gb']:.1f} GB ring attention K/V"))
    if plan["ep_comm_gb"]:
        out.append(("EP traffic", _f(plan["ep_comm_s"], ".3f", " s"), f"{plan['ep_comm_gb']:.2f} GB token all-to-all, {plan['ep_link']}"))
    note = f"write {_f(plan['checkpoint_write_s'], '.1f', ' s')}, MTBF {_f(plan['mtbf_hours'], 'g', ' h')} (Young/Daly)"
    if configured_interval:
        note += f"; configured: {configured_interval}"
    out.append(("checkpoint interval", _f(plan["checkpoint_interval_steps"], "d", " steps"), note))
    return out


def one_line(plan: dict[str, Any]) -> str:
    fit = {True: "fits", False: "DOES NOT FIT", None: "fit unknown"}[plan["fits_memory"]]
    return (
        f"plan [{plan['degrees']}]: estimated step {_f(plan['estimated_step_time_s'], '.3f', ' s')} "
        f"(MFU {_f(plan['estimated_mfu'] and 100 * plan['estimated_mfu'], '.1f', ' %')}), m={plan['microbatches']}, "
        f"bubble {100 * plan['bubble_fraction']:.1f} %, TP {_f(plan['tp_comm_s'], '.3f', ' s')}, "
        f"memory {plan['total_gb_per_gpu']:.3g} GB ({fit})"
    )


def render(plan: dict[str, Any], configured_interval: int | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    unit = wording.device_unit(plan["device"])
    table = Table(title=f"step budget: {plan['model']} on {count(plan['world_size'], unit)}", title_justify="left")
    for col in ("", f"per {unit}", "note"):
        table.add_column(col)
    for r in rows(plan, configured_interval):
        table.add_row(*r, style="bold red" if "NOT" in r[2] or "LONGER" in r[2] else None)
    Console(highlight=False, width=160).print(table)


def write(plan: dict[str, Any], run_dir: Path) -> Path:
    path = run_dir / runfiles.PLAN
    path.write_text(json.dumps(plan, indent=2) + "\n")
    return path
