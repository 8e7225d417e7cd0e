"""Process group, TorchTitan's ParallelDims and device mesh, and what ranks import before they build."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from runner.estimate import pipeline
from runner.run.device import DevicePolicy
from runner.schema import RunConfig
from runner.schema.layout import Layout

SPMD_BACKEND = "partial_dtensor"
"""The SPMD backend that composes FSDP2 + TP here; TorchTitan's default fails with dp_shard or tp > 1 (docs/CPU.md)."""


def titan_configs(cfg: RunConfig, lay: Layout):
    """TorchTitan's TrainingConfig and ParallelismConfig for this run and layout."""
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
    # private_api: titan_fqn_per_model_part
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    p, n = cfg.parallelism, cfg.model.num_layers
    first, last = p.pp_first_stage_less_layers, p.pp_last_stage_less_layers
    fqns = _generate_llm_fqn_per_model_part(lay.pp * p.pp_virtual_stages, n, first, last)
    got = [sum(f.startswith("layers.") for f in stage) for stage in fqns]
    want = pipeline.stage_layers(n, lay.pp * p.pp_virtual_stages, first, last)
    if got != want:
        raise RuntimeError(
            f"TorchTitan split {n} layers as {got}, runner.estimate.pipeline.stage_layers says {want}: the mirror is out of date"
        )
    return fqns


# What a rank imports while it builds and trains (measured: ~2,800 modules, about 10 s of CPU per rank);
# importing them in the agent before it forks the ranks (cluster.worker_start=fork) pays that once.
PRELOAD = (
    "runner.run.titan.cpu",
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
    if DevicePolicy.of(cfg.cluster, cfg.distributed).cpu:
        import logging

        logging.getLogger("torchao").setLevel(logging.ERROR)


def preload(cfg: RunConfig) -> None:
    """Import PRELOAD and the model's family, so that forked ranks inherit them. Imports only: no
    tensor op runs, so the agent starts no OpenMP pool that a forked rank would deadlock on."""
    import importlib

    quiet_torchao(cfg)
    for name in (*PRELOAD, f"torchtitan.models.{cfg.model.name}"):
        importlib.import_module(name)


def init_process_group(cfg: RunConfig, policy) -> None:
    """The default process group and the host group (runner.run.device), after TorchTitan's device
    globals on CPU; one per process."""
    if policy.cpu:
        import runner.run.titan.cpu as cpu

        cpu.patch_device_globals()
    policy.start_group(cfg.distributed.timeout_s)


def build_mesh(cfg: RunConfig, lay: Layout):
    """TorchTitan's ParallelDims and device mesh for this layout over the whole default group. Several
    layouts may be built one after another in one process group (runner.run.layout_parity)."""
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.distributed import ParallelDims

    pd = ParallelDims.from_config(titan_configs(cfg, lay)[1], dist.get_world_size())
    pd.build_mesh()
    _set_group_timeouts(datetime.timedelta(seconds=cfg.distributed.timeout_s))
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
    # private_api: torch_set_pg_timeout, torch_c10d_world
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world

    for pg in list(_world.pg_names):
        if pg.rank() >= 0 and dist.get_backend(pg) in ("gloo", "nccl"):  # not the fake groups of size-1 mesh axes
            _set_pg_timeout(timeout, pg)
