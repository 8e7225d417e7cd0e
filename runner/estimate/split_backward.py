"""What a V schedule's split backward holds on a rank (torch-free), for runner.estimate.memory.

torch's ScheduleZBVZeroBubble, and ScheduleDualPipeV from the middle of its step 6 on, split a stage's backward into an
input half (I: `stage_backward_input`) and a weight half (W: `stage_backward_weight`) that runs later
(runner.estimate.pipeline_ranks.v_actions). Measured by the CPU dry run of the DeepSeek-V3 recipe's V bottom
(rank 2047: stages 15 and 16, two MoE blocks each, full activation checkpointing), whose peak is inside the
tail's first W, 15 I's deferred beside it:

- a deferred I keeps its microbatch's checkpointed block inputs and stage output (pipeline_ranks.FREES) and, per
  weight, the gradient of the weight's op output that W multiplies (torch's `param_group["grads"]`): 3.29 GB per
  stage and microbatch there, as `weight_grad_inputs` counts it.
- W calls autograd once per weight (its param group), each call a graph task of its own: under activation
  checkpointing each recomputes the weight's block, and what the call does not unpack stays with the retained graph
  until W ends. 351.6 GB for stage 16's 2 blocks x 16 weights on the CPU's kernels, 0.88 of 32 recomputed blocks
  (debug_moe, 2 blocks x 14 weights: 0.79); the model counts RECOMPUTE_KEPT of each.
- W's param_dtype gradients stay beside FSDP2's reduce_dtype accumulation until the stage's next backward adds them
  (its post-backward hook runs at the stage's input, which an I reaches before W has made them).
- the model's first stage has no input gradient: its I does nothing and its W is a full backward (no recomputes).
"""

from __future__ import annotations

import functools

from runner.estimate import flops, pipeline, pipeline_ranks
from runner.schema import ActivationCheckpoint, DeviceType, RunConfig
from runner.schema.layout import Layout

RECOMPUTE_KEPT = 0.85
"""Share of a recomputed block that each of W's per-weight autograd calls leaves held (dry run: 0.88 DeepSeek-V3, 0.79
debug_moe)."""
GEMM_BYTES = 2  # the routed experts' grouped GEMMs run in bf16 (runner.estimate.moe_memory)


def weights_per_block(cfg: RunConfig, moe: bool) -> int:
    """Parameter tensors of one block (W's param groups): attention's projections and norms, the two block norms, the
    FFN's three (an MoE block's router, routed experts' three, shared experts' three)."""
    m = cfg.model
    if flops.is_mla(m):
        attention = 5 + 2 * (m.q_lora_rank > 0)  # wq or wq_a + q_norm + wq_b; wkv_a, kv_norm, wkv_b, wo
    else:
        attention = 4 * (1 + m.attention_bias) + 2 * m.qk_norm + m.attention_sinks
    ffn = 1 + (3 + 2 * m.moe_bias) + 3 * (m.num_shared_experts > 0) if moe else 3
    return attention + 2 + ffn


def weight_grad_inputs(cfg: RunConfig, lay: Layout, moe: bool, tokens: float) -> float:
    """Bytes a deferred I keeps per block for W: the gradient of each weight's op output (param_dtype; norms' in fp32 on
    the CPU's composite kernel; the routed experts' grouped GEMMs' in bf16 for each routed copy)."""
    m, tp = cfg.model, lay.tp
    bw = 2 if cfg.precision.param_dtype.value == "bfloat16" else 4
    norm = 4 if cfg.cluster.device == DeviceType.cpu else bw
    if flops.is_mla(m):
        qk = m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim) / tp
        q = bw * (2 * m.q_lora_rank + qk) if m.q_lora_rank else bw * qk  # wq_a and its norm's output in param_dtype
        kv = bw * (m.kv_lora_rank + m.qk_rope_head_dim) + norm * m.kv_lora_rank
        attention = q + kv + bw * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim) / tp + bw * m.dim
    else:
        hd = flops.head_dim(m)
        attention = bw * (hd * (m.num_heads + 2 * m.num_kv_heads) / tp + m.dim)
    out = attention + 2 * norm * m.dim
    if not moe:
        return tokens * (out + bw * (2 * m.ffn_hidden_dim / tp + m.dim))
    routed = m.num_experts_per_token * GEMM_BYTES * (2 * m.moe_hidden_dim + m.dim)
    shared = bw * (2 * m.num_shared_experts * m.moe_hidden_dim + m.dim) if m.num_shared_experts else 0
    return tokens * (out + bw * m.num_experts + routed + shared)


def w_points(cfg: RunConfig, lay: Layout, micro: int, st: int) -> tuple[tuple, ...]:
    """Each W of rank `st` under a V schedule (empty otherwise): (its chunk, microbatches each chunk holds, I's each chunk
    has deferred besides it, whether the other chunk's param_dtype gradients are unreduced, whether each chunk has its
    reduce_dtype accumulation yet: FSDP2 makes it at the chunk's first full backward, or at the I after its first W)."""
    if lay.pp == 1 or pipeline.SCHEDULES[cfg.parallelism.pp_schedule].style != "v":
        return ()
    return _w_points(cfg.parallelism.pp_schedule, lay.pp, micro, st)


@functools.lru_cache(maxsize=1024)
def _w_points(schedule: str, pp: int, micro: int, rank: int) -> tuple[tuple, ...]:
    held, deferred, unreduced, reduced, out = [0, 0], [0, 0], [False, False], [False, False], []
    for chunk, kind in pipeline_ranks.v_actions(schedule, pp, micro, rank):
        if kind == "W":
            deferred[chunk] -= 1
            out.append((chunk, *held, *deferred, unreduced[1 - chunk], *reduced))
        held[chunk] += 1 if kind == "F" else -1 if kind in pipeline_ranks.FREES else 0
        deferred[chunk] += kind == "I"
        reduced[chunk] = reduced[chunk] or kind == "B" or (kind == "I" and unreduced[chunk])
        unreduced[chunk] = kind == "W" or (unreduced[chunk] and kind == "F")
    return tuple(dict.fromkeys(out))


BYTES = {"float32": 4, "bfloat16": 2}


def peak(
    cfg: RunConfig, lay: Layout, micro: int, st: int, per_mb: list[float], params: list[float], layer: tuple[float, float], tokens: float
):
    """(activations beside the receive slots, temporaries, gradients) at the W of rank `st` with the largest sum, given
    each chunk's bytes saved per microbatch and parameters on the rank, and a (dense, moe) block's recomputed bytes."""
    stages, blocks = pipeline_ranks.chunk_stages(cfg, lay, st), pipeline_ranks.chunk_blocks(cfg, lay, st)
    kept = RECOMPUTE_KEPT * (cfg.training.activation_checkpoint != ActivationCheckpoint.none)
    bw, rw = BYTES[cfg.precision.param_dtype.value], BYTES[cfg.precision.reduce_dtype.value]
    inputs = [weight_grad_inputs(cfg, lay, moe, tokens) for moe in (False, True)]
    groups = [weights_per_block(cfg, moe) * size for moe, size in zip((False, True), layer, strict=True)]
    dw = [(s != 0) * (d * inputs[0] + e * inputs[1]) for s, (d, e) in zip(stages, blocks, strict=True)]
    recompute = [(s != 0) * kept * (d * groups[0] + e * groups[1]) for s, (d, e) in zip(stages, blocks, strict=True)]
    best = (0.0, 0.0, 0.0)
    for chunk, h0, h1, q0, q1, other, reduced0, reduced1 in w_points(cfg, lay, micro, st):
        if stages[chunk] != 0:  # the first stage's W is a full backward
            grads = (reduced0 * params[0] + reduced1 * params[1]) * rw + (params[chunk] + other * params[1 - chunk]) * bw
            cand = (h0 * per_mb[0] + h1 * per_mb[1], q0 * dw[0] + q1 * dw[1] + recompute[chunk], grads)
            best = max(best, cand, key=sum)
    return best
