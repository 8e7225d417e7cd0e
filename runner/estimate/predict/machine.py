"""The machine as the step-time predictor sees it: a few named constants, each with a physical meaning.

Two sources. A machine profile (JSON written by `python -m runner.calibrate`, given as
`cluster.profile`) holds what was measured on the machine itself: GEMM throughput at the model's
per-rank shapes and thread count, the attention kernel's rate, memory bandwidth, latency and
bandwidth of each collective per group size on the backend, and the stack's fixed costs. Without
one, the cluster's datasheet figures are used with the constants below, which describe TorchTitan
in eager mode on NVIDIA GPUs; ATTENTION_VS_MATMUL, the two bytes-per-element figures and
LINK_EFFICIENCY were chosen on a grid (0.45-0.75, 40-80, 16-32, 0.7-0.9) to minimise the squared log
error over the `fit` rows of runner/calibrate/reference_runs.csv (TorchTitan's published runs),
never the `heldout` ones. Such predictions are labelled "datasheet, not calibrated".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from runner.formats.user_files import parse_json
from runner.schema import RunConfig

DATASHEET = "datasheet, not calibrated"
PROFILE_KIND = "runner machine profile"
PROFILE_VERSION = 2  # 2: collective_fixed_s, in_run_share; memory_gbs from the block's own kernels

# Constants of the datasheet model (GPU, NCCL, TorchTitan eager), each with its physical meaning.
GEMM_HALF_DIM = 96.0
"""GEMM size (its smallest of M, K, N) at which the rate falls to half the large-GEMM rate: tile and wave quantization."""
FP8_GEMM_HALF_DIM = 192.0
"""The same for FP8 GEMMs: Hopper's float8 MMA takes a K step twice bf16's (32 against 16) and tiles twice as deep, so a
small GEMM (a TP-sharded projection) reaches less of its peak and gains less from FP8."""
ATTENTION_VS_MATMUL = 0.55
"""Rate of the fused attention kernel (forward + backward, causal FLOPs) over the large-GEMM rate."""
EAGER_BYTES_PER_ELEMENT = 50.0
"""Bytes the eager elementwise kernels (norms, RoPE, SwiGLU, residuals) move per activation element, forward + backward."""
COMPILED_BYTES_PER_ELEMENT = 32.0
"""The same with torch.compile, whose fused kernels read and write each element fewer times."""
ADAMW_BYTES_PER_PARAM = 32.0
"""Bytes AdamW and gradient clipping move per local fp32 parameter (read p, g, m, v; write p, m, v; the norm reads g)."""
LINK_EFFICIENCY = 0.90
"""Bandwidth NCCL's ring collectives reach over the datasheet figure (per direction)."""
COLLECTIVE_LATENCY_S = 30e-6
"""Fixed cost of one NCCL collective (launch and ring set-up)."""
REFERENCE_ERROR = 0.067
"""Root mean square of predicted / measured - 1 over the modelled rows of reference_runs.csv (fit and heldout): the
datasheet model's error band, inside which mode=search cannot order two candidates. A figure of the rows, kept here
because pricing them takes seconds (a Hydra composition each); tests/test_predictor.py checks it against them."""

OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


@dataclass(frozen=True)
class Link:
    latency_s: float
    """Fixed seconds of one call."""
    gbs: float
    """Bytes each rank sends per second / 1e9 (ring volumes: all-reduce 2(n-1)/n, gather/scatter (n-1)/n of the tensor)."""

    def seconds(self, sent_bytes: float) -> float:
        return self.latency_s + sent_bytes / (self.gbs * 1e9) if sent_bytes > 0 else 0.0


@dataclass(frozen=True)
class Machine:
    """What one rank can do, from a profile or a datasheet."""

    matmul_tflops: float
    """Rate of large GEMMs in the compute dtype, per rank."""
    memory_gbs: float
    """Memory bandwidth per rank for the elementwise kernels' roofline, GB/s."""
    bytes_per_element: float
    """See EAGER_BYTES_PER_ELEMENT."""
    attention_tflops: float
    """Rate of the attention kernel on the causal FLOPs it computes."""
    links: dict[str, dict[str, Link]]
    """Link per {"intra-node", "scale-out"} -> op; a profile's are measured, keyed "<op>" for its group size 2 and "<op>@<n>" per size."""
    gemm_half_dim: float = GEMM_HALF_DIM
    gemm_table: dict[tuple[int, int, int], float] = field(default_factory=dict)
    """Measured TFLOP/s at (M, K, N); GEMMs not in it use matmul_tflops and gemm_half_dim."""
    layer_overhead_s: float = 0.0
    """Fixed seconds per transformer block per pass (forward or backward): kernel dispatch not hidden behind work."""
    collective_fixed_s: float | None = None
    """Fixed seconds of one collective inside a training step with this many ranks running (its launch and latency,
    and waiting for peers that are still computing or waiting for a core), measured in real runs (a profile); when
    set it replaces the links' latency, fitted over 64 KiB-4 MiB by a microbenchmark whose ranks do nothing else,
    for every collective."""
    comm_overlap: float = 1.0
    """Share of FSDP/DP traffic that runs while the rank computes (a GPU's separate stream: 1)."""
    cpu_share: float = 1.0
    """Ranks per core set: > 1 when the ranks oversubscribe the machine's cores (CPU), which stretches compute."""
    calibrated: bool = False
    source: str = DATASHEET
    fp8_tflops: float | None = None
    """Rate of large GEMMs of the FP8 recipe's kernel, per rank; None: no FP8 model (no FP8 recipe, or a machine profile,
    whose GEMMs are timed in the run's own dtype)."""
    fp8_half_dim: float = FP8_GEMM_HALF_DIM
    expert_fp8_tflops: float | None = None
    """Rate of large grouped GEMMs of the routed experts' FP8 recipe (precision.experts), per rank; None: not in FP8,
    or no FP8 model (a machine profile)."""

    def fp8_gemm_s(self, g: tuple[int, int, int], rate: float | None = None) -> float:
        """Seconds of one FP8 GEMM at the Linear recipe's rate, or at `rate` (the experts')."""
        d = min(g)
        return 2.0 * g[0] * g[1] * g[2] / ((rate or self.fp8_tflops) * d / (d + self.fp8_half_dim) * 1e12)

    def gemm_s(self, g: tuple[int, int, int]) -> float:
        rate = self.gemm_table.get(g)
        if rate is None:
            d = min(g)
            rate = self.matmul_tflops * d / (d + self.gemm_half_dim)
        return 2.0 * g[0] * g[1] * g[2] / (rate * 1e12)

    def link(self, kind: str, op: str, group: int) -> Link:
        table = self.links[kind]
        return table.get(f"{op}@{group}") or table[op]


def _datasheet_links(cfg: RunConfig, link_gbs: dict[str, float] | None) -> dict[str, dict[str, Link]]:
    c = cfg.cluster
    gbs_of = link_gbs or {"intra-node": c.intra_node_bandwidth_gbs, "scale-out": c.inter_node_bandwidth_gbs}
    return {kind: {op: Link(COLLECTIVE_LATENCY_S, g / 2 * LINK_EFFICIENCY) for op in OPS} for kind, g in gbs_of.items() if g > 0}


def datasheet(cfg: RunConfig, peak_tflops: float | None, link_gbs: dict[str, float] | None, efficiency: float | None) -> Machine | None:
    """The cluster's figures with the GPU constants above (a link of unknown bandwidth left out); None without a peak.
    The GEMMs, attention and the layers kept in high precision run at the param_dtype peak; an FP8 recipe's converted
    GEMMs at its peak (float8, or mxfp8) x the recipe's efficiency (runner/estimate/predict/fp8_cost.py). `peak_tflops`
    overrides the peak of the dtype MFU's GEMM figure names (precision.matmul_peak: float8 under FP8)."""
    from runner.estimate.predict import fp8_cost as fp8

    c = cfg.cluster
    eff = efficiency if efficiency is not None else c.matmul_efficiency
    recipe = fp8.cost(cfg)
    high = c.peak_tflops.get(cfg.precision.param_dtype.value) if recipe else peak_tflops
    high = high if high is not None else c.peak_tflops.get(cfg.precision.param_dtype.value)
    links = _datasheet_links(cfg, link_gbs)
    if not high:
        return None
    fp8_rate = None
    if recipe:
        low = peak_tflops if peak_tflops is not None else fp8.peak(cfg)
        if not low:
            return None
        fp8_rate = low * eff * recipe.gemm_efficiency
    experts = fp8.expert_cost(cfg)
    expert_low = fp8.expert_peak(cfg) if experts else None
    expert_rate = expert_low * eff * experts.gemm_efficiency if experts and expert_low else None
    rate = high * eff
    bpe = COMPILED_BYTES_PER_ELEMENT if cfg.training.compile else EAGER_BYTES_PER_ELEMENT
    memory = c.memory_bandwidth_gbs if c.memory_bandwidth_gbs > 0 else math.inf
    return Machine(rate, memory, bpe, rate * ATTENTION_VS_MATMUL, links, fp8_tflops=fp8_rate, expert_fp8_tflops=expert_rate)


def load(path: str | Path) -> dict:
    """The profile's JSON; ValueError naming the path when it is not a runner profile."""
    data = parse_json(Path(path).expanduser().read_bytes(), path, "write one with `python -m runner.calibrate`")  # OSError, or a ValueError
    if data.get("kind") != PROFILE_KIND or data.get("version") != PROFILE_VERSION:
        raise ValueError(f"{path} is not a {PROFILE_KIND} (version {PROFILE_VERSION}); write one with python -m runner.calibrate")
    return data
