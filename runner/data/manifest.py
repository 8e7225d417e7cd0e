"""A prepared folder on disk: its file names, the manifest, and the checks a reader relies on (torch-free).

<folder>/
  manifest.json               tokenizer (sha256 of its normalized JSON, vocabulary), dtype, EOS, the
                              held-out fraction, sources (path, bytes, sha256), per split: tokens,
                              documents and parts; written last, atomically
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
