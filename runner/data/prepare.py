"""Tokenize local corpora into a prepared folder (layout in manifest.py), one part per input file.

Each input file is read by Hugging Face `datasets` (json/text/parquet builders, local paths only),
tokenized by `datasets.map(batched=True, num_proc=...)` with a local `tokenizers` JSON file, and written as
a train and a held-out (eval) token file with their document indexes. Document j of a file is held out when
floor((j + 1) f) > floor(j f), f the eval fraction: an exact share, evenly spread, the same on every run.
A part is published by renaming its files into place and then writing its record; the manifest comes
last. A rerun skips every part whose record matches its source (size and sha256) and settings, so it is
idempotent and resumes an interrupted preparation where it stopped.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runner.data import manifest as mf

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
    """The batched map function (picklable for num_proc workers): token ids + EOS of each non-empty
    document, and whether it is held out."""

    def __init__(self, tokenizer: str, column: str, eos_id: int | None, eval_fraction: float):
        self.tokenizer, self.column, self.eos_id, self.f = tokenizer, column, eos_id, eval_fraction
        self._tok = None

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        if self._tok is None:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(self.tokenizer)
        keep = [(j, d) for j, d in zip(indices, batch[self.column], strict=True) if d]
        tail = [] if self.eos_id is None else [self.eos_id]
        ids = [e.ids + tail for e in self._tok.encode_batch([d for _, d in keep])]
        held = [int((j + 1) * self.f) > int(j * self.f) for j, _ in keep]
        return {"ids": ids, "held_out": held}


def _settings(req: Request, fmt: str, tok: dict, dtype: str) -> dict:
    return {"format": fmt, "text_field": req.text_field, "eos_token": req.eos_token, "eval_fraction": req.eval_fraction,
            "tokenizer_sha256": tok["sha256"], "dtype": dtype}  # fmt: skip


def _source(path: Path) -> dict:
    return {"path": str(path.resolve()), "bytes": path.stat().st_size, "sha256": mf.file_sha256(path)}


def _published(out: Path, part: str, source: dict, settings: dict) -> dict | None:
    """The part's record when its files are complete for this source and these settings, else None."""
    path = mf.record_file(out, part)
    if not path.is_file():
        return None
    rec = json.loads(path.read_text())
    if rec.get("source") != source or rec.get("settings") != settings:
        return None
    itemsize = np.dtype(settings["dtype"]).itemsize
    for split in mf.SPLITS:
        s = rec["splits"][split]
        if mf.tokens_file(out, part, split).stat().st_size != s["tokens"] * itemsize:
            return None
    return rec


def _tokenized(req: Request, src: Path, fmt: str, eos_id: int | None, cache: Path):
    from datasets import load_dataset

    ds = load_dataset(fmt, data_files=[str(src.resolve())], split="train", cache_dir=str(cache))
    column = "text" if fmt == "text" else req.text_field
    if column not in ds.column_names:
        raise ValueError(f"{src} has the columns {ds.column_names}, no {column!r}")
    fn = _Encode(str(req.tokenizer), column, eos_id, req.eval_fraction)
    nproc = max(1, min(req.num_proc, len(ds)))  # datasets shards the rows over the processes
    return ds.map(fn, batched=True, batch_size=req.batch_size, with_indices=True, remove_columns=ds.column_names,
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


def _part(req: Request, i: int, src: Path, tok: dict, eos_id: int | None, dtype: str, say) -> tuple[dict, bool]:
    """Part i's record, and whether it was (re)written now."""
    part, fmt = mf.part_name(i), FORMATS[src.suffix.lower()]
    source, settings = _source(src), _settings(req, fmt, tok, dtype)
    rec = _published(req.out, part, source, settings)
    if rec is not None:
        say(f"{part}: {src.name} already prepared ({rec['splits']['train']['tokens']:,} train tokens)")
        return rec, False
    cache = req.out / ".cache" / part
    shutil.rmtree(cache, ignore_errors=True)
    counts = _write(_tokenized(req, src, fmt, eos_id, cache), req.out, part, dtype)
    for split in mf.SPLITS:  # publish: the files first, the record that vouches for them last
        for f in (mf.tokens_file(req.out, part, split), mf.index_file(req.out, part, split)):
            os.replace(_tmp(f), f)
    rec = {"name": part, "source": source, "settings": settings, "splits": counts}
    mf.write_json(mf.record_file(req.out, part), rec)
    shutil.rmtree(cache, ignore_errors=True)
    say(f"{part}: {src.name} -> {counts['train']['tokens']:,} train / {counts['eval']['tokens']:,} held-out tokens")
    return rec, True


def _manifest(req: Request, tok: dict, eos_id: int | None, dtype: str, records: list[dict]) -> dict:
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
        "eos_token": req.eos_token,
        "eos_id": eos_id,
        "dtype": dtype,
        "eval_fraction": req.eval_fraction,
        "sources": [r["source"] | {"part": r["name"], "format": r["settings"]["format"]} for r in records],
        "splits": splits,
    }


def prepare(req: Request, say=print) -> tuple[dict, bool]:
    """Prepare `req.out`; returns the manifest and whether anything was (re)written."""
    from tokenizers import Tokenizer

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: nothing is downloaded
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tok = mf.tokenizer_info(req.tokenizer)
    eos_id = Tokenizer.from_file(str(req.tokenizer)).token_to_id(req.eos_token)
    dtype = mf.dtype_for(tok["vocab_size"])
    req.out.mkdir(parents=True, exist_ok=True)
    parts = [_part(req, i, Path(src), tok, eos_id, dtype, say) for i, src in enumerate(req.inputs)]
    m = _manifest(req, tok, eos_id, dtype, [rec for rec, _ in parts])
    path = req.out / mf.MANIFEST
    fresh = any(new for _, new in parts)
    shutil.rmtree(req.out / ".cache", ignore_errors=True)
    if not fresh and path.is_file() and json.loads(path.read_text()) == m:
        return m, False
    mf.write_json(path, m)
    return m, True
