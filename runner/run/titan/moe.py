"""TorchTitan's MoE bookkeeping, read and kept exact: the routed experts' token counts (`tokens_per_expert_E`, added in
each MoE forward and zeroed by the optimizer's step pre-hook that moves the expert bias, TorchTitan's auxiliary-loss-free
load balancing in components/optimizer.py)."""

from __future__ import annotations

import torch


def moe_blocks(parts: list[torch.nn.Module]) -> list[tuple[int, torch.nn.Module]]:
    """This rank's MoE blocks as (model block index, block), walked as TorchTitan's pre-hook walks them (`layers` keeps
    the model's block indices as keys in every pipeline stage)."""
    out = []
    for part in parts:
        for key, block in getattr(part, "layers", {}).items():
            if getattr(block, "moe_enabled", False):
                out.append((int(key), block))
    return out


def _recomputed(block: torch.nn.Module) -> bool:
    """Full activation checkpointing runs the block's forward twice, counting its tokens twice (TorchTitan's
    _is_recomputation_enabled, whose pre-hook halves the counts the same way)."""
    # private_api: torch_checkpoint_impl
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl

    return getattr(block, "checkpoint_impl", None) is CheckpointImpl.NO_REENTRANT


def take_counts(blocks: list[tuple[int, torch.nn.Module]]) -> torch.Tensor:
    """(blocks, experts) float32 on the device: each block's tokens per expert since they were last zeroed. Without load
    balancing nothing else reads or zeroes them, so they are zeroed here (each call then returns one step's counts);
    with it they stay for the pre-hook. Device ops only: no host synchronization."""
    rows = []
    for _, block in blocks:
        moe = block.moe
        counts = moe.tokens_per_expert_E
        local = counts.to_local() if hasattr(counts, "to_local") else counts
        rows.append(local // 2 if _recomputed(block) else local.clone())
        if moe.load_balance_coeff is None:
            counts.zero_()
    return torch.stack(rows)


def clear_counts(parts: list[torch.nn.Module]) -> None:
    """A step whose gradients are dropped (the loss guard's skip or rewind, a step torchft did not commit) runs no
    optimizer step, so no pre-hook zeroes its counts: zero them, or the next expert-bias update counts two batches."""
    with torch.no_grad():
        for _, block in moe_blocks(parts):
            block.moe.tokens_per_expert_E.zero_()


def expert_biases(parts: list[torch.nn.Module]) -> dict[str, list[float]]:
    """Each of this rank's MoE blocks' load-balancing bias (TorchTitan's `expert_bias_E`, moved by the optimizer's
    pre-hook from the token counts summed over the batch ranks: the same on every rank) by block index; none without
    balancing. A host read: for parity checks after training, never in the step."""
    out = {}
    for key, block in moe_blocks(parts):
        bias = block.moe.expert_bias_E
        if bias is not None:
            out[str(key)] = (bias.to_local() if hasattr(bias, "to_local") else bias).detach().cpu().tolist()
    return out


def use_comm_backend(model_config, backend: str) -> None:
    """parallelism.moe_comm_backend in every MoE block's token dispatcher, through TorchTitan's own builder
    (make_token_dispatcher_config, as its layer builders call it); hybridep non-blocking with capacity factor 1.0, as
    TorchTitan's *_hybridep configs run it (no host read, no token dropped). The layer builders in model.py build
    `standard`; update_from_config then fills the buffers' sizes from the training shape."""
    if backend == "standard":
        return
    from torchtitan.models.common.config_utils import make_token_dispatcher_config

    for layer in model_config.layers:
        moe = getattr(layer, "moe", None)
        if moe is None:
            continue
        old = moe.routed_experts.token_dispatcher
        moe.routed_experts.token_dispatcher = make_token_dispatcher_config(
            num_experts=old.num_experts,
            top_k=old.top_k,
            comm_backend=backend,
            non_blocking_capacity_factor=1.0 if backend == "hybridep" else None,
            hidden_dim=model_config.dim,
        )


def use_load_balance(model_config, coeff: float) -> None:
    """model.load_balance_coeff in every MoE block (TorchTitan's MoE.Config.load_balance_coeff; None turns the bias and
    its optimizer pre-hook off, as TorchTitan takes it)."""
    for layer in model_config.layers:
        if getattr(layer, "moe", None) is not None:
            layer.moe.load_balance_coeff = coeff if coeff > 0 else None
