"""Typed schema of every config group, registered in Hydra's ConfigStore.

Torch-free: this module is imported by `--cfg job`, validation and planning.
Every default lives here so that the frozen YAML shows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore


class Mode(Enum):
    train = "train"
    """Validate, freeze, launch the ranks and train."""
    validate = "validate"
    """Validate and print the resolved layout; start nothing (works for any cluster)."""


class DeviceType(Enum):
    cpu = "cpu"
    cuda = "cuda"


class Backend(Enum):
    gloo = "gloo"
    nccl = "nccl"


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
    """Pipeline schedule name as torch.distributed.pipelining knows it."""
    sequence_parallel: bool = True
    """Shard norms/dropout activations along the sequence inside the TP group."""


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
    """Save distributed checkpoints (PyTorch DCP) during training."""
    folder: str = "checkpoints"
    """Folder for checkpoints; relative paths are inside the run folder."""
    interval: int = 100
    """Save every this many steps (and at the last step)."""


@dataclass
class ClusterConfig:
    name: str = "local_cpu"
    """Name of the cluster description."""
    num_nodes: int = 1
    """Nodes in the job."""
    devices_per_node: int = -1
    """Ranks per node; -1 takes the world size from the layout (local CPU only)."""
    device: DeviceType = DeviceType.cpu
    """Device every rank computes on."""
    backend: Backend = Backend.gloo
    """torch.distributed backend."""
    intra_node_bandwidth_gbs: float = 0.0
    """Per-device intra-node bandwidth in GB/s (NVLink aggregate on H100: 900)."""
    inter_node_bandwidth_gbs: float = 0.0
    """Per-device scale-out bandwidth in GB/s (400 Gb/s NIC = 50 GB/s)."""
    peak_tflops: dict[str, float] = field(default_factory=dict)
    """Dense peak TFLOP/s per device by dtype name. Empty on CPU: the peak is measured
    once per run by a matmul benchmark on the whole machine."""
    compute_capability: str = ""
    """CUDA compute capability ("major.minor", e.g. "9.0" for H100) that FP8 recipes are checked
    against; empty on CPU."""
    high_precision_dtype: DType = DType.float32
    """Dtype for the parts FP8 recipes keep out of FP8 (their precision.param_dtype): bfloat16 on
    GPUs; float32 on AVX2-only CPUs, where bf16 matmuls are ~200x slower."""
    device_memory_gb: float = 0.0
    """Memory per device in GB (0 on CPU: the machine's RAM is read at validation)."""
    rank_overhead_gb: float = 0.6
    """Resident memory of one rank before the model (torch + TorchTitan import), GB."""


@dataclass
class DataConfig:
    name: str = "synthetic"
    """Data source. synthetic: a deterministic token stream derived from training.seed."""


@dataclass
class WandbConfig:
    enable: bool = False
    """Log metrics to Weights & Biases from rank 0."""
    project: str = "runner"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team); null uses the account default."""
    mode: str = "offline"
    """W&B mode: offline (default, needs no network), online or disabled."""


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
    """Seed for weights and synthetic data (0 is a valid seed)."""
    seq_len: int = 256
    """Tokens per sample."""
    global_batch_size: int = 8
    """Samples per optimizer step over all data-parallel replicas."""
    microbatch_size: int = 2
    """Samples per forward/backward pass on one rank (gradient accumulation or pipeline microbatch)."""
    lr: float = 8e-4
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    warmup_steps: int = 2
    """Linear warm-up steps, then constant."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value."""
    activation_checkpoint: ActivationCheckpoint = ActivationCheckpoint.none
    """Activation recomputation; when on, HFU is logged beside MFU."""


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
    provenance: dict[str, Any] = field(default_factory=dict)
    """Filled by the runner in frozen.yaml (versions, git commit, layout); ignored on input."""


GROUPS = {
    "model": ModelConfig,
    "parallelism": ParallelismConfig,
    "precision": PrecisionConfig,
    "checkpoint": CheckpointConfig,
    "cluster": ClusterConfig,
    "data": DataConfig,
    "logging": LoggingConfig,
}


def register() -> None:
    """Register the top-level schema and one `base_<group>` schema per group."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=RunConfig)
    for group, node in GROUPS.items():
        cs.store(group=group, name=f"base_{group}", node=node)
