"""Checkpoint folders on disk: atomic publishing, completeness, choosing one to resume, keep-last.

Torch-free (validation reads it). A checkpoint of step n is written by DCP into `step-<n>.partial`;
when every rank's shard is on disk (DCP's finish step gathers every rank's write result before the
coordinator writes `.metadata`, so the save returning on rank 0 is that barrier), rank 0 writes
`COMPLETE.json` (every file with its size, plus what the state was saved from) into it and renames
the folder to `step-<n>`: a crash at any moment leaves either a `.partial` folder, which resume
ignores, or a whole checkpoint. A `step-<n>` folder whose files no longer match its marker
(truncated or missing shard) is reported and skipped.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.config import runfiles

MARKER = runfiles.CHECKPOINT_MARKER


def _step_of(folder: Path) -> int:
    return int(folder.name[len(runfiles.CHECKPOINT_PREFIX) :])


def partial_path(folder: Path, step: int) -> Path:
    return folder / f"{runfiles.CHECKPOINT_PREFIX}{step}{runfiles.CHECKPOINT_PARTIAL}"


def final_path(folder: Path, step: int) -> Path:
    return folder / f"{runfiles.CHECKPOINT_PREFIX}{step}"


def _files(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file() and p.name != MARKER}


def publish(partial: Path, final: Path, info: dict[str, Any]) -> Path:
    """Mark a fully written checkpoint complete and make it visible under its final name in one rename."""
    body = {**info, "files": _files(partial)}
    tmp = partial / (runfiles.CHECKPOINT_MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(partial / runfiles.CHECKPOINT_MARKER)
    if final.exists():  # a rewound run saving the same step again
        shutil.rmtree(final)
    partial.rename(final)
    _fsync_dir(final.parent)
    return final


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def marker(path: Path) -> dict[str, Any]:
    return json.loads((path / runfiles.CHECKPOINT_MARKER).read_text())


def verify(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be used (None: it is complete and its files are intact)."""
    try:
        body = marker(path)
    except FileNotFoundError:
        return f"no {runfiles.CHECKPOINT_MARKER} (the save never finished)"
    except (OSError, ValueError) as e:
        return f"unreadable {runfiles.CHECKPOINT_MARKER} ({e})"
    if ".metadata" not in body.get("files", {}):
        return f"{runfiles.CHECKPOINT_MARKER} lists no DCP .metadata"
    for name, size in body["files"].items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} were written"
    return None


@dataclass
class Scan:
    complete: list[tuple[int, Path]]
    """Usable checkpoints, newest first."""
    skipped: list[tuple[Path, str]]
    """`step-<n>` folders that are not usable, with the reason (partial `.partial` folders are not listed)."""


def scan(folder: Path) -> Scan:
    complete, skipped = [], []
    if folder.is_dir():
        for p in folder.iterdir():
            if not (p.is_dir() and p.name.startswith(runfiles.CHECKPOINT_PREFIX) and p.name[len(runfiles.CHECKPOINT_PREFIX) :].isdigit()):
                continue
            why = verify(p)
            if why is None:
                complete.append((_step_of(p), p))
            else:
                skipped.append((p, why))
    complete.sort(reverse=True)
    skipped.sort(key=lambda x: -_step_of(x[0]))
    return Scan(complete, skipped)


def choose(folder: Path, before: int | None = None) -> tuple[Path | None, list[str]]:
    """Newest complete checkpoint (of a step < `before` when given) and a warning per newer unusable one."""
    s = scan(folder)
    pick = next((p for step, p in s.complete if before is None or step < before), None)
    newest = _step_of(pick) if pick else -1
    warnings = [
        f"skipping checkpoint {p}: {why}; falling back to {pick or 'a fresh start'}"
        for p, why in s.skipped
        if _step_of(p) > newest and (before is None or _step_of(p) < before)
    ]
    return pick, warnings


def prune(folder: Path, keep: int) -> list[Path]:
    """Delete complete checkpoints older than the newest `keep` (0: keep all). Partial and unusable
    folders are left alone: a `.partial` one may still be written by a save in flight."""
    if keep <= 0:
        return []
    old = [p for _, p in scan(folder).complete[keep:]]
    for p in old:
        shutil.rmtree(p)
    return old


def size_estimate_gb(num_params: int) -> float:
    """One checkpoint: fp32 weights + AdamW's two fp32 moments."""
    return num_params * 12 / 1e9
