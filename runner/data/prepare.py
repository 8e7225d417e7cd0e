"""Tokenize local corpora into a prepared folder (layout in runner/formats/data_manifest.py), one part per input file.

Each input file's documents are read into an Arrow file of one column (read.py: a bad line is refused
with its file and line), tokenized by `datasets.map(batched=True, num_proc=...)` with a local `tokenizers`
JSON file (each document framed by the tokenizer's own BOS and EOS: runner.formats.documents), and written as a
train and a held-out (eval) token file with their document indexes. Document j of a file is held out when
floor((j + 1) f) > floor(j f), f the eval fraction: an exact share, evenly spread, the same on every run. A
record whose text is null, missing or empty is skipped (it keeps its j), and counted: `skipped_records`, per source and in all.
A part is published by renaming its files into place and then writing its record; the manifest comes
last; then the files of parts beyond the inputs (a rerun with fewer of them) are removed. A rerun skips
every part whose record matches its source (size and sha256) and settings, so it is idempotent and resumes
an interrupted preparation where it stopped. A failure or an interruption leaves no file of the part it
was writing and no `.cache`; the parts finished before it stay, and the manifest is the previous one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runner.data import read
from runner.formats import data_manifest as mf
from runner.formats import documents

PART_FILE = re.compile(r"part-(\d+)\.")
FORMATS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet"}


@dataclass(frozen=True)
class Request:
    inputs: list[Path]
    tokenizer: Path
    out: Path
    text_field: str = "text"
    eos_token: str = "<|end_of_text|>"
    eval_fraction: float = 0.01
    num_proc: int = 1
    batch_size: int = 1000


class _Encode:
    """The batched map function (picklable for num_proc workers): the token ids of each non-empty document framed by
    the tokenizer's BOS and EOS (runner.formats.documents.Specials.frame, as TorchTitan's text dataset encodes them), and
    whether it is held out."""

    def __init__(self, tokenizer: str, frame: documents.Specials, eval_fraction: float):
        self.tokenizer, self.specials, self.f = tokenizer, frame, eval_fraction
        self.parent, self._tok = os.getpid(), None

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        if self._tok is None:
            from tokenizers import Tokenizer

            if os.getpid() != self.parent:  # a num_proc worker: Ctrl-C is the parent's to handle, not a traceback per worker
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            self._tok = Tokenizer.from_file(self.tokenizer)
        keep = [(j, d) for j, d in zip(indices, batch[read.COLUMN], strict=True) if d]
        ids = [self.specials.frame(e.ids) for e in self._tok.encode_batch([d for _, d in keep])]
        held = [int((j + 1) * self.f) > int(j * self.f) for j, _ in keep]
        return {"ids": ids, "held_out": held}


def _settings(req: Request, fmt: str, tok: dict, frame: documents.Specials, dtype: str) -> dict:
    return {"format": fmt, "text_field": req.text_field, **documents.describe(frame), "eval_fraction": req.eval_fraction,
            "tokenizer_sha256": tok["sha256"], "dtype": dtype}  # fmt: skip


def _source(path: Path) -> dict:
    return {"path": str(path.resolve()), "bytes": path.stat().st_size, "sha256": mf.file_sha256(path)}


def _published(out: Path, part: str, source: dict, settings: dict) -> dict | None:
    """The part's record when its files are complete for this source and these settings, else None."""
    path = mf.record_file(out, part)
    if not path.is_file():
        return None
    rec = json.loads(path.read_text())  # its schema was checked before anything was written (mf.foreign)
    if rec["source"] != source or rec["settings"] != settings or "skipped_records" not in rec:
        return None
    itemsize = np.dtype(settings["dtype"]).itemsize
    for split in mf.SPLITS:
        s = rec["splits"][split]
        f = mf.tokens_file(out, part, split)
        if not f.is_file() or f.stat().st_size != s["tokens"] * itemsize:
            return None
    return rec


def _tokenized(req: Request, src: Path, fmt: str, frame: documents.Specials, cache: Path):
    """The number of records read, and their tokens."""
    ds = read.texts(src, fmt, req.text_field, cache)
    fn = _Encode(str(req.tokenizer), frame, req.eval_fraction)
    nproc = max(1, min(req.num_proc, len(ds)))  # datasets shards the rows over the processes
    return len(ds), ds.map(fn, batched=True, batch_size=req.batch_size, with_indices=True, remove_columns=ds.column_names,
                           num_proc=nproc if nproc > 1 else None, desc=f"tokenizing {src.name}")  # fmt: skip


def _tmp(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def _write(ds, out: Path, part: str, dtype: str) -> dict:
    """Write both splits' token and index files under temporary names; return their counts."""
    import pyarrow.compute as pc

    handles = {s: (open(_tmp(mf.tokens_file(out, part, s)), "wb"), open(_tmp(mf.index_file(out, part, s)), "wb")) for s in mf.SPLITS}
    counts = {s: {"tokens": 0, "documents": 0} for s in mf.SPLITS}
    try:
        for table in ds.with_format("arrow").iter(batch_size=10_000):
            held = table.column("held_out")
            for split, mask in (("train", pc.invert(held)), ("eval", held)):
                ids = table.filter(mask).column("ids").combine_chunks()
                if len(ids) == 0:
                    continue
                tokens, bins = handles[split]
                lengths = np.diff(ids.offsets.to_numpy())
                ids.flatten().to_numpy().astype(dtype).tofile(tokens)
                (counts[split]["tokens"] + np.cumsum(lengths, dtype=np.uint64)).astype(np.uint64).tofile(bins)
                counts[split]["tokens"] += int(lengths.sum())
                counts[split]["documents"] += len(lengths)
    finally:
        for fh in (h for pair in handles.values() for h in pair):
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()
    return counts


def _part(req: Request, i: int, src: Path, tok: dict, frame: documents.Specials, dtype: str, say) -> tuple[dict, bool]:
    """Part i's record, and whether it was (re)written now."""
    part, fmt = mf.part_name(i), FORMATS[src.suffix.lower()]
    source, settings = _source(src), _settings(req, fmt, tok, frame, dtype)
    rec = _published(req.out, part, source, settings)
    if rec is not None:
        say(f"{part}: {src.name} already prepared ({rec['splits']['train']['tokens']:,} train tokens)")
        return rec, False
    cache = req.out / ".cache" / part
    shutil.rmtree(cache, ignore_errors=True)
    files = [f(req.out, part, split) for split in mf.SPLITS for f in (mf.tokens_file, mf.index_file)]
    try:
        records, ds = _tokenized(req, src, fmt, frame, cache)
        counts = _write(ds, req.out, part, dtype)
    except BaseException:  # an input error or Ctrl-C: nothing of this part is left
        for f in files:
            _tmp(f).unlink(missing_ok=True)
        raise
    for f in files:  # publish: the files first, the record that vouches for them last
        os.replace(_tmp(f), f)
    skipped = records - sum(c["documents"] for c in counts.values())
    rec = {"name": part, "source": source, "settings": settings, "splits": counts, "skipped_records": skipped}
    mf.write_json(mf.record_file(req.out, part), rec)
    shutil.rmtree(cache, ignore_errors=True)
    say(f"{part}: {src.name} -> {counts['train']['tokens']:,} train / {counts['eval']['tokens']:,} held-out tokens")
    return rec, True


def _remove_stale(out: Path, n: int) -> list[str]:
    """Remove the files of parts n and above (after the manifest that no longer names them); return their names.
    Records go first, so a record never vouches for a removed file."""
    stale = [f for f in out.iterdir() if (m := PART_FILE.match(f.name)) and int(m[1]) >= n]
    for f in sorted(stale, key=lambda f: f.suffix != ".json"):
        f.unlink()
    return sorted({f.name.split(".")[0] for f in stale})


def _manifest(req: Request, tok: dict, frame: documents.Specials, dtype: str, records: list[dict]) -> dict:
    splits = {
        s: {
            "tokens": sum(r["splits"][s]["tokens"] for r in records),
            "documents": sum(r["splits"][s]["documents"] for r in records),
            "parts": [{"name": r["name"], **r["splits"][s]} for r in records],
        }
        for s in mf.SPLITS
    }
    return {
        "version": mf.VERSION,
        "tokenizer": {"path": str(req.tokenizer.resolve()), **tok},
        **documents.describe(frame),
        "dtype": dtype,
        "eval_fraction": req.eval_fraction,
        "sources": [
            r["source"] | {"part": r["name"], "format": r["settings"]["format"], "skipped_records": r["skipped_records"]} for r in records
        ],
        "skipped_records": sum(r["skipped_records"] for r in records),
        "splits": splits,
    }


def prepare(req: Request, say=print) -> tuple[dict, bool]:
    """Prepare `req.out`; returns the manifest and whether anything was (re)written."""
    from tokenizers import Tokenizer

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: nothing is downloaded
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tok = mf.tokenizer_info(req.tokenizer)
    frame = documents.specials(Tokenizer.from_file(str(req.tokenizer)), req.tokenizer, req.eos_token)
    dtype = mf.dtype_for(tok["vocab_size"])
    created = not req.out.exists()
    req.out.mkdir(parents=True, exist_ok=True)
    try:
        parts = [_part(req, i, Path(src), tok, frame, dtype, say) for i, src in enumerate(req.inputs)]
    finally:
        shutil.rmtree(req.out / ".cache", ignore_errors=True)
        if created and not any(req.out.iterdir()):
            req.out.rmdir()  # failed before any part was published: the folder is as it was, absent
    m = _manifest(req, tok, frame, dtype, [rec for rec, _ in parts])
    path = req.out / mf.MANIFEST
    wrote = any(new for _, new in parts) or not path.is_file() or json.loads(path.read_text()) != m
    if wrote:
        mf.write_json(path, m)
    if stale := _remove_stale(req.out, len(req.inputs)):
        say(f"removed {', '.join(stale)}: parts of inputs no longer given")
    return m, wrote or bool(stale)
