"""The choice fields of the schema, as Enums: OmegaConf refuses any other value at composition."""

from __future__ import annotations

from enum import Enum, StrEnum


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
    search = "search"
    """Enumerate every layout TorchTitan can run for the model, cluster, global batch and seq_len, reject them by
    validation's rules and the memory model, rank the rest by predicted step time; write search.json and a sweep of
    the top search.top_k; start nothing."""


class InitFormat(Enum):
    hf = "hf"
    """A Hugging Face folder: config.json with model.safetensors or a sharded model.safetensors.index.json."""


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


class ExpertsPrecision(Enum):
    high = "high"
    """The routed experts' grouped GEMMs in high precision: bf16 on GPUs (TorchTitan's GroupedExperts casts to it),
    float32 on CPU ranks (runner.run.titan.cpu)."""
    fp8_rowwise = "fp8_rowwise"
    """float8 e4m3 with one power-of-two scale per row of each operand (per expert): TorchTitan's
    Float8GroupedExpertsConverter, torchao's scaled grouped GEMMs (SM 8.9+); emulated on CPU."""
    mxfp8 = "mxfp8"
    """OCP MX: one E8M0 scale per 32 elements: TorchTitan's MXFP8GroupedExpertsConverter (SM 10.0, Blackwell)."""


class ActivationCheckpoint(Enum):
    none = "none"
    """Keep every activation."""
    full = "full"
    """Recompute every transformer block in backward (TorchTitan FullAC)."""
    selective_op = "selective_op"
    """Per-op selective AC (TorchTitan SelectiveAC): save matmul (all but every second), attention and
    reduce-scatter outputs, recompute the cheap ops (norms, activations, elementwise) in backward."""
    selective_layer = "selective_layer"
    """Per-layer selective AC: recompute every training.ac_layer_frequency-th block whole (TorchTitan's full AC
    on those blocks, its former selective_ac_option=N), keep every other block's activations."""


class MoeCommBackend(StrEnum):
    """TorchTitan 0.3.0's MoE token exchange under expert parallelism (models/common/token_dispatcher.py)."""

    standard = "standard"
    """torch all-to-all collectives (any backend, gloo too); the routing splits are read on the host once per MoE
    block per microbatch forward."""
    minimal_async_ep = "minimal_async_ep"
    """Rows copied to peers through CUDA symmetric memory by Triton kernels, counts kept on the device (no host read);
    EP inside one node, full activation checkpointing."""
    deepep = "deepep"
    """DeepEP's ElasticBuffer kernels (the deep_ep library, NVSHMEM; Hopper and later): a token goes once to each rank
    holding one of its experts; its training dispatch reads counts on the host."""
    hybridep = "hybridep"
    """DeepEP's HybridEP kernels (deep_ep, TMA; built for GB200 NVL72), non-blocking (capacity factor 1.0, as TorchTitan's
    *_hybridep configs): no host read, no token dropped."""


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
    """Hydra's submitit launcher submits the points of `python -m runner -m ...` as one array job, a task per point; each
    node of a task runs the per-node launcher."""


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


class DataSource(Enum):
    synthetic = "synthetic"
    """A deterministic token stream derived from training.seed."""
    text = "text"
    """Local text files read through Hugging Face datasets, tokenized with a local tokenizers JSON file."""
    tokens = "tokens"
    """Folders prepared by `python -m runner.data prepare`, read by memory map (one, or a weighted mixture)."""


class TextFormat(Enum):
    json = "json"
    """JSON lines, one document per line in `text_field`."""
    text = "text"
    """Plain text, one document per line."""
    parquet = "parquet"
    """Parquet files with a string column `text_field`."""


class MismatchAction(Enum):
    stop = "stop"
    """End the run: every rank raises after integrity_report.json is written."""
    rewind = "rewind"
    """Reload the newest checkpoint at or before the step (every replica loads the same values) and go on."""


class FaultTolerance(Enum):
    none = "none"
    """A dead rank stops every rank; torch's elastic agent restarts the job (cluster.max_restarts) from its checkpoint."""
    torchft = "torchft"
    """Per-replica fault tolerance through torchft: each dp_replicate group is its own torchrun job and a dead one
    restarts alone and recovers the weights from a live peer while the others train on (docs/fault-tolerance.md)."""


class OptimizerName(Enum):
    AdamW = "AdamW"
    """Adam with decoupled weight decay (torch.optim.AdamW), TorchTitan's default."""
    Adam = "Adam"
    """Adam with L2 weight decay added to the gradient (torch.optim.Adam)."""


class OptimizerImpl(Enum):
    fused = "fused"
    """One fused kernel for the whole update (TorchTitan's default; torch has it on CPU and CUDA)."""
    foreach = "foreach"
    """Horizontally fused kernels over lists of tensors."""
    for_loop = "for_loop"
    """One parameter at a time (torch's reference implementation; slowest)."""


class LRDecay(Enum):
    linear = "linear"
    """From the peak down to min_lr_factor x peak in a straight line."""
    sqrt = "sqrt"
    """1 - sqrt(progress): falls fast at first."""
    cosine = "cosine"
    """Half a cosine period: slow at both ends."""


class GuardAction(Enum):
    skip = "skip"
    """Drop the batch: no optimizer step; counted and logged."""
    rewind = "rewind"
    """Skip single spikes; after `max_consecutive` in a row, reload the last checkpoint and skip the bad batches."""


class Objective(StrEnum):
    """The figure a run returns to Hydra's optimizing sweepers (Optuna, Nevergrad, Ax), always to minimize."""

    step_time = "step_time"
    """Plans: the predicted step time (s). Training runs: the measured median step time (s)."""
    neg_mfu = "neg_mfu"
    """The MFU negated: plans the predicted MFU, training runs the measured median MFU."""
    final_loss = "final_loss"
    """Training runs: the loss of the last step."""
    eval_loss = "eval_loss"
    """Training runs: summary.json's eval_loss (needs evaluation turned on)."""
