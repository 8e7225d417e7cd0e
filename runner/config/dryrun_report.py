"""mode=dryrun in plain numbers (torch-free): which ranks to simulate, the batch the rehearsal runs, and
the table of the plan's analytic memory beside the measured one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runner.config import pipeline, runfiles
from runner.config.layout import Layout
from runner.config.schema import RunConfig

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
    return (
        f"global batch {cfg.training.global_batch_size} reduced to {gbs} for the dry run: {dry} microbatches per DP rank instead of {m}, "
        f"the same microbatches in flight on every stage ({pipeline.microbatches_in_flight(cfg.parallelism.pp_schedule, lay.pp, m)}) "
        "beside the accumulated gradients, so the same peak; dryrun.full_batch=true runs them all"
    )


def rows(budget: dict[str, Any], measured: dict[str, Any]) -> list[dict[str, Any]]:
    """Plan beside measurement (GB, at the rank's peak). The plan counts the fp32 master weights in the optimizer
    (12 bytes per parameter) and the compute-dtype weights with the gradients; the measured rows are grouped the same way."""
    at = measured["at_peak"]
    pairs = [
        ("weights + gradients", "weights_grads_gb_per_gpu", at["param_gathered"] + at["grad_shard"] + at["grad_unsharded"]),
        ("optimizer (master + moments)", "optimizer_gb_per_gpu", at["param_shard"] + at["optimizer_state"]),
        ("activations", "activations_gb_per_gpu", at["activation"]),
        ("temporaries", None, at["backward_temp"] + at["optimizer_temp"]),
        ("buffers", None, at["buffer"]),
        ("collective buffers", None, at["collective"]),
        ("total (peak)", "total_gb_per_gpu", measured["peak_bytes"]),
    ]
    out = []
    for name, key, got in pairs:
        plan = budget[key] if key else None
        meas = got / GB
        out.append({"row": name, "plan_gb": plan, "measured_gb": meas, "ratio": meas / plan if plan else None})
    return out


def _num(x: float | None, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:{width}.2f}"


def render_rank(r: dict[str, Any], microbatches: int) -> str:
    coords = " ".join(f"{k}={v}" for k, v in r["coords"].items())
    head = (
        f"rank {r['rank']} [{coords}]: peak {r['peak_bytes'] / GB:.2f} GB during {r['peak_phase']}; "
        f"{r['num_params_local']:,} parameters in {len(r['param_shards'])} shards; wall {r['wall_s']:.1f} s "
        f"(build {r['build_s']:.1f} s, steps {', '.join(f'{s:.1f}' for s in r['step_s'])} s)"
    )
    lines = [head, f"  {'':30}{'plan GB':>10}{'measured GB':>13}{'ratio':>8}"]
    for row in r["rows"]:
        lines.append(f"  {row['row']:30}{_num(row['plan_gb'], 10)}{row['measured_gb']:13.2f}{_num(row['ratio'], 8)}")
    lines.append(
        f"  collectives of the rehearsed step ({microbatches} microbatches): "
        + (", ".join(f"{c['op']} on {c['group']} x{c['count']} {c['bytes'] / GB:.3g} GB" for c in r["collectives"]) or "none")
    )
    return "\n".join(lines)


def render(report: dict[str, Any]) -> str:
    lines = [f"dry run of {report['model']} on {report['world_size']} ranks [{report['degrees']}], precision {report['precision']}"]
    if report["batch_note"]:
        lines.append(f"  {report['batch_note']}")
    for s in report["substitutions"]:
        lines.append(f"  substituted: {s}")
    lines += [render_rank(r, report["microbatches"]["rehearsed"]) for r in report["ranks"]]
    return "\n".join(lines)


def report(cfg: RunConfig, lay: Layout, budget: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """What dryrun.json holds: the run, the substitutions made, and per rank the plan-vs-measured rows and the ledger."""
    ranks_out = [r | {"rows": rows(budget, r)} for r in measured["ranks"]]
    return {
        "model": budget["model"],
        "world_size": lay.world_size,
        "degrees": lay.describe(),
        "precision": cfg.precision.name,
        "batch_note": batch_note(cfg, lay),
        "microbatches": dict(zip(("configured", "rehearsed"), microbatches(cfg, lay), strict=True)),
        "substitutions": measured["substitutions"],
        "plan": {k: budget[k] for k in ("weights_grads_gb_per_gpu", "optimizer_gb_per_gpu", "activations_gb_per_gpu", "total_gb_per_gpu")},
        "ranks": ranks_out,
    }


def write(rep: dict[str, Any], run_dir: Path) -> Path:
    path = run_dir / runfiles.DRYRUN
    path.write_text(json.dumps(rep, indent=2) + "\n")
    return path
