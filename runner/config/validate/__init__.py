"""Every rule that can reject a config, in one ordered table that validation, search and the preflight walk.

Torch-free. Each rule appends `Problem`s (field, value, why, fix) to the list it is given; the caller raises
them all at once, so a wrong world size does not hide a wrong TP degree. A rule says what it reads:
- `CONFIG`: the config alone; any cluster, including ones this machine cannot run;
- `LAYOUT`: the parallel degrees as well; search applies it to every candidate layout;
- `FILES`: the files and folders the config names, as this machine sees them now (data, checkpoints to read, folders
  to write): the preflight, which `mode=validate` and `mode=train` both run before any process starts;
- `MACHINE`: this machine as the place the ranks start (how the run is started, driver, memory, torchft): the
  preflight of a launch only, as `mode=validate` checks a config for its cluster from any machine (a login node).
A rule search does not apply says why (`search_skips`); search's own calls (per-candidate memory, the cached
batch rule) are named there. The rules live by subject in this package's modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import runner.config.validate.checkpoint_rules as checkpoint_rules
import runner.config.validate.data_rules as data_rules
import runner.config.validate.eval_rules as eval_rules
import runner.config.validate.expert_rules as expert_rules
import runner.config.validate.fault_tolerance_rules as ft_rules
import runner.config.validate.fields as fields
import runner.config.validate.folder_rules as folder_rules
import runner.config.validate.hf_rules as hf_rules
import runner.config.validate.host_rules as launch_rules
import runner.config.validate.layout_rules as layout_rules
import runner.config.validate.model_rules as model_rules
import runner.config.validate.moe_comm_rules as moe_comm_rules
import runner.config.validate.monitor_rules as monitor_rules
import runner.config.validate.pipeline_rules as pipeline_rules
import runner.config.validate.profile_rules as profile_rules
from runner.schema import ActivationCheckpoint, DeviceType, Fp8Recipe, Mode, ReshardPolicy, RunConfig
from runner.schema.layout import Layout, resolve  # not `layout`: that name is this package's module of layout rules
from runner.schema.problems import ConfigError, Problem

__all__ = ["RULES", "ConfigError", "Context", "Needs", "Rule", "check", "preflight", "walk", "warnings"]


class Needs(Enum):
    CONFIG = "config"
    LAYOUT = "layout"
    FILES = "files"
    MACHINE = "machine"


@dataclass
class Context:
    """What the rules read: the config, and what earlier rules resolved or the caller knows."""

    cfg: RunConfig
    ws: int | None = None
    """The world size, once the world-size rule (or search's candidate) fixes one."""
    lay: Layout | None = None
    """The layout as far as the config fixes it."""
    run_dir: Path | None = None
    """The run folder (FILES rules: the folders the run writes, checkpoint storage, what to resume)."""
    node: bool = False
    """Called by the per-node launcher, which is how a multi-node or SLURM run is meant to start."""
    model_ok: bool = field(default=True)
    """No model.* problem before the layout rules (FP8 shapes read the model's dims)."""


@dataclass(frozen=True)
class Rule:
    name: str
    check: Callable[..., None]
    """Called with the Context fields named in `reads`, then the list it appends its problems to."""
    needs: Needs
    search_skips: str = ""
    """Why search does not apply this rule ("" when it does: once for CONFIG rules, per candidate for LAYOUT ones)."""
    reads: tuple[str, ...] = ("cfg",)
    """Context fields the rule takes; "ctx" is the whole Context, for a rule that resolves or gates on it."""

    def apply(self, ctx: Context, out: list[Problem]) -> None:
        self.check(*(ctx if name == "ctx" else getattr(ctx, name) for name in self.reads), out)


def _world(ctx: Context, out: list[Problem]) -> None:
    """World size against the cluster; resolves the layout as far as the config fixes it."""
    ctx.model_ok = not any(p.field.startswith("model.") for p in out)
    ctx.ws = layout_rules.world(ctx.cfg, out)
    ctx.lay = layout_rules.resolved(ctx.cfg, ctx.ws)


def _tensor_parallel(cfg: RunConfig, ws: int | None, out: list[Problem]) -> None:
    if layout_rules.degrees_ok(cfg.parallelism):
        layout_rules.tensor_parallel(cfg, ws, out)


def _batch(cfg: RunConfig, lay: Layout | None, out: list[Problem]) -> None:
    pipeline_rules.batch(cfg, lay, pipeline_rules.schedule_name(cfg, out), out)


def _fp8_shapes(ctx: Context, out: list[Problem]) -> None:
    cfg = ctx.cfg
    if cfg.precision.fp8 == Fp8Recipe.none or not ctx.model_ok:
        return
    if layout_rules.degrees_ok(cfg.parallelism) and layout_rules.tp_divides_heads(cfg):
        model_rules.fp8_shapes(cfg, out)


def _fp8_device(cfg: RunConfig, out: list[Problem]) -> None:
    if cfg.precision.fp8 != Fp8Recipe.none:
        model_rules.fp8_device(cfg, out)


def _expert_shapes(ctx: Context, out: list[Problem]) -> None:
    if ctx.model_ok and layout_rules.degrees_ok(ctx.cfg.parallelism):
        expert_rules.shapes(ctx.cfg, out)


def _dryrun_ranks(ctx: Context, out: list[Problem]) -> None:
    cfg, lay = ctx.cfg, ctx.lay
    if lay is None or ctx.ws is None:
        return
    if cfg.dryrun.device == DeviceType.cuda and cfg.cluster.device != DeviceType.cuda:
        out.append(
            Problem(
                "dryrun.device",
                cfg.dryrun.device.value,
                f"the CUDA rehearsal plays a CUDA cluster's ranks; cluster {cfg.cluster.name} is a {cfg.cluster.device.value} cluster",
                "pick a CUDA cluster (e.g. cluster=h100_node), or use dryrun.device=cpu",
            )
        )
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


def _device_memory(ctx: Context, out: list[Problem]) -> None:
    """The plan's memory verdict, for a GPU cluster that states its memory, once every other rule passed.
    mode=plan (and mode=dryrun) print the verdict as its memory row instead, so that a sweep tabulates the
    layouts that do not fit."""
    cfg, lay, c = ctx.cfg, ctx.lay, ctx.cfg.cluster
    if out or lay is None or ctx.ws is None:
        return
    if c.device != DeviceType.cuda or c.device_memory_gb <= 0 or cfg.mode in (Mode.plan, Mode.dryrun):  # those two measure it
        return
    from runner.estimate import plan  # the plan's own memory model; imported here, as only GPU configs need it

    b = plan.compute(cfg, lay)
    if not b["fits_memory"]:
        out.append(_memory_problem(cfg, lay, b))


def _memory_problem(cfg: RunConfig, lay: Layout, b: dict) -> Problem:
    fixes = ["raise parallelism.pp or parallelism.tp (weights and gradients are split over tp x pp)"]
    if cfg.training.activation_checkpoint == ActivationCheckpoint.none:
        fixes.append("set training.activation_checkpoint=full")
    if cfg.training.microbatch_size > 1:
        fixes.append("lower training.microbatch_size")
    if cfg.parallelism.fsdp_reshard_after_forward != ReshardPolicy.always and b["weights_gathered_during_step"] and lay.dp_shard > 1:
        fixes.append("set parallelism.fsdp_reshard_after_forward=always")
    return Problem(
        "parallelism",
        lay.describe(),
        f"needs {b['total_gb_per_gpu']:.1f} GB per GPU (weights + gradients {b['weights_grads_gb_per_gpu']:.1f}, "
        f"optimizer {b['optimizer_gb_per_gpu']:.1f}, activations {b['activations_gb_per_gpu']:.1f} for "
        f"{b['microbatches_in_flight']} microbatches in flight), more than the {cfg.cluster.device_memory_gb:g} GB of a "
        f"{cfg.cluster.name} GPU (cluster.device_memory_gb)",
        "; or ".join(fixes) + " (mode=plan shows the budget)",
    )


def _how_started(cfg: RunConfig, node: bool, out: list[Problem]) -> None:
    if not node:  # the per-node launcher is how a multi-node or SLURM run is meant to start
        launch_rules.how_started(cfg.cluster, out)


_LAUNCH = "search starts nothing; the preflight of the layout it picks checks this when that run starts"
_CTX, _LAY, _WS = ("ctx",), ("cfg", "lay"), ("cfg", "ws")
RULES: tuple[Rule, ...] = (
    Rule("ranges of training, plan and search fields", fields.training, Needs.CONFIG),
    Rule("model shape and family", model_rules.check, Needs.CONFIG),
    Rule("Hugging Face weights to start from", hf_rules.check, Needs.CONFIG),
    Rule("world size", _world, Needs.CONFIG, "search enumerates only layouts whose degrees multiply to the world size", _CTX),
    Rule("tensor parallel against heads and node", _tensor_parallel, Needs.LAYOUT, reads=_WS),
    Rule(
        "batch, microbatches and pipeline schedule",
        _batch,
        Needs.LAYOUT,
        "search calls pipeline.batch itself, cached per (dp, pp, schedule, v, microbatch) (Search.batch_problems)",
        _LAY,
    ),
    Rule("expert parallel", layout_rules.experts, Needs.LAYOUT, reads=_LAY),
    Rule("MoE communication backend", moe_comm_rules.check, Needs.LAYOUT, reads=_LAY),
    Rule("tied embedding under pipeline parallel", layout_rules.tied_pipeline, Needs.LAYOUT),
    Rule("multi-token prediction under pipeline or context parallel", layout_rules.mtp_layout, Needs.LAYOUT),
    Rule("FP8 layer shapes", _fp8_shapes, Needs.LAYOUT, reads=_CTX),
    Rule("FP8 expert shapes", _expert_shapes, Needs.LAYOUT, reads=_CTX),
    Rule("sequence against CP and TP", layout_rules.sequence, Needs.LAYOUT),
    Rule("async TP", layout_rules.async_tp, Needs.LAYOUT),
    Rule("device", fields.device, Needs.CONFIG),
    Rule("cluster", fields.cluster, Needs.CONFIG),
    Rule("FP8 recipe on the device", _fp8_device, Needs.CONFIG),
    Rule("routed experts' precision on the model and device", expert_rules.device, Needs.CONFIG),
    Rule("monitor and distributed", monitor_rules.check, Needs.CONFIG, reads=_WS),
    Rule("checkpoint", checkpoint_rules.check, Needs.CONFIG),
    Rule("checkpoint weights to start from", checkpoint_rules.init_check, Needs.CONFIG),
    Rule("data", data_rules.check, Needs.CONFIG),
    Rule("evaluation", eval_rules.check, Needs.CONFIG),
    Rule("profiler", profile_rules.check, Needs.CONFIG, reads=_WS),
    Rule("fault tolerance (torchft)", ft_rules.check, Needs.LAYOUT, reads=_LAY),
    Rule("dry-run ranks", _dryrun_ranks, Needs.LAYOUT, "dryrun.ranks are ranks of the layout mode=dryrun plays; a search plays none", _CTX),
    Rule(
        "device memory",
        _device_memory,
        Needs.LAYOUT,
        "search prices every candidate's memory with the same model (Search.fits) and sets apart those that do not fit",
        _CTX,
    ),
    Rule("how the run is started", _how_started, Needs.MACHINE, _LAUNCH, ("cfg", "node")),
    Rule("this machine: driver, kernels, memory", launch_rules.this_machine, Needs.MACHINE, _LAUNCH, ("cfg", "lay", "node")),
    Rule("folders the run writes", folder_rules.check, Needs.FILES, _LAUNCH, ("cfg", "run_dir")),
    Rule("data files and tokenizer", data_rules.files, Needs.FILES, _LAUNCH),
    Rule("held-out files", eval_rules.files, Needs.FILES, _LAUNCH),
    Rule("Hugging Face folder to start from", hf_rules.files, Needs.FILES, _LAUNCH),
    Rule("checkpoint storage and what to resume", checkpoint_rules.launch, Needs.FILES, _LAUNCH, ("cfg", "lay", "run_dir")),
    Rule("checkpoint to start from", checkpoint_rules.init_files, Needs.FILES, _LAUNCH, ("cfg", "run_dir")),
    Rule("torchft installed, lighthouse answering", ft_rules.launch, Needs.MACHINE, _LAUNCH),
    Rule("MoE communication library installed", moe_comm_rules.installed, Needs.MACHINE, _LAUNCH),
)


def walk(ctx: Context, out: list[Problem], needs: tuple[Needs, ...], *, in_search: bool = False) -> None:
    """Apply the rules that read `needs`, in table order (the rules search skips, when `in_search`)."""
    for rule in RULES:
        if rule.needs in needs and not (in_search and rule.search_skips):
            rule.apply(ctx, out)


def check(cfg: RunConfig) -> Layout:
    """Raise ConfigError listing every problem of the config; return the resolved layout."""
    ctx, out = Context(cfg), []
    walk(ctx, out, (Needs.CONFIG, Needs.LAYOUT))
    if out:
        raise ConfigError(out)
    return ctx.lay


warnings = fields.warnings
"""What runs but is likely not what was meant (a warm-up longer than the run): printed, never refused."""


def preflight(cfg: RunConfig, run_dir: Path, lay: Layout | None = None, *, node: bool = False) -> None:
    """Raise ConfigError with every problem of starting `cfg` here, now; change nothing. Run by `python -m runner`
    for mode=validate and before it freezes and launches a run (mode=train), and by `python -m runner.launch` (`node`)
    on every node before torchrun. The FILES rules always; the MACHINE rules unless mode=validate, which checks a
    config for its cluster, not for the machine it is typed on."""
    lay = lay or resolve(cfg.parallelism, cfg.cluster)
    out: list[Problem] = []
    needs = (Needs.FILES,) if cfg.mode == Mode.validate else (Needs.FILES, Needs.MACHINE)
    walk(Context(cfg, lay.world_size, lay, run_dir, node), out, needs)
    if out:
        raise ConfigError(out)
