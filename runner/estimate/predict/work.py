"""The work one rank does for one microbatch, as the predictor counts it (torch-free arithmetic).

Each transformer block is a list of GEMMs at their per-rank shapes (M tokens x K in -> N out, TP
shards N of column-parallel and K of row-parallel projections), the attention core (causal: half
the score FLOPs TorchTitan's convention counts), and the activation elements the elementwise kernels
(norms, RoPE, SwiGLU, residual adds) read and write. Recomputation repeats a share of the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from runner.estimate import flops
from runner.schema import RunConfig
from runner.schema.layout import Layout

Gemm = tuple[int, int, int]  # (M, K, N) of one forward GEMM on this rank


@dataclass(frozen=True)
class BlockWork:
    """One transformer block, one microbatch, one rank, forward only (backward is twice each GEMM)."""

    gemms: list[Gemm]
    attention_flops: float
    """Forward FLOPs of the attention core actually computed (causal mask: half of Q K^T and P V)."""
    attention_shape: tuple[int, int, int]
    """(heads on this rank, query length, head dim) of one attention call."""
    elements: float
    """Activation elements the forward's elementwise kernels touch (norms, RoPE, SwiGLU, residual adds)."""


def tokens(cfg: RunConfig, lay: Layout) -> int:
    """Tokens of one microbatch on one rank (CP splits the sequence)."""
    return cfg.training.microbatch_size * cfg.training.seq_len // lay.cp


def _attention_gemms(cfg: RunConfig, lay: Layout, n: int) -> list[Gemm]:
    m, tp = cfg.model, lay.tp
    if flops.is_mla(m):
        qk = m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim) // tp
        q = [(n, m.dim, qk)] if m.q_lora_rank == 0 else [(n, m.dim, m.q_lora_rank), (n, m.q_lora_rank, qk)]
        kv = [(n, m.dim, m.kv_lora_rank + m.qk_rope_head_dim), (n, m.kv_lora_rank, m.num_heads * (m.qk_nope_head_dim + m.v_head_dim) // tp)]
        return [*q, *kv, (n, m.num_heads * m.v_head_dim // tp, m.dim)]
    hd = flops.head_dim(m)
    return [
        (n, m.dim, m.num_heads * hd // tp),
        (n, m.dim, m.num_kv_heads * hd // tp),
        (n, m.dim, m.num_kv_heads * hd // tp),
        (n, m.num_heads * hd // tp, m.dim),
    ]


def routed_gemms(cfg: RunConfig, lay: Layout, n: int) -> list[Gemm]:
    """The routed experts' grouped GEMMs on one rank (balanced routing), as TorchTitan shards them. Without EP
    every TP rank sees the microbatch's n tokens and holds 1/tp of each expert's hidden dim. With EP the TP
    ranks split the tokens (the MoE reuses the TP axis for sequence sharding) and a rank's num_experts / ep
    local experts receive the tokens of all ep ranks of its group: n / tp x ep x top-k / num_experts each.
    Either way a rank does n x top-k / tp tokens' expert FLOPs, whatever ep is; EP changes the shapes."""
    m, tp, ep = cfg.model, lay.tp, lay.ep
    h = m.moe_hidden_dim // (tp if ep == 1 else 1)
    per_expert = max(1, n * m.num_experts_per_token * ep // ((tp if ep > 1 else 1) * m.num_experts))
    return [(per_expert, m.dim, h), (per_expert, m.dim, h), (per_expert, h, m.dim)] * max(1, m.num_experts // ep)


def _ffn_gemms(cfg: RunConfig, lay: Layout, n: int) -> list[Gemm]:
    """SwiGLU (w1, w3 column-parallel, w2 row-parallel); an MoE block's router, routed experts and shared experts."""
    m, tp = cfg.model, lay.tp
    if not flops.is_moe(m):
        f = m.ffn_hidden_dim // tp
        return [(n, m.dim, f), (n, m.dim, f), (n, f, m.dim)]
    shared = m.moe_hidden_dim * m.num_shared_experts // tp
    out = [(n, m.dim, m.num_experts), *routed_gemms(cfg, lay, n)]
    return out + ([(n, m.dim, shared), (n, m.dim, shared), (n, shared, m.dim)] if shared else [])


def block(cfg: RunConfig, lay: Layout) -> BlockWork:
    m, n, tp = cfg.model, tokens(cfg, lay), lay.tp
    heads = m.num_heads // tp
    dims = flops.attention_head_dims(m)
    s_q, s_kv = n // cfg.training.microbatch_size, cfg.training.seq_len  # ring attention: every K/V chunk once
    attention = 2 * cfg.training.microbatch_size * heads * s_q * s_kv * dims / 2  # causal: half
    sp = tp if cfg.parallelism.sequence_parallel else 1
    hd = flops.head_dim(m)
    ffn = (m.moe_hidden_dim * m.num_experts_per_token if flops.is_moe(m) else m.ffn_hidden_dim) / tp
    elements = n * (4 * m.dim / sp + (m.num_heads + m.num_kv_heads) * hd / tp + 3 * ffn)
    return BlockWork(_attention_gemms(cfg, lay, n) + _ffn_gemms(cfg, lay, n), attention, (heads, s_q, hd), elements)


def head_gemm(cfg: RunConfig, lay: Layout) -> Gemm:
    """The output projection (column-parallel over the vocabulary under TP)."""
    return (tokens(cfg, lay), cfg.model.dim, cfg.model.vocab_size // lay.tp)


def logits(cfg: RunConfig, lay: Layout) -> float:
    """Logit elements of one microbatch on this rank (the loss's elementwise work, in fp32: 2 elements' bytes each)."""
    return 2.0 * tokens(cfg, lay) * cfg.model.vocab_size / lay.tp


def gemm_flops(g: Gemm) -> float:
    return 2.0 * g[0] * g[1] * g[2]


def recomputed_share(ac: str, layer_frequency: int) -> tuple[float, float, float]:
    """(share of the forward GEMMs, of the attention core, of the elementwise work) recomputed in backward.
    full: all of it. selective_op (TorchTitan's per-op policy): every second matmul and every cheap op;
    attention and the other matmuls are saved. selective_layer: every layer_frequency-th block whole."""
    if ac == "full":
        return 1.0, 1.0, 1.0
    if ac == "selective_op":
        return 0.5, 0.0, 1.0
    if ac == "selective_layer":
        return (1.0 / layer_frequency,) * 3
    return 0.0, 0.0, 0.0
