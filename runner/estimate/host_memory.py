"""Memory of this machine and of one CPU rank on it (torch-free): what validation's host check and the search's CPU
capacity read. A GPU's memory is runner.estimate.memory's."""

from __future__ import annotations

from runner.estimate import flops
from runner.estimate.block_bytes import BYTES, activation_bytes_per_layer
from runner.schema import ActivationCheckpoint, RunConfig
from runner.schema.layout import Layout

CPU_STATE_BYTES = 16  # fp32 weight + gradient + Adam first and second moments, per parameter
CPU_LOGIT_COPIES = 3  # fp32 logits, their softmax and the logits' gradient


def cpu_rank_gb(cfg: RunConfig, lay: Layout) -> float:
    """Rough resident memory of one CPU rank, GB: process overhead, fp32 weights + grads + Adam
    moments sharded over FSDP x TP x PP, one microbatch of activations and the fp32 logits."""
    m, t = cfg.model, cfg.training
    state = flops.num_params(m) * CPU_STATE_BYTES / (lay.dp_shard * lay.tp * lay.pp)
    recompute = t.activation_checkpoint != ActivationCheckpoint.none
    acts = m.num_layers / lay.pp * activation_bytes_per_layer(cfg, lay, recompute)
    logits = CPU_LOGIT_COPIES * t.seq_len // lay.cp * t.microbatch_size * m.vocab_size * BYTES["float32"]
    return cfg.cluster.rank_overhead_gb + (state + acts + logits) / 1e9


def machine_memory_gb() -> float:
    """Total RAM of this machine from /proc/meminfo (GB): what the ranks of a CPU cluster share."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / 1e9
    raise RuntimeError("MemTotal missing from /proc/meminfo")
