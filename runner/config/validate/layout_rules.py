"""Layout rules: world size, the degrees against the model and the node, sequence, async TP, EP.

Torch-free; called by validate.check. The world-size rule does not stop the others: every
rule runs on whatever the config fixes (the degrees always; dp_shard once it resolves).
"""

from __future__ import annotations

from runner.config import families
from runner.schema import DeviceType, ParallelismConfig, RunConfig, layout
from runner.schema.layout import Layout
from runner.schema.problems import Problem

DEGREES = ("dp_replicate", "tp", "pp", "cp", "ep")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def degrees_ok(p: ParallelismConfig) -> bool:
    """Every degree usable in arithmetic (the range rule reports the others)."""
    return all(getattr(p, name) >= 1 for name in DEGREES) and (p.dp_shard >= 1 or p.dp_shard == -1)


def tp_divides_heads(cfg: RunConfig) -> bool:
    return cfg.parallelism.tp in families.tp_degrees(cfg.model)


def resolved(cfg: RunConfig, ws: int | None) -> Layout | None:
    """The layout as far as it is fixed: a given dp_shard stands even when the world size is wrong;
    -1 resolves only against a world size that the other degrees divide."""
    p = cfg.parallelism
    if not degrees_ok(p):
        return None
    dp_shard = p.dp_shard
    if dp_shard == -1:
        fixed = layout.fixed_product(p)
        if ws is None or ws % fixed:
            return None
        dp_shard = ws // fixed
    return Layout(pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=dp_shard, cp=p.cp, tp=p.tp, ep=p.ep)


def _cluster_size(cfg: RunConfig, out: list[Problem]) -> bool:
    """Whether the cluster's node and device counts give (or leave to the layout) a world size."""
    c = cfg.cluster
    if c.num_nodes is None or c.num_nodes < 1:
        why = f"cluster {c.name} leaves the node count to the job" if c.num_nodes is None else "must be >= 1"
        out.append(Problem("cluster.num_nodes", c.num_nodes, why, "set cluster.num_nodes=N"))
        return False
    if c.devices_per_node < 1 and not layout.sized_by_layout(c):
        out.append(Problem("cluster.devices_per_node", c.devices_per_node, "must be >= 1 or -1", "set the devices per node"))
        return False
    if layout.sized_by_layout(c) and c.device != DeviceType.cpu:
        out.append(Problem("cluster.devices_per_node", -1, "only a CPU cluster may take its size from the layout", "set the GPUs per node"))
        return False
    if layout.sized_by_layout(c) and c.num_nodes != 1:
        out.append(Problem("cluster.devices_per_node", -1, "a size from the layout needs num_nodes = 1", "set cluster.devices_per_node"))
        return False
    return True


def world(cfg: RunConfig, out: list[Problem]) -> int | None:
    """The world size when the cluster and the degrees agree on one, else None (with the problem)."""
    p, c = cfg.parallelism, cfg.cluster
    if not _cluster_size(cfg, out) or not degrees_ok(p):
        return None
    ws = layout.world_size(p, c)
    if ws is None:
        out.append(
            Problem(
                "parallelism.dp_shard",
                -1,
                f"cluster {c.name} takes its world size from the layout, so -1 has nothing to absorb",
                "set parallelism.dp_shard=N, or cluster.devices_per_node=N for N ranks",
            )
        )
        return None
    fixed = layout.fixed_product(p)
    if p.dp_shard == -1 and ws % fixed:
        out.append(
            Problem(
                "parallelism",
                f"pp={p.pp} dp_replicate={p.dp_replicate} cp={p.cp} tp={p.tp}",
                f"their product {fixed} does not divide the world size {ws} (cluster {c.name}), so dp_shard=-1 cannot absorb the rest",
                f"choose degrees whose product divides {ws}",
            )
        )
        return None
    if p.dp_shard != -1 and fixed != ws:
        out.append(
            Problem(
                "parallelism",
                f"pp x dp_replicate x dp_shard x cp x tp = {fixed}",
                f"must equal the world size {ws} = cluster.num_nodes {c.num_nodes} x cluster.devices_per_node {c.devices_per_node}",
                "change the degrees, or set parallelism.dp_shard=-1 to absorb the remaining ranks",
            )
        )
        return None
    return ws


def tensor_parallel(cfg: RunConfig, ws: int | None, out: list[Problem]) -> None:
    """TP against the heads, the node and the sequence; the node rule needs the node's size."""
    p, m, c = cfg.parallelism, cfg.model, cfg.cluster
    if not tp_divides_heads(cfg):
        linear = f" and the linear-attention heads ({m.num_linear_key_heads} key, {m.num_linear_value_heads} value)"
        out.append(
            Problem(
                "parallelism.tp",
                p.tp,
                f"must divide model.num_heads = {m.num_heads} and model.num_kv_heads = {m.num_kv_heads}"
                + (linear if m.num_linear_value_heads else ""),
                f"use tp in {families.tp_degrees(m)}",
            )
        )
    per_node = layout.devices_per_node(c, ws) if ws is not None or not layout.sized_by_layout(c) else None
    if per_node is not None and per_node >= 1 and (p.tp > per_node or per_node % p.tp):
        out.append(
            Problem(
                "parallelism.tp",
                p.tp,
                f"a TP group must fit inside one node of {per_node} devices (cluster {c.name}) and divide it",
                f"use tp in {divisors(per_node)}",
            )
        )
    if p.tp > 1 and p.sequence_parallel and cfg.training.seq_len % p.tp:
        out.append(
            Problem(
                "training.seq_len",
                cfg.training.seq_len,
                f"sequence parallelism splits the sequence over tp = {p.tp}",
                f"use a multiple of {p.tp}, or parallelism.sequence_parallel=false",
            )
        )


def sequence(cfg: RunConfig, out: list[Problem]) -> None:
    p, t = cfg.parallelism, cfg.training
    if p.cp > 1 and t.seq_len % (2 * p.cp):
        out.append(
            Problem(
                "training.seq_len",
                t.seq_len,
                f"context parallelism with load balancing splits the sequence into 2 x cp = {2 * p.cp} chunks",
                f"use a multiple of {2 * p.cp}",
            )
        )
    if cfg.model.rope_max_seq_len >= 1 and t.seq_len > cfg.model.rope_max_seq_len:  # below 1: the model's own rule
        out.append(
            Problem(
                "training.seq_len",
                t.seq_len,
                f"longer than the model's RoPE table ({cfg.model.rope_max_seq_len})",
                f"use training.seq_len <= {cfg.model.rope_max_seq_len}",
            )
        )


def async_tp(cfg: RunConfig, out: list[Problem]) -> None:
    """TorchTitan's async TP is Inductor's micro-pipeline TP pass on symmetric memory: CUDA, compile, TP."""
    p, c = cfg.parallelism, cfg.cluster
    if not p.async_tp:
        return
    if c.device != DeviceType.cuda:
        out.append(
            Problem(
                "parallelism.async_tp",
                True,
                f"async TP overlaps TP collectives with matmuls through Inductor's micro-pipeline TP pass on CUDA symmetric "
                f"memory (torch.distributed._symmetric_memory); cluster {c.name} computes on {c.device.value} with "
                f"{c.backend.value}, which has neither",
                "set parallelism.async_tp=false here (mode=validate checks it for a CUDA cluster)",
            )
        )
    if not cfg.training.compile:
        out.append(
            Problem(
                "parallelism.async_tp",
                True,
                "async TP is a torch.compile (Inductor) pass, and training.compile is false",
                "set training.compile=true, or parallelism.async_tp=false",
            )
        )
    if p.tp < 2:
        out.append(
            Problem(
                "parallelism.async_tp", True, f"there is no TP collective to overlap with tp = {p.tp}", "use tp >= 2, or async_tp=false"
            )
        )


def experts(cfg: RunConfig, lay: Layout | None, out: list[Problem]) -> None:
    """TorchTitan's EP borrows its ranks from FSDP, CP and TP: ep must divide dp_shard x cp x tp
    (the rest, efsdp, shards the experts further) and the experts must split evenly over ep."""
    m, ep = cfg.model, cfg.parallelism.ep
    if ep <= 1:  # below 1: the degree rule's (validate.fields)
        return
    if m.num_experts == 0:
        out.append(
            Problem(
                "parallelism.ep",
                ep,
                f"expert parallelism needs a mixture-of-experts model (it shards the experts); model {m.name} {m.flavor} is dense",
                "use ep=1, or an MoE model (model=debug_moe)",
            )
        )
        return
    if m.num_experts > 0 and m.num_experts % ep:
        out.append(
            Problem(
                "parallelism.ep",
                ep,
                f"model.num_experts = {m.num_experts} must split evenly over the expert-parallel ranks",
                f"use ep in {divisors(m.num_experts)}",
            )
        )
    region = lay.dp_shard * lay.cp * lay.tp if lay is not None else None
    if region is not None and region % ep:
        out.append(
            Problem(
                "parallelism.ep",
                ep,
                f"EP takes its ranks from dp_shard x cp x tp = {lay.dp_shard} x {lay.cp} x {lay.tp} = {region} "
                "(TorchTitan: dp_shard * cp * tp == efsdp * ep), which it does not divide",
                f"use ep in {divisors(region)}, or raise parallelism.dp_shard",
            )
        )


def tied_pipeline(cfg: RunConfig, out: list[Problem]) -> None:
    """TorchTitan's Decoder.update_from_config raises NotImplementedError for a tied embedding under PP (the embedding
    and the head sit on different stages)."""
    if cfg.model.weight_tying and cfg.parallelism.pp > 1:
        out.append(
            Problem(
                "parallelism.pp",
                cfg.parallelism.pp,
                f"model {cfg.model.name} {cfg.model.flavor} ties its embedding to the output head, which TorchTitan does not "
                "support with pipeline parallelism",
                "use pp=1 (FSDP, TP or CP instead), or model.weight_tying=false",
            )
        )


def mtp_layout(cfg: RunConfig, out: list[Problem]) -> None:
    """TorchTitan 0.3.0's MTPDecoder.Config.update_from_config raises NotImplementedError for MTP under pipeline or
    context parallelism (its MTP blocks need the tokens and the embedding beside the last block, and unsplit sequences)."""
    if cfg.model.num_mtp_layers <= 0:
        return
    for axis, what in (("pp", "pipeline"), ("cp", "context")):
        degree = getattr(cfg.parallelism, axis)
        if degree > 1:
            out.append(
                Problem(
                    f"parallelism.{axis}",
                    degree,
                    f"model.num_mtp_layers = {cfg.model.num_mtp_layers}: TorchTitan 0.3.0 does not support multi-token "
                    f"prediction with {what} parallelism",
                    f"use parallelism.{axis}=1 (FSDP, TP or EP instead), or model.num_mtp_layers=0",
                )
            )
