"""What one MoE block holds on a rank, by named term (torch-free): the memory model (runner.estimate.memory) adds them
to a block's activations, the plan shows them (`moe_memory_gb`).

Each term follows what TorchTitan 0.3.0 allocates (torchtitan/models/common/moe.py, token_dispatcher.py), per
microbatch of `tokens` tokens of the local sequence, each token routed to k of E experts (N = k x tokens routed
copies; the busiest EP rank receives R = N x moe_imbalance of them):

- routed_experts: GroupedExperts casts the routed tokens and the expert weights to bf16 whatever param_dtype
  (`x.bfloat16()`, `w.bfloat16()`), so its grouped GEMMs save a bf16 copy of each received token (R x dim) and
  SwiGLU's w1, w3, silu and product outputs (4 x R x moe_hidden_dim; gpt-oss's clamped SwiGLU 7); with param_dtype
  float32 the bf16 copies of the rank's experts' weights too (`.bfloat16()` of a bf16 weight is the weight itself).
- combine: the scores weight each returned expert output in fp32 (`routed.to(float32) * scores`), which saves the
  fp32 output (N x dim) and the scores sorted by expert (N, in the router's dtype).
- routing: the router's scores over every expert (sigmoid or softmax output, E per token, param_dtype: TorchTitan's
  float32 autocast is refused by torch, which supports only 16-bit autocast dtypes) and the int64 index tensors that
  reorder tokens: the top-k expert ids, their sort order, the token of each sorted copy and, with EP, the
  permutation from rank-major to expert-major order after the all-to-all.
- shared_experts: the shared experts' SwiGLU (a FeedForward in param_dtype) over every token.
- padding: with FP8/MXFP8 grouped GEMMs TorchTitan's TorchAOTokenDispatcher pads each local expert's token group to
  the kernel's multiple (16 FP8, 32 MXFP8): up to multiple - 1 rows per local expert through the grouped GEMMs.
  bf16 experts (the AllToAllTokenDispatcher) pad nothing.
- imbalance_headroom: what the busiest EP rank receives beyond the mean, (moe_imbalance - 1) x N routed copies'
  expert-side tensors. The dry run routes perfectly (1.0); a run's measured busiest-rank share (metrics.jsonl's `moe`
  rows) gives the real factor.

Beside those saved tensors a block holds transient buffers, counted with the temporaries of the block's backward (the
larger of the two): `dispatch_combine`, with EP the all-to-all's send and receive buffers of the routed tokens (N and
R x dim, param_dtype; in backward the same for their gradients); `combine_backward`, the first step of the block's
backward, three fp32 N x dim tensors (Qwen3-235B's rank 0 under the dry run: 3.18 GB of temporaries, 1.61 GB of them
this, beside the recomputed block's 1.49 GB).
"""

from __future__ import annotations

from runner.estimate import flops, precision
from runner.schema import RunConfig
from runner.schema.layout import Layout

GEMM_BYTES = 2  # GroupedExperts runs its grouped GEMMs in bf16 (TorchTitan casts operands with .bfloat16())
INDEX_BYTES = 8  # int64 index tensors
COMBINE_BYTES = 4  # the routed output weighted by its score in fp32
PARAM_BYTES = {"float32": 4, "bfloat16": 2}
TERMS = ("routed_experts", "combine", "routing", "shared_experts", "padding", "imbalance_headroom")


def pad_multiple(cfg: RunConfig) -> int:
    """Rows each local expert's token group is padded to a multiple of: 1 while the routed experts run bf16 grouped GEMMs;
    under precision.experts, the converters' TorchAOTokenDispatcher pads to the recipe's token_pad (FP8 rowwise 16,
    MXFP8 128: runner.estimate.precision.EXPERT_RECIPES)."""
    req = precision.EXPERT_RECIPES.get(cfg.precision.experts)
    return req.token_pad if req is not None else 1


SWIGLU_SAVED = 4  # w1, w3, silu and product outputs, each moe_hidden_dim wide
CLAMPED_SWIGLU_SAVED = 7  # gpt-oss: the fused gate/up output (2 wide), sigmoid, both clamped halves, the gate and the product


def _expert_row_bytes(cfg: RunConfig) -> float:
    """Bytes the grouped GEMMs save per received row: its bf16 copy and the activation's bf16 intermediates. gpt-oss's
    experts (biases, torchtitan/models/gpt_oss/moe.py) run one fused gate/up GEMM and a clamped SwiGLU: the clamps keep
    the fused output alive through their views, the sigmoid its output, the two products their clamped operands."""
    m = cfg.model
    saved = CLAMPED_SWIGLU_SAVED if m.moe_bias else SWIGLU_SAVED
    return GEMM_BYTES * m.dim + saved * GEMM_BYTES * m.moe_hidden_dim


def saved_terms(cfg: RunConfig, lay: Layout, tokens: float) -> dict[str, float]:
    """Bytes one MoE block saves for backward per microbatch of `tokens` local tokens, by term (the module's docstring)."""
    m, bw = cfg.model, PARAM_BYTES[cfg.precision.param_dtype.value]
    routed = m.num_experts_per_token * tokens
    local_experts = m.num_experts // lay.ep
    weight_copies = 0.0
    if bw != GEMM_BYTES:
        weight_copies = GEMM_BYTES * flops.routed_expert_params(m) / lay.ep
    indices = 3 + (lay.ep > 1)  # top-k ids, sort order, token of each sorted copy (+ the all-to-all's permutation)
    row = _expert_row_bytes(cfg)
    return {
        "routed_experts": routed * row + weight_copies,
        "combine": routed * (COMBINE_BYTES * m.dim + bw),
        "routing": tokens * bw * m.num_experts + routed * indices * INDEX_BYTES,
        "shared_experts": tokens * 4 * bw * m.num_shared_experts * m.moe_hidden_dim,
        "padding": local_experts * (pad_multiple(cfg) - 1) * row,
        "imbalance_headroom": (cfg.plan.moe_imbalance - 1) * routed * (row + INDEX_BYTES * (lay.ep > 1)),
    }


def dispatch_combine_bytes(cfg: RunConfig, lay: Layout, tokens: float) -> float:
    """The all-to-all's transient send and receive buffers of one MoE block (param_dtype, N + R rows of dim); none
    without EP (the reordered tokens are the grouped GEMMs' own input)."""
    if lay.ep == 1:
        return 0.0
    m, bw = cfg.model, PARAM_BYTES[cfg.precision.param_dtype.value]
    return (1 + cfg.plan.moe_imbalance) * m.num_experts_per_token * tokens * m.dim * bw


def combine_backward_bytes(cfg: RunConfig, tokens: float) -> float:
    """The backward of the combine's fp32 weighting (`routed.to(float32) * scores`), the first an MoE block's backward
    runs: the incoming fp32 gradient, the expert output's gradient and the product that sums to the scores' gradient,
    each N x dim in fp32, beside the block's saved tensors."""
    m = cfg.model
    return 3 * COMBINE_BYTES * m.num_experts_per_token * tokens * m.dim


def transient_bytes(cfg: RunConfig, lay: Layout, tokens: float) -> float:
    """What an MoE block's forward or backward holds beyond its saved tensors at its own peak: the combine's backward,
    or the all-to-all's buffers where they are larger."""
    return max(combine_backward_bytes(cfg, tokens), dispatch_combine_bytes(cfg, lay, tokens))


def terms_gb(cfg: RunConfig, lay: Layout) -> dict[str, float]:
    """The plan's `moe_memory_gb`: each term of one MoE block and one microbatch (GB), the transient buffers beside."""
    if not flops.is_moe(cfg.model):
        return {}
    tokens = cfg.training.microbatch_size * cfg.training.seq_len / lay.cp
    out = {k: v / 1e9 for k, v in saved_terms(cfg, lay, tokens).items()}
    return out | {
        "dispatch_combine": dispatch_combine_bytes(cfg, lay, tokens) / 1e9,
        "combine_backward": combine_backward_bytes(cfg, tokens) / 1e9,
    }
