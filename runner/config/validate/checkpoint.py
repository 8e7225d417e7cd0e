"""Rules for checkpoints and text data (torch-free), in the style of runner/validate.py.

`check` is about the config alone (any cluster), except that `mode=validate`, the check users run before
training, also looks at the local data files and tokenizer. `check_launch` looks at this machine before any
rank starts: the data files (their text field) and tokenizer, the checkpoint folder (writable, room for the
checkpoints kept) and, when resuming, the checkpoint to start from: it must exist, be intact and belong to
this model; it is pinned into `checkpoint.resume_from`, so the frozen file replays from the same step.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import runner.config.validate.data as validate_tokens
from runner.config import checkpoint, flops
from runner.config.problems import ConfigError, Problem
from runner.config.schema import DataConfig, DataSource, Mode, RunConfig, TextFormat


def check(cfg: RunConfig, out: list[Problem]) -> None:
    c, d = cfg.checkpoint, cfg.data
    if c.keep < 0:
        out.append(Problem("checkpoint.keep", c.keep, "must be >= 0", "keep N >= 1 newest checkpoints, or 0 to keep all"))
    if c.min_free_gb < 0:
        out.append(Problem("checkpoint.min_free_gb", c.min_free_gb, "must be >= 0", "use 0 for no margin"))
    if c.resume and not c.enable:
        out.append(Problem("checkpoint.resume", True, "resuming needs checkpoints", "use checkpoint=local (or checkpoint.enable=true)"))
    if c.resume_from and not c.resume:
        out.append(
            Problem("checkpoint.resume_from", c.resume_from, "is read only when resuming", "add checkpoint.resume=true, or leave it empty")
        )
    if d.name == DataSource.text:
        if not d.files:
            out.append(
                Problem("data.files", [], "data=text reads no files", "list local jsonl/txt/parquet files: data.files=[a.jsonl,b.jsonl]")
            )
        if not d.tokenizer:
            out.append(Problem("data.tokenizer", "''", "data=text needs a tokenizer", "point data.tokenizer at a local tokenizer.json"))
        if cfg.mode == Mode.validate and d.files and d.tokenizer:
            _data(d, cfg.model.vocab_size, out)
    if d.name == DataSource.tokens:
        validate_tokens.check(cfg, out)


def _data(d: DataConfig, vocab_size: int, out: list[Problem]) -> None:
    missing = [f for f in d.files if not Path(f).is_file()]
    if missing:
        out.append(
            Problem("data.files", missing, "not found (paths are relative to where `python -m runner` starts)", "give existing local files")
        )
    for f in d.files:
        if f not in missing and (why := _first_record_lacks(Path(f), d)):
            out.append(Problem("data.text_field", d.text_field, f"{f}: {why}", "set data.text_field to the column holding the documents"))
    _tokenizer(d.tokenizer, vocab_size, out)


def _first_record_lacks(path: Path, d: DataConfig) -> str | None:
    """Why the text field is not in the file's first record (None: it is, or the format has no field to check)."""
    if d.format == TextFormat.parquet:
        import pyarrow.parquet as pq  # only for parquet data; the schema is read from the footer

        try:
            names = pq.read_schema(path).names
        except Exception as e:  # pyarrow raises its own error types for a file that is not parquet
            return f"not a parquet file ({type(e).__name__}: {e})"
        return None if d.text_field in names else f"its columns are {names}"
    if d.format != TextFormat.json:
        return None  # plain text: every line is a document
    with open(path, encoding="utf-8", errors="replace") as fh:
        line = next((ln for ln in fh if ln.strip()), None)
    if line is None:
        return "it holds no records"
    try:
        first = json.loads(line)
    except ValueError:
        return None  # not JSON lines (e.g. one JSON document): left to the datasets loader
    if isinstance(first, dict) and d.text_field not in first:
        return f"its first record has the fields {sorted(first)}"
    return None


def _tokenizer(path: str, vocab_size: int, out: list[Problem]) -> None:
    if not Path(path).is_file():
        out.append(Problem("data.tokenizer", path, "no such file", "point data.tokenizer at a local tokenizer.json"))
        return
    try:
        vocab = _vocab_size(Path(path))
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        out.append(Problem("data.tokenizer", path, f"not a tokenizers JSON file ({e})", "save one with tokenizers' Tokenizer.save"))
        return
    if vocab > vocab_size:
        out.append(
            Problem(
                "data.tokenizer",
                path,
                f"its vocabulary has {vocab} tokens, more than model.vocab_size {vocab_size}",
                "use a tokenizer with at most model.vocab_size tokens or a model with a larger vocabulary",
            )
        )


def _vocab_size(path: Path) -> int:
    """Token ids the model must embed: the largest id of the tokenizer (any model type, added tokens included) + 1.
    The `tokenizers` library reads the file itself (torch-free, ~15 ms to import)."""
    from tokenizers import Tokenizer

    return max(Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True).values()) + 1


def _storage(cfg: RunConfig, where: Path, out: list[Problem]) -> None:
    c = cfg.checkpoint
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        out.append(Problem("checkpoint.folder", where, f"{probe} is a file, so the folder cannot be made", "name a folder path"))
        return
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        out.append(
            Problem(
                "checkpoint.folder", where, f"cannot write into {probe} ({e.strerror})", "choose a writable folder or fix its permissions"
            )
        )
        return
    one = checkpoint.size_estimate_gb(flops.num_params(cfg.model))
    saves = math.ceil(cfg.training.steps / c.interval)  # every interval, plus the last step
    count = min(c.keep + 1, saves) if c.keep else saves  # a new one is written before the oldest goes
    need, free = count * one + c.min_free_gb, shutil.disk_usage(probe).free / 1e9
    if free < need:
        out.append(
            Problem(
                "checkpoint.folder",
                where,
                f"its filesystem has {free:.3g} GB free; {count} checkpoint(s) of {one:.3g} GB (fp32 weights + AdamW state)"
                f" + checkpoint.min_free_gb {c.min_free_gb:g} need {need:.3g} GB",
                "free space, point checkpoint.folder at a larger filesystem, or lower checkpoint.keep",
            )
        )


def _resume_point(cfg: RunConfig, where: Path, out: list[Problem]) -> Path | None:
    """The checkpoint a resume starts from (pinned, else the newest intact one in `where`), or a problem saying why none."""
    c = cfg.checkpoint
    if c.resume_from:
        pick = Path(c.resume_from)
        why = checkpoint.verify(pick)
        if why is None:
            return pick
        out.append(
            Problem(
                "checkpoint.resume_from",
                c.resume_from,
                f"cannot be resumed from: {why}",
                "name an intact checkpoint folder (<folder>/step-<n>), or leave it empty to resume from the newest in checkpoint.folder",
            )
        )
        return None
    pick, warnings = checkpoint.choose(where)
    for w in warnings:
        print(f"WARNING: {w}", file=sys.stderr, flush=True)
    if pick is None:
        state = "does not exist" if not where.exists() else "holds no intact checkpoint"
        out.append(
            Problem(
                "checkpoint.resume",
                True,
                f"nothing to resume: the checkpoint folder {where} {state}",
                "point checkpoint.folder at the stopped run's checkpoints (an absolute path), "
                "or drop checkpoint.resume=true to start at step 1",
            )
        )
    return pick


def _resume(cfg: RunConfig, where: Path, out: list[Problem]) -> None:
    pick = _resume_point(cfg, where, out)
    if pick is None:
        return
    info = checkpoint.marker(pick)
    diff = checkpoint.identity_mismatch(info["model"], checkpoint.model_identity(cfg.model))
    if diff:
        out.append(Problem("checkpoint.resume", True, f"the checkpoint {pick} holds another model: {diff}", "resume with that model"))
    elif info["step"] >= cfg.training.steps:
        out.append(
            Problem(
                "training.steps",
                cfg.training.steps,
                f"the checkpoint {pick} is already at step {info['step']}",
                "raise training.steps to train further",
            )
        )
    else:
        cfg.checkpoint.resume_from = os.path.abspath(pick)


def check_launch(cfg: RunConfig, run_dir: Path) -> None:
    """Raise ConfigError listing every problem; when resuming, pin the checkpoint into cfg.checkpoint.resume_from."""
    out: list[Problem] = []
    if cfg.data.name == DataSource.text:
        _data(cfg.data, cfg.model.vocab_size, out)
    if cfg.data.name == DataSource.tokens:
        validate_tokens.folders(cfg, out)
    if cfg.checkpoint.enable:
        where = checkpoint.folder(cfg.checkpoint, run_dir)
        _storage(cfg, where, out)
        if cfg.checkpoint.resume:
            _resume(cfg, where, out)
    if out:
        raise ConfigError(out)


def absolute_paths(cfg: RunConfig) -> None:
    """Data paths as absolute ones, so the frozen file replays from any directory."""
    cfg.data.files = [os.path.abspath(f) for f in cfg.data.files]
    if cfg.data.tokenizer:
        cfg.data.tokenizer = os.path.abspath(cfg.data.tokenizer)
    if cfg.data.path:
        cfg.data.path = os.path.abspath(cfg.data.path)
    for m in cfg.data.mix:
        m.path = os.path.abspath(m.path) if m.path else m.path
