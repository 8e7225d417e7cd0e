"""The measurements of `python -m runner.calibrate` that need several ranks or whole runs: collectives
on the backend with torch's own ops, and the stack's fixed costs fitted from short runs of the runner."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runner.config import freeze, points
from runner.estimate.predict import machine_profile as steptime_profile
from runner.estimate.predict import steptime
from runner.formats import runfiles
from runner.run import procs
from runner.schema import RunConfig
from runner.schema.layout import label, resolve

OPS = ("all_reduce", "all_gather", "reduce_scatter")
# the short runs: a model so small that its GEMMs cost next to nothing, so what a block costs is the stack's
TINY = ["model=debug", "model.dim=64", "model.ffn_hidden_dim=192", "model.num_heads=4", "model.num_kv_heads=4", "training.seq_len=64"]
RUN = ["training.global_batch_size=4", "training.microbatch_size=2", "data=synthetic", "logging.progress=false", "checkpoint=none"]
LAYERS = (2, 6)
# the in-run share runs: the calibrated model itself, 2 samples per microbatch, 8 per step
RUN_AT_SHAPE = ["training.global_batch_size=8", "training.microbatch_size=2", "data=synthetic", "logging.progress=false", "checkpoint=none"]


def _sent(op: str, group: int, tensor_bytes: float) -> float:
    return {"all_reduce": 2 * (group - 1) / group, "send_recv": 1.0}.get(op, (group - 1) / group) * tensor_bytes


def _run_op(op: str, x: torch.Tensor, group, size: int):
    if op == "all_reduce":
        return dist.all_reduce(x, group=group)
    if op == "all_gather":
        return dist.all_gather_single(x, x[: x.numel() // size].clone(), group=group)
    return dist.reduce_scatter_single(x[: x.numel() // size].clone(), x, group=group)


def _timed(fn, group, device: torch.device, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _send_recv(x: torch.Tensor, rank: int) -> None:
    """One round trip with the pair partner (rank ^ 1)."""
    peer = rank ^ 1
    if rank % 2 == 0:
        dist.send(x, peer), dist.recv(x, peer)
    else:
        dist.recv(x, peer), dist.send(x, peer)


def _measure(rank: int, world: int, device: torch.device, sizes: tuple[int, ...], reps: int) -> dict[str, Any]:
    groups = {world: None}
    if world >= 4:  # pairs running side by side, as TP or CP 2 inside a 4-rank job
        pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
        groups[2] = pairs[rank // 2]
    out = {}
    for size, group in groups.items():
        for op in OPS:
            pts = []
            for nbytes in sizes:
                x = torch.ones(nbytes // 4, device=device)
                pts.append((_sent(op, size, nbytes), _timed(lambda op=op, x=x, g=group, n=size: _run_op(op, x, g, n), group, device, reps)))
            out[f"{op}@{size}"] = steptime_profile.fit_link(pts)
    pts = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, device=device)
        pts.append((nbytes, _timed(lambda x=x: _send_recv(x, rank), None, device, reps) / 2))
    out["send_recv@2"] = steptime_profile.fit_link(pts)
    return out


def _worker(rank: int, world: int, backend: str, store: str, sizes: tuple[int, ...], reps: int, out: str) -> None:
    torch.set_num_threads(procs.threads_per_rank(world))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        result = _measure(rank, world, device, sizes, reps)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def collectives(cfg: RunConfig, world: int, sizes: tuple[int, ...], reps: int) -> dict[str, Any]:
    """Latency and bandwidth of every op per group size with `world` ranks running (a FileStore: no port)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "collectives.json"
        args = (world, cfg.cluster.backend.value, str(Path(tmp) / "store"), sizes, reps, str(out))
        mp.spawn(_worker, args=args, nprocs=world, join=True)
        return json.loads(out.read_text())


def _multirun(argv: list[str], folder: Path) -> list[tuple[RunConfig, float]]:
    """Run `python -m runner -m <argv>` into folder: each job's (frozen config, median step time)."""
    proc = subprocess.run([sys.executable, "-m", "runner", "-m", *argv, f"hydra.sweep.dir={folder}"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the short runs failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    out = []
    for summary in sorted(folder.glob(f"*/{runfiles.SUMMARY}")):
        cfg = freeze.load(summary.parent / runfiles.FROZEN)
        out.append((cfg, json.loads(summary.read_text())["step_time_s_median"]))
    return out


def _short_runs(base: list[str], folder: Path, quick: bool) -> list[tuple[RunConfig, float]]:
    """Train the tiny model with 2 and 6 blocks, on one rank and with TP 2 (one Hydra multirun): (config, median step)."""
    steps = "training.steps=6" if quick else "training.steps=16"
    layers = "model.num_layers=" + ",".join(map(str, LAYERS))
    return _multirun([*base, *TINY, *RUN, steps, layers, "parallelism=single,tp2"], folder)


def _residual(profile: dict[str, Any], cfg: RunConfig, measured: float) -> float:
    return measured - steptime.predict(cfg, resolve(cfg.parallelism, cfg.cluster), profile).step_s


def fixed_costs(
    profile: dict[str, Any], base: list[str], folder: Path, quick: bool
) -> tuple[dict[str, Any], list[tuple[RunConfig, float]]]:
    """The block and DTensor costs fitted from short runs of the runner (fit_fixed_costs), and those runs."""
    runs = _short_runs(base, folder, quick)
    return fit_fixed_costs(profile, runs), runs


def residuals(profile: dict[str, Any], runs: list[tuple[RunConfig, float]]) -> list[dict[str, Any]]:
    """Each run of the calibration, measured and predicted by the finished profile (the profile's `residuals`, whose
    RMS error is the predictor's error band on this machine: mode=search does not order candidates closer than it)."""
    out = []
    for cfg, measured in runs:
        lay = resolve(cfg.parallelism, cfg.cluster)
        name = f"{label(lay, cfg.parallelism)}, {cfg.model.num_layers} blocks of dim {cfg.model.dim}"
        out.append({"run": name, "measured_s": measured, "predicted_s": steptime.predict(cfg, lay, profile).step_s})
    return out


def fit_fixed_costs(profile: dict[str, Any], runs: list[tuple[RunConfig, float]]) -> dict[str, Any]:
    """What the runs with 6 blocks take beyond those with 2, less what the measured GEMMs, kernels and the
    collectives' bytes explain: per block pass (single rank), and per collective inside a run (TP 2: 2
    passes x 2 all-gathers + 2 reduce-scatters per block, the tiny runs' collectives being all latency)."""
    zero = {**profile, "constants": {n: steptime_profile.constant(n, 0.0) for n in steptime_profile.CONSTANTS}}
    res = {(c.model.num_layers, c.parallelism.tp): _residual(zero, c, t) for c, t in runs}
    cfg = runs[0][0]
    micro = cfg.training.global_batch_size // cfg.training.microbatch_size
    extra_blocks = LAYERS[1] - LAYERS[0]
    block = max(0.0, (res[(LAYERS[1], 1)] - res[(LAYERS[0], 1)]) / (extra_blocks * 2 * micro))
    tp_block = (res[(LAYERS[1], 2)] - res[(LAYERS[0], 2)]) / (extra_blocks * micro)  # per block and microbatch, TP 2
    dtensor = max(0.0, (tp_block - 2 * block) / 8)  # per TP collective
    overlap = 1.0 if cfg.cluster.backend.value == "nccl" else 0.0  # gloo's collectives need the cores the compute holds
    return {
        "layer_overhead_s": steptime_profile.constant("layer_overhead_s", block),
        "collective_fixed_s": steptime_profile.constant("collective_fixed_s", dtensor),
        "comm_overlap": steptime_profile.constant("comm_overlap", overlap),
    }


def _share(profile: dict[str, Any], cfg: RunConfig, measured: float) -> float:
    """The in-run share with which the profile predicts the run's measured step time (bisection: the predicted
    time falls as the share rises, through the kernels and the bubble they set), within 0.2-3."""
    lay = resolve(cfg.parallelism, cfg.cluster)
    n = steptime_profile.nearest(profile["by_ranks"], lay.world_size)

    def predicted(share: float) -> float:
        by_ranks = {**profile["by_ranks"], n: {**profile["by_ranks"][n], "in_run_share": share}}
        return steptime.predict(cfg, lay, {**profile, "by_ranks": by_ranks}).step_s

    lo, hi = 0.2, 3.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted(mid) > measured else (lo, mid)
    return (lo + hi) / 2


def with_fit(
    profile: dict[str, Any], shares: dict[int, float], constants: dict[str, float], fixed: dict[int, float] | None = None
) -> dict[str, Any]:
    """The profile with these in-run shares and constants, and `fixed`: the collective's fixed cost per rank count."""
    by_ranks = {n: {**e, "in_run_share": shares.get(int(n), e.get("in_run_share", 1.0))} for n, e in profile["by_ranks"].items()}
    for n, f in (fixed or {}).items():
        by_ranks[str(n)]["collective_fixed_s"] = f
    named = {k: steptime_profile.constant(k, v) for k, v in constants.items()}
    return {**profile, "by_ranks": by_ranks, "constants": {**profile["constants"], **named}}


def _solve(profile_at, cfg: RunConfig, measured: float) -> float:
    """The fixed cost f with which `profile_at(f)` predicts the run's measured step time (the predicted time is linear
    in it), at least 0."""
    lay = resolve(cfg.parallelism, cfg.cluster)
    at = [steptime.predict(cfg, lay, profile_at(f)).step_s for f in (0.0, 1e-3)]
    return max(0.0, (measured - at[0]) / ((at[1] - at[0]) / 1e-3)) if at[1] > at[0] else 0.0


def fit_in_run_shares(
    profile: dict[str, Any],
    runs: list[tuple[RunConfig, float]],
    pipeline: list[tuple[RunConfig, float]] = (),
    tp: list[tuple[RunConfig, float]] = (),
) -> tuple[dict[int, float], dict[str, float], dict[int, float]]:
    """Per rank count, the share of the timed kernels' rate a rank reaches inside a training step, and the in-run
    fixed cost of one collective, from runs of the calibrated model: `runs` over several rank counts (one rank,
    and above 2 a 2-stage pipeline with FSDP over the rest); `pipeline` a 2-stage pipeline, `tp` TP 2 runs (on 2
    ranks, and above 2 with FSDP over the rest).
    - The 1-rank run (whose FSDP has no peer) gives the 1-rank share.
    - The pipeline run (no data-parallel collectives, few point-to-point ones) gives the 2-rank share, and the TP
      run with it collective_fixed_s, which replaces the tiny model's figure: waiting for a peer costs more when
      the peer computes more between two collectives. The two are solved together (the pipeline's sends cost
      collective_fixed_s too).
    - Above 2 ranks the TP run with FSDP over the rest gives that rank count's own collective cost, solved together
      with its share from the pipeline with FSDP (returned per rank count, the third value). With 4 ranks on 2
      cores a collective waits for a peer that shares a core, but not twice as long as with 2: stretching the
      2-rank cost by the cores' sharing (2x) priced TP on 4 ranks 18-33 % slow on one machine's grid.
    - The runs on the other rank counts give their shares with the cost they have. A pipeline with FSDP over half the
      ranks: its FSDP collectives are fewer, and its compute more, than pure FSDP's. Fitted from pure FSDP on 4
      ranks, the share came out 0.73-0.74 in two calibrations against 0.90-0.98 that the 20 four-rank points of
      the bench grid agree on best: on the debug model pure FSDP is the 4-rank layout whose step is most
      collectives, and the share took their cost in.
    Each figure is the value with which the predictor gives the run's measured step time. A share is below 1 when
    the step's own work around the kernels (hooks, the optimizer, other ranks' processes on the same cores) slows
    them; one figure per rank count, for every layout with that many ranks. Without the 2-rank runs `runs` give
    every share and the profile's collective_fixed_s stays (no constants returned)."""

    def world(cfg: RunConfig) -> int:
        return resolve(cfg.parallelism, cfg.cluster).world_size

    known = {world(c): _share(profile, c, t) for c, t in runs if world(c) == 1}
    constants: dict[str, float] = {}
    tp_at = {world(c): (c, t) for c, t in tp}
    if pipeline and 2 in tp_at:
        fixed = profile["constants"]["collective_fixed_s"]["value"]
        for _ in range(6):  # converges in 2-3: the pipeline's few sends hardly move its share
            known[2] = _share(with_fit(profile, known, {"collective_fixed_s": fixed}), *pipeline[0])
            fixed = _solve(lambda f: with_fit(profile, known, {"collective_fixed_s": f}), *tp_at[2])
        constants["collective_fixed_s"] = fixed
    fitted = with_fit(profile, known, constants)
    per_ranks: dict[int, float] = {}
    for cfg, t in runs:
        n = world(cfg)
        if n in known:
            continue
        if n in tp_at and 2 in known:
            f = steptime_profile.machine_of(fitted, n, "").collective_fixed_s  # to start: the 2-rank cost, stretched
            for _ in range(6):
                known[n] = _share(with_fit(fitted, {}, {}, {n: f}), cfg, t)
                f = _solve(lambda x, n=n: with_fit(fitted, {n: known[n]}, {}, {n: x}), *tp_at[n])
            per_ranks[n] = f
        else:
            known[n] = _share(fitted, cfg, t)
    return dict(sorted(known.items())), constants, per_ranks


def _shape(cfg: RunConfig) -> tuple[int, int]:
    return cfg.model.dim, cfg.training.seq_len


def _median_points(reps: list[list[tuple[RunConfig, float]]]) -> list[tuple[RunConfig, float]]:
    """Per point (its rank count and shape: the runs of one multirun differ in them), the median step time over
    repetitions."""
    by_point: dict[tuple[int, int, int], list[tuple[RunConfig, float]]] = {}
    for cfg, t in (r for rep in reps for r in rep):
        by_point.setdefault((resolve(cfg.parallelism, cfg.cluster).world_size, *_shape(cfg)), []).append((cfg, t))
    return [(runs[0][0], statistics.median(t for _, t in runs)) for _, runs in sorted(by_point.items())]


def fit_shape_factors(
    profile: dict[str, Any], first: list[tuple[RunConfig, float]], at_shapes: list[tuple[RunConfig, float]]
) -> list[dict[str, Any]]:
    """Per calibrated shape (model width, sequence length), the factor on each rank count's in-run share with which
    the profile predicts that rank count's run at the shape: the share fitted there over the share fitted at the first
    shape, from the same layout (`first`: the runs at the first shape; `at_shapes`: the same layouts at the others).
    The first shape's factors are 1. A share fitted at one shape and applied to every shape left the calibrated
    model's widest shapes 13-59 % slow on one machine (kernels timed alone at a shape ran slower than inside a step)."""

    def world(cfg: RunConfig) -> int:
        return resolve(cfg.parallelism, cfg.cluster).world_size

    base = {world(c): (c, _share(profile, c, t)) for c, t in first}
    out: dict[tuple[int, int], dict[str, float]] = {_shape(c): {str(n): 1.0 for n in base} for c, _ in base.values()}
    for cfg, t in at_shapes:
        n = world(cfg)
        out.setdefault(_shape(cfg), {})[str(n)] = _share(profile, cfg, t) / base[n][1]
    return [{"dim": d, "seq_len": s, "factors": f} for (d, s), f in sorted(out.items())]


def share_points(
    base: list[str], rank_counts: list[int], quick: bool, variants: dict[tuple[int, int], list[str]] | None = None
) -> tuple[dict[str, list[str]], list[str]]:
    """The runs that give the in-run shares: each point's overrides, and the overrides all share (the command line's,
    after `base`'s own; a point's file cannot hold Hydra's `+key=`). The calibrated model (its first
    shape) on 1 rank, on 2 ranks as a 2-stage 1F1B pipeline and with TP 2, and on each larger rank count n as a 2-stage
    pipeline and as TP 2, each with FSDP over n / 2, and at each other shape (`variants`: each shape's overrides by
    (model width, sequence length)) the 1-rank run and the 2-rank pipeline."""
    variants = variants or {}
    steps = "training.steps=4" if quick else "training.steps=8"
    varied = {o.split("=", 1)[0].lstrip("+~") for v in variants.values() for o in v}
    own = [o for o in base if not o.lstrip("+~").startswith(("parallelism", "training.global_batch_size", "training.microbatch_size"))]
    first = [o for o in own if o.split("=", 1)[0].lstrip("+~") in varied]  # the first shape's own values of what a variant sets
    common = [*(o for o in own if o not in first), *RUN_AT_SHAPE, steps]
    single = ["parallelism=fsdp", "parallelism.dp_shard=1"]
    pp2 = ["parallelism=pp2_interleaved", "parallelism.pp_schedule=1F1B", "parallelism.pp_virtual_stages=1"]  # plain 1F1B
    pts = {"single": [*single, *first]} if 1 in rank_counts else {}
    if 2 in rank_counts:
        pts |= {"pp2": [*pp2, *first], "tp2": ["parallelism=tp2", *first]}
    pts |= {f"pp2_fsdp{n // 2}": ["parallelism=dp2_pp2", f"parallelism.dp_shard={n // 2}", *first] for n in rank_counts if n > 2}
    pts |= {f"tp2_fsdp{n // 2}": ["parallelism=dp2_tp2", f"parallelism.dp_shard={n // 2}", *first] for n in rank_counts if n > 2}
    for i, v in enumerate(variants.values()):
        pts |= {f"{name}_shape{i + 1}": [*o, *v] for name, o, n in (("single", single, 1), ("pp2", pp2, 2)) if n in rank_counts}
    return pts, common


def fit_share_runs(
    profile: dict[str, Any], reps: list[list[tuple[RunConfig, float]]], variants: dict[tuple[int, int], list[str]] | None = None
) -> tuple[dict[int, float], dict[str, float], dict[int, float], list[dict[str, Any]]]:
    """fit_in_run_shares on each share point's median over the repetitions `reps` (each repetition's runs of
    share_points) at the first shape, with the profile as measured so far (its in-run shares 1), then
    fit_shape_factors with those shares."""
    variants = variants or {}
    here = [[r for r in rep if _shape(r[0]) not in variants] for rep in reps]
    pipeline = _median_points([[r for rep in here for r in rep if r[0].parallelism.pp == 2 and r[0].parallelism.dp_shard == 1]])
    tp = _median_points([[r for rep in here for r in rep if r[0].parallelism.tp == 2]])
    others = [[r for r in rep if r[0].parallelism.tp == 1 and (r[0].parallelism.pp, r[0].parallelism.dp_shard) != (2, 1)] for rep in here]
    shares, constants, fixed = fit_in_run_shares(profile, _median_points(others), pipeline, tp)
    fitted = with_fit(profile, shares, constants, fixed)
    alike = _median_points([[r for r in rep if r[0].parallelism.tp == 1 and r[0].parallelism.dp_shard == 1] for rep in here])
    elsewhere = _median_points([[r for r in rep if _shape(r[0]) in variants] for rep in reps])
    return shares, constants, fixed, fit_shape_factors(fitted, alike, elsewhere)


def refit(
    profile: dict[str, Any], reps: list[list[tuple[RunConfig, float]]], variants: dict[tuple[int, int], list[str]] | None = None
) -> dict[str, Any]:
    """The profile with its in-run shares, collective fixed costs and shape factors fitted again (fit_share_runs) from
    share_points' runs `reps` (one list per repetition), its timed kernels, collectives and tiny-run constants kept:
    for runs measured at another time than the profile, on a machine whose speed drifts."""
    fitted_here = ("in_run_share", "collective_fixed_s")
    keep = {k: v for k, v in profile.items() if k not in ("by_shape", "residuals")}
    keep["by_ranks"] = {n: {k: v for k, v in e.items() if k not in fitted_here} for n, e in profile["by_ranks"].items()}
    shares, constants, fixed, by_shape = fit_share_runs(keep, reps, variants)
    return {**with_fit(keep, shares, constants, fixed), "by_shape": by_shape}


def in_run_shares(
    profile: dict[str, Any],
    base: list[str],
    rank_counts: list[int],
    folder: Path,
    quick: bool,
    variants: dict[tuple[int, int], list[str]] | None = None,
) -> tuple[dict[int, float], dict[str, float], dict[int, float], list[dict[str, Any]], list[tuple[RunConfig, float]]]:
    """Train share_points in one Hydra multirun, 3 times in alternating order (once with `quick`): a shared machine's
    speed drifts by tens of percent over minutes, and runs measured together see the same drift, so the shares keep
    their ratios. Fit them with fit_share_runs; the runs come back with the fit."""
    pts, common = share_points(base, rank_counts, quick, variants)
    names = points.write(pts, folder / "points")
    reps = [
        _multirun([*points.argv(names if r % 2 == 0 else names[::-1], folder / "points"), *common], folder / f"rep{r}")
        for r in range(1 if quick else 3)
    ]
    return (*fit_share_runs(profile, reps, variants), [r for rep in reps for r in rep])
