"""TorchTitan's own Trainer (its `train()`) on a config equivalent to a runner config, shared by
bench/runner_vs_titan.py and tests/test_runner_vs_titan.py.

    python -m torch.distributed.run --standalone --nproc-per-node 4 bench/titan_trainer.py <spec.json>
    python -m bench.titan_trainer --fork 4 <spec.json>     # the same ranks forked once imported (fork_launch)

spec.json (write_spec): {"overrides": the runner's overrides, "out": the result file, "dump_folder": TorchTitan's}. Every rank
composes the runner config from the overrides and builds TorchTitan's Trainer.Config from it in Python, as
scripts/gpu_check_titan.py does: the registry's model of model.flavor; the runner's layout as TorchTitan's degrees
(its own pipeline split and schedule, the runner's microbatch as its microbatch); the runner's `optimizer.*` and
`lr_scheduler.*` as its OptimizersContainer and LRSchedulersContainer configs; max_norm, gc_every, the precision's
dtypes. The weights come from model.init_from through TorchTitan's checkpointer (initial_load_path,
initial_load_in_hf); the dataloader is SyntheticLoader, which serves the runner's synthetic samples
(runner.run.loader.SyntheticData: by global sample index, each DP rank its slice), or for data=text read as TorchTitan
reads it (text_in_order) TorchTitan's own HuggingFaceTextDataLoader and HuggingFaceTokenizer. On a CPU rank the runner's
CPU adaptations (runner/run/titan/cpu.py, docs/CPU.md) are applied to TorchTitan's process too: the device globals, SDPA
attention with packed documents' mask (cpu_document_masks), sum reductions for gloo, the threads per rank, the
partial_dtensor SPMD backend (and two stand-ins where
TorchTitan's Trainer itself fails on CPU or on torch 2.13: cpu_stand_ins, whole_batch_pipeline_step). The result file (written
by the last rank, which holds the last pipeline stage) has one row per step: TorchTitan's loss, grad norm and
throughput as its MetricsProcessor logged them, and the wall time the step ended.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

IMPLEMENTATION = {"fused": "fused", "foreach": "foreach", "for_loop": "for-loop"}
"""The runner's optimizer.implementation as TorchTitan's OptimizersContainer.Config.implementation."""


def unsupported(cfg) -> list[str]:
    """Runner settings this equivalent config does not carry over (the bench and the test keep to the rest)."""
    from runner.schema import ActivationCheckpoint, DataSource, DeviceType, Fp8Recipe

    checks = {
        "data=synthetic, or data=text read as TorchTitan reads it": cfg.data.name == DataSource.synthetic or text_in_order(cfg),
        "model.init_from set (a Hugging Face folder), or CPU ranks (the runner's initial weights: runner_initial_weights)": bool(
            cfg.model.init_from
        )
        or cfg.cluster.device == DeviceType.cpu,
        "optimizer.param_groups empty": not cfg.optimizer.param_groups,
        "optimizer.no_decay_1d_and_embeddings=false": not cfg.optimizer.no_decay_1d_and_embeddings,
        "training.activation_checkpoint=none": cfg.training.activation_checkpoint == ActivationCheckpoint.none,
        "training.compile=false": not cfg.training.compile,
        "precision.fp8=none": cfg.precision.fp8 == Fp8Recipe.none,
        "parallelism.cp=1 and pp_virtual_stages=1": (cfg.parallelism.cp, cfg.parallelism.pp_virtual_stages) == (1, 1),
        "parallelism.moe_comm_backend=standard (the registry's)": cfg.parallelism.moe_comm_backend.value == "standard",
    }
    return [what for what, ok in checks.items() if not ok]


def text_in_order(cfg) -> bool:
    """data=text that TorchTitan's own text loader reads into the same batches: one file in the folder TorchTitan's
    c4_test loader reads, the tokenizer in the Hugging Face folder (TorchTitan's hf_assets_path), documents masked, in
    file order (data.shuffle=false), by one DP replica (TorchTitan splits documents, not samples, between replicas:
    docs/training.md)."""
    from runner.schema import DataSource, layout

    d = cfg.data
    lay = layout.resolve(cfg.parallelism, cfg.cluster)
    in_hf = bool(cfg.model.init_from) and Path(d.tokenizer).resolve() == (Path(cfg.model.init_from) / "tokenizer.json").resolve()
    return d.name == DataSource.text and len(d.files) == 1 and in_hf and d.document_mask and not d.shuffle and lay.dp == 1


def _text_loader(cfg):
    """TorchTitan's own text loader and tokenizer over data.files (its c4_test loader reads the file's folder)."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    return HuggingFaceTokenizer.Config(), HuggingFaceTextDataLoader.Config(
        dataset="c4_test", dataset_path=str(Path(cfg.data.files[0]).parent)
    )


def cpu_document_masks() -> None:
    """TorchTitan's Trainer builds masks only for FlexAttention and varlen (post_dataloading_process); its SDPA model gets
    the positions alone. On CPU (no FlexAttention backward) the runner's SDPA takes packed documents' mask: added here
    the way the runner adds it (runner.run.titan.cpu.document_mask from the batch's positions)."""
    from torchtitan.trainer import Trainer

    import runner.run.titan.cpu as cpu_adapt

    original = Trainer.post_dataloading_process

    def with_document_mask(self, input_dict, labels):
        inputs, labels, extra = original(self, input_dict, labels)
        if "positions" in extra and "attention_masks" not in extra:
            extra["attention_masks"] = cpu_adapt.document_mask(extra["positions"])
        return inputs, labels, extra

    Trainer.post_dataloading_process = with_document_mask


def _loader_class():
    from torchtitan.components.dataloader import BaseDataLoader

    from runner.run.loader import SyntheticData

    class SyntheticLoader(BaseDataLoader):
        """TorchTitan's dataloader slot filled with the runner's synthetic stream: TorchTitan's Trainer asks for batches
        of its dataloader batch size (the microbatch: training.local_batch_size without PP, the pipeline microbatch
        with it) one after another; this DP rank's microbatches of step 0, then of step 1, ..., in the runner's order."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            seed: int = 0
            """training.seed of the runner config (the synthetic samples' seed)."""
            vocab_size: int = 2048
            """model.vocab_size: the samples' token range."""
            global_batch_size: int = 8
            """training.global_batch_size: samples per step over all DP ranks."""

        def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int, local_batch_size: int, **_):
            self.data = SyntheticData(
                seed=config.seed,
                seq_len=seq_len,
                vocab=config.vocab_size,
                global_batch=config.global_batch_size,
                microbatch=local_batch_size,
                dp_rank=dp_rank,
                dp=dp_world_size,
            )
            self.step = 0

        def __iter__(self):
            while True:
                for mb in self.data.microbatches(self.step):
                    yield {"input": mb.inputs}, mb.labels
                self.step += 1

        def state_dict(self) -> dict[str, Any]:
            return {"step": self.step}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.step = state_dict["step"]

    return SyntheticLoader


def _no_tokenizer_class():
    from torchtitan.components.tokenizer import BaseTokenizer

    class NoTokenizer(BaseTokenizer):
        """The Trainer builds a tokenizer from hf_assets_path; synthetic tokens need none (the folder has no tokenizer)."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config: Config | None = None, *, tokenizer_path: str | None = None):
            super().__init__()

        def encode(self, *args, **kwargs) -> list[int]:
            raise NotImplementedError("synthetic data is tokens already")

        def decode(self, *args, **kwargs) -> str:
            raise NotImplementedError("synthetic data is tokens already")

        def get_vocab_size(self) -> int:
            raise NotImplementedError("synthetic data has no tokenizer")

    return NoTokenizer


def model_spec(cfg, cpu: bool):
    """TorchTitan's registry model of model.name/flavor; on CPU with the runner's adaptations: SDPA attention, float32
    experts, and FSDP's reductions as sums (wrapped around the spec's parallelize_fn, which pipelining_fn calls for every
    stage too); without model.init_from, the runner's initial weights (runner_initial_weights)."""
    import importlib

    spec = importlib.import_module(f"torchtitan.models.{cfg.model.name}").model_registry(cfg.model.flavor)
    if cpu:
        import runner.run.titan.cpu as cpu_adapt

        cpu_adapt.use_sdpa(spec.model)
        cpu_adapt.use_float32_experts(spec.model)
        parallelize = spec.parallelize_fn

        def parallelize_with_sums(model, **kwargs):
            out = parallelize(model, **kwargs)
            cpu_adapt.force_sum_reduction(out)
            if not cfg.model.init_from:
                runner_initial_weights(out, spec.model, cfg.training.seed)
            return out

        spec.parallelize_fn = parallelize_with_sums
    return spec


def runner_initial_weights(part, model_config, seed: int) -> None:
    """Without model.init_from the two sides start from the runner's CPU initialization (runner.run.titan.cpu
    init_like_one_rank: the unsharded model from training.seed, each rank keeping its shard): TorchTitan's Trainer calls
    the part's init_weights after to_empty, which this instance's init_weights follows as the runner's _materialize does."""
    import runner.run.titan.cpu as cpu_adapt

    own = part.init_weights

    def init_weights(*args, **kwargs):
        own(*args, **kwargs)  # buffers (RoPE tables, the MoE counts and biases); parameters follow
        cpu_adapt.init_like_one_rank(part, model_config, seed)

    part.init_weights = init_weights


def trainer_config(cfg, lay, dump_folder: str, cpu: bool = True):
    """TorchTitan's Trainer.Config equivalent to the runner config `cfg` on layout `lay`."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig
    from torchtitan.components.validate import Validator
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.trainer import Trainer

    from runner.run.titan.distributed import SPMD_BACKEND

    missing = unsupported(cfg)
    if missing:
        raise ValueError(f"the TorchTitan-side config carries over runs with {', '.join(missing)}")
    t, o, s, p = cfg.training, cfg.optimizer, cfg.lr_scheduler, cfg.parallelism
    spec = model_spec(cfg, cpu)
    kwargs = {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
    if text_in_order(cfg):
        tokenizer, dataloader = _text_loader(cfg)
    else:
        tokenizer = _no_tokenizer_class().Config()
        dataloader = _loader_class().Config(seed=t.seed, vocab_size=cfg.model.vocab_size, global_batch_size=t.global_batch_size)
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path=cfg.model.init_from,  # the state-dict adapter reads its index (if any); the text loader its tokenizer
        dump_folder=dump_folder,
        tokenizer=tokenizer,
        dataloader=dataloader,
        loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec)),
        optimizer=OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name=o.name.value, optimizer_kwargs=kwargs)],
            implementation=IMPLEMENTATION[o.implementation.value],
        ),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=s.warmup_steps, decay_type=s.decay_type.value, decay_ratio=s.decay_ratio, min_lr_factor=s.min_lr_factor
        ),
        training=TrainingConfig(
            # without PP a batch of the dataloader is one forward/backward (gradient accumulation over the microbatches);
            # with PP it is the DP rank's batch, cut into pipeline microbatches
            local_batch_size=t.global_batch_size // lay.dp if lay.pp > 1 else t.microbatch_size,
            global_batch_size=t.global_batch_size,
            seq_len=t.seq_len,
            steps=t.steps,
            max_norm=t.max_norm,
            mixed_precision_param=cfg.precision.param_dtype.value,
            mixed_precision_reduce=cfg.precision.reduce_dtype.value,
            gc_freq=t.gc_every,
            disable_cuda_graphs=True,  # the runner's step loop captures none
        ),
        parallelism=ParallelismConfig(
            data_parallel_replicate_degree=lay.dp_replicate,
            data_parallel_shard_degree=lay.dp_shard,
            tensor_parallel_degree=lay.tp,
            enable_sequence_parallel=p.sequence_parallel,
            fsdp_reshard_after_forward=p.fsdp_reshard_after_forward.value,
            pipeline_parallel_degree=lay.pp,
            pipeline_parallel_schedule=p.pp_schedule,
            pipeline_parallel_microbatch_size=t.microbatch_size,
            pipeline_parallel_first_stage_less_layers=p.pp_first_stage_less_layers,
            pipeline_parallel_last_stage_less_layers=p.pp_last_stage_less_layers,
            expert_parallel_degree=lay.ep,
            spmd_backend=SPMD_BACKEND,
        ),
        metrics=MetricsProcessor.Config(log_freq=1),
        checkpoint=CheckpointManager.Config(
            enable=bool(cfg.model.init_from),
            load_only=True,
            initial_load_path=cfg.model.init_from or None,
            initial_load_in_hf=True,
            initial_load_model_only=True,
        ),
        activation_checkpoint=None,
        compile=CompileConfig(enable=False),
        validator=Validator.Config(enable=False),
    )


def cpu_stand_ins() -> None:
    """Two calls of TorchTitan's Trainer outside the model and the step's math that fail on CPU, which the runner (it
    uses neither) has no adaptation for; nothing here is trained or timed differently:
    - MetricsProcessor builds a DeviceMemoryMonitor from calls torch.cpu lacks (get_device_name, memory_stats): one that
      reports no device memory instead;
    - after the first step, set_pg_timeouts calls barrier(device_ids=["cpu"]), which gloo refuses, and then
      torch.distributed.set_timeout, which torch 2.13 does not have: the barrier alone (the groups keep the timeout
      they were made with)."""
    import torch.distributed as dist
    from torchtitan.components import metrics
    from torchtitan.distributed import utils as dist_utils

    class CpuMemoryMonitor:
        device_name = "cpu"

        def get_peak_stats(self):
            return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

        def reset_peak_stats(self) -> None:
            pass

    def set_pg_timeouts(timeout, parallel_dims) -> None:
        dist.barrier()

    metrics.build_device_memory_monitor = CpuMemoryMonitor
    dist_utils.set_pg_timeouts = set_pg_timeouts


def whole_batch_pipeline_step(schedule) -> None:
    """TorchTitan 0.3.0's Trainer hands its pipeline schedule pre-split microbatches (`step(arg_mbs=..., kwarg_mbs=...,
    target_mbs=...)`), which torch 2.13's schedules do not take: they land in the model's keyword inputs and the step
    fails ("Expecting 4 arg_mbs but got 2"). On such a torch the microbatches are joined into the whole batch, which
    step() splits back into the same microbatches (as the runner's pipeline step hands it)."""
    import inspect

    import torch

    if schedule is None or "arg_mbs" in inspect.signature(schedule.step).parameters:
        return
    step = schedule.step

    def step_microbatches(*, arg_mbs=None, kwarg_mbs=None, target_mbs=None, **kwargs):
        args = tuple(torch.cat(parts) for parts in zip(*arg_mbs, strict=True)) if arg_mbs else ()
        model_kwargs = {k: torch.cat([mb[k] for mb in kwarg_mbs]) for k in (kwarg_mbs or [{}])[0]}
        target = torch.cat(target_mbs) if target_mbs is not None else None
        return step(*args, target=target, **model_kwargs, **kwargs)

    schedule.step = step_microbatches


class StepRecorder:
    """A TorchTitan metric logger (BaseLogger's interface) that keeps what MetricsProcessor.log computed, and when. Its
    throughput is per device (this rank's tokens over its non-data-parallel group); times the world size it is the
    job's, the global batch's tokens over the time since the last step's log, as the runner's tokens_per_s counts."""

    def __init__(self, world_size: int) -> None:
        self.rows: list[dict[str, Any]] = []
        self.world_size = world_size

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.rows.append(
            {
                "step": step,
                "loss": metrics["loss_metrics/global_avg_loss"],
                "grad_norm": metrics["grad_norm"],
                "tokens_per_s": metrics["throughput(tps)"] * self.world_size,
                "end": time.time(),
            }
        )

    def close(self) -> None:
        pass


def start_rank(cfg) -> bool:
    """What a runner rank does before TorchTitan builds (runner.run.per_rank.start_rank): threads per rank and TorchTitan's
    device globals on CPU; TorchTitan's Trainer then starts the process group itself. Returns whether the rank is a CPU one."""
    from runner.run.device import DevicePolicy
    from runner.run.titan.distributed import quiet_torchao

    policy = DevicePolicy.of(cfg.cluster, cfg.distributed)
    quiet_torchao(cfg)
    if policy.cpu:
        import runner.run.titan.cpu as cpu_adapt

        policy.set_threads(int(os.environ["LOCAL_WORLD_SIZE"]))  # as the runner's ranks (its launcher also sets OMP_NUM_THREADS)
        cpu_adapt.patch_device_globals()
        cpu_stand_ins()
        cpu_document_masks()
    return policy.cpu


def write_spec(folder: Path, overrides: list[str]) -> Path:
    """The spec of one TorchTitan run of `overrides` in `folder` (its result: folder/titan.json); returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = {"overrides": overrides, "out": str(folder / "titan.json"), "dump_folder": str(folder / "dump")}
    path = folder / "spec.json"
    path.write_text(json.dumps(spec, indent=2) + "\n")
    return path


def launch_args(spec: Path, nproc: int, fork: bool = False) -> list[str]:
    """`python -m` arguments of a launch of this entry on `nproc` local ranks: torchrun of this script (each rank a
    fresh interpreter), or with `fork` this module's fork_launch (torchrun's agent forks ranks that have the imports)."""
    if fork:
        return ["bench.titan_trainer", "--fork", str(nproc), str(spec)]
    return ["torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(Path(__file__).resolve()), str(spec)]


def fork_launch(spec: Path, nproc: int) -> None:
    """Start `nproc` local ranks of `spec` as the runner starts CPU ranks (cluster.worker_start=fork, docs/CPU.md):
    torchrun's elastic agent with a function entrypoint, which forks every rank from this process once it has imported
    what a rank imports (runner.run.titan.preload: imports only, no tensor op). The ranks train as under torchrun of
    the script; only their ~10 s of imports each are paid once."""
    import uuid

    from runner.config.compose import compose
    from runner.run import procs, titan

    titan.preload(compose(json.loads(spec.read_text())["overrides"]))
    rdzv = ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", f"--rdzv-id=titan-{uuid.uuid4().hex[:8]}"]
    procs.fork_ranks([*rdzv, f"--nproc-per-node={nproc}", "--monitor-interval=0.5"], forked_main, str(spec))


def forked_main(spec_path: str) -> None:
    from runner.run import procs

    procs.drop_agent_signal_handlers()
    main(spec_path)


def launch_env(nproc: int) -> dict[str, str]:
    """The launch's environment: this one with the runner's OpenMP threads per CPU rank (DevicePolicy.agent_env), which
    torchrun would otherwise set to 1."""
    from runner.run import procs

    return {**os.environ, "OMP_NUM_THREADS": str(procs.threads_per_rank(nproc))}


def output(spec: Path) -> dict[str, Any]:
    """What a finished launch of `spec` wrote: its rows and the expert biases after the last step."""
    return json.loads(Path(json.loads(spec.read_text())["out"]).read_text())


def result(spec: Path) -> list[dict[str, Any]]:
    """The rows a finished launch of `spec` wrote."""
    return output(spec)["rows"]


def main(spec_path: str) -> None:
    import torch.distributed as dist
    from torchtitan.tools.logging import init_logger

    from runner.config.compose import compose
    from runner.run import titan
    from runner.schema import layout

    spec = json.loads(Path(spec_path).read_text())
    cfg = compose(spec["overrides"])
    lay = layout.resolve(cfg.parallelism, cfg.cluster)
    cpu = start_rank(cfg)
    init_logger()
    trainer = trainer_config(cfg, lay, spec["dump_folder"], cpu).build()
    whole_batch_pipeline_step(getattr(trainer, "pp_schedule", None))
    recorder = StepRecorder(dist.get_world_size())
    trainer.metrics_processor.logger = recorder
    try:
        trainer.train()
    finally:
        trainer.close()
    if dist.get_rank() == dist.get_world_size() - 1:  # pp is TorchTitan's outermost mesh axis: this rank has the loss
        out = {"rows": recorder.rows, "expert_bias": titan.expert_biases(trainer.model_parts)}
        Path(spec["out"]).write_text(json.dumps(out, indent=2) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "--fork":  # python -m bench.titan_trainer --fork <nproc> <spec.json>
        from runner.run import procs

        fork_launch(Path(sys.argv[3]), int(sys.argv[2]))
        procs.exit_now(0)
    else:  # a rank under torchrun
        main(sys.argv[1])
