"""A run folder's result as one row of `python -m runner.compare` (torch-free): the first of failed.json, summary.json,
plan.json and invalid.json it holds, labelled by the Hydra overrides that set it apart from the other folders read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runner.formats import runfiles


def _overrides(run: Path) -> list[str]:
    f = run / runfiles.HYDRA_OVERRIDES
    if not f.is_file():
        return []
    lines = [ln.removeprefix("- ").strip() for ln in f.read_text().splitlines() if ln.startswith("- ")]
    return [ln for ln in lines if not ln.startswith(("sweep=", "hydra."))]


RESULTS = (runfiles.FAILED, runfiles.SUMMARY, runfiles.PLAN, runfiles.INVALID)  # what a run folder's result is, first match wins


def _plan_memory(p: dict[str, Any]) -> str:
    """The plan's model memory per rank; on CPU plus the rank's own resident memory (torch, TorchTitan),
    which the measured figure (the rank's peak RSS) includes."""
    fit = {True: "fits", False: "DOES NOT FIT", None: "?"}[p["fits_memory"]]
    if p.get("device") != "cpu":  # plans written before the device was recorded: GPU figures
        return f"{p['total_gb_per_gpu']:.3g} GB {fit}"
    over = p["rank_overhead_gb"]
    return f"{p['total_gb_per_gpu'] + over:.3g} GB {fit} ({p['total_gb_per_gpu']:.3g} model + {over:g} rank overhead)"


def load(run: Path) -> dict[str, Any] | None:
    """One row for a run folder; None when it holds no result."""
    label = _overrides(run)
    if (run / runfiles.FAILED).is_file():
        f = json.loads((run / runfiles.FAILED).read_text())
        why = [f"exit code {f['exit_code']}: {f['error']}", f"rank logs: {f['logs']}"] + ([f"report: {f['report']}"] if f["report"] else [])
        return {"run": label or f["overrides"], "source": "failed", "problems": why}
    if (run / runfiles.SUMMARY).is_file():
        s = json.loads((run / runfiles.SUMMARY).read_text())
        cal = s.get("plan_check") or s.get("calibration") or {}  # "calibration": run folders written before the rename
        return {
            "run": label,
            "source": "measured",
            "degrees": s["degrees"],
            "memory": f"{s['memory_gb_max']:.2f} GB peak" if "memory_gb_max" in s else "-",
            "bubble": cal.get("bubble_measured", cal.get("bubble_predicted")),
            "tp_share": None,
            "fits": True,  # it ran
            "step_time_s": s["step_time_s_median"],
            "predicted_s": cal.get("step_time_predicted_s"),  # the predictor on this run's measured peak, or its profile
            "mfu": s["mfu_median"],
            "mfu_note": f"measured, {s.get('flop_convention', 'titan')}",
            "mfu_dtype": s.get("mfu_dtype", s.get("peak_dtype")),
            "mfu_of_gemm_peak": s.get("mfu_of_gemm_peak_median"),
            "gemm_dtype": s.get("peak_dtype"),
            "eval_loss": s.get("eval_loss_final"),  # None for runs without evaluation (eval.interval=0)
            "moe_max_mean": s.get("moe_max_mean_median"),  # MoE runs: the experts' load (runner.observe.moe_load)
            "moe_ep_share": s.get("moe_ep_share_median"),
            "terms_measured": (s.get("profile") or {}).get("terms_s"),  # profile/breakdown.json's busiest rank (profile.*)
            "terms_predicted": cal.get("terms_predicted_s"),
        }
    if (run / runfiles.PLAN).is_file():
        p = json.loads((run / runfiles.PLAN).read_text())
        return {
            "run": label,
            "source": "plan",
            "degrees": p["degrees"],
            "memory": _plan_memory(p),
            "bubble": p["bubble_fraction"],
            "tp_share": p["tp_comm_share"],
            "fits": p["fits_memory"],  # None: the device memory is unknown
            "step_time_s": p["estimated_step_time_s"],
            "predicted_s": p["estimated_step_time_s"],
            "mfu": p["estimated_mfu"],
            "mfu_note": "estimated",
            "mfu_dtype": p.get("peak_dtype"),
            "mfu_of_gemm_peak": p.get("estimated_mfu_of_gemm_peak"),
            "gemm_dtype": p.get("gemm_peak_dtype"),
            "terms_measured": None,
            "terms_predicted": p.get("predicted_terms_s"),
        }
    if (run / runfiles.INVALID).is_file():
        inv = json.loads((run / runfiles.INVALID).read_text())
        return {"run": label, "source": "invalid", "problems": inv["problems"]}
    return None


def collect(paths: list[Path]) -> list[dict[str, Any]]:
    """Rows for every run folder at or below the given paths."""
    runs: list[Path] = []
    for p in paths:
        found = {f.parent for name in RESULTS for f in p.rglob(name)}
        runs += sorted(found - set(runs))
    loaded = [(run, r) for run in runs if (r := load(run)) is not None]
    common = set.intersection(*(set(r["run"]) for _, r in loaded)) if len(loaded) > 1 else set()
    for run, r in loaded:  # label each run by the overrides that set it apart
        r["run"] = " ".join(o.removeprefix("parallelism.") for o in r["run"] if o not in common) or run.name
    return [r for _, r in loaded]
