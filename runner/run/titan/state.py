"""Checkpoints through PyTorch DCP with TorchTitan's ModelWrapper (canonical, unfused keys)."""

from __future__ import annotations

from pathlib import Path

import torch


def _optim_io():
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

    return StateDictOptions(flatten_optimizer_state_dict=True), get_optimizer_state_dict, set_optimizer_state_dict


def _holder(parts: list[torch.nn.Module]) -> torch.nn.Module:
    return parts[0] if len(parts) == 1 else torch.nn.ModuleList(parts)


def save_state(
    parts: list[torch.nn.Module], optimizer, extra: dict, path: Path, async_group=None, stager=None, *, no_dist=False, asynchronous=False
):
    """Sharded checkpoint through PyTorch DCP: the model with TorchTitan's ModelWrapper (canonical,
    unfused keys, so another layout can load it), the optimizer (the torch optimizers inside TorchTitan's
    OptimizersContainer, which DCP would take for one optimizer) with flattened FQN keys, and `extra`
    (step, LR schedule, RNG, data position). With `async_group` (a gloo group kept for checkpoints,
    so the writer thread's collectives never interleave with training's) DCP copies the state and
    writes it in a background thread with `stager` (DCP's DefaultStager); returns (written, staged): futures that resolve when
    every rank has written, and when the copy is taken (None: taken before the return). With `no_dist` this rank
    saves its own shards alone (no collective: the node-local tier, runner.run.local_tier), asynchronously when
    `asynchronous`."""
    import torch.distributed.checkpoint as dcp

    state = training_state(parts, optimizer, extra)
    if async_group is not None or (no_dist and asynchronous):
        got = dcp.async_save(state, checkpoint_id=str(path), process_group=async_group, async_stager=stager, no_dist=no_dist)
        if isinstance(got, dcp.state_dict_saver.AsyncSaveResponse):  # async staging: the copy is still being taken
            return got.upload_completion, got.staging_completion
        return got, None
    dcp.save(state, checkpoint_id=str(path), no_dist=no_dist)
    return None, None


def training_state(parts: list[torch.nn.Module], optimizer, extra: dict) -> dict:
    """What save_state writes: the model (ModelWrapper's canonical keys), the optimizer (flattened FQN keys) and `extra`."""
    from torchtitan.components.checkpointer.base import ModelWrapper

    options, get_optim, _ = _optim_io()
    return {"model": ModelWrapper(parts).state_dict(), "optimizer": get_optim(_holder(parts), list(optimizer), options=options), **extra}


def save_model(parts: list[torch.nn.Module], path: Path) -> None:
    """The weights alone (the model-only export), sharded like a full checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer.base import ModelWrapper

    dcp.save({"model": ModelWrapper(parts).state_dict()}, checkpoint_id=str(path))


def load_model(parts: list[torch.nn.Module], path: Path) -> int:
    """Load only the model, in place, from a checkpoint written by save_state (or save_model) under any layout: DCP reads
    the "model" entries this rank's parts hold (ModelWrapper's canonical keys) and reshards them onto this layout; the
    optimizer, schedule and data position in the checkpoint are left unread. Returns how many tensors were loaded."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer.base import ModelWrapper

    wrapper = ModelWrapper(parts)
    state = {"model": wrapper.state_dict()}
    dcp.load(state, checkpoint_id=str(path))
    wrapper.load_state_dict(state["model"])
    return len(state["model"])


def load_state(parts: list[torch.nn.Module], optimizer, extra: dict, path: Path, *, no_dist: bool = False) -> dict:
    """Load model and optimizer in place from a checkpoint written by save_state; DCP reshards
    DTensors onto this run's layout. `extra` gives the other entries to read (their current values
    as templates); returns them as loaded. With `no_dist` this rank reads a shard it saved alone (save_state's `no_dist`),
    into the same layout."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer.base import ModelWrapper

    options, get_optim, set_optim = _optim_io()
    holder, wrapper = _holder(parts), ModelWrapper(parts)
    state = {"model": wrapper.state_dict(), "optimizer": get_optim(holder, list(optimizer), options=options), **extra}
    dcp.load(state, checkpoint_id=str(path), no_dist=no_dist)
    wrapper.load_state_dict(state["model"])
    set_optim(holder, list(optimizer), optim_state_dict=state["optimizer"], options=options)
    return {k: state[k] for k in extra}
