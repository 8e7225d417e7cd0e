"""mode=dryrun in plain numbers (torch-free): which ranks to simulate, the batch the rehearsal runs, and
the table of the plan's analytic memory (runner.estimate.memory, for the rank's own pipeline stage) beside the
measured one, each held row marked PASS/FAIL against its tolerance, and whether the plan's fits_memory agrees
with the largest measured peak."""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path
from typing import Any

from runner.estimate import block_mask, memory, pipeline
from runner.formats import runfiles
from runner.schema import DeviceType, ExpertsPrecision, Fp8Recipe, RunConfig
from runner.schema.layout import Layout

GB = 1e9  # the plan's unit


def ranks(cfg: RunConfig, lay: Layout) -> list[int]:
    """dryrun.ranks (validation keeps them inside the layout), or one rank per distinct pipeline stage: the first,
    one in the middle, the last."""
    if cfg.dryrun.ranks:
        return list(dict.fromkeys(cfg.dryrun.ranks))
    per_stage = lay.world_size // lay.pp
    stages = sorted({0, lay.pp // 2, lay.pp - 1})
    return [s * per_stage if s < lay.pp - 1 else lay.world_size - 1 for s in stages] if lay.pp > 1 else [0]


def microbatches(cfg: RunConfig, lay: Layout) -> tuple[int, int]:
    """(configured, rehearsed) microbatches per data-parallel rank. Unless dryrun.full_batch, the rehearsal runs
    the fewest that reach the steady state's peak: with 1F1B, pp + 1 (stage s runs pp - s forwards, one backward
    that makes the gradients, then a forward that brings back pp - s in flight beside those gradients; with only pp
    the peak is 16 % lower on the 70B example's first stage); without a pipeline, 2 (the second accumulates into
    the first one's gradients); other schedules run them all."""
    t, p = cfg.training, cfg.parallelism
    m = t.global_batch_size // (lay.dp * t.microbatch_size)
    if cfg.dryrun.full_batch:
        return m, m
    if lay.pp == 1:
        return m, min(m, 2)
    if p.pp_schedule == "1F1B":
        return m, min(m, lay.pp + 1)
    return m, m


def batch_note(cfg: RunConfig, lay: Layout) -> str | None:
    m, dry = microbatches(cfg, lay)
    if m == dry:
        return None
    gbs = dry * lay.dp * cfg.training.microbatch_size
    note = (
        f"global batch {cfg.training.global_batch_size} reduced to {gbs} for the dry run: {dry} microbatches per DP rank instead of {m}, "
        f"the same microbatches in flight on every stage ({pipeline.microbatches_in_flight(cfg.parallelism.pp_schedule, lay.pp, m)}) "
        "beside the accumulated gradients"
    )
    # pipeline stages keep receive buffers per microbatch of the step (runner.estimate.memory.stage)
    more = max(memory.stage_gb(cfg, lay, m, st)["total"] - memory.stage_gb(cfg, lay, dry, st)["total"] for st in range(lay.pp))
    if more < 0.0005:
        return note + ", so the same peak; dryrun.full_batch=true runs them all"
    return (
        note + f"; pipeline stages also keep receive buffers per microbatch, so the full batch peaks up to "
        f"{more:.2f} GB higher (planned); dryrun.full_batch=true runs them all"
    )


TOLERANCE = {"weights + gradients": 0.02, "optimizer (master + moments)": 0.02, "activations": 0.15}
"""How far the plan may be from the measurement, relative, on the rows it is held to (issue 14)."""


def rehearsal_budget(cfg: RunConfig, lay: Layout, stage: int) -> dict[str, float]:
    """The plan's figures (GB) for a rank of pipeline stage `stage` as the rehearsal runs it: on the rehearsal's
    device's kernels (the CPU's RMSNorm saves more than CUDA's fused one; dryrun.device=cuda keeps the cluster's), and
    its microbatches (a pipeline stage keeps a receive buffer for each; runner.estimate.memory), and its MoE routing,
    perfectly balanced (no imbalance headroom: runner.estimate.moe_memory)."""
    dry = copy.deepcopy(cfg)
    dry.cluster.device = cfg.dryrun.device
    dry.plan.moe_imbalance = 1.0
    return memory.stage_gb(dry, lay, microbatches(cfg, lay)[1], stage)


def rows(plan: dict[str, float], measured: dict[str, Any]) -> list[dict[str, Any]]:
    """Plan beside measurement (GB, at the rank's peak). The fp32 master shard counts with the optimizer (12 bytes
    per parameter), the gathered weights with the gradients, as in runner.estimate.memory."""
    at = measured["at_peak"]
    pairs = [
        ("weights + gradients", "weights_grads", at["param_gathered"] + at["grad_shard"] + at["grad_unsharded"]),
        ("optimizer (master + moments)", "optimizer", at["param_shard"] + at["optimizer_state"]),
        ("activations", "activations", at["activation"]),
        ("temporaries", "temporaries", at["backward_temp"] + at["optimizer_temp"]),
        ("buffers", "buffers", at["buffer"]),
        ("collective buffers", None, at["collective"]),
        ("total (peak)", "total", measured["peak_bytes"]),
    ]
    out = []
    for name, key, got in pairs:
        want = plan[key] if key else None
        meas = got / GB
        ratio = meas / want if want else None
        tol = TOLERANCE.get(name)
        within = None if tol is None or ratio is None else abs(ratio - 1) <= tol
        out.append({"row": name, "plan_gb": want, "measured_gb": meas, "ratio": ratio, "tolerance": tol, "within": within})
    return out


def _num(x: float | None, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:{width}.2f}"


def _steps(r: dict[str, Any]) -> str:
    """The CPU dry run's warm-up and measured step (runner.run.dryrun.rehearse.warm_up), or the CUDA rehearsal's steps."""
    if "warm_up_s" in r:
        return f"warm-up {r['warm_up_s']:.1f} s, measured step {r['step_s'][-1]:.1f} s"
    return f"steps {', '.join(f'{s:.1f}' for s in r['step_s'])} s"


def render_rank(r: dict[str, Any], microbatches: int) -> str:
    coords = " ".join(f"{k}={v}" for k, v in r["coords"].items())
    head = (
        f"rank {r['rank']} [{coords}]: peak {r['peak_bytes'] / GB:.2f} GB during {r['peak_phase']}; "
        f"{r['num_params_local']:,} parameters in {len(r['param_shards'])} shards; wall {r['wall_s']:.1f} s "
        f"(build {r['build_s']:.1f} s, {_steps(r)})"
    )
    lines = [head, f"  {'':30}{'plan GB':>10}{'measured GB':>13}{'ratio':>8}  held to"]
    for row in r["rows"]:
        held = "" if row["tolerance"] is None else f"  {100 * row['tolerance']:.0f} %: " + ("PASS" if row["within"] else "FAIL")
        lines.append(f"  {row['row']:30}{_num(row['plan_gb'], 10)}{row['measured_gb']:13.2f}{_num(row['ratio'], 8)}{held}")
    lines.append(
        f"  collectives of the rehearsed step ({microbatches} microbatches): "
        + (", ".join(f"{c['op']} on {c['group']} x{c['count']} {c['bytes'] / GB:.3g} GB" for c in r["collectives"]) or "none")
    )
    if "steps" in r:  # dryrun.device=cuda (runner.run.dryrun.cuda_rehearse)
        lines += cuda_lines(r)
    return "\n".join(lines)


def cuda_lines(r: dict[str, Any]) -> list[str]:
    """What the CUDA rehearsal adds per rank: per step the host synchronizations, the attention kernels and the matmul
    and reduction dtypes; the devices of the state and the checks of the GPU path."""
    out = []
    for i, st in enumerate(r["steps"], 1):  # step 1 is the run's first: lazy set-up (pipeline shape metadata) syncs there
        syncs = ", ".join(f"{what} x{n}" for what, n in Counter(st["syncs"]).items()) or "none"
        attn = ", ".join(f"{k} x{v}" for k, v in st["attention"].items()) or "none"
        pageable = f"; {st['pageable_copies']} non-blocking copies from pageable memory" if st["pageable_copies"] else ""
        masks = st.get("block_masks_built") or []
        pageable += f"; {len(masks)} block masks built ({_size(sum(masks))})" if masks else ""
        out.append(
            f"  step {i}: host syncs {len(st['syncs'])} ({syncs}){pageable}; attention {attn}; "
            f"matmuls in {'/'.join(st['matmul_dtypes']) or '-'}, reductions in {'/'.join(st['reduce_dtypes']) or '-'}"
        )
    loop = r.get("loop_steps") or []
    if loop:
        per = "; ".join(
            f"step {st['step']}{' (logged)' if st['logged'] else ''}: {len(st['syncs'])} "
            f"({', '.join(f'{what} x{n}' for what, n in Counter(st['syncs']).items()) or 'none'})"
            for st in loop
        )
        out.append(
            f"  the step loop itself (StepLoop.step, {len(loop)} steps): host syncs {per}; CUDA events read after the step's read "
            f"(completed, no wait): {', '.join(str(st['completed_event_reads']) for st in loop)}"
        )
    c = r["checks"]
    last = r["steps"][-1]
    out.append(
        f"  on the device: parameters {'/'.join(c['param_devices'])} ({'/'.join(c['param_dtypes'])}), gradients "
        f"{'/'.join(last['grad_devices'])} ({'/'.join(last['grad_dtypes'])}), "
        f"optimizer state {'/'.join(c['optimizer_state_devices']) or '-'}, "
        f"batches {'/'.join(last['batch_devices'])}; FP8 modules: {', '.join(c['fp8_modules']) or 'none'}"
    )
    rng = c["rng"]
    out.append(
        f"  checkpoint staging: pinned {c['use_pinned_memory']}, async {c['use_async_staging']}; RNG state: host {rng['host_bytes']} B, "
        f"device {rng['device_bytes'] if rng['device_bytes'] is not None else 'none'} B; attention masks to "
        f"{sum(1 for n in c['masks']['forwards_with_masks'] if n)} of {len(c['masks']['forwards_with_masks'])} model parts"
    )
    return out


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def block_mask_line(b: dict[str, Any]) -> str:
    """FlexAttention's block mask of the step (runner.estimate.block_mask): the plan's beside TorchTitan's, built for real."""
    built = f"{b['builds_per_step']} built per step" if b["builds_per_step"] else "built once, kept for the run"
    head = f"block masks (FlexAttention, {b['batch']} x {b['seq_len']} tokens, {built}): plan {_size(b['plan_bytes'])}"
    if b["sample_bytes"] is None:
        return f"{head}; not built here ({b['skipped']})"
    got = b["sample_bytes"] * b["batch"] * b["masks_per_build"]
    return (
        f"{head}, TorchTitan's mask function builds {_size(got)} ({b['sample_bytes']:,} B per sample); "
        f"one sample's build took {b['sample_build_s'] * 1e3:.1f} ms on this CPU (eager create_block_mask; the GPU's is compiled)"
    )


def render(report: dict[str, Any]) -> str:
    lines = [f"dry run of {report['model']} on {report['world_size']} ranks [{report['degrees']}], precision {report['precision']}"]
    if report["batch_note"]:
        lines.append(f"  {report['batch_note']}")
    for s in report["substitutions"]:
        lines.append(f"  substituted: {s}")
    lines += [render_rank(r, report["microbatches"]["rehearsed"]) for r in report["ranks"]]
    if report.get("block_mask"):
        lines.append(block_mask_line(report["block_mask"]))
    if report["fits"]["device_memory_gb"]:
        lines.append(fit_line(report))
    return "\n".join(lines)


def fit_line(report: dict[str, Any]) -> str:
    """The plan's fits_memory against the largest measured peak. Where they disagree after a CPU rehearsal of a CUDA
    cluster, the line says what the CPU's kernels were planned at: their memory is not the cluster's (MLA's math SDPA
    keeps fp32 attention probabilities, for one), and the CUDA rehearsal measures the cluster's kernels."""
    f, verdict = report["fits"], {True: "fits", False: "does not fit"}
    line = (
        f"fits_memory: plan {verdict[f['plan']]} ({report['plan']['total_gb_per_gpu']:.2f} GB per device, cluster kernels), "
        f"dry run {verdict[f['measured']]} (largest peak {f['largest_peak_gb']:.2f} GB) in {f['device_memory_gb']:g} GB: "
        + ("agree" if f["plan"] == f["measured"] else "DISAGREE")
    )
    if f["plan"] != f["measured"] and report.get("rehearsal") == "cpu" and report["device"] == "cuda":
        planned = max(row["plan_gb"] for r in report["ranks"] for row in r["rows"] if row["row"] == "total (peak)")
        line += (
            f" (the CPU rehearsal's kernels, planned at {planned:.2f} GB for these ranks, are not the cluster's: "
            "dryrun.device=cuda rehearses the cluster's kernels)"
        )
    return line


def report(cfg: RunConfig, lay: Layout, budget: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """What dryrun.json holds: the run, the substitutions made, and per rank the plan-vs-measured rows and the ledger."""
    ranks_out = [r | {"rows": rows(rehearsal_budget(cfg, lay, lay.coords(r["rank"])["pp"]), r)} for r in measured["ranks"]]
    peak = max(r["peak_bytes"] for r in measured["ranks"]) / GB
    capacity = budget["device_memory_gb"]
    return {
        "model": budget["model"],
        "world_size": lay.world_size,
        "degrees": lay.describe(),
        "precision": cfg.precision.name,
        "batch_note": batch_note(cfg, lay),
        "microbatches": dict(zip(("configured", "rehearsed"), microbatches(cfg, lay), strict=True)),
        "substitutions": measured["substitutions"],
        "device": cfg.cluster.device.value,
        "rehearsal": cfg.dryrun.device.value,
        "plan": {k: budget[k] for k in ("weights_grads_gb_per_gpu", "optimizer_gb_per_gpu", "activations_gb_per_gpu", "total_gb_per_gpu")},
        "fits": {
            "device_memory_gb": capacity or None,
            "plan": budget["fits_memory"],
            "measured": peak <= capacity if capacity else None,
            "largest_peak_gb": peak,
        },
        "ranks": ranks_out,
        "block_mask": measured.get("block_mask"),
    }


def write(rep: dict[str, Any], run_dir: Path) -> Path:
    return runfiles.write_json(run_dir / runfiles.DRYRUN, rep)


def substitutions(cfg: RunConfig) -> list[str]:
    """What the CPU rehearsal (runner.run.dryrun.rehearse) runs in place of the cluster's own kernels; every one is
    printed and recorded."""
    out = []
    if cfg.cluster.device == DeviceType.cuda:
        out.append(
            "attention: TorchTitan's causal SDPA in place of FlexAttention, which has no backward on the (CPU) fake tensors; "
            "both save out + logsumexp"
        )
    if cfg.cluster.device == DeviceType.cuda and block_mask.documents(cfg):
        out.append(
            "packed documents: the rehearsed step attends one document per sample (SDPA takes no BlockMask); the step's "
            "FlexAttention BlockMask is built apart, for real, and shown below"
        )
    if cfg.model.kv_lora_rank:  # the plan's rehearsal column counts it (runner.estimate.block_bytes._mla_cpu_math_bytes_per_token)
        out.append(
            "multi-head latent attention: on CPU SDPA runs its math kernel (the value head dim differs from the query/key one), "
            "which saves fp32 q, k, v and the attention probabilities; a GPU's flash kernel saves out + logsumexp only"
        )
    if cfg.model.num_experts and cfg.parallelism.ep > 1:
        out.append(
            "MoE routing: perfectly balanced (tokens x top-k / ep to every EP rank); the real all-to-all sizes follow the "
            "router's values, which fake tensors do not have"
        )
    if cfg.precision.fp8 == Fp8Recipe.blockwise:
        out.append("fp8 blockwise: the PyTorch-op emulation (runner.run.titan.fp8_emulation) in place of torchao's Triton kernels")
    if cfg.precision.experts != ExpertsPrecision.high and cfg.model.num_experts:
        out.append(
            f"routed experts {cfg.precision.experts.value}: on the CPU dry run TorchTitan's bf16 grouped GEMM (the CPU emulation "
            "splits tokens by expert counts, which fake tensors do not have); the CUDA rehearsal runs torchao's"
        )
    return out
