"""Memory of one device in the step budget (conventions in runner/config/plan.py's docstring)."""

from __future__ import annotations

from typing import Any

from runner.config import flops, pipeline
from runner.config.layout import Layout
from runner.config.schema import ActivationCheckpoint, RunConfig

BYTES = {"float32": 4, "bfloat16": 2, "float8": 1}
OPTIMIZER_BYTES = 12  # fp32 master weight + Adam first and second moments


def keeps_weights_gathered(cfg: RunConfig, lay: Layout) -> bool:
    """TorchTitan's reshard_after_forward policy: 'default' keeps gathered weights with PP."""
    policy = cfg.parallelism.fsdp_reshard_after_forward
    if lay.dp_shard == 1:  # no FSDP: nothing is sharded
        return True
    return policy == "never" or (policy == "default" and lay.pp > 1)


def activation_bytes_per_layer(cfg: RunConfig, lay: Layout, recompute: bool) -> float:
    """Korthikanti et al. 2022 (module docstring), scaled to the activation dtype."""
    t = cfg.training
    s, b, h, tp = t.seq_len / lay.cp, t.microbatch_size, cfg.model.dim, lay.tp
    sp = cfg.parallelism.sequence_parallel and tp > 1
    scale = BYTES[cfg.precision.param_dtype.value] / 2
    if recompute:
        per = 2 * s * b * h / (tp if sp else 1)
    else:
        per = s * b * h * (34 / tp if sp else 10 + 24 / tp)
    return per * scale


def memory(cfg: RunConfig, lay: Layout, micro: int, device_memory_gb: float | None) -> dict[str, Any]:
    """Weights + gradients, optimizer state and activations in flight per device (bytes), and the verdict."""
    m, p = cfg.model, cfg.parallelism
    bw = BYTES[cfg.precision.param_dtype.value]
    params_gpu = flops.num_params(m) / (lay.tp * lay.pp)
    gathered = keeps_weights_gathered(cfg, lay)
    if gathered:
        weights_grads = params_gpu * 2 * bw
    else:
        weights_grads = params_gpu * 2 * bw / lay.dp_shard + 2 * flops.block_params(m) / lay.tp * bw
    optimizer = params_gpu * OPTIMIZER_BYTES / lay.dp_shard
    layers_gpu = m.num_layers / lay.pp
    act_mb = activation_bytes_per_layer(cfg, lay, recompute=False) * layers_gpu
    act_mb_ac = activation_bytes_per_layer(cfg, lay, recompute=True) * layers_gpu
    in_flight = pipeline.microbatches_in_flight(p.pp_schedule, lay.pp, micro)
    ac = cfg.training.activation_checkpoint != ActivationCheckpoint.none
    activations = (act_mb_ac if ac else act_mb) * in_flight
    total = weights_grads + optimizer + activations
    capacity = device_memory_gb if device_memory_gb is not None else cfg.cluster.device_memory_gb
    return {
        "params_per_gpu": params_gpu,
        "weights_gathered_during_step": gathered,
        "weights_grads_gb_per_gpu": weights_grads / 1e9,
        "optimizer_gb_per_gpu": optimizer / 1e9,
        "activations_gb_per_microbatch": act_mb / 1e9,
        "activations_gb_per_microbatch_recompute": act_mb_ac / 1e9,
        "microbatches_in_flight": in_flight,
        "activations_gb_per_gpu": activations / 1e9,
        "total_gb_per_gpu": total / 1e9,
        "device_memory_gb": capacity,
        "fits_memory": total / 1e9 <= capacity if capacity else None,
    }
