"""What is trained and how: the model, its parallel layout, precision, the step loop's settings, data, and the plan and dry-run options."""

from __future__ import annotations

from dataclasses import dataclass, field

from runner.config.schema.choices import ActivationCheckpoint, DataSource, DType, Fp8Recipe, ReshardPolicy, TextFormat


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
    ac_layer_frequency: int = 2
    """With activation_checkpoint=selective_layer: recompute every N-th transformer block of each model part
    (blocks N-1, 2N-1, ...); 1 recomputes them all, like full."""
    compile: bool = False
    """torch.compile every transformer block (TorchTitan's CompileConfig, Inductor); async TP needs it."""


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
class SearchConfig:
    top_k: int = 4
    """mode=search: candidates written to the run folder's sweep (search/), best first."""
    max_virtual_stages: int = 4
    """mode=search: largest pp_virtual_stages tried for the looped schedules (each from 2 up)."""
    max_cp: int = 8
    """mode=search: largest context-parallel degree tried."""
    max_microbatch_size: int = 4
    """mode=search: microbatch sizes tried are 1..this (those not dividing the local batch are rejected)."""
