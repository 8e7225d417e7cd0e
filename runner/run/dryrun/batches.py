"""What a rehearsed rank's step reads: a step's batch of random tokens (one document per sample, or packed documents'
positions from which the step builds its masks as on real data), and the step's FlexAttention BlockMask built for real
with TorchTitan's mask function beside the plan's bytes (runner.estimate.block_mask)."""

from __future__ import annotations

import time
from typing import Any

import torch

from runner.estimate import block_mask
from runner.run.titan import cpu as titan_cpu
from runner.schema import RunConfig
from runner.schema.layout import Layout


def synthetic_microbatches(cfg: RunConfig, lay: Layout, documents: bool = False) -> list:
    """This rank's batch of one step, random tokens, split into loader.Microbatch (one document per sample; with
    `documents`, packed documents' positions, from which the step builds its masks as on real data)."""
    from runner.run.loader import Microbatch

    t = cfg.training
    local_batch = t.global_batch_size // lay.dp
    inputs = torch.randint(0, cfg.model.vocab_size, (local_batch, t.seq_len))
    labels = torch.randint(0, cfg.model.vocab_size, (local_batch, t.seq_len))
    split = [inputs.split(t.microbatch_size), labels.split(t.microbatch_size)]
    if documents:
        split.append(packed_positions(local_batch, t.seq_len).split(t.microbatch_size))
    return [Microbatch(*mb) for mb in zip(*split, strict=True)]


def packed_positions(batch: int, seq_len: int) -> torch.Tensor:
    """Positions of samples packed with documents of a third of a sample each (restarting at 0 per document): what a
    step on real documents hands its masks (a mask's size does not depend on where documents start)."""
    return (torch.arange(seq_len) % max(1, seq_len // 3)).expand(batch, seq_len).contiguous()


MAX_PROBE_ELEMENTS = 1 << 28
"""Largest seq_len x seq_len whose BlockMask the dry run builds for real: torch's eager create_block_mask evaluates the
mask densely (one byte per element), which TorchTitan's compiled one on the GPU does not."""


def block_mask_probe(cfg: RunConfig, lay: Layout) -> dict[str, Any] | None:
    """The step's FlexAttention BlockMask (runner.estimate.block_mask) as TorchTitan's mask function builds it, for real on
    this CPU, for one sample of the run's seq_len (bytes and build time grow with the batch): its bytes beside the plan's,
    the seconds one build of a sample takes here (eager, not the GPU's compiled kernel). None: the cluster's attention
    takes no block mask (CPU: SDPA). Run it in a child (`in_fork`): its kernels start torch's intra-op threads, and a rank
    forked after that from this process hangs on a lock one of them held."""
    if not block_mask.flex(cfg):
        return None
    s, micro = cfg.training.seq_len, cfg.training.global_batch_size // (lay.dp * cfg.training.microbatch_size)
    out = {
        "batch": block_mask.mask_batch(cfg, lay, micro),
        "seq_len": s,
        "builds_per_step": block_mask.builds_per_step(cfg, lay, micro),
        "plan_bytes": block_mask.held_bytes(cfg, lay, micro),
        "masks_per_build": block_mask.masks_per_build(cfg),
        "sample_bytes": None,
        "sample_build_s": None,
    }
    if s * s > MAX_PROBE_ELEMENTS:
        return out | {"skipped": f"seq_len {s}: the eager build would hold {s * s / 1e9:.3g} GB of dense mask on this CPU"}
    positions = packed_positions(1, s)
    titan_cpu.document_block_mask(positions)  # the first build imports and warms torch's mask code
    t0 = time.perf_counter()
    mask = titan_cpu.document_block_mask(positions)
    took = time.perf_counter() - t0
    tensors = [t for t in mask.as_tuple() if isinstance(t, torch.Tensor)]
    nbytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    return out | {"sample_bytes": nbytes, "sample_build_s": took}
