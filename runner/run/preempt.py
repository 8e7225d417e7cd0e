"""SLURM's warning signal: checkpoint, then requeue, then resume exactly.

SLURM sends USR2 `cluster.slurm.signal_s` seconds before a job's time limit (#SBATCH --signal=USR2@N),
and on preemption; `scancel --signal=USR2 <job>` sends it by hand. It reaches every process of the job
step: the submitted task on each node (which runs the elastic agent) and every rank.

submitit's own handler in the task of global rank 0 would checkpoint the Hydra call, `scontrol requeue`
and `sys.exit(-1)` at once, ending the agent before its ranks have saved. So the runner takes over:

- every rank (`RankWatch`) notes the signal; at the end of each step the ranks agree (a flag in the step's one
  host collective, runner.run.step_sync) so that all stop after the same step, write a synchronous checkpoint (published atomically by the
  Checkpointer), rank 0 appends the interruption to `preempted.json` and the ranks exit cleanly;
- the task (`AgentTakeover`) waits for its ranks and only then hands the signal to submitit's handler,
  which requeues the job as a checkpointable task (hydra-submitit-launcher's `checkpoint`), counting time
  limits against `cluster.slurm.max_requeues`.

The requeued job runs the same Hydra call in the same run folder; SLURM sets SLURM_RESTART_COUNT, and
the ranks resume from the newest checkpoint, so no step is repeated or skipped.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from runner.config.slurm import in_job as in_slurm_job
from runner.config.slurm import restart_count
from runner.formats import runfiles

SIGNAL = signal.SIGUSR2


def requeued() -> bool:
    return restart_count() > 0


def interruptions(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / runfiles.PREEMPTED
    return json.loads(path.read_text()) if path.is_file() else []


class RankWatch:
    """On a rank: whether SLURM asked the job to stop, agreed by all ranks at the end of a step.

    The signal is blocked in every thread the rank starts (gloo's, OpenMP's, c10d's: they inherit the mask of the
    thread that starts them) and taken by one thread of its own with sigwait, so it never interrupts a compute or
    communication thread in a system call. `siginterrupt(SIGNAL, False)` would not be enough: socket calls with a
    timeout (gloo sets SO_RCVTIMEO and SO_SNDTIMEO) and epoll_wait fail with EINTR even under SA_RESTART
    (signal(7)). The handler stays installed for a thread started before the mask (none on a forked rank)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.signalled_at: float | None = None
        self.warned = False  # said once that, without checkpoints, the signal changes nothing
        if enabled:
            signal.signal(SIGNAL, self._note)
            signal.pthread_sigmask(signal.SIG_BLOCK, {SIGNAL})
            threading.Thread(target=self._wait, name=f"{SIGNAL.name.lower()}-watch", daemon=True).start()

    def _wait(self) -> None:
        while True:
            signal.sigwait({SIGNAL})
            self._note(SIGNAL, None)

    def _note(self, signum: int, frame) -> None:
        if self.signalled_at is None:
            self.signalled_at = time.time()

    @property
    def signalled(self) -> bool:
        """This rank has the signal; the ranks agree on it in the step's one host collective (runner.run.step_sync)."""
        return self.signalled_at is not None


_watch = RankWatch(enabled=False)


def watch_rank() -> RankWatch:
    """Called first thing on a rank, before it starts any thread (the default action of USR2 would end it, and a thread
    started before would not block it): in a SLURM job, start noting the signal."""
    global _watch
    _watch = RankWatch(enabled=in_slurm_job())
    return _watch


def rank_watch() -> RankWatch:
    """This rank's watch (a disabled one unless `watch_rank` installed it: local runs, the parity harness)."""
    return _watch


def record(run_dir: Path, step: int, checkpoint: Path, saved_s: float, signalled_at: float | None) -> dict[str, Any]:
    """Rank 0: append this interruption to preempted.json (written whole, then renamed into place)."""
    entry = {
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart_count": restart_count(),
        "signal": SIGNAL.name,
        "step": step,
        "checkpoint": str(checkpoint),
        "checkpoint_s": round(saved_s, 3),
        "signalled_at": signalled_at,
        "stopped_at": time.time(),
    }
    path = run_dir / runfiles.PREEMPTED
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([*interruptions(run_dir), entry], indent=2) + "\n")
    tmp.replace(path)
    return entry


class AgentTakeover:
    """In the submitted task on each node: hold submitit's USR2 handler back until the ranks have saved."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.received_at: float | None = None
        self.submitit_handler = signal.getsignal(SIGNAL)
        signal.signal(SIGNAL, self._note)

    def _note(self, signum: int, frame) -> None:
        if self.received_at is None:
            self.received_at = time.time()
            print(f"preempt: {SIGNAL.name} received; the ranks finish their step and checkpoint before the requeue", flush=True)

    def saved(self) -> dict[str, Any] | None:
        """This run's interruption, once the ranks have recorded their checkpoint."""
        done = [e for e in interruptions(self.run_dir) if e["slurm_restart_count"] == restart_count()]
        return done[-1] if done else None

    def hand_over(self) -> None:
        """After the ranks have exited: if they stopped for the signal, let submitit requeue (it exits the task)."""
        signal.signal(SIGNAL, self.submitit_handler)
        entry = self.saved()
        if entry is None:
            return
        saved = f"checkpoint of step {entry['step']} written in {entry['checkpoint_s']:.2f} s"
        print(f"preempt: {saved}; handing over to SLURM's requeue", flush=True)
        if callable(self.submitit_handler):
            self.submitit_handler(SIGNAL, None)
