"""Synthetic data: a deterministic, learnable token stream derived from the seed.

Sample g (global index step * global_batch_size + i) is an arithmetic progression
modulo the vocabulary with a random start and stride, 1 token in 10 replaced by noise.
DP replica r reads samples [r * local, (r + 1) * local) of each step, so replicas are
disjoint and their union is the same global batch for every layout; every rank of a
TP/CP group has the same DP rank and so the same inputs.
"""

from __future__ import annotations

import torch

MAX_STRIDE = 16
NOISE = 0.1


def sample(seed: int, index: int, seq_len: int, vocab: int) -> torch.Tensor:
    """Tokens (seq_len + 1) of global sample `index`."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    start = torch.randint(0, vocab, (1,), generator=g)
    stride = torch.randint(1, MAX_STRIDE + 1, (1,), generator=g)
    tokens = (start + stride * torch.arange(seq_len + 1)) % vocab
    noise = torch.rand(seq_len + 1, generator=g) < NOISE
    return torch.where(noise, torch.randint(0, vocab, (seq_len + 1,), generator=g), tokens)


class SyntheticData:
    def __init__(self, *, seed: int, seq_len: int, vocab: int, global_batch: int, microbatch: int, dp_rank: int, dp: int):
        self.seed, self.seq_len, self.vocab = seed, seq_len, vocab
        self.global_batch, self.microbatch = global_batch, microbatch
        self.local = global_batch // dp
        self.first = dp_rank * self.local

    def microbatches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, labels) per microbatch of this rank's share of `step` (0-based)."""
        base = step * self.global_batch + self.first
        rows = torch.stack([sample(self.seed, base + i, self.seq_len, self.vocab) for i in range(self.local)])
        return [(mb[:, :-1].contiguous(), mb[:, 1:].contiguous()) for mb in rows.split(self.microbatch)]
