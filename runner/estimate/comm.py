"""Communication of one step in the step budget: TP, PP, DP, CP and EP traffic per device and its time
(conventions in runner/estimate/plan.py's docstring)."""

from __future__ import annotations

from typing import Any

from runner.estimate import flops, moe_comm
from runner.estimate.memory import BYTES, keeps_weights_gathered
from runner.schema import ActivationCheckpoint, RunConfig
from runner.schema.layout import MESH_ORDER, Layout


def link(lay: Layout, axis: str, devices_per_node: int) -> str:
    """'intra-node' when every group of `axis` sits inside one node, else 'scale-out'."""
    stride = 1
    for a in reversed(MESH_ORDER):
        if a == axis:
            break
        stride *= getattr(lay, a)
    extent = stride * getattr(lay, axis)
    return "intra-node" if extent <= devices_per_node and devices_per_node % extent == 0 else "scale-out"


def _collective_s(nbytes: float, gbs: float) -> float | None:
    """Seconds to send `nbytes` per device over a link of `gbs` (both directions together)."""
    return nbytes / (gbs / 2 * 1e9) if gbs > 0 else None


def links(lay: Layout, devices_per_node: int) -> dict[str, str]:
    return {a: link(lay, a, devices_per_node) for a in MESH_ORDER}


def _tp(cfg: RunConfig, lay: Layout, micro: int, act_bytes: float, gbs: float) -> tuple[float, float | None]:
    """Per layer 2 all-reduces forward + 2 backward (+2 when the forward is recomputed)."""
    if lay.tp == 1:
        return 0.0, 0.0
    ac = cfg.training.activation_checkpoint != ActivationCheckpoint.none
    vol = cfg.model.num_layers / lay.pp * micro * (4 + (2 if ac else 0)) * 2 * (lay.tp - 1) / lay.tp * act_bytes
    return vol, _collective_s(vol, gbs)


def _pp(cfg: RunConfig, lay: Layout, micro: int, v: int, act_bytes: float, gbs: float) -> tuple[float, float | None]:
    """Each microbatch sends its activation forward and its gradient back at each of v stage edges."""
    if lay.pp == 1:
        return 0.0, 0.0
    sp = cfg.parallelism.sequence_parallel and lay.tp > 1
    vol = 2 * micro * v * act_bytes / (lay.tp if sp else 1)
    return vol, _collective_s(vol, gbs)


def _dp(cfg: RunConfig, lay: Layout, micro: int, lk: dict[str, str], gbs_of: dict[str, float]) -> tuple[float, float | None]:
    """FSDP all-gathers weights and reduce-scatters gradients; HSDP/DDP all-reduce over replicas."""
    bw, br = BYTES[cfg.precision.param_dtype.value], BYTES[cfg.precision.reduce_dtype.value]
    params_gpu = flops.params_per_ep_rank(cfg.model, lay.ep) / (lay.tp * lay.pp)  # routed experts split over ep first
    syncs = 1 if lay.pp > 1 else micro  # the pipeline schedule syncs gradients once; accumulation every microbatch
    gathers = 1 if keeps_weights_gathered(cfg, lay) else 2 * micro
    f, r = lay.dp_shard, lay.dp_replicate
    shard_vol = (gathers * params_gpu * bw + syncs * params_gpu * br) * (f - 1) / f if f > 1 else 0.0
    rep_vol = syncs * 2 * (r - 1) / r * params_gpu / f * br if r > 1 else 0.0
    times = [_collective_s(vol, gbs_of[lk[a]]) if vol else 0.0 for vol, a in ((shard_vol, "dp_shard"), (rep_vol, "dp_replicate"))]
    return shard_vol + rep_vol, None if None in times else sum(times)


def _cp(cfg: RunConfig, lay: Layout, micro: int, gbs: float) -> tuple[float, float | None]:
    """Ring attention passes K and V chunks cp-1 times forward; backward passes K, V, dK, dV."""
    if lay.cp == 1:
        return 0.0, 0.0
    m, t = cfg.model, cfg.training
    ac = t.activation_checkpoint != ActivationCheckpoint.none
    kv_bytes = (
        t.microbatch_size * (t.seq_len / lay.cp) * m.num_kv_heads * flops.head_dim(m) / lay.tp * BYTES[cfg.precision.param_dtype.value]
    )
    vol = m.num_layers / lay.pp * micro * (lay.cp - 1) * (6 + (2 if ac else 0)) * kv_bytes
    return vol, _collective_s(vol, gbs)


def _ep(cfg: RunConfig, lay: Layout, micro: int, gbs: float) -> tuple[float, float | None]:
    """Each MoE block sends its tokens to the EP ranks of their experts and back (dispatch + combine) forward and
    again backward (+ forward again under recomputation): per token the rows moe_comm.copies_per_token counts for
    parallelism.moe_comm_backend (standard and minimal_async_ep: one per routed expert on another rank; deepep and
    hybridep: one per other rank holding any of them)."""
    if lay.ep == 1:
        return 0.0, 0.0
    m, t = cfg.model, cfg.training
    ac = t.activation_checkpoint != ActivationCheckpoint.none
    dedup = moe_comm.BACKENDS[cfg.parallelism.moe_comm_backend].dedup
    rows = moe_comm.copies_per_token(m.num_experts, m.num_experts_per_token, lay.ep, dedup)
    routed = t.microbatch_size * (t.seq_len / lay.cp) * rows * m.dim * BYTES[cfg.precision.param_dtype.value]
    vol = flops.num_moe_layers(m) / lay.pp * micro * (4 + (2 if ac else 0)) * routed
    return vol, _collective_s(vol, gbs)


def moe_host_syncs(cfg: RunConfig, lay: Layout, micro: int) -> int:
    """Host synchronizations the EP token exchange adds to a pipeline rank's step (moe_comm.host_syncs_per_step): its
    MoE blocks times the forwards of each (its microbatches, twice under activation checkpointing, which runs the
    forward again; per-layer AC recomputes only some blocks, so this is at most)."""
    if lay.ep == 1:
        return 0
    recompute = cfg.training.activation_checkpoint != ActivationCheckpoint.none
    blocks = -(-flops.num_moe_layers(cfg.model) // lay.pp)
    return moe_comm.host_syncs_per_step(cfg.parallelism.moe_comm_backend, blocks, micro * (2 if recompute else 1))


def communication(cfg: RunConfig, lay: Layout, micro: int, v: int, devices_per_node: int, gbs_of: dict[str, float]) -> dict[str, Any]:
    """Traffic (GB) and time (s, None when a link's bandwidth is unknown) of every parallel axis."""
    t = cfg.training
    lk = links(lay, devices_per_node)
    act_bytes = t.microbatch_size * (t.seq_len / lay.cp) * cfg.model.dim * BYTES[cfg.precision.param_dtype.value]
    # TorchTitan's sparse mesh (pp, dp_replicate, efsdp, ep) puts an EP group on consecutive ranks
    ep_link = "intra-node" if lay.ep <= devices_per_node and devices_per_node % lay.ep == 0 else "scale-out"
    out: dict[str, Any] = {"links": {a: lk[a] for a in MESH_ORDER if getattr(lay, a) > 1}}
    for axis, (vol, secs) in {
        "tp": _tp(cfg, lay, micro, act_bytes, gbs_of[lk["tp"]]),
        "pp": _pp(cfg, lay, micro, v, act_bytes, gbs_of[lk["pp"]]),
        "dp": _dp(cfg, lay, micro, lk, gbs_of),
        "cp": _cp(cfg, lay, micro, gbs_of[lk["cp"]]),
        "ep": _ep(cfg, lay, micro, gbs_of[ep_link]),
    }.items():
        out[f"{axis}_comm_gb"], out[f"{axis}_comm_s"] = vol / 1e9, secs
    out["ep_link"] = ep_link if lay.ep > 1 else None
    out["moe_host_syncs"] = moe_host_syncs(cfg, lay, micro)
    return out
