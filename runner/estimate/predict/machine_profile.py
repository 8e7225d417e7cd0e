"""A machine profile (the JSON `python -m runner.calibrate` writes) read into the predictor's Machine.

Layout of the file, everything measured on the machine with the backend the runs use:
- `machine`: CPU model, cores, device, backend, torch version, compute dtype;
- `by_ranks["<n>"]`: with n ranks on the machine, each rank's threads, its GEMM rate at the model's
  per-rank shapes (`gemms`: [M, K, N, TFLOP/s], forward + backward timed together) and fitted over
  them (`matmul_tflops`, `gemm_half_dim`), its attention rate and the bandwidth of its elementwise
  kernels, all timed as kernels; and `in_run_share`, the share of those rates it reaches inside a
  training step, by which the predictor scales them; above 2 ranks also `collective_fixed_s`, one collective's
  fixed cost inside a step with that many ranks running (else the constant's, stretched by the cores' sharing);
- `by_shape`: per calibrated shape (`dim`, `seq_len`), the factor on each rank count's in-run share there
  (`factors["<n>"]`; 1 at the first shape): a shape between or beyond them takes the nearest one's;
- `collectives["<n>"]`: with n ranks running, latency and bandwidth of each op per group size
  ("all_gather@2"), fitted as seconds = latency + bytes sent / bandwidth;
- `constants`: the stack's fixed costs and overlap, each with its unit and meaning;
- `residuals`: each short run of the calibration, measured and predicted by the finished profile (error_band).
Torch-free: the predictor and mode=search read it.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

from runner.estimate.predict import machine as sm
from runner.estimate.predict.machine import Link, Machine
from runner.schema import RunConfig
from runner.schema.layout import Layout

CONSTANTS = {
    "layer_overhead_s": ("s", "fixed cost of one transformer block's forward or backward beyond its GEMMs and kernels (dispatch)"),
    "collective_fixed_s": (
        "s",
        "fixed cost of one collective inside a training step (launch, latency, waiting for its peers), beyond its bytes / bandwidth",
    ),
    "comm_overlap": ("fraction", "share of FSDP/DP collective time that runs while the rank computes"),
}


@functools.lru_cache(maxsize=16)
def _load_path(path: str) -> dict[str, Any]:
    return sm.load(path)


def load(path: str | Path) -> dict[str, Any]:
    """The profile at `path`, read once (ValueError naming it when it is not a runner profile)."""
    return _load_path(str(Path(path).expanduser()))


def nearest(keys, n: int) -> str:
    """The key of the measured rank count closest to n (on a log scale)."""
    return min(keys, key=lambda k: (abs(math.log(int(k) / n)), int(k)))


def _links(collectives: dict[str, dict[str, float]]) -> dict[str, Link]:
    """Links keyed "<op>@<group>", plus "<op>" for the op's smallest measured group (used for other sizes)."""
    out = {name: Link(v["latency_s"], v["gbs"]) for name, v in collectives.items()}
    for name in sorted(collectives, key=lambda k: -int(k.split("@")[1])):
        out[name.split("@")[0]] = out[name]
    return out


def shape_factor(prof: dict[str, Any], world: int, dim: int | None, seq_len: int | None) -> float:
    """The factor on the in-run share of `world` ranks at the calibrated shape nearest to (dim, seq_len) (on a log
    scale, width and length alike); 1 for a profile without shapes or a call without one."""
    shapes = prof.get("by_shape") or []
    if not shapes or dim is None or seq_len is None:
        return 1.0
    near = min(shapes, key=lambda e: abs(math.log(e["dim"] / dim)) + abs(math.log(e["seq_len"] / seq_len)))
    return near["factors"][nearest(near["factors"], world)]


def collective_fixed_s(prof: dict[str, Any], world: int, cpu_share: float) -> float:
    """The in-run fixed cost of one collective with `world` ranks running: the one fitted with the nearest measured
    rank count (`by_ranks["<n>"]["collective_fixed_s"]`), else `constants`' (fitted with 2 ranks, one core each),
    stretched by how much more the ranks share the cores than where it was fitted."""
    key = nearest(prof["by_ranks"], world)
    entry = prof["by_ranks"][key]
    if "collective_fixed_s" not in entry:
        return prof["constants"]["collective_fixed_s"]["value"] * cpu_share
    fitted_share = max(1.0, int(key) * entry["threads"] / prof["machine"]["cores"])
    return entry["collective_fixed_s"] * cpu_share / fitted_share


def machine_of(prof: dict[str, Any], world: int, source: str, dim: int | None = None, seq_len: int | None = None) -> Machine:
    """The Machine of `world` ranks on the profiled machine, for a model of width `dim` at `seq_len` tokens."""
    entry = prof["by_ranks"][nearest(prof["by_ranks"], world)]
    # the kernels' rate inside a training step over their rate timed alone
    share = entry.get("in_run_share", 1.0) * shape_factor(prof, world, dim, seq_len)
    links = _links(prof["collectives"][nearest(prof["collectives"], world)]) if world > 1 and prof["collectives"] else {}
    const = {k: v["value"] for k, v in prof["constants"].items()}
    cores = prof["machine"]["cores"]
    cpu_share = max(1.0, world * entry["threads"] / cores)
    return Machine(
        matmul_tflops=entry["matmul_tflops"] * share,
        memory_gbs=entry["memory_gbs"] * share,
        bytes_per_element=sm.EAGER_BYTES_PER_ELEMENT,
        attention_tflops=entry["attention_tflops"] * share,
        links={"intra-node": links, "scale-out": links},
        gemm_half_dim=entry["gemm_half_dim"],
        gemm_table={(g[0], g[1], g[2]): g[3] * share for g in entry["gemms"]},
        layer_overhead_s=const["layer_overhead_s"],
        collective_fixed_s=collective_fixed_s(prof, world, cpu_share),
        comm_overlap=const["comm_overlap"],
        cpu_share=cpu_share,
        calibrated=True,
        source=source,
    )


def machine(cfg: RunConfig, lay: Layout, source: str | Path | dict[str, Any]) -> Machine:
    at = (cfg.model.dim, cfg.training.seq_len)
    if isinstance(source, dict):
        return machine_of(source, lay.world_size, str(source.get("path", "profile")), *at)
    return _machine_at(str(Path(source).expanduser()), lay.world_size, *at)


@functools.lru_cache(maxsize=64)
def _machine_at(path: str, world: int, dim: int, seq_len: int) -> Machine:
    return machine_of(_load_path(path), world, path, dim, seq_len)


def fit_link(points: list[tuple[float, float]]) -> dict[str, float]:
    """Least-squares latency and bandwidth from (bytes sent, seconds) points: seconds = latency + bytes / (gbs x 1e9)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    slope = max(slope, 1e-15)
    return {"latency_s": max(0.0, my - slope * mx), "gbs": 1.0 / (slope * 1e9)}


def fit_gemm_rate(gemms: list[list[float]]) -> dict[str, float]:
    """Large-GEMM rate R and half-rate size d of rate = R d / (d + d_half), d = min(M, K, N), over measured
    [M, K, N, TFLOP/s]: a least-squares line of 1/rate against 1/d (1/rate = 1/R + (d_half/R) / d)."""
    pts = [(1.0 / min(g[:3]), 1.0 / g[3]) for g in gemms]
    fit = fit_link(pts)  # same algebra: y = a + b x
    inv_r = fit["latency_s"] or min(y for _, y in pts)
    return {"matmul_tflops": 1.0 / inv_r, "gemm_half_dim": (1.0 / (fit["gbs"] * 1e9)) / inv_r}


def constant(name: str, value: float) -> dict[str, Any]:
    unit, meaning = CONSTANTS[name]
    return {"value": value, "unit": unit, "meaning": meaning}


def write(profile: dict[str, Any], path: Path) -> Path:
    profile = {"kind": sm.PROFILE_KIND, "version": sm.PROFILE_VERSION, **profile}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile, indent=1) + "\n")
    tmp.replace(path)
    _load_path.cache_clear()
    _machine_at.cache_clear()
    return path


def error_band(prof: dict[str, Any]) -> float | None:
    """Root mean square of predicted / measured - 1 over the calibration's own runs, each predicted by the finished
    profile (`residuals`, written by python -m runner.calibrate): the predictor's error on this machine, what the fit
    leaves and the machine's drift between repetitions. None for a profile without them."""
    found = prof.get("residuals") or []
    errors = [r["predicted_s"] / r["measured_s"] - 1 for r in found if r["measured_s"] > 0]
    return math.sqrt(sum(e * e for e in errors) / len(errors)) if errors else None


def describe(prof: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(name, value, meaning) rows of the profile's named figures, for printing."""
    m = prof["machine"]
    out = [("machine", f"{m['cpu']}, {m['cores']} cores, {m['device']}/{m['backend']}, {m['dtype']}", f"torch {m['torch']}")]
    for n, e in sorted(prof["by_ranks"].items(), key=lambda kv: int(kv[0])):
        out.append(
            (
                f"{n} rank(s), {e['threads']} thread(s) each",
                f"GEMM {e['matmul_tflops'] * 1e3:.1f} GFLOP/s, half at {e['gemm_half_dim']:.0f}; "
                f"attention {e['attention_tflops'] * 1e3:.1f} GFLOP/s; memory {e['memory_gbs']:.1f} GB/s",
                "large-GEMM rate, size where it halves, fused attention rate, elementwise bandwidth",
            )
        )
        if "collective_fixed_s" in e:
            out.append(
                (
                    f"collective_fixed_s, {n} rank(s)",
                    f"{e['collective_fixed_s']:.3g} s",
                    "fixed cost of one collective inside a training step with this many ranks running (a TP 2 run among them)",
                )
            )
        if "in_run_share" in e:
            out.append(
                (
                    f"in_run_share, {n} rank(s)",
                    f"{e['in_run_share']:.3f}",
                    "share of those rates a rank reaches inside a training step (hooks, the optimizer, the other ranks' processes)",
                )
            )
    for e in prof.get("by_shape") or []:
        factors = ", ".join(f"x{f:.3f} ({n} rank(s))" for n, f in sorted(e["factors"].items(), key=lambda kv: int(kv[0])))
        out.append((f"in-run share at dim {e['dim']}, seq {e['seq_len']}", factors, "the in-run share's factor at this shape"))
    for n, ops in sorted(prof["collectives"].items(), key=lambda kv: int(kv[0])):
        for name, v in sorted(ops.items()):
            out.append(
                (
                    f"{name} ({n} ranks running)",
                    f"{v['latency_s'] * 1e6:.0f} us + bytes / {v['gbs']:.2f} GB/s",
                    "latency + size / bandwidth",
                )
            )
    out += [(k, f"{v['value']:.3g} {v['unit']}", v["meaning"]) for k, v in prof["constants"].items()]
    band = error_band(prof)
    if band is not None:
        n = len(prof["residuals"])
        out.append(("error band", f"+/-{100 * band:.1f} %", f"RMS of predicted / measured - 1 over the calibration's {n} runs"))
    return out
