"""The run's timeline: what the launcher of node 0 and rank 0 did, appended as it happens, for goodput to account.

They append what they did, with its wall-clock time (time.time(), one clock for every attempt and requeued job), to
the run folder's timeline.jsonl (runfiles.TIMELINE), one JSON object a line:

    launch   python -m runner started this run (`job`: SLURM's restart count, 0 outside SLURM)
    mark     rank 0 of attempt (`job`, `attempt`) reached a start-up mark (runner.outputs.goodput.MARKS; `restored` names
             the step resumed from, and the checkpoint tier and why: `tier`, `why`)
    step     one step on rank 0: `start`, `end` (after its checkpoint save, evaluation and logging), `step_s`, `data_s`,
             `checkpoint_s`, `eval_s`, `overhead_s`, `compile_s` (training.compile), `rewound_to` after a rewind, and under
             fault_tolerance=torchft `ft_committed` and `ft_trained` (the quorum committed the step; this replica group trained it)
    failure  a rank raised (`by`: "rank r: error") or the agent saw one fail ("agent"); a silent rank: when last alive
    end      rank 0 left the step loop (`stopped`: for SLURM's requeue), with the final save's blocking seconds

runner.outputs.goodput reads them back and accounts them. Torch-free.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from runner.config import slurm
from runner.formats import runfiles
from runner.outputs.goodput import flat, write


def process_start() -> float:
    """Wall-clock time this process started (a forked rank: its fork), from Linux's /proc (10 ms ticks); now elsewhere."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return time.time()
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))


class Timeline:
    """Appends this process's events to a run folder's timeline.jsonl: one write per line (O_APPEND), so the ranks and
    the agents that report a failure at once do not interleave. The file stays open (a step costs one write, no open on
    a network filesystem); the process's exit closes it."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / runfiles.TIMELINE
        self.job = slurm.restart_count()
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self._fd: int | None = None

    def write(self, event: str, **fields: Any) -> None:
        body = {"event": event, "job": self.job, "attempt": self.attempt} | fields
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(self._fd, (json.dumps(body) + "\n").encode())

    def step(self, row: dict[str, Any], started: float, *, overhead_s: float, publish_s: float) -> None:
        """One step on rank 0 (`row`: its metrics row): its span and the parts inside it, each timed."""
        saved = row.get("checkpoint_s", 0.0) + publish_s  # the save's blocking part, and publishing an async one
        parts = {"step_s": row["step_time_s"], "data_s": row["data_s"], "checkpoint_s": saved, "eval_s": row.get("eval_s", 0.0)}
        parts |= {"compile_s": row["compile_s"]} if row.get("compile_s") else {}
        rewound = {"rewound_to": row["rewound_to"]} if "rewound_to" in row else {}
        ft = {k: row[k] for k in ("ft_committed", "ft_trained") if k in row}
        self.write("step", step=row["step"], start=started, end=time.time(), overhead_s=overhead_s, **parts, **rewound, **ft)

    def end(self, finish_from: float, checkpoint_s: float, stopped: bool = False) -> dict[str, Any]:
        """Rank 0 left the step loop: record it, account every attempt so far into goodput.json, return `flat`'s figures."""
        self.write("end", time=time.time(), finish_from=finish_from, checkpoint_s=checkpoint_s, stopped=stopped)
        return flat(write(self.path.parent))

    def __del__(self) -> None:  # a multirun's launcher makes one per point
        if self._fd is not None:
            os.close(self._fd)

    def launch(self, at: float) -> None:
        self.write("launch", time=at)

    def mark(self, name: str, at: float | None = None, **fields: Any) -> None:
        self.write("mark", name=name, time=time.time() if at is None else at, **fields)

    def failure(self, by: str, *, attempt: int | None = None) -> None:
        """A rank raised, or the agent saw one fail: now."""
        self.write("failure", time=time.time(), by=by[:300], **({} if attempt is None else {"attempt": attempt}))
