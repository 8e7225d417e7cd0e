"""Typed schema of every config group, registered in Hydra's ConfigStore.

Torch-free: this module is imported by `--cfg job`, validation and planning.
Every default lives here so that the frozen YAML shows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any

from hydra.core.config_store import ConfigStore


class Mode(Enum):
    train = "train"
    """Validate, freeze, launch the ranks and train."""
    validate = "validate"
    """Validate and print the resolved layout; start nothing (works for any cluster)."""
    plan = "plan"
    """Validate and print the step budget (memory, time, communication, bubble); write plan.json; start nothing."""
    launch_plan = "launch_plan"
    """Validate, write frozen.yaml and print what would be launched: the sbatch script (SLURM)
    and the command every node runs; submit nothing."""
    dryrun = "dryrun"
    """Validate, then in this one CPU process play chosen ranks of the real layout on fake tensors and
    fake collectives, and measure each one's memory for a training step beside the plan; write dryrun.json."""


class DeviceType(Enum):
    cpu = "cpu"
    cuda = "cuda"


class Backend(Enum):
    gloo = "gloo"
    nccl = "nccl"


class HostGroup(Enum):
    auto = "auto"
    dedicated = "dedicated"


class DType(Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"


class Fp8Recipe(Enum):
    none = "none"
    """No FP8: every matmul in precision.param_dtype."""
    tensorwise = "tensorwise"
    """One dynamic scale per tensor (Transformer Engine style), torchao float8 training."""
    rowwise = "rowwise"
    """One dynamic scale per row of each operand, torchao float8 training."""
    blockwise = "blockwise"
    """DeepSeek-V3: 1x128 tiles for activations and gradients, 128x128 blocks for weights."""
    mxfp8 = "mxfp8"
    """OCP MX: one power-of-two (E8M0) scale per 32 consecutive elements (Blackwell hardware)."""


class ActivationCheckpoint(Enum):
    none = "none"
    """Keep every activation."""
    full = "full"
    """Recompute every transformer block in backward (TorchTitan FullAC)."""


class ReshardPolicy(StrEnum):
    """TorchTitan's FSDP2 reshard_after_forward policy (a str, as TorchTitan's config takes it)."""

    default = "default"
    """never with PP (which would otherwise gather once per microbatch); always without."""
    always = "always"
    """Free the gathered weights after each forward."""
    never = "never"
    """Keep the gathered weights until backward ends."""


class Launcher(StrEnum):
    local = "local"
    """The per-node launcher runs on this machine (`python -m runner`)."""
    slurm = "slurm"
    """Hydra's submitit launcher submits one job per run (`python -m runner -m ...`); each node runs the per-node launcher."""


class WandbMode(StrEnum):
    offline = "offline"
    """Write to the run folder; needs no network (`wandb sync` uploads later)."""
    online = "online"
    """Stream to the W&B server."""
    disabled = "disabled"
    """W&B calls do nothing."""


class WorkerStart(Enum):
    exec = "exec"
    fork = "fork"


@dataclass
class ModelConfig:
    name: str = "llama3"
    """TorchTitan model family (its model registry module)."""
    flavor: str = "debugmodel"
    """TorchTitan flavor inside the family, e.g. debugmodel, 8B, 70B, 405B."""
    dim: int = 256
    """Hidden size. Architecture numbers are copied from TorchTitan's registry so that
    validation and planning need no torch; a test keeps them equal."""
    num_layers: int = 6
    """Transformer blocks."""
    num_heads: int = 16
    """Attention (query) heads."""
    num_kv_heads: int = 16
    """Key/value heads (grouped-query attention)."""
    vocab_size: int = 2048
    """Tokenizer vocabulary size."""
    ffn_hidden_dim: int = 768
    """SwiGLU hidden size after TorchTitan's rounding."""
    weight_tying: bool = False
    """Input embedding shared with the output head."""
    num_experts: int = 0
    """Routed experts per mixture-of-experts block; 0 = dense model (every block a SwiGLU MLP)."""
    num_experts_per_token: int = 0
    """Routed experts each token is sent to (the router's top-k)."""
    num_shared_experts: int = 0
    """Experts every token passes through beside the routed ones (one SwiGLU of num_shared_experts x moe_hidden_dim)."""
    moe_hidden_dim: int = 0
    """SwiGLU hidden size of one expert."""
    num_dense_layers: int = 0
    """Leading blocks of an MoE model with a dense SwiGLU MLP of ffn_hidden_dim instead of experts."""
    kv_lora_rank: int = 0
    """Multi-head latent attention (DeepSeek-V3): rank of the compressed key/value projection; 0 = standard attention."""
    q_lora_rank: int = 0
    """Multi-head latent attention: rank of the compressed query projection; 0 = a direct query projection."""
    qk_nope_head_dim: int = 0
    """Multi-head latent attention: per-head query/key dims without RoPE."""
    qk_rope_head_dim: int = 0
    """Multi-head latent attention: per-head query/key dims with RoPE (the key part is shared by all heads)."""
    v_head_dim: int = 0
    """Multi-head latent attention: per-head value dims."""


@dataclass
class ParallelismConfig:
    name: str = "single"
    """Name of the layout preset."""
    dp_replicate: int = 1
    """Data-parallel replicas (DDP/HSDP replicate axis)."""
    dp_shard: int = -1
    """FSDP shard degree; -1 absorbs the ranks the other degrees leave."""
    tp: int = 1
    """Tensor-parallel degree (inside one node)."""
    pp: int = 1
    """Pipeline stages."""
    cp: int = 1
    """Context-parallel degree (sequence split for attention)."""
    ep: int = 1
    """Expert-parallel degree (MoE models only)."""
    pp_schedule: str = "1F1B"
    """Pipeline schedule name as torch.distributed.pipelining knows it: 1F1B, GPipe (one stage per rank),
    Interleaved1F1B, LoopedBFS, InterleavedZeroBubble (looped, >= 2 stages per rank), ZBVZeroBubble,
    DualPipeV (V-shaped, exactly 2 stages per rank)."""
    pp_virtual_stages: int = 1
    """Pipeline stages (model chunks) per pipeline rank, v: 1 for 1F1B/GPipe, >= 2 for the looped
    schedules, 2 for the V schedules. The model is split into pp x v stages."""
    pp_first_stage_less_layers: int = 1
    """Transformer layers the first stage holds fewer than the others because it also holds the
    embedding (TorchTitan's pipeline_parallel_first_stage_less_layers; the Llama 3 405B split)."""
    pp_last_stage_less_layers: int = 1
    """Transformer layers the last stage holds fewer than the others because it also holds the
    final norm and output head (TorchTitan's pipeline_parallel_last_stage_less_layers)."""
    sequence_parallel: bool = True
    """With tp > 1: shard norm activations along the sequence inside the TP group (reduce-scatter +
    all-gather in place of TP's all-reduce); false keeps them replicated."""
    async_tp: bool = False
    """Overlap TP collectives with the matmuls (TorchTitan's async TP: Inductor's micro-pipeline TP
    pass on symmetric memory); needs CUDA, tp > 1 and training.compile=true."""
    fsdp_reshard_after_forward: ReshardPolicy = ReshardPolicy.default
    """TorchTitan's FSDP2 policy: always (free gathered weights after each forward), never
    (keep them until backward ends), default (never with PP, which would otherwise gather
    once per microbatch; always without)."""


@dataclass
class PrecisionConfig:
    name: str = "fp32"
    """Name of the precision recipe."""
    param_dtype: DType = DType.float32
    """Dtype of parameters in forward/backward compute (FSDP2 mixed precision); the
    dtype whose dense peak MFU uses."""
    reduce_dtype: DType = DType.float32
    """Dtype of gradient reduce-scatter/all-reduce. Master weights and optimizer state stay fp32."""
    fp8: Fp8Recipe = Fp8Recipe.none
    """FP8 recipe for the Linear layers that keep_high_precision does not exclude."""
    keep_high_precision: list[str] = field(default_factory=list)
    """Module name patterns (fnmatch, on TorchTitan's module FQNs such as `lm_head` or
    `layers.*.attention.wo`) kept in param_dtype when fp8 is on; matching Linear layers are not converted."""


@dataclass
class CheckpointConfig:
    enable: bool = False
    """Save sharded checkpoints (PyTorch DCP): model, optimizer, LR schedule, step, RNG and data loader position."""
    folder: str = "checkpoints"
    """Folder for checkpoints (one `step-<n>` folder each); relative paths are inside the run folder."""
    interval: int = 100
    """Save every this many steps (and at the last step)."""
    keep: int = 3
    """Complete checkpoints kept; older complete ones are deleted after a newer one is published (0 = keep all)."""
    async_save: bool = True
    """Write in a background thread (torch.distributed.checkpoint.async_save): training goes on after
    the state is copied; the checkpoint is published when every rank's write has finished."""
    resume: bool = False
    """Start from a checkpoint: `resume_from` when set, else the newest intact one in `folder` (a restart by
    hand: name the stopped run's folder absolutely); with none to resume from the run stops before launch.
    Ranks restarted by the elastic agent (cluster.max_restarts) always resume from the newest in `folder`."""
    resume_from: str = ""
    """With resume: the checkpoint folder (`<folder>/step-<n>`) to start from instead of the newest. The runner
    sets it before freezing a resumed run, so its frozen.yaml replays from the same step."""
    checksum: bool = True
    """Record every checkpoint file's CRC-32 in COMPLETE.json and verify it before resuming (reads the whole
    checkpoint once more per save and per resume)."""
    export_final_model: bool = False
    """After the last step also write the model weights alone (no optimizer) to `<folder>/model-final`."""
    min_free_gb: float = 0.0
    """Free space the checkpoint filesystem must keep beyond `keep` + 1 checkpoints, GB (pre-flight check)."""


@dataclass
class SlurmConfig:
    """sbatch parameters, passed to Hydra's submitit launcher (cluster.launcher=slurm)."""

    partition: str | None = None
    """SLURM partition (required)."""
    account: str | None = None
    """Account charged for the job; null = the user's default."""
    time_min: int = 240
    """Wall-clock limit of one job, minutes."""
    constraint: str | None = None
    """Node feature constraint, e.g. h100."""
    exclusive: bool = True
    """Whole nodes only (#SBATCH --exclusive)."""
    container_image: str | None = None
    """Container image for the job's steps (pyxis/enroot: #SBATCH --container-image)."""
    gpus_per_node_max: int = 8
    """GPUs one node of this partition has; cluster.devices_per_node may not exceed it."""
    cpus_per_node: int | None = None
    """CPU cores requested per node (one task per node); null = SLURM's default."""
    mem_gb: int | None = None
    """Memory per node, GB; null = SLURM's default."""


@dataclass
class ClusterConfig:
    name: str = "local_cpu"
    """Name of the cluster description."""
    num_nodes: int | None = 1
    """Nodes in the job; null = required on the command line (SLURM clusters)."""
    devices_per_node: int = -1
    """Ranks per node; -1 takes the world size from the layout (local CPU only)."""
    device: DeviceType = DeviceType.cpu
    """Device every rank computes on."""
    backend: Backend = Backend.gloo
    """torch.distributed backend."""
    intra_node_bandwidth_gbs: float = 0.0
    """Per-device intra-node bandwidth in GB/s, both directions together, as datasheets quote
    NVLink (H100: 900). A ring collective sends at half of it (one direction)."""
    inter_node_bandwidth_gbs: float = 0.0
    """Per-device scale-out bandwidth in GB/s, both directions together like the intra-node
    figure: a 400 Gb/s full-duplex NIC is 50 GB/s each way, so 100."""
    peak_tflops: dict[str, float] = field(default_factory=dict)
    """Dense peak TFLOP/s per device by dtype name. Empty on CPU: the peak is measured by a matmul
    benchmark of one rank's thread share at its plateau size (runner/run/peak.py), once per machine,
    dtype and thread layout (cached in peak_cache_dir)."""
    peak_cache_dir: str | None = "~/.cache/runner"
    """Folder of the measured CPU peaks (peak-<cpu model>-<dtype>.json, keyed by cores, torch version
    and threads per rank); null = measure every run and cache nothing."""
    compute_capability: str = ""
    """CUDA compute capability ("major.minor", e.g. "9.0" for H100) that FP8 recipes are checked
    against; empty on CPU."""
    high_precision_dtype: DType = DType.float32
    """Dtype for the parts FP8 recipes keep out of FP8 (their precision.param_dtype): bfloat16 on
    GPUs; float32 on AVX2-only CPUs, where bf16 matmuls are ~200x slower."""
    device_memory_gb: float = 0.0
    """Memory per device in GB (0 on CPU: the machine's RAM is read at validation)."""
    launcher: Launcher = Launcher.local
    """local: the per-node launcher runs on this machine (`python -m runner`); slurm: Hydra's
    submitit launcher submits one job per run (`python -m runner -m ...`) and each node of the
    job runs the per-node launcher."""
    max_restarts: int = 0
    """Times torch's elastic agent restarts the ranks after a failure (torchrun --max-restarts)."""
    worker_start: WorkerStart = WorkerStart.exec
    """How the elastic agent starts the ranks: exec (torchrun's `python -m runner.worker`, one
    fresh interpreter per rank) or fork (the agent imports torch and TorchTitan once and forks
    every rank from itself, torchrun's start method for function entrypoints: ~11 s of imports
    paid once per node instead of once per rank). fork is for CPU nodes; a CUDA agent must
    not fork."""
    rdzv_host: str | None = None
    """Host of the c10d rendezvous for hand-started multi-node runs; null = the first node
    of the SLURM job (the only case where the runner knows it)."""
    rdzv_port: int = 29500
    """Port of the c10d rendezvous on the first node of a multi-node job (1..65535)."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    rank_overhead_gb: float = 0.6
    """Resident memory of one rank before the model (torch + TorchTitan import), GB."""
    achievable_mfu: float = 0.40
    """MFU the planner assumes for the step time (mode=plan); 0.40 is a good dense-model result at scale."""
    matmul_efficiency: float = 0.70
    """Fraction of the dense peak that the model's large GEMMs reach, for the planner's
    bottom-up step estimate (H100 SXM bf16: about 700 of 989 TFLOP/s). 1.0 on local CPU,
    whose peak is itself measured with a matmul."""
    mtbf_hours: float = 0.0
    """Mean time between failures of the whole job at this size, hours; 0 = unknown (no
    checkpoint interval suggested)."""
    checkpoint_write_gbs: float = 0.0
    """Aggregate write bandwidth of the checkpoint storage, GB/s; 0 = unknown."""


class DataSource(Enum):
    synthetic = "synthetic"
    """A deterministic token stream derived from training.seed."""
    text = "text"
    """Local text files read through Hugging Face datasets, tokenized with a local tokenizers JSON file."""


class TextFormat(Enum):
    json = "json"
    """JSON lines, one document per line in `text_field`."""
    text = "text"
    """Plain text, one document per line."""
    parquet = "parquet"
    """Parquet files with a string column `text_field`."""


@dataclass
class DataConfig:
    name: DataSource = DataSource.synthetic
    """Data source."""
    files: list[str] = field(default_factory=list)
    """text: local data files (absolute, or relative to the directory `python -m runner` starts in)."""
    format: TextFormat = TextFormat.json
    """text: file format, as Hugging Face datasets names its builder."""
    text_field: str = "text"
    """text: column holding each document."""
    tokenizer: str = ""
    """text: path of a Hugging Face `tokenizers` JSON file (tokenizer.json)."""
    eos_token: str = "<|end_of_text|>"
    """text: token appended after every document when the stream is packed (skipped if the tokenizer lacks it)."""
    shuffle: bool = True
    """text: visit the packed samples in a new order each epoch (seeded by training.seed)."""


@dataclass
class WandbConfig:
    enable: bool = False
    """Log metrics to Weights & Biases from rank 0."""
    project: str = "runner"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team); null uses the account default."""
    mode: WandbMode = WandbMode.offline
    """W&B mode: offline (default, needs no network), online or disabled."""
    group: str | None = None
    """W&B run group; null under a Hydra multirun = the sweep folder's full path (set for the ranks as
    WANDB_RUN_GROUP, not frozen, so a replay gets a group of its own), so W&B compares the sweep's layouts."""


@dataclass
class LoggingConfig:
    name: str = "default"
    """Name of the logging option."""
    log_every: int = 1
    """Log every this many steps (console, metrics.jsonl, W&B)."""
    progress: bool = True
    """Show a rich progress bar on rank 0."""
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class TrainingConfig:
    steps: int = 10
    """Optimizer steps."""
    seed: int = 0
    """Seed for weights and synthetic data, in [0, 2**32) (0 is a valid seed)."""
    seq_len: int = 256
    """Tokens per sample."""
    global_batch_size: int = 8
    """Samples per optimizer step over all data-parallel replicas."""
    microbatch_size: int = 2
    """Samples per forward/backward pass on one rank (gradient accumulation or pipeline microbatch)."""
    lr: float = 8e-4
    """Peak learning rate (AdamW), > 0."""
    weight_decay: float = 0.1
    """AdamW weight decay, >= 0."""
    warmup_steps: int = 2
    """Linear warm-up steps, then constant."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value (> 0)."""
    activation_checkpoint: ActivationCheckpoint = ActivationCheckpoint.none
    """Activation recomputation; when on, HFU is logged beside MFU."""
    compile: bool = False
    """torch.compile every transformer block (TorchTitan's CompileConfig, Inductor); async TP needs it."""


class GuardAction(Enum):
    skip = "skip"
    """Drop the batch: no optimizer step; counted and logged."""
    rewind = "rewind"
    """Skip single spikes; after `max_consecutive` in a row, reload the last checkpoint and skip the bad batches."""


@dataclass
class StragglerConfig:
    enable: bool = True
    """Time forward, backward and optimizer (with PP: stage compute and wait) on every rank."""
    interval: int = 10
    """Steps per window: every this many steps the per-rank medians are gathered and judged."""
    factor: float = 1.3
    """A rank is slow in a phase when its window median exceeds the median over ranks by this factor."""
    windows: int = 3
    """Consecutive slow windows before a rank is reported as a straggler."""
    min_seconds: float = 0.005
    """Phases whose median over ranks is below this many seconds are not judged (timer noise)."""


@dataclass
class LossGuardConfig:
    enable: bool = True
    """Detect loss / gradient-norm spikes. Non-finite values are always caught, even when off."""
    factor: float = 3.0
    """Spike: loss or global grad norm above this factor times its running median."""
    window: int = 20
    """Accepted steps in the running median."""
    warmup_steps: int = 5
    """Accepted steps before spike detection starts (non-finite values are caught from step 1); at most
    `window`, since the running median never holds more."""
    action: GuardAction = GuardAction.skip
    """What a spike does: skip the batch, or skip and rewind to the last checkpoint after repeated spikes."""
    max_consecutive: int = 3
    """With action=rewind: spikes in a row that trigger the rewind."""


@dataclass
class InjectConfig:
    """TEST-ONLY fault injection; every switch is off by default. Never set these in a real run."""

    delay_rank: int = -1
    """Rank whose forward is slowed (-1: none)."""
    delay_frac: float = 0.5
    """Extra forward time on delay_rank, as a fraction of its measured forward time."""
    hang_rank: int = -1
    """Rank that sleeps at the start of a forward (-1: none), so its peers wait in a collective."""
    hang_at_step: int = 0
    """Step (1-based) at which hang_rank sleeps."""
    hang_s: float = 3600.0
    """Seconds hang_rank sleeps."""
    corrupt_steps: list[int] = field(default_factory=list)
    """Steps whose batch is corrupted: every rank's loss of that batch is multiplied by corrupt_scale."""
    corrupt_scale: float = 1e4
    """Loss multiplier of a corrupted batch (1e4: an exploding batch; nan: a non-finite one)."""
    kill_rank: int = -1
    """Rank that kills itself with SIGKILL at the start of `kill_at_step` in the first attempt only (-1: none)."""
    kill_at_step: int = 0
    """Step (1-based) at which kill_rank dies; ranks restarted by the elastic agent do not die again."""


@dataclass
class MonitorConfig:
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    guard: LossGuardConfig = field(default_factory=LossGuardConfig)
    inject: InjectConfig = field(default_factory=InjectConfig)


@dataclass
class FlightRecorderConfig:
    enable: bool = True
    """Record every collective in PyTorch's flight recorder (NCCL's on CUDA, the backend-generic one on gloo)."""
    buffer_size: int = 2000
    """Collectives kept per rank (TORCH_NCCL_TRACE_BUFFER_SIZE / TORCH_FR_BUFFER_SIZE)."""
    dump_on_timeout: bool = True
    """Write each rank's recorder to `folder` when a collective times out (NCCL itself; on gloo the runner)."""
    folder: str = "flight_recorder"
    """Dump folder; relative paths are inside the run folder. Files are `rank_<r>` (torchfrtrace's layout)."""
    enable_timing: bool = False
    """CUDA only: time every collective with CUDA events (TORCH_NCCL_ENABLE_TIMING); costs a little per collective."""


@dataclass
class DistributedConfig:
    timeout_s: float = 600.0
    """Process-group timeout in seconds: a collective waiting longer fails, which ends a hung job."""
    heartbeat_s: float = 1.0
    """Every this many seconds each rank writes its record (phase, step, collective counters) to logs/ranks/."""
    shutdown_timeout_s: int = 30
    """After a rank fails, seconds the elastic agent gives the others to exit before SIGKILL (torchrun
    --shutdown-timeout; torch 2.13 itself waits 30 s there, the runner passes this value); a SIGSTOPped
    rank only goes on SIGKILL."""
    flight_recorder: FlightRecorderConfig = field(default_factory=FlightRecorderConfig)
    host_group: HostGroup = HostGroup.auto
    """Process group of the runner's host collectives (losses, data hashes, monitor windows): auto = the
    default group on CPU, a gloo group of their own on CUDA (NCCL rejects CPU tensors); dedicated = their
    own gloo group on any device (how CPU tests check the CUDA arrangement)."""
    audit_collectives: bool = False
    """TEST-ONLY: record every torch.distributed collective the runner's modules call, with its group and
    tensor device, in logs/collectives/rank_<r>.json."""


@dataclass
class PlanConfig:
    flops_convention: str = "6N"
    """FLOP convention of the plan's compute and step-time rows (both are shown): 6N (6 x
    parameters per token, the Llama 3 paper's MFU) or titan (TorchTitan's: 6 x non-embedding
    parameters plus the attention term)."""


@dataclass
class DryrunConfig:
    ranks: list[int] = field(default_factory=list)
    """Ranks of the full layout that mode=dryrun simulates; empty = one per distinct pipeline stage
    (the first rank, a rank of the middle stage, the last rank)."""
    full_batch: bool = False
    """Run the configured global batch; false runs the fewest microbatches per DP rank that reach the
    step's peak (pp + 1 with 1F1B, 2 without a pipeline; all of them with other schedules): a shorter step."""


@dataclass
class RunConfig:
    mode: Mode = Mode.train
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    dryrun: DryrunConfig = field(default_factory=DryrunConfig)
    provenance: dict[str, Any] = field(default_factory=dict)
    """Filled by the runner in frozen.yaml (versions, git commit, layout); ignored on input."""


def register() -> None:
    """Register the top-level schema. The primary config lists it first, so every group
    option merges into a typed node: unknown keys and wrong types fail at composition."""
    ConfigStore.instance().store(name="base_config", node=RunConfig)
