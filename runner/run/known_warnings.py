"""The warnings of torch, TorchTitan and torchao that the runner knows to be harmless for its own use: one table,
each entry with its category (a `warnings` category, or the logger that logs it), the message and the reason.

They are dropped only where a process writes to the console: the launcher (`python -m runner`, the elastic agent)
and local rank 0 of each node. Local ranks 1 and up write to their rank log files (runner.run.node_launch redirects
them) and keep every warning, these included; every other warning reaches the console as before.
Torch-free, so that it can be applied before torch is imported.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Harmless:
    category: type[Warning] | None
    """The `warnings.warn` category; None for a logging record of `logger`."""
    logger: str | None
    """The logger of a logging record (at any level); None for a Python warning."""
    message: str
    """A regular expression the message matches from its start."""
    reason: str
    """Why the runner need not act on it."""


HARMLESS = (
    Harmless(
        UserWarning,
        None,
        r"torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to (save|load) in a single process",
        "the node-local checkpoint tier (runner.run.local_tier) saves and loads each rank's own shard with DCP's "
        "no_dist on purpose: one checkpoint per rank, no collective; `python -m runner.export` reads a checkpoint of "
        "any layout in one process (runner.run.hf_export)",
    ),
    Harmless(
        UserWarning,
        None,
        r"To get the last learning rate computed by the scheduler, please use `get_last_lr\(\)`",
        "a resumed run: TorchTitan's LRSchedulersContainer.load_state_dict sets each scheduler's rate at the restored "
        "step by calling get_lr() outside step() (torchtitan/components/optimizer/lr_scheduler.py), which is the "
        "schedule's rate there (tests/test_sinks.py compares it)",
    ),
    Harmless(
        UserWarning,
        None,
        r"DTensor random operators may not have complete support on cpu device mesh",
        "DTensor's RNG tracker is CUDA-only; on CPU the runner overwrites every sharded parameter with its shard of "
        "a one-rank initialization from training.seed (runner.run.titan.cpu.init_like_one_rank), so the random "
        "values drawn on the CPU mesh are never used",
    ),
    Harmless(
        None,
        # private_api: torch_redistribute_logger
        "torch.distributed.tensor._redistribute",
        r"While redistributing from \((_NormPartial\([\d.]+\)(, )?)+\) to \((Replicate\(\)(, )?)+\), \d+ sequential all_reduce ",
        "the gradient norm of parameters sharded on two mesh dimensions: one all-reduce of one element per "
        "dimension, once a step; each all-reduce gives its whole group one result, so every rank clips by the same norm",
    ),
    Harmless(
        None,
        # private_api: torch_pytree_logger
        "torch.utils._pytree",
        r"<enum '(KernelPreference|ScaleCalculationMode)'> is an Enum subclass .* register_constant\(\) on Enum "
        r"subclasses is deprecated",
        "torchao registers its own enums when it is imported (torchao.utils.register_as_pytree_constant); the "
        "runner calls nothing deprecated, and torch still supports it",
    ),
    Harmless(
        UserWarning,
        None,
        r"Warning: Profiler clears events at the end of each cycle",
        "profile.*: each traced step is its own cycle of torch.profiler and is written to its own trace as the cycle ends "
        "(runner.run.profiling), so no event of an earlier cycle is wanted again",
    ),
    Harmless(
        UserWarning,
        None,
        r"In CPU autocast, but the target dtype is not supported\. Disabling autocast\.",
        "TorchTitan's MoE router computes its gate under autocast to float32 (models/common/moe.py), which torch's CPU "
        "autocast does not offer: on CPU the gate runs in its inputs' dtype, float32 at the CPU's default precision (what "
        "TorchTitan asks for); under bf16 (the CPU dry run of a GPU recipe) its scores are bf16, tokens x experts, where "
        "a GPU's are float32 (the CUDA rehearsal runs the GPU's autocast)",
    ),
    Harmless(
        None,
        "torch.distributed.elastic.agent.server.api",
        r"Received (2|Signals\.SIGINT|SIGINT) death signal, shutting down workers",
        "Ctrl-C: the launcher says at which step the run stopped and how to resume it (runner.run.node_launch.interrupted)",
    ),
    Harmless(
        None,
        "torch.distributed.elastic.multiprocessing.api",
        r"(Closing process \d+ via signal|Sending process \d+ closing signal) SIGINT$",
        "Ctrl-C: the agent passes it on to every rank, and the launcher reports the interruption once",
    ),
)


class _Drop(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def on_console() -> bool:
    """Whether this process writes to the console: local rank 0, or not a rank at all (the launcher)."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def apply(console: bool) -> None:
    """Drop HARMLESS on a console process; keep everything on the others (undoing what a forked rank inherited).
    Idempotent."""
    for h in HARMLESS:
        if h.category is not None:
            entry = ("ignore", re.compile(h.message, re.I), h.category, None, 0)
            if entry in warnings.filters:
                warnings.filters.remove(entry)
            if console:
                warnings.filterwarnings("ignore", message=h.message, category=h.category)
            continue
        logger = logging.getLogger(h.logger)
        for f in [f for f in logger.filters if isinstance(f, _Drop) and f.pattern.pattern == h.message]:
            logger.removeFilter(f)
        if console:
            logger.addFilter(_Drop(h.message))


@contextmanager
def applied():
    """apply(True) for a block of this console process (a mode that starts no training; the dry run's forked ranks
    inherit it), then the warning filters and the loggers' filters as they were."""
    saved = {h.logger: logging.getLogger(h.logger).filters[:] for h in HARMLESS if h.logger is not None}
    with warnings.catch_warnings():
        apply(True)
        try:
            yield
        finally:
            for name, filters in saved.items():
                logging.getLogger(name).filters[:] = filters
