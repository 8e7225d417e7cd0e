"""Initial weights, a function of training.seed and each unit's name: the same in any pipeline stage, virtual stage or
layout, and no two units alike (runner.run.titan.build materializes the model parts with it; the CPU path's one-rank
reference model too)."""

from __future__ import annotations

import hashlib

import torch


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """TorchTitan's init_weights, then each unit of the model (a direct child, or an entry of a child ModuleDict: the
    blocks, keyed by their global layer id) drawn again from a generator seeded from (seed, its FQN). A unit's weights
    are then the same in any pipeline stage, virtual stage or layout, and no two units share a stream: one seed per
    model part gave the stages of one structure the same blocks. The CPU path initializes its one-rank model so too.
    The first pass starts every rank from `seed`: DTensor creates its RNG tracker at the first random op on a DTensor
    and then sets every rank's generator to rank 0's; the units are drawn after that."""
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # buffers, tied weights and anything outside a unit
        for fqn, unit in _init_units(model):
            torch.manual_seed(unit_seed(seed, fqn))
            unit.init_states(buffer_device=None)


def unit_seed(seed: int, fqn: str) -> int:
    """The seed of the unit `fqn` (`layers.3`, `tok_embeddings`): 63 bits of a hash of both, so distinct FQNs get
    unrelated streams, none of them training.seed's own."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{fqn}".encode(), digest_size=8).digest(), "little") >> 1


def _init_units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(FQN, TorchTitan module) of each unit init_weights seeds; inside an activation-checkpointing wrapper, the block.
    A pipeline split keeps a ModuleDict's keys (TorchTitan's decoders' `layers`) but renumbers a ModuleList's."""
    from torchtitan.protocols.module import Module

    units = []
    for name, child in model.named_children():
        containers = (torch.nn.ModuleDict, torch.nn.ModuleList)
        entries = [(f"{name}.{k}", e) for k, e in child.named_children()] if isinstance(child, containers) else [(name, child)]
        for fqn, entry in entries:
            unit = next((m for m in entry.modules() if isinstance(m, Module)), None)
            if unit is not None:
                units.append((fqn, unit))
    return units
