"""Every rule that can reject a config before a process starts.

Torch-free. Problems are collected and raised once; each names the field, the value,
why it is wrong and the fix. `check` holds rules about the config itself (valid for
any cluster, including ones this machine cannot run); `check_launch` adds the rules
about starting it here.
"""

from __future__ import annotations

from runner.config import flops, layout, pipeline, precision, validate_ckpt, validate_monitor
from runner.config.problems import ConfigError, Problem
from runner.config.schema import Backend, DeviceType, Fp8Recipe, RunConfig, WorkerStart

LLAMA3_FLAVORS = ("debugmodel", "1B", "3B", "8B", "70B", "405B")
FAMILIES = {"llama3": LLAMA3_FLAVORS, "deepseek_v3": ("debugmodel", "16B", "236B", "671B")}  # TorchTitan registries
DEVICE_DTYPES = {DeviceType.cpu: ("float32", "bfloat16"), DeviceType.cuda: ("float32", "bfloat16")}
ROPE_MAX_SEQ_LEN = 131072  # TorchTitan's llama3 RoPE table length
WANDB_MODES = ("offline", "online", "disabled")
RESHARD_POLICIES = ("default", "always", "never")
LAUNCHERS = ("local", "slurm")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _positive(cfg: RunConfig, out: list[Problem]) -> None:
    p, t = cfg.parallelism, cfg.training
    for name in ("dp_replicate", "tp", "pp", "cp", "ep"):
        if getattr(p, name) < 1:
            out.append(Problem(f"parallelism.{name}", getattr(p, name), "a degree must be >= 1", "use 1 to turn the axis off"))
    if p.dp_shard < 1 and p.dp_shard != -1:
        out.append(Problem("parallelism.dp_shard", p.dp_shard, "must be >= 1 or -1", "use -1 to absorb the remaining ranks"))
    for name in ("steps", "seq_len", "global_batch_size", "microbatch_size"):
        if getattr(t, name) < 1:
            out.append(Problem(f"training.{name}", getattr(t, name), "must be >= 1", f"set training.{name} to a positive integer"))
    if t.warmup_steps < 0:
        out.append(Problem("training.warmup_steps", t.warmup_steps, "must be >= 0", "use 0 for no warm-up"))
    if cfg.logging.log_every < 1:
        out.append(Problem("logging.log_every", cfg.logging.log_every, "must be >= 1", "log every N >= 1 steps"))
    if cfg.checkpoint.interval < 1:
        out.append(Problem("checkpoint.interval", cfg.checkpoint.interval, "must be >= 1", "save every N >= 1 steps"))


def _cluster_and_plan(cfg: RunConfig, out: list[Problem]) -> None:
    p, c = cfg.parallelism, cfg.cluster
    if p.fsdp_reshard_after_forward not in RESHARD_POLICIES:
        out.append(
            Problem(
                "parallelism.fsdp_reshard_after_forward",
                p.fsdp_reshard_after_forward,
                "not a TorchTitan reshard policy",
                f"use one of {', '.join(RESHARD_POLICIES)}",
            )
        )
    for name, example in (("achievable_mfu", "0.40"), ("matmul_efficiency", "0.70")):
        if not 0 < getattr(c, name) <= 1:
            out.append(Problem(f"cluster.{name}", getattr(c, name), "is a fraction of peak", f"use a value in (0, 1], e.g. {example}"))
    for name in ("mtbf_hours", "checkpoint_write_gbs", "intra_node_bandwidth_gbs", "inter_node_bandwidth_gbs"):
        if getattr(c, name) < 0:
            out.append(Problem(f"cluster.{name}", getattr(c, name), "must be >= 0", "use 0 for unknown"))
    if c.launcher not in LAUNCHERS:
        out.append(Problem("cluster.launcher", c.launcher, "unknown launcher", f"use one of {', '.join(LAUNCHERS)}"))
    if c.max_restarts < 0:
        out.append(Problem("cluster.max_restarts", c.max_restarts, "must be >= 0", "use 0 to never restart"))
    if c.launcher == "slurm":
        s = c.slurm
        if not s.partition:
            out.append(
                Problem(
                    "cluster.slurm.partition", s.partition, "SLURM needs a partition to submit to", "set cluster.slurm.partition=<name>"
                )
            )
        if c.devices_per_node > s.gpus_per_node_max:
            out.append(
                Problem(
                    "cluster.devices_per_node",
                    c.devices_per_node,
                    f"a node of partition {s.partition} has {s.gpus_per_node_max} GPUs (cluster.slurm.gpus_per_node_max)",
                    f"use at most {s.gpus_per_node_max} per node and more nodes",
                )
            )
        if s.time_min < 1:
            out.append(Problem("cluster.slurm.time_min", s.time_min, "must be >= 1", "set the job's wall-clock limit in minutes"))
    if cfg.plan.flops_convention not in flops.CONVENTIONS:
        out.append(
            Problem(
                "plan.flops_convention", cfg.plan.flops_convention, "unknown FLOP convention", f"use one of {', '.join(flops.CONVENTIONS)}"
            )
        )


def _model(cfg: RunConfig, out: list[Problem]) -> None:
    m = cfg.model
    if m.name not in FAMILIES:
        out.append(
            Problem(
                "model.name",
                m.name,
                f"the runner knows TorchTitan's {' and '.join(FAMILIES)} families",
                "use model=debug, debug_moe or a llama3_* option",
            )
        )
    elif m.flavor not in FAMILIES[m.name]:
        out.append(Problem("model.flavor", m.flavor, f"not a TorchTitan {m.name} flavor", f"use one of {', '.join(FAMILIES[m.name])}"))
    _moe_model(m, out)
    if m.num_heads < 1 or m.dim % m.num_heads:
        out.append(Problem("model.num_heads", m.num_heads, f"must divide model.dim = {m.dim}", f"use one of {divisors(m.dim)}"))
    elif m.num_kv_heads < 1 or m.num_heads % m.num_kv_heads:
        out.append(
            Problem(
                "model.num_kv_heads", m.num_kv_heads, f"must divide model.num_heads = {m.num_heads}", f"use one of {divisors(m.num_heads)}"
            )
        )


def _moe_model(m, out: list[Problem]) -> None:
    """An MoE model's numbers must describe a router TorchTitan can build."""
    if m.num_experts < 0:
        out.append(Problem("model.num_experts", m.num_experts, "must be >= 0", "use 0 for a dense model"))
    if m.num_experts == 0:
        return
    if not 1 <= m.num_experts_per_token <= m.num_experts:
        out.append(
            Problem(
                "model.num_experts_per_token",
                m.num_experts_per_token,
                f"a token goes to between 1 and model.num_experts = {m.num_experts} experts",
                "copy the router's top_k from TorchTitan's registry",
            )
        )
    if m.moe_hidden_dim < 1:
        out.append(Problem("model.moe_hidden_dim", m.moe_hidden_dim, "an MoE model's experts need a hidden size", "set it >= 1"))
    if not 0 <= m.num_dense_layers < m.num_layers:
        out.append(
            Problem(
                "model.num_dense_layers",
                m.num_dense_layers,
                f"must be in [0, model.num_layers = {m.num_layers}) so that some blocks hold experts",
                "copy n_dense_layers from TorchTitan's registry",
            )
        )


def _world(cfg: RunConfig, out: list[Problem]) -> int | None:
    p, c = cfg.parallelism, cfg.cluster
    if c.num_nodes is None or c.num_nodes < 1:
        why = f"cluster {c.name} leaves the node count to the job" if c.num_nodes is None else "must be >= 1"
        out.append(Problem("cluster.num_nodes", c.num_nodes, why, "set cluster.num_nodes=N"))
        return None
    if c.devices_per_node == -1 and c.device != DeviceType.cpu:
        out.append(Problem("cluster.devices_per_node", -1, "only a CPU cluster may take its size from the layout", "set the GPUs per node"))
        return None
    if c.devices_per_node == -1 and c.num_nodes != 1:
        out.append(Problem("cluster.devices_per_node", -1, "a size from the layout needs num_nodes = 1", "set cluster.devices_per_node"))
        return None
    ws = layout.world_size(p, c)
    fixed = layout.fixed_product(p)
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
    if fixed < 1:
        return None
    product = "pp x dp_replicate x dp_shard x cp x tp"
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
                f"{product} = {fixed}",
                f"must equal the world size {ws} = cluster.num_nodes {c.num_nodes} x cluster.devices_per_node {c.devices_per_node}",
                "change the degrees, or set parallelism.dp_shard=-1 to absorb the remaining ranks",
            )
        )
        return None
    return ws


def _tensor_parallel(cfg: RunConfig, ws: int, out: list[Problem]) -> None:
    p, m, c = cfg.parallelism, cfg.model, cfg.cluster
    if m.num_heads % p.tp or m.num_kv_heads % p.tp:
        ok = [d for d in divisors(m.num_kv_heads) if m.num_heads % d == 0]
        out.append(
            Problem(
                "parallelism.tp",
                p.tp,
                f"must divide model.num_heads = {m.num_heads} and model.num_kv_heads = {m.num_kv_heads}",
                f"use tp in {ok}",
            )
        )
    per_node = c.devices_per_node if c.devices_per_node != -1 else ws
    if p.tp > per_node or per_node % p.tp:
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


def _pipeline_and_batch(cfg: RunConfig, lay: layout.Layout, out: list[Problem]) -> None:
    p, t = cfg.parallelism, cfg.training
    unit = lay.dp * t.microbatch_size
    if t.global_batch_size % unit:
        out.append(
            Problem(
                "training.global_batch_size",
                t.global_batch_size,
                f"must be divisible by DP degree {lay.dp} x training.microbatch_size {t.microbatch_size} = {unit}",
                f"use a multiple of {unit}",
            )
        )
        return
    if p.pp > 1:
        _pipeline(cfg, t.global_batch_size // unit, unit, out)


def _pipeline(cfg: RunConfig, m: int, unit: int, out: list[Problem]) -> None:
    """Schedule, stages per rank, microbatches and the layer split: what torch's schedules and
    TorchTitan's pipeline_llm would refuse at start-up (runner/pipeline.py)."""
    p, mo = cfg.parallelism, cfg.model
    if p.pp_schedule not in pipeline.SCHEDULES:
        out.append(
            Problem(
                "parallelism.pp_schedule",
                p.pp_schedule,
                "not a pipeline schedule torch.distributed.pipelining provides",
                f"use one of {', '.join(pipeline.SCHEDULES)}",
            )
        )
        return
    v = p.pp_virtual_stages
    why = pipeline.virtual_stages_rule(p.pp_schedule, v)
    if why:
        want = "1 (or a looped schedule such as Interleaved1F1B)" if pipeline.SCHEDULES[p.pp_schedule].style == "single" else "2"
        out.append(Problem("parallelism.pp_virtual_stages", v, why, f"set parallelism.pp_virtual_stages={want}"))
        return
    rule = pipeline.microbatch_rule(p.pp_schedule, p.pp, v, m)
    if rule:
        why, least = rule
        if least:
            fix = f"use global_batch_size >= {least * unit} or a smaller training.microbatch_size"
        else:
            fix = f"make m a multiple of pp = {p.pp}, e.g. training.global_batch_size={p.pp * unit * max(1, m // p.pp)}"
        out.append(
            Problem("training.global_batch_size", cfg.training.global_batch_size, f"gives m = {m} microbatches per pipeline; {why}", fix)
        )
    first, last = p.pp_first_stage_less_layers, p.pp_last_stage_less_layers
    for name, value in (("pp_first_stage_less_layers", first), ("pp_last_stage_less_layers", last)):
        if value < 0:
            out.append(Problem(f"parallelism.{name}", value, "must be >= 0", "use 0 for an even split of the transformer layers"))
    if first < 0 or last < 0:
        return
    try:
        pipeline.stage_layers(mo.num_layers, p.pp * v, first, last)
    except ValueError as e:
        out.append(
            Problem(
                "parallelism.pp",
                p.pp,
                f"model.num_layers = {mo.num_layers} (+ {first} for the embedding, + {last} for the head) cannot be split "
                f"into pp x pp_virtual_stages = {p.pp * v} stages: {e}",
                "use fewer stages (pp or pp_virtual_stages), or lower parallelism.pp_first_stage_less_layers/pp_last_stage_less_layers",
            )
        )


def _async_tp(cfg: RunConfig, out: list[Problem]) -> None:
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


def _sequence(cfg: RunConfig, out: list[Problem]) -> None:
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
    if t.seq_len > ROPE_MAX_SEQ_LEN:
        out.append(
            Problem("training.seq_len", t.seq_len, f"longer than the model's RoPE table ({ROPE_MAX_SEQ_LEN})", f"use <= {ROPE_MAX_SEQ_LEN}")
        )


def _experts(cfg: RunConfig, lay: layout.Layout, out: list[Problem]) -> None:
    """TorchTitan's EP borrows its ranks from FSDP, CP and TP: ep must divide dp_shard x cp x tp
    (the rest, efsdp, shards the experts further) and the experts must split evenly over ep."""
    m, ep = cfg.model, cfg.parallelism.ep
    if ep == 1:
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
    if m.num_experts % ep:
        out.append(
            Problem(
                "parallelism.ep",
                ep,
                f"model.num_experts = {m.num_experts} must split evenly over the expert-parallel ranks",
                f"use ep in {divisors(m.num_experts)}",
            )
        )
    region = lay.dp_shard * lay.cp * lay.tp
    if region % ep:
        out.append(
            Problem(
                "parallelism.ep",
                ep,
                f"EP takes its ranks from dp_shard x cp x tp = {lay.dp_shard} x {lay.cp} x {lay.tp} = {region} "
                "(TorchTitan: dp_shard * cp * tp == efsdp * ep), which it does not divide",
                f"use ep in {divisors(region)}, or raise parallelism.dp_shard",
            )
        )


def _device(cfg: RunConfig, out: list[Problem]) -> None:
    c, pr = cfg.cluster, cfg.precision
    want = {DeviceType.cpu: Backend.gloo, DeviceType.cuda: Backend.nccl}[c.device]
    if c.backend == Backend.nccl and c.device != DeviceType.cuda:
        out.append(
            Problem(
                "cluster.backend",
                "nccl",
                f"NCCL needs CUDA devices; cluster.device is {c.device.value}",
                f"use cluster.backend={want.value}",
            )
        )
    for field, dtype in (("param_dtype", pr.param_dtype), ("reduce_dtype", pr.reduce_dtype)):
        if dtype.value not in DEVICE_DTYPES[c.device]:
            out.append(
                Problem(
                    f"precision.{field}", dtype.value, f"{c.device.value} cannot compute in it", f"use one of {DEVICE_DTYPES[c.device]}"
                )
            )
    if c.worker_start == WorkerStart.fork and c.device == DeviceType.cuda:
        out.append(
            Problem(
                "cluster.worker_start",
                "fork",
                "a CUDA rank forked from an agent that has imported torch cannot initialize CUDA reliably",
                "use cluster.worker_start=exec",
            )
        )
    peak_dtype = precision.matmul_peak(cfg)[0]
    if c.device == DeviceType.cuda and peak_dtype not in c.peak_tflops:
        out.append(
            Problem(
                "cluster.peak_tflops",
                dict(c.peak_tflops),
                f"has no dense peak for {peak_dtype}, which MFU needs (the dtype of {pr.name}'s matmuls)",
                f"add cluster.peak_tflops.{peak_dtype}",
            )
        )
    if cfg.logging.wandb.mode not in WANDB_MODES:
        out.append(Problem("logging.wandb.mode", cfg.logging.wandb.mode, "not a W&B mode", f"use one of {', '.join(WANDB_MODES)}"))


def _fp8_device(cfg: RunConfig, out: list[Problem]) -> None:
    """The cluster's device must run the recipe: SM capability on CUDA, a real or emulated path on CPU."""
    r, c = cfg.precision.fp8, cfg.cluster
    req = precision.RECIPES[r]
    if c.device == DeviceType.cpu:
        if req.on_cpu == "rejected":
            out.append(
                Problem(
                    "precision.fp8",
                    r.value,
                    f"{cfg.precision.name} needs {req.hardware}: its E8M0-scaled 32-element-block GEMMs exist only there, "
                    "and the runner has no CPU emulation of them",
                    "use precision=fp8_blockwise (emulated on CPU) or fp8_rowwise, or a Blackwell cluster (mode=validate here)",
                )
            )
        return
    cc = precision.parse_capability(c.compute_capability)
    if cc is None:
        out.append(
            Problem(
                "cluster.compute_capability",
                repr(c.compute_capability),
                f"{cfg.precision.name} needs {req.hardware}, and the cluster does not say its GPUs' capability",
                'set it as "major.minor", e.g. cluster.compute_capability="9.0" for H100',
            )
        )
    elif cc < req.min_sm:
        ok = [name for name, q in precision.RECIPES.items() if q.min_sm <= cc]
        out.append(
            Problem(
                "precision.fp8",
                r.value,
                f"needs {req.hardware}; cluster {c.name} has SM {c.compute_capability}",
                f"use a precision this GPU runs ({', '.join(f'fp8 {o.value}' for o in ok) or 'bf16'}) or a newer cluster",
            )
        )


def _fp8_shapes(cfg: RunConfig, lay: layout.Layout, out: list[Problem]) -> None:
    """Converted layers' GEMM dims, per TP shard, and the tokens per GEMM must fit the recipe's tiles."""
    r, t = cfg.precision.fp8, cfg.training
    div = precision.RECIPES[r].divisor
    converted = set(precision.conversion(cfg)[0])
    layers = [la for la in precision.linear_layers(cfg.model) if la.fqn in converted]

    def fits(la: precision.LinearLayer, tp: int) -> bool:
        k, n = precision.local_gemm_dims(la, tp)
        return k % div == 0 and n % div == 0

    good_tp = [d for d in divisors(cfg.model.num_kv_heads) if cfg.model.num_heads % d == 0 and all(fits(la, d) for la in layers)]
    seen = set()
    for layer in layers:
        kind = ".".join("*" if part.isdigit() else part for part in layer.fqn.split("."))
        if kind in seen:
            continue
        k, n = precision.local_gemm_dims(layer, lay.tp)
        if not fits(layer, lay.tp):
            seen.add(kind)
            shard = f", {layer.tp_style} over tp={lay.tp}" if lay.tp > 1 else ""
            out.append(
                Problem(
                    "precision.fp8",
                    r.value,
                    f"layer {layer.fqn} ({layer.in_dim} -> {layer.out_dim}{shard}) multiplies a {k} x {n} weight; "
                    f"{r.value} FP8 GEMMs need every dimension divisible by {div}",
                    f"keep it in high precision with precision.keep_high_precision=[..., '{kind}'], or use parallelism.tp in {good_tp}",
                )
            )
    tokens = t.microbatch_size * t.seq_len // lay.cp
    if tokens % div:
        out.append(
            Problem(
                "training.seq_len",
                t.seq_len,
                f"training.microbatch_size {t.microbatch_size} x seq_len {t.seq_len} / cp {lay.cp} = {tokens} tokens per GEMM; "
                f"{r.value} FP8 needs a multiple of {div}",
                f"make microbatch_size x seq_len / cp a multiple of {div}",
            )
        )


def check(cfg: RunConfig) -> layout.Layout:
    """Raise ConfigError listing every problem; return the resolved layout."""
    out: list[Problem] = []
    _positive(cfg, out)
    _model(cfg, out)
    if out:
        raise ConfigError(out)
    ws = _world(cfg, out)
    fp8 = cfg.precision.fp8 != Fp8Recipe.none
    if ws is not None:
        _tensor_parallel(cfg, ws, out)
        _pipeline_and_batch(cfg, layout.resolve(cfg.parallelism, cfg.cluster), out)
        _experts(cfg, layout.resolve(cfg.parallelism, cfg.cluster), out)
        if fp8 and not out:  # shapes per TP shard need a valid layout
            _fp8_shapes(cfg, layout.resolve(cfg.parallelism, cfg.cluster), out)
    _sequence(cfg, out)
    _async_tp(cfg, out)
    _device(cfg, out)
    _cluster_and_plan(cfg, out)
    if fp8:
        _fp8_device(cfg, out)
    validate_monitor.check(cfg, ws, out)
    validate_ckpt.check(cfg, out)
    if out:
        raise ConfigError(out)
    return layout.resolve(cfg.parallelism, cfg.cluster)


def machine_memory_gb() -> float:
    """Total RAM of this machine from /proc/meminfo (GB)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / 1e9
    raise RuntimeError("MemTotal missing from /proc/meminfo")


def rank_memory_gb(cfg: RunConfig, lay: layout.Layout) -> float:
    """Rough resident memory of one CPU rank: process overhead, fp32 weights + grads +
    Adam moments sharded over FSDP x TP x PP, and one microbatch of activations
    (Korthikanti et al. 2022: s*b*h*(34 + 5*a*s/h) bytes per layer at 2 bytes/value, x2 for fp32)."""
    m, t = cfg.model, cfg.training
    state = flops.num_params(m) * 16 / (lay.dp_shard * lay.tp * lay.pp)
    s, b, h, a = t.seq_len // lay.cp, t.microbatch_size, m.dim, m.num_heads
    acts = m.num_layers / lay.pp * s * b * h * (34 + 5 * a * s / h) * 2 / lay.tp
    logits = 3 * s * b * m.vocab_size * 4
    return cfg.cluster.rank_overhead_gb + (state + acts + logits) / 1e9
