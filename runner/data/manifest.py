"""A prepared folder on disk: its file names, the manifest, and the checks a reader relies on (torch-free).

<folder>/
  manifest.json               tokenizer (sha256 of its normalized JSON, vocabulary), dtype, EOS, the
                              held-out fraction, sources (path, bytes, sha256, skipped_records), per
                              split: tokens, documents and parts, skipped_records (records whose text
                              was null, missing or empty: skipped); written last, atomically
  part-<i>.json               part i's record (its source, settings and counts): its files are complete
  part-<i>.<split>.bin        the split's documents of source i, each followed by EOS (uint16 or uint32)
  part-<i>.<split>.idx        uint64 end offset (in tokens) of each document in the .bin file
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "eval")
DTYPES = ("uint16", "uint32")
_COUNTS = {"tokens": int, "documents": int}
SCHEMA = {  # what readers of a manifest rely on: load() refuses a manifest without it, naming the key
    "version": int,
    "tokenizer": {"sha256": str, "vocab_size": int},
    "dtype": str,
    "splits": {s: {**_COUNTS, "parts": [{"name": str, **_COUNTS}]} for s in SPLITS},
}
RECORD = {"name": str, "source": dict, "settings": {"dtype": str}, "splits": {s: _COUNTS for s in SPLITS}}


class ManifestError(ValueError):
    """A prepared folder that cannot be read as it is: the message says why."""


def part_name(i: int) -> str:
    return f"part-{i:05d}"


def tokens_file(folder: Path, part: str, split: str) -> Path:
    return folder / f"{part}.{split}.bin"


def index_file(folder: Path, part: str, split: str) -> Path:
    return folder / f"{part}.{split}.idx"


def record_file(folder: Path, part: str) -> Path:
    return folder / f"{part}.json"


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def tokenizer_info(path: Path) -> dict:
    """sha256 of the tokenizer's normalized JSON (key order and spacing do not count) and its vocabulary size
    (largest id + 1, added tokens included)."""
    from tokenizers import Tokenizer

    body = json.loads(Path(path).read_text())
    sha = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    vocab = max(Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True).values()) + 1
    return {"sha256": sha, "vocab_size": vocab}


def schema_problem(body: object, spec: object, at: str = "") -> str | None:
    """Why `body` does not have the shape of `spec` (nested dicts of types, a list of one spec for a list), naming
    the first key that is missing or of another type; None when it has it."""
    if isinstance(spec, dict):
        if not isinstance(body, dict):
            return f"{at or 'its content'} is {type(body).__name__}, not an object"
        for key, sub in spec.items():
            path = f"{at}.{key}" if at else key
            if key not in body:
                return f"lacks the key '{path}'"
            if why := schema_problem(body[key], sub, path):
                return why
        return None
    if isinstance(spec, list):
        if not isinstance(body, list):
            return f"'{at}' is {type(body).__name__}, not a list"
        return next((why for i, b in enumerate(body) if (why := schema_problem(b, spec[0], f"{at}[{i}]"))), None)
    return None if isinstance(body, spec) else f"'{at}' is {json.dumps(body)[:40]}, not {spec.__name__}"


def foreign(folder: Path) -> list[tuple[Path, str]]:
    """Files of `folder` with a name of this layout but not its content (a prepare would read or replace them)."""
    out = []
    for path in sorted(folder.glob("part-*.json")) + [folder / MANIFEST]:
        if not path.is_file():
            continue
        try:
            body = json.loads(path.read_text())
        except ValueError as e:  # UnicodeDecodeError included
            out.append((path, f"not JSON ({e})"))
            continue
        spec = {"version": int} if path.name == MANIFEST else RECORD
        if why := schema_problem(body, spec):
            out.append((path, f"{why}: not written by `python -m runner.data prepare`"))
    return out


def write_json(path: Path, body: dict) -> None:
    """Write then rename: a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def load(folder: str | Path) -> dict:
    """The manifest of a prepared folder, checked against the files it names (sizes only: O(parts), not O(tokens))."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise ManifestError(f"{path} does not exist (not a folder written by `python -m runner.data prepare`, or an unfinished one)")
    try:
        m = json.loads(path.read_text())
    except ValueError as e:
        raise ManifestError(f"{path} is not JSON ({e})") from e
    if not isinstance(m, dict) or m.get("version") != VERSION:
        raise ManifestError(f"{path} has version {m.get('version') if isinstance(m, dict) else None}, this runner reads {VERSION}")
    if why := schema_problem(m, SCHEMA):
        raise ManifestError(f"{path} {why} (edited, or not written by `python -m runner.data prepare`)")
    if m["dtype"] not in DTYPES:
        raise ManifestError(f"{path} has dtype {m['dtype']!r}, not one of {', '.join(DTYPES)}")
    itemsize = np.dtype(m["dtype"]).itemsize
    for split in SPLITS:
        for p in m["splits"][split]["parts"]:
            for f, want in (
                (tokens_file(folder, p["name"], split), p["tokens"] * itemsize),
                (index_file(folder, p["name"], split), p["documents"] * 8),
            ):
                got = f.stat().st_size if f.is_file() else None
                if got != want:
                    raise ManifestError(f"{f} {'is missing' if got is None else f'has {got} bytes'}, the manifest says {want} bytes")
    return m


def sources(path: str, mix: list) -> list[tuple[str, str, float]]:
    """(field, folder, weight) of every prepared folder a run reads: `data.path` alone, or each `data.mix` entry (a path and
    a weight)."""
    if path:
        return [("data.path", path, 1.0)]
    return [(f"data.mix[{i}].path", m.path, m.weight) for i, m in enumerate(mix)]
