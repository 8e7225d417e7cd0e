"""The model: TorchTitan's config from the runner's, built on meta, parallelized in TorchTitan's order
(TP, activation checkpointing, compile, FSDP; or its pipeline split), materialized and initialized."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from runner.run.device import DevicePolicy
from runner.run.titan.distributed import titan_configs
from runner.run.titan.fp8_conversion import convert_experts, convert_precision
from runner.run.titan.initial_weights import init_weights
from runner.run.titan.model import check_size, model_spec
from runner.run.titan.moe import use_comm_backend, use_load_balance
from runner.run.titan.step import loss_fn
from runner.run.titan.weight_pass import recompute_once
from runner.schema import ActivationCheckpoint, RunConfig
from runner.schema.layout import Layout


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
    experts_converted: list[str] | None = None
    """Routed experts (GroupedExperts FQNs) converted to precision.experts' FP8, as found in the model config."""
    post_optimizer_build_fn: object = None
    """The model's optimizer hook from its TorchTitan spec (MoE: auxiliary-loss-free expert-bias updates)."""
    attention_masks: bool = False
    """The inner attention takes block masks (FlexAttention, the GPU default): a pipeline step builds them per batch."""
    spec: object = None
    """TorchTitan's ModelSpec the parts were built from (its state_dict_adapter reads Hugging Face weights)."""


def model_config(cfg: RunConfig, lay: Layout, materialize: bool = True):
    """(TorchTitan's ModelSpec, the FP8 Linear layers converted, the FP8 routed experts): the config's architecture, its
    FP8 recipe and experts' precision, the CPU adaptations and TorchTitan's own sharding settings for the layout, ready
    to build."""
    spec = model_spec(cfg.model)
    mcfg = spec.model
    converted = convert_precision(mcfg, cfg)  # before update_from_config sets the TP sharding, as TorchTitan does
    # the token exchange first: the experts' converters swap its dispatcher for one that pads (TorchAO's, or HybridEP's)
    use_comm_backend(mcfg, cfg.parallelism.moe_comm_backend.value)
    experts = convert_experts(mcfg, cfg, materialize)  # before use_float32_experts, which leaves converted experts
    if DevicePolicy.of(cfg.cluster, cfg.distributed).cpu:  # the CPU adaptations (runner.run.titan.cpu)
        import runner.run.titan.cpu as cpu

        if cfg.eval.cpu_flex_attention:  # TEST-ONLY: keep FlexAttention for parity's forward-only pass
            cpu.eager_flex_attention()
        else:
            cpu.use_sdpa(mcfg)
        if materialize:  # the dry run keeps the GPU's grouped GEMM (it reads no token counts)
            cpu.use_float32_experts(mcfg)
        if lay.cp > 1:
            cpu.enable_ring_attention()
    use_load_balance(mcfg, cfg.model.load_balance_coeff)
    training, parallelism = titan_configs(cfg, lay)
    # activation_checkpoint and compile: minimal_async_ep's check reads them (it needs full recompute)
    ns = SimpleNamespace(training=training, parallelism=parallelism, activation_checkpoint=ac_config(cfg), compile=_compile_config(cfg))
    mcfg.update_from_config(config=ns)
    return spec, converted, experts


def build(cfg: RunConfig, lay: Layout, pd, run_dir: Path, device: torch.device, materialize: bool = True) -> Built:
    """The model of cfg.model on meta, checked against runner.estimate.flops, parallelized, materialized on `device`
    (the device policy's compute device) and initialized; materialize=False leaves it on meta (the dry run
    materializes it on fake tensors)."""
    spec, converted, experts = model_config(cfg, lay, materialize)
    mcfg = spec.model
    with torch.device("meta"):
        model = mcfg.build()
    num_params, flops_per_token = mcfg.get_nparams_and_flops(model, cfg.training.seq_len)
    check_size(cfg.model, cfg.training.seq_len, num_params, flops_per_token)
    schedule, parts, has_first, has_last = _parallelize(cfg, lay, pd, run_dir, spec, model, device)
    recompute_once(cfg, schedule)
    for part in parts if materialize else ():
        _materialize(part, mcfg, cfg, device)
    masks = _uses_flex(mcfg)
    extra = _extra_inputs(parts[0], cfg, device) if lay.pp == 1 and masks else {}
    balancer = _cp_load_balancer(mcfg) if lay.cp > 1 else None
    built = Built(parts, pd, num_params, flops_per_token, extra, schedule, has_first, has_last, converted, cp_load_balancer=balancer)
    built.post_optimizer_build_fn, built.spec = spec.post_optimizer_build_fn, spec
    built.experts_converted = experts
    built.attention_masks = masks
    return built


def ac_config(cfg: RunConfig):
    """TorchTitan's activation-checkpointing policy config for training.activation_checkpoint (None: no AC)."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    ac = cfg.training.activation_checkpoint
    if ac == ActivationCheckpoint.full:
        return FullAC.Config()
    if ac == ActivationCheckpoint.selective_op:
        return SelectiveAC.Config()
    if ac == ActivationCheckpoint.selective_layer:
        return _every_nth_block_ac().Config(every=cfg.training.ac_layer_frequency)
    return None


@functools.cache
def _every_nth_block_ac():
    """Per-layer selective AC: TorchTitan 0.3.0 dropped its selective_ac_option=N, so this wraps every N-th block
    of a model part (as that option did: blocks N-1, 2N-1, ...) with TorchTitan's own FullAC wrapper."""
    # private_api: titan_disable_dynamo_lru_cache, titan_full_ac_wrap_block
    from torchtitan.distributed.activation_checkpoint import FullAC, _disable_dynamo_lru_cache
    from torchtitan.tools.logging import logger

    class EveryNthBlockAC(FullAC):
        @dataclass(kw_only=True, slots=True)
        class Config(FullAC.Config):
            every: int = 2
            """Recompute every N-th transformer block."""

        def apply(self, model) -> None:
            _disable_dynamo_lru_cache()
            layers = model.get_submodule("layers")
            wrapped = []
            for i, (layer_id, block) in enumerate(list(layers.named_children())):
                if (i + 1) % self.config.every == 0:
                    layers.register_module(layer_id, self._wrap_block(block, base_fqn=f"layers.{layer_id}"))
                    wrapped.append(layer_id)
            logger.info(f"Applied full activation checkpointing to every {self.config.every}th block: layers {', '.join(wrapped)}")

    return EveryNthBlockAC


def _compile_config(cfg: RunConfig):
    from torchtitan.config import CompileConfig

    return CompileConfig(enable=cfg.training.compile, enable_async_tensor_parallel=cfg.parallelism.async_tp)


def _parallelize(cfg: RunConfig, lay: Layout, pd, run_dir: Path, spec, model, device):
    """(schedule, parts, has_first, has_last) from the spec's parallelize_fn, or its pipelining_fn when pp > 1."""
    training, parallelism = titan_configs(cfg, lay)
    ac = ac_config(cfg)
    compile_config = _compile_config(cfg)
    common = dict(
        parallel_dims=pd, training=training, parallelism=parallelism, compile_config=compile_config, ac_config=ac, dump_folder=str(run_dir)
    )
    if lay.pp > 1:
        return spec.pipelining_fn(
            model, **common, device=device, model_config=spec.model, parallelize_fn=spec.parallelize_fn, loss_fn=loss_fn(cfg)
        )
    return None, [spec.parallelize_fn(model, **common)], True, True


def register_optimizer_hooks(built: Built, optimizer: torch.optim.Optimizer) -> None:
    """What TorchTitan's trainer does after building the optimizer: for MoE models, a step pre-hook that
    moves each router's expert bias toward balance from the token counts summed over the batch and CP ranks."""
    if built.post_optimizer_build_fn is not None:
        built.post_optimizer_build_fn(optimizer, built.parts, built.parallel_dims)


def _cp_load_balancer(mcfg) -> str:
    """TorchTitan's pairing: head-tail chunks for causal SDPA, PTRR for FlexAttention block masks."""
    return "ptrr" if _uses_flex(mcfg) else "headtail"


def _materialize(part: torch.nn.Module, mcfg, cfg: RunConfig, device) -> None:
    part.to_empty(device=device)
    if DevicePolicy.of(cfg.cluster, cfg.distributed).cpu:
        import runner.run.titan.cpu as cpu

        cpu.force_sum_reduction(part)
        with torch.no_grad():
            part.init_weights(buffer_device=None)  # buffers (RoPE tables); parameters follow
        cpu.init_like_one_rank(part, mcfg, cfg.training.seed)
    else:
        init_weights(part, cfg.training.seed)
    part.train()


def tie_weights(part: torch.nn.Module) -> None:
    """The first thing TorchTitan's Decoder.init_states does for a model that ties its embedding to its output head
    (Qwen3's, enable_weight_tying): point tok_embeddings.weight at lm_head.weight again, as to_empty (meta to a device)
    and TP's distribution each give the two modules a parameter of their own. Real runs get it from init_states
    (_materialize, initial_weights.init_weights); the dry run, which skips init_states on fake tensors, calls this."""
    if getattr(part, "enable_weight_tying", False) and part.tok_embeddings is not None and part.lm_head is not None:
        part.tok_embeddings.weight = part.lm_head.weight


def _uses_flex(mcfg) -> bool:
    from torchtitan.models.common.attention import FlexAttention

    return isinstance(mcfg.layers[0].attention.inner_attention, FlexAttention.Config)


def _extra_inputs(model, cfg: RunConfig, device) -> dict:
    """FlexAttention (the GPU default) needs a mask; without a pipeline every microbatch has the same shape, so one
    mask (one document per sample, causal) is built here. The pipeline step builds its own per batch (titan.step)."""
    t = cfg.training
    positions = torch.arange(t.seq_len, device=device).expand(t.microbatch_size, t.seq_len)
    return {"positions": positions, "attention_masks": model.get_attention_masks(positions=positions)}
