"""Model and precision rules: shapes TorchTitan can build, FP8 recipes the device and the
GEMM shapes can run. Torch-free; called by validate.check."""

from __future__ import annotations

from runner.config import families, family_support
from runner.config.validate.layout_rules import divisors
from runner.estimate import flops, precision
from runner.schema import DeviceType, ModelConfig, RunConfig
from runner.schema.problems import Problem

SIZES = ("dim", "num_layers", "vocab_size", "rope_max_seq_len", "full_attention_interval")  # >= 1
OPTIONAL_SIZES = (  # >= 0
    "num_shared_experts",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "head_dim",
    "sliding_window",
    "num_linear_key_heads",
    "num_linear_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel",
    "rope_dim",
)
LINEAR_SIZES = ("num_linear_key_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel")  # >= 1 with linear attention


def check(cfg: RunConfig, out: list[Problem]) -> None:
    m = cfg.model
    _family(cfg, out)
    for name in SIZES:
        if getattr(m, name) < 1:
            out.append(Problem(f"model.{name}", getattr(m, name), "must be >= 1", "copy it from TorchTitan's registry for the flavor"))
    for name in OPTIONAL_SIZES:
        if getattr(m, name) < 0:
            out.append(Problem(f"model.{name}", getattr(m, name), "must be >= 0", "use 0 for off, or copy it from TorchTitan's registry"))
    if not m.rope_theta > 0:
        out.append(Problem("model.rope_theta", m.rope_theta, "must be > 0", "copy it from TorchTitan's registry for the flavor"))
    if m.ffn_hidden_dim < 1 and not (flops.is_moe(m) and m.num_dense_layers == 0):
        why = "the dense blocks need a hidden size" if flops.is_moe(m) else "every block of a dense model is a SwiGLU MLP of this size"
        out.append(Problem("model.ffn_hidden_dim", m.ffn_hidden_dim, why, "copy it from TorchTitan's registry for the flavor (>= 1)"))
    _moe(m, out)
    _mtp(m, out)
    _heads(m, out)
    _linear_attention(m, out)
    family_support.check(cfg, out)  # what the family's runtime supports on the cluster's device (CPU training, CP)


def _linear_attention(m: ModelConfig, out: list[Problem]) -> None:
    """Gated DeltaNet blocks (num_linear_value_heads > 0) need their heads, dims and convolution, and softmax blocks between."""
    if m.num_linear_value_heads <= 0:
        return
    for name in LINEAR_SIZES:
        if getattr(m, name) < 1:
            out.append(
                Problem(f"model.{name}", getattr(m, name), "linear-attention blocks need it >= 1", "copy it from TorchTitan's registry")
            )
    if m.num_linear_key_heads >= 1 and m.num_linear_value_heads % m.num_linear_key_heads:
        out.append(
            Problem(
                "model.num_linear_value_heads",
                m.num_linear_value_heads,
                f"value heads share key heads in groups: must be a multiple of model.num_linear_key_heads = {m.num_linear_key_heads}",
                "copy it from TorchTitan's registry",
            )
        )
    if m.full_attention_interval < 2:
        out.append(
            Problem(
                "model.full_attention_interval",
                m.full_attention_interval,
                "with linear attention, an interval of 1 leaves no block to it",
                "use >= 2 (Qwen3.5: 4), or model.num_linear_value_heads=0",
            )
        )


def _family(cfg: RunConfig, out: list[Problem]) -> None:
    """A family the runner offers (families.FAMILIES), one of its registered flavors, and one that runs on the device."""
    m = cfg.model
    fam = families.family(m)
    if fam is None:
        fix = f"use one of {', '.join(families.FAMILIES)} (see conf/model/)"
        out.append(Problem("model.name", m.name, "not a TorchTitan family the runner knows", fix))
        return
    if m.flavor not in fam.flavors:
        out.append(Problem("model.flavor", m.flavor, f"not a TorchTitan {m.name} flavor", f"use one of {', '.join(fam.flavors)}"))
    if fam.cpu_rejection and cfg.cluster.device == DeviceType.cpu:
        out.append(
            Problem(
                "model.name",
                m.name,
                f"{fam.title} cannot train on CPU ranks: {fam.cpu_rejection}",
                "use a GPU cluster (mode=validate or plan here)",
            )
        )


def _heads(m: ModelConfig, out: list[Problem]) -> None:
    """Heads must split the width (unless the family sets head_dim apart) and the query heads must group over the KV heads."""
    if m.num_heads < 1 or (m.head_dim == 0 and not flops.is_mla(m) and m.dim % m.num_heads):
        out.append(Problem("model.num_heads", m.num_heads, f"must divide model.dim = {m.dim}", f"use one of {divisors(max(m.dim, 1))}"))
    elif m.num_kv_heads < 1 or m.num_heads % m.num_kv_heads:
        out.append(
            Problem(
                "model.num_kv_heads", m.num_kv_heads, f"must divide model.num_heads = {m.num_heads}", f"use one of {divisors(m.num_heads)}"
            )
        )


def _moe(m: ModelConfig, out: list[Problem]) -> None:
    """An MoE model's numbers must describe a router TorchTitan can build."""
    if m.num_experts < 0:
        out.append(Problem("model.num_experts", m.num_experts, "must be >= 0", "use 0 for a dense model"))
    if m.num_experts <= 0:
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
    if m.load_balance_coeff < 0:
        why = "the expert bias moves by this step toward balance; a negative step would push tokens onto the busiest experts"
        out.append(Problem("model.load_balance_coeff", m.load_balance_coeff, why, "use 0 (off) or TorchTitan's 0.001"))
    if not 0 <= m.num_dense_layers < m.num_layers:
        out.append(
            Problem(
                "model.num_dense_layers",
                m.num_dense_layers,
                f"must be in [0, model.num_layers = {m.num_layers}) so that some blocks hold experts",
                "copy n_dense_layers from TorchTitan's registry",
            )
        )


MTP_FAMILIES = ("deepseek_v3",)
"""Families whose TorchTitan model owns multi-token-prediction blocks (MTPDecoder: deepseek_v3's model_registry takes
num_mtp_layers; Kimi's, Qwen3's, Llama 3's and gpt-oss's do not)."""


def _mtp(m: ModelConfig, out: list[Problem]) -> None:
    """Multi-token prediction: a depth >= 0, on a family TorchTitan builds it for, with a loss weight >= 0."""
    if m.num_mtp_layers < 0:
        out.append(Problem("model.num_mtp_layers", m.num_mtp_layers, "must be >= 0", "use 0 (no MTP) or the depth D (DeepSeek-V3: 1)"))
    elif m.num_mtp_layers > 0 and m.name not in MTP_FAMILIES:
        out.append(
            Problem(
                "model.num_mtp_layers",
                m.num_mtp_layers,
                f"TorchTitan builds multi-token-prediction blocks for {', '.join(MTP_FAMILIES)} only, not {m.name}",
                "use model.num_mtp_layers=0, or a deepseek_v3 model (conf/model/deepseek_v3_*)",
            )
        )
    if not m.mtp_loss_scale >= 0:
        out.append(
            Problem("model.mtp_loss_scale", m.mtp_loss_scale, "must be >= 0", "use the DeepSeek-V3 report's 0.3 (or 0.1 late in training)")
        )


def fp8_device(cfg: RunConfig, out: list[Problem]) -> None:
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


_FP8_LAYERS: dict[tuple, tuple[list[precision.LinearLayer], list[int], dict[int, list]]] = {}
"""fp8_shapes' work by what it depends on (the model's shape, the precision group): the converted layers, the
TP degrees all of them fit, and per TP degree the first misfit of each kind. mode=search applies the rule to every
layout of one model, and walking DeepSeek-V3's 547 Linear layers and their patterns each time was half of its search
(as fp8_cost._LAYERS for the cost model); the lists are shared, read them only."""


def _fp8_fits(la: precision.LinearLayer, tp: int, div: int) -> bool:
    k, n = precision.local_gemm_dims(la, tp)
    return k % div == 0 and n % div == 0


def _fp8_misfits(cfg: RunConfig, tp: int) -> tuple[list[tuple[precision.LinearLayer, str]], list[int]]:
    """(the first converted layer of each kind whose TP shard does not fit the recipe's tiles, with its kind; the TP
    degrees every converted layer fits)."""
    model = tuple(v for v in vars(cfg.model).values() if not isinstance(v, dict))  # init_record: provenance, not shape
    key = (model, tuple(tuple(v) if isinstance(v, list) else v for v in vars(cfg.precision).values()))
    div = precision.RECIPES[cfg.precision.fp8].divisor
    if key not in _FP8_LAYERS:
        if len(_FP8_LAYERS) >= 64:
            _FP8_LAYERS.clear()
        converted = set(precision.conversion(cfg)[0])
        layers = [la for la in precision.linear_layers(cfg.model) if la.fqn in converted]
        m = cfg.model
        good_tp = [d for d in divisors(m.num_kv_heads) if m.num_heads % d == 0 and all(_fp8_fits(la, d, div) for la in layers)]
        _FP8_LAYERS[key] = (layers, good_tp, {})
    layers, good_tp, by_tp = _FP8_LAYERS[key]
    if tp not in by_tp:
        seen, bad = set(), []
        for layer in layers:
            kind = ".".join("*" if part.isdigit() else part for part in layer.fqn.split("."))
            if kind not in seen and not _fp8_fits(layer, tp, div):
                seen.add(kind)
                bad.append((layer, kind))
        by_tp[tp] = bad
    return by_tp[tp], good_tp


def fp8_shapes(cfg: RunConfig, out: list[Problem]) -> None:
    """Converted layers' GEMM dims, per TP shard, and the tokens per GEMM must fit the recipe's tiles.
    Needs only tp and cp, which the layout takes from the config as they are."""
    r, t, tp, cp = cfg.precision.fp8, cfg.training, cfg.parallelism.tp, cfg.parallelism.cp
    div = precision.RECIPES[r].divisor
    bad, good_tp = _fp8_misfits(cfg, tp)
    for layer, kind in bad:
        k, n = precision.local_gemm_dims(layer, tp)
        shard = f", {layer.tp_style} over tp={tp}" if tp > 1 else ""
        out.append(
            Problem(
                "precision.fp8",
                r.value,
                f"layer {layer.fqn} ({layer.in_dim} -> {layer.out_dim}{shard}) multiplies a {k} x {n} weight; "
                f"{r.value} FP8 GEMMs need every dimension divisible by {div}",
                f"keep it in high precision with precision.keep_high_precision=[..., '{kind}'], or use parallelism.tp in {good_tp}",
            )
        )
    tokens = t.microbatch_size * t.seq_len // cp
    if tokens % div:
        out.append(
            Problem(
                "training.seq_len",
                t.seq_len,
                f"training.microbatch_size {t.microbatch_size} x seq_len {t.seq_len} / cp {cp} = {tokens} tokens per GEMM; "
                f"{r.value} FP8 needs a multiple of {div}",
                f"make microbatch_size x seq_len / cp a multiple of {div}",
            )
        )
