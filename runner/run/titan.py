"""The only module that knows TorchTitan's API (pinned: torchtitan 0.3.0).

It turns the runner's config into TorchTitan's ParallelDims, model spec and parallelize
call, in TorchTitan's own order (TP, activation checkpointing, FSDP), and exposes the
few operations the step loop needs.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from runner.config import pipeline, precision
from runner.config.layout import Layout
from runner.config.schema import ActivationCheckpoint, DeviceType, Fp8Recipe, RunConfig

SPMD_BACKEND = "partial_dtensor"  # the backend that composes FSDP2 + TP here (NOTES-cpu.md)


@dataclass
class Built:
    parts: list[torch.nn.Module]
    """This rank's model chunks: the whole model, or its pipeline stage(s)."""
    parallel_dims: object
    num_params: int
    flops_per_token: int
    """TorchTitan's own count (get_nparams_and_flops) for this model and seq_len."""
    extra_inputs: dict
    """Keyword inputs the model needs beside tokens (attention masks on the FlexAttention path)."""
    schedule: object = None
    """torch.distributed.pipelining schedule when pp > 1."""
    has_first: bool = True
    """This rank holds the first pipeline stage (it feeds the tokens)."""
    has_last: bool = True
    """This rank holds the last pipeline stage (it computes the loss)."""
    fp8_converted: list[str] | None = None
    """Linear layers (module FQNs) converted to the FP8 recipe, as found in the model config."""
    cp_load_balancer: str | None = None
    """TorchTitan's CP load balancer for this attention (headtail for SDPA, ptrr for FlexAttention); None without CP."""
    post_optimizer_build_fn: object = None
    """The model's optimizer hook from its TorchTitan spec (MoE: auxiliary-loss-free expert-bias updates)."""


def _titan_configs(cfg: RunConfig, lay: Layout):
    from torchtitan.config import ParallelismConfig, TrainingConfig

    t, p = cfg.training, cfg.parallelism
    training = TrainingConfig(
        local_batch_size=t.global_batch_size // lay.dp,  # pipeline_llm splits it into microbatches
        seq_len=t.seq_len,
        steps=t.steps,
        max_norm=t.max_norm,
        mixed_precision_param=cfg.precision.param_dtype.value,
        mixed_precision_reduce=cfg.precision.reduce_dtype.value,
    )
    parallelism = ParallelismConfig(
        data_parallel_replicate_degree=lay.dp_replicate,
        data_parallel_shard_degree=lay.dp_shard,
        tensor_parallel_degree=lay.tp,
        enable_sequence_parallel=p.sequence_parallel,
        fsdp_reshard_after_forward=p.fsdp_reshard_after_forward,
        pipeline_parallel_degree=lay.pp,
        pipeline_parallel_schedule=p.pp_schedule,
        pipeline_parallel_microbatch_size=t.microbatch_size,
        pipeline_parallel_first_stage_less_layers=p.pp_first_stage_less_layers,
        pipeline_parallel_last_stage_less_layers=p.pp_last_stage_less_layers,
        module_fqns_per_model_part=stage_modules(cfg, lay) if lay.pp > 1 else None,
        context_parallel_degree=lay.cp,
        expert_parallel_degree=lay.ep,
        spmd_backend=SPMD_BACKEND,
    )
    return training, parallelism


def stage_modules(cfg: RunConfig, lay: Layout) -> list[list[str]]:
    """Module FQNs of each of the pp x v pipeline stages, from TorchTitan's own LLM split (embedding and head
    weighted as pp_first/last_stage_less_layers). Passed to pipeline_llm explicitly because it only infers
    1 or 2 stages per rank; checked against the torch-free mirror that validation and the plan use."""
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    p, n = cfg.parallelism, cfg.model.num_layers
    first, last = p.pp_first_stage_less_layers, p.pp_last_stage_less_layers
    fqns = _generate_llm_fqn_per_model_part(lay.pp * p.pp_virtual_stages, n, first, last)
    got = [sum(f.startswith("layers.") for f in stage) for stage in fqns]
    want = pipeline.stage_layers(n, lay.pp * p.pp_virtual_stages, first, last)
    if got != want:
        raise RuntimeError(
            f"TorchTitan split {n} layers as {got}, runner.config.pipeline.stage_layers says {want}: the mirror is out of date"
        )
    return fqns


# What a rank imports while it builds and trains (measured: ~2,800 modules, about 10 s of CPU per rank);
# importing them in the agent before it forks the ranks (cluster.worker_start=fork) pays that once.
PRELOAD = (
    "runner.run.titan_cpu",
    "runner.run.checkpointer",
    "torchtitan.trainer",
    "torchtitan.config",
    "torchtitan.components.loss",
    "torchtitan.components.quantization",
    "torchtitan.components.checkpointer.base",
    "torchtitan.distributed.activation_checkpoint",
    "torchtitan.distributed.context_parallel",
    "torchtitan.distributed.pipeline_parallel",
    "torchtitan.distributed.utils",
    "torchtitan.models.common.attention",
    "torchtitan.models.common.linear",
    "torch.distributed.checkpoint",
)


def quiet_torchao(cfg: RunConfig) -> None:
    """On CPU torchao's CUDA kernel libraries cannot load; its warnings about that have nothing to act on."""
    if cfg.cluster.device == DeviceType.cpu:
        import logging

        logging.getLogger("torchao").setLevel(logging.ERROR)


def preload(cfg: RunConfig) -> None:
    """Import PRELOAD and the model's family, so that forked ranks inherit them. Imports only: no
    tensor op runs, so the agent starts no OpenMP pool that a forked rank would deadlock on."""
    import importlib

    quiet_torchao(cfg)
    for name in (*PRELOAD, f"torchtitan.models.{cfg.model.name}"):
        importlib.import_module(name)


def init_distributed(cfg: RunConfig, lay: Layout):
    """Process group, CPU adaptations and the device mesh (pp, dp_replicate, dp_shard, cp, tp)."""
    init_process_group(cfg)
    return build_mesh(cfg, lay)


def init_process_group(cfg: RunConfig) -> None:
    """The default process group (and, on CPU, TorchTitan's device globals); one per process."""
    if cfg.cluster.device == DeviceType.cpu:
        from runner.run import titan_cpu

        titan_cpu.patch_device_globals()
    else:
        import os

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(cfg.cluster.backend.value, timeout=datetime.timedelta(seconds=cfg.distributed.timeout_s))


def build_mesh(cfg: RunConfig, lay: Layout):
    """TorchTitan's ParallelDims and device mesh for this layout over the whole default group. Several
    layouts may be built one after another in one process group (runner.run.parity)."""
    from torchtitan.distributed import ParallelDims

    pd = ParallelDims.from_config(_titan_configs(cfg, lay)[1], dist.get_world_size())
    pd.build_mesh()
    _set_group_timeouts(datetime.timedelta(seconds=cfg.distributed.timeout_s))
    import torchtitan.distributed.utils as dist_utils

    dist_utils.set_spmd_backend(SPMD_BACKEND)
    return pd


def mesh_coords(pd) -> dict[str, int]:
    """This rank's coordinate on each enabled axis of TorchTitan's mesh ('dp': the batch mesh)."""
    out = {}
    for axis, name in (("pp", "pp"), ("dp_replicate", "dp_replicate"), ("cp", "cp"), ("tp", "tp"), ("dp", "batch")):
        mesh = pd.get_optional_mesh(name)
        if mesh is not None:
            out[axis] = mesh.get_local_rank()
    return out


def _set_group_timeouts(timeout: datetime.timedelta) -> None:
    """DeviceMesh makes its groups with new_group(timeout=None), which is torch's backend default (30 min on gloo,
    10 on NCCL), not the world group's: give every group the configured timeout."""
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world

    for pg in list(_world.pg_names):
        if pg.rank() >= 0 and dist.get_backend(pg) in ("gloo", "nccl"):  # not the fake groups of size-1 mesh axes
            _set_pg_timeout(timeout, pg)


def build(cfg: RunConfig, lay: Layout, pd, run_dir: Path, materialize: bool = True) -> Built:
    """Model from TorchTitan's registry on meta, parallelized, materialized and initialized
    (materialize=False leaves it on meta: the dry run materializes it on fake tensors)."""
    import importlib

    from torchtitan.config import CompileConfig
    from torchtitan.distributed.activation_checkpoint import FullAC

    family = importlib.import_module(f"torchtitan.models.{cfg.model.name}")
    spec = family.model_registry(cfg.model.flavor)
    mcfg = spec.model
    converted = convert_precision(mcfg, cfg)  # before update_from_config sets the TP sharding, as TorchTitan does
    on_cpu = cfg.cluster.device == DeviceType.cpu
    if on_cpu:
        from runner.run import titan_cpu

        titan_cpu.use_sdpa(mcfg)
        if materialize:  # the dry run keeps the GPU's grouped GEMM (it reads no token counts)
            titan_cpu.use_float32_experts(mcfg)
        if lay.cp > 1:
            titan_cpu.enable_ring_attention()
    training, parallelism = _titan_configs(cfg, lay)
    mcfg.update_from_config(config=SimpleNamespace(training=training, parallelism=parallelism))
    with torch.device("meta"):
        model = mcfg.build()
    num_params, flops_per_token = mcfg.get_nparams_and_flops(model, cfg.training.seq_len)
    ac = FullAC.Config() if cfg.training.activation_checkpoint == ActivationCheckpoint.full else None
    compile_config = CompileConfig(enable=cfg.training.compile, enable_async_tensor_parallel=cfg.parallelism.async_tp)
    common = dict(
        parallel_dims=pd, training=training, parallelism=parallelism, compile_config=compile_config, ac_config=ac, dump_folder=str(run_dir)
    )
    device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
    schedule, has_first, has_last = None, True, True
    if lay.pp > 1:
        schedule, parts, has_first, has_last = spec.pipelining_fn(
            model, **common, device=device, model_config=mcfg, parallelize_fn=spec.parallelize_fn, loss_fn=loss_fn(cfg)
        )
    else:
        parts = [spec.parallelize_fn(model, **common)]
    for part in parts if materialize else ():
        _materialize(part, mcfg, cfg, device)
    extra = _extra_inputs(parts[0], mcfg, cfg, device) if lay.pp == 1 else {}
    balancer = _cp_load_balancer(mcfg) if lay.cp > 1 else None
    built = Built(parts, pd, num_params, flops_per_token, extra, schedule, has_first, has_last, converted, balancer)
    built.post_optimizer_build_fn = spec.post_optimizer_build_fn
    return built


def register_optimizer_hooks(built: Built, optimizer: torch.optim.Optimizer) -> None:
    """What TorchTitan's trainer does after building the optimizer: for MoE models, a step pre-hook that
    moves each router's expert bias toward balance from the token counts summed over the batch and CP ranks."""
    if built.post_optimizer_build_fn is not None:
        built.post_optimizer_build_fn(optimizer, built.parts, built.parallel_dims)


def _cp_load_balancer(mcfg) -> str:
    """TorchTitan's pairing: head-tail chunks for causal SDPA, PTRR for FlexAttention block masks."""
    from torchtitan.models.common.attention import FlexAttention

    return "ptrr" if isinstance(mcfg.layers[0].attention.inner_attention, FlexAttention.Config) else "headtail"


def model_inputs(built: Built, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Tokens, labels and keyword inputs of one microbatch; with CP, this rank's sequence chunks
    (TorchTitan's prepare_context_parallel_input: load-balanced chunks, positions for RoPE)."""
    if built.cp_load_balancer is None:
        return inputs, labels, built.extra_inputs
    from torchtitan.distributed.context_parallel import prepare_context_parallel_input

    positions = torch.arange(inputs.shape[1], device=inputs.device).expand(inputs.shape)
    extra = {"positions": positions} | {k: v for k, v in built.extra_inputs.items() if k != "positions"}
    return prepare_context_parallel_input(inputs, labels, extra, built.parallel_dims.get_mesh("cp"), inputs.device, built.cp_load_balancer)


def convert_precision(model_config, cfg: RunConfig) -> list[str]:
    """Swap the Linear layers that runner.config.precision.conversion names for the recipe's FP8 Linear
    (in the model config, before any module exists); return the converted module FQNs."""
    from torchtitan.models.common.linear import Linear

    r = cfg.precision.fp8
    if r == Fp8Recipe.none:
        return []
    want, kept = precision.conversion(cfg)
    on_cpu = cfg.cluster.device == DeviceType.cpu
    if r in (Fp8Recipe.tensorwise, Fp8Recipe.rowwise):
        from torchtitan.components.quantization import Float8LinearConverter

        conf = Float8LinearConverter.Config(recipe_name=r.value, filter_fqns=sorted(kept))
        if on_cpu:
            from runner.run import titan_cpu

            converter = titan_cpu.float8_converter(conf)
        else:
            converter = conf.build()
        converter.convert(model_config)
    elif r == Fp8Recipe.mxfp8:  # validation rejects it on CPU
        from torchtitan.components.quantization import MXFP8LinearConverter

        MXFP8LinearConverter.Config(fqns=want).build().convert(model_config)
    else:
        if on_cpu:
            from runner.run import titan_cpu

            new = titan_cpu.emulated_blockwise_linear_config()
        else:
            new = blockwise_linear_config()
        _swap_linears(model_config, new, set(want))
    got = [fqn for fqn, c, _, _ in model_config.traverse(Linear.Config) if type(c) is not Linear.Config]
    if got != want:
        raise RuntimeError(f"FP8 conversion converted {got}, validation planned {want}: precision.linear_layers is out of date")
    return got


def _swap_linears(model_config, new_config_cls, fqns: set[str]) -> None:
    from torchtitan.models.common.linear import Linear

    for fqn, old, parent, attr in list(model_config.traverse(Linear.Config)):
        if fqn in fqns:
            new = new_config_cls(in_features=old.in_features, out_features=old.out_features, bias=old.bias, param_init=old.param_init)
            if isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)


_BLOCKWISE_LINEAR = None


def blockwise_linear_config():
    """torchao's blockwise FP8 Linear (SM 9.0+, Triton quantization kernels) as a TorchTitan
    module, wrapped the way TorchTitan wraps torchao's Float8Linear."""
    global _BLOCKWISE_LINEAR
    if _BLOCKWISE_LINEAR is None:
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear
        from torchtitan.models.common.linear import Linear
        from torchtitan.protocols.module import Module

        class BlockwiseFp8Linear(Float8BlockwiseLinear, Module):
            @dataclass(kw_only=True, slots=True)
            class Config(Linear.Config):
                pass

            def __init__(self, config: Config):
                Float8BlockwiseLinear.__init__(self, config.in_features, config.out_features, bias=config.bias)

        _BLOCKWISE_LINEAR = BlockwiseFp8Linear
    return _BLOCKWISE_LINEAR.Config


def _materialize(part: torch.nn.Module, mcfg, cfg: RunConfig, device) -> None:
    part.to_empty(device=device)
    if device.type == "cpu":
        from runner.run import titan_cpu

        titan_cpu.force_sum_reduction(part)
        with torch.no_grad():
            part.init_weights(buffer_device=None)  # buffers (RoPE tables); parameters follow
        titan_cpu.init_like_one_rank(part, mcfg, cfg.training.seed)
    else:
        torch.manual_seed(cfg.training.seed)
        with torch.no_grad():
            part.init_weights(buffer_device=None)
    part.train()


def _extra_inputs(model, mcfg, cfg: RunConfig, device) -> dict:
    """FlexAttention (the GPU default) needs a mask; one document per sample, causal."""
    from torchtitan.models.common.attention import FlexAttention

    if not isinstance(mcfg.layers[0].attention.inner_attention, FlexAttention.Config):
        return {}
    t = cfg.training
    positions = torch.arange(t.seq_len, device=device).expand(t.microbatch_size, t.seq_len)
    return {"positions": positions, "attention_masks": model.get_attention_masks(positions=positions)}


def loss_fn(cfg: RunConfig):
    """TorchTitan's cross-entropy: sum over tokens divided by the global token count, because
    TorchTitan's FSDP sums (does not average) gradients over data-parallel ranks."""
    from torchtitan.components.loss import CrossEntropyLoss

    return CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=cfg.model.vocab_size))


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor's value as a plain tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def clip_grad_norm(parts: list[torch.nn.Module], max_norm: float, pd) -> float:
    """Clip to the global gradient norm and return it (pre-clip), as TorchTitan's Trainer does: DTensor
    gradients reduce their norm over the axes they are sharded on (dp_shard, cp, tp; ep in the EP-aware
    variant, which sums the expert and dense parts), and the pipeline mesh sums the stages' parts."""
    return float(local_value(clip_grad_norm_tensor(parts, max_norm, pd)))


def clip_grad_norm_tensor(parts: list[torch.nn.Module], max_norm: float, pd) -> torch.Tensor:
    """clip_grad_norm without reading the norm back (the dry run's fake tensors hold no value)."""
    from torchtitan.distributed.utils import clip_grad_norm_

    grads = [p for m in parts for p in m.parameters() if p.grad is not None]
    return clip_grad_norm_(grads, max_norm, foreach=True, pp_mesh=pd.get_optional_mesh("pp"), ep_enabled=pd.ep_enabled)


def pipeline_step(built: Built, microbatches, global_tokens: torch.Tensor) -> torch.Tensor:
    """One pipeline schedule over this DP rank's batch; the loss share lives on the last stage."""
    inputs = torch.cat([i for i, _ in microbatches])
    labels = torch.cat([lab for _, lab in microbatches])
    losses = [] if built.has_last else None
    built.schedule.step(
        *((inputs,) if built.has_first else ()),
        target=labels if built.has_last else None,
        losses=losses,
        loss_kwargs={"global_valid_tokens": global_tokens},
        return_outputs=False,
    )
    return local_value(sum(loss.detach() for loss in losses)).cpu() if built.has_last else torch.zeros(())


def _optim_io():
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

    return StateDictOptions(flatten_optimizer_state_dict=True), get_optimizer_state_dict, set_optimizer_state_dict


def _holder(parts: list[torch.nn.Module]) -> torch.nn.Module:
    return parts[0] if len(parts) == 1 else torch.nn.ModuleList(parts)


def save_state(parts: list[torch.nn.Module], optimizer, extra: dict, path: Path, async_group=None):
    """Sharded checkpoint through PyTorch DCP: the model with TorchTitan's ModelWrapper (canonical,
    unfused keys, so another layout can load it), the optimizer with flattened FQN keys, and `extra`
    (step, LR schedule, RNG, data position). With `async_group` (a gloo group kept for checkpoints,
    so the writer thread's collectives never interleave with training's) DCP copies the state and
    writes it in a background thread; the returned future resolves when every rank has written."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer.base import ModelWrapper

    options, get_optim, _ = _optim_io()
    state = {"model": ModelWrapper(parts).state_dict(), "optimizer": get_optim(_holder(parts), optimizer, options=options), **extra}
    if async_group is not None:
        return dcp.async_save(state, checkpoint_id=str(path), process_group=async_group)
    dcp.save(state, checkpoint_id=str(path))
    return None


def save_model(parts: list[torch.nn.Module], path: Path) -> None:
    """The weights alone (the model-only export), sharded like a full checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer.base import ModelWrapper

    dcp.save({"model": ModelWrapper(parts).state_dict()}, checkpoint_id=str(path))


def load_state(parts: list[torch.nn.Module], optimizer, extra: dict, path: Path) -> dict:
    """Load model and optimizer in place from a checkpoint written by save_state; DCP reshards
    DTensors onto this run's layout. `extra` gives the other entries to read (their current values
    as templates); returns them as loaded."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer.base import ModelWrapper

    options, get_optim, set_optim = _optim_io()
    holder, wrapper = _holder(parts), ModelWrapper(parts)
    state = {"model": wrapper.state_dict(), "optimizer": get_optim(holder, optimizer, options=options), **extra}
    dcp.load(state, checkpoint_id=str(path))
    wrapper.load_state_dict(state["model"])
    set_optim(holder, optimizer, optim_state_dict=state["optimizer"], options=options)
    return {k: state[k] for k in extra}
