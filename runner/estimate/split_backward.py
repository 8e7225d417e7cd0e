"""What a V schedule's split backward holds on a rank (torch-free), for runner.estimate.memory, and how often a
split backward recomputes a checkpointed block (recomputes_per_backward, for HFU).

torch's ScheduleZBVZeroBubble, and ScheduleDualPipeV from the middle of its step 6 on, split a stage's backward into an
input half (I: `stage_backward_input`) and a weight half (W: `stage_backward_weight`) that runs later
(runner.estimate.pipeline_ranks.v_actions). Measured by the CPU dry run of the DeepSeek-V3 recipe's V bottom
(rank 2047: stages 15 and 16, two MoE blocks each, full activation checkpointing), whose peak is inside the
tail's first W, 15 I's deferred beside it:

- a deferred I keeps its microbatch's checkpointed block inputs and stage output (pipeline_ranks.FREES) and, per
  weight, the gradient of the weight's op output that W multiplies (torch's `param_group["grads"]`): 3.29 GB per
  stage and microbatch there, as `weight_grad_inputs` counts it.
- W calls autograd once per weight (its param group). Each call is a graph task of its own, and under activation
  checkpointing torch recomputes the block once per graph task: 16 forwards of an MoE block per W, and what each call
  left unread stayed until W ended (352 GB on the DeepSeek-V3 V bottom, CPU kernels). The runner runs each W inside
  one `torch.utils.checkpoint.GraphExecGroup` (runner.run.titan.weight_pass), so W recomputes each block of its stage
  once; what the recompute holds until W ends is RECOMPUTE_KEPT blocks' saved bytes per block of the stage.
- W's param_dtype gradients stay beside FSDP2's reduce_dtype accumulation until the stage's next backward adds them
  (its post-backward hook runs at the stage's input, which an I reaches before W has made them).
- the model's first stage has no input gradient: its I does nothing and its W is a full backward (no recomputes).
"""

from __future__ import annotations

import functools

from runner.estimate import flops, pipeline, pipeline_ranks
from runner.schema import ActivationCheckpoint, DeviceType, RunConfig
from runner.schema.layout import Layout

RECOMPUTE_KEPT = 1.5
"""What W's one recompute of a block holds at W's peak, in the block's saved bytes: the recomputed saved tensors and
the weight gradients' temporaries beside them. Fitted to the CPU dry runs of 2026-12-05 (with the GraphExecGroup):
DeepSeek-V3 DualPipeV rank 2047 temporaries 93.35 planned / 89.40 measured GB, debug_moe's V (SMALL_V in
tests/test_v_schedule_memory.py) rank 7 89.3 / 86.0 MB."""
GEMM_BYTES = 2  # the routed experts' grouped GEMMs run in bf16 (runner.estimate.moe_memory)


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
    dw = [(s != 0) * (d * inputs[0] + e * inputs[1]) for s, (d, e) in zip(stages, blocks, strict=True)]
    recompute = [(s != 0) * kept * (d * layer[0] + e * layer[1]) for s, (d, e) in zip(stages, blocks, strict=True)]
    best = (0.0, 0.0, 0.0)
    for chunk, h0, h1, q0, q1, other, reduced0, reduced1 in w_points(cfg, lay, micro, st):
        if stages[chunk] != 0:  # the first stage's W is a full backward
            grads = (reduced0 * params[0] + reduced1 * params[1]) * rw + (params[chunk] + other * params[1 - chunk]) * bw
            cand = (h0 * per_mb[0] + h1 * per_mb[1], q0 * dw[0] + q1 * dw[1] + recompute[chunk], grads)
            best = max(best, cand, key=sum)
    return best


def recomputes_per_backward(cfg: RunConfig, lay: Layout) -> float:
    """Forwards of a checkpointed block that backward reruns per microbatch, over all the model's blocks: 1, and 2 for
    the backwards torch splits into an input pass and a weight pass (each reruns the block: the weight pass once, under
    runner.run.titan.weight_pass). Every backward of InterleavedZeroBubble and ZBVZeroBubble splits, DualPipeV's from the
    middle of its step 6 on; the model's first stage has no input gradient, so its weight pass is its only backward.
    Counted on real ranks (tests/test_parallel.py: a pp2 block's forwards over a run, per stage)."""
    p = cfg.parallelism
    if lay.pp == 1 or not pipeline.SCHEDULES[p.pp_schedule].zero_bubble:
        return 1.0
    micro = cfg.training.global_batch_size // (lay.dp * cfg.training.microbatch_size)
    split = split_shares(p.pp_schedule, lay.pp, p.pp_virtual_stages, micro)
    blocks = [sum(b) for b in pipeline_ranks.blocks_of_stages(cfg, lay)]
    return 1.0 + sum(b * s for b, s in zip(blocks, split, strict=True)) / max(1, sum(blocks))


@functools.lru_cache(maxsize=256)
def split_shares(schedule: str, pp: int, v: int, micro: int) -> tuple[float, ...]:
    """Per pipeline stage, the share of its microbatches' backwards split into an input and a weight pass
    (`schedule` a zero-bubble schedule; v stages per rank)."""
    if schedule != "DualPipeV":
        return (0.0,) + (1.0,) * (pp * v - 1)
    share = [0.0] * (2 * pp)
    for rank in range(pp):
        stages = (rank, 2 * pp - 1 - rank)
        for chunk, kind in pipeline_ranks.v_actions(schedule, pp, micro, rank):
            share[stages[chunk]] += (kind == "I") / micro
    return (0.0, *share[1:])
