"""`python -m runner.compare <run folders or multirun folders>`: one table and one plot.

Torch-free. Reads what each run folder holds: summary.json (a measured run), plan.json
(mode=plan), invalid.json (a sweep point that failed validation), failed.json (a run whose
ranks failed). Measured runs are compared by their measured step time and MFU, plans by the
predicted ones; a measured run also shows the step time the predictor gave it (summary.json's
calibration block) and the error, so a sweep's folder shows both. Invalid and failed points are
listed with their reason. No W&B account needed. Also home of `spearman`, the rank agreement of
predicted and measured times (mode=search's verify, bench/predictor_grid.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from runner.config import runfiles


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
        cal = s.get("calibration", {})
        return {
            "run": label,
            "source": "measured",
            "degrees": s["degrees"],
            "memory": f"{s['memory_gb_max']:.2f} GB peak" if "memory_gb_max" in s else "-",
            "bubble": cal.get("bubble_measured", cal.get("bubble_predicted")),
            "tp_share": None,
            "step_time_s": s["step_time_s_median"],
            "predicted_s": cal.get("step_time_predicted_s"),  # the predictor on this run's measured peak, or its profile
            "mfu": s["mfu_median"],
            "mfu_note": f"measured, {s.get('flop_convention', 'titan')}",
            "eval_loss": s.get("eval_loss_final"),  # None for runs without evaluation (eval.interval=0)
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
            "step_time_s": p["estimated_step_time_s"],
            "predicted_s": p["estimated_step_time_s"],
            "mfu": p["estimated_mfu"],
            "mfu_note": "estimated",
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


def _sort_key(r: dict[str, Any]) -> tuple:
    t = r.get("step_time_s")
    return (r["source"] in ("invalid", "failed"), t is None, t or 0.0)


def _ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=xs.__getitem__)
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Pearson correlation of the ranks (ties get their mean rank)."""
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def error(predicted: float | None, measured: float | None) -> float | None:
    """The prediction's error as bench/predictor_grid.py counts it: predicted / measured - 1 (negative: too fast)."""
    return predicted / measured - 1 if predicted and measured else None


def _error(r: dict[str, Any]) -> str:
    """A measured run's prediction error; a plan has nothing measured to be wrong against."""
    e = error(r["predicted_s"], r["step_time_s"]) if r["source"] == "measured" else None
    return "-" if e is None else f"{100 * e:+.1f} %"


def table(rows: list[dict[str, Any]]):
    from rich.table import Table

    t = Table(title="layouts by step time", title_justify="left")
    for col in ("run", "layout", "source", "memory / rank", "bubble", "TP share", "step time", "predicted", "error", "MFU", "eval loss"):
        t.add_column(col)
    for r in sorted(rows, key=_sort_key):
        if r["source"] in ("invalid", "failed"):
            t.add_row(r["run"], "-", r["source"], "\n".join(r["problems"]), "", "", "", "", "", "", "", style="red")
            continue
        step = "-" if r["step_time_s"] is None else f"{r['step_time_s']:.3f} s"
        pred = "-" if r["predicted_s"] is None else f"{r['predicted_s']:.3f} s"
        t.add_row(
            r["run"],
            r["degrees"],
            r["source"],
            r["memory"],
            _pct(r["bubble"]),
            _pct(r["tp_share"]),
            step,
            pred,
            _error(r),
            f"{_pct(r['mfu'])} ({r['mfu_note']})",
            "-" if r.get("eval_loss") is None else f"{r['eval_loss']:.4f}",
        )
    return t


def plot(rows: list[dict[str, Any]], out: Path) -> Path | None:
    """Horizontal bars: measured MFU when every run was measured, else step time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    valid = sorted((r for r in rows if r["source"] not in ("invalid", "failed") and r["step_time_s"] is not None), key=_sort_key)
    if not valid:
        return None
    measured = all(r["source"] == "measured" for r in valid)
    values = [100 * r["mfu"] if measured else r["step_time_s"] for r in valid]
    labels = [r["run"] or r["degrees"] for r in valid]
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(valid) + 1.5))
    ax.barh(labels, values, color="tab:green" if measured else "tab:blue")
    ax.invert_yaxis()
    ax.set_xlabel("measured MFU (%)" if measured else "step time (s; predicted for plans, measured for runs)")
    for y, v in enumerate(values):
        ax.annotate(f"{v:.3g}", (v, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_folder(paths: list[Path]) -> Path:
    """Where the plot goes by default: the folder the paths share (the sweep folder of its runs, a run
    folder given alone), but never a failed or invalid point's folder: its parent instead."""
    folder = Path(os.path.commonpath([p.resolve() for p in paths]))
    if (folder / runfiles.FAILED).is_file() or (folder / runfiles.INVALID).is_file():
        return folder.parent
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runner.compare", description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", type=Path, help="run folders or multirun folders")
    ap.add_argument("--plot", type=Path, default=None, help=f"PNG path (default: <common folder of the paths>/{runfiles.PLOT})")
    args = ap.parse_args(argv)
    missing = [str(p) for p in args.paths if not p.is_dir()]
    if missing:
        print(f"paths = {' '.join(missing)}: not a folder. Fix: pass run folders or a multirun folder.", file=sys.stderr)
        return 2
    rows = collect(args.paths)
    if not rows:
        names = f"{runfiles.SUMMARY}, {runfiles.PLAN}, {runfiles.INVALID} or {runfiles.FAILED}"
        print(f"paths = {' '.join(map(str, args.paths))}: no run folder below them holds {names}. Fix: point at runs.", file=sys.stderr)
        return 2
    from rich.console import Console

    console = Console(highlight=False, width=240)  # wide enough for a failed run's reason on one line beside 11 columns
    console.print(table(rows))
    out = plot(rows, args.plot or plot_folder(args.paths) / runfiles.PLOT)
    if out:
        console.print(f"plot saved to {out}")
    return 0


def cli() -> None:
    """`python -m runner.compare` (runner/compare.py)."""
    sys.exit(main())
