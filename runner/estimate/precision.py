"""FP8 recipes as plain data: what each needs from the device and the GEMM shapes, which
Linear layers it converts, which routed experts precision.experts converts, and which dense peak MFU is measured against.

Torch-free: validation reads it before launch; the adapter (runner/run/titan/fp8_conversion.py) picks the layers
to convert by walking TorchTitan's model config (its `traverse` over Linear configs) with the same
keep_high_precision patterns, and refuses to build if that model's Linear layers differ from the
per-family rule `linear_layers`, so the converted-layer list a run logs is the one validated here.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase

from runner.estimate import flops
from runner.schema import DeviceType, ExpertsPrecision, Fp8Recipe, ModelConfig, RunConfig


@dataclass(frozen=True)
class Requirement:
    min_sm: tuple[int, int]
    """Lowest CUDA compute capability with hardware GEMMs for the recipe."""
    hardware: str
    """The GPUs that have it, for messages."""
    divisor: int
    """Every GEMM dimension of a converted layer, after TP sharding, must be a multiple of this."""
    on_cpu: str
    """"real" (torch._scaled_mm has a CPU kernel), "emulated" (runner/run/titan/fp8_emulation.py) or "rejected"."""
    gpu_path: str
    """What runs on GPU."""
    token_pad: int = 0
    """Routed experts only: TorchTitan's converter swaps the MoE's token dispatcher for TorchAOTokenDispatcher, which
    pads each expert's token group to a multiple of this (the scaled grouped GEMM's alignment); 0 for Linear layers."""


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
    """TorchTitan's module name (the adapter checks these against its model config's traverse at build)."""
    in_dim: int
    out_dim: int
    tp_style: str
    """"colwise" (output dim sharded over TP), "rowwise" (input dim sharded) or "replicate" (whole on every TP rank)."""
    fp8_twin: bool = True
    """TorchTitan's plain Linear, which the FP8 recipes swap; False for gpt-oss's ScaledBiasRowwiseLinear (the
    attention output), whose bias is divided by the TP degree in its own forward: an FP8 Linear in its place would
    add the bias once per TP rank, so it stays in high precision."""


SCALED_BIAS = "scaled-bias rowwise Linear (TP divides its bias)"
"""The reason precision.json gives for a layer kept because it has no FP8 twin."""


def linear_layers(m: ModelConfig) -> list[LinearLayer]:
    """Every Linear of the TorchTitan model m describes, in its config's traverse order, by one rule for all
    families: the head, then per block the attention projections and the FFN (a dense SwiGLU, or in an MoE block
    the router gate and any shared experts; routed experts are grouped GEMMs, not Linear layers). Kimi's vision
    encoder is not built (the runner trains the text tower). tests/test_precision.py compares this with
    TorchTitan's traverse of every family's debug flavor."""
    out = [LinearLayer("lm_head", m.dim, m.vocab_size, "colwise")]
    for i in range(m.num_layers):
        out += _attention_linears(m, f"layers.{i}.attention") + _ffn_linears(m, i)
    last = f"layers.{m.num_layers - 1}."
    for k in range(m.num_mtp_layers):  # the MTP blocks: the last block's layers, then the projection of [embedding; hidden]
        ffn = [replace(la, fqn=la.fqn.replace(last, f"mtp_layers.{k}.", 1)) for la in _ffn_linears(m, m.num_layers - 1)]
        eh_proj = LinearLayer(f"mtp_layers.{k}.eh_proj", 2 * m.dim, m.dim, "replicate")
        out += [*_attention_linears(m, f"mtp_layers.{k}.attention"), *ffn, eh_proj]
    return out


def _attention_linears(m: ModelConfig, p: str) -> list[LinearLayer]:
    """GQA (Llama 3, Qwen3, gpt-oss): q, k, v in one fused projection, or wq and wkv (one config TorchTitan builds
    twice, as wk and wv), then the output projection (gpt-oss's carries a TP-scaled bias). MLA (DeepSeek-V3, Kimi):
    the query projection (direct, or down to q_lora_rank and up again), the joint key/value + RoPE-key
    down-projection, its up-projection and the output projection; the down-projections stay whole on every TP rank."""
    if not flops.is_mla(m):
        hd = flops.head_dim(m)
        q, kv = m.num_heads * hd, m.num_kv_heads * hd
        if m.fuse_qkv:
            qkv = [LinearLayer(f"{p}.qkv_linear.wqkv", m.dim, q + 2 * kv, "colwise")]
        else:
            qkv = [LinearLayer(f"{p}.qkv_linear.wq", m.dim, q, "colwise"), LinearLayer(f"{p}.qkv_linear.wkv", m.dim, kv, "colwise")]
        return [*qkv, LinearLayer(f"{p}.wo", q, m.dim, "rowwise", fp8_twin=not m.attention_bias)]
    qk = m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    if m.q_lora_rank == 0:
        query = [LinearLayer(f"{p}.wq", m.dim, qk, "colwise")]
    else:
        query = [LinearLayer(f"{p}.wq_a", m.dim, m.q_lora_rank, "replicate"), LinearLayer(f"{p}.wq_b", m.q_lora_rank, qk, "colwise")]
    return [
        *query,
        LinearLayer(f"{p}.wkv_a", m.dim, m.kv_lora_rank + m.qk_rope_head_dim, "replicate"),
        LinearLayer(f"{p}.wkv_b", m.kv_lora_rank, m.num_heads * (m.qk_nope_head_dim + m.v_head_dim), "colwise"),
        LinearLayer(f"{p}.wo", m.num_heads * m.v_head_dim, m.dim, "rowwise"),
    ]


def _ffn_linears(m: ModelConfig, i: int) -> list[LinearLayer]:
    if flops.is_moe(m) and i >= m.num_dense_layers:
        gate = LinearLayer(f"layers.{i}.moe.router.gate", m.dim, m.num_experts, "replicate")
        if m.num_shared_experts == 0:
            return [gate]
        return [gate, *_swiglu(f"layers.{i}.moe.shared_experts", m.dim, m.moe_hidden_dim * m.num_shared_experts)]
    return _swiglu(f"layers.{i}.feed_forward", m.dim, m.ffn_hidden_dim)


def _swiglu(p: str, dim: int, hidden: int) -> list[LinearLayer]:
    return [
        LinearLayer(f"{p}.w1", dim, hidden, "colwise"),
        LinearLayer(f"{p}.w2", hidden, dim, "rowwise"),
        LinearLayer(f"{p}.w3", dim, hidden, "colwise"),
    ]


EXPERT_RECIPES = {
    ExpertsPrecision.fp8_rowwise: Requirement(
        (8, 9),
        "NVIDIA SM 8.9+ (Ada L4/L40S, Hopper H100/H200)",
        16,
        "emulated",
        "TorchTitan Float8GroupedExpertsConverter (torchao float8 rowwise scaled grouped GEMMs)",
        16,
    ),
    ExpertsPrecision.mxfp8: Requirement(
        (10, 0),
        "NVIDIA SM 10.0+ (Blackwell B200/GB200)",
        32,
        "rejected",
        "TorchTitan MXFP8GroupedExpertsConverter (torchao MXFP8 scaled grouped GEMMs)",
        128,
    ),
}
"""The routed experts' FP8 recipes (precision.experts), as RECIPES for the Linear layers. The divisor is the GEMM
dims' (torchao's _Float8GroupedMM asserts K and N divisible by 16; MX scales 32-element blocks); token_pad is
TorchTitan's: Float8GroupedExpertsConverter.PAD_MULTIPLE (16), and 128 for MXFP8 as its deepseek_v3_debugmodel_mxfp8()
sets it (the CuTeDSL quantization kernel on SM 10.0 needs multiples of 128; its config's default, 32, does not)."""

GROUPED_EXPERTS = (
    "high precision: the FP8 recipe converts Linear layers only; the routed experts' grouped GEMMs stay in param_dtype "
    "(precision.experts=high; fp8_rowwise or mxfp8 convert them through TorchTitan's grouped-experts converters)"
)
"""What happens to an MoE model's routed experts under a Linear FP8 recipe with precision.experts=high."""


def expert_modules(m: ModelConfig) -> list[str]:
    """The routed experts' modules (TorchTitan's GroupedExperts FQNs), one per MoE block, in model order."""
    if not flops.is_moe(m):
        return []
    return [f"layers.{i}.moe.routed_experts.inner_experts" for i in range(m.num_dense_layers, m.num_layers)]


def converted_experts(cfg: RunConfig) -> list[str]:
    """The routed experts precision.experts converts to FP8 (precision.json's `experts.converted`)."""
    return [] if cfg.precision.experts == ExpertsPrecision.high else expert_modules(cfg.model)


def expert_gemm_dims(m: ModelConfig, tp: int, ep: int) -> list[tuple[int, int]]:
    """(K, N) of the experts' grouped GEMMs on one rank: w1 and w3 (dim -> hidden), w2 (hidden -> dim). Without EP,
    TP shards each expert's hidden dim; with EP the TP ranks split the tokens instead (runner/estimate/predict/work.py)."""
    h = m.moe_hidden_dim // (tp if ep == 1 else 1)
    return [(m.dim, h), (m.dim, h), (h, m.dim)]


def grouped_experts(cfg: RunConfig) -> str | None:
    """The routed experts' precision, in words; None for a dense model, or high precision with no FP8 anywhere."""
    e = cfg.precision.experts
    if not flops.is_moe(cfg.model) or (e == ExpertsPrecision.high and cfg.precision.fp8 == Fp8Recipe.none):
        return None
    if e == ExpertsPrecision.high:
        return GROUPED_EXPERTS
    req, n = EXPERT_RECIPES[e], len(expert_modules(cfg.model))
    where = (
        "EMULATED on CPU (float8 e4m3 casts with torchao's scales, grouped GEMM on the dequantized values in float32)"
        if cfg.cluster.device == DeviceType.cpu
        else f"{req.gpu_path}, token groups padded to {req.token_pad}"
    )
    return f"{e.value} in {n} MoE blocks: {where}"


def any_fp8(cfg: RunConfig) -> bool:
    """Whether anything runs in FP8: a Linear recipe, or routed experts converted (precision.json is then written)."""
    return cfg.precision.fp8 != Fp8Recipe.none or bool(converted_experts(cfg))


def kept_by(fqn: str, patterns: list[str]) -> str | None:
    """The first keep_high_precision pattern that matches a module name, or None."""
    return next((p for p in patterns if fnmatchcase(fqn, p)), None)


def by_pattern(fqns: Iterable[str]) -> str:
    """Module names summarised with their block index as `*` and a count, in first-seen order: `lm_head,
    layers.*.attention.wkv_a x61` (a 61-block model's 120 kept layers on one line, not 5,000 characters)."""
    kinds: dict[str, int] = {}
    for fqn in fqns:
        kind = ".".join("*" if part.isdigit() else part for part in fqn.split("."))
        kinds[kind] = kinds.get(kind, 0) + 1
    return ", ".join(f"{k} x{n}" if n > 1 else k for k, n in kinds.items())


def conversion(cfg: RunConfig) -> tuple[list[str], dict[str, str]]:
    """(Linear layers converted to FP8, {kept layer: the pattern that kept it, or SCALED_BIAS})."""
    if cfg.precision.fp8 == Fp8Recipe.none:
        return [], {}
    converted, kept = [], {}
    for layer in linear_layers(cfg.model):
        pattern = kept_by(layer.fqn, cfg.precision.keep_high_precision) or (None if layer.fp8_twin else SCALED_BIAS)
        if pattern is None:
            converted.append(layer.fqn)
        else:
            kept[layer.fqn] = pattern
    return converted, kept


def local_gemm_dims(layer: LinearLayer, tp: int) -> tuple[int, int]:
    """(in, out) of the weight shard one TP rank multiplies."""
    if layer.tp_style == "rowwise":
        return layer.in_dim // tp, layer.out_dim
    if layer.tp_style == "colwise":
        return layer.in_dim, layer.out_dim // tp
    return layer.in_dim, layer.out_dim


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


def mfu_peak(cfg: RunConfig, measured: bool = False) -> str:
    """The dtype whose dense peak `mfu` is measured against: param_dtype (bf16 on GPUs) whatever dtype the GEMMs run
    in, so that an FP8 run's MFU compares with a bf16 run's (TorchTitan prints N/A under FP8 for want of this,
    pytorch/torchtitan#2451); matmul_peak's dtype gives `mfu_of_gemm_peak`. Where the cluster states no peak for
    param_dtype: with `measured` (a run whose peaks are measured at launch: CPU) param_dtype's is measured beside the
    GEMMs' (a CPU FP8 run's float8 figure times torch._scaled_mm's CPU kernel, which can be a reference loop far
    slower than what the step runs: MFU against it passed 100 %); otherwise (the plan, search) the GEMMs' peak."""
    high = cfg.precision.param_dtype.value
    return high if measured or high in cfg.cluster.peak_tflops else matmul_peak(cfg)[0]


def without_fp8(cfg: RunConfig) -> RunConfig:
    """The same run with the FP8 recipe off and the routed experts in high precision: every layer in param_dtype (bf16
    on GPUs), what an FP8 plan's speed-up is measured against. A shallow copy (mode=search asks once per kept
    candidate), named after param_dtype."""
    p, out = copy.copy(cfg.precision), copy.copy(cfg)
    p.__dict__.update(name=p.param_dtype.value, fp8=Fp8Recipe.none, keep_high_precision=[], experts=ExpertsPrecision.high)
    out.precision = p
    return out


def parse_capability(text: str) -> tuple[int, int] | None:
    major, dot, minor = text.partition(".")
    if not (dot and major.isdigit() and minor.isdigit()):
        return None
    return int(major), int(minor)
