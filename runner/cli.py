"""`python -m runner`: compose (Hydra), validate, then train or just report.

Torch-free until the ranks are launched: `--cfg job`, `--help`, `--info` and
validation never import torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from runner.config import compose, flops, freeze, precision, runfiles, slurm, validate
from runner.config.layout import label
from runner.config.schema import Fp8Recipe, Mode, RunConfig
from runner.config.search import objective as search_objective
from runner.config.wording import count

compose.register()
_entered = False  # set once Hydra hands over a composed config
_failed: list[str] = []  # overrides of the sweep points whose ranks failed


def _discard(run_dir: Path) -> None:
    """Remove the run folder Hydra just made, so a rejected config leaves nothing behind."""
    ours = set(runfiles.HYDRA_LOGS)
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= ours:
        shutil.rmtree(run_dir)
        parent = run_dir.parent  # outputs/<date> left empty
        if parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()


def _fail(msg: str, run_dir: Path) -> None:
    print(msg, file=sys.stderr)
    _discard(run_dir)
    sys.exit(2)


def _invalid_sweep_point(e: Exception, run_dir: Path) -> float:
    """In a multirun an invalid point is a result, not the end of the sweep: record why, and return the
    objective of a point that lost (an optimizing sweeper goes on with its next trial)."""
    problems = [str(p) for p in e.problems] if isinstance(e, validate.ConfigError) else [str(e)]
    overrides = list(HydraConfig.get().overrides.task)
    print(f"invalid sweep point {' '.join(overrides)}:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
    (run_dir / runfiles.INVALID).write_text(json.dumps({"overrides": overrides, "problems": problems}, indent=2) + "\n")
    return search_objective.WORST


def _precision_lines(cfg: RunConfig) -> list[str]:
    pr = cfg.precision
    dtype, emulated = precision.matmul_peak(cfg)
    peak = cfg.cluster.peak_tflops.get(dtype)
    mfu = f"  MFU against the {dtype} dense peak" + (f", {peak:g} TFLOP/s per device" if peak else " (measured at start-up)")
    if pr.fp8 == Fp8Recipe.none:
        return [f"  precision {pr.name}: {pr.param_dtype.value} compute, {pr.reduce_dtype.value} reduce", mfu]
    converted, kept = precision.conversion(cfg)
    return [
        f"  precision {pr.name}: {len(converted)} of {len(converted) + len(kept)} Linear layers in FP8 {pr.fp8.value} "
        f"(kept in {pr.param_dtype.value}: {', '.join(kept) or 'none'})",
        mfu + (" (FP8 emulated on CPU)" if emulated else ""),
        *([f"  routed experts: {precision.grouped_experts(cfg)}"] if precision.grouped_experts(cfg) else []),
    ]


def _report(cfg: RunConfig, lay) -> str:
    t = cfg.training
    micro = t.global_batch_size // (lay.dp * t.microbatch_size)
    return "\n".join(
        [
            f"config OK: model {cfg.model.name} {cfg.model.flavor} ({flops.num_params(cfg.model) / 1e9:.3g}B params)",
            f"  cluster {cfg.cluster.name}: {count(lay.world_size, 'rank')}, layout {label(lay, cfg.parallelism)} [{lay.describe()}]",
            f"  global batch {t.global_batch_size} x seq {t.seq_len} = {t.global_batch_size * t.seq_len:,} tokens/step, "
            f"{count(micro, 'microbatch')} of {t.microbatch_size} per DP rank",
            f"  FLOPs/token {flops.flops_per_token(cfg.model, t.seq_len, 'titan'):,} (titan) / "
            f"{flops.flops_per_token(cfg.model, t.seq_len, '6N'):,} (6N)",
            *_precision_lines(cfg),
        ]
    )


def _plan(cfg: RunConfig, lay, run_dir: Path) -> float:
    """Print the step budget (one line per point in a sweep) and write plan.json + frozen.yaml; start nothing.
    Returns the objective (predicted step time or MFU) for an optimizing sweeper."""
    from runner.config import memory, plan

    device_gb = memory.machine_memory_gb() / lay.world_size if cfg.cluster.device.value == "cpu" else None
    budget = plan.compute(cfg, lay, device_memory_gb=device_gb)
    budget["overrides"] = list(HydraConfig.get().overrides.task)
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        print(plan.one_line(budget))
    else:
        plan.render(budget, cfg.checkpoint.interval if cfg.checkpoint.enable else None)
    freeze.write(cfg, lay, run_dir)
    print(f"plan written to {plan.write(budget, run_dir)}")
    return search_objective.of_plan(cfg, budget)


def _search(cfg: RunConfig, run_dir: Path) -> float:
    """Search every layout of the model on the cluster; print the report, write search.json and the top-k sweep;
    with search.verify=k, train the top k here briefly and print measured beside predicted."""
    from runner.config import search
    from runner.config.search import render as search_render
    from runner.config.search import verify as search_verify

    res = search.run(cfg)
    path, cmd = search_render.write(cfg, res, run_dir, list(HydraConfig.get().overrides.task))
    print("\n".join(search_render.lines(cfg, res, cmd)))
    print(f"search written to {path}")
    k = min(cfg.search.verify, len(res.ranked))
    if k:
        v = search_verify.run(res, run_dir, k, cfg.search.verify_steps)
        print("\n".join(search_verify.lines(v)))
        search_verify.write(path, v)
    elif cfg.search.verify:
        print("verify: no candidate survived, nothing to train")
    if not res.ranked:
        return search_objective.WORST
    best = res.ranked[0]
    return search_objective.of_plan(cfg, {"estimated_step_time_s": best.step_s, "estimated_mfu": best.mfu})


def _launch_plan(cfg: RunConfig, lay, dcfg: DictConfig, run_dir: Path) -> None:
    """Print the submission (sbatch script) and the per-node command; submit nothing."""
    from runner.run import launch

    frozen = freeze.write(cfg, lay, run_dir)
    c = cfg.cluster
    per_node = lay.world_size // c.num_nodes
    print(f"launch plan: {count(lay.world_size, 'rank')} = {count(c.num_nodes, 'node')} x {per_node} per node [{lay.describe()}]")
    print(f"frozen config: {frozen}")
    if c.launcher == "slurm":
        params, job_dir = slurm.submission(dcfg)
        if job_dir != run_dir:
            print(f"submitted with -m, this command runs as job 0 in {job_dir}; the paths below are that job's")
        print("\nsbatch script (what hydra-submitit-launcher submits for `python -m runner -m ...`; nothing is submitted):\n")
        print(slurm.sbatch_script(params))
        frozen = job_dir / runfiles.FROZEN
        host, rdzv_id = c.rdzv_host or slurm.FIRST_NODE, "$SLURM_JOB_ID"
        print("\neach node of the job runs (in the submitted Hydra task, in-process):\n")
    else:
        host, rdzv_id = c.rdzv_host or "$HEAD_NODE_ADDR", f"runner-{run_dir.name}"
        print(f"\nrun on each of the {count(c.num_nodes, 'node')}:\n")
    print("  " + launch.node_command(cfg, lay, frozen, rdzv_endpoint=f"{host}:{c.rdzv_port}", rdzv_id=rdzv_id))


def _dryrun(cfg: RunConfig, lay, run_dir: Path) -> None:
    """Play the chosen ranks of the layout on fake tensors in this process; print and write dryrun.json beside the plan."""
    from runner.config import plan
    from runner.config.dryrun import report as dryrun_report

    ranks = dryrun_report.ranks(cfg, lay)
    freeze.write(cfg, lay, run_dir)
    from runner.run.dryrun import rehearse as dryrun

    rep = dryrun_report.report(cfg, lay, plan.compute(cfg, lay), dryrun.rehearse(cfg, lay, ranks, run_dir))
    print(dryrun_report.render(rep))
    print(f"dry run written to {dryrun_report.write(rep, run_dir)}")


def _check_and_report(cfg: RunConfig, dcfg: DictConfig, run_dir: Path):
    """Validate, then run a mode that starts nothing: (True, its objective) when it ran, (False, layout) otherwise."""
    if cfg.mode == Mode.search:  # searches the layouts: the configured one need not fit this cluster
        return True, _search(cfg, run_dir)
    lay = validate.check(cfg)
    if cfg.mode == Mode.validate:
        print(_report(cfg, lay))
        _discard(run_dir)  # a check, not a run: leave no folder behind
        return True, None
    if cfg.mode == Mode.plan:
        return True, _plan(cfg, lay, run_dir)
    if cfg.mode == Mode.launch_plan:
        _launch_plan(cfg, lay, dcfg, run_dir)
        return True, None
    if cfg.mode == Mode.dryrun:
        _dryrun(cfg, lay, run_dir)
        return True, None
    validate.preflight(cfg, run_dir, lay)
    return False, lay


@hydra.main(version_base="1.3", config_path=str(compose.CONF), config_name="config")
def main(dcfg: DictConfig) -> float | None:
    """The Hydra task: returns the config's objective (a float an optimizing sweeper minimizes; +inf for an
    invalid or failed point) where the mode has one."""
    global _entered
    _entered = True
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        cfg = compose.to_object(dcfg)
        done, result = _check_and_report(cfg, dcfg, run_dir)
        if done:
            return result
        lay = result
    except (validate.ConfigError, OmegaConfBaseException) as e:
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            return _invalid_sweep_point(e, run_dir)
        _fail(str(e) if isinstance(e, validate.ConfigError) else f"Invalid config: {e}", run_dir)
    if slurm.in_job():
        node, _, first_host, job_id = slurm.job_nodes()
    else:
        node, first_host, job_id = 0, None, None
    requeued = slurm.restart_count() > 0  # SLURM requeued this job: resume in its own run folder (runner.run.preempt)
    if node == 0 and (run_dir / runfiles.FROZEN).exists() and not requeued:
        _fail(f"Run folder {run_dir} already holds a run. Fix: set hydra.run.dir to a new folder.", run_dir)
    if HydraConfig.get().mode == RunMode.MULTIRUN and cfg.logging.wandb.group is None:
        # one W&B group per sweep, passed to the ranks through wandb's own variable rather than frozen,
        # so that a replay of frozen.yaml gets a group of its own instead of joining this sweep's
        os.environ["WANDB_RUN_GROUP"] = wandb_group(Path(HydraConfig.get().sweep.dir))
    frozen = run_dir / runfiles.FROZEN
    if node == 0 and not requeued:
        freeze.pin(cfg, run_dir)
        freeze.write(cfg, lay, run_dir)
    else:
        slurm.wait_for(frozen)  # the first node writes it; all nodes share the run folder
    from runner.run import launch

    try:
        if job_id is None:
            launch.run(cfg, lay, frozen, checked=True)
        else:
            _slurm_node(cfg, lay, run_dir, frozen, first_host, job_id)
    except Exception as e:  # a rank failed: the agent printed which one and where its log is
        record = _failed_point(e, run_dir)
        where = f"rank logs in {record['logs']}; recorded in {run_dir / runfiles.FAILED}"
        print(f"training failed: {record['error']}; {where}", file=sys.stderr)
        if HydraConfig.get().mode != RunMode.MULTIRUN or job_id is not None:  # a SLURM job reports its own failure
            sys.exit(1)
        _failed.append(" ".join(record["overrides"]))  # the sweep goes on; cli() exits 1 at its end
        return search_objective.WORST
    return _run_objective(cfg, run_dir) if node == 0 else None


def _run_objective(cfg: RunConfig, run_dir: Path) -> float:
    """The measured objective of a finished run, from its summary.json."""
    path = run_dir / runfiles.SUMMARY
    if not path.is_file():  # another node of a SLURM job wrote it, or the run logged no step
        return search_objective.WORST
    try:
        return search_objective.of_run(cfg, json.loads(path.read_text()))
    except validate.ConfigError as e:  # the run itself is kept: only the objective is missing
        print(str(e), file=sys.stderr)
        if HydraConfig.get().mode != RunMode.MULTIRUN:
            sys.exit(2)
        return search_objective.WORST


def _slurm_node(cfg: RunConfig, lay, run_dir: Path, frozen: Path, first_host: str, job_id: str) -> None:
    """A node of a SLURM job: torchrun with a c10d rendezvous on the job's first node. SLURM's warning
    signal goes to submitit's requeue only once the ranks have checkpointed (runner.run.preempt)."""
    from runner.run import launch, mesh, preempt

    if slurm.node_name():
        os.environ.setdefault(mesh.NODE_NAME_ENV, slurm.node_name())  # nodes may share a hostname
    takeover = preempt.AgentTakeover(run_dir)
    endpoint = f"{cfg.cluster.rdzv_host or first_host}:{cfg.cluster.rdzv_port}"
    launch.start(launch.torchrun_flags(cfg, lay, run_dir, rdzv_endpoint=endpoint, rdzv_id=job_id), frozen, checked=True)
    takeover.hand_over()


def wandb_group(sweep_dir: Path) -> str:
    """The sweep folder's full path names the sweep unambiguously (the last two parts repeat across
    roots); W&B allows 128 characters, so a longer path keeps its end and a hash of the whole."""
    full = str(sweep_dir.resolve())
    if len(full) <= 128:
        return full
    return f"...{full[-110:]}-{hashlib.sha1(full.encode()).hexdigest()[:10]}"


def _failed_point(e: Exception, run_dir: Path) -> dict:
    """failed.json: a run whose ranks failed is a result too (runner.compare lists it)."""
    from runner.observe import forensics

    failures = getattr(e, "failures", {})  # torch's ChildFailedError: rank -> ProcessFailure
    records = forensics.read_records(run_dir)  # each rank's own exception line, when it could write one
    ranks = {
        str(r): {"exit_code": f.exitcode, "error": (records.get(r) or {}).get("error") or _first_line(f.message)}
        for r, f in sorted(failures.items())
    }
    first = next(iter(ranks.values()), {"exit_code": 1, "error": f"{type(e).__name__}: {e}"})
    record = {
        "overrides": list(HydraConfig.get().overrides.task),
        "exit_code": first["exit_code"],
        "error": first["error"],
        "failed_ranks": ranks,
        "logs": str(run_dir / runfiles.LOGS),
        "report": next((str(run_dir / n) for n in (runfiles.FAILURE_REPORT, runfiles.HANG_REPORT) if (run_dir / n).is_file()), None),
    }
    (run_dir / runfiles.FAILED).write_text(json.dumps(record, indent=2) + "\n")
    return record


def _first_line(message: str | dict) -> str:
    """The exception line of a rank's error (torch's error file, a dict when the rank was forked, holds the whole traceback)."""
    if isinstance(message, dict):
        message = message.get("message", message)
    lines = [ln for ln in str(message).strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "unknown error"


_SETS_MODE = re.compile(r"^[ \t]+mode:[ \t]*(RUN|MULTIRUN)\b|hydra\.mode", re.M)


def mode_probe_needed(overrides: list[str], conf: Path = compose.CONF) -> bool:
    """Whether `hydra.mode` may be set by something other than `-m`.

    Before running, Hydra composes the whole config once just to read `hydra.mode` (`Hydra.get_mode`),
    then composes it again to run: about 0.35 s of a 1.4 s plan. Only the files that set
    `hydra.mode` (the sweeps) can make that first composition matter, so it is needed only when
    the command line names their group, sets `hydra.mode` itself, or picks another config folder,
    or when a file of another group sets or pulls in such a file. Any doubt keeps Hydra's probe."""
    if any(a.startswith(("-cd", "-cn", "-cp", "--config")) for a in overrides):
        return True
    files = {f: f.read_text() for f in [conf / "config.yaml", *conf.glob("*/*.yaml")]}
    groups = {f.parent.name for f, text in files.items() if f.parent != conf and _SETS_MODE.search(text)}
    pulls = re.compile(rf"^\s*-\s*(override\s+)?/?({'|'.join(map(re.escape, groups))})\s*:[ \t]*(?![ \t]|null\b)", re.M) if groups else None
    for f, text in files.items():
        if f.parent.name in groups:
            continue
        if _SETS_MODE.search(text) or (pulls and pulls.search(text)):
            return True
    for a in overrides:
        key = a.split("=", 1)[0].lstrip("+~")
        if key.startswith("hydra.mode") or key.split("/")[0].split(".")[0] in groups or key.startswith("hydra/"):
            return True
    return False


def _skip_mode_probe() -> None:
    """Let Hydra take the mode from `-m` alone (its answer when no file sets it) without composing."""
    from hydra._internal.hydra import Hydra

    Hydra.get_mode = lambda self, config_name, overrides: None


def cli() -> None:
    if not mode_probe_needed(sys.argv[1:]):
        _skip_mode_probe()
    try:
        main()
    except SystemExit as e:
        if e.code == 1 and not _entered:  # Hydra rejected the command line or a config file
            print("Fix the override or config file named above; `python -m runner --help` lists the groups.", file=sys.stderr)
            sys.exit(2)
        if "torch" in sys.modules and isinstance(e.code, int):
            _fast_exit(e.code)
        raise
    code = 0
    if _failed:
        print(f"{count(len(_failed), 'sweep point')} failed (failed.json in each run folder): " + "; ".join(_failed), file=sys.stderr)
        code = 1
    if "torch" in sys.modules:  # a launch: skip the interpreter's ~3 s teardown of torch and TorchTitan
        _fast_exit(code)
    sys.exit(code)


def _fast_exit(code: int) -> None:
    from runner.run import procs

    procs.exit_now(code)


if __name__ == "__main__":
    cli()
