"""search.verify=k: the top k of mode=search trained briefly on this machine, their measured step times beside the
predicted ones, and whether the ranking held.

The k runs are one Hydra multirun of the sweep the search wrote (`sweep=search_top`, restricted to top1..topk, with
training.steps = search.verify_steps), so torch and TorchTitan are imported once and each run is the sweep's point
exactly as a user would run it. Each job folder's summary.json gives the measured median (the warm-up step left
out); its failed.json or invalid.json the reason it has none. The predicted times are the search's own (the same
cluster.profile), not recomputed. Torch-free: the training happens in the child process.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from runner.config.search import Result
from runner.config.search.render import SWEEP_NAME
from runner.estimate.predict import accuracy
from runner.formats import runfiles
from runner.schema.wording import count

MIN_SPEARMAN = 3  # points a rank correlation needs to say anything


def command(run_dir: Path, k: int, steps: int) -> list[str]:
    """The written sweep, restricted to its first k points (a command-line value replaces the file's sweep list)."""
    points = ",".join(f"top{i}" for i in range(1, k + 1))
    return [
        sys.executable,
        "-m",
        "runner",
        "--config-dir",
        str((run_dir / runfiles.SEARCH_SWEEP).resolve()),
        f"sweep={SWEEP_NAME}",
        f"+{SWEEP_NAME}={points}",
        f"training.steps={steps}",
        "lr_scheduler.warmup_steps=0",  # a few steps to time: no schedule of the recipe's length fits in them
        f"hydra.sweep.dir={(run_dir / runfiles.SEARCH_VERIFY).resolve()}",
    ]


def _candidate(job: Path) -> int | None:
    """Which top<i> a job folder ran, from its recorded overrides (not its job number)."""
    f = job / runfiles.HYDRA_OVERRIDES
    prefix = f"- +{SWEEP_NAME}=top"
    lines = f.read_text().splitlines() if f.is_file() else []
    return next((int(ln.removeprefix(prefix)) for ln in lines if ln.startswith(prefix)), None)


def _outcome(job: Path | None, exit_code: int) -> dict[str, Any]:
    """The measured median of a job folder, or why there is none."""
    if job is not None and (job / runfiles.FAILED).is_file():
        f = json.loads((job / runfiles.FAILED).read_text())
        return {"measured_s": None, "failed": f"exit code {f['exit_code']}: {f['error']}"}
    if job is not None and (job / runfiles.INVALID).is_file():
        return {"measured_s": None, "failed": "invalid: " + "; ".join(json.loads((job / runfiles.INVALID).read_text())["problems"])}
    if job is not None and (job / runfiles.SUMMARY).is_file():
        return {"measured_s": json.loads((job / runfiles.SUMMARY).read_text())["step_time_s_median"], "failed": None}
    return {"measured_s": None, "failed": f"no result (the multirun exited with code {exit_code}; its output is above)"}


def collect(res: Result, run_dir: Path, k: int, steps: int, exit_code: int) -> dict[str, Any]:
    """search.json's "verify": each candidate predicted and measured, the rank correlation and the #1's verdict."""
    folder = run_dir / runfiles.SEARCH_VERIFY
    jobs = {_candidate(j): j for j in folder.iterdir() if j.is_dir()} if folder.is_dir() else {}
    points = []
    for i, r in enumerate(res.ranked[:k], 1):
        out = _outcome(jobs.get(i), exit_code)
        c = r.candidate
        points.append(
            {
                "rank": i,
                "label": r.label,
                "microbatch_size": c.microbatch_size,
                "ac": c.ac.value,
                "predicted_s": r.step_s,
                **out,
                "error": accuracy.error(r.step_s, out["measured_s"]),
                "folder": str(jobs[i]) if i in jobs else None,
            }
        )
    return {"steps": steps, "folder": str(folder), "exit_code": exit_code, "points": points, **agreement(points)}


def agreement(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Spearman of predicted vs measured over the measured points (None under MIN_SPEARMAN), and the best predicted
    of them against the measured fastest: its rank, the fastest's rank, and how much slower it measured."""
    ok = [p for p in points if p["measured_s"] is not None]
    rho = accuracy.spearman([p["predicted_s"] for p in ok], [p["measured_s"] for p in ok]) if len(ok) >= MIN_SPEARMAN else None
    if not ok:
        return {"spearman": None, "first": None, "fastest": None, "first_slower_by": None}
    first, fastest = ok[0], min(ok, key=lambda p: p["measured_s"])
    return {
        "spearman": None if rho is None or math.isnan(rho) else rho,
        "first": first["rank"],
        "fastest": fastest["rank"],
        "first_slower_by": first["measured_s"] / fastest["measured_s"] - 1,
    }


def run(res: Result, run_dir: Path, k: int, steps: int) -> dict[str, Any]:
    """Train the top k (the child's output goes to this console as it comes) and collect what each measured."""
    sys.stdout.flush()  # the search's report before the child's training output
    sys.stderr.flush()
    proc = subprocess.run(command(run_dir, k, steps), check=False)
    return collect(res, run_dir, k, steps, proc.returncode)


def _row(p: dict[str, Any]) -> str:
    head = f"{p['rank']:>3}  {p['label']:<40} {p['microbatch_size']:>3}  {p['ac']:<15} {p['predicted_s']:>13.3f}"
    if p["failed"]:
        return f"{head}  failed: {p['failed']}"
    return f"{head} {p['measured_s']:>13.3f} {100 * p['error']:>+8.1f} %"


def _name(p: dict[str, Any]) -> str:
    """A candidate in words: its layout label repeats across microbatch sizes and AC, so those too."""
    return f"{p['label']}, mbs {p['microbatch_size']}" + (f", AC {p['ac']}" if p["ac"] != "none" else "")


def _verdict(v: dict[str, Any]) -> str:
    pts = {p["rank"]: p for p in v["points"]}
    if v["first"] is None:
        return "no candidate measured: nothing to rank"
    first, fastest = pts[v["first"]], pts[v["fastest"]]
    who = f"predicted #{first['rank']} ({_name(first)})" + (" (the best predicted that ran)" if first["rank"] != 1 else "")
    if first is fastest:
        return f"{who} is the measured fastest"
    return f"{who} measures {100 * v['first_slower_by']:.1f} % slower than the measured fastest, #{fastest['rank']} ({_name(fastest)})"


def lines(v: dict[str, Any]) -> list[str]:
    """The printed table: predicted, measured median and error per candidate; below it the rank agreement."""
    measured = [p for p in v["points"] if p["measured_s"] is not None]
    k = len(v["points"])
    if v["spearman"] is not None:
        rho = f"Spearman {v['spearman']:.2f} over {count(len(measured), 'measured candidate')}"
    elif len(measured) < MIN_SPEARMAN:
        rho = f"Spearman needs >= {MIN_SPEARMAN} measured candidates, {len(measured)} measured"
    else:
        rho = f"Spearman undefined over {count(len(measured), 'measured candidate')} (every time equal)"
    return [
        f"verify: the top {k} trained here for {v['steps']} steps each (measured: median step time after the warm-up "
        f"step), in {v['folder']}",
        f"{'#':>3}  {'layout':<40} {'mbs':>3}  {'AC':<15} {'predicted (s)':>13} {'measured (s)':>13} {'error':>10}",
        *(_row(p) for p in v["points"]),
        f"rank agreement, predicted vs measured: {rho}",
        _verdict(v),
    ]


def write(path: Path, v: dict[str, Any]) -> None:
    """Add the verify block to the search.json the search wrote."""
    found = json.loads(path.read_text())
    path.write_text(json.dumps(found | {"verify": v}, indent=2) + "\n")
