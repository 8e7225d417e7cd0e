"""Documents as TorchTitan 0.3.0 trains them (torch-free): each document framed by the tokenizer's own BOS and EOS,
shifted into (input, label) pairs within itself, packed into samples of seq_len pairs with positions that restart
at every document and at every sample start.

The rules follow TorchTitan's files, named where each is applied:
- `hf_datasets/text_datasets.py` (HuggingFaceTextDataset.__iter__): a document of L tokens gives L - 1 pairs
  (tokens[:-1], tokens[1:]), so no label is the next document's first token and no label is masked; its positions are
  0..L-2; the pairs of all documents form one stream, cut into samples of exactly seq_len pairs; `_normalize_positions`
  restarts the first document piece of a sample at 0 (a long document "wraps" at seq_len).
- `components/tokenizer.py` (HuggingFaceTokenizer): BOS and EOS are the tokenizer_config.json's `bos_token` and
  `eos_token` (a string or an AddedToken object's content); the text dataset encodes with add_bos=True, add_eos=True,
  and a token the tokenizer's own post-processor already adds (found by encoding "") is not added again.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from runner.formats.user_files import UnreadableFile, read_json

if TYPE_CHECKING:
    from tokenizers import Tokenizer

CONFIG = "tokenizer_config.json"
"""The file beside a tokenizer.json that names its special tokens (Hugging Face's, read by TorchTitan's wrapper)."""
FIX = f"put the {CONFIG} of the tokenizer's Hugging Face folder beside it (its bos_token and eos_token name tokens of the tokenizer)"


@dataclass(frozen=True)
class Specials:
    """A tokenizer's document frame: the tokens, their ids, and whether its post-processor adds them itself."""

    bos_token: str | None
    bos_id: int | None
    eos_token: str | None
    eos_id: int | None
    adds_bos: bool = False
    adds_eos: bool = False
    source: str | None = None
    """The tokenizer_config.json that named the tokens; None for a bare tokenizer.json (EOS given by the caller)."""

    def frame(self, ids: list[int]) -> list[int]:
        """`ids` as TorchTitan's encode(add_bos=True, add_eos=True) returns them."""
        head = [self.bos_id] if self.bos_id is not None and not self.adds_bos else []
        tail = [self.eos_id] if self.eos_id is not None and not self.adds_eos else []
        return head + ids + tail


def _named(config: dict, key: str, path: Path) -> str | None:
    token = config.get(key)
    if isinstance(token, dict):
        token = token.get("content")
    if token is not None and not isinstance(token, str):
        raise UnreadableFile(path, f"has a {key} that is neither a string nor an object with a content string", "fix the file")
    return token


def _id(tok: Tokenizer, config: dict, token: str | None) -> int | None:
    """The token's id as TorchTitan resolves it: added_tokens_decoder first, else the vocabulary."""
    if token is None:
        return None
    for key, spec in (config.get("added_tokens_decoder") or {}).items():
        if isinstance(spec, dict) and spec.get("content") == token:
            return int(key)
    return tok.token_to_id(token)


def specials(tok: Tokenizer, tokenizer_path: str | Path, fallback_eos: str = "") -> Specials:
    """The BOS and EOS of the tokenizer at `tokenizer_path`: those of the tokenizer_config.json beside it (as TorchTitan
    reads them); a bare tokenizer.json has no BOS and `fallback_eos` (data.eos_token) as its EOS."""
    config_path = Path(tokenizer_path).parent / CONFIG
    empty = tok.encode("").ids
    if config_path.is_file():
        config = read_json(config_path, f"take the {CONFIG} of the tokenizer's Hugging Face folder")
        bos, eos = _named(config, "bos_token", config_path), _named(config, "eos_token", config_path)
        bos_id, eos_id = _id(tok, config, bos), _id(tok, config, eos)
        return Specials(bos, bos_id, eos, eos_id, bos_id in empty, eos_id in empty, str(config_path))
    eos_id = tok.token_to_id(fallback_eos) if fallback_eos else None
    return Specials(None, None, fallback_eos or None, eos_id, False, eos_id in empty, None)


def special_problem(s: Specials, tokenizer: str | Path) -> str | None:
    """Why documents framed by `s` could not be told apart in a token stream (None: they can)."""
    if s.eos_token is None:
        return f"{s.source or tokenizer} names no eos_token: documents would run together with no end"
    if s.eos_id is None and s.source is None:
        return f"not a token of {tokenizer}"
    if s.eos_id is None:
        return f"{s.source} names the eos_token {s.eos_token!r}, not a token of {tokenizer}"
    if s.bos_token is not None and s.bos_id is None:
        return f"{s.source} names the bos_token {s.bos_token!r}, not a token of {tokenizer}"
    return None


def describe(s: Specials) -> dict:
    """The frame as the manifest and the start-up line record it."""
    return {"bos_token": s.bos_token, "bos_id": s.bos_id, "eos_token": s.eos_token, "eos_id": s.eos_id}


class _PairEnds:
    """Sequence view of a document end table: entry k is the pair count of documents 0..k (ends[k] - (k + 1))."""

    def __init__(self, ends):
        self.ends = ends

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, k: int) -> int:
        return int(self.ends[k]) - (k + 1)


@dataclass
class Piece:
    """A run of documents stored whole and in order (a prepared part's split, or data=text's stream): `read(start, n)`
    gives tokens [start, start + n) as int64, `ends` each document's end offset (cumulative, in tokens)."""

    read: object
    ends: object

    @property
    def pairs(self) -> int:
        return int(self.ends[-1]) - len(self.ends) if len(self.ends) else 0

    def take(self, first: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(inputs, labels, positions) of pairs [first, first + n) of this piece: the pairs of document k are its
        tokens t..t+L-2 against t+1..t+L-1, so the pair across two documents (an EOS against the next BOS) is left out."""
        view = _PairEnds(self.ends)
        k0 = bisect.bisect_right(view, first)
        k1 = bisect.bisect_right(view, first + n - 1)
        t0, t1 = first + k0, first + n - 1 + k1  # token index of the first and the last pair's input
        tokens = self.read(t0, t1 + 2 - t0)
        starts = np.asarray([0 if k0 == 0 else int(self.ends[k0 - 1]), *(int(e) for e in self.ends[k0:k1])], dtype=np.int64)
        index = np.arange(t0, t1 + 1, dtype=np.int64)
        keep = ~np.isin(index + 1, starts[1:])  # the last token of a document has no label within it
        index = index[keep]
        positions = index - starts[np.searchsorted(starts, index, side="right") - 1]
        inputs, labels = tokens[:-1][keep], tokens[1:][keep]
        return inputs, labels, positions


class PairStream:
    """Pieces one after the other as one stream of (input, label, position) pairs, cut into samples of seq_len."""

    def __init__(self, pieces: list[Piece]):
        self.pieces = pieces
        self.bounds = np.cumsum([p.pairs for p in pieces], dtype=np.int64)

    @property
    def num_pairs(self) -> int:
        return int(self.bounds[-1]) if len(self.bounds) else 0

    def window(self, first: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Pairs [first, first + n), positions restarted at the window's start as TorchTitan's _normalize_positions does."""
        parts, i = [], int(np.searchsorted(self.bounds, first, side="right"))
        while n > 0:
            begin = first - (int(self.bounds[i - 1]) if i else 0)
            count = min(n, self.pieces[i].pairs - begin)
            parts.append(self.pieces[i].take(begin, count))
            first, n, i = first + count, n - count, i + 1
        inputs, labels, positions = (np.concatenate(x) for x in zip(*parts, strict=True))
        return inputs, labels, normalize(positions)


def normalize(positions: np.ndarray) -> np.ndarray:
    """TorchTitan's _normalize_positions: the piece of a document a sample starts inside restarts at 0."""
    zeros = np.flatnonzero(positions == 0)
    head = int(zeros[0]) if len(zeros) else len(positions)
    out = positions.copy()
    out[:head] -= positions[0]
    return out
