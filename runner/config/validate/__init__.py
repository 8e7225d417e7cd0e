"""Every rule that can reject a config before a process starts.

Torch-free. Problems are collected and raised once; each names the field, the value,
why it is wrong and the fix. `check` runs every rule that can run (a wrong world size does
not hide a wrong TP degree); the rules live by subject in the validate_* modules. `check`
holds rules about the config itself (valid for any cluster, including ones this machine
cannot run); runner.config.validate.launch adds the rules about starting it here.
"""

from __future__ import annotations

from runner.config import layout, memory
from runner.config.problems import ConfigError, Problem
from runner.config.schema import ActivationCheckpoint, DeviceType, Fp8Recipe, Mode, ReshardPolicy, RunConfig
from runner.config.validate import checkpoint as validate_ckpt
from runner.config.validate import eval as validate_eval
from runner.config.validate import fields as validate_fields
from runner.config.validate import layout as validate_layout
from runner.config.validate import model as validate_model
from runner.config.validate import monitor as validate_monitor
from runner.config.validate import pipeline as pipeline_rules

__all__ = ["ConfigError", "check", "machine_memory_gb", "rank_memory_gb"]


def _layout_rules(cfg: RunConfig, out: list[Problem]) -> layout.Layout | None:
    """World size, degrees, batch and pipeline, EP and FP8 shapes, each on what the config fixes."""
    model_ok = not any(p.field.startswith("model.") for p in out)
    ws = validate_layout.world(cfg, out)
    lay = validate_layout.resolved(cfg, ws)
    degrees = validate_layout.degrees_ok(cfg.parallelism)
    if degrees:
        validate_layout.tensor_parallel(cfg, ws, out)
    pipeline_rules.batch(cfg, lay, pipeline_rules.schedule_name(cfg, out), out)
    validate_layout.experts(cfg, lay, out)
    if cfg.precision.fp8 != Fp8Recipe.none and model_ok and degrees and validate_layout.tp_divides_heads(cfg):
        validate_model.fp8_shapes(cfg, out)
    validate_layout.sequence(cfg, out)
    validate_layout.async_tp(cfg, out)
    return lay if ws is not None else None


def check(cfg: RunConfig) -> layout.Layout:
    """Raise ConfigError listing every problem; return the resolved layout."""
    out: list[Problem] = []
    validate_fields.training(cfg, out)
    validate_model.check(cfg, out)
    lay = _layout_rules(cfg, out)
    validate_fields.device(cfg, out)
    validate_fields.cluster(cfg, out)
    if cfg.precision.fp8 != Fp8Recipe.none:
        validate_model.fp8_device(cfg, out)
    validate_monitor.check(cfg, lay.world_size if lay else None, out)
    validate_ckpt.check(cfg, out)
    validate_eval.check(cfg, out)
    if lay is not None:
        _dryrun_ranks(cfg, lay, out)
    if not out and lay is not None:
        _device_memory(cfg, lay, out)
    if out:
        raise ConfigError(out)
    return lay


def _dryrun_ranks(cfg: RunConfig, lay: layout.Layout, out: list[Problem]) -> None:
    bad = [r for r in cfg.dryrun.ranks if not 0 <= r < lay.world_size]
    if bad:
        out.append(
            Problem(
                "dryrun.ranks",
                cfg.dryrun.ranks,
                f"{bad} outside the layout's {lay.world_size} ranks",
                f"pick ranks in 0..{lay.world_size - 1}",
            )
        )


def _device_memory(cfg: RunConfig, lay: layout.Layout, out: list[Problem]) -> None:
    """The plan's memory verdict, for a GPU cluster that states its memory. mode=plan (and mode=dryrun) print the
    verdict as its memory row instead, so that a sweep tabulates the layouts that do not fit."""
    c = cfg.cluster
    if c.device != DeviceType.cuda or c.device_memory_gb <= 0 or cfg.mode in (Mode.plan, Mode.dryrun):  # those two measure it
        return
    from runner.config import plan  # the plan's own memory model; imported here, as only GPU configs need it

    b = plan.compute(cfg, lay)
    if b["fits_memory"]:
        return
    fixes = ["raise parallelism.pp or parallelism.tp (weights and gradients are split over tp x pp)"]
    if cfg.training.activation_checkpoint == ActivationCheckpoint.none:
        fixes.append("set training.activation_checkpoint=full")
    if cfg.training.microbatch_size > 1:
        fixes.append("lower training.microbatch_size")
    if cfg.parallelism.fsdp_reshard_after_forward != ReshardPolicy.always and b["weights_gathered_during_step"] and lay.dp_shard > 1:
        fixes.append("set parallelism.fsdp_reshard_after_forward=always")
    out.append(
        Problem(
            "parallelism",
            lay.describe(),
            f"needs {b['total_gb_per_gpu']:.1f} GB per GPU (weights + gradients {b['weights_grads_gb_per_gpu']:.1f}, "
            f"optimizer {b['optimizer_gb_per_gpu']:.1f}, activations {b['activations_gb_per_gpu']:.1f} for "
            f"{b['microbatches_in_flight']} microbatches in flight), more than the {c.device_memory_gb:g} GB of a "
            f"{c.name} GPU (cluster.device_memory_gb)",
            "; or ".join(fixes) + " (mode=plan shows the budget)",
        )
    )


def machine_memory_gb() -> float:
    """Total RAM of this machine from /proc/meminfo (GB)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / 1e9
    raise RuntimeError("MemTotal missing from /proc/meminfo")


rank_memory_gb = memory.cpu_rank_gb  # the CPU rank estimate, on the plan's activation model
