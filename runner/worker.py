"""Per-rank entry: `python -m runner.worker <run folder>/frozen.yaml`.

Started by torch's elastic agent (runner/launch.py locally, or torchrun on a cluster);
it reads the rank from the environment the agent sets.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from runner import flops, forensics, freeze, layout, metrics, peak, startup, titan, train
from runner.data import SyntheticData
from runner.schema import DeviceType


def _threads(cfg) -> None:
    """Ranks of one CPU machine share its cores."""
    if cfg.cluster.device == DeviceType.cpu:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))


def _check_dp_rank(pd, lay: layout.Layout, rank: int) -> int:
    """The data shard follows the runner's mesh order; TorchTitan's batch mesh must agree."""
    mesh = pd.get_optional_mesh("batch")
    got = mesh.get_local_rank() if mesh is not None else 0
    want = lay.dp_rank(rank)
    if got != want:
        raise RuntimeError(f"rank {rank}: TorchTitan's batch mesh says DP rank {got}, runner's layout says {want}")
    return want


@record
def main(frozen_path: str) -> None:
    frozen = Path(frozen_path)
    run_dir = frozen.parent
    cfg = freeze.load(frozen)
    lay = layout.resolve(cfg.parallelism, cfg.cluster)
    _threads(cfg)
    if cfg.cluster.device == DeviceType.cpu:  # torchao's CUDA kernel libraries cannot load on CPU; nothing to act on
        logging.getLogger("torchao").setLevel(logging.ERROR)
    for key, value in forensics.rank_env(cfg, run_dir).items():  # the launcher set these; torchrun-started ranks set them here
        os.environ.setdefault(key, value)
    pd = titan.init_distributed(cfg, lay)
    rank = dist.get_rank()
    recorder = forensics.RankRecorder(cfg, run_dir, rank, lay.coords(rank))
    recorder.start()
    try:
        _train(cfg, lay, pd, rank, run_dir, recorder)
    except Exception as e:  # e.g. a collective timed out: leave the rank's last state and recorder dump, then fail
        recorder.failed(e, cfg, run_dir)
        raise
    recorder.done()
    dist.destroy_process_group()


def _train(cfg, lay: layout.Layout, pd, rank: int, run_dir: Path, recorder) -> None:
    dp_rank = _check_dp_rank(pd, lay, rank)
    built = titan.build(cfg, lay, pd, run_dir)
    pk = peak.read(run_dir)
    peak_tflops, source = pk["peak_tflops"], pk["peak_source"]
    acc = train.Accounting(
        peak_tflops, pk["peak_flops_total"], source, built.flops_per_token, flops.flops_per_token(cfg.model, cfg.training.seq_len, "6N")
    )
    t = cfg.training
    data = SyntheticData(
        seed=t.seed,
        seq_len=t.seq_len,
        vocab=cfg.model.vocab_size,
        global_batch=t.global_batch_size,
        microbatch=t.microbatch_size,
        dp_rank=dp_rank,
        dp=lay.dp,
    )
    sinks = []
    if rank == 0:
        header = (
            f"runner: {cfg.model.flavor} ({built.num_params / 1e6:.1f}M params), layout {cfg.parallelism.name} "
            f"[{lay.describe()}], {lay.world_size} ranks, {cfg.precision.name}, peak {peak_tflops:.3g} TFLOP/s ({source}), "
            f"run folder {run_dir}"
        )
        converted = getattr(built, "converted_modules", None)
        print(startup.report(cfg, lay, run_dir / freeze.FROZEN_NAME, forensics.dump_folder(cfg, run_dir), converted), flush=True)
        sinks = metrics.sinks(cfg, run_dir, header, freeze.to_container(cfg))
    train.run(cfg, lay, built, data, acc, sinks, run_dir, recorder)


if __name__ == "__main__":
    main(sys.argv[1])
