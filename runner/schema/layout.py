"""The parallel layout as plain numbers: degrees, world size, rank coordinates.

Torch-free (like TorchTitan's ParallelDims, but with no mesh): validation, planning
and the mesh check all read it. Mesh order is (pp, dp_replicate, dp_shard, cp, tp):
TP varies fastest, so a TP group is consecutive ranks, i.e. consecutive local ranks
of one node when the launcher assigns ranks contiguously per node.
"""

from __future__ import annotations

from dataclasses import dataclass

from runner.schema import ClusterConfig, ParallelismConfig

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many distinct batches a step reads."""
        return self.dp_replicate * self.dp_shard

    def coords(self, rank: int) -> dict[str, int]:
        """Row-major coordinates of `rank` in MESH_ORDER."""
        out = {}
        for axis in reversed(MESH_ORDER):
            size = getattr(self, axis)
            rank, out[axis] = divmod(rank, size)
        return {axis: out[axis] for axis in MESH_ORDER}

    def dp_rank(self, rank: int) -> int:
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def describe(self) -> str:
        parts = [f"{a}={getattr(self, a)}" for a in (*MESH_ORDER, "ep") if getattr(self, a) > 1]  # ep borrows dp_shard/cp/tp ranks
        return " x ".join(parts) if parts else "single rank"


def label(lay: Layout, p: ParallelismConfig) -> str:
    """Compact name of the layout that ran, for run names and tables: degrees > 1 (dpr = replicas,
    dp = FSDP shards) and, with pp, the schedule and the stages per rank when more than one, e.g.
    `tp8_pp4_1F1B_dp32`, `pp2_DualPipeV_v2`, `dpr2`. The preset the config started from is `p.name`."""
    parts = [f"{axis}{n}" for axis, n in (("tp", lay.tp), ("cp", lay.cp), ("ep", lay.ep)) if n > 1]
    if lay.pp > 1:
        parts.append(f"pp{lay.pp}_{p.pp_schedule}" + (f"_v{p.pp_virtual_stages}" if p.pp_virtual_stages > 1 else ""))
    parts += [f"{axis}{n}" for axis, n in (("dpr", lay.dp_replicate), ("dp", lay.dp_shard)) if n > 1]
    return "_".join(parts) or "single"


def fixed_product(p: ParallelismConfig) -> int:
    """Product of every degree except a -1 dp_shard."""
    n = p.pp * p.dp_replicate * p.cp * p.tp
    return n * (p.dp_shard if p.dp_shard != -1 else 1)


def sized_by_layout(c: ClusterConfig) -> bool:
    """A cluster (local CPU, one node) whose ranks per node are whatever the layout asks for."""
    return c.devices_per_node == -1


def devices_per_node(c: ClusterConfig, world_size: int) -> int:
    """Ranks on one node: the cluster's figure, or the whole job on a cluster sized by its layout."""
    return world_size if sized_by_layout(c) else c.devices_per_node


def world_size(p: ParallelismConfig, c: ClusterConfig) -> int | None:
    """Ranks in the job; None when neither the cluster nor the layout fixes it."""
    if not sized_by_layout(c):
        return c.num_nodes * c.devices_per_node
    if p.dp_shard == -1:
        return None
    return fixed_product(p)


def resolve(p: ParallelismConfig, c: ClusterConfig) -> Layout:
    """Degrees with dp_shard=-1 absorbed. Call only on a validated config."""
    ws = world_size(p, c)
    assert ws is not None, "resolve() on an unvalidated config"
    dp_shard = ws // fixed_product(p) if p.dp_shard == -1 else p.dp_shard
    return Layout(pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=dp_shard, cp=p.cp, tp=p.tp, ep=p.ep)


def group_of(lay: Layout, rank: int, axis: str) -> list[int]:
    """Ranks that share every coordinate with `rank` except along `axis`."""
    me = lay.coords(rank)
    return [r for r in range(lay.world_size) if all(v == me[a] for a, v in lay.coords(r).items() if a != axis)]
