"""What is trained and how: the model, its parallel layout, precision, the step loop's settings, data, and the plan and dry-run options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runner.schema.choices import (
    ActivationCheckpoint,
    DataSource,
    DeviceType,
    DType,
    ExpertsPrecision,
    Fp8Recipe,
    InitFormat,
    LRDecay,
    MoeCommBackend,
    OptimizerImpl,
    OptimizerName,
    ReshardPolicy,
    TextFormat,
)


@dataclass
class ModelConfig:
    name: str = "llama3"
    """TorchTitan model family (its model registry module)."""
    flavor: str = "debugmodel"
    """TorchTitan flavor inside the family, e.g. debugmodel, 8B, 30B-A3B, 671B (conf/model/ lists every one)."""
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
    """SwiGLU hidden size after TorchTitan's rounding, of every dense block; 0 in an MoE model without dense blocks."""
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
    num_mtp_layers: int = 0
    """Multi-token prediction depth D (DeepSeek-V3 only): MTP blocks after the last block, the k-th predicting the
    token k + 1 ahead through the shared embedding and head (TorchTitan's MTPDecoder and MTPLoss); 0 = none."""
    mtp_loss_scale: float = 0.3
    """Weight of the MTP loss (the mean over the D depths) added to the main cross-entropy (TorchTitan's
    MTPLoss.Config.mtp_scale; the DeepSeek-V3 report's lambda: 0.3 for the first 10T tokens, then 0.1)."""
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
    head_dim: int = 0
    """Query/key/value dims of one attention head; 0 = dim // num_heads (Llama 3). Qwen3 and gpt-oss set it
    apart from the width (Qwen3 0.6B: dim 1024, 16 heads of 128)."""
    fuse_qkv: bool = True
    """Grouped-query attention projects q, k and v with one fused Linear (wqkv); false = separate projections
    (wq and a joint wkv in Qwen3's QKVLinear; wq, wk and wv in Qwen3.5)."""
    qk_norm: bool = False
    """An RMSNorm over each query and key head (head_dim weights each) before RoPE (Qwen3)."""
    attention_bias: bool = False
    """The attention's q, k, v and output projections carry biases (gpt-oss)."""
    attention_sinks: bool = False
    """One learned sink logit per query head that takes part in the softmax and absorbs attention (gpt-oss)."""
    sliding_window: int = 0
    """Tokens a sliding-window attention layer looks back over; 0 = full causal attention in every block."""
    full_attention_interval: int = 1
    """With sliding_window or linear attention: every full_attention_interval-th block (the last of each group)
    attends to the whole sequence, the others to the window (gpt-oss: 2, blocks 0, 2, 4, ... slide) or through
    linear attention (Qwen3.5: 4, blocks 3, 7, 11, ... hold softmax attention)."""
    attention_output_gate: bool = False
    """The query projection also yields a sigmoid gate on the attention output (twice the query width; Qwen3.5)."""
    num_linear_key_heads: int = 0
    """Gated DeltaNet linear-attention blocks (Qwen3.5): query/key heads; 0 = no linear attention."""
    num_linear_value_heads: int = 0
    """Gated DeltaNet: value heads (each with its own decay and gate)."""
    linear_key_head_dim: int = 0
    """Gated DeltaNet: dims of one query/key head."""
    linear_value_head_dim: int = 0
    """Gated DeltaNet: dims of one value head."""
    linear_conv_kernel: int = 0
    """Gated DeltaNet: width of the depthwise causal convolution over q, k and v."""
    shared_expert_gate: bool = False
    """A sigmoid gate (one Linear of dim -> 1) scales the shared experts' output (Qwen3.5)."""
    moe_bias: bool = False
    """The router gate and every routed expert's projections carry biases (gpt-oss)."""
    load_balance_coeff: float = 0.001
    """Step of TorchTitan's auxiliary-loss-free load balancing (MoE models): before each optimizer step every expert's
    routing bias moves by this toward the mean load (minus for experts above it, plus below); 0 = off, the bias stays 0.
    TorchTitan's default for every MoE flavor (DeepSeek-V3's report: 0.001)."""
    rope_max_seq_len: int = 131072
    """Positions of the RoPE table TorchTitan's flavor precomputes (a buffer in every block; the longest seq_len)."""
    rope_cos_sin: bool = False
    """The RoPE table holds real cos and sin (fp32, 2 x head_dim per position; Qwen3, gpt-oss) rather than
    complex64 rotations (head_dim / 2 per position; Llama 3, DeepSeek-V3)."""
    rope_dim: int = 0
    """Dims of a head that RoPE rotates, the width of its table (Qwen3.5's partial rotary: 64 of 256); 0 = the whole
    head (MLA: qk_rope_head_dim). The plan reads it; the model is built with its flavor's."""
    rope_theta: float = 500000.0
    """RoPE base frequency (Llama 3: 500000, Qwen3: 1e6, DeepSeek-V3: 10000)."""
    init_from: str = ""
    """A local folder of Hugging Face weights the run starts from (config.json with model.safetensors or a sharded
    model.safetensors.index.json; nothing is downloaded); '' = TorchTitan's random initialization. A resume from
    the run's own checkpoint takes precedence; the optimizer starts fresh."""
    init_format: InitFormat = InitFormat.hf
    """Format of model.init_from: hf (read through the family's TorchTitan state_dict_adapter)."""
    init_record: dict[str, Any] = field(default_factory=dict)
    """Filled when the run is frozen (leave empty): sha256 of init_from's config.json and index, each shard's size and
    the sha256 of its safetensors header; a replay refuses a folder that no longer matches."""


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
    moe_comm_backend: MoeCommBackend = MoeCommBackend.standard
    """How routed tokens travel to their experts' EP ranks and back (TorchTitan's moe_comm_backend): standard (torch
    all-to-all), minimal_async_ep (CUDA symmetric memory), deepep or hybridep (the DeepEP library); docs/models.md."""


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
    experts: ExpertsPrecision = ExpertsPrecision.high
    """Precision of an MoE model's routed experts (their grouped GEMMs, not Linear layers, so apart from fp8): high
    (param_dtype; bf16 on GPUs), fp8_rowwise or mxfp8 through TorchTitan's grouped-experts converters."""
    keep_high_precision: list[str] = field(default_factory=list)
    """Module name patterns (fnmatch, on TorchTitan's module FQNs such as `lm_head` or
    `layers.*.attention.wo`) kept in param_dtype when fp8 is on; matching Linear layers are not converted."""
    allow_fp32_on_gpu: bool = False
    """Train with param_dtype float32 on a CUDA cluster on purpose (H100: 67 dense TFLOP/s against bf16's 989); false
    refuses it there, where float32 is most often the CPU default (precision=fp32) left in place."""


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
    max_norm: float = 1.0
    """Clip the global gradient norm to this value (> 0)."""
    activation_checkpoint: ActivationCheckpoint = ActivationCheckpoint.none
    """Activation recomputation; when on, HFU is logged beside MFU."""
    ac_layer_frequency: int = 2
    """With activation_checkpoint=selective_layer: recompute every N-th transformer block of each model part
    (blocks N-1, 2N-1, ...); 1 recomputes them all, like full."""
    compile: bool = False
    """torch.compile every transformer block (TorchTitan's CompileConfig, Inductor); async TP needs it."""
    gc_every: int = 50
    """Python's automatic garbage collection is off inside the step loop and every rank collects after each gc_every-th
    step, all at the same step (TorchTitan's gc_freq); 0 leaves Python's automatic collection on."""


@dataclass
class ParamGroup:
    pattern: str = ""
    """Regular expression searched in each parameter's name (TorchTitan's names, e.g. `norm\\.weight$`,
    `tok_embeddings`); a parameter belongs to the first group whose pattern it matches, else to the default group."""
    weight_decay: float = 0.0
    """Weight decay of the parameters this group takes, >= 0."""


@dataclass
class OptimizerConfig:
    """The optimizer, built by TorchTitan's OptimizersContainer (one optimizer per model part)."""

    name: OptimizerName = OptimizerName.AdamW
    """Optimizer class."""
    lr: float = 8e-4
    """Peak learning rate, > 0."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam's (beta1, beta2), each in [0, 1)."""
    eps: float = 1e-8
    """Adam's epsilon, > 0."""
    weight_decay: float = 0.1
    """Weight decay of the parameters no group takes, >= 0."""
    implementation: OptimizerImpl = OptimizerImpl.fused
    """How the update runs: fused (one kernel), foreach or for_loop."""
    no_decay_1d_and_embeddings: bool = False
    """No weight decay on 1-D parameters (norm weights, biases) and the token embeddings (Megatron's and OLMo's
    choice); TorchTitan's default decays every parameter."""
    param_groups: list[ParamGroup] = field(default_factory=list)
    """Parameter groups by name pattern, checked in order before the no_decay_1d_and_embeddings group; every pattern
    must match some parameter of the model."""


@dataclass
class LRSchedulerConfig:
    """The learning-rate schedule over training.steps, built by TorchTitan's LRSchedulersContainer: linear warm-up,
    then a stable phase (with decay_ratio), then the decay."""

    warmup_steps: int = 2
    """Linear warm-up steps from lr / warmup_steps up to the peak optimizer.lr."""
    decay_type: LRDecay = LRDecay.linear
    """Shape of the decay after warm-up (or after the stable phase)."""
    decay_ratio: float | None = None
    """Share of training.steps that decays, in [0, 1] (warmup-stable-decay); None decays from the end of warm-up."""
    min_lr_factor: float = 0.0
    """The rate decays to min_lr_factor x optimizer.lr, in [0, 1]."""


@dataclass
class MixSource:
    path: str = ""
    """A folder written by `python -m runner.data prepare`."""
    weight: float = 1.0
    """Its share of the samples (weights are normalized over the mixture)."""


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
    """text: path of a Hugging Face `tokenizers` JSON file (tokenizer.json); tokens: optional, must be the one the
    folders were prepared with (checked by hash)."""
    eos_token: str = "<|end_of_text|>"
    """text: end-of-document token of a bare tokenizer.json; a tokenizer_config.json beside data.tokenizer names the BOS
    and EOS instead (as TorchTitan's tokenizer reads them). data.document_mask=false appends this token alone."""
    document_mask: bool = True
    """text, tokens: train documents as TorchTitan does: each framed by the tokenizer's BOS and EOS, labels within the
    document, positions restarting per document and attention masked to it. false: today's packing (one token stream,
    positions 0..seq_len-1 and causal attention across documents). Synthetic data is one document per sample either way."""
    shuffle: bool = True
    """text, tokens: visit the packed samples in a new order each epoch (seeded by training.seed)."""
    path: str = ""
    """tokens: a folder written by `python -m runner.data prepare` (or use mix)."""
    mix: list[MixSource] = field(default_factory=list)
    """tokens: several prepared folders with weights, e.g. [{path: a, weight: 0.7}, {path: b, weight: 0.3}]."""
    eval_files: list[str] = field(default_factory=list)
    """text: local files of the held-out split (same format, text field and tokenizer as data.files); empty = none."""
    eval_fraction: float = 0.0
    """text: fraction in [0, 1) of the documents of data.files held out for evaluation, chosen by a hash of each
    document's text (stable when files are added or reordered); training never reads them. 0 = none."""


@dataclass
class EvalConfig:
    interval: int = 0
    """Compute the loss on held-out data every this many optimizer steps, and after the last step; 0 = off."""
    steps: int = 4
    """Batches per evaluation pass, each of training.global_batch_size samples (sliced over DP like training's):
    every pass reads the same first eval.steps batches of the held-out split, so passes are comparable."""
    cpu_flex_attention: bool = False
    """TEST-ONLY: CPU ranks keep TorchTitan's FlexAttention and its block masks (the GPU path) instead of SDPA. Its
    forward runs on CPU, its backward does not, so only runner.run.layout_parity uses it, for one forward-only evaluation
    pass of the initial weights (no step is trained); a launch refuses it."""


@dataclass
class PlanConfig:
    flops_convention: str = "6N"
    """FLOP convention of the plan's compute and step-time rows (both are shown): 6N (6 x
    parameters per token, the Llama 3 paper's MFU) or titan (TorchTitan's: 6 x non-embedding
    parameters plus the attention term)."""
    moe_imbalance: float = 1.0
    """MoE models: the routed tokens the busiest EP rank receives over the mean (>= 1), which sizes the plan's
    imbalance headroom (runner.estimate.moe_memory). 1.0 is perfect balance, what mode=dryrun rehearses; a run's
    metrics.jsonl `moe` rows measure the real share."""


@dataclass
class DryrunConfig:
    ranks: list[int] = field(default_factory=list)
    """Ranks of the full layout that mode=dryrun simulates; empty = one per distinct pipeline stage
    (the first rank, a rank of the middle stage, the last rank)."""
    full_batch: bool = False
    """Run the configured global batch; false runs the fewest microbatches per DP rank that reach the
    step's peak (pp + 1 with 1F1B, 2 without a pipeline; all of them with other schedules): a shorter step."""
    device: DeviceType = DeviceType.cpu
    """Device the rehearsal's tensors claim: cpu plays each rank on fake CPU tensors through the CPU build path;
    cuda (a CUDA cluster only) through the runner's own CUDA code on fake CUDA tensors, in .venv-cuda (a CUDA build
    of torch; `scripts/setup.sh --cuda-rehearsal`), on a machine without a GPU (docs/dryrun.md)."""


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
    verify: int = 0
    """mode=search: train the top this-many candidates here, briefly, as one multirun of the written sweep (into
    search/verify/), and print their measured step times beside the predicted ones; 0 = off. At most top_k, and
    only on a cluster that starts on this machine (one node, the local launcher)."""
    verify_steps: int = 4
    """mode=search with verify > 0: training.steps of each verify run; the first step is warm-up, which the
    measured median leaves out, so at least 2."""
