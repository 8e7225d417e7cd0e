"""Start-up proof that the device mesh is the layout and that every TP group sits on one node.

Every rank compares its coordinates in TorchTitan's mesh with the ones the runner derives
from its global rank (mesh order pp, dp_replicate, dp_shard, cp, tp; TP fastest), then all
ranks gather (node, LOCAL_RANK). A TP group split over nodes would put its per-layer
all-reduces on the scale-out network: the run refuses to train and names the group.

Node identity is the hostname. For tests that simulate several nodes on one machine,
RUNNER_NODE_NAME sets the node name of every rank an agent starts, and RUNNER_NODE_NAMES
(comma-separated, indexed by global rank) sets the whole placement.
"""

from __future__ import annotations

import os

from runner.formats import local_checkpoint
from runner.schema.layout import Layout

NODE_NAME_ENV = local_checkpoint.NODE_NAME_ENV
NODE_NAMES_ENV = "RUNNER_NODE_NAMES"


class PlacementError(RuntimeError):
    """The launcher placed ranks so that the layout cannot run as intended."""


def node_name(rank: int) -> str:
    names = os.environ.get(NODE_NAMES_ENV)
    if names:
        return names.split(",")[rank]
    return local_checkpoint.this_node()


def tp_groups(lay: Layout) -> list[list[int]]:
    """TP varies fastest, so each TP group is a block of consecutive ranks."""
    return [list(range(start, start + lay.tp)) for start in range(0, lay.world_size, lay.tp)]


def split_tp_groups(lay: Layout, places: list[tuple[str, int]]) -> list[str]:
    """One line per TP group whose ranks are on more than one node."""
    out = []
    for group in tp_groups(lay):
        nodes = {places[r][0] for r in group}
        if len(nodes) > 1:
            where = ", ".join(f"rank {r} on {places[r][0]} (local rank {places[r][1]})" for r in group)
            out.append(f"TP group {group} spans {len(nodes)} nodes: {where}")
    return out


def describe_nodes(places: list[tuple[str, int]]) -> str:
    """'node0 ranks [0, 1]; node1 ranks [2, 3]' in order of first rank."""
    nodes: dict[str, list[int]] = {}
    for rank, (node, _) in enumerate(places):
        nodes.setdefault(node, []).append(rank)
    return "; ".join(f"{node} ranks {ranks}" for node, ranks in nodes.items())


def check(lay: Layout, mesh_coords: dict[str, int], rank: int, policy) -> list[tuple[str, int]]:
    """Raise PlacementError on a mismatch; return every rank's (node, local rank), gathered over the
    device policy's host group."""
    want = {**lay.coords(rank), "dp": lay.dp_rank(rank)}
    wrong = [f"{axis}: mesh {got}, layout {want[axis]}" for axis, got in mesh_coords.items() if got != want[axis]]
    if wrong:
        raise PlacementError(f"rank {rank}: TorchTitan's mesh coordinates differ from the runner's layout ({'; '.join(wrong)})")
    places_ = places(policy, rank)
    split = split_tp_groups(lay, places_)
    if split:
        raise PlacementError(
            "ranks are placed so that tensor-parallel groups cross nodes, which would put every layer's all-reduces "
            "on the scale-out network:\n  " + "\n  ".join(split) + "\nFix: start ranks node by node with contiguous "
            "global ranks (torchrun's c10d rendezvous does; with srun use --distribution=block, not cyclic/round-robin), "
            f"and keep tp <= GPUs per node ({lay.describe()})."
        )
    return places_


def places(policy, rank: int) -> list[tuple[str, int]]:
    """Every rank's (node, local rank), gathered over the device policy's host group."""
    return policy.all_gather_object((node_name(rank), int(os.environ.get("LOCAL_RANK", "0"))))
