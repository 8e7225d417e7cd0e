"""Where and how a run is operated: checkpoints, the cluster and its scheduler, logging and the process groups.

The monitors' group (`monitor.*`) is runner.schema.monitoring."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runner.schema.choices import (
    Backend,
    DeviceType,
    DType,
    FaultTolerance,
    HostGroup,
    Launcher,
    WandbMode,
    WorkerStart,
)


@dataclass
class LocalCheckpointConfig:
    """The fast tier between shared checkpoints: every rank writes its own shard of the whole training state to its
    node's local storage, and a copy of it to the same local rank on the next node (docs/checkpoints-and-data.md)."""

    folder: str = ""
    """Node-local storage (an absolute path on every node: a local SSD, /dev/shm); '' = no local tier. `%N` in it
    is replaced by the node's name, as in SLURM's file patterns (e.g. simulated nodes on one machine). Not the shared
    checkpoint.folder nor inside it."""
    interval: int = 10
    """Save to the local tier every this many steps (not at steps the shared tier saves)."""
    keep: int = 2
    """Local checkpoints kept per node (own shards and partner copies alike), >= 1."""


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
    init_from: str = ""
    """The runner's own checkpoint whose model weights the run starts from (a new phase: anneal, another data mix, a
    longer run), in any layout: a `<folder>/step-<n>`, or a run or checkpoint folder (its newest intact checkpoint);
    the optimizer, learning-rate schedule and data position start fresh; '' = none. A resume takes precedence."""
    init_record: dict[str, Any] = field(default_factory=dict)
    """Filled when the run is frozen (leave empty): the step of the checkpoint init_from was pinned to and the sha256 of
    its COMPLETE.json file list (every file's size and CRC-32); a replay refuses a checkpoint that no longer matches."""
    checksum: bool = True
    """Record every checkpoint file's CRC-32 in COMPLETE.json and verify it before resuming (reads the whole
    checkpoint once more per save and per resume)."""
    export_final_model: bool = False
    """After the last step also write the model weights alone (no optimizer) to `<folder>/model-final`."""
    export_hf: bool = False
    """After the last step also export the last checkpoint as a Hugging Face folder `<folder>/model-hf` that `transformers`
    loads (config.json, safetensors shards, generation_config.json, the tokenizer of data=text), as
    `python -m runner.export <run folder> --format hf` does; needs checkpoint.enable and a family runner.formats.hf_folder lists."""
    min_free_gb: float = 0.0
    """Free space the checkpoint filesystem must keep beyond `keep` + 1 checkpoints, GB (pre-flight check)."""
    local: LocalCheckpointConfig = field(default_factory=LocalCheckpointConfig)
    """The node-local tier (off unless local.folder is set)."""


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
    signal_s: int = 120
    """Seconds before the time limit at which SLURM sends USR2 (#SBATCH --signal=USR2@N): the job checkpoints
    on it and is requeued. Preemption sends it too (`scancel --signal=USR2 <job>` by hand)."""
    max_requeues: int = 3
    """Times a job that reached its time limit is requeued to resume from its checkpoint (hydra-submitit-launcher's
    max_num_timeout); 0 = never. Preemptions do not count."""


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
    and threads per rank) and of the machine profiles `python -m runner.calibrate` made here
    (profile-<cpu model>-<dtype>-<created>.json); null = measure every run and cache nothing."""
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
    submitit launcher submits the points of `python -m runner -m ...` as one array job, a task per
    point, and each node of a task runs the per-node launcher."""
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
    local_write_gbs: float = 0.0
    """Write bandwidth of one node's local storage (checkpoint.local.folder), GB/s; 0 = unknown."""
    memory_bandwidth_gbs: float = 0.0
    """Device memory bandwidth per device, GB/s (H100 SXM HBM3: 3,350), for the step-time predictor's roofline of
    the elementwise kernels; 0 = unknown (that term is left out)."""
    profile: str | None = None
    """Machine profile (JSON) written by `python -m runner.calibrate` on this cluster: the step-time predictor uses
    its measured figures instead of the datasheet ones; null = on CPU the newest profile of this machine in
    peak_cache_dir (none there: no prediction), on GPUs the datasheet figures, labelled "datasheet, not calibrated"."""


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
    verbose: bool = False
    """Print every log line of TorchTitan and the libraries (INFO and up) on the console; false: WARNING and up
    (the rank logs of ranks 1.. keep every line either way)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)


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
class FaultToleranceConfig:
    name: FaultTolerance = FaultTolerance.none
    """none: one torchrun job for every rank; torchft: one torchrun job per dp_replicate group under a torchft lighthouse."""
    lighthouse: str = ""
    """Address of a running torchft lighthouse (http://host:port); "" starts one on the first node at lighthouse_port."""
    lighthouse_port: int = 29510
    """Port of the lighthouse the runner starts (lighthouse ""), on the first node."""
    lighthouse_bind: str = ""
    """Host or IP the lighthouse listens on (its --bind, with the port): "" = loopback (127.0.0.1) for a run on one
    machine, and on a cluster the host of `lighthouse`, the address the replica groups use; 0.0.0.0 = every interface."""
    min_replicas: int = 1
    """Replica groups a step needs to commit (the lighthouse's --min_replicas and the manager's min_replica_size)."""
    join_timeout_ms: int = 60000
    """Milliseconds the lighthouse waits for heartbeating replica groups to join a new quorum before it forms one without them."""
    heartbeat_timeout_ms: int = 5000
    """Milliseconds without a heartbeat after which the lighthouse counts a replica group dead."""
    timeout_s: int = 60
    """Seconds torchft's collectives, should_commit and checkpoint transfers may take (TORCHFT_TIMEOUT_SEC)."""
    quorum_timeout_s: int = 60
    """Seconds a replica group waits for a quorum (TORCHFT_QUORUM_TIMEOUT_SEC); longer than a step."""
    connect_timeout_s: int = 60
    """Seconds to connect to the lighthouse and the replica groups' managers (TORCHFT_CONNECT_TIMEOUT_SEC)."""
    process_group_timeout_ms: int = 10000
    """Milliseconds after which torchft's cross-replica gloo/NCCL group aborts an operation (TorchTitan's TorchFTManager)."""
    replica_id: int = -1
    """This job's replica group (0..dp_replicate-1); set by the runner in each group's frozen file, -1 in a user config."""


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
class ProfileConfig:
    """torch.profiler traces of chosen steps (runner.run.profiling); off while `steps` is empty and `every` is 0."""

    steps: list[int] = field(default_factory=list)
    """Steps to trace, each into profile/rank_<r>/step_<s>.json.gz (after `warmup` steps of the profiler running unrecorded)."""
    every: int = 0
    """Trace `active` steps of every this many (torch.profiler.schedule's cycle of wait + warmup + active); 0 = only `steps`."""
    warmup: int = 1
    """Steps the profiler runs before each traced step without recording (torch.profiler.schedule's warmup: its first step costs more)."""
    active: int = 1
    """Steps traced per cycle of `every` (torch.profiler.schedule's active)."""
    ranks: list[int] | None = None
    """Ranks that trace; null = rank 0 and the first rank of each pipeline stage."""
    memory: bool = False
    """CUDA: record the allocator's history and dump memory_snapshot_rank_<r>.pickle at traced steps and on an out-of-memory
    error (pytorch.org/memory_viz). CPU: the traces' profile_memory only (allocator snapshots are CUDA-only)."""
