"""FP8 recipes as plain data: what each needs from the device and the GEMM shapes, which
Linear layers it converts, and which dense peak MFU is measured against.

Torch-free: validation reads it before launch, and runner/titan.py converts the model with
the same name filter, so the converted-layer list a run logs is the one validated here.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from runner.config.schema import DeviceType, Fp8Recipe, ModelConfig, RunConfig


@dataclass(frozen=True)
class Requirement:
    min_sm: tuple[int, int]
    """Lowest CUDA compute capability with hardware GEMMs for the recipe."""
    hardware: str
    """The GPUs that have it, for messages."""
    divisor: int
    """Every GEMM dimension of a converted layer, after TP sharding, must be a multiple of this."""
    on_cpu: str
    """"real" (torch._scaled_mm has a CPU kernel), "emulated" (runner/fp8_emulation.py) or "rejected"."""
    gpu_path: str
    """What runs on GPU."""


RECIPES = {
    Fp8Recipe.tensorwise: Requirement(
        (8, 9), "NVIDIA SM 8.9+ (Ada L4/L40S, Hopper H100/H200)", 16, "real", "TorchTitan Float8LinearConverter (torchao float8)"
    ),
    Fp8Recipe.rowwise: Requirement(
        (8, 9), "NVIDIA SM 8.9+ (Ada L4/L40S, Hopper H100/H200)", 16, "real", "TorchTitan Float8LinearConverter (torchao float8)"
    ),
    Fp8Recipe.blockwise: Requirement(
        (9, 0), "NVIDIA SM 9.0+ (Hopper H100/H200)", 128, "emulated", "torchao.prototype.blockwise_fp8_training (Triton kernels)"
    ),
    Fp8Recipe.mxfp8: Requirement(
        (10, 0), "NVIDIA SM 10.0+ (Blackwell B200/GB200)", 32, "rejected", "TorchTitan MXFP8LinearConverter (torchao MXFP8Linear)"
    ),
}


@dataclass(frozen=True)
class LinearLayer:
    fqn: str
    """TorchTitan's module name (a test keeps these equal to its model config)."""
    in_dim: int
    out_dim: int
    tp_style: str
    """"colwise" (output dim sharded over TP) or "rowwise" (input dim sharded)."""


def linear_layers(m: ModelConfig) -> list[LinearLayer]:
    """Every Linear of TorchTitan's llama3 in module order (fused QKV, SwiGLU FFN, lm_head)."""
    hd = m.dim // m.num_heads
    q, kv = m.num_heads * hd, m.num_kv_heads * hd
    out = []
    for i in range(m.num_layers):
        p = f"layers.{i}"
        out += [
            LinearLayer(f"{p}.attention.qkv_linear.wqkv", m.dim, q + 2 * kv, "colwise"),
            LinearLayer(f"{p}.attention.wo", q, m.dim, "rowwise"),
            LinearLayer(f"{p}.feed_forward.w1", m.dim, m.ffn_hidden_dim, "colwise"),
            LinearLayer(f"{p}.feed_forward.w2", m.ffn_hidden_dim, m.dim, "rowwise"),
            LinearLayer(f"{p}.feed_forward.w3", m.dim, m.ffn_hidden_dim, "colwise"),
        ]
    return [LinearLayer("lm_head", m.dim, m.vocab_size, "colwise"), *out]


def kept_by(fqn: str, patterns: list[str]) -> str | None:
    """The first keep_high_precision pattern that matches a module name, or None."""
    return next((p for p in patterns if fnmatchcase(fqn, p)), None)


def conversion(cfg: RunConfig) -> tuple[list[str], dict[str, str]]:
    """(Linear layers converted to FP8, {kept layer: the pattern that kept it})."""
    if cfg.precision.fp8 == Fp8Recipe.none:
        return [], {}
    converted, kept = [], {}
    for layer in linear_layers(cfg.model):
        pattern = kept_by(layer.fqn, cfg.precision.keep_high_precision)
        if pattern is None:
            converted.append(layer.fqn)
        else:
            kept[layer.fqn] = pattern
    return converted, kept


def local_gemm_dims(layer: LinearLayer, tp: int) -> tuple[int, int]:
    """(in, out) of the weight shard one TP rank multiplies."""
    if layer.tp_style == "rowwise":
        return layer.in_dim // tp, layer.out_dim
    return layer.in_dim, layer.out_dim // tp


def matmul_peak(cfg: RunConfig) -> tuple[str, bool]:
    """(dtype whose dense peak MFU uses, whether the FP8 matmuls are emulated).

    GPU FP8 runs use the float8 peak (twice bf16 on H100/H200). On CPU, tensorwise/rowwise run
    torch._scaled_mm's CPU kernel, so the peak is measured with it; the blockwise emulation
    multiplies dequantized values in float32, so its peak is the float32 one."""
    r = cfg.precision.fp8
    if r == Fp8Recipe.none:
        return cfg.precision.param_dtype.value, False
    if cfg.cluster.device == DeviceType.cuda or RECIPES[r].on_cpu == "real":
        return "float8", False
    return "float32", True


def parse_capability(text: str) -> tuple[int, int] | None:
    major, dot, minor = text.partition(".")
    if not (dot and major.isdigit() and minor.isdigit()):
        return None
    return int(major), int(minor)
