"""The only package that knows TorchTitan's API (pinned: torchtitan 0.3.0).

It turns the runner's config into TorchTitan's ParallelDims, model config and parallelize call,
in TorchTitan's own order (TP, activation checkpointing, FSDP), and exposes the few operations
the step loop needs:

- distributed: process group, ParallelDims and mesh, the modules ranks preload;
- model: TorchTitan's model config with the config's architecture (dim, layers, heads, experts, ...);
- fp8: which Linear layers run in FP8 and the recipe's module for them;
- build: the parallelized, initialized model (Built); hf: its weights from a Hugging Face folder;
- step, state: loss, clipping, pipeline step; DCP checkpoints;
- cpu: the adaptations for CPU ranks on gloo (docs/CPU.md).
"""

from typing import TYPE_CHECKING

from runner.run.titan.build import Built, build, model_config, register_optimizer_hooks, tie_weights
from runner.run.titan.distributed import (
    PRELOAD,
    SPMD_BACKEND,
    build_mesh,
    init_process_group,
    mesh_coords,
    preload,
    quiet_torchao,
    stage_modules,
    titan_configs,
)
from runner.run.titan.fp8_conversion import blockwise_linear_config, check_layer_table, convert_experts, convert_precision, fp8_layers
from runner.run.titan.hf_adapter import load_hf
from runner.run.titan.model import check_size, model_spec
from runner.run.titan.moe import clear_counts, expert_biases, moe_blocks, take_counts
from runner.run.titan.optim import build_optimizer, current_lr, garbage_collection, optimizers
from runner.run.titan.state import load_model, load_state, save_model, save_state, training_state
from runner.run.titan.step import (
    clip_grad_norm_tensor,
    local_value,
    loss_fn,
    loss_inputs,
    model_inputs,
    next_token_loss,
    pipeline_eval,
    pipeline_set_up,
    pipeline_stages,
    pipeline_step,
)

if TYPE_CHECKING:  # TorchTitan's types the step loop holds (runner.run.step_loop.StepLoop)
    from runner.run.titan.optim import GarbageCollection as GarbageCollection
    from runner.run.titan.optim import LRSchedulers as LRSchedulers
    from runner.run.titan.optim import Optimizers as Optimizers
    from runner.run.titan.step import BaseLoss as BaseLoss

__all__ = [
    "PRELOAD",
    "SPMD_BACKEND",
    "Built",
    "blockwise_linear_config",
    "build",
    "build_mesh",
    "build_optimizer",
    "check_layer_table",
    "check_size",
    "clear_counts",
    "expert_biases",
    "clip_grad_norm_tensor",
    "convert_experts",
    "convert_precision",
    "current_lr",
    "fp8_layers",
    "garbage_collection",
    "init_process_group",
    "load_hf",
    "load_model",
    "load_state",
    "local_value",
    "loss_fn",
    "loss_inputs",
    "mesh_coords",
    "model_config",
    "model_inputs",
    "model_spec",
    "moe_blocks",
    "next_token_loss",
    "optimizers",
    "pipeline_eval",
    "pipeline_set_up",
    "pipeline_stages",
    "pipeline_step",
    "preload",
    "quiet_torchao",
    "register_optimizer_hooks",
    "save_model",
    "save_state",
    "stage_modules",
    "take_counts",
    "tie_weights",
    "titan_configs",
    "training_state",
]
