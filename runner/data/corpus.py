"""data=text's token stream (torch-free): the documents of local files, tokenized, and where each document came from.

The training loader (runner.run.loader.TextData) cuts this stream into samples; `python -m runner.data show` builds it
again from a run's frozen.yaml to decode the samples a spike was blamed on. Both read it here, so they read the same
tokens. With data.document_mask each document is framed by the tokenizer's BOS and EOS (runner.formats.documents) and a
sample is a window of (input, label) pairs; without it each document is followed by data.eos_token and a sample is
seq_len + 1 tokens of the stream.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


def held_out(document: str, fraction: float) -> bool:
    """Whether a document belongs to the held-out split of data.eval_fraction: by a hash of its text, so the split
    does not move when files are added or reordered, or with training.seed, and repeated documents stay together."""
    h = int.from_bytes(hashlib.sha1(document.encode("utf-8")).digest()[:8], "big")
    return h < fraction * 2**64


def documents(
    files: list[str], fmt: str, text_field: str, cache_dir: Path, split: str, eval_fraction: float
) -> tuple[list[str], list[tuple[int, int]]]:
    """The non-empty documents of `files` in `split` (all of them when eval_fraction is 0; else those `held_out` picks
    for "eval" and the others for "train"), in file order, and each one's (file index, record index in its file)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: nothing is downloaded
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    from datasets import load_dataset

    column = "text" if fmt == "text" else text_field
    docs, where = [], []
    for f, path in enumerate(files):
        ds = load_dataset(fmt, data_files=[str(Path(path).resolve())], split="train", cache_dir=str(cache_dir))
        for r, d in enumerate(ds[column]):
            if d and (eval_fraction == 0 or held_out(d, eval_fraction) == (split == "eval")):
                docs.append(d)
                where.append((f, r))
    return docs, where


@dataclass
class Corpus:
    """The stream and its documents: `ends[k]` is document k's end offset in `tokens`, `where[k]` its (file, record)."""

    tokens: np.ndarray
    ends: np.ndarray
    where: list[tuple[int, int]]
    files: list[str]
    framed: bool
    """data.document_mask: documents framed by BOS and EOS, samples are windows of pairs."""

    def __post_init__(self):
        # where each document ends in the samples' own offsets: pairs (L - 1 per document) when framed, else tokens
        self.starts_at = self.ends - np.arange(1, len(self.ends) + 1) if self.framed else self.ends

    def origin(self, start: int) -> dict[str, Any]:
        """Where a sample starting at `start` (a pair offset when framed, else a token offset) begins: its file, the
        record of that file (0-based, empty records counted) and the offset (in pairs or tokens) into its document."""
        k = int(np.searchsorted(self.starts_at, start, side="right"))
        f, record = self.where[k]
        return {"file": self.files[f], "record": record, "offset": start - (int(self.starts_at[k - 1]) if k else 0)}


def build(
    files: list[str], fmt: str, text_field: str, tokenizer: str, eos_token: str, cache_dir: Path, split: str = "train",
    eval_fraction: float = 0.0, framed: bool = True,
) -> Corpus:  # fmt: skip
    """The documents of `files` in `split`, tokenized with the tokenizers JSON file `tokenizer`: framed by its BOS and EOS
    as TorchTitan's tokenizer wrapper frames them (`framed`), else each followed by `eos_token` (when in its vocabulary)."""
    from tokenizers import Tokenizer

    from runner.formats import documents as frames

    tok = Tokenizer.from_file(tokenizer)
    docs, where = documents(files, fmt, text_field, cache_dir, split, eval_fraction)
    if framed:
        frame = frames.specials(tok, tokenizer, eos_token).frame
    else:
        eos = tok.token_to_id(eos_token)
        frame = lambda ids: ids + ([eos] if eos is not None else [])  # noqa: E731
    ids = [frame(enc.ids) for enc in tok.encode_batch(docs)]
    ends = np.cumsum([len(d) for d in ids], dtype=np.int64)
    tokens = np.fromiter((t for d in ids for t in d), dtype=np.int64, count=int(ends[-1]) if len(ends) else 0)
    return Corpus(tokens, ends, where, list(files), framed)
