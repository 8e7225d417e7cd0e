"""Observers of the step loop: phase timing and the straggler monitor.

`StragglerJudge` and `ArrivalJudge` are plain Python (unit-tested without ranks); the loss-spike guard is
runner.observe.loss_guard. `StepMonitor` is what the step loop calls at its phase boundaries: it times each phase on
the policy's clock, the step and its waits inside collectives on the policy's timeline clock (runner.observe.waits: a
rank's own work is the step less its waits), tells the rank's record (runner.observe.rank_recorder) where the rank is,
and every `monitor.straggler.interval` steps gathers the per-rank medians in one small all-gather. The test-only faults a
run may plant are runner.observe.fault_injection's (`faults`, the rank's set, struck at the phase boundaries).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from runner.formats import runfiles
from runner.observe.fault_injection import Faults
from runner.schema import MonitorConfig, StragglerConfig

JUDGED = ("forward", "backward", "optimizer", "pp_compute", "own")
"""Phases whose slowness makes a straggler; `own` is the step on the timeline clock less its waits inside collectives
(a rank slowed from outside accrues no CPU time, but its own work grows). Waiting (pp_wait, waits, the loss exchange)
is a symptom of someone else."""
TIMED = (*JUDGED, "pp_wait", "waits")


class StragglerJudge:
    """Per window: which (rank, phase) are above factor x median over ranks, for `windows` windows in a row.

    A phase too short to judge (median under `min_seconds`), or an excess over the median too small in seconds
    (`min_excess_s`) or against the median step (`min_step_frac`), is noise: an oversubscribed CPU host stretches
    a few-ms phase by 1.3x on any rank now and then (docs/monitoring.md)."""

    def __init__(self, cfg: StragglerConfig, phases: tuple[str, ...] = JUDGED):
        self.cfg, self.phases = cfg, phases
        self.streak: dict[tuple[int, str], int] = {}

    def update(self, window: list[dict[str, float]]) -> list[dict[str, Any]]:
        """window[rank][phase] = that rank's median seconds in the window (its step: own + waits). Returns the
        flagged (rank, phase)."""
        flagged = []
        step_s = statistics.median(w.get("own", 0.0) + w.get("waits", 0.0) for w in window)
        floor = max(self.cfg.min_excess_s, self.cfg.min_step_frac * step_s)
        for phase in self.phases:
            values = [w.get(phase, 0.0) for w in window]
            median = statistics.median(values)
            for rank, value in enumerate(values):
                key = (rank, phase)
                slow = median >= self.cfg.min_seconds and value > self.cfg.factor * median and value - median >= floor
                self.streak[key] = self.streak.get(key, 0) + 1 if slow else 0
                if self.streak[key] >= self.cfg.windows:
                    f = {"rank": rank, "phase": phase, "slowdown": value / median, "windows": self.streak[key]}
                    flagged.append(f | {"rank_s": value, "median_s": median})
        return flagged


class ArrivalJudge:
    """Per window: the rank its peers wait for at the step's end. A rank slowed from outside (descheduled,
    stopped, a noisy neighbour) accrues no extra CPU time, so the phase judge cannot see it; it arrives last.

    Each step every rank stamps its arrival at, and departure from, the step's one host collective (the exchange of
    the loss, data digest and stop flag, runner.run.step_sync), after the step's read of its loss (on CUDA: after the
    device finished the step); with several stamped collectives a step's lateness is their sum. All ranks leave a
    collective together, so the median difference of departure stamps is the difference of the hosts' clocks, which
    is taken out of the arrival stamps. On an oversubscribed machine every rank is
    descheduled now and then and arrives last once in a while, so one step proves nothing: a straggler arrives
    last in at least `last_frac` of a window's steps (a majority), and later than the median of its peers by
    `min_late_s` (median over the steps), for `windows` windows in a row."""

    def __init__(self, cfg: StragglerConfig):
        self.cfg = cfg
        self.streak: dict[int, int] = {}

    @staticmethod
    def lateness(arrive: list[list[float]], depart: list[list[float]], points: int) -> list[list[float]]:
        """[rank][k]: how much later than the median of its peers the rank arrived at the k-th step's collectives
        (summed over the `points` collectives of a step; clock offsets removed)."""
        ranks, cols = range(len(arrive)), range(len(arrive[0]))
        ref = [statistics.median(depart[r][c] for r in ranks) for c in cols]
        offset = [statistics.median(depart[r][c] - ref[c] for c in cols) for r in ranks]
        at = [[arrive[r][c] - offset[r] for c in cols] for r in ranks]
        late = [[at[r][c] - statistics.median(at[o][c] for o in ranks if o != r) for c in cols] for r in ranks]
        return [[sum(row[k : k + points]) for k in range(0, len(row), points)] for row in late]

    def update(self, arrive: list[list[float]], depart: list[list[float]], points: int, step_s: float) -> list[dict[str, Any]]:
        """arrive/depart[rank][k * points + p]: stamps at the p-th collective of the window's k-th step;
        step_s: the median step's wall time."""
        if len(arrive) < 2:
            return []
        late = self.lateness(arrive, depart, points)
        ranks, n = range(len(late)), len(late[0])
        last = [max(ranks, key=lambda r: late[r][k]) for k in range(n)]
        flagged = []
        for r in ranks:
            frac, median_late = last.count(r) / n, statistics.median(late[r])
            slow = frac >= self.cfg.last_frac and median_late >= self.cfg.min_late_s
            self.streak[r] = self.streak.get(r, 0) + 1 if slow else 0
            if self.streak[r] >= self.cfg.windows:
                f = {"rank": r, "phase": "arrival", "slowdown": step_s / max(step_s - median_late, 1e-9), "windows": self.streak[r]}
                flagged.append(f | {"last_frac": frac, "late_s": median_late, "rank_s": median_late, "median_s": 0.0})
        return flagged


class StepMonitor:
    """Phase hooks for the step loop (one per rank)."""

    def __init__(self, cfg: MonitorConfig, policy, coords_of, rank: int, recorder, run_dir: Path, compiled: bool = False):
        self.rank, self.recorder, self.policy = rank, recorder, policy
        self.s = cfg.straggler
        self.judge = StragglerJudge(self.s)
        self.arrivals = ArrivalJudge(self.s)
        self.step = 0
        self.now: dict[str, float] = {}
        self._pending: list[tuple[str, Any]] = []  # phases whose time the clock resolves at the end of the step
        self.window: list[dict[str, float]] = []
        self.window_stamps: list[list[tuple[float, float]]] = []
        self.windows_judged = 0
        self.flagged_total = 0
        self.tables: list[dict[str, Any]] = []  # every judged window (per-rank medians), kept for the summary
        self.all_steps: list[dict[str, float]] = []
        self.path = run_dir / runfiles.STRAGGLERS
        who = policy.all_gather_object({"host": socket.gethostname(), "local_rank": int(os.environ.get("LOCAL_RANK", 0))})
        self.ws = len(who)
        self.who = [{**w, "coords": coords_of(r)} for r, w in enumerate(who)]
        self._wall0, self._stamps = time.perf_counter(), []
        # What a phase costs this rank, by the device policy's clock: on CPU the process's CPU time (a rank
        # blocked in a gloo collective accrues none, so the peers that wait for a slow rank do not look as slow
        # as it), on CUDA events around the phase's kernels.
        self.clock = policy.clock()
        self.timeline = policy.timeline_clock()  # the step, its waits and pipeline stages (runner.observe.waits)
        self.faults = Faults(cfg.inject, rank, self.clock)  # TEST-ONLY: what monitor.inject plants in this rank
        from runner.observe import waits  # torch: the config side imports this module torch-free

        self.waits = waits.Waits(self.timeline, functional=not compiled)
        self._span: Any = None
        self._spans: list[Any] = []  # this step's pipeline schedules (two at a replay check) on the timeline clock
        self._stages: Any = None  # their stage timer (plan_check.StageTimer)
        self.idle: list[float] = []  # per step: this rank's idle fraction inside the pipeline schedule

    def begin_step(self, step: int) -> None:
        self.step = step
        self.now, self._pending, self._spans = {}, [], []
        self._wall0 = time.perf_counter()
        if self.s.enable:
            self._span = self.timeline.start()
            self.waits.start()
        self._stamps: list[tuple[float, float]] = []  # (arrival, departure) at this step's host collectives
        self.faults.begin_step(step)
        self.mark("data")

    def finished_step(self) -> None:
        """Every rank, once its step and its save are done: its record on disk (runner.observe.forensics)."""
        if self.recorder is not None:
            self.recorder.finished_step()

    def mark(self, phase: str) -> None:
        if self.recorder is not None:
            self.recorder.mark(phase, self.step)

    @contextmanager
    def phase(self, name: str):
        self.mark(name)
        if name == "forward":
            self.faults.before_forward()
        started = self.clock.start()
        arrive = time.time()
        try:
            yield
        finally:
            self._pending.append((name, self.clock.stop(started)))
            if name == "loss":  # the loss all-reduce: a host collective every step, stamped for the arrival judge
                self._stamps.append((arrive, time.time()))

    def add(self, name: str, seconds: float) -> None:
        self.now[name] = self.now.get(name, 0.0) + seconds

    def pipeline(self, span, timer) -> None:
        """A schedule's span on the timeline clock and its stage timer (plan_check.StageTimer), resolved at end_step."""
        self._spans.append(span)
        self._stages = timer

    def _resolve(self) -> None:
        """The step's phase, pipeline and wait times (CUDA events: after the step's host synchronization)."""
        for name, value in self._pending:
            self.add(name, self.clock.resolve(value))
        self._pending = []
        if self._spans:
            total, busy = sum(self.timeline.resolve(span) for span in self._spans), self._stages.take()
            self.idle.append(1 - busy / total)
            self.add("pp_compute", self.now["pipeline"] if self.clock.measures_cpu_time else busy)  # CPU: see StepMonitor.clock
            self.add("pp_wait", total - busy)
        if self.s.enable:
            self.waits.stop()
            waited = self.waits.take()
            self.now |= {"own": self.timeline.resolve(self.timeline.stop(self._span)) - waited, "waits": waited}

    def end_step(self) -> list[dict[str, Any]]:
        """Close the step; at the end of a window gather and judge. Returns the stragglers flagged now (every rank)."""
        self.mark("between steps")
        self._resolve()
        if self.s.enable and self.s.arrival:
            self.now["step_wall"] = time.perf_counter() - self._wall0
        self.all_steps.append(self.now)
        if not self.s.enable or self.step == 1:  # step 1 carries one-time costs on every rank: not judged
            return []
        self.window.append(self.now)
        self.window_stamps.append(self._stamps)
        if len(self.window) < self.s.interval:
            return []
        return self._judge()

    def _judge(self) -> list[dict[str, Any]]:
        """One all-gather of this rank's phase medians, median step time and per-step arrival stamps; every rank judges alike."""
        import torch

        arrival = self.s.arrival
        mine = [statistics.median(w.get(p, 0.0) for w in self.window) for p in TIMED]
        points = len(self.window_stamps[0])
        if arrival:
            stamps = [st for step in self.window_stamps for st in step]
            mine += [statistics.median(w["step_wall"] for w in self.window), *(st[0] for st in stamps), *(st[1] for st in stamps)]
        rows = [row.tolist() for row in self.policy.all_gather(torch.tensor(mine, dtype=torch.float64))]
        self.window, self.window_stamps = [], []
        table = [dict(zip(TIMED, row[: len(TIMED)], strict=True)) for row in rows]
        self.windows_judged += 1
        self.tables.append({"step": self.step, "ranks": table})
        found = self.judge.update(table)
        if arrival:
            n, at = len(stamps), len(TIMED) + 1
            arrive, depart = [row[at : at + n] for row in rows], [row[at + n :] for row in rows]
            self.tables[-1]["late_s"] = ArrivalJudge.lateness(arrive, depart, points) if len(rows) > 1 else []
            found += self.arrivals.update(arrive, depart, points, statistics.median(row[len(TIMED)] for row in rows))
        flagged = [{"step": self.step, **f, **self.who[f["rank"]]} for f in found]
        self.flagged_total += len(flagged)
        if flagged and self.rank == 0:
            with open(self.path, "a") as fh:
                for f in flagged:
                    fh.write(json.dumps(f) + "\n")
        return flagged

    def summary(self) -> dict[str, Any]:
        steady = self.all_steps[1:] or self.all_steps
        medians = {p: statistics.median(s.get(p, 0.0) for s in steady) for p in TIMED if any(p in s for s in steady)}
        return {
            "phase_median_s": medians,
            "straggler_windows": self.windows_judged,
            "stragglers_flagged": self.flagged_total,
            "window_medians_s": self.tables,
        }


def describe(f: dict[str, Any]) -> str:
    coords = " ".join(f"{a}={v}" for a, v in f["coords"].items())
    if f["phase"] == "arrival":
        return (
            f"straggler: rank {f['rank']} (host {f['host']}, local rank {f['local_rank']}, mesh {coords}) "
            f"arrives last at the step's host collectives in {100 * f['last_frac']:.0f} % of steps, "
            f"{f['late_s'] * 1e3:.1f} ms after its peers' median (its peers wait for it; "
            f"steps {f['slowdown']:.2f}x longer) for {f['windows']} windows, step {f['step']}"
        )
    phase = "own work (its step less its waits in collectives)" if f["phase"] == "own" else f["phase"]
    return (
        f"straggler: rank {f['rank']} (host {f['host']}, local rank {f['local_rank']}, mesh {coords}) "
        f"{phase} {f['slowdown']:.2f}x the median over ranks ({f['rank_s'] * 1e3:.1f} vs {f['median_s'] * 1e3:.1f} ms) "
        f"for {f['windows']} windows, step {f['step']}"
    )
