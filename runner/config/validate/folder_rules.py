"""The folders a run writes (torch-free; a FILES rule of the preflight): each must be a folder this machine can write
into, or one it can make. A file in a folder's place passed before and failed a rank mid-run (a `checkpoint.local.folder`
that is a file: NotADirectoryError on rank 0 after the first local save, with a rank traceback)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from runner.formats import checkpoint, local_checkpoint, runfiles
from runner.schema import DataSource, RunConfig
from runner.schema.problems import Problem

RUN_DIR = "hydra.run.dir"


def check(cfg: RunConfig, run_dir: Path, out: list[Problem]) -> None:
    """Every folder of `written` that cannot be written, once (not again below a folder already refused)."""
    refused: list[Path] = []
    for field, value, where, what in written(cfg, run_dir):
        if any(where == r or r in where.parents for r in refused):
            continue
        why = unwritable(where)
        if why is not None:
            refused.append(where)
            out.append(Problem(field, value, why + (f" (the run writes {what} there)" if what else ""), _fix(why)))


def _fix(why: str) -> str:
    if "is a file, not a folder" in why:
        return "name a folder, or move that file away"
    return "name a folder path" if "is a file" in why else "choose a writable folder or fix its permissions"


def written(cfg: RunConfig, run_dir: Path) -> list[tuple[str, object, Path, str]]:
    """(field, value, folder, what the run writes there) of every folder the run writes besides the run folder itself:
    checkpoints (shared, exports, the local tier of each node this machine holds), rank logs, the text data cache,
    profiler traces and flight-recorder dumps."""
    c, out = cfg.checkpoint, []
    if c.enable:
        shared = checkpoint.folder(c, run_dir)
        out.append(("checkpoint.folder", c.folder, shared, ""))
        if c.export_final_model:
            out.append(("checkpoint.export_final_model", True, shared / runfiles.FINAL_MODEL, "the model-only export"))
        if c.export_hf:
            out.append(("checkpoint.export_hf", True, shared / runfiles.HF_EXPORT, "the Hugging Face export"))
        if c.local.folder and Path(c.local.folder).is_absolute():
            for node in local_checkpoint.visible_nodes(cfg) or [local_checkpoint.this_node()]:
                out.append(("checkpoint.local.folder", c.local.folder, local_checkpoint.node_folder(c.local, node), ""))
    out.append((RUN_DIR, str(run_dir), run_dir / runfiles.LOGS, "the rank logs"))
    if cfg.data.name == DataSource.text:
        out.append((RUN_DIR, str(run_dir), run_dir / runfiles.DATA_CACHE, "the tokenized text's cache"))
    if cfg.profile.steps or cfg.profile.every:
        out.append((RUN_DIR, str(run_dir), run_dir / runfiles.PROFILE, "the profiler's traces"))
    fr = cfg.distributed.flight_recorder
    if fr.enable:
        out.append(("distributed.flight_recorder.folder", fr.folder, run_dir / fr.folder, "the flight recorder's dumps"))
    return out


def nearest(where: Path) -> Path:
    """`where`, or its nearest ancestor that exists (where the folder would be made)."""
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def unwritable(where: Path) -> str | None:
    """Why the folder `where` cannot be written, or made and written (None: it can); writes and removes one temporary
    file to find out (permissions alone do not say: ACLs, read-only mounts, root squashing)."""
    probe = nearest(where)
    if not probe.is_dir():
        return f"{where} is a file, not a folder" if probe == where else f"{probe} is a file, so the folder cannot be made"
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        return f"cannot write into {probe} ({e.strerror})"
    return None
