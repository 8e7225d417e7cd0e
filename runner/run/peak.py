"""Dense peak FLOP/s of the device: from the cluster config, or measured on CPU."""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import time
from pathlib import Path

import torch

from runner.config import precision, runfiles
from runner.config.schema import DeviceType, RunConfig

# Matrix size per dtype: fp32 reaches its plateau at 1024; bf16 on AVX2-only CPUs runs
# ~200x slower, so a smaller matrix keeps the measurement under a second.
_SIZE = {"float32": 1024, "bfloat16": 256, "float8": 1024}


def _matmul(dtype_name: str, n: int):
    """A square matmul in the dtype; float8 is torch._scaled_mm on e4m3 operands (what torchao's
    tensorwise/rowwise Float8Linear calls), with a float32 output."""
    if dtype_name == "float8":
        a = torch.randn(n, n).to(torch.float8_e4m3fn)
        b = torch.randn(n, n).to(torch.float8_e4m3fn).t()
        one = torch.ones(())
        return lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.float32)
    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return lambda: torch.mm(a, b)


def measure_cpu_tflops(dtype_name: str, reps: int = 5) -> float:
    """Best matmul rate of the whole machine (all cores) in TFLOP/s, measured in a child process.

    The caller is the elastic agent, which may fork the ranks (cluster.worker_start=fork): a
    process that has run an OpenMP parallel region must not fork a child that runs one (GNU
    OpenMP then deadlocks the child in its first multi-threaded op), so the agent never does.
    """
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        return pool.submit(_measure, dtype_name, reps).result()


def _measure(dtype_name: str, reps: int) -> float:
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        n = _SIZE[dtype_name]
        mm = _matmul(dtype_name, n)
        mm()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            mm()
            best = min(best, time.perf_counter() - t0)
        return 2 * n**3 / best / 1e12
    finally:
        torch.set_num_threads(threads)


def source(cfg: RunConfig) -> str:
    """ "config" when the cluster declares the peak of the matmul dtype, else "measured"."""
    return "config" if precision.matmul_peak(cfg)[0] in cfg.cluster.peak_tflops else "measured"


def peak(cfg: RunConfig, world_size: int) -> tuple[float, float]:
    """(peak TFLOP/s per device, peak FLOP/s of the whole job).

    On CPU the ranks of a node share one machine, so the "device" is the node.
    """
    dtype = precision.matmul_peak(cfg)[0]
    devices = cfg.cluster.num_nodes if cfg.cluster.device == DeviceType.cpu else world_size
    if source(cfg) == "measured":  # validation allows a missing peak on CPU only
        tflops = measure_cpu_tflops(dtype)
    else:
        tflops = cfg.cluster.peak_tflops[dtype]
    return tflops, tflops * 1e12 * devices




def write(cfg: RunConfig, world_size: int, run_dir: Path) -> dict:
    """Decide the peak once per run (measuring before any rank starts) and record it."""
    tflops, total = peak(cfg, world_size)
    rec = {
        "peak_tflops": tflops,
        "peak_flops_total": total,
        "peak_source": source(cfg),
        "dtype": precision.matmul_peak(cfg)[0],
        "emulated": precision.matmul_peak(cfg)[1],
        "fp8": cfg.precision.fp8.value,
        "device": cfg.cluster.device.value,
    }
    if rec["peak_source"] == "measured":
        op = "torch._scaled_mm (e4m3)" if rec["dtype"] == "float8" else "torch.mm"
        rec["method"] = f"best of 5 square {op} n={_SIZE[rec['dtype']]} on {os.cpu_count()} threads"
    (run_dir / runfiles.PEAK).write_text(json.dumps(rec, indent=2) + "\n")
    return rec


def read(run_dir: Path) -> dict:
    return json.loads((run_dir / runfiles.PEAK).read_text())
