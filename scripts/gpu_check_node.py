"""`scripts/gpu_check.sh --node`: the runner on one 8-GPU node, case by case, beside TorchTitan's own trainer.

Every case trains the debug model through `python -m runner` on all 8 GPUs (NCCL, the gloo host group, the flight
recorder, an 8-rank launch) after `mode=plan` and `mode=dryrun` of the same config, and, where TorchTitan's trainer
has the case, that trainer on the same layout (scripts/gpu_check_titan.py under torchrun). For each case it prints
tokens/s beside TorchTitan's with the ratio (target >= 0.98), the peak memory beside the dry run's and the plan's,
and the host syncs per step (scripts/gpu_check_syncs: torch's sync debug mode and the explicit synchronize calls,
counted between optimizer steps in every rank; the runner's metrics carry no such field in this checkout).

    scripts/gpu_check.sh --node          # on the 8-GPU node, under 15 minutes
    scripts/gpu_check.sh --node --list   # each case's exact commands; no GPU needed
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import gpu_check as gc

from runner.formats import runfiles

NUM_GPUS = 8
STEPS = 20
SEQ_LEN = 2048
GLOBAL_BATCH = 32
MICROBATCH = 4
BUDGET_S = 870.0
"""The whole check fits in 15 minutes on the node (the issue's limit), start-ups and compiles included."""
RUN_CAP_S = 150.0
SYNCS = gc.ROOT / "scripts" / "gpu_check_syncs"
"""Folder put first on PYTHONPATH of the training runs: its sitecustomize counts host syncs per step."""
CPU_MODES = ("plan", "dryrun")
"""The modes that train nothing; every case but the hang runs them on the same config."""
LIST_GPU = gc.Gpu("NVIDIA H100 80GB HBM3", (9, 0), 85.0)
"""What --list assumes (no GPU is probed): one HGX H100 node."""


@dataclass(frozen=True)
class NodeCase:
    name: str
    overrides: tuple[str, ...]
    """The runner's overrides beyond the common ones (model, cluster, steps, batch, data)."""
    titan: dict | None
    """TorchTitan's degrees and recipe for the same config (gpu_check_titan.trainer_config); None: no TorchTitan run."""
    no_titan: str = ""
    resume_at: int = 0
    """Checkpoint at this step; a second run resumes from it, and its losses must equal the first run's bitwise."""
    hang_rank: int = -1
    """The run must end in a hang report naming this rank, and torchfrtrace must name it too."""


DP4_TP2 = ("parallelism=dp2_tp2", "parallelism.name=dp4_tp2", "parallelism.dp_shard=4")
CASES = (
    NodeCase(
        "dp_shard4 x tp2 bf16, checkpoint + resume",
        (*DP4_TP2, "precision=bf16", "checkpoint=local", f"checkpoint.interval={STEPS // 2}", "checkpoint.keep=0"),
        {"dp_shard": 4, "tp": 2},
        resume_at=STEPS // 2,
    ),
    NodeCase(
        "dp_shard2 x tp2 x pp2 FlexAttention",
        ("parallelism=tp2_pp2", "parallelism.name=dp2_tp2_pp2", "parallelism.dp_shard=2", "precision=bf16"),
        {"dp_shard": 2, "tp": 2, "pp": 2, "pp_schedule": "1F1B"},
    ),
    NodeCase(
        "fp8_rowwise FSDP8", ("parallelism=fsdp", "precision=fp8_rowwise", "training.compile=true"), {"dp_shard": 8, "fp8": "rowwise"}
    ),
    NodeCase(
        "injected hang, NCCL flight recorder",
        (*DP4_TP2, "precision=bf16", "monitor.inject.hang_rank=1", "monitor.inject.hang_at_step=5", "distributed.timeout_s=60"),
        None,
        no_titan="a hang has no throughput",
        hang_rank=1,
    ),
    NodeCase(
        "async TP compiled",
        (*DP4_TP2, "precision=bf16", "training.compile=true", "parallelism.async_tp=true"),
        {"dp_shard": 4, "tp": 2, "async_tp": True},
    ),
)


@dataclass
class NodeResult:
    case: NodeCase
    runner: dict | None = None
    titan: dict | None = None
    plan_gb: float | None = None
    dryrun_gb: float | None = None
    syncs: float | None = None
    checks: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def slug(case: NodeCase) -> str:
    return "".join(c if c.isalnum() else "_" for c in case.name.split(",")[0]).strip("_")


def runner_command(case: NodeCase, assets: gc.Assets, run_dir: Path, gpu: gc.Gpu, *, mode: str, extra: tuple[str, ...] = ()) -> list[str]:
    cluster = gc.cluster_for(gpu.name)[0]
    return [
        sys.executable,
        "-m",
        "runner",
        f"mode={mode}",
        "model=debug",
        f"cluster={cluster}",
        f"cluster.devices_per_node={NUM_GPUS}",
        f"cluster.compute_capability='{gpu.capability[0]}.{gpu.capability[1]}'",
        f"cluster.device_memory_gb={gpu.memory_gb:.1f}",
        *case.overrides,
        *extra,
        f"training.steps={STEPS}",
        f"training.seq_len={SEQ_LEN}",
        f"training.global_batch_size={GLOBAL_BATCH}",
        f"training.microbatch_size={MICROBATCH}",
        "data=text",
        f"data.files=['{assets.corpus}']",
        f"data.tokenizer='{assets.tokenizer}'",
        "logging.progress=false",
        f"hydra.run.dir={run_dir}",
    ]


def titan_spec(case: NodeCase, assets: gc.Assets, dump_folder: Path) -> dict:
    """gpu_check_titan's spec for the case: the runner's batch per DP rank and microbatch, its degrees and recipe."""
    t = case.titan
    dp = t["dp_shard"]
    spec = gc.titan_spec(
        gc.Case(case.name, "bf16", "training.compile=true" in case.overrides), assets, dump_folder, steps=STEPS, seq_len=SEQ_LEN
    )
    spec |= {"local_batch_size": GLOBAL_BATCH // dp, "fp8_recipe": t.get("fp8"), "nproc": NUM_GPUS}
    spec["compile"] = spec["compile"] or bool(t.get("fp8"))
    return spec | {
        "parallelism": {k: t[k] for k in ("dp_shard", "tp", "pp", "pp_schedule", "async_tp") if k in t} | {"microbatch": MICROBATCH}
    }


def commands(case: NodeCase, assets: gc.Assets, work: Path, gpu: gc.Gpu) -> list[tuple[str, list[str]]]:
    """(what, argv) in the order the case runs them."""
    run = work / "runs" / slug(case)
    out = [] if case.hang_rank >= 0 else [(k, runner_command(case, assets, run / k, gpu, mode=k)) for k in CPU_MODES]
    out.append(("train", runner_command(case, assets, run / "train", gpu, mode="train")))
    if case.resume_at:
        back = ("checkpoint.resume=true", f"checkpoint.resume_from={run / 'train' / 'checkpoints' / f'step-{case.resume_at}'}")
        out.append(("resume", runner_command(case, assets, run / "resume", gpu, mode="train", extra=back)))
    if case.hang_rank >= 0:
        out.append(
            (
                "torchfrtrace",
                [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(run / "train" / "flight_recorder"), "-p", "rank_"],
            )
        )
    if case.titan is not None:
        out.append(("titan", titan_command(run / "titan")))
    return out


def titan_command(folder: Path) -> list[str]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NUM_GPUS}"]
    return [
        *torchrun,
        str(gc.ROOT / "scripts" / "gpu_check_titan.py"),
        "--spec",
        str(folder / "spec.json"),
        "--out",
        str(folder / "out.json"),
    ]


def list_cases(work: Path, gpu: gc.Gpu = LIST_GPU) -> str:
    """--list: every case's commands as shell lines, with TorchTitan's spec; nothing is run."""
    assets = gc.Assets(work / "assets" / "corpus", work / "assets" / "corpus" / "corpus.jsonl", work / "assets" / "tokenizer")
    lines = [f"# {NUM_GPUS} x {gpu.name}; assets made by gpu_check.make_assets in {work / 'assets'}"]
    for case in CASES:
        lines.append(f"# case: {case.name}")
        for what, argv in commands(case, assets, work, gpu):
            if what == "titan":
                lines.append(f"# titan spec ({argv[-3]}): {json.dumps(titan_spec(case, assets, Path(argv[-3]).parent))}")
            lines.append(shlex.join(argv))
        if case.no_titan:
            lines.append(f"# no TorchTitan run: {case.no_titan}")
    return "\n".join(lines)


# ---- the runs ---------------------------------------------------------------------------------------------


def start_cpu_modes(results: list[NodeResult], assets: gc.Assets, work: Path, gpu: gc.Gpu) -> list[tuple]:
    """mode=plan and mode=dryrun of every case, started together up front: they run on the node's CPUs (the dry run
    on fake tensors) while the GPU runs go one after another."""
    started = []
    for r in results:
        for what, argv in commands(r.case, assets, work, gpu):
            if what in CPU_MODES:
                log = work / "logs" / f"{slug(r.case)}-{what}.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                with open(log, "w") as f:
                    proc = subprocess.Popen(
                        argv, cwd=gc.ROOT, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}
                    )
                started.append((r, what, proc, Path(argv[-1].split("=", 1)[1]), log))
    return started


def finish_cpu_modes(started: list[tuple], deadline: float) -> None:
    for r, what, proc, folder, log in started:
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            r.errors.append(f"{what}: timed out (log: {log})")
            continue
        if rc != 0:
            r.errors.append(f"{what}: exit status {rc} (log: {log})")
        else:
            read_outputs(r, what, folder, log)


def run_case(r: NodeResult, assets: gc.Assets, work: Path, gpu: gc.Gpu, deadline: float) -> None:
    """The case's GPU commands in order; one that fails (other than the hang's run and torchfrtrace, which must) ends it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SYNCS), str(gc.ROOT), os.environ.get("PYTHONPATH", "")])}
    for what, argv in commands(r.case, assets, work, gpu):
        if what in CPU_MODES:
            continue
        left = deadline - time.monotonic()
        if left < gc.MIN_RUN_S:
            r.errors.append(f"{what}: not run, less than {gc.MIN_RUN_S:.0f} s of the {BUDGET_S:.0f} s budget left")
            return
        folder = Path(argv[-3]).parent if what in ("titan", "torchfrtrace") else Path(argv[-1].split("=", 1)[1])
        if what == "titan":
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "spec.json").write_text(json.dumps(titan_spec(r.case, assets, folder), indent=2) + "\n")
        log = work / "logs" / f"{slug(r.case)}-{what}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        err = gc.run_logged(argv, log, min(RUN_CAP_S, left), env | {"GPU_CHECK_SYNC_DIR": str(folder / "syncs")})
        if err and not ((what == "train" and r.case.hang_rank >= 0) or what == "torchfrtrace"):
            r.errors.append(f"{what}: {err}")
            return
        read_outputs(r, what, folder, log)


def read_outputs(r: NodeResult, what: str, folder: Path, log: Path) -> None:
    """What each command leaves: plan.json, dryrun.json, summary.json and metrics.jsonl, the hang report, TorchTitan's out.json."""
    if what == "plan":
        r.plan_gb = json.loads((folder / runfiles.PLAN).read_text())["total_gb_per_gpu"]
    elif what == "dryrun":
        r.dryrun_gb = json.loads((folder / runfiles.DRYRUN).read_text())["fits"]["largest_peak_gb"]
    elif what == "train" and r.case.hang_rank >= 0:
        r.checks.append(hang_check(folder, r.case.hang_rank))
    elif what == "train":
        r.runner = json.loads((folder / runfiles.SUMMARY).read_text())
        r.syncs = syncs_per_step(folder / "syncs")
    elif what == "resume":
        r.checks.append(resume_check(folder.parent / "train", folder, r.case.resume_at))
    elif what == "torchfrtrace":
        r.checks.append(frtrace_check(log.read_text(errors="replace"), r.case.hang_rank))
    elif what == "titan":
        r.titan = json.loads((folder / "out.json").read_text())


def frtrace_check(text: str, rank: int) -> str:
    """torchfrtrace names the hung rank: with its dump missing (what the gloo dumps give, tests/test_monitor.py), or, where
    NCCL's dump-on-timeout signal made the sleeping rank's watchdog thread dump too, as the collective's missing rank."""
    said = [w for w in (f"Missing dump files from ranks {{{rank}}}", f"missing ranks: {{{rank}}}") if w in text]
    return f"torchfrtrace: {said[0]}" if said else f"FAILED torchfrtrace: rank {rank} not named"


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / runfiles.METRICS).read_text().splitlines() if line.strip()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def resume_check(first: Path, resumed: Path, at: int) -> str:
    a, b = losses(first), losses(resumed)
    steps = sorted(s for s in b if s > at)
    same = bool(steps) and all(a.get(s) == b[s] for s in steps)
    return f"resume from step {at}: steps {steps[0]}-{steps[-1]} bitwise equal" if same else f"FAILED resume from step {at}: {a} vs {b}"


def hang_check(run_dir: Path, rank: int) -> str:
    path = run_dir / runfiles.HANG_REPORT
    if not path.is_file():
        return f"FAILED hang: no {runfiles.HANG_REPORT} in {run_dir}"
    report = json.loads(path.read_text())
    dumps = sorted(p.name for p in (run_dir / "flight_recorder").glob("rank_*"))
    ok = report["missing_ranks"] == [rank] and dumps
    return f"hang: rank {rank} named, NCCL dumps {dumps}" if ok else f"FAILED hang: missing {report['missing_ranks']}, dumps {dumps}"


def syncs_per_step(folder: Path) -> float | None:
    """Median over ranks and steps 2.. of the host syncs counted between optimizer steps (scripts/gpu_check_syncs)."""
    counts = [c for p in folder.glob("rank_*.json") for c in json.loads(p.read_text())["per_step"][1:]]
    return statistics.median(counts) if counts else None


# ---- the report -------------------------------------------------------------------------------------------

HEADER = (
    "case",
    "runner tokens/s",
    "TorchTitan tokens/s",
    "ratio",
    "peak GB (run)",
    "dry run GB",
    "plan GB",
    "host syncs / step",
    "checks",
)


def table_rows(results: list[NodeResult]) -> list[tuple[str, ...]]:
    rows = []
    for r in results:
        run, tt = r.runner, r.titan
        ratio = f"{run['tokens_per_s_median'] / tt['tokens_per_s_median']:.3f}" if run and tt else "-"
        titan_cell = f"n/a ({r.case.no_titan})" if r.case.no_titan else f"{tt['tokens_per_s_median']:,.0f}" if tt else "-"
        cells = [r.case.name, f"{run['tokens_per_s_median']:,.0f}" if run else "-", titan_cell, ratio]
        cells += [_gb(run["memory_gb_max"] if run else None), _gb(r.dryrun_gb), _gb(r.plan_gb)]
        cells += ["-" if r.syncs is None else f"{r.syncs:g}", "; ".join(r.checks) or "-"]
        rows.append(tuple(cells))
    return rows


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def verdict(results: list[NodeResult]) -> tuple[bool, str]:
    failed = [r.case.name for r in results if r.errors or any(c.startswith("FAILED") for c in r.checks)]
    if failed:
        return False, f"FAIL: {len(failed)} of {len(results)} cases failed ({', '.join(failed)})"
    return True, f"PASS: {len(results)} cases on {NUM_GPUS} GPUs"


def main(args) -> int:
    if args.list:
        print(list_cases(args.work_dir or Path(tempfile.gettempdir()) / "gpu_check_node"))
        return 0
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="gpu_check_node_"))
    try:
        gpu = gc.probe_gpu()
    except gc.NoGpu as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    deadline = time.monotonic() + BUDGET_S
    assets = gc.make_assets(work / "assets", SEQ_LEN)
    results = [NodeResult(c) for c in CASES]
    started = start_cpu_modes(results, assets, work, gpu)
    for r in results:
        print(f"{r.case.name} ...", flush=True)
        run_case(r, assets, work, gpu, deadline)
    finish_cpu_modes(started, deadline + 30)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"debug model on {NUM_GPUS} x {gpu.name}, {STEPS} steps of {GLOBAL_BATCH} x {SEQ_LEN} tokens")
    for h in HEADER:
        table.add_column(h)
    for row in table_rows(results):
        table.add_row(*row)
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 220)
    console.print(table)
    for r in results:
        for e in r.errors:
            console.print(f"{r.case.name}: {e}", markup=False, soft_wrap=True)
    ok, text = verdict(results)
    console.print(text)
    return 0 if ok else 1
