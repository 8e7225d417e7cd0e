"""`python -m runner.calibrate`: measure this machine once and write the predictor's profile.

What it measures (runner/estimate/predict/machine_profile.py describes the file):
- GEMMs at the per-rank shapes the given model(s) use under every TP/CP degree that fits the rank
  counts, forward + backward, with the threads each rank gets (runner/run/procs.threads_per_rank),
  in as many processes side by side as keep the cores busy, on operands cycled through more memory
  than the caches hold (a run's weights and activations come from memory, next to other ranks); rank
  counts whose ranks get the same threads and neighbours are measured once, together;
- the attention kernel (SDPA, causal) and the block's elementwise kernels (norms, RoPE, SwiGLU) at the
  same shapes and threads;
- collectives (all-reduce, all-gather, reduce-scatter, send/recv) per group size with 2 and 4 ranks
  running, on the cluster's backend with torch's own ops, fitted as latency + bytes / bandwidth;
- the stack's fixed costs, fitted from short real runs (Hydra multirun of the runner itself): the cost
  per transformer block pass from runs that differ only in their number of blocks, the cost per DTensor
  collective from the same runs with TP 2;
- per rank count, the share of the timed kernels' rate a rank reaches inside a training step, and the
  fixed cost of a collective inside a step, from short runs of the calibrated model in one multirun:
  1 rank; a 2-stage pipeline and TP 2 on 2 ranks; a 2-stage pipeline with FSDP over the rest on 4 ... ranks;
- the residuals: every one of those runs predicted by the finished profile, whose RMS error is the predictor's
  error band on this machine (mode=search groups candidates closer than it into one tier).
The profile goes to --out and, on CPU, a copy into cluster.peak_cache_dir for runs without cluster.profile.
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

from runner.calibrate import runs as calibrate_runs
from runner.estimate import flops
from runner.estimate.predict import machine as steptime_machine
from runner.estimate.predict import machine_profile as steptime_profile
from runner.estimate.predict import steptime
from runner.estimate.predict import work as steptime_work
from runner.run import peak, procs
from runner.run.peak import cpu_model
from runner.schema import RunConfig
from runner.schema.layout import Layout

SIZES_BYTES = (1 << 16, 1 << 20, 1 << 22)  # collective sizes: latency-bound to bandwidth-bound
QUICK_SIZES_BYTES = (1 << 16, 1 << 22)


MIN_WINDOW_S = 0.25  # each figure times at least this long: a shared machine's slow spells last tens of ms
WORKING_SET_BYTES = 16 << 20  # operands cycle through this much memory, so they come from L3 or DRAM, as in a run


def timeit(fn, reps: int, min_s: float = 0.0) -> float:
    """Median seconds of `fn` over at least `reps` calls and `min_s` seconds, after two warm-up calls."""
    fn(), fn()
    times: list[float] = []
    while len(times) < reps or sum(times) < min_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cycled(make, one_set_bytes: int):
    """Copies of the operands `make()` returns, enough to fill WORKING_SET_BYTES, and a function giving the next."""
    sets = [make() for _ in range(max(1, min(64, WORKING_SET_BYTES // max(one_set_bytes, 1))))]
    state = {"i": 0}

    def take():
        state["i"] = (state["i"] + 1) % len(sets)
        return sets[state["i"]]

    return take


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
    size = (m * k + n * k + m * n) * 2 * torch.finfo(dtype).bits // 8  # operands and their gradients

    def make():
        x, w = torch.randn(m, k, dtype=dtype, requires_grad=True), torch.randn(n, k, dtype=dtype, requires_grad=True)
        return x, w, torch.randn(m, n, dtype=dtype)

    take = _cycled(make, size)

    def step():
        x, w, g = take()
        F.linear(x, w).backward(g)
        x.grad = w.grad = None

    return 6 * m * k * n / timeit(step, reps, MIN_WINDOW_S) / 1e12


def _attention_tflops(shape: tuple[int, int, int, int], dtype: torch.dtype, reps: int) -> float:
    b, h, s, hd = shape
    q, k, v = (torch.randn(b, h, s, hd, dtype=dtype, requires_grad=True) for _ in range(3))
    g = torch.randn(b, h, s, hd, dtype=dtype)

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)
        q.grad = k.grad = v.grad = None

    causal_forward = 2 * b * h * s * s * 2 * hd / 2  # as steptime_work.block counts it
    return 3 * causal_forward / timeit(step, reps, MIN_WINDOW_S) / 1e12


def _elementwise_gbs(cfg: RunConfig, lay: Layout, dtype: torch.dtype, reps: int) -> float:
    """The block's elementwise kernels at one rank's shapes (two RMSNorms and residual adds on the hidden
    state, RoPE on the queries and keys, SwiGLU's gate), forward + backward, as the bandwidth that makes
    the predictor's count of their bytes (steptime_work.block's elements) take the measured time. Small
    activations stay in cache and threads help unevenly, so a large-array copy rate would mislead."""
    m, n = cfg.model, steptime_work.tokens(cfg, lay)
    hd = flops.head_dim(m)
    dim = m.dim // (lay.tp if cfg.parallelism.sequence_parallel else 1)
    heads, kv = m.num_heads // lay.tp, m.num_kv_heads // lay.tp
    ffn = (m.moe_hidden_dim * m.num_experts_per_token if flops.is_moe(m) else m.ffn_hidden_dim) // lay.tp

    def leaf(*shape):
        return torch.randn(*shape, dtype=dtype, requires_grad=True)

    x, w, q, k, a, b = leaf(n, dim), leaf(dim), leaf(n, heads, hd // 2, 2), leaf(n, kv, hd // 2, 2), leaf(n, ffn), leaf(n, ffn)
    rope = torch.polar(torch.ones(n, 1, hd // 2), torch.randn(n, 1, hd // 2))  # complex64: TorchTitan's RoPE runs in fp32

    def step():
        h = x + F.rms_norm(x, (dim,), w)
        h = h + F.rms_norm(h, (dim,), w)
        rq = torch.view_as_real(torch.view_as_complex(q.float()) * rope)
        rk = torch.view_as_real(torch.view_as_complex(k.float()) * rope)
        (h.sum() + rq.sum() + rk.sum() + (F.silu(a) * b).sum()).backward()
        for t in (x, w, q, k, a, b):
            t.grad = None

    per_element = steptime.element_bytes(cfg.precision.param_dtype.value, steptime_machine.EAGER_BYTES_PER_ELEMENT)
    moved = steptime_work.block(cfg, lay).elements * per_element
    return moved / timeit(step, reps, MIN_WINDOW_S) / 1e9


def _figures(cfgs: list[RunConfig], counts: list[int], dtype: torch.dtype, reps: int) -> dict[str, Any]:
    """One rank's GEMM rate per shape, attention rate and elementwise bandwidth, with the threads a rank of a
    job of counts[0] ranks gets, at the shapes of every rank count in `counts` (all get those threads)."""
    torch.set_num_threads(procs.threads_per_rank(counts[0]))
    found = [shapes(cfgs, n) for n in counts]
    gemm_shapes, attn_shapes = set().union(*(g for g, _ in found)), set().union(*(a for _, a in found))
    lays = list(dict.fromkeys(lay for n in counts for lay in _layouts(n)))
    return {
        "gemms": [[*g, _gemm_tflops(g, dtype, reps)] for g in sorted(gemm_shapes)],
        "attention_tflops": statistics.median(_attention_tflops(a, dtype, reps) for a in sorted(attn_shapes)),
        "memory_gbs": statistics.median(_elementwise_gbs(cfg, lay, dtype, reps) for cfg in cfgs for lay in lays),
    }


def _figures_worker(start, queue, cfgs, counts: list[int], dtype: torch.dtype, reps: int) -> None:
    start.wait()
    queue.put(_figures(cfgs, counts, dtype, reps))


def _collect(queue, workers) -> list[dict[str, Any]]:
    """Every worker's figures; RuntimeError as soon as one of them died without its answer."""
    import queue as queues

    found: list[dict[str, Any]] = []
    while len(found) < len(workers):
        try:
            found.append(queue.get(timeout=2))
        except queues.Empty:
            if any(w.exitcode not in (None, 0) for w in workers):
                raise RuntimeError("a measuring process died: " + ", ".join(f"exit code {w.exitcode}" for w in workers)) from None
    return found


def busy_ranks(ranks: int) -> int:
    """Ranks measured side by side for a job of `ranks` ranks: as many as keep every core busy, as in the job
    (more would only time-slice; the predictor's cpu_share stretches for that)."""
    return max(1, min(ranks, (os.cpu_count() or 1) // procs.threads_per_rank(ranks)))


def conditions(rank_counts: list[int]) -> dict[tuple[int, int], list[int]]:
    """Rank counts by what a rank's kernels are timed with: (threads per rank, processes side by side). Counts
    that share both (2 and 4 ranks on 2 cores: 1 thread, 2 processes) are measured once, over the shapes of all
    of them, and get the same figures: measured apart, they differed by up to 12 % on the same GEMM, which the
    predictor then read as a difference between the layouts."""
    out: dict[tuple[int, int], list[int]] = {}
    for n in rank_counts:
        out.setdefault((procs.threads_per_rank(n), busy_ranks(n)), []).append(n)
    return out


def by_ranks(cfgs: list[RunConfig], rank_counts: list[int], dtype: torch.dtype, reps: int) -> dict[str, Any]:
    """The compute figures of one rank, for every rank count (threads per rank differ), measured with the
    other ranks' processes measuring the same shapes at the same time (shared caches, memory bandwidth and
    frequency, as in a run); each figure is the median over those processes."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = {}
    for (threads, side_by_side), counts in conditions(rank_counts).items():
        start, queue = ctx.Barrier(side_by_side), ctx.Queue()
        workers = [ctx.Process(target=_figures_worker, args=(start, queue, cfgs, counts, dtype, reps)) for _ in range(side_by_side)]
        for w in workers:
            w.start()
        found = _collect(queue, workers)
        for w in workers:
            w.join()
        gemms = [[*found[0]["gemms"][i][:3], statistics.median(f["gemms"][i][3] for f in found)] for i in range(len(found[0]["gemms"]))]
        figures = {
            "threads": threads,
            "measured_side_by_side": side_by_side,
            **steptime_profile.fit_gemm_rate(gemms),
            "gemms": gemms,
            "attention_tflops": statistics.median(f["attention_tflops"] for f in found),
            "memory_gbs": statistics.median(f["memory_gbs"] for f in found),
        }
        out.update({str(n): dict(figures) for n in counts})
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


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

    from runner.config import compose, validate

    args = _parse(sys.argv[1:] if argv is None else argv)
    base = args.overrides
    try:
        cfgs = [compose.compose(base)] + [compose.compose([*base, *v.split()]) for v in args.variant]
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
        profile["constants"], short = calibrate_runs.fixed_costs(profile, base, Path(tmp) / "fixed", quick=args.quick)
        console.print("short runs of the model (a pipeline and TP, on 2 ranks and with FSDP; 1 and 2 ranks at other shapes): in-run shares")
        shapes = {(c.model.dim, c.training.seq_len): v.split() for c, v in zip(cfgs[1:], args.variant, strict=True)}
        shapes.pop((cfgs[0].model.dim, cfgs[0].training.seq_len), None)  # a variant at the first shape has its shares
        found = calibrate_runs.in_run_shares(profile, base, rank_counts, Path(tmp) / "share", args.quick, shapes)
    shares, constants, fixed, profile["by_shape"], runs = found
    for n, share in shares.items():
        profile["by_ranks"][str(n)]["in_run_share"] = share
    for n, f in fixed.items():
        profile["by_ranks"][str(n)]["collective_fixed_s"] = f
    profile["constants"].update({k: steptime_profile.constant(k, v) for k, v in constants.items()})
    profile["residuals"] = calibrate_runs.residuals(profile, [*short, *runs])
    path = steptime_profile.write(profile, Path(args.out).expanduser())
    table = Table(title=f"machine profile {path}", title_justify="left")
    for col in ("figure", "value", "meaning"):
        table.add_column(col)
    for row in steptime_profile.describe(steptime_profile.sm.load(path)):
        table.add_row(*row)
    console.print(table)
    console.print(f"use it with: python -m runner ... cluster.profile={path.resolve()}")
    cached = peak.store_profile(cfgs[0].cluster.peak_cache_dir, path) if cfgs[0].cluster.device.value == "cpu" else None
    if cached:
        console.print(f"stored in the cache as {cached}: runs on this machine without cluster.profile use the newest one")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
