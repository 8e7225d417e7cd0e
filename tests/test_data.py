"""Synthetic data: DP shards are disjoint and together equal the single-rank batch."""

from __future__ import annotations

import torch

from runner.run.data import SyntheticData


def _data(dp_rank: int, dp: int, seed: int = 0) -> SyntheticData:
    return SyntheticData(seed=seed, seq_len=32, vocab=2048, global_batch=8, microbatch=2, dp_rank=dp_rank, dp=dp)


def _rows(d: SyntheticData, step: int) -> torch.Tensor:
    return torch.cat([inp for inp, _ in d.microbatches(step)])


def test_dp_shards_partition_the_global_batch():
    whole = _rows(_data(0, 1), step=3)
    shards = [_rows(_data(r, 4), step=3) for r in range(4)]
    assert all(s.shape == (2, 32) for s in shards)
    assert torch.equal(torch.cat(shards), whole)
    assert len({tuple(r.tolist()) for r in whole}) == 8  # no sample repeated


def test_labels_are_inputs_shifted_and_steps_differ():
    inp, lab = _data(0, 2).microbatches(0)[0]
    assert inp.shape == lab.shape == (2, 32)
    assert torch.equal(inp[:, 1:], lab[:, :-1])
    assert not torch.equal(_rows(_data(0, 1), 0), _rows(_data(0, 1), 1))


def test_seed_decides_the_stream():
    assert torch.equal(_rows(_data(1, 2, seed=7), 5), _rows(_data(1, 2, seed=7), 5))
    assert not torch.equal(_rows(_data(1, 2, seed=7), 5), _rows(_data(1, 2, seed=0), 5))


def test_stream_is_learnable_progression():
    inp, _ = _data(0, 1).microbatches(0)[0]
    diffs = (inp[:, 1:] - inp[:, :-1]) % 2048
    # most steps repeat the sample's stride (1 token in 10 is noise)
    mode = torch.mode(diffs, dim=1).values  # per-sample stride
    assert ((diffs == mode[:, None]).float().mean() > 0.7).item()
