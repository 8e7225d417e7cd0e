"""Activation memory: the one model that planning (per GPU) and the CPU rank estimate share.

Torch-free. Korthikanti et al. 2022, Table 2, bytes per layer per microbatch at 2-byte
activations: s*b*h*(10 + 24/t) with TP, s*b*h*34/t with TP + sequence parallelism, and
2*s*b*h (/t with SP) with full recomputation. TorchTitan's attention is fused on every
device (FlexAttention/SDPA on CUDA, aten._scaled_dot_product_flash_attention_for_cpu on
CPU), which stores no attention scores, so the paper's 5*a*s/h term is dropped. The
constants are for a GPT block (4h MLP); Llama's SwiGLU MLP and grouped-query attention
shift them by a few percent.
"""

from __future__ import annotations

from runner.config import flops
from runner.config.layout import Layout
from runner.config.schema import ActivationCheckpoint, RunConfig

BYTES = {"float32": 4, "bfloat16": 2, "float8": 1}
CPU_STATE_BYTES = 16  # fp32 weight + gradient + Adam first and second moments, per parameter
CPU_LOGIT_COPIES = 3  # fp32 logits, their softmax and the logits' gradient


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
