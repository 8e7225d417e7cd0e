"""A prepared folder on disk: its file names, the manifest, and the checks a reader relies on (torch-free).

<folder>/
  manifest.json               format version, tokenizer (sha256 of its normalized JSON, vocabulary), dtype, BOS and EOS, the
                              held-out fraction, sources (path, bytes, sha256, skipped_records), per
                              split: tokens, documents and parts, skipped_records (records whose text
                              was null, missing or empty: skipped); written last, atomically
  part-<i>.json               part i's record (its source, settings and counts): its files are complete
  part-<i>.<split>.bin        the split's documents of source i, each framed by the tokenizer's BOS and EOS (uint16 or uint32)
  part-<i>.<split>.idx        uint64 end offset (in tokens) of each document in the .bin file: where the next one starts

Format 2 (this one) frames documents as TorchTitan's tokenizer wrapper does (runner.formats.documents); format 1 appended
EOS alone, and a reader refuses it with the command that rewrites it (a rerun of prepare rewrites every part).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from runner.formats.user_files import UnreadableFile, read_json, schema_problem

if TYPE_CHECKING:
    import numpy as np
    from tokenizers import Tokenizer

VERSION = 2
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


TOKENIZER_FIX = "save one with tokenizers' Tokenizer.save (or take the tokenizer.json of the model's Hugging Face folder)"


def tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizers JSON file at `path` as a `tokenizers.Tokenizer` holding at least one token; UnreadableFile when
    it is not one. Validation, prepare's argument checks and the export check a tokenizer here, before anything reads
    it otherwise (the ranks' loader, prepare's workers, the export's copy)."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception; an empty, cut, non-text or non-object file is worded first
        read_json(path, TOKENIZER_FIX)
        raise UnreadableFile(path, f"is not a tokenizers JSON file ({e})", TOKENIZER_FIX) from e
    if not tok.get_vocab(with_added_tokens=True):
        raise UnreadableFile(path, "holds no tokens", TOKENIZER_FIX)
    return tok


def vocab_size(tok: Tokenizer) -> int:
    """Token ids the model must embed: the largest id of the tokenizer (added tokens included) + 1."""
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1


def tokenizer_info(path: Path) -> dict:
    """sha256 of the tokenizer's normalized JSON (key order and spacing do not count) and its vocabulary size
    (largest id + 1, added tokens included); UnreadableFile when it is not a tokenizer."""
    vocab = vocab_size(tokenizer(path))
    body = read_json(path, TOKENIZER_FIX)
    sha = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return {"sha256": sha, "vocab_size": vocab}


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
        m = read_json(path, "prepare the folder again")
    except UnreadableFile as e:
        raise ManifestError(f"{e.path} {e.why}") from e
    if m.get("version") != VERSION:
        older = isinstance(m.get("version"), int) and m["version"] < VERSION
        fix = f"; prepare it again (every part is rewritten, its documents framed by the tokenizer's BOS and EOS): {_again(m, folder)}"
        raise ManifestError(f"{path} has format version {json.dumps(m.get('version'))}, this runner reads {VERSION}{fix if older else ''}")
    if why := schema_problem(m, SCHEMA):
        raise ManifestError(f"{path} {why} (edited, or not written by `python -m runner.data prepare`)")
    if m["dtype"] not in DTYPES:
        raise ManifestError(f"{path} has dtype {m['dtype']!r}, not one of {', '.join(DTYPES)}")
    import numpy as np  # here: mode=search and validation import this module, and need no numpy otherwise

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


def _again(m: dict, folder: Path) -> str:
    """The prepare command that rewrites an older folder, from what its manifest recorded."""
    inputs = " ".join(str(s.get("path", "<file>")) for s in m.get("sources", [])) or "<files>"
    tok = (m.get("tokenizer") or {}).get("path", "<tokenizer.json>")
    return f"python -m runner.data prepare --input {inputs} --tokenizer {tok} --out {folder}"


def sources(path: str, mix: list) -> list[tuple[str, str, float]]:
    """(field, folder, weight) of every prepared folder a run reads: `data.path` alone, or each `data.mix` entry (a path and
    a weight)."""
    if path:
        return [("data.path", path, 1.0)]
    return [(f"data.mix[{i}].path", m.path, m.weight) for i, m in enumerate(mix)]


class Split:
    """One split of a prepared folder as a single token stream, read by memory map: the parts' token files are
    opened when first read, so start-up costs O(parts) whatever their size."""

    def __init__(self, folder: str, split: str):
        import numpy as np  # lazily: mode=search and validation import this module

        self.folder, self.split, self.m = Path(folder), split, load(folder)
        parts = self.m["splits"][split]["parts"]
        self.names = [p["name"] for p in parts]
        self._docs = [p["documents"] for p in parts]
        self.ends = np.cumsum([p["tokens"] for p in parts], dtype=np.int64)
        self.num_tokens = int(self.ends[-1]) if len(parts) else 0
        self._maps: dict[int, np.ndarray] = {}

    def _map(self, i: int) -> np.ndarray:
        import numpy as np  # lazily: mode=search and validation import this module

        if i not in self._maps:
            self._maps[i] = np.memmap(tokens_file(self.folder, self.names[i], self.split), dtype=self.m["dtype"], mode="r")
        return self._maps[i]

    def pieces(self) -> list:
        """Each part as a runner.formats.documents.Piece: its tokens and its documents' end offsets (the .idx file)."""
        import numpy as np  # lazily: mode=search and validation import this module

        from runner.formats.documents import Piece

        def piece(i: int) -> Piece:
            ends = np.memmap(index_file(self.folder, self.names[i], self.split), dtype=np.uint64, mode="r") if self._docs[i] else []
            return Piece(lambda start, n: self._map(i)[start : start + n].astype(np.int64), ends)

        return [piece(i) for i in range(len(self.names))]

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start + n) of the split, across part boundaries, as int64."""
        import numpy as np  # lazily: mode=search and validation import this module

        out, i = [], int(np.searchsorted(self.ends, start, side="right"))
        while n > 0:
            begin = start - (int(self.ends[i - 1]) if i else 0)
            chunk = self._map(i)[begin : begin + n]
            out.append(chunk)
            start, n, i = start + len(chunk), n - len(chunk), i + 1
        return np.concatenate(out).astype(np.int64)
