"""The optimizer and its learning-rate schedule, built by TorchTitan's own containers (OptimizersContainer: one optimizer
per model part, parameter groups by name pattern; LRSchedulersContainer: warm-up, stable phase, decay), from the
`optimizer` and `lr_scheduler` sections over training.steps."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

from runner.schema import OptimizerImpl, RunConfig

if TYPE_CHECKING:  # the types the step loop names; their modules are imported where they are built
    from torchtitan.components.optimizer import OptimizersContainer as Optimizers
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer as LRSchedulers
    from torchtitan.tools.utils import GarbageCollection
from runner.schema.problems import ConfigError, Problem

NO_DECAY = r"(^|\.)(tok_embeddings|embed_tokens)\.|norm|\.bias$"
"""optimizer.no_decay_1d_and_embeddings' group: the token embeddings, every norm weight (the 1-D parameters of
TorchTitan's models besides biases) and biases. One pattern, so that every pipeline stage has a parameter it matches
(every stage holds norms)."""

IMPLEMENTATION = {OptimizerImpl.fused: "fused", OptimizerImpl.foreach: "foreach", OptimizerImpl.for_loop: "for-loop"}


def groups(cfg: RunConfig) -> list[tuple[str, float]]:
    """(pattern, weight decay) of each parameter group in the order a parameter is matched: the configured groups, the
    switch's group, and last the default group (every other parameter, optimizer.weight_decay)."""
    o = cfg.optimizer
    out = [(g.pattern, g.weight_decay) for g in o.param_groups]
    if o.no_decay_1d_and_embeddings:
        out.append((NO_DECAY, 0.0))
    return [*out, (".*", o.weight_decay)]


def _container_class():
    from torchtitan.components.optimizer import OptimizersContainer

    class PerPartGroups(OptimizersContainer):
        """TorchTitan's container, except that a model part (a pipeline stage) skips the groups none of its parameters
        match: the embeddings live on the first stage only. Every pattern matches some part (unmatched)."""

        # private_api: titan_build_param_groups
        @staticmethod
        def _build_param_groups(model, param_group_configs, impl_kwargs):
            names = [n for n, p in model.named_parameters() if p.requires_grad]
            present = [g for g in param_group_configs if any(re.search(g.pattern, n) for n in names)]
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
    sched = LRSchedulersContainer.Config(
        warmup_steps=s.warmup_steps, decay_type=s.decay_type.value, decay_ratio=s.decay_ratio, min_lr_factor=s.min_lr_factor
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
    """optimizer.param_groups patterns that match none of `names` (the whole model's parameter names) as one error, or
    None. TorchTitan would raise on the first such pattern at build time; this names every one before launch."""
    problems = [
        Problem(
            f"optimizer.param_groups[{i}].pattern",
            g.pattern,
            "matches no parameter of the model",
            f"match one of {', '.join(names[:4])}, ...",
        )
        for i, g in enumerate(cfg.optimizer.param_groups)
        if not any(re.search(g.pattern, n) for n in names)
    ]
    return ConfigError(problems) if problems else None


def parameter_names(cfg: RunConfig) -> list[str]:
    """The parameter names of the whole model (built on the meta device: no memory, no process group)."""
    from runner.run.titan.model import model_spec

    with torch.device("meta"):
        model = model_spec(cfg.model).model.build()
    return [n for n, _ in model.named_parameters()]
