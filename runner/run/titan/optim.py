"""The optimizer and its learning-rate schedule, built by TorchTitan's own containers (OptimizersContainer: one optimizer
per model part, parameter groups by name pattern; LRSchedulersContainer: warm-up, stable phase, decay), from the
`optimizer` and `lr_scheduler` sections over training.steps."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

import runner.config.validate.fields as fields
from runner.schema import OptimizerImpl, RunConfig

if TYPE_CHECKING:  # the types the step loop names; their modules are imported where they are built
    from torchtitan.components.optimizer import OptimizersContainer as Optimizers
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer as LRSchedulers
    from torchtitan.tools.utils import GarbageCollection
from runner.schema.problems import ConfigError, Problem

NO_DECAY = r"(^|\.)(tok_embeddings|embed_tokens)\.|norm|bias|\.sinks$|\.A_log$"
"""optimizer.no_decay_1d_and_embeddings' group: the token embeddings and every 1-D parameter of TorchTitan's models:
norm weights, biases (gpt-oss's expert biases `mlp1_bias_EG` included, 1-D per expert), gpt-oss's attention sinks,
Qwen3.5's linear-attention decay `A_log` and `dt_bias`. One pattern, so that every pipeline stage has a parameter it
matches (every stage holds norms); tests/test_eval.py checks it against every family's parameters."""

IMPLEMENTATION = {OptimizerImpl.fused: "fused", OptimizerImpl.foreach: "foreach", OptimizerImpl.for_loop: "for-loop"}


def groups(cfg: RunConfig) -> list[tuple[str, float]]:
    """(pattern, weight decay) of each parameter group in the order a parameter is matched: the configured groups, the
    switch's group, and last the default group (every other parameter, optimizer.weight_decay)."""
    o = cfg.optimizer
    out = [(g.pattern, g.weight_decay) for g in o.param_groups]
    if o.no_decay_1d_and_embeddings:
        out.append((NO_DECAY, 0.0))
    return [*out, (".*", o.weight_decay)]


def claims(patterns: list[str], names: list[str]) -> list[list[str]]:
    """The names each pattern takes under TorchTitan's rule (OptimizersContainer._build_param_groups): a parameter
    belongs to the first pattern that matches it, so a later pattern gets only what the earlier ones left."""
    left, out = list(names), []
    for pattern in patterns:
        rx = re.compile(pattern)
        out.append([n for n in left if rx.search(n)])
        left = [n for n in left if not rx.search(n)]
    return out


def _container_class():
    from torchtitan.components.optimizer import OptimizersContainer

    class PerPartGroups(OptimizersContainer):
        """TorchTitan's container, except that a model part (a pipeline stage) skips the groups that take none of its
        parameters: the embeddings live on the first stage only, and the switch's or the default group may find all
        of a part's parameters taken by earlier groups. Every configured group takes some parameter (unmatched)."""

        # private_api: titan_build_param_groups
        @staticmethod
        def _build_param_groups(model, param_group_configs, impl_kwargs):
            names = [n for n, p in model.named_parameters() if p.requires_grad]
            taken = claims([g.pattern for g in param_group_configs], names)
            present = [g for g, got in zip(param_group_configs, taken, strict=True) if got]
            return OptimizersContainer._build_param_groups(model, present, impl_kwargs)

    return PerPartGroups


def build_optimizer(cfg: RunConfig, parts: list[torch.nn.Module]) -> tuple[Optimizers, LRSchedulers]:
    """TorchTitan's OptimizersContainer and LRSchedulersContainer for the model parts."""
    from torchtitan.components.optimizer import ParamGroupConfig
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    o, s = cfg.optimizer, cfg.lr_scheduler
    kwargs = {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps}
    configs = [
        ParamGroupConfig(pattern=pattern, optimizer_name=o.name.value, optimizer_kwargs=kwargs | {"weight_decay": decay})
        for pattern, decay in groups(cfg)
    ]
    container = _container_class()
    opt = container(container.Config(param_groups=configs, implementation=IMPLEMENTATION[o.implementation]), model_parts=parts)
    warmup, decay = fields.schedule_steps(cfg)  # clipped to the run as TorchTitan would (validate.warnings said so once)
    ratio = None if decay == cfg.training.steps - warmup else s.decay_ratio  # None: the decay fills what warm-up leaves
    sched = LRSchedulersContainer.Config(
        warmup_steps=warmup, decay_type=s.decay_type.value, decay_ratio=ratio, min_lr_factor=s.min_lr_factor
    ).build(optimizers=opt, training_steps=cfg.training.steps)
    return opt, sched


def garbage_collection(every: int) -> GarbageCollection | None:
    """TorchTitan's GarbageCollection (training.gc_every > 0): Python's automatic collection off, a generation-1
    collection at multiples of `every` (its `run(step)`); None leaves Python's automatic collection on."""
    if every <= 0:
        return None
    from torchtitan.tools.utils import GarbageCollection

    return GarbageCollection(gc_freq=every)


def optimizers(opt) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside the container, whose `state` and `param_groups` hold the parameters (the container's
    own are a shell)."""
    return list(opt)


def current_lr(opt) -> float:
    """The learning rate the next update uses (the default group's: every group shares the schedule and the peak)."""
    return optimizers(opt)[0].param_groups[-1]["lr"]


def unmatched(cfg: RunConfig, names: list[str]) -> ConfigError | None:
    """optimizer.param_groups that take no parameter of `names` (the whole model's) under TorchTitan's first-match rule,
    as one error, or None. TorchTitan would raise on the first such group when the optimizer is built."""
    groups = cfg.optimizer.param_groups
    taken = claims([g.pattern for g in groups], names)
    problems = []
    for i, (g, got) in enumerate(zip(groups, taken, strict=True)):
        if got:
            continue
        rx = re.compile(g.pattern)
        before = [j for j in range(i) if any(rx.search(n) for n in taken[j])]
        if not before:
            problems.append(
                Problem(f"optimizer.param_groups[{i}].pattern", g.pattern, "matches no parameter of the model", _names_fix(names))
            )
            continue
        first = " and ".join(f"optimizer.param_groups[{j}] (pattern {groups[j].pattern})" for j in before)
        order = [groups[i], *(h for k, h in enumerate(groups) if k != i)]
        problems.append(
            Problem(
                f"optimizer.param_groups[{i}].pattern",
                g.pattern,
                f"takes no parameter: every parameter it matches goes to {first} first (TorchTitan gives a parameter "
                "to the first group whose pattern matches it)",
                f"put it first, {fields.param_groups_override(order)}, or narrow the earlier pattern",
            )
        )
    return ConfigError(problems) if problems else None


def _names_fix(names: list[str]) -> str:
    shown = list(dict.fromkeys(re.sub(r"\.\d+\.", ".<i>.", n) for n in names))
    return f"match one of {', '.join(shown[:6])}, ..." if len(shown) > 6 else f"match one of {', '.join(shown)}"


def parameter_names(cfg: RunConfig) -> list[str]:
    """The parameter names of the whole model (built on the meta device: no memory, no process group)."""
    from runner.run.titan.model import model_spec

    with torch.device("meta"):
        model = model_spec(cfg.model).model.build()
    return [n for n, _ in model.named_parameters()]
