"""Rules for evaluation on held-out data (torch-free): eval.* and the held-out split of data=text.

`check` is about the config alone (called by validate.check); `files` looks for the held-out files on this machine
before any process starts (walked by the preflight, in mode=validate and mode=train).
"""

from __future__ import annotations

import math
from pathlib import Path

from runner.schema import DataSource, RunConfig
from runner.schema.problems import Problem


def check(cfg: RunConfig, out: list[Problem]) -> None:
    e, d = cfg.eval, cfg.data
    if e.interval < 0:
        out.append(Problem("eval.interval", e.interval, "must be >= 0", "evaluate every N >= 1 steps, or use 0 for no evaluation"))
    if e.steps < 1:
        out.append(Problem("eval.steps", e.steps, "an evaluation pass reads at least one batch", "use e.g. eval.steps=4"))
    if not (math.isfinite(d.eval_fraction) and 0 <= d.eval_fraction < 1):
        out.append(
            Problem(
                "data.eval_fraction", d.eval_fraction, "is the fraction of documents held out, in [0, 1)", "use e.g. 0.01, or 0 for none"
            )
        )
    elif d.eval_fraction > 0 and d.eval_files:
        out.append(
            Problem(
                "data.eval_fraction",
                d.eval_fraction,
                "held-out documents and held-out files (data.eval_files) are two held-out splits; the run reads one",
                "set data.eval_fraction=0 to evaluate on data.eval_files, or data.eval_files=[] to hold out documents",
            )
        )
    if cfg.objective.value == "eval_loss" and cfg.mode.value == "train" and e.interval == 0:
        out.append(
            Problem(
                "objective",
                "eval_loss",
                "the run evaluates nothing (eval.interval=0)",
                "set e.g. eval.interval=50, or objective=final_loss",
            )
        )
    if e.interval > 0 and d.name == DataSource.text and not d.eval_files and not d.eval_fraction > 0:
        out.append(
            Problem(
                "data.eval_files",
                [],
                f"eval.interval={e.interval} evaluates on held-out data, and data=text has no held-out split",
                "list held-out files: data.eval_files=[val.jsonl], or hold out documents of data.files: data.eval_fraction=0.01",
            )
        )


def files(cfg: RunConfig, out: list[Problem]) -> None:
    """The held-out files must exist where the ranks start (paths relative to where `python -m runner` starts)."""
    d = cfg.data
    if d.name != DataSource.text or cfg.eval.interval == 0:
        return
    missing = [f for f in d.eval_files if not Path(f).is_file()]
    if missing:
        out.append(
            Problem(
                "data.eval_files", missing, "not found (paths are relative to where `python -m runner` starts)", "give existing local files"
            )
        )
