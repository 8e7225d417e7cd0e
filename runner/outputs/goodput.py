"""Goodput: where a run's wall time went, from its first launch to its end, across elastic restarts and SLURM requeues.

`account` reads the run folder's timeline.jsonl (runfiles.TIMELINE: written as the run goes by runner.outputs.timeline,
its events described there) back into PARTS, one row per part, each measured from its own timestamps; what no part
covers is `unaccounted`. Under fault_tolerance=torchft each replica group keeps its own timeline (folder replica_<r>), a
failed attempt of a group throws no work away (its committed steps live on in its peers' weights), the time it is out
is lost capacity (`outage`); `combine` sums the groups' accounts, in group-seconds. Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.formats import runfiles
from runner.schema.wording import count

MARKS = ("rank_start", "main", "process_group", "built", "data", "restored")
"""Start-up marks of an attempt on rank 0, in order; its first step's start ends the start-up."""
STARTUP = {
    "launcher": "the launch to rank 0's process (compose, validate, peak measurement, torchrun, rendezvous of the agents)",
    "imports": "rank 0's process start to its main (torch and TorchTitan imports; ~0 for a forked rank)",
    "rendezvous": "the process groups (init_process_group)",
    "build": "mesh, model, parallelize, FP8 conversion",
    "data": "this rank's train and held-out data",
    "restore": "metric sinks (W&B's init), optimizer, monitors, checkpoint restore, the first batch's check, up to the first step",
}
"""Start-up of an attempt, split at its marks (the launcher row only for the first attempt of a job)."""


def failed_at(failures: list[dict[str, Any]]) -> float:
    """When an attempt failed: the earliest of the ranks' own errors, the last sign of life of a rank that raised none
    (the end of its last step or its last heartbeat record: a SIGKILLed rank, a lost node, is heard of by its peers
    only when its sockets close, after its memory is torn down, ~0.2-1 s later here) and the agent's notice."""
    return min(f["time"] for f in failures)


def read(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / runfiles.TIMELINE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


@dataclass
class Attempt:
    """One attempt of the run: an elastic agent's start of the ranks within one SLURM job (`job`)."""

    job: int
    attempt: int
    marks: dict[str, float] = field(default_factory=dict)
    restored: int = 0
    """The step the attempt resumed from (0: from the start)."""
    restored_from: dict[str, Any] = field(default_factory=dict)  # the tier it resumed from, and why (the `restored` mark)
    steps: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    end: dict[str, Any] | None = None
    start: float = 0.0
    """The job's launch for its first attempt, rank 0's process start for a restart."""
    first_of_job: bool = True
    kept: int | None = None
    """A failed attempt: the step the next attempt resumed from; its records of later steps are thrown away."""
    lost_from: float | None = None
    """A failed attempt: the end of its record of step `kept` (its first step's start without one)."""

    @property
    def stop(self) -> float:
        """Its end record, else its failure (not before rank 0 finished the step kept), else its last step's end."""
        if self.end is not None:
            return self.end["time"]
        if self.failures:
            return max(failed_at(self.failures), self.lost_from or 0.0)
        return self.steps[-1]["end"] if self.steps else self.start

    @property
    def training_from(self) -> float:
        return self.steps[0]["start"] if self.steps else self.stop


@dataclass
class Run:
    """A run's timeline, parsed: its attempts in order, and the intervals whose work was thrown away."""

    launches: dict[int, float]
    attempts: list[Attempt]
    lost: list[tuple[float, float]] = field(default_factory=list)
    thrown: list[tuple[float, float]] = field(default_factory=list)
    """Intervals whose step records do not count: what a rewind undid, and under torchft a step the quorum did not
    commit (retried with the same batch), outside an outage."""
    outages: list[tuple[float, float]] = field(default_factory=list)
    """torchft: a replica group out of training, from the end of its last committed step before a failure to the start
    of the first step it trained again (the step in flight, the restart, the start-up, the recovery)."""

    def counted(self) -> list[dict[str, Any]]:
        """Step records that count: not after the step a restart resumed from, not undone by a rewind or left
        uncommitted by torchft's quorum, not inside an outage (a recovering group's step trained nothing)."""
        rows = [s for a in self.attempts for s in a.steps if a.kept is None or s["step"] <= a.kept]
        return [s for s in rows if not _inside(s, [*self.thrown, *self.outages])]

    def out(self, t: float) -> bool:
        """`t` falls inside an outage (its restart gap and start-up are lost capacity)."""
        return any(lo <= t <= hi for lo, hi in self.outages)

    def gaps(self, requeue: bool) -> list[float]:
        """Restart gaps (a failed attempt's stop to the next attempt's rank start) or requeue gaps (a job's last stop
        to the requeued job's launch), outside outages."""
        pairs = zip(self.attempts, self.attempts[1:], strict=False)
        return [b.start - a.stop for a, b in pairs if b.first_of_job == requeue and not self.out(a.stop)]


def parse(events: list[dict[str, Any]]) -> Run:
    launches = {e["job"]: e["time"] for e in events if e["event"] == "launch"}
    attempts: dict[tuple[int, int], Attempt] = {}
    for e in events:
        if e["event"] == "launch":
            continue
        a = attempts.setdefault((e["job"], e["attempt"]), Attempt(e["job"], e["attempt"]))
        if e["event"] == "mark":
            a.marks[e["name"]] = e["time"]
            a.restored = e.get("step", a.restored)
            a.restored_from = {k: e[k] for k in ("tier", "why") if k in e} or a.restored_from
        elif e["event"] == "step":
            a.steps.append(e)
        elif e["event"] == "failure":
            a.failures.append(e)
        elif e["event"] == "end":
            a.end = e
    ordered = [attempts[k] for k in sorted(attempts)]
    torchft = any("ft_trained" in s for a in ordered for s in a.steps)
    for a, nxt in zip(ordered, ordered[1:], strict=False):
        if a.end is None and not torchft:  # failed: the next attempt resumed from its checkpoint of step `kept`
            a.kept = nxt.restored
            a.lost_from = _after(a.steps, nxt.restored, a.steps[0]["start"]) if a.steps else None
    for prev, a in zip([None, *ordered], ordered, strict=False):
        a.first_of_job = prev is None or prev.job != a.job
        a.start = launches.get(a.job, a.marks.get("rank_start", a.training_from)) if a.first_of_job else a.marks.get("rank_start", a.stop)
    outages = _outages(ordered) if torchft else []
    thrown = _rewinds(ordered) + [  # torchft: a step the quorum did not commit was computed, then thrown away
        (s["start"], s["end"]) for a in ordered for s in a.steps if s.get("ft_committed") is False and not _inside(s, outages)
    ]
    lost = [(a.lost_from, a.stop) for a in ordered if a.lost_from is not None]
    return Run(launches, ordered, lost + thrown, thrown, outages)


def _inside(step: dict[str, Any], intervals: list[tuple[float, float]]) -> bool:
    """The step record lies within one of the intervals."""
    return any(lo <= step["start"] and step["end"] <= hi for lo, hi in intervals)


def _outages(attempts: list[Attempt]) -> list[tuple[float, float]]:
    """torchft: each failed attempt's outage, from the end of its last committed step (its first step's start, its stop
    without a step) to the start of the first step a later attempt trained (the last attempt's stop if none did)."""
    out = []
    for i, a in enumerate(attempts[:-1]):
        if a.end is not None:
            continue
        committed = [s["end"] for s in a.steps if s.get("ft_committed")]
        lo = max(committed) if committed else (a.steps[0]["start"] if a.steps else a.stop)
        back = [s["start"] for b in attempts[i + 1 :] for s in b.steps if s.get("ft_trained")]
        out.append((lo, min(back) if back else attempts[-1].stop))
    return out


def _after(steps: list[dict[str, Any]], step: int, default: float, before: float = float("inf")) -> float:
    """End of the latest record of `step` that ended by `before`; `default` when there is none."""
    ends = [s["end"] for s in steps if s["step"] == step and s["end"] <= before]
    return max(ends) if ends else default


def _rewinds(attempts: list[Attempt]) -> list[tuple[float, float]]:
    """What a loss-guard or integrity rewind threw away: from the end of the step it rewound to, to its own end."""
    return [
        (_after(a.steps, s["rewound_to"], a.steps[0]["start"], before=s["start"]), s["end"])
        for a in attempts
        for s in a.steps
        if "rewound_to" in s
    ]


@dataclass(frozen=True)
class Part:
    """One row of the goodput table: where a share of the wall time went, measured by `measure`."""

    name: str
    label: str
    measure: Callable[[Run], float]
    definition: str


def _sum(rows: list[dict[str, Any]], key: str) -> float:
    return sum(r.get(key, 0.0) for r in rows)


def _startup(a: Attempt) -> float:
    return min(a.training_from, a.stop) - a.start


PARTS: tuple[Part, ...] = (
    Part(
        "productive",
        "productive",
        lambda r: sum(s["step_s"] - s["data_s"] - s.get("compile_s", 0.0) for s in r.counted()),
        "the steps that count (not thrown away by a restart or a rewind), at their measured step time, less their data wait "
        "and compilation",
    ),
    Part(
        "startup",
        "start-up",
        lambda r: sum(_startup(a) for a in r.attempts if not r.out(a.start)),
        "per attempt, its start to its first step: " + "; ".join(STARTUP),
    ),
    Part(
        "checkpoint",
        "checkpoints",
        lambda r: _sum(r.counted(), "checkpoint_s") + sum(a.end.get("checkpoint_s", 0.0) for a in r.attempts if a.end),
        "the blocking part of the saves of counted steps, and the wait for the last save and the model export at the end",
    ),
    Part(
        "compile",
        "compilation",
        lambda r: _sum(r.counted(), "compile_s"),
        "training.compile: torch.compile compiling inside counted steps (the first step's graphs, their backward, recompilations)",
    ),
    Part("eval", "evaluation", lambda r: _sum(r.counted(), "eval_s"), "the evaluation passes after counted steps"),
    Part("data_wait", "data waits", lambda r: _sum(r.counted(), "data_s"), "how long counted steps waited for their batch"),
    Part(
        "overhead",
        "step overhead",
        lambda r: _sum(r.counted(), "overhead_s"),
        "counted steps outside their timed window: the batch check across ranks (it waits for the slowest), the monitors, the sinks",
    ),
    Part("lost", "lost work", lambda r: sum(hi - lo for lo, hi in r.lost), "computed, then thrown away (see docs/profiling.md)"),
    Part(
        "outage",
        "lost capacity",
        lambda r: sum(hi - lo for lo, hi in r.outages),
        "fault_tolerance=torchft: the replica group out of training while its peers trained on, from the end of its last "
        "committed step to its first trained step after it rejoined (its shards of those steps skipped, none recomputed)",
    ),
    Part("restart_gap", "restart gaps", lambda r: sum(r.gaps(requeue=False)), "a failed attempt's failure to the restarted rank 0's start"),
    Part("requeue_gap", "requeue gaps", lambda r: sum(r.gaps(requeue=True)), "a SLURM job's stop to its requeued job's launch"),
    Part(
        "finish",
        "finish",
        lambda r: sum(a.end["time"] - a.end["finish_from"] for a in r.attempts if a.end),
        "after the last step and its save: the summary, the calibration's measurements",
    ),
)
"""Every part of the wall time, in the order the line and goodput.json list them."""


def _startup_detail(a: Attempt) -> dict[str, float]:
    """An attempt's start-up split at its marks (a missing mark folds into the next)."""
    stamps = [("launcher", a.marks.get("rank_start"))] if a.first_of_job else []
    names = ("imports", "rendezvous", "build", "data")
    stamps += list(zip(names, (a.marks.get(m) for m in MARKS[1:5]), strict=True)) + [("restore", min(a.training_from, a.stop))]
    out, since = {}, a.start
    for name, at in stamps:
        if at is not None:
            out[name] = round(at - since, 4)
            since = at
    return out


def account(events: list[dict[str, Any]]) -> dict[str, Any]:
    """goodput.json: the run's wall time from its first launch to its last attempt's stop, split into PARTS."""
    run = parse(events)
    if not run.attempts:
        raise ValueError("timeline holds no attempt")
    begin = min([*run.launches.values(), run.attempts[0].start])
    total = run.attempts[-1].stop - begin
    parts = {p.name: p.measure(run) for p in PARTS}
    unaccounted = total - sum(parts.values())
    seen: set[int] = set()
    repeated = 0
    for s in (s for a in run.attempts for s in a.steps if not run.out(s["start"])):  # an outage's steps trained nothing
        repeated += s["step"] in seen
        seen.add(s["step"])
    return {
        "goodput": parts["productive"] / total if total > 0 else 0.0,
        "total_s": total,
        "parts_s": parts,
        "unaccounted_s": unaccounted,
        "unaccounted_fraction": unaccounted / total if total > 0 else 0.0,
        "restarts": len(run.gaps(requeue=False)),
        "requeues": len(run.gaps(requeue=True)),
        "repeated_steps": repeated,
        "steps_counted": len(run.counted()),
        "attempts": [_attempt_row(a) for a in run.attempts],
    }


def _attempt_row(a: Attempt) -> dict[str, Any]:
    how = ("stopped" if a.end.get("stopped") else "ended") if a.end else "failed"
    row = {"job": a.job, "attempt": a.attempt, "start": a.start, "stop": a.stop, "how": how, "resumed_from_step": a.restored}
    row |= {"resumed_from_tier": a.restored_from} if a.restored_from else {}
    row |= {"steps": len(a.steps), "startup_s": _startup(a), "startup": _startup_detail(a)}
    first = min(a.failures, key=lambda f: f["time"]) if a.failures else None
    return row | ({"failure": {"time": first["time"], "by": first["by"]}} if first else {})


def combine(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's account under fault_tolerance=torchft from its replica groups' (`account` of each group's timeline),
    in group-seconds: each part and the total summed over the groups, so a group's outage weighs what it cost."""
    total, unaccounted = sum(r["total_s"] for r in reports), sum(r["unaccounted_s"] for r in reports)
    parts = {p.name: sum(r["parts_s"][p.name] for r in reports) for p in PARTS}
    counts = {k: sum(r[k] for r in reports) for k in ("restarts", "requeues", "repeated_steps", "steps_counted")}
    share = {"goodput": parts["productive"] / total, "unaccounted_fraction": unaccounted / total} if total > 0 else {}
    out = {"goodput": 0.0, "unit": f"group-seconds over {len(reports)} replica groups", "total_s": total, "parts_s": parts}
    return out | {"unaccounted_s": unaccounted, "unaccounted_fraction": 0.0, **counts, "groups": reports} | share


def flat(report: dict[str, Any]) -> dict[str, Any]:
    """The figures W&B's summary and summary.json keep: goodput, total and each part in seconds."""
    out = {"fraction": report["goodput"], "total_s": report["total_s"]}
    out |= {f"{name}_s": s for name, s in report["parts_s"].items()}
    out |= {k: report[k] for k in ("unaccounted_s", "restarts", "requeues", "repeated_steps")}
    return out


def line(figures: dict[str, Any], path: Path, note: str = "") -> str:
    """The run's closing goodput line, from `flat`'s figures."""
    total = figures["total_s"]
    shown = ", ".join(f"{p.label} {figures[p.name + '_s']:.2f} s" for p in PARTS[1:])
    counts = f"{count(figures['restarts'], 'restart')}, {count(figures['requeues'], 'requeue')}"
    counts += f", {count(figures['repeated_steps'], 'repeated step')}"
    un = figures["unaccounted_s"]
    return (
        f"goodput{note}: {100 * figures['fraction']:.1f} % ({figures['productive_s']:.2f} s productive of {total:.2f} s since the "
        f"first launch; {shown}; unaccounted {un:.2f} s = {100 * un / total:.1f} %; {counts}) in {path}"
    )


def write(run_dir: Path) -> dict[str, Any]:
    """Account the run folder's timeline into goodput.json; the report."""
    report = account(read(run_dir))
    runfiles.write_json(run_dir / runfiles.GOODPUT, report)
    return report
