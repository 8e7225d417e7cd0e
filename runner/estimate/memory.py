"""Memory of one device: the one model that planning (per GPU) and validation's memory verdict share (torch-free;
a CPU rank's rough resident memory is runner.estimate.host_memory's).

The default figures follow what TorchTitan allocates, category by category as the dry run's ledger
(runner/run/dryrun/ledger.py) measures them, at the step's peak on each pipeline stage:

- weights: FSDP2 keeps an fp32 shard of every parameter (over dp_shard x cp, TorchTitan's FSDP mesh) and
  gathers param_dtype copies: the whole stage while `fsdp_reshard_after_forward` keeps them (TorchTitan's
  default with PP), else only the module being run (at the peak, the start of backward: norm + head).
- gradients: with PP the schedule turns gradient sync off until the last microbatch, so FSDP2 accumulates
  unsharded gradients in reduce_dtype for the whole stage (without AC, the peak of a stage other than the last
  is inside a block's backward, beside FFN gradients still in param_dtype); without PP each is reduce-scattered to an fp32
  shard right after its backward (present at the peak from the second microbatch on).
- optimizer: AdamW's two fp32 moments on the same shard; with the fp32 master shard, 12 B per parameter.
- activations per layer and token: what a block saves for backward (runner.estimate.block_bytes).
- temporaries: that recomputed block, or on the last stage the loss's backward (the logits and their fp32 and
  param_dtype gradients), whichever is larger. Under an FP8 recipe the block's backward also holds a converted
  Linear's float8 operands and the cast that makes the last of them (runner/estimate/predict/fp8_cost.py,
  backward_transient_bytes); nothing else of FP8 stays in memory (no float8 weight copy, no scale buffer; saved
  activations stay in param_dtype).
  The last stage adds the final norm, the head's input, its output (the param_dtype logits, kept for backward
  as every stage's output is) and the fp32 log-softmax of the loss (vocab / tp); other stages keep each
  in-flight microbatch's output. torch's PipelineStage allocates a receive buffer per microbatch of the step for
  the input of every stage after the first, kept across steps (and one for the gradient of every stage before
  the last, not counted yet: the dry run's ledger registers each only when its microbatch's backward uses it).
- multi-token prediction (model.num_mtp_layers, no PP): the MTP blocks' parameters on the one stage, what each
  block, its input norms and projection and its head's loss save for backward (activation checkpointing leaves them
  whole), and a RoPE table each.
- block masks: FlexAttention's BlockMask of the step on CUDA (runner/estimate/block_mask.py).
- buffers: one RoPE table per softmax-attention block (complex64, head_dim / 2 per position; fp32 cos and sin,
  2 x head_dim, in Qwen3, Qwen3.5 and gpt-oss: the CUDA rehearsal of the gpt-oss recipe measures 67 MB a block; Qwen3.5
  rotates model.rope_dim of its head's dims) at the flavor's model.rope_max_seq_len (llama3 131,072, deepseek_v3
  16,384), which the runner keeps whatever training.seq_len.

The budget convention of the worked example (the 70B plan on 1,024 H100s the docs work through) is kept beside it,
under keys ending in `_worked_example`: weights and gradients both in the training dtype, 12 B of optimizer state per
parameter over dp_shard, and Korthikanti et al. 2022 (Table 2) for
activations: s*b*h*(10 + 24/t) per layer with TP, s*b*h*34/t with TP + SP, 2*s*b*h (/t with SP) with full
recomputation, the 5*a*s/h score term dropped (fused attention).
"""

from __future__ import annotations

from typing import Any

from runner.estimate import block_mask, flops, moe_memory, pipeline, pipeline_ranks, split_backward
from runner.estimate.block_bytes import (
    BYTES,
    activation_bytes_per_layer,
    attention_backward_bytes,
    layer_bytes_per_token,
    moe_layer_bytes,
    norm_bytes,
    rope_bytes_per_position,
    rope_tables,
    selective_op_bytes_per_token,
)
from runner.estimate.predict import fp8_cost as fp8
from runner.schema import ActivationCheckpoint, RunConfig
from runner.schema.layout import Layout

OPTIMIZER_BYTES = 12  # fp32 master weight + Adam first and second moments
MOMENT_BYTES = 8  # Adam first and second moments in fp32
MASTER_BYTES = 4  # FSDP2's fp32 parameter shard
FFN_GRADS_AT_PEAK = 2  # of the FFN's 3 weights, those with a param_dtype gradient at a stage's peak without AC: w2 and w3
# (the dry run finds 2 on the debug model, all 3 on the 405B whose activations dwarf the weights; 2 is within 2 % of both)
LOSS_BACKWARD_BYTES = 8  # per token and vocabulary entry: the param_dtype logits, the fp32 gradient of the loss and its param_dtype cast


def keeps_weights_gathered(cfg: RunConfig, lay: Layout) -> bool:
    """TorchTitan's reshard_after_forward policy: 'default' keeps gathered weights with PP."""
    policy = cfg.parallelism.fsdp_reshard_after_forward
    if lay.dp_shard == 1:  # no FSDP: nothing is sharded
        return True
    return policy == "never" or (policy == "default" and lay.pp > 1)


def _regathers_blocks(cfg: RunConfig, lay: Layout) -> bool:
    """Whether FSDP2 frees each block's gathered weights after its forward and gathers them again for its backward,
    by TorchTitan's policy, also where nothing is sharded: TorchTitan applies FSDP whatever the degree, so on one rank
    the blocks' weights are gathered copies too (qwen3_debugmodel's dry run on one rank: a block's and the head's at the
    peak). keeps_weights_gathered, which prices the all-gathers, leaves dp_shard 1 out."""
    policy = cfg.parallelism.fsdp_reshard_after_forward
    return not (policy == "never" or (policy == "default" and lay.pp > 1))


def _ffn_weight_params(cfg: RunConfig, lay: Layout, moe: bool) -> float:
    """Parameters of one block's FFN on this rank (routed experts / ep), whose gradients autograd makes in param_dtype
    before FSDP2's post-backward casts them to reduce_dtype and accumulates them."""
    m = cfg.model
    if not moe:
        return 3 * m.dim * m.ffn_hidden_dim / lay.tp
    return (flops.moe_ffn_params(m) - flops.routed_expert_params(m) * (1 - 1 / lay.ep)) / lay.tp


def _ffn_grads_at_peak(cfg: RunConfig, lay: Layout, moe: bool, pipelined: bool) -> float:
    """Parameters of the FFN whose block's backward holds a stage's peak that have their gradient in param_dtype there,
    before FSDP2's post-backward casts and reduces them. An MoE block's all: its experts' backward makes the three expert
    weights' gradients before the block's attention (dry runs of qwen3_debugmodel_moe dp2_pp2 and debug_moe: every expert,
    router and shared-expert gradient at the peak). A dense SwiGLU's w2 and w3 under PP (FFN_GRADS_AT_PEAK); without PP,
    where FSDP2 regathers the block, w2's alone: the peak is at the SwiGLU product's backward, which holds three
    gradients of the FFN's width (qwen3_debugmodel on one rank, fp32 and bf16, and dp2_tp2)."""
    ffn = _ffn_weight_params(cfg, lay, moe)
    if moe:
        return ffn
    return ffn * (FFN_GRADS_AT_PEAK if pipelined else 1) / 3


def _stage_params(cfg: RunConfig, layers: tuple[int, int], first: bool, last: bool) -> tuple[float, float]:
    """(parameters, of which the final norm + head) of a stage with (dense, moe) blocks."""
    m = cfg.model
    mixer = flops.mixer_params(m) / m.num_layers  # the mean block's attention (Qwen3.5 mixes two kinds)
    dense_block = mixer + 3 * m.dim * m.ffn_hidden_dim + 2 * m.dim
    moe_block = mixer + flops.moe_ffn_params(m) + 2 * m.dim if flops.is_moe(m) else 0
    head = (m.dim + flops.embedding_params(m)) if last else 0
    emb = flops.embedding_params(m) if first and not (last and m.weight_tying) else 0
    mtp = m.num_mtp_layers * flops.mtp_block_params(m) if last else 0  # MTP is refused under PP: its stage is the model
    return layers[0] * dense_block + layers[1] * moe_block + emb + head + mtp, head


def _saved_by_blocks(cfg: RunConfig, lay: Layout, blocks: tuple[int, int], first: bool, sizes: tuple[float, float, float], tokens: float):
    """Bytes a stage's (dense, moe) blocks save for backward per microbatch under the AC mode. A checkpointed block
    keeps its input (on a later stage the first block's is the receive buffer, counted by the caller); a
    selective_layer stage checkpoints n // N of its n blocks; selective_op adds what its policy saves (MoE and
    MLA blocks: half of what they keep without AC)."""
    full_layer, moe_layer, hidden = sizes
    ac, n = cfg.training.activation_checkpoint, blocks[0] + blocks[1]
    kept = blocks[0] * full_layer + blocks[1] * moe_layer
    if ac == ActivationCheckpoint.none or n == 0:
        return kept
    inputs = (n - (not first)) * hidden
    if ac == ActivationCheckpoint.full:
        return inputs
    if ac == ActivationCheckpoint.selective_layer:
        share = (n // cfg.training.ac_layer_frequency) / n
        return share * inputs + (1 - share) * kept
    if flops.is_moe(cfg.model) or flops.is_mla(cfg.model):
        return inputs + kept / 2
    return inputs + n * selective_op_bytes_per_token(cfg, lay) * tokens


def stage(cfg: RunConfig, lay: Layout, micro: int, st: int) -> dict[str, float]:
    """Bytes by category on a rank of pipeline stage `st`, at its peak (the start of the backward that frees
    the most activations, every earlier microbatch's gradients accumulated)."""
    m, t = cfg.model, cfg.training
    bw, rw = BYTES[cfg.precision.param_dtype.value], BYTES[cfg.precision.reduce_dtype.value]
    # the last stage holds the final norm, the head and the loss: pipeline rank pp - 1, or rank 0 in a V schedule
    v_shaped = lay.pp > 1 and pipeline.SCHEDULES[cfg.parallelism.pp_schedule].style == "v"
    first, last = st == 0, st == (0 if v_shaped else lay.pp - 1)
    blocks = pipeline_ranks.stage_blocks(cfg, lay)[st]
    params, head = _stage_params(cfg, blocks, first, last)
    ep_share = 0.0
    mtp = m.num_mtp_layers if last else 0  # the MTP blocks: copies of the last block, with the head
    if flops.is_moe(m) and lay.ep > 1:  # routed experts are split over ep before FSDP shards the rest
        ep_share = (blocks[1] + mtp) * flops.routed_expert_params(m) * (1 - 1 / lay.ep)
    local = (params - ep_share) / lay.tp  # embedding and head are split over tp as well (vocab- and column-wise)
    shard = lay.dp_shard * lay.cp
    # routed experts are split over ep, then FSDP-sharded over dp_shard x cp / ep: every parameter's shard is / shard
    sharded = params / lay.tp / shard
    ac = t.activation_checkpoint != ActivationCheckpoint.none
    tokens = t.microbatch_size * t.seq_len / lay.cp
    ffn_grads = 0.0
    if not _regathers_blocks(cfg, lay) and lay.pp > 1:
        ffn_grads = _pipelined_ffn_grads(cfg, lay, blocks, last, tokens)
        weights_grads = local * (bw + rw) + ffn_grads
    else:
        weights_grads = head / lay.tp * bw + (sharded * MASTER_BYTES if micro > 1 else 0)
    # FSDP resharding after forward: the step peaks either in the loss's backward (its temporaries) or inside the
    # stage's last block's backward, beside that block's gathered weights, its FFN gradients in param_dtype and the
    # head's gradients (param_dtype and their reduce_dtype shard): the larger total is the peak (debug_moe ep8 dry run)
    in_block = _last_block_backward(cfg, lay, blocks, head, shard, micro) if _regathers_blocks(cfg, lay) else None
    sp = cfg.parallelism.sequence_parallel and lay.tp > 1
    full_layer = layer_bytes_per_token(cfg, lay) * tokens
    moe_layer = moe_layer_bytes(cfg, lay, tokens) if flops.is_moe(m) else 0.0
    hidden = bw * m.dim * tokens / (lay.tp if sp else 1)  # one hidden state: a block's input, a stage's output
    layers = _saved_by_blocks(cfg, lay, blocks, first, (full_layer, moe_layer, hidden), tokens)
    extras = _extras(cfg, lay, first, last, tokens, hidden)
    # torch's PipelineStage keeps a receive buffer per microbatch of the step for the stage's input (all but the first
    # stage) and one for its output's gradient (all but the last), made in the first step and kept across steps
    receive = micro * hidden * pipeline_ranks.receive_buffers(cfg, lay, st, first, last)
    # the V's bottom rank keeps the tensors its two stages pass each other, a microbatch's in each receive slot: the
    # first stage's output (an activation) and the second's input gradient (a backward temporary)
    passed = micro * hidden * pipeline_ranks.local_links(cfg, lay, st)
    activations = pipeline_ranks.in_flight(cfg, lay, micro, st) * (layers + extras) + receive
    chunks = _held_by_virtual_stage(cfg, lay, micro, st, (full_layer, moe_layer, hidden), tokens)
    if chunks is not None:  # each virtual stage's blocks and extras times the microbatches it holds at the peak
        activations = receive + passed + chunks
    if ffn_grads and blocks[1] and not ac:  # the stage peaks past an MoE block's experts' backward
        activations -= _freed_by_experts_backward(cfg, lay, last, tokens, extras)
    recompute = max(full_layer if blocks[0] else 0, moe_layer if blocks[1] else 0) if ac else 0
    # an MoE block's backward starts with the combine's fp32 gradients (runner.estimate.moe_memory), before its Linears'
    in_moe = (moe_layer if ac else 0) + moe_memory.transient_bytes(cfg, lay, tokens) if blocks[1] else 0
    if ffn_grads and blocks[1] and ac:  # past the recomputed MoE block's experts: what remains of it
        recompute = in_moe = max(full_layer if blocks[0] else 0, _recomputed_moe_past_experts(cfg, lay, tokens))
    loss_backward = LOSS_BACKWARD_BYTES * m.vocab_size / lay.tp * tokens if last and not (ffn_grads and lay.pp > 1) else 0
    buffers = (rope_tables(m, blocks[0] + blocks[1]) + mtp) * m.rope_max_seq_len * rope_bytes_per_position(m)
    optimizer = sharded * (MASTER_BYTES + MOMENT_BYTES)
    # FP8: the block's backward peaks at w2's last cast, before the FFN has gradients, or at a later Linear's beside them
    first, later = fp8.backward_transient_bytes(cfg, lay.tp, t.microbatch_size * t.seq_len // lay.cp)
    if first - ffn_grads > later and first > loss_backward:
        weights_grads -= ffn_grads
    in_linear = max(recompute + (first if first - ffn_grads > later else later), in_moe)
    temporaries = max(in_linear, loss_backward, attention_backward_bytes(cfg, lay, tokens, ac)) + passed
    if in_block is not None and in_block > temporaries:
        weights_grads, temporaries = weights_grads + in_block, in_linear
    split = _split_backward_peak(cfg, lay, micro, st, (full_layer, moe_layer, hidden), tokens)
    if split is not None and receive + 2 * passed + sum(split) + local * bw > activations + temporaries + weights_grads:
        # the peak is inside the weight half of a V schedule's split backward (runner.estimate.split_backward)
        activations, temporaries, weights_grads = receive + passed + split[0], passed + split[1], local * bw + split[2]
    masks = block_mask.held_bytes(cfg, lay, micro)  # FlexAttention's BlockMask on CUDA (runner.estimate.block_mask)
    return {
        "params": local,
        "weights_grads": weights_grads,
        "optimizer": optimizer,
        "activations": activations,
        "activations_per_microbatch": layers + extras + receive / micro,
        "temporaries": temporaries,
        "buffers": buffers,
        "block_masks": masks,
        "total": weights_grads + optimizer + activations + temporaries + buffers + masks,
    }


def _pipelined_ffn_grads(cfg: RunConfig, lay: Layout, blocks: tuple[int, int], last: bool, tokens: float) -> float:
    """Bytes of FFN gradients in param_dtype at the peak of a pipeline stage that keeps its weights gathered, inside a
    block's backward. A dense block's without AC on a stage other than the last (whose peak is in the loss's backward;
    with full AC the peak is in the recompute, before them: the 405B's dry run). An MoE block's experts', where they
    outweigh the loss's backward and, with AC, the recomputed block and its combine's backward that come before them
    (_recomputed_moe_past_experts): qwen3_debugmodel_moe dp2_pp2, with and without full AC, holds all of them at both
    stages' peaks (5 % of weights + gradients); the gpt-oss and Qwen3-235B recipes' recomputed blocks outweigh theirs."""
    moe, ac = blocks[1] > 0, cfg.training.activation_checkpoint != ActivationCheckpoint.none
    if not moe and (ac or last):
        return 0.0
    grads = _ffn_grads_at_peak(cfg, lay, moe, pipelined=True) * BYTES[cfg.precision.param_dtype.value]
    before = moe_layer_bytes(cfg, lay, tokens) + moe_memory.transient_bytes(cfg, lay, tokens) if moe and ac else 0.0
    if before and grads + _recomputed_moe_past_experts(cfg, lay, tokens) <= before:
        return 0.0
    return grads if not last or grads > LOSS_BACKWARD_BYTES * cfg.model.vocab_size / lay.tp * tokens else 0.0


def _recomputed_moe_past_experts(cfg: RunConfig, lay: Layout, tokens: float) -> float:
    """What a recomputed MoE block still holds once its experts' backward is done: its norms' and attention's saved
    tensors (the MoE terms are freed)."""
    return layer_bytes_per_token(cfg, lay, moe=True) * tokens


def _freed_by_experts_backward(cfg: RunConfig, lay: Layout, last: bool, tokens: float, extras: float) -> float:
    """What a stage without AC no longer holds at a peak past an MoE block's experts' backward (_pipelined_ffn_grads):
    that block's MoE terms (moe_memory.saved_terms) and, on the last stage, what the head and the loss saved (their
    backward came first). qwen3_debugmodel_moe dp2_pp2: 38 and 44 MB below the plan's activations on the first and last
    stage."""
    return sum(moe_memory.saved_terms(cfg, lay, tokens).values()) + (extras if last else 0.0)


def _chunk_per_mb(cfg: RunConfig, lay: Layout, st: int, sizes: tuple[float, float, float], tokens: float) -> list[float]:
    """Bytes each of rank `st`'s virtual stages saves per microbatch: its blocks' and its extras (on the V's bottom rank
    the first stage's output is the second's receive slot, counted by the caller)."""
    n, passed = lay.pp * cfg.parallelism.pp_virtual_stages, pipeline_ranks.local_links(cfg, lay, st)
    per_mb = []
    for s, blk in zip(pipeline_ranks.chunk_stages(cfg, lay, st), pipeline_ranks.chunk_blocks(cfg, lay, st), strict=True):
        saved = _saved_by_blocks(cfg, lay, blk, s == 0, sizes, tokens)
        per_mb.append(saved + _extras(cfg, lay, s == 0, s == n - 1, tokens, sizes[2]) - (passed and not per_mb) * sizes[2])
    return per_mb


def _split_backward_peak(cfg: RunConfig, lay: Layout, micro: int, st: int, sizes: tuple[float, float, float], tokens: float):
    """(activations beside the receive slots, temporaries, gradients) at the heaviest W of a V schedule's split backward
    on rank `st` (runner.estimate.split_backward.peak); None without one."""
    if not split_backward.w_points(cfg, lay, micro, st):
        return None
    stages, blocks = pipeline_ranks.chunk_stages(cfg, lay, st), pipeline_ranks.chunk_blocks(cfg, lay, st)
    params = [_chunk_params(cfg, lay, s, b) for s, b in zip(stages, blocks, strict=True)]
    return split_backward.peak(cfg, lay, micro, st, _chunk_per_mb(cfg, lay, st, sizes, tokens), params, sizes[:2], tokens)


def _chunk_params(cfg: RunConfig, lay: Layout, s: int, blocks: tuple[int, int]) -> float:
    """Parameters of pipeline stage `s` on one of its ranks (routed experts / ep, all / tp)."""
    n = lay.pp * cfg.parallelism.pp_virtual_stages
    params, _ = _stage_params(cfg, blocks, s == 0, s == n - 1)
    return (params - blocks[1] * flops.routed_expert_params(cfg.model) * (1 - 1 / lay.ep)) / lay.tp


def _held_by_virtual_stage(cfg: RunConfig, lay: Layout, micro: int, st: int, sizes: tuple[float, float, float], tokens: float):
    """Bytes rank `st`'s virtual stages save at its peak, each its blocks and extras times the microbatches it holds:
    torch's warm-up under Interleaved1F1B; under a V schedule the most of every point of its action order (None for a
    schedule with one stage per rank)."""
    per_mb = _chunk_per_mb(cfg, lay, st, sizes, tokens)
    looped = pipeline_ranks.looped_held(cfg, lay, micro, st)
    if looped is not None:
        return sum(k * b for k, b in zip(looped, per_mb, strict=True))
    v = pipeline_ranks.v_peaks(cfg, lay, micro, st)
    if v is not None:
        return max(held * per_mb[0] + last * per_mb[1] for held, last in v)
    return None


def _extras(cfg: RunConfig, lay: Layout, first: bool, last: bool, tokens: float, hidden: float) -> float:
    """Bytes a (virtual) stage saves per microbatch beside its blocks: the embedding's token ids on the first; on the last
    the final norm, the head's input and output, the loss's fp32 log-softmax and labels; else its output."""
    m, bw = cfg.model, BYTES[cfg.precision.param_dtype.value]
    sp = cfg.parallelism.sequence_parallel and lay.tp > 1
    extras = 8 * tokens if first else 0  # the embedding's token ids
    if last:  # final norm, the head's input and output (the stage's output, kept for backward), the loss's fp32 log-softmax, labels
        head_in = norm_bytes(cfg, m.dim) / (lay.tp if sp else 1) + bw * m.dim
        logits = bw * m.vocab_size / lay.tp if lay.pp > 1 else 0  # without PP the loss's backward frees them (a temporary)
        return extras + (head_in + logits + 4 * m.vocab_size / lay.tp + 8) * tokens + _mtp_bytes(cfg, lay, tokens)
    return extras + hidden  # the stage's output, kept for backward


def _mtp_bytes(cfg: RunConfig, lay: Layout, tokens: float) -> float:
    """What the model.num_mtp_layers MTP depths save for backward per microbatch (TorchTitan's MTPTransformerBlock, which
    activation checkpointing leaves whole: it wraps `layers` only): each its block (a copy of the last) and, per token,
    the RMSNorms of the shifted tokens' embedding and of the previous depth's hidden state, their concatenation
    (eh_proj's input, 2 x dim), its output norm and the head's input, the loss's fp32 log-softmax and shifted labels.
    Dry run (debug_moe, D = 1, seq 512, CPU): 66.3 MB measured beside the block's 57.7 MB and 8.9 MB per token here."""
    m, bw = cfg.model, BYTES[cfg.precision.param_dtype.value]
    if not m.num_mtp_layers:
        return 0.0
    sp = cfg.parallelism.sequence_parallel and lay.tp > 1
    norms = 3 * norm_bytes(cfg, m.dim) / (lay.tp if sp else 1)
    per_token = norms + 3 * bw * m.dim + 4 * m.vocab_size / lay.tp + 8
    block = moe_layer_bytes(cfg, lay, tokens) if flops.is_moe(m) else layer_bytes_per_token(cfg, lay) * tokens
    return m.num_mtp_layers * (block + per_token * tokens)


def _last_block_backward(cfg: RunConfig, lay: Layout, blocks: tuple[int, int], head: float, shard: int, micro: int) -> float:
    """Bytes beyond the loss-backward peak's weights and gradients that a rank holds inside its last block's backward:
    the block's gathered weights, its FFN's gradients in param_dtype (_ffn_grads_at_peak), and the head's gradient shard
    in reduce_dtype: new in the first microbatch (later ones add to the accumulated shards), and not yet made with a
    tied embedding (the head's FSDP unit holds the embedding, whose backward is the step's last)."""
    m = cfg.model
    bw, rw = BYTES[cfg.precision.param_dtype.value], BYTES[cfg.precision.reduce_dtype.value]
    moe = blocks[1] > 0  # the stage's last block is an MoE block when it holds any (dense blocks come first)
    block = flops.attention_params(m) / lay.tp + _ffn_weight_params(cfg, lay, moe) + 2 * m.dim
    head_shard = head / lay.tp / shard * rw if micro == 1 and not m.weight_tying else 0.0
    # a tied embedding under TP: its gathered copy and the head's gradient of it are still held at this peak
    # (measured: the dry run of qwen3_debugmodel dp2_tp2, 2 x embedding / tp bytes over the plan without them)
    tied_tp = 2 * flops.embedding_params(m) / lay.tp * bw if m.weight_tying and lay.tp > 1 else 0.0
    return block * bw + _ffn_grads_at_peak(cfg, lay, moe, pipelined=False) * bw + head_shard + tied_tp


def stage_gb(cfg: RunConfig, lay: Layout, micro: int, st: int) -> dict[str, float]:
    return {k: v / 1e9 if k != "params" else v for k, v in stage(cfg, lay, micro, st).items()}


def _worked_example(cfg: RunConfig, lay: Layout, micro: int) -> dict[str, Any]:
    """The worked example's budget convention: training-dtype weights and gradients, 12 B/param over dp_shard, Korthikanti."""
    m, p = cfg.model, cfg.parallelism
    bw = BYTES[cfg.precision.param_dtype.value]
    params_gpu = flops.num_params(m) / (lay.tp * lay.pp)
    if keeps_weights_gathered(cfg, lay):
        weights_grads = params_gpu * 2 * bw
    else:
        weights_grads = params_gpu * 2 * bw / lay.dp_shard + 2 * flops.block_params(m) / lay.tp * bw
    optimizer = params_gpu * OPTIMIZER_BYTES / lay.dp_shard
    layers_gpu = m.num_layers / lay.pp
    act_mb = activation_bytes_per_layer(cfg, lay, recompute=False) * layers_gpu
    act_mb_ac = activation_bytes_per_layer(cfg, lay, recompute=True) * layers_gpu
    flight = pipeline.microbatches_in_flight(p.pp_schedule, lay.pp, micro)
    ac = cfg.training.activation_checkpoint != ActivationCheckpoint.none
    activations = (act_mb_ac if ac else act_mb) * flight
    return {
        "params_per_gpu": params_gpu,
        "weights_grads_gb_per_gpu_worked_example": weights_grads / 1e9,
        "optimizer_gb_per_gpu_worked_example": optimizer / 1e9,
        "activations_gb_per_microbatch_worked_example": act_mb / 1e9,
        "activations_gb_per_microbatch_recompute_worked_example": act_mb_ac / 1e9,
        "activations_gb_per_gpu_worked_example": activations / 1e9,
        "total_gb_per_gpu_worked_example": (weights_grads + optimizer + activations) / 1e9,
    }


def memory(cfg: RunConfig, lay: Layout, micro: int, device_memory_gb: float | None) -> dict[str, Any]:
    """Per device: the stage with the largest total (TorchTitan's allocation), the worked example's budget beside it, the verdicts."""
    stages = [stage_gb(cfg, lay, micro, s) for s in range(lay.pp)]
    worst = max(range(lay.pp), key=lambda s: stages[s]["total"])
    w = stages[worst]
    example = _worked_example(cfg, lay, micro)
    capacity = device_memory_gb if device_memory_gb is not None else cfg.cluster.device_memory_gb
    return {
        **example,
        "weights_gathered_during_step": keeps_weights_gathered(cfg, lay),
        "memory_stage": worst,
        "microbatches_in_flight": pipeline_ranks.held_microbatches(cfg, lay, micro, worst),
        "weights_grads_gb_per_gpu": w["weights_grads"],
        "optimizer_gb_per_gpu": w["optimizer"],
        "activations_gb_per_microbatch": w["activations_per_microbatch"],
        "activations_gb_per_gpu": w["activations"],
        "temporaries_gb_per_gpu": w["temporaries"],
        "buffers_gb_per_gpu": w["buffers"],
        "moe_memory_gb": moe_memory.terms_gb(cfg, lay),
        "block_mask_gb_per_gpu": w["block_masks"],
        "total_gb_per_gpu": w["total"],
        "total_gb_per_stage": [s["total"] for s in stages],
        "device_memory_gb": capacity,
        "fits_memory": w["total"] <= capacity if capacity else None,
        "fits_memory_worked_example": example["total_gb_per_gpu_worked_example"] <= capacity if capacity else None,
    }
