"""mode=search's space: the layouts, schedules and resharding policies it enumerates, the bounds it states, and the
warning when a GPU cluster is searched at the debug defaults. Torch-free.

- tp: divisors of the world size up to the devices of a node (rules: divides the heads, KV heads and the node);
- cp: divisors up to search.max_cp (rule: the sequence splits into 2 x cp chunks);
- pp: divisors of what tp x cp leave, up to the layers plus the embedding and head (rule: TorchTitan's split);
- dp_replicate x dp_shard: every factorization of the rest; ep (MoE only): divisors of the experts;
- schedule and stages per rank: 1F1B and GPipe (v=1), each looped schedule with v in 2..search.max_virtual_stages,
  ZBVZeroBubble and DualPipeV (v=2); with pp=1 just one entry;
- microbatch size: 1..search.max_microbatch_size (rule: dp x microbatch divides the global batch, and the schedule's m);
- activation checkpointing: none, selective_op, selective_layer (every training.ac_layer_frequency-th block), full;
- fsdp_reshard_after_forward: always and never when dp_shard > 1 (default is one of the two), else default.
"""

from __future__ import annotations

from runner.config.validate import layout_rules as validate_layout
from runner.schema import DeviceType, Fp8Recipe, ReshardPolicy, RunConfig, TrainingConfig

LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")


def schedules(pp: int, max_v: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1F1B", 1)]
    looped = [(s, v) for s in LOOPED for v in range(2, max_v + 1)]
    return [("1F1B", 1), ("GPipe", 1), *looped, ("ZBVZeroBubble", 2), ("DualPipeV", 2)]


def reshard_policies(dp_shard: int) -> tuple[ReshardPolicy, ...]:
    return (ReshardPolicy.never, ReshardPolicy.always) if dp_shard > 1 else (ReshardPolicy.default,)


def layouts(cfg: RunConfig, ws: int):
    """(tp, cp, pp, dp_replicate, dp_shard, ep) with product ws, inside the stated bounds."""
    per_node, m, s = cfg.cluster.devices_per_node, cfg.model, cfg.search
    eps = validate_layout.divisors(m.num_experts) if m.num_experts else [1]
    for tp in (d for d in validate_layout.divisors(ws) if d <= per_node):
        for cp in (d for d in validate_layout.divisors(ws // tp) if d <= s.max_cp):
            for pp in (d for d in validate_layout.divisors(ws // (tp * cp)) if d <= m.num_layers + 2):
                dp = ws // (tp * cp * pp)
                for dpr in validate_layout.divisors(dp):
                    for ep in eps:
                        yield tp, cp, pp, dpr, dp // dpr, ep


def _precision(cfg: RunConfig) -> str:
    """'bf16 (bfloat16 compute)', 'fp8_rowwise (bfloat16 compute, FP8 rowwise)'."""
    pr = cfg.precision
    return f"{pr.name} ({pr.param_dtype.value} compute" + (f", FP8 {pr.fp8.value})" if pr.fp8 != Fp8Recipe.none else ")")


def debug_defaults(cfg: RunConfig) -> str | None:
    """The warning for a GPU cluster searched at the schema's debug defaults (the CPU smoke run's global batch and
    sequence length): the layouts would be ranked for that toy problem, not for the run's. The CPU default fp32 is
    refused on a GPU cluster by validation (validate.fields), so it is no warning here."""
    if cfg.cluster.device == DeviceType.cpu:
        return None
    t, default = cfg.training, TrainingConfig()
    at_default = [k for k in ("global_batch_size", "seq_len") if getattr(t, k) == getattr(default, k)]
    found = {f"training.{k}": f"training.{k}={getattr(t, k)}" for k in at_default}
    if not found:
        return None
    fields = list(found)
    named = ", ".join(fields[:-1]) + " and " + fields[-1] if len(fields) > 1 else fields[0]
    return (
        f"warning: cluster {cfg.cluster.name} is searched with the debug defaults {', '.join(found.values())}, so the layouts "
        f"are ranked for that toy problem; set {named} to the run's own"
    )


def bounds(cfg: RunConfig, ws: int) -> list[str]:
    s, t = cfg.search, cfg.training
    return [
        f"{ws:,} devices ({cfg.cluster.num_nodes} nodes x {cfg.cluster.devices_per_node}), global batch {t.global_batch_size}, "
        f"seq_len {t.seq_len}, precision {_precision(cfg)}",
        f"tp | ws, <= {cfg.cluster.devices_per_node} (a node); cp | ws, <= search.max_cp = {s.max_cp}; "
        f"pp | ws, <= num_layers + 2 = {cfg.model.num_layers + 2}; dp_replicate x dp_shard = the rest"
        + (f"; ep | num_experts = {cfg.model.num_experts}" if cfg.model.num_experts else ""),
        f"schedules: 1F1B, GPipe (v=1), {', '.join(LOOPED)} (v = 2..search.max_virtual_stages = {s.max_virtual_stages}), "
        "ZBVZeroBubble, DualPipeV (v=2)",
        f"microbatch 1..search.max_microbatch_size = {s.max_microbatch_size}; AC none, selective_op, "
        f"selective_layer (every {t.ac_layer_frequency}), full; fsdp_reshard_after_forward always/never when dp_shard > 1",
    ]
