"""What an FP8 recipe costs beyond its GEMMs, per converted Linear layer, as the step-time predictor counts it.

Torch-free arithmetic. A converted Linear (runner/estimate/precision.py decides which) runs its three GEMMs (forward
y = x W, input gradient dx = dy W^T, weight gradient dW = x^T dy) at the FP8 rate of the recipe's kernel
(machine.Machine.fp8_gemm_s), except those the recipe keeps in high precision, and pays for:
- fp8_cast: the kernels that turn each of the GEMMs' three high-precision operands (x, W, dy) into float8 and their
  scales, with the transposed (or other-axis) copy the backward GEMMs need: memory traffic at the memory bandwidth;
- fp8_amax: tensorwise scaling's absolute-maximum reductions, one small all-reduce per operand over the TP group
  that shards it (rowwise, blockwise and MXFP8 scale tiles a rank holds whole: no collective).
Layers precision.keep_high_precision keeps (the output head by default) run at the bf16 rate as before. The routed
experts' grouped GEMMs follow precision.experts (EXPERT_COSTS: their own recipe, apart from the Linear layers').
FSDP's float8 all-gather is not priced: TorchTitan 0.3.0's Float8LinearConverter, which the runner uses, has no
option for it, so a converted weight is gathered in param_dtype and cast after the gather.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from runner.estimate import precision
from runner.estimate.predict.work import Gemm
from runner.schema import DeviceType, ExpertsPrecision, Fp8Recipe, RunConfig

GEMMS = ("forward", "input_grad", "weight_grad")


@dataclass(frozen=True)
class RecipeCost:
    """One recipe's kernels, each figure a named physical quantity."""

    gemm_efficiency: float
    """Share of the FP8 dense peak its large GEMMs reach, over the share bf16 GEMMs reach of theirs
    (cluster.matmul_efficiency): the scaling epilogue and, for blockwise, Triton kernels in place of cuBLAS."""
    high_precision_gemms: tuple[str, ...]
    """Which of GEMMS the recipe runs in param_dtype (torchao's rowwise_with_gw_hp keeps the weight gradient)."""
    cast_bytes: tuple[float, float]
    """(eager, training.compile) bytes moved per element of each operand (x, W, dy) over forward and backward:
    reading the bf16 tensor (2 B) for the scale and for the cast, writing each float8 layout (1 B), the scales."""
    amax_all_reduce: bool
    """The scale is one amax over the whole tensor: an all-reduce over the TP group per operand (tensorwise)."""
    peak: str
    """The cluster.peak_tflops entry its GEMMs run at."""
    staging_bytes: tuple[float, float]
    """(eager, training.compile) bytes per element a cast holds beside its float8 output while it runs: torchao's eager
    cast (float8_training_tensor._ToFloat8ConstrFunc) scales into an fp32 tensor and clamps it into another before the
    float8 conversion (4 + 4); compiled, and in the blockwise and MX kernels, one fused kernel writes float8 only."""
    scale_group: int | None
    """Elements of a row that share one scale along the GEMM's reduction axis: None one scale per tensor (tensorwise),
    0 one per row (rowwise), else one per that many (blockwise's 1 x 128 tiles, MXFP8's 32)."""
    scale_bytes: int
    """Bytes of one scale: fp32 (4), MXFP8's e8m0 exponent (1)."""

    def scales(self, rows: int, cols: int) -> float:
        """Bytes of the scales of a rows x cols float8 tensor scaled along its cols."""
        if self.scale_group is None:
            return float(self.scale_bytes)
        groups = 1 if self.scale_group == 0 else -(-cols // self.scale_group)
        return float(self.scale_bytes * rows * groups)


# Bytes per element, compiled: tensorwise reads the tensor once for its amax and once for the cast, which writes the
# float8 tensor and its transpose (2 + 2 + 1 + 1); rowwise and MXFP8 cast along each of the two axes the forward and
# the backward GEMMs scale by, each pass reading 2 B and writing 1 B (+ scales); blockwise the same with torchao's
# Triton quantization kernels, which torch.compile does not fuse, so eager costs as much. Eager tensorwise/rowwise
# (torchao's casts as separate ATen kernels: abs, amax, an fp32 multiply, clamp, the float8 conversion, the
# transpose): about 27 B per element per scaling axis pass, counted as 27 for tensorwise (one amax, one transpose)
# and 50 for the two-axis rowwise and MXFP8 casts.
COSTS = {
    Fp8Recipe.tensorwise: RecipeCost(0.90, (), (27.0, 6.0), True, "float8", (8.0, 0.0), None, 4),
    Fp8Recipe.rowwise: RecipeCost(0.75, (), (50.0, 6.0), False, "float8", (8.0, 0.0), 0, 4),
    Fp8Recipe.blockwise: RecipeCost(0.60, (), (6.1, 6.1), False, "float8", (0.0, 0.0), 128, 4),
    Fp8Recipe.mxfp8: RecipeCost(0.80, (), (50.0, 6.1), False, "mxfp8", (0.0, 0.0), 32, 1),
}
"""gemm_efficiency: tensorwise 0.90, the one figure fitted, on TorchTitan's Float8 rows of reference_runs.csv (0.80
left the 8B FSDP 8 speed-up at 1.18 against the published 1.28): cuBLAS's tensorwise FP8 GEMMs reach nearly the
share of their peak that bf16 GEMMs reach of theirs. The others are assumed, with no published run here to fit:
rowwise 0.75 (the per-row scaling epilogue), blockwise 0.60 (torchao's prototype Triton GEMMs), MXFP8 0.80 (B200)."""


EXPERT_COSTS = {
    ExpertsPrecision.fp8_rowwise: RecipeCost(0.75, (), (8.0, 8.0), False, "float8", (0.0, 0.0), 0, 4),
    ExpertsPrecision.mxfp8: RecipeCost(0.80, (), (6.1, 6.1), False, "mxfp8", (0.0, 0.0), 32, 1),
}
"""The routed experts' recipes (precision.experts), torchao's scaled grouped GEMMs. fp8_rowwise: torchao's
_Float8GroupedMM casts with fused Triton kernels whatever training.compile says (eager = compiled): x is cast rowwise
for the forward (read 2 B, write 1 B) and per group along the tokens for the weight gradient (two passes and a write:
5 B), W along each of two axes (5 + 5 B), dy like x (3 + 5 B): about 8 B per element; no staging beside the float8
output. gemm_efficiency as the Linear rowwise recipe (assumed: the grouped GEMM's per-expert tiles are the same
kernel family, no published grouped run to fit). mxfp8: as the Linear MXFP8 recipe compiled (torchao's grouped MX
casts are CUDA/CuTeDSL kernels in eager too)."""


def expert_cost(cfg: RunConfig) -> RecipeCost | None:
    """The experts' recipe on a CUDA cluster; None in high precision, and on CPU (the emulation runs float32 GEMMs)."""
    if cfg.cluster.device != DeviceType.cuda:
        return None
    return EXPERT_COSTS.get(cfg.precision.experts)


def expert_peak(cfg: RunConfig) -> float | None:
    """Dense peak TFLOP/s of the experts' FP8 GEMMs (cluster.peak_tflops[mxfp8] for MXFP8 where given, else [float8])."""
    c, r = cfg.cluster, EXPERT_COSTS[cfg.precision.experts]
    return c.peak_tflops.get(r.peak) or c.peak_tflops.get("float8")


def cost(cfg: RunConfig) -> RecipeCost | None:
    """The recipe's kernels on a CUDA cluster; None without FP8, and on CPU, whose FP8 GEMMs (torch._scaled_mm, or the
    blockwise emulation in float32) a machine profile times in the run's own dtype."""
    if cfg.cluster.device != DeviceType.cuda:
        return None
    return COSTS.get(cfg.precision.fp8)


def peak(cfg: RunConfig) -> float | None:
    """Dense peak TFLOP/s of the recipe's GEMMs: cluster.peak_tflops[mxfp8] for MXFP8 where the datasheet has it
    (B200: the float8 figure), else [float8]."""
    c, r = cfg.cluster, COSTS[cfg.precision.fp8]
    return c.peak_tflops.get(r.peak) or c.peak_tflops.get("float8")


_LAYERS: dict[tuple, tuple[Counter, Counter]] = {}
"""block_layers' answers by what they depend on: mode=search prices and sizes thousands of candidates of one model,
and walking every layer's keep_high_precision patterns each time made an FP8 search 17 (time) to 30 (memory) times
slower than a bf16 one."""


def block_layers(cfg: RunConfig, tp: int) -> tuple[Counter, Counter]:
    """(converted, kept) Linear layers of all blocks on one TP rank, counted by (is w2, K, N): its weight shard's in and
    out dims and whether it is an FFN's w2. TorchTitan builds a GQA model's `wkv` config twice (wk and wv): two of its
    shape. The head is not a block's. Cached (_LAYERS); the counters are shared, read them only."""
    model = tuple(v for v in vars(cfg.model).values() if not isinstance(v, dict))  # init_record: provenance, not shape
    key = (model, tuple(cfg.precision.keep_high_precision), cfg.precision.fp8, tp)
    found = _LAYERS.get(key)
    if found is None:
        if len(_LAYERS) >= 1024:
            _LAYERS.clear()
        converted = set(precision.conversion(cfg)[0])
        conv, kept = Counter(), Counter()
        for layer in precision.linear_layers(cfg.model):
            if layer.fqn.startswith("layers."):
                k, n = precision.local_gemm_dims(layer, tp)
                times = 2 if layer.fqn.endswith(".wkv") else 1
                (conv if layer.fqn in converted else kept)[(layer.fqn.endswith(".w2"), k, n)] += times
        found = _LAYERS[key] = (conv, kept)
    return found


def linear_gemms(cfg: RunConfig, tp: int, tokens: int) -> tuple[Counter[Gemm], Counter[Gemm]]:
    """(converted, kept) forward GEMMs (M tokens, K, N) of all blocks' Linear layers on one rank for one microbatch,
    counted by shape."""
    out: tuple[Counter[Gemm], Counter[Gemm]] = (Counter(), Counter())
    for layers, gemms in zip(block_layers(cfg, tp), out, strict=True):
        for (_, k, n), times in layers.items():
            gemms[(tokens, k, n)] += times
    return out


def cast_elements(g: Gemm) -> tuple[float, float, float]:
    """Elements of x (M x K), W (K x N) and dy (M x N) of one converted forward GEMM (M, K, N)."""
    m, k, n = g
    return float(m * k), float(k * n), float(m * n)


def backward_transient_bytes(cfg: RunConfig, tp: int, tokens: int) -> tuple[float, float]:
    """Bytes an FP8 recipe holds beyond param_dtype's inside a block's backward, on any device (the CPU dry run runs
    torchao's own casts), as (at the FFN's second Linear w2, whose backward runs first, before any FFN weight has a
    gradient; at the largest of the other converted Linear layers): each the largest backward_bytes of its layers.

    Nothing else changes in memory (torchao 0.18, read in float8/float8_linear.py and the blockwise and MX linears):
    each converted Linear saves its high-precision input and weight for backward, as nn.Linear does, so activations are
    those of param_dtype; dynamic scaling keeps no amax history or other buffer; and the float8 copies of the weights
    are cast per GEMM and dropped, since FSDP's float8 all-gather (float8 weight shards) is off in TorchTitan 0.3.0."""
    if cfg.precision.fp8 == Fp8Recipe.none:
        return 0.0, 0.0
    recipe = COSTS[cfg.precision.fp8]
    staging = recipe.staging_bytes[1 if cfg.training.compile else 0]
    first = later = 0.0
    for w2, k, n in block_layers(cfg, tp)[0]:
        b = backward_bytes(recipe, (tokens, k, n), staging)
        first, later = (max(first, b), later) if w2 else (first, max(later, b))
    return first, later


def backward_bytes(recipe: RecipeCost, g: Gemm, staging: float) -> float:
    """A converted Linear's backward (M tokens, K in, N out) at its last cast: the float8 dy scaled for the input
    gradient (M x N) and the float8 weight for it (K x N) still held by the backward's locals, dy again scaled along
    the tokens for the weight gradient (N x M), and the input being cast for it (K x M): its float8 output beside the
    cast's staging, with every tensor's scales."""
    m, k, n = g
    held = 2 * m * n + k * n + recipe.scales(m, n) + recipe.scales(k, n) + recipe.scales(n, m)
    return held + m * k * (1 + staging) + recipe.scales(k, m)
