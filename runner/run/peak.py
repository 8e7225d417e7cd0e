"""Dense peak FLOP/s of the device: from the cluster config, or measured on CPU (and cached).

The CPU measurement (one rank's share of the node, as the ranks will run):
- threads: each rank gets cores // ranks-per-node OpenMP threads (the launcher's OMP_NUM_THREADS), so
  one share is measured with that many threads and the node's peak is the share's rate times the
  shares that run at once, min(ranks per node, cores // threads);
- size: square matmuls of growing size until the rate stops rising by PLATEAU_GAIN (or one matmul
  takes MAX_MATMUL_S): the size with the best rate is the plateau;
- rounds: ROUNDS rounds at that size, each the best of >= MIN_REPS matmuls (the fastest matmul of a
  round is the one no other process slowed); the peak is the median round, a round more than
  OUTLIER from it is refused, and `spread` = (max - min) / median of the rounds kept;
- FP8 beside float32: for an FP8 recipe that runs torch._scaled_mm on CPU, a float32 GEMM is timed beside an
  FP8 one at the FP8 plateau size (fp8_slowdown, kept with the FP8 figure): on some CPUs the FP8 kernel is a
  reference loop, hundreds of times slower than float32, and the run says so before its first step;
- cache: `<cluster.peak_cache_dir>/peak-<cpu model>-<dtype>.json`, keyed by the core count, torch
  version and thread layout, so runs on one machine share one figure instead of each drawing its own.
  A run checks the cached figure with a short round (check_round), unless it was measured or checked in
  the last CHECK_EVERY_S: a round more than OUTLIER faster means the figure was measured while other
  processes held the cores (it would put MFU above 100 %), so it is measured again and replaced.
- profiles: `python -m runner.calibrate` stores a copy of each machine profile it writes in the same folder
  (`profile-<cpu model>-<dtype>-<created>.json`); a CPU run without cluster.profile predicts its step time
  with the newest one measured on this machine (the same CPU model, core count and torch version).
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from runner.estimate import precision
from runner.estimate.predict import machine as steptime_machine
from runner.formats import runfiles
from runner.run.device import DevicePolicy
from runner.schema import RunConfig
from runner.schema.wording import count

SIZES = (128, 256, 512, 1024, 2048)
PLATEAU_GAIN = 0.05  # a size whose rate rises less than this over the previous one: the plateau is reached
MAX_MATMUL_S = 0.2  # stop growing once one matmul takes this long (bf16 on AVX2-only CPUs: ~200x slower than fp32)
ROUNDS = 5
MIN_REPS, MIN_ROUND_S = 8, 0.15  # matmuls per round: at least this many and this long
OUTLIER = 0.15  # a round more than 15 % from the median round is refused
CHECK_REPS, CHECK_MAX_SIZE = 3, 1024  # a cached figure's check round: about 0.1 s at 1 thread
CHECK_EVERY_S = 600  # a figure measured or checked this recently is not checked again (a sweep's runs start back to back)


def _matmul(dtype_name: str, n: int):
    """A square matmul in the dtype; float8 is torch._scaled_mm on e4m3 operands (what torchao's
    tensorwise/rowwise Float8Linear calls), with a float32 output."""
    if dtype_name == "float8":
        a = torch.randn(n, n).to(torch.float8_e4m3fn)
        b = torch.randn(n, n).to(torch.float8_e4m3fn).t()
        one = torch.ones(())
        # private_api: torch_scaled_mm
        return lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.float32)
    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return lambda: torch.mm(a, b)


def _round(mm, n: int) -> tuple[float, float]:
    """(best rate in TFLOP/s, seconds of one matmul at that rate) over >= MIN_REPS matmuls and >= MIN_ROUND_S."""
    best, reps, t_end = float("inf"), 0, time.perf_counter() + MIN_ROUND_S
    while reps < MIN_REPS or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        mm()
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return 2 * n**3 / best / 1e12, best


def robust(rounds: list[float]) -> dict[str, Any]:
    """Median of the rounds with those far from it refused, and the spread of the rest."""
    med = statistics.median(rounds)
    kept = [r for r in rounds if abs(r - med) <= OUTLIER * med]
    peak = statistics.median(kept)
    return {"tflops": peak, "spread": (max(kept) - min(kept)) / peak, "rounds": rounds, "refused": [r for r in rounds if r not in kept]}


def measure_share(dtype_name: str, threads: int) -> dict[str, Any]:
    """One rank's share: the plateau size, then ROUNDS rounds there (in this process, with `threads` threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best_n, best_rate = SIZES[0], 0.0
        for n in SIZES:
            mm = _matmul(dtype_name, n)
            mm()  # warm-up: allocation, kernel selection
            rate, seconds = _round(mm, n)
            rising = rate > best_rate * (1 + PLATEAU_GAIN)
            if rate > best_rate:
                best_n, best_rate = n, rate
            if not rising or seconds > MAX_MATMUL_S:
                break
        mm = _matmul(dtype_name, best_n)
        mm()
        return robust([_round(mm, best_n)[0] for _ in range(ROUNDS)]) | {"size": best_n, "threads": threads}
    finally:
        torch.set_num_threads(before)


def check_round(dtype_name: str, threads: int, n: int) -> float:
    """The cached figure's check: the best of CHECK_REPS matmuls at size min(n, CHECK_MAX_SIZE) with `threads`
    threads (a smaller size than the plateau rates no higher, so it only finds figures that are too low)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = min(n, CHECK_MAX_SIZE)
        mm = _matmul(dtype_name, n)
        mm()
        best = float("inf")
        for _ in range(CHECK_REPS):
            t0 = time.perf_counter()
            mm()
            best = min(best, time.perf_counter() - t0)
        return 2 * n**3 / best / 1e12
    finally:
        torch.set_num_threads(before)


def fp8_slowdown(threads: int, n: int) -> dict[str, Any]:
    """How many times slower an FP8 GEMM (torch._scaled_mm, e4m3) runs than a float32 one here, each the best of
    CHECK_REPS square GEMMs at size min(n, CHECK_MAX_SIZE) with `threads` threads."""
    fp8, fp32 = check_round("float8", threads, n), check_round("float32", threads, n)
    return {"size": min(n, CHECK_MAX_SIZE), "threads": threads, "float8_tflops": fp8, "float32_tflops": fp32, "slowdown": fp32 / fp8}


def _in_child(fn, *args):
    """fn(*args) in a forked child process.

    The caller is the elastic agent, which may fork the ranks (cluster.worker_start=fork): a
    process that has run an OpenMP parallel region must not fork a child that runs one (GNU
    OpenMP then deadlocks the child in its first multi-threaded op), so the agent never does."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        return pool.submit(fn, *args).result()


def layout(ranks_per_node: int) -> tuple[int, int]:
    """(threads per rank, shares running at once) as the launcher sets them: cores // ranks threads each."""
    cores = os.cpu_count() or 1
    threads = max(1, cores // ranks_per_node)
    return threads, min(ranks_per_node, cores // threads)


def measure_cpu(dtype_name: str, ranks_per_node: int) -> dict[str, Any]:
    """The node's peak from one rank's share, measured in a child process (_in_child)."""
    threads, shares = layout(ranks_per_node)
    share = _in_child(measure_share, dtype_name, threads)
    if dtype_name == "float8":
        share["fp8_vs_fp32"] = _in_child(fp8_slowdown, threads, share["size"])
    return share | {"shares": shares, "tflops": share["tflops"] * shares, "share_tflops": share["tflops"]}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux)."""
    info = Path("/proc/cpuinfo")
    if info.is_file():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    import platform

    return platform.processor() or platform.machine()


def _slug() -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", cpu_model()).strip("-") or "cpu"


def _cache_file(folder: str, dtype_name: str) -> Path:
    return Path(folder).expanduser() / f"peak-{_slug()}-{dtype_name}.json"


def _cache_key(ranks_per_node: int) -> str:
    threads, shares = layout(ranks_per_node)
    return f"{os.cpu_count()} cores, torch {torch.__version__}, {threads} threads x {shares} ranks"


def cpu_peak(cfg: RunConfig, dtype_name: str, ranks_per_node: int) -> dict[str, Any]:
    """The cached measurement for this machine, dtype and thread layout, if one check round does not beat it by
    more than OUTLIER; else (or when there is none) measured and cached."""
    folder = cfg.cluster.peak_cache_dir
    key = _cache_key(ranks_per_node)
    path = _cache_file(folder, dtype_name) if folder else None
    cached = json.loads(path.read_text()) if path and path.is_file() else {}
    replaced = {}
    complete = key in cached and (dtype_name != "float8" or "fp8_vs_fp32" in cached[key])  # older FP8 figures lack it
    if complete:
        old = cached[key]
        if time.time() - old.get("checked_s", 0.0) < CHECK_EVERY_S:
            return old | {"cache": str(path), "cached": True}
        check = _in_child(check_round, dtype_name, old["threads"], old["size"])
        if check <= old["share_tflops"] * (1 + OUTLIER):
            _store(path, cached | {key: old | {"checked_s": time.time(), "check_tflops": check}})
            return old | {"cache": str(path), "cached": True, "check_tflops": check}
        replaced = {"replaced": {"share_tflops": old["share_tflops"], "measured_at": old.get("measured_at"), "check_tflops": check}}
    rec = measure_cpu(dtype_name, ranks_per_node) | {"cpu_model": cpu_model(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    rec |= replaced | {"checked_s": time.time()}
    if path:
        _store(path, cached | {key: rec})
    return rec | {"cache": str(path) if path else None, "cached": False}


def _store(path: Path, cached: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # two runs starting at once: the last complete file wins
    tmp.write_text(json.dumps(cached, indent=2) + "\n")
    tmp.replace(path)


def _identity(dtype_name: str) -> dict[str, Any]:
    """What a machine profile must have been measured on to stand for this machine: as the cached peak's file and
    key, the CPU model, core count and torch version (and the dtype its kernels ran in)."""
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "device": "cpu", "torch": torch.__version__, "dtype": dtype_name}


def store_profile(folder: str | None, profile: Path) -> Path | None:
    """A copy of the machine profile at `profile` (python -m runner.calibrate's) in the cache folder, named after the
    machine, the dtype and when it was made; None when the cache is off."""
    if not folder:
        return None
    found = json.loads(profile.read_text())
    stamp = re.sub(r"[^0-9T]", "", found["machine"]["created"].split("+")[0])
    path = Path(folder).expanduser() / f"profile-{_slug()}-{found['machine']['dtype']}-{stamp}.json"
    _store(path, found)
    return path


def cached_profile(folder: str | None, dtype_name: str) -> Path | None:
    """The newest machine profile in the cache folder measured on this machine in this dtype (files that are no
    profile of the current version, or of another machine, are passed over)."""
    if not folder:
        return None
    me, found = _identity(dtype_name), []
    for path in Path(folder).expanduser().glob(f"profile-{_slug()}-{dtype_name}-*.json"):
        try:
            machine = steptime_machine.load(path)["machine"]
        except (OSError, ValueError, KeyError, AttributeError):  # unreadable, not JSON, not a runner profile (of this version)
            continue
        if all(machine.get(k) == v for k, v in me.items()):
            found.append((machine["created"], path))
    return max(found)[1] if found else None


def source(cfg: RunConfig) -> str:
    """ "config" when the cluster declares the peak of the matmul dtype, else "measured"."""
    return "config" if precision.matmul_peak(cfg)[0] in cfg.cluster.peak_tflops else "measured"


def write(cfg: RunConfig, world_size: int, run_dir: Path) -> dict:
    """Decide the peak once per run (measuring before any rank starts) and record it.

    On CPU the ranks of a node share one machine, so the "device" is the node."""
    dtype, emulated = precision.matmul_peak(cfg)
    rec: dict[str, Any] = {"peak_source": source(cfg), "dtype": dtype, "emulated": emulated}
    if rec["peak_source"] == "measured":  # validation allows a missing peak on CPU only
        m = cpu_peak(cfg, dtype, world_size // cfg.cluster.num_nodes)
        op = "torch._scaled_mm (e4m3)" if dtype == "float8" else "torch.mm"
        rec |= {
            "peak_tflops": m["tflops"],
            "peak_spread": m["spread"],
            "method": f"one rank's share ({count(m['threads'], 'thread')}), square {op} n={m['size']} (plateau), median of "
            f"{len(m['rounds'])} rounds of best-of-{MIN_REPS}+ ({len(m['refused'])} refused as outliers), x {count(m['shares'], 'rank')} "
            "running at once",
            "measurement": m,
        }
        if "fp8_vs_fp32" in m:
            rec["fp8_vs_fp32"] = m["fp8_vs_fp32"]
    else:
        rec |= {"peak_tflops": cfg.cluster.peak_tflops[dtype], "peak_spread": None}
    devices = DevicePolicy.of(cfg.cluster, cfg.distributed).peak_devices(world_size, cfg.cluster.num_nodes)
    rec |= {"peak_flops_total": rec["peak_tflops"] * 1e12 * devices, "fp8": cfg.precision.fp8.value, "device": cfg.cluster.device.value}
    rec |= _mfu_peak(cfg, rec, world_size // cfg.cluster.num_nodes)
    rec["mfu_peak_flops_total"] = rec["mfu_peak_tflops"] * 1e12 * devices
    (run_dir / runfiles.PEAK).write_text(json.dumps(rec, indent=2) + "\n")
    return rec


def _mfu_peak(cfg: RunConfig, rec: dict, ranks_per_node: int) -> dict[str, Any]:
    """mfu's peak: param_dtype's for every precision (runner.estimate.precision.mfu_peak); peak_tflops is the GEMMs'.
    Stated by the cluster, or measured as the GEMMs' is (CPU: an FP8 run's float32 peak beside its float8 one)."""
    mfu_dtype = precision.mfu_peak(cfg, measured=rec["peak_source"] == "measured")
    if mfu_dtype == rec["dtype"]:
        return {"mfu_dtype": mfu_dtype, "mfu_peak_tflops": rec["peak_tflops"]}
    if mfu_dtype in cfg.cluster.peak_tflops:
        return {"mfu_dtype": mfu_dtype, "mfu_peak_tflops": cfg.cluster.peak_tflops[mfu_dtype]}
    m = cpu_peak(cfg, mfu_dtype, ranks_per_node)
    return {"mfu_dtype": mfu_dtype, "mfu_peak_tflops": m["tflops"], "mfu_measurement": m}


def spread_text(pk: dict) -> str:
    """', spread 6.2 %' beside a measured peak ((max - min) / median of its rounds); empty for a datasheet peak."""
    return "" if pk["peak_spread"] is None else f", spread {100 * pk['peak_spread']:.1f} %"


def read(run_dir: Path) -> dict:
    return json.loads((run_dir / runfiles.PEAK).read_text())


def profile_source(cfg: RunConfig, policy: DevicePolicy) -> tuple[str | None, str]:
    """The machine profile the run's prediction uses and where it comes from (summary.json's `profile_from`):
    "cluster.profile"; without one on a device the datasheet model may price (GPUs), "datasheet"; else (CPU)
    "cache", the newest profile of this machine that python -m runner.calibrate stored in cluster.peak_cache_dir,
    or "none" (no prediction)."""
    c = cfg.cluster
    if c.profile:
        return c.profile, "cluster.profile"
    if policy.datasheet_predicts:
        return None, "datasheet"
    found = cached_profile(c.peak_cache_dir, cfg.precision.param_dtype.value)
    return (str(found), "cache") if found else (None, "none")
