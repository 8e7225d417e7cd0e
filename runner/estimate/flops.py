"""Parameter counts, FLOPs per token, MFU and HFU: each figure computed here only.

Torch-free. Two FLOP conventions, and every figure says which one it used:
- "titan": TorchTitan's `get_dense_model_nparams_and_flops`:
      6 * (N - N_embedding) + 6 * L * H * (2 * head_dim) * seq_len
  (matmul parameters; attention scores and value aggregation, forward 1 + backward 2,
  2 FLOPs per multiply-add, causal sparsity ignored; with tied embeddings N is used whole).
- "6N": 6 * N (Kaplan et al. 2020; the convention of the Llama 3 paper's MFU).
For mixture-of-experts models N is the ACTIVE parameter count in both conventions (TorchTitan's
`get_moe_model_nparams_and_flops`): a token runs num_experts_per_token of num_experts routed experts.
TorchTitan counts every block's attention over the whole sequence, sliding-window blocks (gpt-oss) included, and
so does "titan" here: its FLOPs equal TorchTitan's for every registered flavor (tests/test_families.py).
Multi-token prediction (model.num_mtp_layers = D): TorchTitan counts the D MTP blocks' parameters (their active ones)
and nothing else, so "titan" does too; `mtp_uncounted_flops_per_token` is what that leaves out (each depth's second
pass through the head, and its block's attention scores), which the FLOP test measures on the built module.
MFU = model FLOP/s / (number of devices x dense peak per device in the compute dtype); `utilisation` computes it, and
its siblings HFU and MFU of the GEMM peak, for the step rows of a run, the plan and the search alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from runner.schema import ActivationCheckpoint, ModelConfig

CONVENTIONS = ("titan", "6N")


def head_dim(m: ModelConfig) -> int:
    """Dims of one grouped-query attention head: model.head_dim where the family sets it apart (Qwen3, gpt-oss)."""
    return m.head_dim or m.dim // m.num_heads


def is_moe(m: ModelConfig) -> bool:
    return m.num_experts > 0


def is_mla(m: ModelConfig) -> bool:
    """Multi-head latent attention (DeepSeek-V3, Kimi) rather than grouped-query attention."""
    return m.kv_lora_rank > 0


def attention_head_dims(m: ModelConfig) -> int:
    """Query/key plus value dims of one head: the factor of the attention-score FLOPs."""
    if is_mla(m):
        return m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim
    return 2 * head_dim(m)


def embedding_params(m: ModelConfig) -> int:
    return m.vocab_size * m.dim


def attention_params(m: ModelConfig) -> int:
    """GQA: q, k, v, o projections (with biases in gpt-oss), Qwen3's per-head q and k norms, gpt-oss's sink
    logit per head. MLA: query projection (direct or through a q_lora_rank bottleneck with its norm), the joint
    compressed key/value + shared RoPE-key projection, its norm, the key/value up-projection and the output projection."""
    if not is_mla(m):
        hd, q = head_dim(m), m.num_heads * head_dim(m)
        qkv = q + 2 * m.num_kv_heads * hd
        n = m.dim * qkv + q * m.dim + m.dim * q * m.attention_output_gate
        n += (qkv + m.dim) * m.attention_bias + 2 * hd * m.qk_norm + m.num_heads * m.attention_sinks
        return n
    qk = m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    q = m.dim * qk if m.q_lora_rank == 0 else m.dim * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * qk
    kv = m.dim * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
    kv += m.kv_lora_rank * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
    return q + kv + m.num_heads * m.v_head_dim * m.dim


def is_hybrid(m: ModelConfig) -> bool:
    """Linear-attention blocks between the softmax-attention ones (Qwen3.5's Gated DeltaNet)."""
    return m.num_linear_value_heads > 0


def num_full_attention_layers(m: ModelConfig) -> int:
    """Blocks with softmax attention: every full_attention_interval-th one in a hybrid model, else all (sliding-window
    blocks count as full, as TorchTitan's FLOPs do)."""
    return m.num_layers // m.full_attention_interval if is_hybrid(m) else m.num_layers


def linear_attention_params(m: ModelConfig) -> int:
    """One Gated DeltaNet block: q, k, v and output-gate (z) projections, the per-value-head decay (a) and beta (b)
    projections, the depthwise convolutions over q, k and v, A_log and dt_bias per value head, the gated norm
    (one value head wide) and the output projection."""
    qk, v = m.num_linear_key_heads * m.linear_key_head_dim, m.num_linear_value_heads * m.linear_value_head_dim
    proj = m.dim * (2 * qk + 2 * v + 2 * m.num_linear_value_heads) + v * m.dim
    return proj + (2 * qk + v) * m.linear_conv_kernel + 2 * m.num_linear_value_heads + m.linear_value_head_dim


def mixer_params(m: ModelConfig) -> int:
    """The token mixers of all blocks: softmax attention, and Gated DeltaNet in a hybrid model's other blocks."""
    n_full = num_full_attention_layers(m)
    return n_full * attention_params(m) + (m.num_layers - n_full) * linear_attention_params(m)


def routed_expert_params(m: ModelConfig) -> int:
    """All routed experts of one MoE block (SwiGLU each; gpt-oss adds a bias to the fused gate/up and the down projection)."""
    bias = (2 * m.moe_hidden_dim + m.dim) * m.moe_bias
    return m.num_experts * (3 * m.dim * m.moe_hidden_dim + bias)


def router_params(m: ModelConfig) -> int:
    """The router gate of one MoE block (with its bias in gpt-oss)."""
    return (m.dim + m.moe_bias) * m.num_experts


def moe_ffn_params(m: ModelConfig) -> int:
    """Routed experts, router gate and shared experts of one MoE block."""
    shared = 3 * m.dim * m.moe_hidden_dim * m.num_shared_experts + m.dim * m.shared_expert_gate
    return routed_expert_params(m) + router_params(m) + shared


def num_moe_layers(m: ModelConfig) -> int:
    return m.num_layers - m.num_dense_layers if is_moe(m) else 0


def block_params(m: ModelConfig) -> int:
    """Parameters of the largest transformer block (an MoE block in an MoE model): attention, MLP or experts, two norms."""
    ffn = moe_ffn_params(m) if is_moe(m) else 3 * m.dim * m.ffn_hidden_dim
    return attention_params(m) + ffn + 2 * m.dim


def mtp_block_params(m: ModelConfig) -> int:
    """One multi-token-prediction block (TorchTitan's MTPTransformerBlock, a copy of the last block): the last block's
    attention, experts (or MLP) and two norms, plus the projection of [embedding; hidden] (2 dim -> dim) and its three
    RMSNorms (enorm, hnorm, mtp_norm). The embedding and the head are the main model's."""
    return block_params(m) + 2 * m.dim * m.dim + 3 * m.dim


def num_params(m: ModelConfig) -> int:
    """Parameters of the decoder (the text tower of a vision-language flavor), every expert included, tied weights
    counted once, the MTP blocks included."""
    head = 0 if m.weight_tying else m.vocab_size * m.dim
    n_moe = num_moe_layers(m)
    ffns = (m.num_layers - n_moe) * 3 * m.dim * m.ffn_hidden_dim + n_moe * moe_ffn_params(m)
    main = embedding_params(m) + mixer_params(m) + ffns + m.num_layers * 2 * m.dim + m.dim + head
    return main + m.num_mtp_layers * mtp_block_params(m)


def routed_params(m: ModelConfig) -> int:
    """All routed experts of the model: its MoE blocks and its MTP blocks (copies of the last, an MoE block)."""
    return (num_moe_layers(m) + (m.num_mtp_layers if is_moe(m) else 0)) * routed_expert_params(m)


def num_active_params(m: ModelConfig) -> int:
    """Parameters one token uses: of the routed experts only num_experts_per_token of num_experts
    (TorchTitan's get_moe_model_nparams_and_flops, with its integer division over all MoE and MTP blocks)."""
    routed = routed_params(m)
    return num_params(m) - routed + routed * m.num_experts_per_token // max(m.num_experts, 1)


def params_per_ep_rank(m: ModelConfig, ep: int) -> float:
    """Parameters one expert-parallel rank holds before FSDP shards them: the routed experts / ep, the rest whole."""
    routed = routed_params(m)
    return num_params(m) - routed + routed / ep


def flops_per_token(m: ModelConfig, seq_len: int, convention: str = "titan") -> int:
    """Training FLOPs (forward + backward) per token, from the active parameters."""
    n = num_active_params(m)
    if convention == "6N":
        return 6 * n
    if convention != "titan":
        raise ValueError(f"unknown FLOP convention {convention!r}; use one of {CONVENTIONS}")
    matmul_params = n if m.weight_tying else n - embedding_params(m)
    return 6 * matmul_params + 6 * num_full_attention_layers(m) * m.num_heads * attention_head_dims(m) * seq_len


def mtp_uncounted_flops_per_token(m: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token of multi-token prediction that TorchTitan's count (and "titan") leaves out: each MTP
    depth runs the shared head again (dim x vocab) and its block's attention over the sequence. DeepSeek-V3 671B at
    D = 1, seq 4096: 5.6 + 1.0 GFLOPs a token beside the 285.3 counted (2.3 %)."""
    head = 6 * m.dim * m.vocab_size
    return m.num_mtp_layers * (head + 6 * m.num_heads * attention_head_dims(m) * seq_len)


@dataclass(frozen=True)
class Utilisation:
    """How much of the devices' dense peak a step's FLOPs used: fractions, None where a time or a peak is missing."""

    mfu: float | None
    """Model FLOPs over the MFU peak (param_dtype's: runner.estimate.precision.mfu_peak)."""
    mfu_of_gemm_peak: float | None
    """The same model FLOPs over the peak of the dtype the GEMMs run in (float8 under an FP8 recipe on GPUs)."""
    hfu: float | None
    """Hardware FLOPs (model FLOPs and what activation checkpointing recomputes, `hfu_factor`) over the MFU peak."""


def utilisation(
    tokens: float,
    seconds: float | None,
    flops_token: float,
    peak_flops: float | None,
    gemm_peak_flops: float | None = None,
    hfu_factor: float | None = None,
) -> Utilisation:
    """MFU and its siblings of `tokens` trained in `seconds` at `flops_token` model FLOPs each, against the peak FLOP/s
    of all devices together (`peak_flops`; `gemm_peak_flops` that of the GEMMs' dtype; `hfu_factor` None: no HFU)."""

    def of(peak: float | None) -> float | None:
        return tokens * flops_token / (seconds * peak) if seconds and peak else None

    mfu = of(peak_flops)
    return Utilisation(mfu, of(gemm_peak_flops), mfu * hfu_factor if mfu is not None and hfu_factor is not None else None)


def recompute_fraction(m: ModelConfig, ac: ActivationCheckpoint, layer_frequency: int) -> float:
    """Share of the blocks' forward matmul FLOPs that backward runs again.

    selective_layer recomputes num_layers // N blocks whole. selective_op (TorchTitan's SelectiveAC) saves
    attention and every odd-numbered matmul of a block, so of a llama3 block's wq, wk, wv, wo, w1, w3, w2 it
    recomputes wk, wo and w3 (MoE and MLA blocks: half of their matmuls, the policy's own alternation)."""
    if ac == ActivationCheckpoint.none:
        return 0.0
    if ac == ActivationCheckpoint.full:
        return 1.0
    if ac == ActivationCheckpoint.selective_layer:
        return (m.num_layers // layer_frequency) / m.num_layers
    if is_moe(m) or is_mla(m):
        return 0.5
    hd = head_dim(m)
    kv, q, ffn = m.dim * hd * m.num_kv_heads, m.dim * hd * m.num_heads, m.dim * m.ffn_hidden_dim
    return (kv + q + ffn) / (2 * q + 2 * kv + 3 * ffn)


def hfu_factor(m: ModelConfig, ac: ActivationCheckpoint, layer_frequency: int, recomputes: float = 1.0) -> float:
    """Hardware FLOPs / model FLOPs: recomputation repeats that share of the forward (2 of 6 units), `recomputes` times
    per backward (more than 1 under a split backward: runner.estimate.split_backward.recomputes_per_backward)."""
    return 1.0 + recompute_fraction(m, ac, layer_frequency) * recomputes * 2.0 / 6.0
