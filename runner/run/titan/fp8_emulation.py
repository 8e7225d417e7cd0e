"""DeepSeek-V3 blockwise FP8 training, emulated in PyTorch ops for CPUs.

torchao's blockwise FP8 training (torchao.prototype.blockwise_fp8_training) quantizes with
Triton kernels that do not run on CPU. This module does the same quantization with real
torch.float8_e4m3fn casts and the same scales (amax per block in float64, scale = 448 / amax
in float32, values scaled, clamped to +-448, cast with round-to-nearest-even), then multiplies
the dequantized values in float32 (the higher-precision accumulation of the FP8 GEMM).
`BlockwiseFp8Matmul` quantizes every GEMM operand of forward and backward as torchao's
`fp8_blockwise_mm` does:

    forward  out    = x[1x128 tiles along K] @ W[128x128 blocks].T
    backward grad_x = dy[1x128 tiles along N] @ W[128x128 blocks]
             grad_W = dy.T[1x128 tiles along M] @ x[128x1 tiles along M]
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.experimental import local_map

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
EPS = 1e-12  # torchao's floor on a block's amax (an all-zero block gets a finite scale)
BLOCK = 128


def _scale(amax: torch.Tensor) -> torch.Tensor:
    """FP8_MAX / amax, computed in float64 and stored as float32 (as torchao's kernels do)."""
    return (FP8_MAX / amax.to(torch.float64).clamp(min=EPS)).to(torch.float32)


def cast_saturating(y: torch.Tensor) -> torch.Tensor:
    """Clamp to +-448 before the cast, as torchao's kernels do: float8_e4m3fn has no infinity, and
    the emulation should not depend on how a backend's cast treats overflow."""
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_tiles(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """1 x block tiles along the last dim of a 2-D tensor: (fp8 values, reciprocal scales [M, K/block])."""
    m, k = x.shape
    tiles = x.reshape(m, k // block, block)
    scale = _scale(tiles.abs().amax(dim=-1, keepdim=True))
    return cast_saturating(tiles * scale).reshape(m, k), (1.0 / scale).squeeze(-1)


def dequantize_tiles(q: torch.Tensor, inv_scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    m, k = q.shape
    return (q.to(torch.float32).reshape(m, k // block, block) * inv_scale.unsqueeze(-1)).reshape(m, k)


def quantize_blocks(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """block x block squares of a 2-D weight: (fp8 values, reciprocal scales [N/block, K/block])."""
    n, k = w.shape
    blocks = w.reshape(n // block, block, k // block, block)
    scale = _scale(blocks.abs().amax(dim=(1, 3), keepdim=True))
    return cast_saturating(blocks * scale).reshape(n, k), (1.0 / scale).reshape(n // block, k // block)


def dequantize_blocks(q: torch.Tensor, inv_scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    n, k = q.shape
    blocks = q.to(torch.float32).reshape(n // block, block, k // block, block)
    return (blocks * inv_scale[:, None, :, None]).reshape(n, k)


def fake_tiles(x: torch.Tensor) -> torch.Tensor:
    """x as the FP8 GEMM sees it with 1x128 tiles along its last dim (float32)."""
    return dequantize_tiles(*quantize_tiles(x))


def fake_blocks(w: torch.Tensor) -> torch.Tensor:
    return dequantize_blocks(*quantize_blocks(w))


class BlockwiseFp8Matmul(torch.autograd.Function):
    """x @ w.T with every operand of forward and backward quantized as DeepSeek-V3 does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        ctx.save_for_backward(x2, w)
        ctx.shape = shape
        out = fake_tiles(x2) @ fake_blocks(w).t()
        return out.to(x.dtype).reshape(*shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x2, w = ctx.saved_tensors
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = fake_tiles(dy) @ fake_blocks(w)
        grad_w = fake_tiles(dy.t().contiguous()) @ fake_tiles(x2.t().contiguous()).t()
        return grad_x.to(x2.dtype).reshape(ctx.shape), grad_w.to(w.dtype)


def blockwise_fp8_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) through the emulation. With a tensor-parallel weight (a DTensor after FSDP's
    all-gather) the emulation runs on each rank's shard via local_map: a colwise shard gives a
    column shard of the output, a rowwise shard a partial sum. Shards are multiples of 128
    (validation checks it), so every tile and block is the one the unsharded GEMM would use."""
    if not isinstance(w, DTensor):
        return BlockwiseFp8Matmul.apply(x, w)
    if len(w.placements) != 1:
        raise NotImplementedError(f"blockwise FP8 emulation expects a 1-D TP mesh, got weight placements {w.placements}")
    (p,) = w.placements
    if p == Shard(0):
        x_in, out = Replicate(), Shard(x.ndim - 1)
    elif p == Shard(1):
        x_in, out = Shard(x.ndim - 1), Partial()
    else:
        x_in, out = Replicate(), Replicate()
    fn = local_map(BlockwiseFp8Matmul.apply, out_placements=[out], in_placements=([x_in], [p]), redistribute_inputs=True)
    return fn(x, w)


# The routed experts in float8 rowwise (precision.experts=fp8_rowwise), emulated per expert. torchao's _Float8GroupedMM
# (prototype/moe_training/fp8_grouped_mm.py) scales with Triton kernels, which do not run on CPU; the scales here are
# torchao's own CPU-capable ones (float8_utils.tensor_to_scale: amax along the GEMM's reduction axis, FP8_MAX / amax
# in float64, rounded down to a power of two as its kernels are called; to_fp8_saturated: clamp, cast to e4m3). A
# group's padding rows (TorchTitan's TorchAOTokenDispatcher pads each group to 16 on GPU) are zero, so they change no
# amax: the emulation needs no padding. Per expert, with w its (out, in) weight as TorchTitan stores it:
#
#     forward  out    = x[scale per token row] @ w[scale per output row].T          (A rowwise, B_t colwise)
#     backward grad_x = dy[scale per token row] @ w[scale per input column]         (B rowwise over N)
#              grad_w = dy[scale per column over the group's tokens].T @ x[the same] (per-group colwise)


def fake_rowwise(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x as torchao's float8 rowwise grouped GEMM sees it, scaled along `dim` (the GEMM's reduction axis), in float32."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    scale = tensor_to_scale(x, FP8, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=dim, round_scales_to_power_of_2=True)
    return to_fp8_saturated(x.to(torch.float32) * scale, FP8).to(torch.float32) / scale


class RowwiseFp8ExpertMatmul(torch.autograd.Function):
    """x @ w.T for one expert's token group, every operand of forward and backward quantized as torchao's
    _Float8GroupedMM quantizes it; the GEMM runs on the dequantized values in float32."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        if x.shape[0] == 0:  # an expert no token reached: no amax to take
            return x.new_zeros(0, w.shape[0])
        return (fake_rowwise(x, -1) @ fake_rowwise(w, -1).t()).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        if x.shape[0] == 0:
            return torch.zeros_like(x), torch.zeros_like(w)
        grad_x = fake_rowwise(dy, -1) @ fake_rowwise(w, 0)
        grad_w = fake_rowwise(dy, 0).t() @ fake_rowwise(x, 0)
        return grad_x.to(x.dtype), grad_w.to(w.dtype)
