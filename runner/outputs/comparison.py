"""`python -m runner.compare <run folders or multirun folders>`: one table and one plot.

Torch-free. Reads what each run folder holds (runner.outputs.run_rows): summary.json (a measured run), plan.json
(mode=plan), invalid.json (a sweep point that failed validation), failed.json (a run whose
ranks failed). Measured runs are compared by their measured step time and MFU, plans by the
predicted ones; a measured run also shows the step time the predictor gave it (summary.json's
calibration block) and the error, so a sweep's folder shows both. A layout that does not fit in device
memory is marked and ranked after every one that fits, in the table and the figure; invalid and failed
points are listed with their reason in both. No W&B account needed. Also home of `spearman`, the rank agreement of
predicted and measured times (mode=search's verify, bench/predictor_grid.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from runner.estimate.predict.accuracy import error
from runner.formats import runfiles
from runner.outputs import breakdown as breakdown_terms
from runner.outputs.run_rows import collect
from runner.schema.wording import count


def _sort_key(r: dict[str, Any]) -> tuple:
    """Layouts that fit by step time, then those that do not fit in device memory (a fast plan that cannot run
    ranks after every one that can), then invalid and failed points."""
    t = r.get("step_time_s")
    return (r["source"] in ("invalid", "failed"), r.get("fits") is False, t is None, t or 0.0)


def _unfit(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["source"] not in ("invalid", "failed") and r.get("fits") is False]


def _unfit_note(rows: list[dict[str, Any]]) -> str | None:
    n = len(_unfit(rows))
    if not n:
        return None
    return f"{count(n, 'layout')} {'does' if n == 1 else 'do'} not fit in device memory: ranked after those that fit"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _mfu_cell(r: dict[str, Any]) -> str:
    """MFU against param_dtype's (bf16) peak, comparable across precisions; under FP8 also mfu_of_gemm_peak, against the
    peak of the dtype the GEMMs run in (float8)."""
    dtype = f" of {r['mfu_dtype']}" if r.get("mfu_dtype") else ""
    cell = f"{_pct(r['mfu'])}{dtype} ({r['mfu_note']})"
    if r.get("mfu_of_gemm_peak") is not None and r.get("gemm_dtype") != r.get("mfu_dtype"):
        cell += f"\n{_pct(r['mfu_of_gemm_peak'])} of {r['gemm_dtype']} (mfu_of_gemm_peak)"
    return cell


def _error(r: dict[str, Any]) -> str:
    """A measured run's prediction error; a plan has nothing measured to be wrong against."""
    e = error(r["predicted_s"], r["step_time_s"]) if r["source"] == "measured" else None
    return "-" if e is None else f"{100 * e:+.1f} %"


def _moe_cell(r: dict[str, Any]) -> str:
    """The median over logged windows of the worst layer's max/mean, and with EP the busiest EP rank's share."""
    if r.get("moe_max_mean") is None:
        return "-"
    share = r.get("moe_ep_share")
    return f"{r['moe_max_mean']:.2f} x" + ("" if share is None else f", {100 * share:.1f} %")


def table(rows: list[dict[str, Any]]):
    from rich.table import Table

    note = _unfit_note(rows)
    t = Table(title="layouts by step time", title_justify="left", caption=note and f"{note} (yellow)", caption_justify="left")
    moe = any(r.get("moe_max_mean") is not None for r in rows)  # a column only beside MoE runs
    for col in ("run", "layout", "source", "memory / rank", "bubble", "TP share", "step time", "predicted", "error", "MFU", "eval loss"):
        t.add_column(col)
    if moe:
        t.add_column("experts max/mean, EP share")
    for r in sorted(rows, key=_sort_key):
        if r["source"] in ("invalid", "failed"):
            t.add_row(r["run"], "-", r["source"], "\n".join(r["problems"]), "", "", "", "", "", "", "", *([""] if moe else []), style="red")
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
            _mfu_cell(r),
            "-" if r.get("eval_loss") is None else f"{r['eval_loss']:.4f}",
            *([_moe_cell(r)] if moe else []),
            style="yellow" if r.get("fits") is False else None,
        )
    return t


TERMS = breakdown_terms.TERMS
"""The predictor's terms (runner.estimate.predict.steptime.TERMS) and the breakdown's two more (runner.outputs.breakdown)."""
MEASURED_ONLY = ("data_wait", "unattributed")  # the predictor has no such terms


def _with_terms(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in sorted(rows, key=_sort_key) if r.get("terms_measured") or r.get("terms_predicted")]


def _shown_terms(rows: list[dict[str, Any]]) -> list[str]:
    """Terms that hold time in some row (measured or predicted), in TERMS order."""
    return [k for k in TERMS if any(((r.get(w) or {}).get(k) or 0) >= 5e-4 for r in rows for w in ("terms_measured", "terms_predicted"))]


def gap_term(r: dict[str, Any]) -> tuple[str, float] | None:
    """The term whose measured time exceeds its prediction most (what explains a slow layout), and by how much (s)."""
    m, p = r.get("terms_measured"), r.get("terms_predicted")
    if not m or not p:
        return None
    k = max(TERMS, key=lambda k: m.get(k, 0.0) - p.get(k, 0.0))
    return k, m.get(k, 0.0) - p.get(k, 0.0)


def _term_cell(m: float | None, p: float | None) -> str:
    if m is None:
        return "-" if p is None else f"- / {p:.3f}"
    if p is None:
        return f"{m:.3f}"
    return f"{m:.3f} / {p:.3f}" + (f" ({m / p:.2f})" if p >= 5e-4 else "")


def terms_table(rows: list[dict[str, Any]]):
    """Where each layout's step time goes: per term, seconds measured on the busiest traced rank / predicted (ratio);
    measured alone without a prediction (a CPU without a machine profile), predicted alone for a plan; None when no row
    has terms (nothing traced, nothing predicted)."""
    from rich.table import Table

    shown = _with_terms(rows)
    if not shown or not any(r.get("terms_measured") for r in shown):
        return None
    keys = _shown_terms(shown)
    t = Table(title="where the step time goes (s per step by term, measured / predicted (ratio); profile/breakdown.json)")
    for col in ("run", "layout", *keys, "largest gap"):
        t.add_column(col)
    for r in shown:
        m, p = r.get("terms_measured"), r.get("terms_predicted")
        cells = [_term_cell(None if m is None else m.get(k, 0.0), None if p is None or k in MEASURED_ONLY else p.get(k, 0.0)) for k in keys]
        gap = gap_term(r)
        t.add_row(r["run"], r["degrees"], *cells, "-" if gap is None else f"{gap[0]} +{gap[1]:.3f} s")
    return t


def _term_bars(ax, rows: list[dict[str, Any]]) -> None:
    """Per layout a predicted and a measured bar, each stacked by term in one colour per term, and beside the measured
    one the term that explains the gap."""
    import matplotlib.pyplot as plt

    keys = _shown_terms(rows)
    colors = dict(
        zip(TERMS, [*plt.get_cmap("tab20").colors[: len(TERMS) - 2], "dimgrey", "black"], strict=True)
    )  # one colour per term in every plot
    labels, ys, y, widest = [], [], 0.0, 0.0
    for r in rows:
        for which, name in (("terms_predicted", "predicted"), ("terms_measured", "measured")):
            terms = r.get(which) or {}
            labels.append(f"{r['run'] or r['degrees']}  {name}")
            ys.append(y)
            left = 0.0
            for k in keys:
                ax.barh(y, terms.get(k, 0.0), left=left, color=colors[k], label=k if len(labels) == 1 else None)
                left += terms.get(k, 0.0)
            ax.annotate(_bar_note(r, which, left), (left, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
            widest = max(widest, left)
            y += 1
        y += 0.5
    ax.set_yticks(ys, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step by term: the predictor's, and the busiest traced rank's (profile/breakdown.json)")
    ax.legend(fontsize=7, ncol=len(keys), loc="lower left", bbox_to_anchor=(0, 1.0), frameon=False)
    ax.set_xlim(0, 1.7 * widest or 1)


def _bar_note(r: dict[str, Any], which: str, total: float) -> str:
    if not r.get(which):
        return "no prediction (no machine profile)" if which == "terms_predicted" else "not traced (profile.steps)"
    gap = gap_term(r) if which == "terms_measured" else None
    return f"{total:.3g} s" + (f"; the gap is mostly {gap[0]} (+{gap[1]:.3g} s)" if gap else "")


NOT_DRAWN_WIDTH = 120
"""Characters of a point's reason in the figure's list of points without a bar (the table has it whole)."""


def _not_drawn(rows: list[dict[str, Any]]) -> list[str]:
    """One line per invalid or failed point: its label, what it is and its first reason."""
    import textwrap

    out = []
    for r in sorted((r for r in rows if r["source"] in ("invalid", "failed")), key=lambda r: r["run"]):
        out.append(textwrap.shorten(f"{r['run']} ({r['source']}): {r['problems'][0]}", NOT_DRAWN_WIDTH, placeholder=" ..."))
    return out


def _bars(ax, valid: list[dict[str, Any]], measured: bool) -> None:
    """One bar per layout; those that do not fit are grey, hatched and say so, below a line under the ones that fit."""
    values = [100 * r["mfu"] if measured else r["step_time_s"] for r in valid]
    unfit = [r.get("fits") is False for r in valid]
    colors = ["lightgrey" if u else ("tab:green" if measured else "tab:blue") for u in unfit]
    bars = ax.barh([r["run"] or r["degrees"] for r in valid], values, color=colors)
    for bar, u in zip(bars, unfit, strict=True):
        if u:
            bar.set_hatch("//")
            bar.set_edgecolor("tab:red")
    ax.invert_yaxis()
    ax.set_xlabel("measured MFU (%)" if measured else "step time (s; predicted for plans, measured for runs)")
    for y, (v, r, u) in enumerate(zip(values, valid, unfit, strict=True)):
        text = f"{v:.3g} {'%' if measured else 's'}" + (f"  {r['memory'].split(' (')[0]}" if u else "")
        ax.annotate(text, (v, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8, color="tab:red" if u else "black")
    if any(unfit):
        ax.axhline(unfit.index(True) - 0.5, color="tab:red", linestyle="--", linewidth=0.8)
        ax.set_title(_unfit_note(valid) + " (hatched)", fontsize=9, loc="left", color="tab:red")
    ax.margins(x=0.25)


def figure(rows: list[dict[str, Any]]):
    """The comparison figure: bars in the table's order (measured MFU when every run was measured, else step
    time); for the traced runs (profile.*) their step time stacked by term, predicted beside measured; under them the
    invalid and failed points that have no bar, each with its reason; None without rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    valid = sorted((r for r in rows if r["source"] not in ("invalid", "failed") and r["step_time_s"] is not None), key=_sort_key)
    missing = _not_drawn(rows)
    if not valid and not missing:
        return None
    split = [r for r in _with_terms(valid) if r.get("terms_measured")]
    heights = ([0.4 * len(valid) + 1.2] if valid else []) + ([0.75 * len(split) + 1.4] if split else [])
    heights += [0.17 * len(missing) + 0.3] if missing else []
    fig, axes = plt.subplots(len(heights), 1, figsize=(11, sum(heights) + 0.3), height_ratios=heights, squeeze=False)
    if valid:
        _bars(axes[0][0], valid, all(r["source"] == "measured" for r in valid))
    if split:
        _term_bars(axes[1][0], split)
    if missing:
        ax = axes[-1][0]
        ax.axis("off")
        listed = "\n".join([f"not drawn: {count(len(missing), 'point')} without a result", *missing])
        ax.text(0, 1, listed, va="top", fontsize=8, family="monospace")
    fig.tight_layout()
    return fig


def plot(rows: list[dict[str, Any]], out: Path) -> Path | None:
    """Save `figure(rows)` as a PNG; None when there is nothing to draw."""
    fig = figure(rows)
    if fig is None:
        return None
    import matplotlib.pyplot as plt

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
    by_term = terms_table(rows)
    if by_term is not None:
        console.print(by_term)
    out = plot(rows, args.plot or plot_folder(args.paths) / runfiles.PLOT)
    if out:
        console.print(f"plot saved to {out}")
    return 0


def cli() -> None:
    """`python -m runner.compare` (runner/compare.py)."""
    sys.exit(main())
