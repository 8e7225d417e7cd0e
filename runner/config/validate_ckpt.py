"""Rules for checkpoints and text data (torch-free), in the style of runner/validate.py.

`check` is about the config alone (any cluster); `check_launch` looks at this machine before any rank
starts: the data files and tokenizer, the checkpoint folder (writable, room for the checkpoints kept)
and, when resuming, whether the newest complete checkpoint belongs to this model.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

from runner.config import checkpoint, flops
from runner.config.problems import ConfigError, Problem
from runner.config.schema import DataSource, RunConfig


def check(cfg: RunConfig, out: list[Problem]) -> None:
    c, d = cfg.checkpoint, cfg.data
    if c.keep < 0:
        out.append(Problem("checkpoint.keep", c.keep, "must be >= 0", "keep N >= 1 newest checkpoints, or 0 to keep all"))
    if c.min_free_gb < 0:
        out.append(Problem("checkpoint.min_free_gb", c.min_free_gb, "must be >= 0", "use 0 for no margin"))
    if c.resume and not c.enable:
        out.append(Problem("checkpoint.resume", True, "resuming needs checkpoints", "use checkpoint=local (or checkpoint.enable=true)"))
    if d.name == DataSource.text:
        if not d.files:
            out.append(
                Problem("data.files", [], "data=text reads no files", "list local jsonl/txt/parquet files: data.files=[a.jsonl,b.jsonl]")
            )
        if not d.tokenizer:
            out.append(Problem("data.tokenizer", "''", "data=text needs a tokenizer", "point data.tokenizer at a local tokenizer.json"))


def folder(cfg: RunConfig, run_dir: Path) -> Path:
    f = Path(cfg.checkpoint.folder)
    return f if f.is_absolute() else run_dir / f


def _data(cfg: RunConfig, out: list[Problem]) -> None:
    d = cfg.data
    missing = [f for f in d.files if not Path(f).is_file()]
    if missing:
        out.append(
            Problem("data.files", missing, "not found (paths are relative to where `python -m runner` starts)", "give existing local files")
        )
    try:
        vocab = _vocab_size(Path(d.tokenizer))
    except FileNotFoundError:
        out.append(Problem("data.tokenizer", d.tokenizer, "no such file", "point data.tokenizer at a local tokenizer.json"))
        return
    except (OSError, ValueError, KeyError) as e:
        out.append(Problem("data.tokenizer", d.tokenizer, f"not a tokenizers JSON file ({e})", "save one with tokenizers' Tokenizer.save"))
        return
    if vocab > cfg.model.vocab_size:
        out.append(
            Problem(
                "data.tokenizer",
                d.tokenizer,
                f"its vocabulary has {vocab} tokens, more than model.vocab_size {cfg.model.vocab_size}",
                "use a tokenizer with at most model.vocab_size tokens or a model with a larger vocabulary",
            )
        )


def _vocab_size(path: Path) -> int:
    """Tokens of a `tokenizers` JSON file: the model's vocabulary plus added tokens beyond it."""
    body = json.loads(path.read_text())
    ids = set(body["model"]["vocab"].values()) | {t["id"] for t in body.get("added_tokens", [])}
    return max(ids) + 1


def _storage(cfg: RunConfig, run_dir: Path, out: list[Problem]) -> None:
    c, where = cfg.checkpoint, folder(cfg, run_dir)
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


def _resume(cfg: RunConfig, run_dir: Path, out: list[Problem]) -> None:
    pick, _ = checkpoint.choose(folder(cfg, run_dir))
    if pick is None:
        return  # nothing to resume: the run starts at step 1 and says so
    saved, m = checkpoint.marker(pick)["model"], cfg.model
    want = {"name": m.name, "flavor": m.flavor, "dim": m.dim, "num_layers": m.num_layers, "vocab_size": m.vocab_size}
    if saved != want:
        out.append(
            Problem(
                "checkpoint.resume",
                True,
                f"the newest complete checkpoint {pick} holds model {saved}, this run builds {want}",
                "resume with that model",
            )
        )
    elif checkpoint.marker(pick)["step"] >= cfg.training.steps:
        out.append(
            Problem(
                "training.steps",
                cfg.training.steps,
                f"the newest complete checkpoint {pick} is already at step {checkpoint.marker(pick)['step']}",
                "raise training.steps to train further",
            )
        )


def check_launch(cfg: RunConfig, run_dir: Path) -> None:
    out: list[Problem] = []
    if cfg.data.name == DataSource.text:
        _data(cfg, out)
    if cfg.checkpoint.enable:
        _storage(cfg, run_dir, out)
        if cfg.checkpoint.resume:
            _resume(cfg, run_dir, out)
    if out:
        raise ConfigError(out)


def absolute_paths(cfg: RunConfig) -> None:
    """Data paths as absolute ones, so the frozen file replays from any directory."""
    cfg.data.files = [os.path.abspath(f) for f in cfg.data.files]
    if cfg.data.tokenizer:
        cfg.data.tokenizer = os.path.abspath(cfg.data.tokenizer)
