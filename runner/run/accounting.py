"""What the step loop reports per step and per run: tokens/s, MFU/HFU against the run's peak, the summary.

Every figure comes from runner.estimate.flops (FLOPs per token, MFU, HFU) and the run's peak.json
(runner.run.peak), so the same conventions hold in metrics.jsonl, summary.json and the console.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from runner.estimate import flops, split_backward
from runner.schema import ActivationCheckpoint, RunConfig
from runner.schema.layout import Layout, label, resolve
from runner.schema.wording import count


@dataclass
class Accounting:
    """What MFU is measured against, recorded in summary.json."""

    peak_tflops: float
    peak_flops_total: float
    peak_source: str
    flops_per_token: int
    flops_per_token_6n: int
    peak_dtype: str
    """Dtype of the matmuls whose dense peak MFU uses (float8 for FP8 recipes on GPU)."""
    emulated: bool
    """The FP8 matmuls are emulated (CPU blockwise): MFU is against the float32 peak."""
    num_params: int
    """Parameters of the model that was built (TorchTitan's count, checked equal to runner.estimate.flops.num_params)."""
    peak_spread: float | None
    """(max - min) / median of the measured peak's rounds; None for a peak from the cluster config."""
    mfu_peak_tflops: float | None = None
    """Dense peak per device `mfu` is measured against: param_dtype's (bf16 on GPUs) for every precision
    (runner.estimate.precision.mfu_peak); `peak_tflops` is the GEMMs' dtype's, for `mfu_of_gemm_peak`. None: the same."""
    mfu_peak_flops_total: float | None = None
    mfu_dtype: str | None = None

    @property
    def mfu_total(self) -> float:
        """Peak FLOP/s of all devices that `mfu` divides by."""
        return self.mfu_peak_flops_total or self.peak_flops_total


def accounting(cfg: RunConfig, built, pk: dict) -> Accounting:
    """What MFU is measured against: the run's peak (peak.json) and TorchTitan's FLOPs per token and parameter
    count, from `built` (the adapter's Built model)."""
    return Accounting(
        pk["peak_tflops"],
        pk["peak_flops_total"],
        pk["peak_source"],
        built.flops_per_token,
        flops.flops_per_token(cfg.model, cfg.training.seq_len, "6N"),
        pk["dtype"],
        pk["emulated"],
        built.num_params,
        pk["peak_spread"],
        pk.get("mfu_peak_tflops", pk["peak_tflops"]),  # a peak.json written before mfu_peak: the GEMMs' peak
        pk.get("mfu_peak_flops_total", pk["peak_flops_total"]),
        pk.get("mfu_dtype", pk["dtype"]),
    )


class CompileClock:
    """Seconds torch.compile spends compiling (Dynamo's frames, the backward AOTAutograd compiles lazily at the first
    backward, recompilations) between two `take`s: TorchDynamo's compile start and end callbacks, which fire around the
    outermost compilation only."""

    def __init__(self) -> None:
        self.spent, self._since = 0.0, None

    def _start(self, _args) -> None:
        self._since = time.perf_counter()

    def _end(self, _args) -> None:
        if self._since is not None:
            self.spent += time.perf_counter() - self._since
            self._since = None

    def install(self) -> CompileClock:
        from torch._dynamo.callback import callback_handler  # private_api: torch_dynamo_compile_callbacks

        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)
        return self

    def remove(self) -> None:
        from torch._dynamo.callback import callback_handler  # private_api: torch_dynamo_compile_callbacks

        callback_handler.remove_start_callback(self._start)
        callback_handler.remove_end_callback(self._end)

    def take(self) -> float:
        """The compilation seconds since the last take."""
        spent, self.spent = self.spent, 0.0
        return spent


SLOW_FP8 = 10
"""An FP8 GEMM more than this many times slower than a float32 one of its size: a CPU whose FP8 kernel is a reference
loop (some Intel machines: ~250x); the run says so before its first step."""


def _about(seconds: float) -> str:
    return f"{seconds:.0f}" if seconds >= 10 else f"{seconds:.2g}"


def slow_fp8(cfg: RunConfig, acc: Accounting, pk: dict) -> str | None:
    """One line for rank 0 to print before the first step when peak.json's FP8-beside-float32 GEMM measurement (CPU FP8
    recipes that run torch._scaled_mm) finds FP8 more than SLOW_FP8 x slower; None otherwise. The step times are
    estimates: the model FLOPs per step at the measured FP8 rate (the run's peak), and at that rate x the slowdown."""
    m = pk.get("fp8_vs_fp32")  # only FP8 recipes on CPU measure it
    if m is None or m["slowdown"] <= SLOW_FP8:
        return None
    step_flops = acc.flops_per_token * cfg.training.global_batch_size * cfg.training.seq_len
    fp8_s = step_flops / acc.peak_flops_total
    return (
        f"WARNING: this CPU runs FP8 GEMMs {m['slowdown']:.0f}x slower than float32 (torch._scaled_mm "
        f"{m['float8_tflops'] * 1e3:.3g} vs torch.mm {m['float32_tflops'] * 1e3:.3g} GFLOP/s, n={m['size']}, "
        f"{count(m['threads'], 'thread')}): expect about {_about(fp8_s)} s a step (an estimate: {step_flops / 1e9:.3g} GFLOP "
        f"per step at the measured FP8 rate); precision=fp32 runs them in about {_about(fp8_s / m['slowdown'])} s"
    )


def hfu_factor(cfg: RunConfig) -> float:
    """Hardware FLOPs / model FLOPs of a run: activation checkpointing's recomputes, twice where a split backward runs
    them in its input and its weight pass."""
    t = cfg.training
    again = split_backward.recomputes_per_backward(cfg, resolve(cfg.parallelism, cfg.cluster))
    return flops.hfu_factor(cfg.model, t.activation_checkpoint, t.ac_layer_frequency, again)


def row(step: int, loss: float, grad_norm: float, dt: float, lr: float, cfg: RunConfig, acc: Accounting, memory_gb: float) -> dict:
    t = cfg.training
    tokens = t.global_batch_size * t.seq_len
    recomputes = t.activation_checkpoint != ActivationCheckpoint.none
    hfu = hfu_factor(cfg) if recomputes else None
    u = flops.utilisation(tokens, dt, acc.flops_per_token, acc.mfu_total, acc.peak_flops_total, hfu)
    out = {
        "step": step,
        "loss": loss,
        "grad_norm": grad_norm,
        "step_time_s": dt,
        "tokens_per_s": tokens / dt,
        "lr": lr,
        "mfu": u.mfu,
        "mfu_6n": flops.utilisation(tokens, dt, acc.flops_per_token_6n, acc.mfu_total).mfu,
        "mfu_of_gemm_peak": u.mfu_of_gemm_peak,
        "memory_gb": memory_gb,
    }
    if recomputes:
        out["hfu"] = u.hfu
    return out


def summarize(rows: list[dict[str, Any]], cfg: RunConfig, lay: Layout, acc: Accounting) -> dict[str, Any]:
    """Medians skip the first step (warm-up) when there is more than one, and the steps the profiler ran in
    (`"profiled": true`: it slows them) unless nothing else is left."""
    steady = [r for r in rows[1:] if not r.get("profiled")] or rows[1:] or rows
    out = {
        "final_loss": rows[-1]["loss"],
        "first_loss": rows[0]["loss"],
        "steps": len(rows),
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in steady),
        "step_time_s_median": statistics.median(r["step_time_s"] for r in steady),
        "mfu_median": statistics.median(r["mfu"] for r in steady),
        "mfu_6n_median": statistics.median(r["mfu_6n"] for r in steady),
        "mfu_of_gemm_peak_median": statistics.median(r.get("mfu_of_gemm_peak", r["mfu"]) for r in steady),
        "mfu_peak_tflops": acc.mfu_peak_tflops or acc.peak_tflops,
        "mfu_dtype": acc.mfu_dtype or acc.peak_dtype,
        "num_params": acc.num_params,
        "flop_convention": "titan",
        "flops_per_token": acc.flops_per_token,
        "flops_per_token_6n": acc.flops_per_token_6n,
        "peak_tflops": acc.peak_tflops,
        "peak_source": acc.peak_source,
        "peak_spread": acc.peak_spread,
        "peak_dtype": acc.peak_dtype,
        "fp8": cfg.precision.fp8.value,
        "fp8_emulated": acc.emulated,
        "world_size": lay.world_size,
        "layout": label(lay, cfg.parallelism),
        "preset": cfg.parallelism.name,
        "degrees": lay.describe(),
        "steps_profiled": sum(1 for r in rows if r.get("profiled")),
    }
    if "hfu" in rows[0]:
        out["hfu_median"] = statistics.median(r["hfu"] for r in steady)
    return out | moe_medians([r["moe"] for r in steady if "moe" in r] or [r["moe"] for r in rows if "moe" in r])


def moe_medians(windows: list[dict[str, Any]]) -> dict[str, float]:
    """MoE runs: the median over logged windows of the worst layer's max/mean and (with EP) busiest EP rank share
    (metrics.jsonl's `moe`, runner.observe.moe_load), for runner.compare."""
    out = {}
    if windows:
        out["moe_max_mean_median"] = statistics.median(max(w["max_mean"]) for w in windows)
    if windows and "ep_share" in windows[0]:
        out["moe_ep_share_median"] = statistics.median(max(w["ep_share"]) for w in windows)
    return out
