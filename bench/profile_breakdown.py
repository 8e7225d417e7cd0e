"""Benchmark: where the step time goes, measured from a traced step, beside the predictor's terms.

python bench/profile_breakdown.py [--profile machine_profile.json | --measured-only] [--steps 4] [--trace 3] [--out bench_out]
python bench/profile_breakdown.py --report-from bench_out/profile_breakdown.json --profile machine_profile.json

Trains the default run (dp2_tp2) and tp2_pp2, cp2 and dp2_pp2 in one Hydra multirun with profile.steps=[--trace]
and the machine profile as cluster.profile (without --profile the machine is calibrated first, as
bench/predictor_grid.py does), then prints for each layout every term measured on the busiest traced rank
(profile/breakdown.json) beside the predictor's, with the ratio, and the predictor's largest term error
(the term whose measured and predicted seconds differ most). bench/README.md holds the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runner.config import points as points_file  # noqa: E402
from runner.formats import runfiles  # noqa: E402
from runner.outputs.comparison import TERMS, gap_term  # noqa: E402

LAYOUTS = {
    "default (dp2_tp2)": [],
    "tp2_pp2": ["parallelism=tp2_pp2"],
    "cp2": ["parallelism=cp2"],
    "dp2_pp2": ["parallelism=dp2_pp2"],
}
COMMON = ["logging.progress=false"]


def calibrate(out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "runner.calibrate", "--out", str(out)], cwd=ROOT, check=True)
    return out


def measure(steps: int, trace: int, profile: Path | None, folder: Path) -> dict[str, dict | None]:
    """Each layout's summary.json after one multirun (None for a point that failed)."""
    names = points_file.write({f"p{i}": [*COMMON, *o] for i, o in enumerate(LAYOUTS.values())}, folder / "points")
    argv = [sys.executable, "-m", "runner", "-m", *points_file.argv(names, folder / "points")]
    argv += [f"training.steps={steps}", f"profile.steps=[{trace}]", f"hydra.sweep.dir={folder / 'sweep'}"]
    argv += [f"cluster.profile={profile}"] if profile else ["cluster.peak_cache_dir=null"]  # measured alone: no cached profile either
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode:
        print(proc.stderr[-3000:], file=sys.stderr)
    out = {}
    for i, name in enumerate(LAYOUTS):
        path = folder / "sweep" / str(i) / runfiles.SUMMARY
        out[name] = json.loads(path.read_text()) if path.is_file() else None
        if out[name] is not None:
            out[name]["overrides"] = [*COMMON, *LAYOUTS[name], f"training.steps={steps}"]
    return out


def predicted_terms(s: dict, profile: Path | None) -> dict:
    """The predictor's terms for the point: the run's own calibration block, or, for a run without a profile, the
    predictor on `profile` (the same arithmetic, torch-free)."""
    own = s["calibration"].get("terms_predicted_s")
    if own or profile is None:
        return own or {}
    from runner.config import compose, validate
    from runner.estimate.predict import steptime

    cfg = compose.compose([*s["overrides"], f"cluster.profile={profile}"])
    return steptime.predict(cfg, validate.check(cfg)).terms


def report(found: dict[str, dict | None], profile: Path | None) -> dict[str, dict]:
    from rich.console import Console
    from rich.table import Table

    console, result = Console(highlight=False, width=160), {}
    for name, s in found.items():
        if s is None or not s.get("profile"):
            console.print(f"{name}: failed or not traced")
            continue
        m, p = s["profile"]["terms_s"], predicted_terms(s, profile)
        t = Table(title=f"{name} [{s['degrees']}]: busiest traced rank {s['profile']['busiest_rank']}", title_justify="left")
        for col in ("term", "measured s", "predicted s", "measured/predicted", "measured - predicted s"):
            t.add_column(col, justify="left" if col == "term" else "right")
        for k in TERMS:
            if m.get(k, 0.0) < 5e-4 and p.get(k, 0.0) < 5e-4:
                continue
            pk = p.get(k)
            ratio = f"{m[k] / pk:.2f}" if pk and pk >= 5e-4 else "-"
            t.add_row(k, f"{m[k]:.3f}", "-" if pk is None else f"{pk:.3f}", ratio, "-" if pk is None else f"{m[k] - pk:+.3f}")
        pred_total = sum(p.values()) if p else None
        t.add_row("step (traced span)", f"{s['profile']['step_s']:.3f}", "-" if pred_total is None else f"{pred_total:.3f}", "", "")
        console.print(t)
        worst = max((k for k in TERMS if k in p), key=lambda k: abs(m.get(k, 0.0) - p[k]), default=None)
        if worst:
            console.print(
                f"{name}: largest term error {worst} {m[worst] - p[worst]:+.3f} s (measured {m[worst]:.3f}, predicted {p[worst]:.3f})"
            )
        result[name] = {"measured": m, "predicted": p, "largest_error": worst, "gap": gap_term({"terms_measured": m, "terms_predicted": p})}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", type=Path, help="machine profile; default: calibrate this machine first")
    ap.add_argument("--measured-only", action="store_true", help="no machine profile, no calibration: the measured terms alone")
    ap.add_argument("--report-from", type=Path, help="print an earlier run's profile_breakdown.json beside --profile's prediction")
    ap.add_argument("--steps", type=int, default=4, help="steps per run")
    ap.add_argument("--trace", type=int, default=3, help="the traced step (after warm-up steps)")
    ap.add_argument("--out", type=Path, default=Path("bench_out"), help="folder for the profile and the JSON result")
    a = ap.parse_args()
    started = time.perf_counter()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.report_from:  # the summaries of an earlier run of this bench, set beside --profile's prediction
        report(json.loads(a.report_from.read_text())["summaries"], a.profile and a.profile.resolve())
        return
    profile = None if a.measured_only else (a.profile or calibrate(a.out / "machine_profile.json")).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        found = measure(a.steps, a.trace, profile, Path(tmp))
    result = report(found, profile)
    (a.out / "profile_breakdown.json").write_text(json.dumps({"summaries": found, "result": result}, indent=1) + "\n")
    load = os.getloadavg()
    print(f"bench wall time {time.perf_counter() - started:.0f} s; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


if __name__ == "__main__":
    main()
