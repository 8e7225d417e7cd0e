"""Process plumbing shared by the launcher and the worker: how ranks are forked and stopped, and how a
finished process exits. Two of these patch private torch 2.13 code; remove them when torch honours
--shutdown-timeout on failure."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator


def threads_per_rank(ranks_on_this_machine: int) -> int:
    """CPU ranks of one machine share its cores: each gets an equal share, at least one (OpenMP and torch)."""
    return max(1, (os.cpu_count() or 1) // ranks_on_this_machine)


def honour_shutdown_timeout() -> None:
    """torch 2.13's agent stops the ranks of a failed group with `_shutdown()`, i.e. with its 30 s
    default, not the --shutdown-timeout it was given (that one only applies when the agent itself is
    signalled or exits). A SIGSTOPped rank ignores SIGTERM, so every such failure cost 30 s before the
    SIGKILL; stop the ranks with the configured distributed.shutdown_timeout_s instead."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    # private_api: torch_agent_stop_workers, torch_agent_shutdown, torch_agent_shutdown_timeout
    LocalElasticAgent._stop_workers = lambda self, worker_group: self._shutdown(timeout=self._shutdown_timeout)


_agent_restart = None


def note_agent_restarts(on_failure: Callable[[int], None]) -> None:
    """Call `on_failure(attempt)` when the elastic agent is about to restart its ranks after one failed (torch 2.13's
    agent only logs it): the time a rank that died without a word (SIGKILL, a lost node) ended its attempt, at the
    latest (one monitor interval late)."""
    global _agent_restart
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerState

    # private_api: torch_agent_restart_workers, torch_agent_remaining_restarts
    _agent_restart = _agent_restart or SimpleElasticAgent._restart_workers
    restart = _agent_restart

    def noted(self, worker_group) -> None:
        if worker_group.state in {WorkerState.UNHEALTHY, WorkerState.FAILED}:  # not a membership change
            on_failure(worker_group.spec.max_restarts - self._remaining_restarts - 1)  # the agent counted this restart
        restart(self, worker_group)

    SimpleElasticAgent._restart_workers = noted


def fork_ranks(flags: list[str], entry: Callable[..., None], *args: str) -> None:
    """torchrun with a function entrypoint: the agent imports `entry`'s module (torch, TorchTitan)
    once and its multiprocessing context forks every rank, and every restart, from itself."""
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    config, _, _ = config_from_args(parse_args([*flags, "--start-method=fork", "-m", "runner.worker", *args]))
    _fork_grace(config.shutdown_timeout)
    elastic_launch(config, entry)(*args)


_spawn_join = None


def _fork_grace(seconds: float) -> None:
    """With forked ranks, a failed rank is noticed inside torch's ProcessContext.join, which gives the
    others a hard-coded 30 s after SIGTERM before SIGKILL (the agent's --shutdown-timeout does not reach
    it). Give them the configured time instead: half to exit on their own, half after SIGTERM."""
    global _spawn_join
    from torch.multiprocessing.spawn import ProcessContext

    # private_api: torch_spawn_join
    _spawn_join = _spawn_join or ProcessContext.join
    join = _spawn_join
    ProcessContext.join = lambda self, timeout=None, grace_period=None: join(
        self, timeout, seconds / 2 if grace_period is None else grace_period
    )


def exit_now(code: int) -> None:
    """End the process without tearing the interpreter down. With torch and TorchTitan loaded
    (~2,800 modules) Python's finalization takes ~3 s of every launch after the ranks are done;
    the exit handlers (logging, multiprocessing, torch's) still run first, and output is flushed."""
    # private_api: python_run_exitfuncs
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)  # torch's TORCHELASTIC_SIGNALS_TO_HANDLE


@contextlib.contextmanager
def agent_signal_handlers() -> Iterator[None]:
    """The elastic agent's signal handlers last as long as its ranks. torch 2.13's agent installs handlers that raise
    on SIGTERM, SIGINT, SIGHUP and SIGQUIT when it starts its ranks and never puts the earlier ones back. In a SLURM
    task those were submitit's (SIGTERM bypassed): the SIGTERM of a requeue, arriving after the ranks exited, raised
    inside submitit's writing of the task's result and left its temporary file, which failed the requeued task."""
    before = {sig: signal.getsignal(sig) for sig in AGENT_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def drop_agent_signal_handlers() -> None:
    """A rank forked from the agent (cluster.worker_start=fork) inherits its signal handlers, which
    turn the agent's SIGTERM into an exception; restore the defaults, so that a rank ends on the
    agent's signals as an exec-started one does."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
