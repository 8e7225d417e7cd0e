"""The run's console: library log lines in the runner's format, and `runner.log`, the console as rank 0 prints it
(torch-free, so that the launcher sets it up before torch is imported).

TorchTitan logs on the root logger (`torchtitan.tools.logging.logger`), torch's elastic agent and torchft on named
ones. Hydra's job logging is off (`hydra/job_logging: none` in conf/config.yaml: its format, and a `runner.log` with
every rank's copy of those lines only); here one handler prints them as the runner prints its own lines,
`WARNING: <message>` on stderr (a named logger's name before the message), on the console at WARNING and up
(everything with `logging.verbose=true`), in the rank logs of the other ranks everything.

`runner.log` in the run folder holds what the launcher and rank 0 write to stdout and stderr through Python from the
launch on (the start-up block, restore lines, steps, the closing lines, warnings; not C++ output of torch), as it
is printed (with a progress bar's control codes on a terminal).
"""

from __future__ import annotations

import io
import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        source = "" if record.name == "root" else f"{record.name}: "
        text = f"{record.levelname}: {source}{record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class _Console(logging.Handler):
    """Writes through sys.stdout (INFO and below) or sys.stderr (WARNING and up) as they are when the line is logged,
    so a line reaches runner.log where the console does."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # logging's own contract: a handler never raises
            self.handleError(record)


def route_logs(verbose: bool, console: bool) -> None:
    """A rank's root logger lines in the runner's format: on a console process WARNING and up (all with `verbose`),
    on the others (their output is a rank log) all. Idempotent: replaces the handler an earlier call added and the
    plain StreamHandler Hydra's logging gave the launcher, and leaves others (pytest's) alone. The launcher keeps
    Hydra's (its own lines: a sweep's jobs)."""
    root = logging.getLogger()
    for h in [h for h in root.handlers if isinstance(h, _Console) or type(h) is logging.StreamHandler]:
        root.removeHandler(h)  # ours, and the console handler a forked rank inherits from Hydra's logging set-up
    handler = _Console(logging.INFO if verbose or not console else logging.WARNING)
    handler.setFormatter(_Format())
    root.addHandler(handler)
    root.setLevel(handler.level)


@contextmanager
def routed(verbose: bool):
    """route_logs on this console process for a block, then the root logger's handlers and level as they were: a mode
    that starts no training (the dry run's TorchTitan lines, in its forked ranks too) in a process that may run more
    commands after it (a sweep's points, a test's in-process CLI)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    route_logs(verbose, console=True)
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


class _Tee(io.TextIOBase):
    """A text stream that writes to `stream` and to the log file; everything else (isatty, fileno, encoding) is
    the stream's, so rich and the rest see the console they would see."""

    def __init__(self, stream, log, path: Path):
        super().__init__()
        self.stream, self.log, self.path = stream, log, path

    def write(self, s: str) -> int:
        n = self.stream.write(s)
        if not self.log.closed:
            self.log.write(s)
        return n

    def flush(self) -> None:
        self.stream.flush()
        if not self.log.closed:
            self.log.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def tee(path: Path) -> None:
    """From now on, stdout and stderr of this process also go to `path` (appended: the launcher and rank 0 share it).
    Idempotent for the same path (a forked rank 0 keeps the launcher's)."""
    path = Path(path).resolve()
    if isinstance(sys.stdout, _Tee) and sys.stdout.path == path:
        return
    untee()
    log = open(path, "a", buffering=1, encoding="utf-8")  # line-buffered: each line one append
    sys.stdout, sys.stderr = _Tee(sys.stdout, log, path), _Tee(sys.stderr, log, path)


def untee() -> None:
    """stdout and stderr back to the streams under the tee (a rank that is not rank 0, the end of a sweep point).
    The log file stays open: torch's rank redirection holds the tee it found and flushes it at the rank's end."""
    for name in ("stdout", "stderr"):
        s = getattr(sys, name)
        if isinstance(s, _Tee):
            s.flush()
            setattr(sys, name, s.stream)
    loggers = [logging.getLogger(), *(x for x in logging.Logger.manager.loggerDict.values() if isinstance(x, logging.Logger))]
    for h in (h for x in loggers for h in x.handlers):
        if isinstance(getattr(h, "stream", None), _Tee):  # torch's own handlers took the stream they found at import
            h.setStream(h.stream.stream)


@contextmanager
def teed(path: Path):
    """stdout and stderr also into `path` while the block runs (the launcher: one run folder per sweep point)."""
    tee(path)
    log = sys.stdout.log
    try:
        yield
    finally:
        untee()
        log.close()


def rank(verbose: bool, run_dir: Path, log_name: str) -> None:
    """A rank's console: rank 0 (local rank 0 of the first node) writes into the run's log as the launcher does,
    the others not (a forked rank inherits the launcher's tee); log lines routed by route_logs."""
    console = os.environ.get("LOCAL_RANK", "0") == "0"
    if os.environ.get("RANK", "0") == "0":
        tee(run_dir / log_name)
    else:
        untee()
    route_logs(verbose, console)
