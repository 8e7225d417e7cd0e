"""Synthetic data: DP shards are disjoint and together equal the single-rank batch; the start-up data check."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from runner.run.loader import SyntheticData


def _data(dp_rank: int, dp: int, seed: int = 0) -> SyntheticData:
    return SyntheticData(seed=seed, seq_len=32, vocab=2048, global_batch=8, microbatch=2, dp_rank=dp_rank, dp=dp)


def _rows(d: SyntheticData, step: int) -> torch.Tensor:
    return torch.cat([mb.inputs for mb in d.microbatches(step)])


def test_dp_shards_partition_the_global_batch():
    whole = _rows(_data(0, 1), step=3)
    shards = [_rows(_data(r, 4), step=3) for r in range(4)]
    assert all(s.shape == (2, 32) for s in shards)
    assert torch.equal(torch.cat(shards), whole)
    assert len({tuple(r.tolist()) for r in whole}) == 8  # no sample repeated


def test_labels_are_inputs_shifted_and_steps_differ():
    inp, lab, positions = _data(0, 2).microbatches(0)[0]
    assert positions is None  # one document per sample
    assert inp.shape == lab.shape == (2, 32)
    assert torch.equal(inp[:, 1:], lab[:, :-1])
    assert not torch.equal(_rows(_data(0, 1), 0), _rows(_data(0, 1), 1))


def test_seed_decides_the_stream():
    assert torch.equal(_rows(_data(1, 2, seed=7), 5), _rows(_data(1, 2, seed=7), 5))
    assert not torch.equal(_rows(_data(1, 2, seed=7), 5), _rows(_data(1, 2, seed=0), 5))


def test_stream_is_learnable_progression():
    inp = _data(0, 1).microbatches(0)[0].inputs
    diffs = (inp[:, 1:] - inp[:, :-1]) % 2048
    # most steps repeat the sample's stride (1 token in 10 is noise)
    mode = torch.mode(diffs, dim=1).values  # per-sample stride
    assert ((diffs == mode[:, None]).float().mean() > 0.7).item()


def _check_inputs_on_threads(shards: list, dp_rank_of) -> list:
    """runner.run.loader.check_inputs on one thread per rank; the policy's host all_gather is done by hand between the threads."""
    from runner.run import loader as data

    n, box, barrier = len(shards), [None] * len(shards), threading.Barrier(len(shards))
    local = threading.local()

    class ThreadPolicy:
        def all_gather(self, mine):
            box[local.rank] = mine
            barrier.wait()
            return list(box)

    def rank(r):
        local.rank = r
        try:
            return data.check_inputs(shards[r], dp_rank_of, 0, ThreadPolicy())
        except RuntimeError as e:
            return e

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(rank, range(n)))


def test_data_check_judges_replicas_by_sample_not_content():
    """One short document repeated: DP replicas read the same tokens from different samples, which is fine."""
    from runner.run.loader import TextData

    tokens = torch.tensor([5, 6, 7, 8] * 200)  # every 64-token piece starts at a multiple of 4: all identical

    def shard(r, dp):
        return TextData(tokens, seed=0, shuffle=True, seq_len=64, global_batch=8, microbatch=2, dp_rank=r, dp=dp)

    got = _check_inputs_on_threads([shard(0, 2), shard(1, 2)], lambda r: r)
    line = "data check: first batch identical on the 1 ranks of each TP/CP/PP group, disjoint samples across 2 DP replica(s)"
    assert got == [f"{line} (global samples 0-3, 4-7)"] * 2  # before the fix: "two DP replicas read the same first batch"
    # dp2 x tp2 (rank // 2 is the DP rank): agreeing TP pairs pass
    assert _check_inputs_on_threads([shard(0, 2), shard(0, 2), shard(1, 2), shard(1, 2)], lambda r: r // 2)[0].startswith(
        "data check: first batch identical on the 2 ranks of each TP/CP/PP group"
    )


def test_data_check_catches_overlapping_replicas_and_disagreeing_tp_ranks():
    overlap = _check_inputs_on_threads([_data(0, 2), _data(0, 2)], lambda r: r)  # both think they are DP rank 0
    assert all(str(e).startswith("DP replicas 0 and 1 both read global sample 0") for e in overlap)
    split = _check_inputs_on_threads([_data(0, 2), _data(0, 2, seed=1)], lambda r: 0)  # one TP group, other seeds
    assert all(str(e).startswith("ranks of DP rank 0 read different first batches: ranks [") for e in split)
