"""The step-time predictor: seconds per training step of a layout, as a sum of named terms.

Torch-free and pure arithmetic (mode=search prices thousands of candidates with it). The terms are
seconds per step on the busiest rank:
- compute: GEMMs at their per-rank shapes (rate by shape) and the attention kernel, forward + backward;
- non_matmul: the elementwise kernels (norms, RoPE, SwiGLU, the loss) by a memory-bandwidth roofline,
  and the optimizer step;
- recompute: the forward work activation checkpointing repeats (full, selective per op or per layer);
- overhead: the stack's fixed cost per block pass (dispatch);
- bubble: pipeline fill and drain around the busiest rank, through the other ranks' first stages;
- tp, pp, cp, ep: their collectives, on the critical path;
- dp: FSDP gathers and reduce-scatters (and replica all-reduces) per block, and FSDP's own copies into
  and out of their buffers (also with dp_shard = 1), less what runs under the block's compute;
- fp8_cast, fp8_amax: an FP8 recipe's cast and scale kernels (memory traffic) and tensorwise scaling's amax
  all-reduces over TP (runner/estimate/predict/fp8_cost.py); its converted GEMMs are in compute, at the FP8 rate;
  so are the routed experts precision.experts converts (their own recipe and rate, Machine.expert_fp8_tflops).
`binding` names the largest. The machine's figures come from a profile (`cluster.profile`, written by
`python -m runner.calibrate`) or else from the datasheet ("datasheet, not calibrated").
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from runner.estimate import comm as plan_comm
from runner.estimate import flops, pipeline, precision
from runner.estimate.memory import BYTES, keeps_weights_gathered
from runner.estimate.predict import fp8_cost as fp8
from runner.estimate.predict import machine, work
from runner.estimate.predict.machine import DATASHEET, Machine
from runner.schema import RunConfig, layout
from runner.schema.layout import MESH_ORDER, Layout

CPU_TERMS = ("compute", "non_matmul", "recompute", "overhead")
Stages = tuple[tuple[int, ...], ...]  # blocks of each virtual stage, by pipeline rank
TERMS = ("compute", "non_matmul", "recompute", "overhead", "bubble", "tp", "pp", "cp", "ep", "dp", "fp8_cast", "fp8_amax")


@dataclass(frozen=True)
class StepPrediction:
    step_s: float | None
    """Predicted seconds per step (None when the cluster lacks a peak or a link bandwidth)."""
    terms: dict[str, float] = field(default_factory=dict)
    """Exposed seconds per step by term (TERMS)."""
    binding: str = ""
    """The largest term's name: what to attack first."""
    calibrated: bool = False
    """True when the figures come from a machine profile measured by `python -m runner.calibrate`."""
    source: str = DATASHEET
    """Where the machine figures come from: the profile's path, or DATASHEET."""


@dataclass(frozen=True)
class _Chunk:
    """One microbatch through one rank's share of the model (forward + backward), by term."""

    compute: float = 0.0
    non_matmul: float = 0.0
    recompute: float = 0.0
    overhead: float = 0.0
    tp: float = 0.0
    cp: float = 0.0
    ep: float = 0.0
    fp8_cast: float = 0.0
    fp8_amax: float = 0.0

    def total(self) -> float:
        return self.compute + self.non_matmul + self.recompute + self.overhead + self.tp + self.cp + self.ep + self.fp8_cast + self.fp8_amax


def _layer_frequency(cfg: RunConfig) -> int:
    # training.ac_layer_frequency arrives with the selective AC modes; TorchTitan's default is every 2nd block
    return getattr(cfg.training, "ac_layer_frequency", 2)


def _collective(mach: Machine, kind: str, op: str, group: int, tensor_bytes: float) -> float:
    """Seconds of one ring collective over `group` ranks on a tensor of `tensor_bytes` (the whole, gathered size)."""
    if group <= 1:
        return 0.0
    sent = {"all_reduce": 2 * (group - 1) / group, "send_recv": 1.0}.get(op, (group - 1) / group) * tensor_bytes
    link = mach.link(kind, op, group)
    if mach.collective_fixed_s is not None:  # measured in runs, at this rank count
        return sent / (link.gbs * 1e9) + mach.collective_fixed_s
    return link.seconds(sent)


def _tp_cp_ep(
    cfg: RunConfig, lay: Layout, mach: Machine, kinds: dict[str, str], shares: tuple[float, float, float]
) -> tuple[float, float, float]:
    """Seconds of one block's TP, CP and EP collectives for one microbatch (forward, backward, recomputed forward)."""
    m, n, bw = cfg.model, work.tokens(cfg, lay), BYTES[cfg.precision.param_dtype.value]
    passes = 2 + shares[2]  # forward, backward and the share of blocks whose forward runs again

    tp = 0.0
    if lay.tp > 1:
        # sequence parallel: all-gather before and reduce-scatter after attention and the MLP, each way
        gather = _collective(mach, kinds["tp"], "all_gather", lay.tp, n * m.dim * bw)
        scatter = _collective(mach, kinds["tp"], "reduce_scatter", lay.tp, n * m.dim * bw)
        tp = 2 * passes * (gather + scatter)
    cp = 0.0
    if lay.cp > 1:
        # torch's ring attention (all-gather rotation): K and V gathered forward; gathered again and dK, dV
        # reduce-scattered backward
        kv = 2 * n * lay.cp * m.num_kv_heads * flops.head_dim(m) / lay.tp * bw
        cp = passes * _collective(mach, kinds["cp"], "all_gather", lay.cp, kv) + _collective(
            mach, kinds["cp"], "reduce_scatter", lay.cp, kv
        )
    ep = 0.0
    if lay.ep > 1 and flops.is_moe(m):
        routed = n * m.num_experts_per_token * m.dim * bw
        ep = 2 * passes * _collective(mach, kinds["ep"], "all_gather", lay.ep, routed)
    return tp, cp, ep


def element_bytes(dtype: str, bytes_per_element: float) -> float:
    """Bytes moved per activation element of `dtype`: `bytes_per_element` is the figure for 2-byte (bf16) activations."""
    return bytes_per_element * BYTES[dtype] / 2


def _element_bytes(cfg: RunConfig, mach: Machine) -> float:
    return element_bytes(cfg.precision.param_dtype.value, mach.bytes_per_element)


def _block(cfg: RunConfig, lay: Layout, mach: Machine, kinds: dict[str, str], shares: tuple[float, float, float]) -> _Chunk:
    """One transformer block, one microbatch, forward + backward."""
    blk = work.block(cfg, lay)
    gemm = sum(mach.gemm_s(g) for g in blk.gemms)
    attn = blk.attention_flops / (mach.attention_tflops * 1e12)
    elem = blk.elements * _element_bytes(cfg, mach) / (mach.memory_gbs * 1e9)
    tp, cp, ep = _tp_cp_ep(cfg, lay, mach, kinds, shares)
    plain = _Chunk(
        compute=3 * (gemm + attn),
        non_matmul=elem,
        recompute=shares[0] * gemm + shares[1] * attn + shares[2] * elem / 3,
        overhead=(2 + shares[2]) * mach.layer_overhead_s,
        tp=tp,
        cp=cp,
        ep=ep,
    )
    return _add(_add(plain, _fp8_block(cfg, lay, mach, kinds, shares[0])), _fp8_experts(cfg, lay, mach, shares[0]))


def _fp8_block(cfg: RunConfig, lay: Layout, mach: Machine, kinds: dict[str, str], recomputed: float) -> _Chunk:
    """What an FP8 recipe changes in one block, one microbatch (the mean block: keep_high_precision may keep some
    blocks' layers): its converted GEMMs move from the bf16 rate to the FP8 rate (those the recipe keeps in high
    precision stay), plus the cast kernels and tensorwise's amax all-reduces; a recomputed forward casts x and W again."""
    recipe = fp8.cost(cfg)
    if recipe is None or mach.fp8_tflops is None:
        return _Chunk()
    conv, _ = fp8.linear_gemms(cfg, lay.tp, work.tokens(cfg, lay))
    n_fp8 = sum(g not in recipe.high_precision_gemms for g in fp8.GEMMS)
    gain = sum(k * (mach.fp8_gemm_s(g) - mach.gemm_s(g)) for g, k in conv.items())  # forward, negative: FP8 is faster
    fwd_fp8 = "forward" not in recipe.high_precision_gemms
    per_elem = recipe.cast_bytes[1 if cfg.training.compile else 0]
    moved = 0.0
    for g, k in conv.items():
        x, w, dy = fp8.cast_elements(g)
        moved += k * per_elem * (x + w + dy + recomputed * (x + w) / 2)  # the forward's layout of x and W, once more
    blocks = cfg.model.num_layers
    amax = 0.0
    if recipe.amax_all_reduce and lay.tp > 1:
        one = _collective(mach, kinds["tp"], "all_reduce", lay.tp, 4.0)  # one fp32 amax
        amax = sum(conv.values()) * (3 + 2 * recomputed) * one
    return _Chunk(
        compute=n_fp8 * gain / blocks,
        recompute=recomputed * gain / blocks if fwd_fp8 else 0.0,
        fp8_cast=moved / (mach.memory_gbs * 1e9) * mach.cpu_share / blocks,
        fp8_amax=amax / blocks,
    )


def _fp8_experts(cfg: RunConfig, lay: Layout, mach: Machine, recomputed: float) -> _Chunk:
    """What precision.experts changes in the mean block, one microbatch: the routed experts' grouped GEMMs (of the MoE
    blocks, a share of all) move from the bf16 rate to the experts' FP8 rate, all three (forward, input and weight
    gradients), plus their casts (fp8_cost.EXPERT_COSTS); a recomputed forward casts x and W again. No amax
    all-reduce: rowwise and MX scales are per row or block of what a rank holds."""
    recipe = fp8.expert_cost(cfg)
    if recipe is None or mach.expert_fp8_tflops is None:
        return _Chunk()
    m = cfg.model
    share = (m.num_layers - m.num_dense_layers) / m.num_layers
    gemms = work.routed_gemms(cfg, lay, work.tokens(cfg, lay))
    gain = share * sum(mach.fp8_gemm_s(g, mach.expert_fp8_tflops) - mach.gemm_s(g) for g in gemms)  # negative: faster
    per_elem = recipe.cast_bytes[1 if cfg.training.compile else 0]
    moved = 0.0
    for g in gemms:
        x, w, dy = fp8.cast_elements(g)
        moved += per_elem * (x + w + dy + recomputed * (x + w) / 2)
    return _Chunk(
        compute=3 * gain,
        recompute=recomputed * gain,
        fp8_cast=share * moved / (mach.memory_gbs * 1e9) * mach.cpu_share,
    )


def _head(cfg: RunConfig, lay: Layout, mach: Machine) -> _Chunk:
    """The output projection and the loss of one microbatch (last stage)."""
    elem = work.logits(cfg, lay) * _element_bytes(cfg, mach) / (mach.memory_gbs * 1e9)
    return _Chunk(compute=3 * mach.gemm_s(work.head_gemm(cfg, lay)), non_matmul=elem)


def _scaled(c: _Chunk, k: float) -> _Chunk:
    return _Chunk(*(k * getattr(c, f) for f in _Chunk.__dataclass_fields__))


def _add(a: _Chunk, b: _Chunk) -> _Chunk:
    return _Chunk(*(getattr(a, f) + getattr(b, f) for f in _Chunk.__dataclass_fields__))


def _stages(cfg: RunConfig, lay: Layout, v: int) -> Stages:
    """Blocks of each virtual stage, grouped by pipeline rank (stage s sits on rank s % pp)."""
    p = cfg.parallelism
    return _rank_stages(cfg.model.num_layers, lay.pp, v, p.pp_first_stage_less_layers, p.pp_last_stage_less_layers)


@functools.lru_cache(maxsize=1024)
def _rank_stages(num_layers: int, pp: int, v: int, first_less: int, last_less: int) -> Stages:
    """Cached: mode=search prices thousands of candidates on a few dozen (pp, v) splits."""
    split = pipeline.stage_layers(num_layers, pp * v, first_less, last_less)
    return tuple(tuple(split[r + pp * j] for j in range(v)) for r in range(pp))


def _dp_per_block(cfg: RunConfig, lay: Layout, mach: Machine, kinds: dict[str, str], micro: int) -> float:
    """Seconds of one block's FSDP and replica traffic per step."""
    bw, br = BYTES[cfg.precision.param_dtype.value], BYTES[cfg.precision.reduce_dtype.value]
    params = flops.block_params(cfg.model) / lay.tp
    shard = lay.dp_shard * lay.cp  # TorchTitan shards parameters over dp_shard x cp
    syncs = 1 if lay.pp > 1 else micro
    gathers = 1 if keeps_weights_gathered(cfg, lay) else 2 * micro
    secs = gathers * _collective(mach, kinds["dp_shard"], "all_gather", shard, params * bw)
    secs += syncs * _collective(mach, kinds["dp_shard"], "reduce_scatter", shard, params * br)
    return secs + syncs * _collective(mach, kinds["dp_replicate"], "all_reduce", lay.dp_replicate, params / shard * br)


def _fsdp_copies_s(cfg: RunConfig, lay: Layout, mach: Machine, micro: int) -> float:
    """Seconds per step of one block's FSDP2 copies, which run whatever the shard degree: TorchTitan applies FSDP to
    every block, also with dp_shard = 1 (no peer to talk to). Before each all-gather the local shard is copied into
    the gather buffer and after it the buffer out into the parameters (a read and a write of 1 / shard + 1 of the
    block's parameters); before each reduce-scatter the gradients are concatenated into its buffer (a read and a
    write of all), and after it the shard is divided (a read and a write) and added into the fp32 sharded gradient
    (two reads and a write). Memory-bound, at the elementwise kernels' bandwidth, stretched like the optimizer when
    ranks share cores. The gathers follow TorchTitan's reshard_after_forward policy (its own, not the memory model's,
    whose keeps_weights_gathered counts no resharding without a shard)."""
    bw, br = BYTES[cfg.precision.param_dtype.value], BYTES[cfg.precision.reduce_dtype.value]
    params = flops.block_params(cfg.model) / lay.tp
    shard = lay.dp_shard * lay.cp
    policy = cfg.parallelism.fsdp_reshard_after_forward
    gathered = policy == "never" or (policy == "default" and lay.pp > 1)
    gathers = 1 if gathered else 2 * micro
    syncs = 1 if lay.pp > 1 else micro
    moved = gathers * 2 * params * bw * (1 / shard + 1) + syncs * params * (2 * br + (2 * br + 3 * BYTES["float32"]) / shard)
    return moved / (mach.memory_gbs * 1e9) * mach.cpu_share


def _optimizer_s(cfg: RunConfig, lay: Layout, mach: Machine) -> float:
    local = flops.num_params(cfg.model) / (lay.tp * lay.pp * lay.dp_shard * lay.cp)
    return local * machine.ADAMW_BYTES_PER_PARAM / (mach.memory_gbs * 1e9) * mach.cpu_share


def _pp_s(cfg: RunConfig, lay: Layout, mach: Machine, kinds: dict[str, str], micro: int, v: int) -> float:
    """Each microbatch's activation forward and its gradient back at each of the rank's v stage edges."""
    if lay.pp == 1:
        return 0.0
    sp = cfg.parallelism.sequence_parallel and lay.tp > 1
    act = work.tokens(cfg, lay) * cfg.model.dim * BYTES[cfg.precision.param_dtype.value] / (lay.tp if sp else 1)
    return 2 * micro * v * _collective(mach, kinds["pp"], "send_recv", 2, act)


def _work(c: _Chunk) -> float:
    return c.compute + c.non_matmul + c.recompute + c.overhead + c.fp8_cast


def _pipeline(lay: Layout, blk: _Chunk, head: _Chunk, stages: Stages, micro: int, share: float) -> tuple[_Chunk, float, int]:
    """The busiest pipeline rank's terms per step (its blocks, and the head on the rank of the last stage)
    and its bubble: the fill and drain around it, one microbatch's forward and backward through every
    other rank's first stage ((p - 1) stage chunks when the stages are even; the classical
    sum-of-stages + (m - 1) x slowest-stage step when v = 1). With the cores shared (CPU ranks > cores)
    every rank's work is spread over them, so a stage's idle time goes to the other ranks: the compute
    terms stretch by `share` x the mean rank's work / the busiest's, and the bubble shrinks by as much."""
    last = len(stages) - 1
    blocks = [sum(row) for row in stages]
    b, h = blk.total(), head.total()
    busiest = max(range(len(stages)), key=lambda r: blocks[r] * b + (h if r == last else 0.0))
    rank = _scaled(_add(_scaled(blk, blocks[busiest]), head if busiest == last else _Chunk()), micro)
    first = [row[0] * b + (h if r == last and len(row) == 1 else 0.0) for r, row in enumerate(stages)]  # stage r on rank r
    bubble = sum(first) - first[busiest]
    if share <= 1:
        return rank, bubble, blocks[busiest]
    work = [micro * (n * _work(blk) + (_work(head) if r == last else 0.0)) for r, n in enumerate(blocks)]
    k = share * (sum(work) / len(work)) / work[busiest]
    stretched = dataclasses.replace(rank, **{f: k * getattr(rank, f) for f in CPU_TERMS})
    return stretched, max(0.0, bubble - (k - 1) * work[busiest]), blocks[busiest]


def _terms(cfg: RunConfig, lay: Layout, mach: Machine, kinds: dict[str, str], ac: str, memo: dict | None) -> dict[str, float]:
    micro = cfg.training.global_batch_size // (lay.dp * cfg.training.microbatch_size)
    v = cfg.parallelism.pp_virtual_stages if lay.pp > 1 else 1
    key = (lay, cfg.training.microbatch_size, ac)  # what _block and _head read that a Pricer's configs vary
    got = memo.get(key) if memo is not None else None
    if got is None:
        shares = work.recomputed_share(ac, _layer_frequency(cfg))
        got = (_block(cfg, lay, mach, kinds, shares), _head(cfg, lay, mach))
        if memo is not None:
            memo[key] = got
    blk, head = got
    mtp = cfg.model.num_mtp_layers  # each MTP depth: one block and one pass through the head more, on the last stage
    head = _add(_scaled(head, 1 + mtp), _scaled(blk, mtp))
    rank, bubble, blocks = _pipeline(lay, blk, head, _stages(cfg, lay, v), micro, mach.cpu_share)
    dp_block = _dp_per_block(cfg, lay, mach, kinds, micro) + _fsdp_copies_s(cfg, lay, mach, micro)
    hidden = mach.comm_overlap * min(dp_block, micro * (blk.compute + blk.non_matmul + blk.recompute))
    dp = blocks * (dp_block - hidden) + (hidden if blocks else 0.0)  # the first gather and the last reduce-scatter stay exposed
    out = {f: getattr(rank, f) for f in ("compute", "non_matmul", "recompute", "overhead", "tp", "cp", "ep", "fp8_cast", "fp8_amax")}
    out["non_matmul"] += _optimizer_s(cfg, lay, mach)
    return {**out, "bubble": bubble, "pp": _pp_s(cfg, lay, mach, kinds, micro, v), "dp": dp}


def _kinds(cfg: RunConfig, lay: Layout) -> dict[str, str]:
    """The link kind ('intra-node' or 'scale-out') each axis's groups use."""
    dpn = layout.devices_per_node(cfg.cluster, lay.world_size)
    return {**plan_comm.links(lay, dpn), "ep": "intra-node" if lay.ep <= dpn and dpn % lay.ep == 0 else "scale-out"}


def _links_known(mach: Machine, lay: Layout, kinds: dict[str, str]) -> bool:
    """Every link a parallel axis of `lay` uses has a bandwidth (a cluster may leave one unknown)."""
    return all(mach.links.get(kinds[a]) for a in (*MESH_ORDER, "ep") if getattr(lay, a) > 1)


def resolve_machine(cfg: RunConfig, lay: Layout, profile=None, **datasheet_overrides) -> Machine | None:
    """The machine figures: `profile` (a loaded profile dict or a path), else cluster.profile, else the datasheet."""
    source = profile if profile is not None else cfg.cluster.profile
    if source is not None:
        from runner.estimate.predict import machine_profile as steptime_profile

        return steptime_profile.machine(cfg, lay, source)
    return machine.datasheet(cfg, **datasheet_overrides)


def predict(
    cfg: RunConfig,
    lay: Layout,
    profile=None,
    *,
    peak_tflops: float | None = None,
    link_gbs: dict[str, float] | None = None,
    matmul_efficiency: float | None = None,
    ac: str | None = None,
) -> StepPrediction:
    """Seconds per step of `lay` by term. `peak_tflops`, `link_gbs` and `matmul_efficiency` override the
    datasheet's (a profile's measured figures take precedence over all three); `ac` prices another
    activation-checkpointing mode than training.activation_checkpoint's (its value, e.g. "selective_op")."""
    mach = resolve_machine(cfg, lay, profile, peak_tflops=peak_tflops, link_gbs=link_gbs, efficiency=matmul_efficiency)
    return _predict(cfg, lay, mach, ac or cfg.training.activation_checkpoint.value, None)


def _predict(cfg: RunConfig, lay: Layout, mach: Machine | None, ac: str, memo: dict | None) -> StepPrediction:
    kinds = _kinds(cfg, lay)
    if mach is None or not _links_known(mach, lay, kinds):
        return StepPrediction(None)
    found = _terms(cfg, lay, mach, kinds, ac, memo)
    terms = {k: found[k] for k in TERMS}
    return StepPrediction(sum(terms.values()), terms, max(terms, key=terms.get), mach.calibrated, mach.source)


class Pricer:
    """predict() for many configs that differ from one only in the layout, the schedule, the microbatch size, AC and
    resharding (mode=search's candidates of a config): the machine's figures resolved once (they read the cluster, the
    precision and the world size), and a block's and the head's work once per layout, microbatch size and AC mode
    (not per schedule and resharding policy). The predictions are predict()'s, to the bit."""

    def __init__(self, cfg: RunConfig, world_size: int):
        self.mach = resolve_machine(cfg, Layout(1, 1, world_size, 1, 1), peak_tflops=None, link_gbs=None, efficiency=None)
        self._memo: dict[tuple, tuple[_Chunk, _Chunk]] = {}

    def predict(self, cfg: RunConfig, lay: Layout) -> StepPrediction:
        return _predict(cfg, lay, self.mach, cfg.training.activation_checkpoint.value, self._memo)


def fp8_speed_up(
    cfg: RunConfig,
    lay: Layout,
    pred: StepPrediction,
    profile=None,
    *,
    link_gbs: dict[str, float] | None = None,
    matmul_efficiency: float | None = None,
) -> float | None:
    """Predicted step time of the same layout with the FP8 recipe off (precision.without_fp8: param_dtype, bf16 on
    GPUs) over `pred`'s, the FP8 one: where FP8 pays (large GEMMs, > 1) and where its casts, amax reductions and the
    layers kept in high precision eat the GEMMs' gain (small TP-sharded GEMMs, < 1 possible). None without the FP8
    model (no recipe, a CPU cluster, a machine profile that times GEMMs in the run's dtype: no fp8_cast term) or a
    prediction. The twin takes the same links and efficiency; a peak_tflops override names the float8 peak, so the
    twin keeps the cluster's param_dtype peak."""
    if not pred.step_s or not pred.terms.get("fp8_cast"):
        return None
    twin = predict(precision.without_fp8(cfg), lay, profile, link_gbs=link_gbs, matmul_efficiency=matmul_efficiency).step_s
    return twin / pred.step_s if twin else None
