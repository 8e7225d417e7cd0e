"""Training inputs from folders prepared by `python -m runner.data prepare`: one or a weighted mixture, by memory map.

The same global-sample addressing, DP slice and loader position as every source (runner.run.loader.Stream); what is
its own is the folder's split read as one token stream across its parts (`_Split`) and the mixture's and epochs'
on-the-fly permutation (`TokenData`), so nothing grows with the corpus.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from runner.formats.data_manifest import Split as _Split  # python -m runner.data show reads a split too (torch-free)
from runner.run.loader import Stream

SOURCE_SHIFT = 48  # token_start of a mixture: source index above the bits of a token offset (2^48 tokens per source)


class TokenData(Stream):
    """Prepared token folders (`python -m runner.data prepare`), one or a weighted mixture, by memory map.

    Global sample g goes to source s with within-source index k = Mixture(weights)(g) (k = g for one source);
    source s cuts its split into N_s samples of seq_len + 1 tokens (stride seq_len, like TextData) and reads
    piece P_{s,e}(k mod N_s) of epoch e = k // N_s, P a seeded Feistel permutation: all pure functions of g,
    so a position is the next sample index alone and nothing grows with the corpus."""

    def __init__(
        self, sources: list[tuple[str, float]], *, split: str = "train", seed: int, shuffle: bool, seq_len: int, global_batch: int,
        microbatch: int, dp_rank: int, dp: int, documents: bool = False,
    ):  # fmt: skip
        """`documents`: samples are windows of each source's document pairs (data.document_mask), else of its tokens."""
        super().__init__(seq_len=seq_len, global_batch=global_batch, microbatch=microbatch, dp_rank=dp_rank, dp=dp)
        from runner.formats.data_order import Mixture
        from runner.formats.documents import PairStream

        self.seed, self.shuffle, self.split, self.documents = seed, shuffle, split, documents
        self.splits = [_Split(folder, split) for folder, _ in sources]
        self.streams = [PairStream(s.pieces()) for s in self.splits] if documents else []
        if documents:
            self.num_samples = [p.num_pairs // seq_len for p in self.streams]
            held = [f"{p.num_pairs} (input, label) pairs, fewer than one sample of seq_len = {seq_len}" for p in self.streams]
        else:
            self.num_samples = [(s.num_tokens - 1) // seq_len for s in self.splits]
            held = [f"{s.num_tokens} tokens, fewer than one sample of seq_len + 1 = {seq_len + 1}" for s in self.splits]
        for (folder, _), n, what in zip(sources, self.num_samples, held, strict=True):
            if n < 1:
                raise ValueError(f"the {split} split of {folder} holds {what}")
        self.mixture = Mixture([w for _, w in sources])
        self._perms: dict[tuple[int, int], object] = {}

    def _piece(self, index: int) -> tuple[int, int]:
        source, k = self.mixture(index)
        epoch, j = divmod(k, self.num_samples[source])
        if not self.shuffle:
            return source, j
        if (source, epoch) not in self._perms:
            from runner.formats.data_order import Permutation

            if len(self._perms) > 8:  # one or two epochs per source are live at a time
                self._perms.clear()
            self._perms[(source, epoch)] = Permutation(self.num_samples[source], (self.seed * 1_000_003 + epoch) * 1_000_003 + source)
        return source, self._perms[(source, epoch)](j)

    def token_start(self, index: int) -> int:
        source, piece = self._piece(index)
        return (source << SOURCE_SHIFT) | piece * self.seq_len

    def sample(self, index: int) -> torch.Tensor:
        source, piece = self._piece(index)
        return torch.from_numpy(self.splits[source].read(piece * self.seq_len, self.seq_len + 1))

    def window(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        source, piece = self._piece(index)
        return self.streams[source].window(piece * self.seq_len, self.seq_len)

    def origin(self, index: int) -> dict[str, Any]:
        """The prepared folder and split the sample is read from, and its range in that split's stream: seq_len (input,
        label) pairs of its documents (data.document_mask), else seq_len + 1 tokens."""
        source, piece = self._piece(index)
        split = self.splits[source]
        where = {"source": str(split.folder), "split": split.split}
        if self.documents:
            return where | {"pair_start": piece * self.seq_len, "num_pairs": self.seq_len}
        return where | {"token_start": piece * self.seq_len, "num_tokens": self.seq_len + 1}
