"""Range and choice rules of single fields (training, logging, cluster, plan) and the device rules.

Torch-free; called by validate.check. Each bound is what torch, TorchTitan or torchao would
refuse at start-up, or what would silently turn a feature off.
"""

from __future__ import annotations

import dataclasses
import math
import re

from runner.config.validate.layout_rules import DEGREES
from runner.estimate import flops, precision
from runner.schema import Backend, DeviceType, DType, Fp8Recipe, Launcher, Mode, RunConfig, SlurmConfig, WorkerStart
from runner.schema.problems import Problem

DEVICE_DTYPES = {DeviceType.cpu: ("float32", "bfloat16"), DeviceType.cuda: ("float32", "bfloat16")}
SEED_LIMIT = 2**32  # runner.run.loader seeds torch.Generator with seed x 1,000,003 + sample index, which must fit 64 bits
PORTS = range(1, 65536)


def _choice(field: str, value: object, choices: tuple[str, ...], what: str, out: list[Problem]) -> None:
    if value not in choices:
        out.append(Problem(field, value, f"not {what}", f"use one of {', '.join(choices)}"))


def training(cfg: RunConfig, out: list[Problem]) -> None:
    p, t = cfg.parallelism, cfg.training
    for name in DEGREES:
        if getattr(p, name) < 1:
            out.append(Problem(f"parallelism.{name}", getattr(p, name), "a degree must be >= 1", "use 1 to turn the axis off"))
    if p.dp_shard < 1 and p.dp_shard != -1:
        fix = "use -1 to absorb the remaining ranks"
        if cfg.cluster.devices_per_node == -1:  # the layout sizes the job: -1 has nothing to absorb (validate.layout)
            fix = f"use a degree >= 1, e.g. parallelism.dp_shard=1 (cluster {cfg.cluster.name} takes its world size from the layout)"
        out.append(Problem("parallelism.dp_shard", p.dp_shard, "must be >= 1 or -1", fix))
    for name in ("steps", "seq_len", "global_batch_size", "microbatch_size"):
        if getattr(t, name) < 1:
            out.append(Problem(f"training.{name}", getattr(t, name), "must be >= 1", f"set training.{name} to a positive integer"))
    if t.ac_layer_frequency < 1:
        out.append(Problem("training.ac_layer_frequency", t.ac_layer_frequency, "must be >= 1", "use e.g. 2 (every second block)"))
    if not 0 <= t.seed < SEED_LIMIT:
        out.append(Problem("training.seed", t.seed, "must be in [0, 2**32) (the data seeds torch generators from it)", "use e.g. 0"))
    if t.gc_every < 0:
        out.append(Problem("training.gc_every", t.gc_every, "must be >= 0", "use 0 to leave Python's automatic collection on, e.g. 50"))
    if not t.max_norm > 0:
        out.append(Problem("training.max_norm", t.max_norm, "clipping to a norm <= 0 zeroes every gradient", "use e.g. 1.0"))
    if cfg.logging.log_every < 1:
        out.append(Problem("logging.log_every", cfg.logging.log_every, "must be >= 1", "log every N >= 1 steps"))
    if cfg.checkpoint.interval < 1:
        out.append(Problem("checkpoint.interval", cfg.checkpoint.interval, "must be >= 1", "save every N >= 1 steps"))
    _choice("plan.flops_convention", cfg.plan.flops_convention, flops.CONVENTIONS, "a FLOP convention", out)
    if not cfg.plan.moe_imbalance >= 1:
        why = "the busiest EP rank receives at least the mean of the routed tokens"
        out.append(
            Problem("plan.moe_imbalance", cfg.plan.moe_imbalance, why, "use 1.0 for perfect balance, e.g. 1.3 for a 30 % hotter rank")
        )
    _optimizer(cfg, out)
    _schedule(cfg, out)
    _search(cfg, out)


def _optimizer(cfg: RunConfig, out: list[Problem]) -> None:
    """What torch's Adam and AdamW refuse at construction, and parameter-group patterns that are not regexes (a pattern
    that matches no parameter is refused before launch, where the model's names are known: runner.run.titan.optim)."""
    o = cfg.optimizer
    if not (o.lr > 0 and math.isfinite(o.lr)):
        out.append(Problem("optimizer.lr", o.lr, f"{o.name.value} needs a positive learning rate (0 trains nothing)", "use e.g. 3e-4"))
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        out.append(Problem("optimizer.betas", list(o.betas), "Adam takes two betas, each in [0, 1)", "use optimizer.betas=[0.9,0.95]"))
    if not o.eps > 0:
        out.append(Problem("optimizer.eps", o.eps, "must be > 0 (it keeps the update finite)", "use e.g. 1e-8"))
    if not o.weight_decay >= 0:
        out.append(
            Problem("optimizer.weight_decay", o.weight_decay, f"{o.name.value} rejects a negative weight decay", "use 0 for none, e.g. 0.1")
        )
    for i, g in enumerate(o.param_groups):
        field, norm = f"optimizer.param_groups[{i}]", _replaced(o.param_groups, i, pattern="norm")
        try:
            re.compile(g.pattern)
        except re.error as e:
            out.append(Problem(f"{field}.pattern", g.pattern, f"not a regular expression ({e})", f"fix the pattern, e.g. {norm}"))
        if not g.pattern:
            out.append(
                Problem(f"{field}.pattern", g.pattern, "an empty pattern takes every parameter", f"name the parameters, e.g. {norm}")
            )
        if not g.weight_decay >= 0:
            fixed = _replaced(o.param_groups, i, weight_decay=0.0)
            out.append(Problem(f"{field}.weight_decay", g.weight_decay, "must be >= 0", f"use 0 for none: {fixed}"))


def _replaced(groups: list, i: int, **change) -> str:
    """The override of the groups with group i's fields changed: a fix that names the whole list, as it is given."""
    return param_groups_override([dataclasses.replace(g, **change) if k == i else g for k, g in enumerate(groups)])


def param_groups_override(groups) -> str:
    """`optimizer.param_groups=[...]`: the groups as one command-line override (quote it for the shell)."""
    return "optimizer.param_groups=[" + ",".join(f"{{pattern:'{g.pattern}',weight_decay:{g.weight_decay}}}" for g in groups) + "]"


def _schedule(cfg: RunConfig, out: list[Problem]) -> None:
    """The schedule's own numbers. A warm-up or decay longer than training.steps is not wrong in itself (a one-step
    smoke run keeps the default warm-up): TorchTitan clips it to the run, and `warnings` says so in one line."""
    s = cfg.lr_scheduler
    if s.warmup_steps < 0:
        out.append(Problem("lr_scheduler.warmup_steps", s.warmup_steps, "must be >= 0", "use 0 for no warm-up"))
    if s.decay_ratio is not None and not 0 <= s.decay_ratio <= 1:
        out.append(
            Problem("lr_scheduler.decay_ratio", s.decay_ratio, "a share of training.steps must be in [0, 1]", "use e.g. 0.2, or null")
        )
    if not 0 <= s.min_lr_factor <= 1:
        out.append(Problem("lr_scheduler.min_lr_factor", s.min_lr_factor, "must be in [0, 1] (a share of optimizer.lr)", "use e.g. 0.1"))


def schedule_steps(cfg: RunConfig) -> tuple[int, int]:
    """(warm-up, decay) steps of the schedule the run trains, as TorchTitan's LRSchedulersContainer.Config.build
    computes them ("Adjusting warmup steps"): a warm-up longer than training.steps is clipped to it, then a decay
    (decay_ratio) that does not fit after the warm-up to what is left. For a config whose numbers validate."""
    s, steps = cfg.lr_scheduler, cfg.training.steps
    warmup = min(s.warmup_steps, steps)
    decay = steps - warmup if s.decay_ratio is None else round(steps * s.decay_ratio)
    return warmup, min(decay, steps - warmup)


def _clipped_schedule(cfg: RunConfig) -> Problem | None:
    """One line when the run trains a shorter warm-up or decay than configured (TorchTitan's clipping)."""
    s, steps = cfg.lr_scheduler, cfg.training.steps
    if steps < 1 or s.warmup_steps < 0 or (s.decay_ratio is not None and not 0 <= s.decay_ratio <= 1):
        return None  # refused by the rules above
    warmup, decay = schedule_steps(cfg)
    asked = steps - s.warmup_steps if s.decay_ratio is None else round(steps * s.decay_ratio)
    if warmup == s.warmup_steps and decay == asked:
        return None
    what = f"warm-up {s.warmup_steps}" + ("" if s.decay_ratio is None else f" + decay {asked} (decay_ratio {s.decay_ratio})")
    fix = [f"lr_scheduler.warmup_steps={warmup}"] * (warmup < s.warmup_steps) + ["lr_scheduler.decay_ratio=null"] * (decay < asked)
    return Problem(
        "lr_scheduler.warmup_steps",
        s.warmup_steps,
        f"{what} steps are longer than training.steps = {steps}; the run warms up over {warmup} and decays over {decay} "
        "(TorchTitan's clipping)",
        f"{' '.join(fix)} configures that schedule and silences this warning",
    )


def warnings(cfg: RunConfig) -> list[Problem]:
    """What runs but is likely not what was meant: printed before the mode runs, never refused (validate.warnings)."""
    clipped = _clipped_schedule(cfg)
    return [clipped] if clipped else []


def _search(cfg: RunConfig, out: list[Problem]) -> None:
    """mode=search's bounds, and an objective a plan can return (it trains nothing, so it has no loss)."""
    s = cfg.search
    for name, least in (("top_k", 1), ("max_virtual_stages", 2), ("max_cp", 1), ("max_microbatch_size", 1)):
        if getattr(s, name) < least:
            out.append(Problem(f"search.{name}", getattr(s, name), f"must be >= {least}", f"set search.{name} to at least {least}"))
    _verify(cfg, out)
    if cfg.mode.value in ("plan", "search") and cfg.objective.value in ("final_loss", "eval_loss"):
        out.append(
            Problem(
                "objective", cfg.objective.value, f"mode={cfg.mode.value} trains nothing, so it has no loss", "use step_time or neg_mfu"
            )
        )


def _verify(cfg: RunConfig, out: list[Problem]) -> None:
    """search.verify trains the top candidates in a child process on this machine: a cluster whose runs start
    elsewhere (SLURM, several nodes) cannot be measured from here, and one step alone is all warm-up."""
    s, c = cfg.search, cfg.cluster
    if s.verify < 0:
        out.append(Problem("search.verify", s.verify, "must be >= 0 (0 = off)", "set search.verify=0, or k > 0 to train the top k"))
    elif s.top_k >= 1 and s.verify > s.top_k:  # a top_k below 1 is its own rule's
        out.append(
            Problem(
                "search.verify",
                s.verify,
                f"trains candidates of the written sweep, which holds search.top_k = {s.top_k}",
                f"set search.verify to at most {s.top_k}, or search.top_k={s.verify}",
            )
        )
    if s.verify <= 0:
        return
    if c.launcher != Launcher.local or c.num_nodes != 1:
        where = f"launcher {c.launcher.value}" if c.launcher != Launcher.local else f"{c.num_nodes} nodes"
        out.append(
            Problem(
                "search.verify",
                s.verify,
                f"trains the candidates on this machine, and cluster {c.name} starts its runs elsewhere ({where})",
                "set search.verify=0 and run the written sweep on the cluster "
                "(python -m runner --config-dir <run folder>/search sweep=search_top), then python -m runner.compare on it",
            )
        )
    if s.verify_steps < 2:
        out.append(
            Problem(
                "search.verify_steps",
                s.verify_steps,
                "must be >= 2: the first step is warm-up, which the measured median leaves out",
                "set search.verify_steps to at least 2 (e.g. 4)",
            )
        )


def cluster(cfg: RunConfig, out: list[Problem]) -> None:
    c = cfg.cluster
    for name, example in (("achievable_mfu", "0.40"), ("matmul_efficiency", "0.70")):
        if not 0 < getattr(c, name) <= 1:
            out.append(Problem(f"cluster.{name}", getattr(c, name), "is a fraction of peak", f"use a value in (0, 1], e.g. {example}"))
    for name in (
        "mtbf_hours",
        "checkpoint_write_gbs",
        "local_write_gbs",
        "intra_node_bandwidth_gbs",
        "inter_node_bandwidth_gbs",
        "device_memory_gb",
        "memory_bandwidth_gbs",
    ):
        if getattr(c, name) < 0:
            out.append(Problem(f"cluster.{name}", getattr(c, name), "must be >= 0", "use 0 for unknown"))
    if c.rank_overhead_gb < 0:
        out.append(
            Problem("cluster.rank_overhead_gb", c.rank_overhead_gb, "must be >= 0", "use the resident GB of a rank before the model")
        )
    bad_peaks = {k: v for k, v in c.peak_tflops.items() if not v > 0}
    if bad_peaks:
        out.append(Problem("cluster.peak_tflops", bad_peaks, "a dense peak must be > 0 TFLOP/s", "copy the datasheet's dense figure"))
    if c.compute_capability and precision.parse_capability(c.compute_capability) is None:
        out.append(Problem("cluster.compute_capability", repr(c.compute_capability), 'not "major.minor"', 'use e.g. "9.0" for H100'))
    if c.rdzv_port not in PORTS:
        out.append(Problem("cluster.rdzv_port", c.rdzv_port, "not a TCP port", "use a free port in 1..65535, e.g. 29500"))
    if c.max_restarts < 0:
        out.append(Problem("cluster.max_restarts", c.max_restarts, "must be >= 0", "use 0 to never restart"))
    if c.launcher == "slurm":
        _slurm(cfg, out)
    if c.profile is not None:
        _profile(c.profile, out)


def _profile(path: str, out: list[Problem]) -> None:
    """cluster.profile must be a machine profile the predictor can read."""
    from runner.estimate.predict import machine as steptime_machine

    try:
        steptime_machine.load(path)
    except (OSError, ValueError) as e:
        why = f"cannot be read ({e.strerror or e})" if isinstance(e, OSError) else "is not a machine profile (or a newer version)"
        out.append(Problem("cluster.profile", path, why, "write one with `python -m runner.calibrate`, or set cluster.profile=null"))


def _slurm(cfg: RunConfig, out: list[Problem]) -> None:
    c, s = cfg.cluster, cfg.cluster.slurm
    if not s.partition and cfg.mode != Mode.dryrun:  # a dry run (on a login node, before submitting) submits nothing
        out.append(
            Problem("cluster.slurm.partition", s.partition, "SLURM needs a partition to submit to", "set cluster.slurm.partition=<name>")
        )
    if s.gpus_per_node_max < 1:
        out.append(Problem("cluster.slurm.gpus_per_node_max", s.gpus_per_node_max, "must be >= 1", "set the GPUs of one node"))
    elif c.devices_per_node > s.gpus_per_node_max:
        out.append(
            Problem(
                "cluster.devices_per_node",
                c.devices_per_node,
                f"a node of partition {s.partition} has {s.gpus_per_node_max} GPUs (cluster.slurm.gpus_per_node_max)",
                f"use at most {s.gpus_per_node_max} per node and more nodes",
            )
        )
    if s.time_min < 1:
        out.append(Problem("cluster.slurm.time_min", s.time_min, "must be >= 1", "set the job's wall-clock limit in minutes"))
    if s.time_min >= 1 and not 0 < s.signal_s < s.time_min * 60:
        out.append(_signal(s))
    if s.max_requeues < 0:
        out.append(Problem("cluster.slurm.max_requeues", s.max_requeues, "must be >= 0", "use 0 to never requeue at the time limit"))
    for name in ("cpus_per_node", "mem_gb"):
        if getattr(s, name) is not None and getattr(s, name) < 1:
            out.append(Problem(f"cluster.slurm.{name}", getattr(s, name), "must be >= 1", "or null for SLURM's default"))


def _signal(s: SlurmConfig) -> Problem:
    """SLURM's warning must fall inside the job: suggest a value that does, and the time limit that fits the given one."""
    limit = s.time_min * 60
    example = min(SlurmConfig().signal_s, limit // 2)  # the schema's default, unless the job is too short for it
    fits = f", or cluster.slurm.time_min={s.signal_s // 60 + 1} to keep it" if s.signal_s > 0 else ""
    return Problem(
        "cluster.slurm.signal_s",
        s.signal_s,
        f"SLURM's warning must come after the start and before the time limit ({limit} s)",
        f"give the seconds a step and a checkpoint need, below {limit}, e.g. cluster.slurm.signal_s={example}{fits}",
    )


def _fp32_on_gpu(cfg: RunConfig, out: list[Problem]) -> None:
    """float32 compute on a CUDA cluster, unless precision.allow_fp32_on_gpu says it is meant: fp32 is the CPU default
    (conf/config.yaml), so a GPU composition that names no precision would train at a fraction of the GPU's peak."""
    c, pr = cfg.cluster, cfg.precision
    if c.device != DeviceType.cuda or pr.param_dtype != DType.float32 or pr.allow_fp32_on_gpu:
        return
    peaks = c.peak_tflops
    speed = f" ({peaks['float32']:g} dense TFLOP/s against bf16's {peaks['bfloat16']:g})" if {"float32", "bfloat16"} <= peaks.keys() else ""
    fix = "use cluster.high_precision_dtype=bfloat16" if pr.fp8 != Fp8Recipe.none else "use precision=bf16"
    out.append(
        Problem(
            "precision.param_dtype",
            pr.param_dtype.value,
            f"precision {pr.name} computes in float32 on cluster {c.name}'s CUDA GPUs{speed}; float32 is the CPU default",
            f"{fix}, or set precision.allow_fp32_on_gpu=true to train in float32 on purpose",
        )
    )


def device(cfg: RunConfig, out: list[Problem]) -> None:
    c, pr = cfg.cluster, cfg.precision
    want = {DeviceType.cpu: Backend.gloo, DeviceType.cuda: Backend.nccl}[c.device]
    if c.backend == Backend.nccl and c.device != DeviceType.cuda:
        out.append(
            Problem(
                "cluster.backend",
                "nccl",
                f"NCCL needs CUDA devices; cluster.device is {c.device.value}",
                f"use cluster.backend={want.value}",
            )
        )
    for field, dtype in (("param_dtype", pr.param_dtype), ("reduce_dtype", pr.reduce_dtype)):
        if dtype.value not in DEVICE_DTYPES[c.device]:
            out.append(
                Problem(
                    f"precision.{field}", dtype.value, f"{c.device.value} cannot compute in it", f"use one of {DEVICE_DTYPES[c.device]}"
                )
            )
    _fp32_on_gpu(cfg, out)
    if c.worker_start == WorkerStart.fork and c.device == DeviceType.cuda:
        out.append(
            Problem(
                "cluster.worker_start",
                "fork",
                "a CUDA rank forked from an agent that has imported torch cannot initialize CUDA reliably",
                "use cluster.worker_start=exec",
            )
        )
    peak_dtype = precision.matmul_peak(cfg)[0]
    if c.device == DeviceType.cuda and peak_dtype not in c.peak_tflops:
        out.append(
            Problem(
                "cluster.peak_tflops",
                dict(c.peak_tflops),
                f"has no dense peak for {peak_dtype}, which MFU needs (the dtype of {pr.name}'s matmuls)",
                f"add cluster.peak_tflops.{peak_dtype}",
            )
        )
