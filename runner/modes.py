"""The modes that start no training: each prints what it is for and writes its files into the run folder.
Every one takes (config, layout, the composed DictConfig, run folder) and returns the objective an
optimizing sweeper minimizes, or None. Torch-free except the dry run, which imports the rehearsal."""

from __future__ import annotations

from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from runner import sweep
from runner.config import fault_tolerance, freeze, slurm
from runner.config.search import objective as search_objective
from runner.estimate import flops, precision
from runner.estimate.predict import fp8_cost as fp8_model
from runner.formats import runfiles
from runner.schema import DeviceType, Fp8Recipe, RunConfig
from runner.schema.layout import Layout, label
from runner.schema.wording import count


def validate(cfg: RunConfig, lay: Layout, dcfg: DictConfig, run_dir: Path) -> None:
    """Print the resolved layout, batch, FLOPs and precision; a check, not a run: leave no folder behind."""
    print(_report(cfg, lay))
    sweep.discard(run_dir)


def plan(cfg: RunConfig, lay: Layout, dcfg: DictConfig, run_dir: Path) -> float:
    """Print the step budget (one line per point in a sweep) and write plan.json + frozen.yaml; start nothing.
    Returns the objective (predicted step time or MFU) for an optimizing sweeper."""
    from runner.estimate import host_memory
    from runner.estimate import plan as plan_mod

    device_gb = host_memory.machine_memory_gb() / lay.world_size if cfg.cluster.device.value == "cpu" else None
    budget = plan_mod.compute(cfg, lay, device_memory_gb=device_gb)
    budget["overrides"] = list(HydraConfig.get().overrides.task)
    if sweep.multirun():
        print(plan_mod.one_line(budget))
    else:
        c = cfg.checkpoint
        plan_mod.render(budget, c.interval if c.enable else None, c.local.interval if c.enable and c.local.folder else None)
    freeze.write(cfg, lay, run_dir)
    print(f"plan written to {plan_mod.write(budget, run_dir)}")
    return search_objective.of_plan(cfg, budget)


def search(cfg: RunConfig, lay: None, dcfg: DictConfig, run_dir: Path) -> float:
    """Search every layout of the model on the cluster; print the report, write search.json and the top-k sweep;
    with search.verify=k, train the top k here briefly and print measured beside predicted. No candidate left: the
    report, then the binding reason as a ConfigError (exit 2; in a multirun an invalid point), and no files."""
    from runner.config import search as search_mod
    from runner.config.search import render as search_render
    from runner.config.search import verdict
    from runner.config.search import verify as search_verify

    res = search_mod.run(cfg)
    if not res.ranked:
        print("\n".join(search_render.lines(cfg, res)))
        raise verdict.nothing_survived(cfg, res)
    path, cmd = search_render.write(cfg, res, run_dir, list(HydraConfig.get().overrides.task))
    print("\n".join(search_render.lines(cfg, res, cmd)))
    print(f"search written to {path}")
    k = min(cfg.search.verify, len(res.ranked))
    if k:
        v = search_verify.run(res, run_dir, k, cfg.search.verify_steps)
        print("\n".join(search_verify.lines(v)))
        search_verify.write(path, v)
    best = res.ranked[0]
    return search_objective.of_plan(cfg, {"estimated_step_time_s": best.step_s, "estimated_mfu": best.mfu})


def launch_plan(cfg: RunConfig, lay: Layout, dcfg: DictConfig, run_dir: Path) -> None:
    """Print the submission (sbatch script) and the per-node command; submit nothing."""
    from runner.run import node_launch

    frozen = freeze.write(cfg, lay, run_dir)
    c = cfg.cluster
    if fault_tolerance.enabled(cfg):
        from runner.run import ft_launch

        print(f"launch plan (fault_tolerance=torchft): {count(lay.world_size, 'rank')} in {count(lay.dp_replicate, 'replica group')}")
        print(ft_launch.plan(cfg, lay, run_dir))
        return
    per_node = lay.world_size // c.num_nodes
    print(f"launch plan: {count(lay.world_size, 'rank')} = {count(c.num_nodes, 'node')} x {per_node} per node [{lay.describe()}]")
    print(f"frozen config: {frozen}")
    if c.launcher == "slurm":
        frozen = _sbatch_preview(dcfg, run_dir) / runfiles.FROZEN
        host, rdzv_id = c.rdzv_host or slurm.FIRST_NODE, "$SLURM_JOB_ID"
        job = "this point's array task" if sweep.multirun() else "the job"
        print(f"\neach node of {job} runs (in the submitted Hydra task, in-process):\n")
    else:
        host, rdzv_id = c.rdzv_host or "$HEAD_NODE_ADDR", f"runner-{run_dir.name}"
        print(f"\nrun on each of the {count(c.num_nodes, 'node')}:\n")
    print("  " + node_launch.node_command(cfg, lay, frozen, rdzv_endpoint=f"{host}:{c.rdzv_port}", rdzv_id=rdzv_id))


def _sbatch_preview(dcfg: DictConfig, run_dir: Path) -> Path:
    """Print the sbatch script of this command submitted with -m (under -m the sweeper has printed the one array job
    of all the points already: runner_sweeper.ArrayPreview); return the run folder of the job that runs it."""
    if sweep.multirun():
        return run_dir
    params, job_dir = slurm.submission(dcfg)
    if job_dir != run_dir:
        print(f"submitted with -m, this command runs as job 0 in {job_dir}; the paths below are that job's")
    print("\nsbatch script (what hydra-submitit-launcher submits for `python -m runner -m ...`; nothing is submitted):\n")
    print(slurm.sbatch_script(params))
    return job_dir


def dryrun(cfg: RunConfig, lay: Layout, dcfg: DictConfig, run_dir: Path) -> None:
    """Play the chosen ranks of the layout on fake tensors in this process; print and write dryrun.json beside the plan."""
    from runner.estimate import dryrun_report, plan

    ranks = dryrun_report.ranks(cfg, lay)
    frozen = freeze.write(cfg, lay, run_dir)
    if cfg.dryrun.device == DeviceType.cuda:
        measured = _cuda_rehearsal(cfg, frozen, ranks, run_dir)
    else:
        from runner.run.dryrun import rehearse as dryrun

        measured = dryrun.rehearse(cfg, lay, ranks, run_dir)
    rep = dryrun_report.report(cfg, lay, plan.compute(cfg, lay), measured)
    print(dryrun_report.render(rep))
    print(f"dry run written to {dryrun_report.write(rep, run_dir)}")


FP8_TERMS = (
    "  FP8 costs mode=plan prices as their own terms: fp8_cast (the cast and scale kernels), fp8_amax (tensorwise amax "
    "all-reduces over TP); the converted GEMMs in compute at the FP8 rate (runner/estimate/predict/fp8_cost.py)"
)
"""mode=validate's line naming an FP8 recipe's cost terms (GPU clusters: the datasheet predictor's FP8 model)."""


def _cuda_rehearsal(cfg: RunConfig, frozen: Path, ranks: list[int], run_dir: Path) -> dict:
    """dryrun.device=cuda: the ranks on fake CUDA tensors in .venv-cuda's interpreter (runner.run.dryrun.cuda_env.launch;
    torch-free here). A rank that fails is a RuntimeError with its traceback, as in the CPU dry run."""
    from runner.run.dryrun import cuda_env

    job = {"frozen": str(frozen), "ranks": ranks, "run_dir": str(run_dir), "gpu": cuda_env.gpu(cfg.cluster)}
    (res,) = cuda_env.launch([job], Path(__file__).resolve().parent.parent, run_dir)
    if "error" in res:
        raise RuntimeError(f"CUDA rehearsal failed:\n{res['error']}")
    return res["result"]


def _precision_lines(cfg: RunConfig) -> list[str]:
    pr = cfg.precision
    gemm, emulated = precision.matmul_peak(cfg)
    dtype = precision.mfu_peak(cfg, measured=gemm not in cfg.cluster.peak_tflops)
    peak = cfg.cluster.peak_tflops.get(dtype)
    mfu = f"  MFU against the {dtype} dense peak" + (f", {peak:g} TFLOP/s per device" if peak else " (measured at start-up)")
    experts = [f"  routed experts: {precision.grouped_experts(cfg)}"] if precision.grouped_experts(cfg) else []
    if pr.fp8 == Fp8Recipe.none:
        cast = [FP8_TERMS] if fp8_model.expert_cost(cfg) else []
        return [f"  precision {pr.name}: {pr.param_dtype.value} compute, {pr.reduce_dtype.value} reduce", mfu, *cast, *experts]
    converted, kept = precision.conversion(cfg)
    gemm_peak = cfg.cluster.peak_tflops.get(gemm)
    if gemm != dtype:
        mfu += f"; mfu_of_gemm_peak against the {gemm} one" + (f", {gemm_peak:g} TFLOP/s" if gemm_peak else "")
    return [
        f"  precision {pr.name}: {len(converted)} of {len(converted) + len(kept)} Linear layers in FP8 {pr.fp8.value} "
        f"(kept in {pr.param_dtype.value}: {precision.by_pattern(kept) or 'none'})",
        mfu + (" (FP8 emulated on CPU)" if emulated else ""),
        *([FP8_TERMS] if fp8_model.cost(cfg) or fp8_model.expert_cost(cfg) else []),
        *experts,
    ]


def _report(cfg: RunConfig, lay: Layout) -> str:
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
