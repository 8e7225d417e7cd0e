"""Data rules (torch-free): the config alone (`check`), and the files on disk (`files`, a FILES rule: the preflight
that `mode=validate` and `mode=train` run before any process starts). data=text: local files whose records hold the text field, and a
tokenizers JSON file whose vocabulary fits the model and, with data.document_mask, whose end-of-document token is known
(runner.formats.documents); CPU ring attention (cp > 1 on CPU) takes no document mask. data=tokens: prepared folders.
A folder must have an intact manifest (format 2), the tokenizer it was prepared with must be data.tokenizer's (when
set) and the same across a mixture, its vocabulary must fit the model, and its train split must hold at least one
sample (seq_len pairs; seq_len + 1 tokens with data.document_mask=false)."""

from __future__ import annotations

import json
from pathlib import Path

from runner.formats import data_manifest as mf
from runner.formats.user_files import UnreadableFile
from runner.schema import DataConfig, DataSource, DeviceType, RunConfig, TextFormat
from runner.schema.problems import Problem

PREPARE = "prepare it with `python -m runner.data prepare --input <files> --tokenizer <tokenizer.json> --out <folder>`"


def check(cfg: RunConfig, out: list[Problem]) -> None:
    """The data config alone (the files it names: `files`)."""
    d = cfg.data
    if d.name == DataSource.text:
        if not d.files:
            out.append(
                Problem("data.files", [], "data=text reads no files", "list local jsonl/txt/parquet files: data.files=[a.jsonl,b.jsonl]")
            )
        if not d.tokenizer:
            out.append(Problem("data.tokenizer", "''", "data=text needs a tokenizer", "point data.tokenizer at a local tokenizer.json"))
    if d.name == DataSource.tokens:
        _tokens(cfg, out)
    if d.name != DataSource.synthetic and d.document_mask and cfg.parallelism.cp > 1 and cfg.cluster.device == DeviceType.cpu:
        out.append(
            Problem(
                "data.document_mask",
                True,
                f"CPU ring attention (parallelism.cp = {cfg.parallelism.cp}) takes a causal mask only, not packed documents' mask",
                "set data.document_mask=false on this CPU cluster, or parallelism.cp=1 (a CUDA cluster shards the document mask)",
            )
        )


def files(cfg: RunConfig, out: list[Problem]) -> None:
    """The data files (their text field) and tokenizer, or the prepared folders, on this machine now."""
    if cfg.data.name == DataSource.text:
        _text(cfg.data, cfg.model.vocab_size, out)
    if cfg.data.name == DataSource.tokens:
        folders(cfg, out)


def _tokens(cfg: RunConfig, out: list[Problem]) -> None:
    d = cfg.data
    if not d.path and not d.mix:
        out.append(Problem("data.path", "''", "data=tokens reads no prepared folder", f"set data.path (or data.mix); {PREPARE}"))
    if d.path and d.mix:
        out.append(
            Problem(
                "data.mix",
                f"{len(d.mix)} sources",
                "data.path and data.mix are both set",
                "use data.path for one folder, data.mix for several",
            )
        )
    for i, m in enumerate(d.mix):
        if not m.path:
            out.append(Problem(f"data.mix[{i}].path", "''", "a mixture source needs a folder", f"give each source a path; {PREPARE}"))
        if not m.weight > 0:
            out.append(
                Problem(f"data.mix[{i}].weight", m.weight, "must be > 0", "give each source a positive share (weights are normalized)")
            )


def _text(d: DataConfig, vocab_size: int, out: list[Problem]) -> None:
    missing = [f for f in d.files if not Path(f).is_file()]
    if missing:
        out.append(
            Problem("data.files", missing, "not found (paths are relative to where `python -m runner` starts)", "give existing local files")
        )
    for f in d.files:
        if f not in missing and holds_no_records(Path(f), d):
            out.append(Problem("data.files", f, "the file holds no records", "leave it out of data.files, or give it its documents"))
        elif f not in missing and (why := first_record_lacks(Path(f), d)):
            out.append(Problem("data.text_field", d.text_field, f"{f}: {why}", "set data.text_field to the column holding the documents"))
    _tokenizer(d.tokenizer, vocab_size, out, d.eos_token if d.document_mask else None)


def holds_no_records(path: Path, d: DataConfig) -> bool:
    """Whether the file is empty: blank (JSON, text), or parquet with no rows. Reads until the first non-blank byte."""
    if d.format == TextFormat.parquet:
        import pyarrow.parquet as pq

        try:
            return pq.read_metadata(path).num_rows == 0
        except Exception:  # not parquet: first_record_lacks says so
            return False
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 16):
            if chunk.strip():
                return False
    return True


def first_record_lacks(path: Path, d: DataConfig) -> str | None:
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
        return None  # an empty file: holds_no_records says so
    try:
        first = json.loads(line)
    except ValueError:
        return None  # not JSON lines (e.g. one JSON document): left to the datasets loader
    if isinstance(first, dict) and d.text_field not in first:
        return f"its first record has the fields {sorted(first)}"
    return None


def _tokenizer(path: str, vocab_size: int, out: list[Problem], eos_token: str | None = None) -> None:
    """The tokenizer file; with `eos_token` (data.document_mask on) also its document frame (runner.formats.documents)."""
    from runner.formats import documents

    if not Path(path).is_file():
        out.append(Problem("data.tokenizer", path, "no such file", "point data.tokenizer at a local tokenizer.json"))
        return
    try:
        tok = mf.tokenizer(path)  # the tokenizers library reads the file itself (torch-free, ~15 ms to import)
        frame = documents.specials(tok, path, eos_token) if eos_token is not None else None
    except UnreadableFile as e:
        out.append(Problem("data.tokenizer", path, f"{e.path} {e.why}", e.fix))
        return
    vocab = mf.vocab_size(tok)
    if frame is not None and (why := documents.special_problem(frame, path)):
        if frame.source is None:
            fix = f"set data.eos_token to the tokenizer's end-of-document token, or {documents.FIX}"
            out.append(Problem("data.eos_token", eos_token, f"{why}: data.document_mask cannot tell documents apart", fix))
        else:
            out.append(Problem("data.tokenizer", path, f"{why}: data.document_mask cannot tell documents apart", documents.FIX))
    if vocab > vocab_size:
        out.append(
            Problem(
                "data.tokenizer",
                path,
                f"its vocabulary has {vocab} tokens, more than model.vocab_size {vocab_size}",
                "use a tokenizer with at most model.vocab_size tokens or a model with a larger vocabulary",
            )
        )


def folders(cfg: RunConfig, out: list[Problem]) -> None:
    """Every problem of the prepared folders against this config."""
    hashes: dict[str, str] = {}
    loaded = []
    for name, folder, weight in mf.sources(cfg.data.path, cfg.data.mix):
        try:
            m = mf.load(folder)
        except mf.ManifestError as e:
            out.append(Problem(name, folder, str(e), PREPARE))
            continue
        hashes[name] = m["tokenizer"]["sha256"]
        loaded.append((name, folder, weight, m))
        _fits(cfg, name, folder, m, out)
    _same_tokenizer(cfg, hashes, out)
    if len(loaded) == len(mf.sources(cfg.data.path, cfg.data.mix)):
        _held_out(cfg, loaded, out)


def _samples(cfg: RunConfig, split: dict) -> int:
    """The samples a split of a prepared folder gives: seq_len (input, label) pairs each, a document of L tokens giving
    L - 1 pairs (runner.formats.documents); seq_len + 1 tokens each with data.document_mask=false."""
    if cfg.data.document_mask:
        return max(split["tokens"] - split["documents"], 0) // cfg.training.seq_len
    return max(split["tokens"] - 1, 0) // cfg.training.seq_len


def _held_out(cfg: RunConfig, loaded: list[tuple[str, str, float, dict]], out: list[Problem]) -> None:
    """An evaluation pass reads eval.steps global batches of the held-out split, each source its share of the mixture
    (runner.run.evaluate.check_split refuses a shorter split on every rank at start-up): refused here from the
    manifests' counts, with the eval.steps that fits."""
    from runner.config import fault_tolerance
    from runner.formats.data_order import Mixture

    e, t = cfg.eval, cfg.training
    if e.interval == 0 or e.steps < 1 or t.seq_len < 1:
        return
    batch = t.global_batch_size * (cfg.parallelism.dp_replicate if fault_tolerance.enabled(cfg) else 1)  # runner.run.ft.data_coords
    held = [_samples(cfg, m["splits"]["eval"]) for *_, m in loaded]  # runner.run.token_data.TokenData
    mix = Mixture([w for _, _, w, _ in loaded])

    def short(steps: int) -> list[int]:
        return [i for i, (h, r) in enumerate(zip(held, mix.counts(steps * batch), strict=True)) if r > h]

    fits = next(s for s in range(e.steps, -1, -1) if not short(s))
    reads = mix.counts(e.steps * batch)
    unit = (
        f"training.seq_len = {t.seq_len} (input, label) pairs"
        if cfg.data.document_mask
        else f"training.seq_len + 1 = {t.seq_len + 1} tokens"
    )
    for i in short(e.steps):
        name, folder, _, m = loaded[i]
        tokens, fraction = m["splits"]["eval"]["tokens"], m.get("eval_fraction")
        again = f"prepare {folder} again with a larger --eval-fraction" + (f" (it was {fraction})" if fraction is not None else "")
        share = ("its share of " if len(loaded) > 1 else "") + f"eval.steps {e.steps} x global batch {batch}"
        out.append(
            Problem(
                name,
                folder,
                f"its held-out split holds {held[i]} samples of {unit} ({tokens:,} tokens), "
                f"fewer than the {reads[i]} an evaluation pass reads ({share})",
                f"use eval.steps={fits}, or {again}" if fits else f"{again}, or set eval.interval=0 to evaluate nothing",
            )
        )


def _fits(cfg: RunConfig, name: str, folder: str, m: dict, out: list[Problem]) -> None:
    vocab, need = m["tokenizer"]["vocab_size"], cfg.training.seq_len + 1
    if vocab > cfg.model.vocab_size:
        out.append(
            Problem(
                name,
                folder,
                f"it was prepared with a {vocab}-token vocabulary, more than model.vocab_size {cfg.model.vocab_size}",
                "use a model with a larger vocabulary, or prepare the data with a smaller tokenizer",
            )  # fmt: skip
        )
    tokens = m["splits"]["train"]["tokens"]
    if cfg.data.document_mask:  # a document of L tokens gives L - 1 (input, label) pairs (runner.formats.documents)
        tokens, need = tokens - m["splits"]["train"]["documents"], cfg.training.seq_len
        held = f"its train split holds {tokens} (input, label) pairs (tokens less one per document), fewer than training.seq_len = {need}"
    else:
        held = f"its train split holds {tokens} tokens, fewer than training.seq_len + 1 = {need}"
    if tokens < need:
        out.append(Problem(name, folder, held, "prepare more text (or a smaller --eval-fraction), or lower training.seq_len"))


def split_problem(name: str, folder: str, split: str, seq_len: int) -> Problem | None:
    """A split with fewer than seq_len + 1 tokens (for callers that read another split, e.g. evaluation)."""
    m = mf.load(folder)
    tokens = m["splits"][split]["tokens"]
    if tokens >= seq_len + 1:
        return None
    return Problem(name, folder, f"its {split} split holds {tokens} tokens, fewer than training.seq_len + 1 = {seq_len + 1}",
                   "prepare more text or hold out a larger share (--eval-fraction)")  # fmt: skip


def _same_tokenizer(cfg: RunConfig, hashes: dict[str, str], out: list[Problem]) -> None:
    d = cfg.data
    if d.tokenizer and hashes:
        if not Path(d.tokenizer).is_file():
            out.append(
                Problem(
                    "data.tokenizer",
                    d.tokenizer,
                    "no such file",
                    "point data.tokenizer at the tokenizer the data was prepared with, or leave it empty",
                )
            )
            return
        try:
            mine = mf.tokenizer_info(Path(d.tokenizer))["sha256"]
        except UnreadableFile as e:
            out.append(Problem("data.tokenizer", d.tokenizer, f"{e.path} {e.why}", e.fix))
            return
        for name, h in hashes.items():
            if h != mine:
                out.append(
                    Problem(
                        "data.tokenizer",
                        d.tokenizer,
                        f"differs from the tokenizer {name} was prepared with (sha256 {h[:12]} vs {mine[:12]})",
                        "use the tokenizer the folder was prepared with, or prepare the data again with this one",
                    )  # fmt: skip
                )
    elif len(set(hashes.values())) > 1:
        seen = ", ".join(f"{n}: {h[:12]}" for n, h in hashes.items())
        out.append(
            Problem("data.mix", seen, "the sources were prepared with different tokenizers", "prepare every source with the same tokenizer")
        )
