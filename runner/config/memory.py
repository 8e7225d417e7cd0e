"""Memory of one device or CPU rank: the one model that planning (per GPU), validation's memory verdict
and the CPU rank estimate share (torch-free).

Activations: Korthikanti et al. 2022, Table 2, bytes per layer per microbatch at 2-byte
activations: s*b*h*(10 + 24/t) with TP, s*b*h*34/t with TP + sequence parallelism, and
2*s*b*h (/t with SP) with full recomputation. TorchTitan's attention is fused on every
device (FlexAttention/SDPA on CUDA, aten._scaled_dot_product_flash_attention_for_cpu on
CPU), which stores no attention scores, so the paper's 5*a*s/h term is dropped. The
constants are for a GPT block (4h MLP); Llama's SwiGLU MLP and grouped-query attention
shift them by a few percent.
"""

from __future__ import annotations

from typing import Any

from runner.config import flops, pipeline
from runner.config.layout import Layout
from runner.config.schema import ActivationCheckpoint, RunConfig

BYTES = {"float32": 4, "bfloat16": 2, "float8": 1}
OPTIMIZER_BYTES = 12  # fp32 master weight + Adam first and second moments
CPU_STATE_BYTES = 16  # fp32 weight + gradient + Adam first and second moments, per parameter
CPU_LOGIT_COPIES = 3  # fp32 logits, their softmax and the logits' gradient


def keeps_weights_gathered(cfg: RunConfig, lay: Layout) -> bool:
    """TorchTitan's reshard_after_forward policy: 'default' keeps gathered weights with PP."""
    policy = cfg.parallelism.fsdp_reshard_after_forward
    if lay.dp_shard == 1:  # no FSDP: nothing is sharded
        return True
    return policy == "never" or (policy == "default" and lay.pp > 1)


def activation_bytes_per_layer(cfg: RunConfig, lay: Layout, recompute: bool) -> float:
    """Bytes one transformer layer keeps for one microbatch, scaled to the activation dtype."""
    t = cfg.training
    s, b, h, tp = t.seq_len / lay.cp, t.microbatch_size, cfg.model.dim, lay.tp
    sp = cfg.parallelism.sequence_parallel and tp > 1
    scale = BYTES[cfg.precision.param_dtype.value] / 2
    if recompute:
        per = 2 * s * b * h / (tp if sp else 1)
    else:
        per = s * b * h * (34 / tp if sp else 10 + 24 / tp)
    return per * scale


def cpu_rank_gb(cfg: RunConfig, lay: Layout) -> float:
    """Rough resident memory of one CPU rank, GB: process overhead, fp32 weights + grads + Adam
    moments sharded over FSDP x TP x PP, one microbatch of activations and the fp32 logits."""
    m, t = cfg.model, cfg.training
    state = flops.num_params(m) * CPU_STATE_BYTES / (lay.dp_shard * lay.tp * lay.pp)
    recompute = t.activation_checkpoint != ActivationCheckpoint.none
    acts = m.num_layers / lay.pp * activation_bytes_per_layer(cfg, lay, recompute)
    logits = CPU_LOGIT_COPIES * t.seq_len // lay.cp * t.microbatch_size * m.vocab_size * BYTES["float32"]
    return cfg.cluster.rank_overhead_gb + (state + acts + logits) / 1e9


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
