"""A shared Hydra multirun read point by point (conftest's multirun, shared_runs and dry_runs): a point that failed
fails only the tests that read it; a multirun that failed as a whole fails every test that reads any of its points."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest


class Lazy(Mapping):
    """names -> get(name), computed at each access: a test that reads a failed point fails, its neighbours go on."""

    def __init__(self, names: Iterable[str], get: Callable[[str], object]):
        self.names, self.get = list(names), get

    def __getitem__(self, name: str):
        if name not in self.names:
            raise KeyError(name)
        return self.get(name)

    def __contains__(self, name) -> bool:
        return name in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


@dataclass
class Multirun(Mapping):
    """One shared Hydra multirun, point by point: runs[name] is point(runs, name), (its run folder, its part of the
    console), and fails the test that asks for a point that failed; the tests of the other points go on."""

    folders: dict[str, Path]
    """Each point's run folder (Hydra's sweep/<i>)."""
    consoles: dict[str, str]
    """Each point's part of the console (stdout split at Hydra's `#i :` lines; "" for a point that never started)."""
    failed: dict[str, str]
    """Why each point that failed did: its failed.json or invalid.json and the tails of its console and rank logs."""
    error: str | None = None
    """Why the multirun failed as a whole (every point fails with it), with its stdout and stderr tails."""
    stderr: str = ""
    """The multirun's stderr, every point's (warnings, library log lines)."""

    def __getitem__(self, name: str) -> tuple[Path, str]:
        return point(self, name)

    def __contains__(self, name) -> bool:
        return name in self.folders

    def __iter__(self) -> Iterator[str]:
        return iter(self.folders)

    def __len__(self) -> int:
        return len(self.folders)


def point(runs: Multirun, name: str) -> tuple[Path, str]:
    """The point's (run folder, part of the console); pytest.fail, in the test that asks, when that point failed or the
    multirun failed as a whole."""
    if runs.error is not None:
        pytest.fail(runs.error, pytrace=False)
    if name in runs.failed:
        pytest.fail(f"sweep point {name} failed: {runs.failed[name]}", pytrace=False)
    return runs.folders[name], runs.consoles[name]


def multirun_status(names: list[str], sweep: Path, proc: subprocess.CompletedProcess) -> Multirun:
    """Read the multirun `proc` of the points `names` (in order) out of its sweep folder. The runner exits 1 when a
    point's ranks failed (failed.json in its run folder) and goes on with the next point; an invalid point (invalid.json)
    leaves the exit code 0. Any other exit code, an exit 1 with no failed.json, or no run folder at all fails the
    multirun as a whole."""
    from runner.formats import runfiles

    folders = {name: sweep / str(i) for i, name in enumerate(names)}
    split = re.split(r"\[HYDRA\]\s+#(\d+) : ", proc.stdout)
    parts = {int(i): part for i, part in zip(split[1::2], split[2::2], strict=True)}
    consoles = {name: parts.get(i, "") for i, name in enumerate(names)}
    failed = {name: why for name in names if (why := _point_failure(folders[name], consoles[name])) is not None}
    ranks_failed = any((f / runfiles.FAILED).is_file() for f in folders.values())
    error = None
    if proc.returncode not in (0, 1) or (proc.returncode == 1 and not ranks_failed) or not any(f.is_dir() for f in folders.values()):
        error = f"multirun failed (exit code {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return Multirun(folders, consoles, failed, error, proc.stderr)


def _point_failure(folder: Path, console: str) -> str | None:
    """Why the point of run folder `folder` failed, or None: its record (failed.json, invalid.json) with the tails of its
    console and of its ranks' stderr logs (local ranks 1 and up write theirs to files); no folder: it never started."""
    from runner.formats import runfiles

    if not folder.is_dir():
        return f"no run folder {folder}: the multirun ended before this point"
    record = next((folder / n for n in (runfiles.FAILED, runfiles.INVALID) if (folder / n).is_file()), None)
    if record is None:
        return None
    logs = [p for p in sorted((folder / runfiles.LOGS).rglob("stderr.log")) if p.stat().st_size]
    tails = "".join(f"\n--- {log}:\n{log.read_text(errors='replace')[-1500:]}" for log in logs[:4])
    return f"{record}:\n{record.read_text()}--- its console:\n{console[-3000:]}{tails}"
