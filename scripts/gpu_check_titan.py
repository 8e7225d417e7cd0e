"""TorchTitan's own trainer on the config scripts/gpu_check.py runs through the runner, on one GPU (or, for
scripts/gpu_check_node.py, on the node's GPUs with the runner layout's degrees).

Started by gpu_check.py under torchrun (one process per GPU): builds TorchTitan's Trainer.Config in Python from a
spec (gpu_check.titan_spec), trains, and writes each step's tokens/s and MFU as TorchTitan's MetricsProcessor
computed them (its metric logger is the place TorchTitan hands them out) with their medians.

Equivalent to the runner's run: llama3 debugmodel with FlexAttention, the same seq_len, batch (one microbatch),
steps, AdamW settings, warm-up then constant LR, clipping, bf16 FSDP2 mixed precision with fp32 master weights,
plain cross-entropy, no activation checkpointing, the same SPMD backend, and for FP8 TorchTitan's
Float8LinearConverter with the same recipe name, every Linear but lm_head converted (the runner's
keep_high_precision). CUDA graphs are off: the runner's step loop does not capture them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

KEEP_HIGH_PRECISION = ["lm_head"]
"""TorchTitan's filter_fqns (substring match): the Linear layers the precision presets keep out of FP8."""


def converters(spec: dict) -> list:
    """TorchTitan's model converters for the spec's FP8 recipe (built later, on the GPU: building checks SM 8.9+)."""
    if spec["fp8_recipe"] is None:
        return []
    from torchtitan.components.quantization import Float8LinearConverter

    return [
        Float8LinearConverter.Config(recipe_name=spec["fp8_recipe"], filter_fqns=KEEP_HIGH_PRECISION, model_compile_enabled=spec["compile"])
    ]


def trainer_config(spec: dict, model_spec=None):
    """TorchTitan's Trainer.Config for the spec; `model_spec` defaults to the registry's debugmodel with the
    spec's converters applied (which needs the GPU for FP8)."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.validate import Validator
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry
    from torchtitan.trainer import Trainer

    from runner.run.titan.distributed import SPMD_BACKEND
    from runner.schema import LRSchedulerConfig, OptimizerConfig
    from runner.schema import TrainingConfig as RunnerTraining

    t, o, s = RunnerTraining(), OptimizerConfig(), LRSchedulerConfig()  # the runner's defaults, which gpu_check's runner command keeps
    if model_spec is None:
        model_spec = model_registry("debugmodel", converters=converters(spec) or None)
    return Trainer.Config(
        model_spec=model_spec,
        hf_assets_path=spec["hf_assets_path"],
        dump_folder=spec["dump_folder"],
        loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec)),
        optimizer=default_adamw(lr=o.lr, weight_decay=o.weight_decay),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=s.warmup_steps, decay_type=s.decay_type.value, decay_ratio=s.decay_ratio, min_lr_factor=s.min_lr_factor
        ),
        training=TrainingConfig(
            local_batch_size=spec["local_batch_size"],
            seq_len=spec["seq_len"],
            steps=spec["steps"],
            max_norm=t.max_norm,
            mixed_precision_param="bfloat16",
            mixed_precision_reduce="float32",
            disable_cuda_graphs=True,
        ),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=spec["dataset_path"]),
        metrics=MetricsProcessor.Config(log_freq=1),
        parallelism=parallelism_config(spec, ParallelismConfig, SPMD_BACKEND),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None,
        compile=CompileConfig(enable=spec["compile"], enable_async_tensor_parallel=spec.get("parallelism", {}).get("async_tp", False)),
        validator=Validator.Config(enable=False),
    )


def parallelism_config(spec: dict, ParallelismConfig, spmd_backend: str):
    """TorchTitan's degrees for the spec: one GPU, or (gpu_check_node) the runner layout's dp_shard, tp, pp and schedule,
    with the runner's microbatch as the pipeline microbatch."""
    p = spec.get("parallelism", {})
    return ParallelismConfig(
        data_parallel_shard_degree=p.get("dp_shard", 1),
        tensor_parallel_degree=p.get("tp", 1),
        pipeline_parallel_degree=p.get("pp", 1),
        pipeline_parallel_schedule=p.get("pp_schedule", "1F1B"),
        pipeline_parallel_microbatch_size=p.get("microbatch", 1),
        spmd_backend=spmd_backend,
    )


class StepRecorder:
    """A TorchTitan metric logger (BaseLogger's interface) that keeps what MetricsProcessor.log computed. TorchTitan's
    throughput is per device (the rank's tokens over its non-data-parallel group); times the world size it is the
    job's, which is what the runner's tokens_per_s counts (the global batch over the step time)."""

    def __init__(self, world_size: int = 1) -> None:
        self.rows: list[dict[str, Any]] = []
        self.world_size = world_size

    def log(self, metrics: dict[str, Any], step: int) -> None:
        mfu = metrics.get("mfu(%)")  # TorchTitan reports none with FP8 (its peak is the bf16 one)
        tps = metrics["throughput(tps)"] * self.world_size
        self.rows.append({"step": step, "tokens_per_s": tps, "mfu": None if mfu is None else mfu / 100})

    def close(self) -> None:
        pass


def main() -> None:
    import torch
    from gpu_check import titan_medians
    from torchtitan.tools.logging import init_logger

    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    init_logger()
    trainer = trainer_config(json.loads(args.spec.read_text())).build()
    recorder = StepRecorder(int(os.environ.get("WORLD_SIZE", "1")))
    trainer.metrics_processor.logger = recorder
    try:
        trainer.train()
    finally:
        trainer.close()
    out = {"rows": recorder.rows, "peak_tflops": trainer.metrics_processor.gpu_peak_flops / 1e12, **titan_medians(recorder.rows)}
    if int(os.environ.get("RANK", "0")) == 0:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
