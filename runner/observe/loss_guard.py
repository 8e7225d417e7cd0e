"""The loss-spike guard: running medians of accepted losses and grad norms, and its verdict on each step.

Plain Python, unit-tested without ranks; the step loop (runner.run.step_loop) asks it about every step before the
optimizer acts, and a flagged step may be replayed (runner.observe.attribution) and reverted here when hardware is to blame.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from runner.schema import GuardAction, LossGuardConfig


@dataclass
class Verdict:
    spike: str | None
    """Why the step is bad (None: it is fine)."""
    action: str
    """ok | skip | rewind | accept (a spike after max_consecutive skipped ones: trained, the medians restart from it)"""
    metric: str = ""
    """What spiked: loss | grad_norm (empty when fine)."""
    value: float = 0.0
    """Its value at the step."""
    median: float = 0.0
    """Its running median before the step (nan before warm-up, for a non-finite step)."""
    why: str = ""
    """Why an accepted spike was accepted (the console line's end)."""


class LossGuard:
    """Running medians of accepted losses and grad norms; a spike is a value above factor x median, or non-finite.

    Finite spikes in a row (`finite`) decide a level shift; non-finite steps neither count nor break that run, so a
    spike right after them is judged against the medians before them. `rewound_at` is the step of the last rewind and
    `after_rewind` the first step judged past it: a streak starting there that reaches max_consecutive again is the
    same shift, which persisted across the rewind, and is accepted instead of rewinding a second time."""

    def __init__(self, cfg: LossGuardConfig):
        self.cfg = cfg
        self.losses: deque[float] = deque(maxlen=cfg.window)
        self.norms: deque[float] = deque(maxlen=cfg.window)
        self.consecutive = self.finite = 0
        self.streak_start = 0
        self.rewound_at = self.after_rewind = 0
        self.bad_steps: set[int] = set()
        self.skipped = 0
        self.rewinds = 0
        self._before: dict[str, Any] | None = None  # the state before the last flagged step (revert)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps, so a resumed run judges later steps exactly as the uninterrupted one."""
        return {
            "losses": list(self.losses),
            "norms": list(self.norms),
            "consecutive": self.consecutive,
            "finite": self.finite,
            "streak_start": self.streak_start,
            "rewound_at": self.rewound_at,
            "after_rewind": self.after_rewind,
            "bad_steps": sorted(self.bad_steps),
            "skipped": self.skipped,
            "rewinds": self.rewinds,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses.clear()
        self.losses.extend(state["losses"])
        self.norms.clear()
        self.norms.extend(state["norms"])
        self.consecutive, self.streak_start = state["consecutive"], state["streak_start"]
        # checkpoints written before the level-shift bookkeeping existed lack these three
        self.finite = state.get("finite", state["consecutive"])
        self.rewound_at, self.after_rewind = state.get("rewound_at", 0), state.get("after_rewind", 0)
        self.bad_steps = set(state["bad_steps"])
        self.skipped, self.rewinds = state["skipped"], state["rewinds"]

    def _spike(self, loss: float, grad_norm: float) -> Verdict | None:
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):  # caught even with the guard off
            metric, value = ("loss", loss) if not math.isfinite(loss) else ("grad_norm", grad_norm)
            median = statistics.median(self.losses if metric == "loss" else self.norms) if self.losses else math.nan
            return Verdict(f"non-finite (loss {loss}, grad norm {grad_norm})", "skip", metric, value, median)
        if not self.cfg.enable or len(self.losses) < max(1, self.cfg.warmup_steps):
            return None
        f = self.cfg.factor
        lm, gm = statistics.median(self.losses), statistics.median(self.norms)
        if loss > f * lm:
            return Verdict(f"loss {loss:.4g} > {f:g} x running median {lm:.4g}", "skip", "loss", loss, lm)
        if grad_norm > f * gm:
            return Verdict(f"grad norm {grad_norm:.4g} > {f:g} x running median {gm:.4g}", "skip", "grad_norm", grad_norm, gm)
        return None

    def check(self, step: int, loss: float, grad_norm: float) -> Verdict:
        verdict = self._spike(loss, grad_norm)
        if self.rewound_at and not self.after_rewind and step > self.rewound_at:
            self.after_rewind = step  # the first step judged past the batches the rewind left out
        if verdict is None:
            self.consecutive = self.finite = 0
            self.losses.append(loss)
            self.norms.append(grad_norm)
            return Verdict(None, "ok")
        self._before = self.state_dict()
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        self.bad_steps.add(step)
        self.skipped += 1
        self.consecutive += 1
        self.finite += finite
        if self.consecutive == 1:
            self.streak_start = step
        m = self.cfg.max_consecutive
        if self.cfg.action == GuardAction.rewind and self.consecutive >= m:
            if finite and self.finite >= m and self.streak_start == self.after_rewind:
                why = f"again right after the rewind at step {self.rewound_at}: a lasting level shift, not a spike"
                why += ": accepted, no second rewind"
                return self._accept(step, loss, grad_norm, verdict, why)
            self.consecutive = self.finite = 0
            self.rewinds += 1
            self.rewound_at, self.after_rewind = step, 0
            verdict.action = "rewind"
            return verdict
        if self.cfg.action == GuardAction.skip and finite and self.finite > m:
            return self._accept(step, loss, grad_norm, verdict, f"after {m} skipped steps in a row: accepted as a new level")
        return verdict

    def _accept(self, step: int, loss: float, grad_norm: float, verdict: Verdict, why: str) -> Verdict:
        """A level shift, not a spike: train on the step and judge later ones from the new level."""
        self.bad_steps.discard(step)
        self.skipped -= 1
        self.consecutive = self.finite = 0
        self.rewound_at = self.after_rewind = 0
        self.losses.clear()
        self.norms.clear()
        self.losses.append(loss)
        self.norms.append(grad_norm)
        verdict.action, verdict.why = "accept", why
        return verdict

    def revert(self) -> None:
        """Undo the last flagged step's bookkeeping: it was no spike of the data (runner.observe.attribution: hardware)."""
        if self._before is not None:
            self.load_state_dict(self._before)
            self._before = None

    def describe(self, step: int, verdict: Verdict) -> str:
        """The console's line for an accepted spike: the step, its value against the median, what the guard did."""
        return f"loss guard: step {step}: {verdict.spike} {verdict.why}, the running medians restart from this step"
