"""Training inputs: a synthetic token stream or local text files, both addressed by global sample index.

Step s (0-based) reads global samples [n + (s - s0) * B, n + (s - s0 + 1) * B), B the global batch, where
(n, s0) is the loader position (next sample, at step s0) restored from a checkpoint, (0, 0) on a fresh
start. DP replica r reads its contiguous slice [r * B / dp, (r + 1) * B / dp) of those, so replicas
are disjoint and their union is the same global batch for every layout; every rank of a TP/CP/PP
group has the same DP rank and so the same inputs (`check_inputs` checks both at start-up).

synthetic: sample g is an arithmetic progression modulo the vocabulary with a random start and
stride, 1 token in 10 replaced by noise.
text: the documents of local files (Hugging Face datasets, from local paths only) tokenized with a
local `tokenizers` JSON file. With data.document_mask (the default) each document is framed by the tokenizer's BOS and
EOS and shifted into (input, label) pairs within itself, the pairs of all documents are one stream cut into samples of
seq_len pairs, and each sample carries its positions (restarting per document): TorchTitan's text dataset
(runner.formats.documents). Without it (today's packing before documents) each document is followed by data.eos_token,
the tokens are one stream cut into samples of seq_len + 1 tokens (inputs and labels overlap by one token), and
attention and positions run across documents. Either way sample g is piece perm_e[g mod N] of epoch e = g // N,
perm_e a seeded permutation.
tokens: folders prepared by `python -m runner.data prepare`, read by memory map, one or a weighted mixture
(runner.run.token_data.TokenData); the same cut into samples, with an on-the-fly permutation instead of a materialized one.

`Prefetch` reads the next step's batch in a background thread while the current step trains.

The held-out split (split="eval", read by runner.run.evaluate) is addressed the same way, from sample 0 at every
evaluation pass, with no loader position: synthetic eval sample j is synthetic sample -(j + 1), a negative index
training (which counts from 0 up) never reads; text reads data.eval_files, or the documents of data.files that
`runner.data.corpus.held_out` picks (which the training split then leaves out), packed in file order without shuffling.
"""

from __future__ import annotations

import hashlib
import time
import zlib
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from runner.data import corpus

MAX_STRIDE = 16
NOISE = 0.1


class Microbatch(NamedTuple):
    """One microbatch on its way to the model: token ids and their labels (microbatch, seq_len), and the positions of
    packed documents (restarting at each document; None: one document per sample, positions 0..seq_len-1 and a plain
    causal mask, as synthetic data and data.document_mask=false have)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None


def sample(seed: int, index: int, seq_len: int, vocab: int) -> torch.Tensor:
    """Tokens (seq_len + 1) of synthetic global sample `index`."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    start = torch.randint(0, vocab, (1,), generator=g)
    stride = torch.randint(1, MAX_STRIDE + 1, (1,), generator=g)
    tokens = (start + stride * torch.arange(seq_len + 1)) % vocab
    noise = torch.rand(seq_len + 1, generator=g) < NOISE
    return torch.where(noise, torch.randint(0, vocab, (seq_len + 1,), generator=g), tokens)


class Stream(ABC):
    """Global-sample addressing, the DP slice and the loader position shared by every source (runner.run.token_data's too)."""

    def __init__(self, *, seq_len: int, global_batch: int, microbatch: int, dp_rank: int, dp: int):
        self.seq_len, self.global_batch, self.microbatch = seq_len, global_batch, microbatch
        self.local = global_batch // dp
        self.first = dp_rank * self.local
        self.next_sample, self.at_step = 0, 0
        self.documents = False
        """Samples are windows of document pairs with their positions (data.document_mask; `window`)."""

    def indices(self, step: int) -> list[int]:
        """Global sample indices this rank reads at `step` (0-based)."""
        base = self.next_sample + (step - self.at_step) * self.global_batch + self.first
        return list(range(base, base + self.local))

    def state_dict(self, steps_done: int) -> dict[str, int]:
        """Loader position after `steps_done` steps: the next global sample (layout-independent)."""
        return {"next_sample": self.next_sample + (steps_done - self.at_step) * self.global_batch}

    def load_state_dict(self, state: dict[str, int], steps_done: int) -> None:
        self.next_sample, self.at_step = int(state["next_sample"]), steps_done

    @abstractmethod
    def sample(self, index: int) -> torch.Tensor:
        """Tokens (seq_len + 1) of global sample `index`."""

    def window(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(inputs, labels, positions) of global sample `index` (seq_len each) when `documents`."""
        raise NotImplementedError(f"{type(self).__name__} has no document windows")

    @abstractmethod
    def token_start(self, index: int) -> int:
        """Where sample `index` starts in the source's token stream (its position in the data)."""

    def microbatches(self, step: int) -> list[Microbatch]:
        """The microbatches of this rank's share of `step` (0-based)."""
        if self.documents:
            rows = [self.window(i) for i in self.indices(step)]
            inputs, labels, positions = (torch.from_numpy(np.stack(x)) for x in zip(*rows, strict=True))
            m = self.microbatch
            return [Microbatch(*mb) for mb in zip(inputs.split(m), labels.split(m), positions.split(m), strict=True)]
        rows = torch.stack([self.sample(i) for i in self.indices(step)])
        return [Microbatch(mb[:, :-1].contiguous(), mb[:, 1:].contiguous()) for mb in rows.split(self.microbatch)]

    def step_samples(self, step: int) -> list[dict[str, Any]]:
        """Every global sample of `step` (0-based, all ranks' shares) and where it comes from (origin)."""
        base = self.next_sample + (step - self.at_step) * self.global_batch
        return [{"index": i, **self.origin(i)} for i in range(base, base + self.global_batch)]

    def origin(self, index: int) -> dict[str, Any]:
        """Where sample `index` starts in the source's token stream."""
        return {"token_start": self.token_start(index), "num_tokens": self.seq_len + 1}

    def positions(self, step: int) -> torch.Tensor:
        """(global sample index, token start) of every sample this rank reads at `step`."""
        return torch.tensor([[i, self.token_start(i)] for i in self.indices(step)], dtype=torch.int64)


SPLITS = ("train", "eval")


class SyntheticData(Stream):
    def __init__(
        self, *, seed: int, seq_len: int, vocab: int, global_batch: int, microbatch: int, dp_rank: int, dp: int, split: str = "train"
    ):
        super().__init__(seq_len=seq_len, global_batch=global_batch, microbatch=microbatch, dp_rank=dp_rank, dp=dp)
        if split not in SPLITS:
            raise ValueError(f"split {split!r} is not one of {SPLITS}")
        self.seed, self.vocab, self.split = seed, vocab, split

    def _source_index(self, index: int) -> int:
        """The synthetic sample behind sample `index` of this split: eval sample j is -(j + 1), disjoint from training's."""
        return index if self.split == "train" else -(index + 1)

    def sample(self, index: int) -> torch.Tensor:
        return sample(self.seed, self._source_index(index), self.seq_len, self.vocab)

    def token_start(self, index: int) -> int:
        return self._source_index(index) * (self.seq_len + 1)


def load_tokens(
    files: list[str], fmt: str, text_field: str, tokenizer: str, eos_token: str, cache_dir: Path, split: str = "train",
    eval_fraction: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """data.document_mask=false: the documents of `files` in `split` (runner.data.corpus), tokenized and concatenated (EOS
    after each) into one int64 stream."""
    c = corpus.build(files, fmt, text_field, tokenizer, eos_token, cache_dir, split, eval_fraction, framed=False)
    return torch.from_numpy(c.tokens)


def load_documents(
    files: list[str], fmt: str, text_field: str, tokenizer: str, eos_token: str, cache_dir: Path, split: str = "train",
    eval_fraction: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """data.document_mask: the documents of `files` in `split`, each framed by the tokenizer's BOS and EOS (as TorchTitan's
    tokenizer wrapper frames them: runner.formats.documents.specials), as one int64 stream and each document's end offset.
    NumPy, as the document reader reads it (a torch tensor made under the CUDA rehearsal's FakeTensorMode holds no data)."""
    c = corpus.build(files, fmt, text_field, tokenizer, eos_token, cache_dir, split, eval_fraction, framed=True)
    return c.tokens, c.ends


class TextData(Stream):
    def __init__(
        self, tokens: torch.Tensor | np.ndarray, *, seed: int, shuffle: bool, seq_len: int, global_batch: int, microbatch: int,
        dp_rank: int, dp: int, ends: np.ndarray | None = None, source: corpus.Corpus | None = None,
    ):  # fmt: skip
        """`ends`: each document's end offset in `tokens` (load_documents); None cuts the stream as one text. `source`: the
        corpus the tokens come from, which names each sample's file and record (origin)."""
        super().__init__(seq_len=seq_len, global_batch=global_batch, microbatch=microbatch, dp_rank=dp_rank, dp=dp)
        self.tokens, self.seed, self.shuffle, self.source = tokens, seed, shuffle, source
        if ends is not None:
            from runner.formats.documents import PairStream, Piece

            self.documents = True
            stream = tokens if isinstance(tokens, np.ndarray) else tokens.numpy()
            self.pairs = PairStream([Piece(lambda start, n: stream[start : start + n], ends)])
            self.num_samples = self.pairs.num_pairs // seq_len
            what = f"{self.pairs.num_pairs} (input, label) pairs in {len(ends)} documents, fewer than one sample of seq_len = {seq_len}"
        else:
            self.num_samples = (len(tokens) - 1) // seq_len
            what = f"{len(tokens)} tokens, fewer than one sample of seq_len + 1 = {seq_len + 1}"
        if self.num_samples < 1:
            raise ValueError(f"the text data holds {what}")
        self._perms: dict[int, torch.Tensor] = {}

    def _piece(self, index: int) -> int:
        epoch, j = divmod(index, self.num_samples)
        if not self.shuffle:
            return j
        if epoch not in self._perms:
            self._perms = {epoch: torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))}
        return int(self._perms[epoch][j])

    def token_start(self, index: int) -> int:
        return self._piece(index) * self.seq_len

    def sample(self, index: int) -> torch.Tensor:
        s = self.token_start(index)
        return self.tokens[s : s + self.seq_len + 1]

    def window(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.pairs.window(self.token_start(index), self.seq_len)

    def origin(self, index: int) -> dict[str, Any]:
        """The file and record the sample starts in, its offset into that document, and its range in the stream: seq_len
        (input, label) pairs (data.document_mask), else seq_len + 1 tokens."""
        start = self.token_start(index)
        where = self.source.origin(start) if self.source is not None else {}
        if self.documents:
            return where | {"pair_start": start, "num_pairs": self.seq_len}
        return where | {"token_start": start, "num_tokens": self.seq_len + 1}


def _digest(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().numpy().tobytes())


def check_inputs(data: Stream, dp_rank_of, step: int, policy) -> str:
    """Start-up proof of the input layout at `step`: every rank's (content hash, global sample indices) are gathered;
    ranks with the same DP rank (a TP/CP/PP group) must read the same samples with the same tokens, and different
    DP ranks disjoint samples. Disjointness is judged by sample index, not content: a corpus may repeat itself."""
    mbs = data.microbatches(step)
    content = _digest(torch.cat([torch.cat([t for t in mb if t is not None], dim=1) for mb in mbs]))
    mine = torch.tensor([content, *data.indices(step)], dtype=torch.int64)
    got = policy.all_gather(mine)  # the device policy's host collectives
    return judge_inputs([(int(t[0]), t[1:].tolist()) for t in got], dp_rank_of)


def judge_inputs(per_rank: list[tuple[int, list[int]]], dp_rank_of) -> str:
    """The verdict of `check_inputs` on every rank's (content hash, sample indices), indexed by rank."""
    by_dp: dict[int, dict[tuple[int, tuple[int, ...]], list[int]]] = {}
    for rank, (h, idx) in enumerate(per_rank):
        by_dp.setdefault(dp_rank_of(rank), {}).setdefault((h, tuple(idx)), []).append(rank)
    for dp_rank, reads in by_dp.items():
        if len(reads) > 1:
            what = "; ".join(f"ranks {ranks}: samples {list(idx)} (crc32 {h:08x})" for (h, idx), ranks in sorted(reads.items()))
            raise RuntimeError(f"ranks of DP rank {dp_rank} read different first batches: {what}")
    samples = {dp_rank: next(iter(reads))[1] for dp_rank, reads in sorted(by_dp.items())}
    owner: dict[int, int] = {}
    for dp_rank, idx in samples.items():
        for i in idx:
            if owner.setdefault(i, dp_rank) != dp_rank:
                raise RuntimeError(f"DP replicas {owner[i]} and {dp_rank} both read global sample {i} (samples by DP rank: {samples})")
    spans = ", ".join(f"{idx[0]}-{idx[-1]}" if idx else "none" for idx in samples.values())
    return (
        f"data check: first batch identical on the {len(per_rank) // len(by_dp)} ranks of each TP/CP/PP group, "
        f"disjoint samples across {len(by_dp)} DP replica(s) (global samples {spans})"
    )


DIGEST_BITS = 32
"""Bits of each of the digest's two lanes: a step's sum of row hashes stays exact in float64 below 2**21 rows."""


def digest_lanes(data: Stream, step: int) -> tuple[float, float]:
    """This rank's part of the data digest at `step`: per lane, the sum of a hash of every (sample index, token start)
    it reads (host arithmetic, no tensor). Summed over one rank of each data-parallel group (runner.run.step_sync),
    it is the same for runs that consume the same data, whatever their layout."""
    lanes = [0, 0]
    for i in data.indices(step):
        h = int.from_bytes(hashlib.blake2b(f"{i},{data.token_start(i)}".encode(), digest_size=8).digest(), "big")
        lanes[0] += h >> DIGEST_BITS
        lanes[1] += h & ((1 << DIGEST_BITS) - 1)
    return float(lanes[0]), float(lanes[1])


def digest_text(lanes: tuple[float, float]) -> str:
    """metrics.jsonl's data_hash: the summed lanes, each modulo 2**32, as 16 hex digits."""
    return "".join(f"{int(v) % (1 << DIGEST_BITS):08x}" for v in lanes)


class Prefetch:
    """Reads step s + 1's microbatches in a background thread while step s trains. A batch is a pure function of
    (loader position, step), so a read ahead is used only when that key still holds (a restore or a rewind moves
    the position, and the batch is then read on the spot). `waited_s`: how long the last `get` waited. With `pin`
    (a CUDA compute device: DevicePolicy.pins_host_batches) the batches are read into pinned memory, without which
    the step's non_blocking copy to the device is a synchronous one."""

    def __init__(self, data: Stream, pin: bool = False):
        self.data, self.waited_s, self.pin = data, 0.0, pin
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self._ahead = None

    def _key(self, step: int) -> tuple[int, int, int]:
        return (self.data.next_sample, self.data.at_step, step)

    def get(self, step: int) -> list[Microbatch]:
        """Microbatches of `step` (0-based), then the read of step + 1 starts."""
        t0 = time.perf_counter()
        if self._ahead is not None and self._ahead[0] == self._key(step):
            mbs = self._ahead[1].result()
        else:
            mbs = self._read(step)
        self.waited_s = time.perf_counter() - t0
        self._ahead = (self._key(step + 1), self._pool.submit(self._read, step + 1))
        return mbs

    def _read(self, step: int) -> list[Microbatch]:
        mbs = self.data.microbatches(step)
        return [Microbatch(*(None if t is None else t.pin_memory() for t in mb)) for mb in mbs] if self.pin else mbs

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
