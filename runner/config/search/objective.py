"""The number `python -m runner` returns to Hydra, for the sweepers that optimize (Optuna, Nevergrad, Ax).

Torch-free. `objective` picks the figure; every objective is minimized (MFU is negated). A point that is
invalid, failed, or has no such figure returns +inf: Optuna records it as a completed trial that is worse
than any other (hydra-optuna-sweeper 1.2 turns NaN into a failed tell that stops the whole sweep).
"""

from __future__ import annotations

import math
from typing import Any

from runner.schema import Objective, RunConfig
from runner.schema.problems import ConfigError, Problem

WORST = math.inf


def _finite(x: float | None) -> float:
    return WORST if x is None or not math.isfinite(x) else float(x)


def of_plan(cfg: RunConfig, budget: dict[str, Any]) -> float:
    """A plan's figure: the predicted step time, or the predicted MFU negated."""
    if cfg.objective == Objective.neg_mfu:
        mfu = budget["estimated_mfu"]
        return WORST if mfu is None else -mfu
    return _finite(budget["estimated_step_time_s"])


def of_run(cfg: RunConfig, summary: dict[str, Any]) -> float:
    """A training run's figure from its summary.json: median step time, median MFU negated, final or eval loss."""
    o = cfg.objective
    if o == Objective.neg_mfu:
        return -summary["mfu_median"]
    if o == Objective.final_loss:
        return _finite(summary["final_loss"])
    if o == Objective.eval_loss:
        if summary.get("eval_loss_final") is None:
            raise ConfigError(
                [
                    Problem(
                        "objective",
                        o.value,
                        "the run's summary.json has no eval_loss_final (the run evaluated nothing)",
                        "set e.g. eval.interval=50, or use objective=final_loss",
                    )
                ]
            )
        return _finite(summary["eval_loss_final"])
    return _finite(summary["step_time_s_median"])
