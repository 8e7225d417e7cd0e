"""What one transformer block saves for backward, per token of a rank's local sequence (torch-free): the per-category
bytes of runner.estimate.memory's activations, module by module as the dry run's ledger measures them (norms, linear
inputs, attention, the FFN; an MoE block's FFN by runner.estimate.moe_memory's terms), and the worked example's
Korthikanti convention.

- activations per layer and token, what TorchTitan's llama3 block saves for backward: two RMSNorms (on CPU,
  the composite kernel saves the fp32 upcast and the normalized fp32 input, 8h B; CUDA's fused kernel saves
  the input and rstd), the two linear inputs (param_dtype, the whole sequence after SP's all-gather),
  q, k, v after RoPE, the attention output and its fp32 logsumexp (SDPA/flash: no scores), and the SwiGLU
  w1, w3, silu and product outputs; per TP rank heads and FFN are / tp, norms / tp with SP. Full activation
  checkpointing keeps each block's input; one block is recomputed at a time during backward (a temporary).
"""

from __future__ import annotations

from runner.estimate import flops, moe_memory
from runner.schema import DeviceType, RunConfig
from runner.schema.layout import Layout

BYTES = {"float32": 4, "bfloat16": 2, "float8": 1}
ROPE_ENTRY_BYTES = 8  # complex64 per (position, head_dim / 2)
ROPE_COS_SIN_BYTES = 8  # fp32 cos and sin per (position, head_dim)


def activation_bytes_per_layer(cfg: RunConfig, lay: Layout, recompute: bool) -> float:
    """Korthikanti's bytes per layer per microbatch, scaled to the activation dtype (the worked example's convention)."""
    t = cfg.training
    s, b, h, tp = t.seq_len / lay.cp, t.microbatch_size, cfg.model.dim, lay.tp
    sp = cfg.parallelism.sequence_parallel and tp > 1
    scale = BYTES[cfg.precision.param_dtype.value] / 2
    if recompute:
        per = 2 * s * b * h / (tp if sp else 1)
    else:
        per = s * b * h * (34 / tp if sp else 10 + 24 / tp)
    return per * scale


def _attention_bytes_per_token(cfg: RunConfig, tp: int) -> float:
    """q, k, v after RoPE, the attention output and its fp32 logsumexp, per TP rank."""
    m, bw = cfg.model, BYTES[cfg.precision.param_dtype.value]
    a = m.num_heads / tp
    if flops.is_mla(m):  # compressed kv (+ its norm's fp32 input) and the expanded q, k, v of each head
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if cfg.cluster.device == DeviceType.cpu and qk != m.v_head_dim:
            return _mla_cpu_math_bytes_per_token(cfg, a, qk)
        return bw * (m.kv_lora_rank + m.qk_rope_head_dim) + 8 * m.kv_lora_rank + bw * a * (2 * qk + 2 * m.v_head_dim) + 4 * a
    hd, kv = flops.head_dim(m), m.num_kv_heads / tp
    return bw * hd * (a + 2 * kv) + bw * hd * a + 4 * a + _qk_norm_bytes_per_token(cfg, a, kv)


def _qk_norm_bytes_per_token(cfg: RunConfig, a: float, kv: float) -> float:
    """Qwen3's per-head RMSNorms of q and k before RoPE (model.qk_norm), on this TP rank's heads: each saves what a
    block's RMSNorm saves, one head wide (on CPU the composite's fp32 upcast and result, 24.7 KB a token and block over
    qwen3_debugmodel's 16 + 8 heads, as its dry run measures; CUDA's fused kernel its input and rstd)."""
    return norm_bytes(cfg, flops.head_dim(cfg.model)) * (a + kv) if cfg.model.qk_norm else 0.0


def attention_backward_bytes(cfg: RunConfig, lay: Layout, tokens: float, recomputed: bool) -> float:
    """Temporaries inside an attention's backward that holds score-sized gradients: on CPU, MLA's math SDPA
    (_mla_cpu_math_bytes_per_token) makes the gradient of its fp32 probabilities and of its scores, a x seq each per
    token, beside the saved probabilities and, when the block was `recomputed`, what the block still holds there (its
    norms' and attention's saved tensors: the FFN's backward came first). CPU dry runs of 2026-12-05, temporaries
    measured / planned with this term: debug_moe at seq 2,048 0.892 / 0.902 GB (1.78 / 1.80 with microbatches of 2),
    the DeepSeek-V3 recipe's ranks 0 and 1920 54.56 / 55.17 GB (30.48 planned without it). The fused kernels (CPU
    flash, CUDA's) hold no score-sized tensor: 0."""
    m = cfg.model
    if not flops.is_mla(m) or cfg.cluster.device != DeviceType.cpu or m.qk_nope_head_dim + m.qk_rope_head_dim == m.v_head_dim:
        return 0.0
    grads = 2 * 4 * m.num_heads / lay.tp * cfg.training.seq_len / lay.cp * tokens
    return grads + (layer_bytes_per_token(cfg, lay, moe=True) * tokens if recomputed else 0.0)


def _mla_cpu_math_bytes_per_token(cfg: RunConfig, a: float, qk: int) -> float:
    """MLA on CPU: SDPA has no fused kernel for a value head narrower than the query's, so its math path runs (under
    DeepSeek-V3's fp32 autocast) and saves the scaled q and k and v in fp32, the fp32 probabilities (a x seq per token)
    and the output; the compressed kv's RMSNorm (the CPU composite) and its param_dtype output."""
    m, bw = cfg.model, BYTES[cfg.precision.param_dtype.value]
    seq = cfg.training.seq_len
    return norm_bytes(cfg, m.kv_lora_rank) + bw * m.kv_lora_rank + 4 * a * (2 * qk + m.v_head_dim + seq) + bw * a * m.v_head_dim


def _ffn_bytes_per_token(cfg: RunConfig, lay: Layout) -> float:
    """SwiGLU's w1, w3, silu and product outputs (an MoE block's FFN: runner.estimate.moe_memory, by term)."""
    return 4 * BYTES[cfg.precision.param_dtype.value] * cfg.model.ffn_hidden_dim / lay.tp


def norm_bytes(cfg: RunConfig, width: int) -> float:
    """One RMSNorm per token: CUDA's fused kernel saves its input and rstd; the CPU composite the fp32 upcast and result."""
    if cfg.cluster.device == DeviceType.cuda:
        return BYTES[cfg.precision.param_dtype.value] * width + 4
    return 8 * width + 4


def layer_bytes_per_token(cfg: RunConfig, lay: Layout, moe: bool = False) -> float:
    """Bytes one transformer block saves for backward per token of the local sequence (seq_len / cp); an MoE block's
    without its FFN (moe_layer_bytes adds it)."""
    h, bw, tp = cfg.model.dim, BYTES[cfg.precision.param_dtype.value], lay.tp
    norms = 2 * norm_bytes(cfg, h) / (tp if cfg.parallelism.sequence_parallel else 1)
    return norms + 2 * bw * h + _attention_bytes_per_token(cfg, tp) + (0 if moe else _ffn_bytes_per_token(cfg, lay))


def moe_layer_bytes(cfg: RunConfig, lay: Layout, tokens: float) -> float:
    """Bytes an MoE block saves for backward per microbatch of `tokens`: norms, attention and the MoE's named terms."""
    return layer_bytes_per_token(cfg, lay, moe=True) * tokens + sum(moe_memory.saved_terms(cfg, lay, tokens).values())


def selective_op_bytes_per_token(cfg: RunConfig, lay: Layout) -> float:
    """What TorchTitan's SelectiveAC saves of a llama3 block beside its input: the outputs of the odd-numbered
    matmuls (wq, wv, w1, w2; w2's before TP's reduce), the attention output and its fp32 logsumexp."""
    m, bw, tp = cfg.model, BYTES[cfg.precision.param_dtype.value], lay.tp
    hd, a = flops.head_dim(m), m.num_heads / tp
    return bw * hd * (2 * a + m.num_kv_heads / tp) + 4 * a + bw * m.ffn_hidden_dim / tp + bw * m.dim


def rope_bytes_per_position(m) -> float:
    """One block's RoPE table per position: complex64 rotations (rotated dims / 2) or fp32 cos and sin (rotated dims
    each); the rotated dims are the head's unless model.rope_dim says fewer (Qwen3.5's partial rotary)."""
    rotated = m.rope_dim or (m.qk_rope_head_dim if flops.is_mla(m) else flops.head_dim(m))
    return rotated * ROPE_COS_SIN_BYTES if m.rope_cos_sin else rotated / 2 * ROPE_ENTRY_BYTES


def rope_tables(m, blocks: int) -> float:
    """RoPE tables of `blocks` blocks: one per softmax-attention block; a hybrid model's Gated DeltaNet blocks have none
    (with PP, a stage's share of the model's softmax blocks)."""
    return blocks * flops.num_full_attention_layers(m) / m.num_layers
