"""What a Hugging Face export takes from the run besides the checkpoint: the tokenizer it writes (`--tokenizer`,
the run's `data.tokenizer`, or for `data=tokens` the one its prepared folders' manifest names, checked by sha256),
and every path the run reads, which the export never writes over (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runner.formats import data_manifest as mf
from runner.formats import runfiles
from runner.formats.user_files import UnreadableFile
from runner.schema import DataConfig, DataSource

ADD = "Fix: export again with --tokenizer <the tokenizer.json the data was prepared with>"


class TokenizerRefused(Exception):
    """The tokenizer named cannot be exported with this run; the message names it and the fix."""


@dataclass
class Tokenizer:
    path: str = ""
    """The tokenizers JSON file the export writes ('' = none)."""
    eos_token: str = ""
    note: str = ""
    """Why the export has no tokenizer and how to add one, in one line ('' = it has one, or the run had none)."""
    warn: bool = False
    """The run had a tokenizer that the export cannot take (a WARNING), not a checkpoint outside any run."""


def choose(ckpt: Path, data: DataConfig | None, given: str = "", eos: str | None = None) -> Tokenizer:
    """The tokenizer to export for checkpoint `ckpt` of a run with `data` (None: no run folder around `ckpt`)."""
    if given:
        _readable(given, "--tokenizer")
        if data is not None and data.name == DataSource.tokens:
            _prepared_with(given, data)
        return Tokenizer(given, eos if eos is not None else _run_eos(data))
    if data is None:
        where = f"{ckpt} is not in a run folder ({runfiles.FROZEN} two levels up)"
        return Tokenizer(note=f"the export has no tokenizer: {where}. Add one: export again with --tokenizer <tokenizer.json>")
    if data.tokenizer:
        if not Path(data.tokenizer).is_file():
            raise TokenizerRefused(
                f"data.tokenizer {data.tokenizer} (the run's, in its {runfiles.FROZEN}) is not there, so the export would have no "
                "tokenizer. Fix: put the tokenizer back at that path, or export again with --tokenizer <tokenizer.json>"
            )
        _readable(data.tokenizer, "the run's data.tokenizer")
        return Tokenizer(data.tokenizer, eos if eos is not None else _run_eos(data))
    if data.name == DataSource.tokens:
        return _from_manifest(data, eos)
    return Tokenizer()  # synthetic tokens: there is no tokenizer to export


def _readable(path: str, what: str) -> None:
    try:
        mf.tokenizer(path)
    except UnreadableFile as e:
        raise TokenizerRefused(f"{what} {e}") from e


def _manifests(data: DataConfig) -> list[tuple[str, dict | str]]:
    """(folder, its manifest, or why it cannot be read) of each prepared folder the run reads."""
    out = []
    for _, folder, _ in mf.sources(data.path, data.mix):
        try:
            out.append((folder, mf.load(folder)))
        except mf.ManifestError as e:
            out.append((folder, str(e)))
    return out


def _from_manifest(data: DataConfig, eos: str | None) -> Tokenizer:
    """The tokenizer the run's prepared folders were made with, where it is still at its path with the same sha256."""
    why = "the run reads no prepared folder"
    for folder, m in _manifests(data):
        if isinstance(m, str):
            why = m
            continue
        path, want = m["tokenizer"].get("path", ""), m["tokenizer"]["sha256"]
        try:
            got = mf.tokenizer_info(Path(path))["sha256"] if path and Path(path).is_file() else None
        except UnreadableFile as e:
            why, got = f"{e.path} (the tokenizer {folder} was prepared with) {e.why}", ""
        if got == want:
            return Tokenizer(path, eos if eos is not None else m.get("eos_token", data.eos_token))
        if got is None:
            why = f"{path or 'its path'}, the tokenizer {folder} was prepared with ({mf.MANIFEST}), is not there"
        elif got:
            why = f"{path} changed since {folder} was prepared with it (sha256 {got[:12]}, the manifest says {want[:12]})"
    return Tokenizer(note=f"the export has no tokenizer: {why}. {ADD}", warn=True)


def _prepared_with(path: str, data: DataConfig) -> None:
    """Refuse a --tokenizer that is not the one the run's prepared folders were made with (checked by sha256)."""
    mine = mf.tokenizer_info(Path(path))["sha256"]
    for folder, m in _manifests(data):
        if not isinstance(m, str) and m["tokenizer"]["sha256"] != mine:
            want = m["tokenizer"]["sha256"]
            raise TokenizerRefused(
                f"--tokenizer {path} differs from the tokenizer {folder} was prepared with (sha256 {mine[:12]}, the manifest "
                f"says {want[:12]}). Fix: give the tokenizer the data was prepared with ({m['tokenizer'].get('path', '?')})"
            )


def _run_eos(data: DataConfig | None) -> str:
    """The run's end-of-text token: a prepared folder's (data=tokens), else data.eos_token (the schema's by default)."""
    if data is None:
        return DataConfig().eos_token
    if data.name == DataSource.tokens:
        for _, m in _manifests(data):
            if not isinstance(m, str) and m.get("eos_token"):
                return m["eos_token"]
    return data.eos_token


def reads(cfg) -> list[tuple[str, Path]]:
    """(field, path) of every file or folder the run `cfg` reads (None: no run, nothing known)."""
    if cfg is None:
        return []
    d = cfg.data
    named = [("data.tokenizer", d.tokenizer), *((f"data.files[{i}]", f) for i, f in enumerate(d.files))]
    named += [(f"data.eval_files[{i}]", f) for i, f in enumerate(d.eval_files)]
    named += [(name, folder) for name, folder, _ in mf.sources(d.path, d.mix)]
    named += [("model.init_from", cfg.model.init_from), ("checkpoint.init_from", cfg.checkpoint.init_from)]
    named += [("checkpoint.resume_from", cfg.checkpoint.resume_from)]
    return [(name, Path(p)) for name, p in named if p]
