"""Parameter counts, FLOPs per token, MFU and HFU: each figure computed here only.

Torch-free. Two FLOP conventions, and every figure says which one it used:
- "titan": TorchTitan's `get_dense_model_nparams_and_flops`:
      6 * (N - N_embedding) + 6 * L * H * (2 * head_dim) * seq_len
  (matmul parameters; attention scores and value aggregation, forward 1 + backward 2,
  2 FLOPs per multiply-add, causal sparsity ignored; with tied embeddings N is used whole).
- "6N": 6 * N (Kaplan et al. 2020; the convention of the Llama 3 paper's MFU).
MFU = model FLOP/s / (number of devices x dense peak per device in the compute dtype).
"""

from __future__ import annotations

from runner.schema import ActivationCheckpoint, ModelConfig

CONVENTIONS = ("titan", "6N")


def head_dim(m: ModelConfig) -> int:
    return m.dim // m.num_heads


def embedding_params(m: ModelConfig) -> int:
    return m.vocab_size * m.dim


def block_params(m: ModelConfig) -> int:
    """Parameters of one transformer block: attention, SwiGLU MLP and two norms."""
    hd = head_dim(m)
    attention = m.dim * hd * (m.num_heads + 2 * m.num_kv_heads) + m.num_heads * hd * m.dim
    return attention + 3 * m.dim * m.ffn_hidden_dim + 2 * m.dim


def num_params(m: ModelConfig) -> int:
    """Parameters of a Llama-style decoder (no biases), counting tied weights once."""
    head = 0 if m.weight_tying else m.vocab_size * m.dim
    return embedding_params(m) + m.num_layers * block_params(m) + m.dim + head


def flops_per_token(m: ModelConfig, seq_len: int, convention: str = "titan") -> int:
    """Training FLOPs (forward + backward) per token."""
    n = num_params(m)
    if convention == "6N":
        return 6 * n
    if convention != "titan":
        raise ValueError(f"unknown FLOP convention {convention!r}; use one of {CONVENTIONS}")
    matmul_params = n if m.weight_tying else n - embedding_params(m)
    return 6 * matmul_params + 6 * m.num_layers * m.num_heads * (2 * head_dim(m)) * seq_len


def mfu(tokens_per_s: float, flops_token: float, peak_flops_total: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all devices."""
    return tokens_per_s * flops_token / peak_flops_total


def hfu_factor(ac: ActivationCheckpoint) -> float:
    """Hardware FLOPs / model FLOPs: full recomputation repeats the forward (2 of 6 units)."""
    return {ActivationCheckpoint.none: 1.0, ActivationCheckpoint.full: 8.0 / 6.0}[ac]
