"""`python -m runner.calibrate`: measure this machine once and write the predictor's profile.

What it measures (runner/config/steptime_profile.py describes the file):
- GEMMs at the per-rank shapes the given model(s) use under every TP/CP degree that fits the rank
  counts, forward + backward, with the threads each rank gets (runner/run/procs.threads_per_rank);
- the attention kernel (SDPA, causal) and the elementwise memory bandwidth at those threads;
- collectives (all-reduce, all-gather, reduce-scatter, send/recv) per group size with 2 and 4 ranks
  running, on the cluster's backend with torch's own ops, fitted as latency + bytes / bandwidth;
- the stack's fixed costs, fitted from short real runs (Hydra multirun of the runner itself): the cost
  per transformer block pass from runs that differ only in their number of blocks, the cost per DTensor
  collective from the same runs with TP 2.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from runner.config import steptime_profile, steptime_work
from runner.config.layout import Layout
from runner.config.schema import RunConfig
from runner.run import calibrate_runs, procs
from runner.run.peak import cpu_model

SIZES_BYTES = (1 << 16, 1 << 20, 1 << 22)  # collective sizes: latency-bound to bandwidth-bound
QUICK_SIZES_BYTES = (1 << 16, 1 << 22)


def timeit(fn, reps: int) -> float:
    """Median seconds of `fn` over `reps` calls after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _layouts(ranks: int) -> list[Layout]:
    """The TP and CP degrees a job of `ranks` ranks can use (their GEMM and attention shapes)."""
    return [Layout(1, 1, 1, cp, tp) for tp in (1, 2, 4) for cp in (1, 2) if tp * cp <= max(ranks, 1) and ranks % (tp * cp) == 0]


def shapes(cfgs: list[RunConfig], ranks: int) -> tuple[set[tuple[int, int, int]], set[tuple[int, int, int, int]]]:
    """GEMM (M, K, N) and attention (batch, heads, seq, head_dim) shapes one rank of `ranks` computes."""
    gemms, attn = set(), set()
    for cfg in cfgs:
        for lay in _layouts(ranks):
            gemms |= set(steptime_work.block(cfg, lay).gemms) | {steptime_work.head_gemm(cfg, lay)}
            if lay.cp == 1:
                heads, seq, hd = steptime_work.block(cfg, lay).attention_shape
                attn.add((cfg.training.microbatch_size, heads, seq, hd))
    return gemms, attn


def _gemm_tflops(shape: tuple[int, int, int], dtype: torch.dtype, reps: int) -> float:
    m, k, n = shape
    x, w, g = (
        torch.randn(m, k, dtype=dtype, requires_grad=True),
        torch.randn(n, k, dtype=dtype, requires_grad=True),
        torch.randn(m, n, dtype=dtype),
    )

    def step():
        F.linear(x, w).backward(g)
        x.grad = w.grad = None

    return 6 * m * k * n / timeit(step, reps) / 1e12


def _attention_tflops(shape: tuple[int, int, int, int], dtype: torch.dtype, reps: int) -> float:
    b, h, s, hd = shape
    q, k, v = (torch.randn(b, h, s, hd, dtype=dtype, requires_grad=True) for _ in range(3))
    g = torch.randn(b, h, s, hd, dtype=dtype)

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)
        q.grad = k.grad = v.grad = None

    causal_forward = 2 * b * h * s * s * 2 * hd / 2  # as steptime_work.block counts it
    return 3 * causal_forward / timeit(step, reps) / 1e12


def _memory_gbs(dtype: torch.dtype, reps: int) -> float:
    """Elementwise bandwidth: forward + backward of a product of two 4M-element tensors (6 tensor passes)."""
    n = 1 << 22
    x, y, g = torch.randn(n, dtype=dtype, requires_grad=True), torch.randn(n, dtype=dtype), torch.randn(n, dtype=dtype)

    def step():
        (x * y).backward(g)
        x.grad = None

    return 6 * n * x.element_size() / timeit(step, reps) / 1e9


def by_ranks(cfgs: list[RunConfig], rank_counts: list[int], dtype: torch.dtype, reps: int) -> dict[str, Any]:
    """The compute figures of one rank, for every rank count (threads per rank differ)."""
    out = {}
    for n in rank_counts:
        threads = procs.threads_per_rank(n)
        torch.set_num_threads(threads)
        gemm_shapes, attn_shapes = shapes(cfgs, n)
        gemms = [[*g, _gemm_tflops(g, dtype, reps)] for g in sorted(gemm_shapes)]
        out[str(n)] = {
            "threads": threads,
            **steptime_profile.fit_gemm_rate(gemms),
            "gemms": gemms,
            "attention_tflops": statistics.median(_attention_tflops(a, dtype, reps) for a in sorted(attn_shapes)),
            "memory_gbs": _memory_gbs(dtype, reps),
        }
    return out


def machine_facts(cfg: RunConfig) -> dict[str, Any]:
    return {
        "cpu": cpu_model() or platform.processor(),
        "cores": os.cpu_count(),
        "device": cfg.cluster.device.value,
        "backend": cfg.cluster.backend.value,
        "torch": torch.__version__,
        "dtype": cfg.precision.param_dtype.value,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _rank_counts(text: str) -> list[int]:
    """--ranks: 1 and powers of two (pairs of ranks exchange in the send/recv measurement)."""
    try:
        counts = sorted({int(n) for n in text.split(",")})
    except ValueError:
        counts = []
    if not counts or any(n < 1 or n & (n - 1) for n in counts):
        raise ValueError(f"--ranks {text!r}: give rank counts that are 1 or powers of two, e.g. --ranks 1,2,4")
    return counts


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m runner.calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of the model and batch to measure (as for python -m runner)")
    ap.add_argument("--out", default="machine_profile.json", help="profile to write (give it to runs as cluster.profile=<path>)")
    ap.add_argument("--variant", action="append", default=[], help="more overrides whose shapes to measure too, e.g. 'model.dim=512'")
    ap.add_argument("--ranks", default="1,2,4", help="rank counts on this machine to measure, comma-separated")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and sizes (a smoke check, noisier)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    from runner.config import steptime_refs, validate

    args = _parse(sys.argv[1:] if argv is None else argv)
    base = args.overrides
    try:
        cfgs = [steptime_refs.compose(base)] + [steptime_refs.compose([*base, *v.split()]) for v in args.variant]
        rank_counts = _rank_counts(args.ranks)
        for cfg in cfgs:
            validate.check(cfg)
    except Exception as e:  # Hydra's override and composition errors, ConfigError, a bad --ranks: a message, no traceback
        print(f"python -m runner.calibrate: {e}", file=sys.stderr)
        return 2
    reps = 3 if args.quick else 7
    dtype = getattr(torch, cfgs[0].precision.param_dtype.value)
    console = Console(highlight=False, width=160)
    console.print(f"calibrating {cpu_model() or 'this machine'}: GEMMs, attention, memory for {rank_counts} ranks ...")
    profile: dict[str, Any] = {"machine": machine_facts(cfgs[0]), "by_ranks": by_ranks(cfgs, rank_counts, dtype, reps)}
    console.print("collectives ...")
    sizes = QUICK_SIZES_BYTES if args.quick else SIZES_BYTES
    profile["collectives"] = {str(n): calibrate_runs.collectives(cfgs[0], n, sizes, reps) for n in rank_counts if n > 1}
    console.print("short runs for the fixed costs ...")
    with tempfile.TemporaryDirectory() as tmp:
        profile["constants"] = calibrate_runs.fixed_costs(profile, base, Path(tmp), quick=args.quick)
    path = steptime_profile.write(profile, Path(args.out).expanduser())
    table = Table(title=f"machine profile {path}", title_justify="left")
    for col in ("figure", "value", "meaning"):
        table.add_column(col)
    for row in steptime_profile.describe(steptime_profile.sm.load(path)):
        table.add_row(*row)
    console.print(table)
    console.print(f"use it with: python -m runner ... cluster.profile={path.resolve()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
