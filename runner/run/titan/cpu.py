"""Adaptations of TorchTitan 0.3.0 (torch 2.13) for CPU ranks on gloo. Applied only when
cluster.device is cpu; on GPU TorchTitan's defaults (NCCL, FlexAttention) stay. docs/CPU.md says
which upstream error each one avoids."""

from __future__ import annotations

import functools
import importlib

import torch

# Modules that copied torchtitan.tools.utils.device_type / device_module by value at import.
_DEVICE_GLOBALS = (
    "torchtitan.tools.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.components.metrics",
    "torchtitan.models.common.token_dispatcher",
    "torchtitan.tools.profiler",
)


def patch_device_globals() -> None:
    """TorchTitan falls back to "cuda" when no accelerator exists; meshes must be built on "cpu"."""
    for name in _DEVICE_GLOBALS:
        mod = importlib.import_module(name)
        if hasattr(mod, "device_type"):
            mod.device_type = "cpu"
        if hasattr(mod, "device_module"):
            mod.device_module = torch.cpu


def use_sdpa(model_config) -> None:
    """FlexAttention has no backward on CPU ("FlexAttention does not support backward on CPU", torch 2.13, eager or
    compiled): use TorchTitan's causal SDPA inner attention, which also takes packed documents' boolean mask
    (`document_mask`). Not for gpt-oss: SDPA would silently drop its sinks and sliding window (validation rejects it on
    CPU: runner.config.family_support)."""
    if any(hasattr(layer.attention, "sliding_window_size") for layer in model_config.layers):
        raise RuntimeError("attention with sinks or a sliding window (gpt-oss) has no CPU path: SDPA would compute another model")
    for layer in [*model_config.layers, *getattr(model_config, "mtp_layers", [])]:  # and the MTP blocks' (DeepSeek-V3)
        layer.attention.inner_attention = _masked_sdpa().Config()


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """The mask TorchTitan's FlexAttention applies to packed documents (decoder.py's _create_flex_attention_mask_for_document:
    its causal AND packed-document mask mods, built from `positions`), evaluated densely: (batch, 1, seq, seq) booleans,
    True where a query may read a key. SDPA with it computes what FlexAttention computes with the BlockMask."""
    from torch.nn.attention.flex_attention import and_masks, create_mask
    from torchtitan.models.common.attention import get_causal_mask_mod, get_efficient_causal_mask_mod_for_packed_document

    b, s = positions.shape
    mods = and_masks(get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(positions))
    return create_mask(mods, b, 1, s, s, device=positions.device)


def document_block_mask(positions: torch.Tensor):
    """The BlockMask TorchTitan's FlexAttention models build for packed documents (decoder.py's
    _create_flex_attention_mask_for_document: create_block_mask over its causal AND packed-document mask mods, heads
    broadcast, its FlexAttention block size, full blocks apart), with torch's eager create_block_mask in place of
    TorchTitan's torch.compile'd one (a cold CPU compile costs minutes): the same tensors, for the dry run to measure."""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask
    from torchtitan.models.common.attention import (
        FlexAttention,
        get_causal_mask_mod,
        get_efficient_causal_mask_mod_for_packed_document,
    )

    b, s = positions.shape
    mods = and_masks(get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(positions))
    block = FlexAttention.Config().block_size
    return create_block_mask(mods, b, None, s, s, device=positions.device, BLOCK_SIZE=block, separate_full_blocks=True)


@functools.cache
def _masked_sdpa():
    """TorchTitan's ScaledDotProductAttention, which refuses attention_masks, taking `document_mask`'s boolean mask:
    without one it is TorchTitan's causal SDPA unchanged (the same call, bitwise)."""
    from dataclasses import dataclass

    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    from torchtitan.models.common.attention import ScaledDotProductAttention

    class DocumentMaskedSdpa(ScaledDotProductAttention):
        @dataclass(kw_only=True, slots=True)
        class Config(ScaledDotProductAttention.Config):
            pass

        def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False, is_causal=True, **kwargs):
            if attention_masks is None:
                return super().forward(q_BLNH, k_BLNH, v_BLNH, scale=scale, enable_gqa=enable_gqa, is_causal=is_causal, **kwargs)
            q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
            with sdpa_kernel(self.sdpa_backends, set_priority=True):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_masks, scale=scale, enable_gqa=enable_gqa)
            return out.transpose(1, 2)

    return DocumentMaskedSdpa


def eager_flex_attention() -> None:
    """TEST-ONLY (eval.cpu_flex_attention): TorchTitan calls flex_attention (with max_autotune) and create_block_mask
    through torch.compile, whose cold CPU compiles cost minutes per process here (docs/parallelism.md). The eager ops
    are the same attention and the same block masks (torch's reference paths), which is what the forward-only check
    of the masks needs; the GPU keeps TorchTitan's compiled ones."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torchtitan.models.common import attention

    # private_api: titan_compiled_flex_attn, titan_compiled_create_block_mask
    attention.FlexAttention._compiled_flex_attn = flex_attention
    attention._compiled_create_block_mask = create_block_mask


def force_sum_reduction(model: torch.nn.Module) -> None:
    """TorchTitan sets FSDP's gradient divide factor to 1, i.e. PREMUL_SUM, which gloo lacks."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


def init_like_one_rank(model: torch.nn.Module, model_config, seed: int) -> None:
    """DTensor's RNG tracker is CUDA-only, so initializing sharded parameters on CPU would give
    different weights for every layout. Every rank initializes the unsharded model from the
    seed (CPU runs are small), as the GPU path initializes its part (titan.initial_weights.init_weights: each
    block from its own stream), and keeps its own shard of each parameter."""
    # private_api: torch_checkpoint_prefix
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
    from torch.distributed.tensor import DTensor, distribute_tensor

    from runner.run.titan.initial_weights import init_weights

    with torch.device("cpu"):
        ref = model_config.build()
    init_weights(ref, seed)
    with torch.no_grad():
        full = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            src = full[name.replace(_CHECKPOINT_PREFIX, "")]  # activation checkpointing wraps blocks
            if isinstance(p, DTensor):
                src = distribute_tensor(src, p.device_mesh, p.placements)
            p.copy_(src)


def float8_converter(config):
    """TorchTitan's Float8LinearConverter refuses anything below NVIDIA SM 8.9, but torch 2.13 has a
    CPU torch._scaled_mm, so its torchao Float8Linear runs real FP8 matmuls here: same converter,
    minus the capability check (its __init__ without the raise)."""
    from functools import partial

    from torchao.float8 import Float8LinearConfig
    from torchtitan.components.quantization.float8 import Float8LinearConverter
    from torchtitan.components.quantization.utils import module_filter_fn

    class CpuFloat8LinearConverter(Float8LinearConverter):
        def __init__(self, config):
            self.config = config
            self.torchao_config = Float8LinearConfig.from_recipe_name(config.recipe_name)
            self.filter_fn = partial(module_filter_fn, filter_fqns=config.filter_fqns)
            self.enabled = True

    return CpuFloat8LinearConverter(config)


def emulated_blockwise_linear_config():
    """torchao's blockwise FP8 kernels are Triton-only: a TorchTitan Linear whose matmul is the
    PyTorch-op emulation in runner/run/titan/fp8_emulation.py (same tiles, blocks, scales and casts)."""
    global _EmulatedBlockwiseLinear
    if _EmulatedBlockwiseLinear is None:
        from dataclasses import dataclass

        from torchtitan.models.common.linear import Linear

        from runner.run.titan.fp8_emulation import blockwise_fp8_linear

        class EmulatedBlockwiseFp8Linear(Linear):
            @dataclass(kw_only=True, slots=True)
            class Config(Linear.Config):
                pass

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                out = blockwise_fp8_linear(x, self.weight)
                return out if self.bias is None else out + self.bias

        _EmulatedBlockwiseLinear = EmulatedBlockwiseFp8Linear
    return _EmulatedBlockwiseLinear.Config


_EmulatedBlockwiseLinear = None


def enable_ring_attention() -> None:
    """torch's CP dispatcher maps only the CUDA SDPA kernels to ring attention, and CPU SDPA lowers to
    aten._scaled_dot_product_flash_attention_for_cpu, which has no sharding strategy ("NotImplementedError:
    Operator ... does not have a sharding strategy registered"). Register that op and its backward with
    handlers that call torch's own ring-attention code (_templated_ring_attention and its backward).
    Call before TorchTitan's apply_cp_to_forward (inside parallelize), which turns the dispatcher on."""
    # private_api: torch_ring_attention, torch_ring_attention_backward, torch_sdpa_flash_cpu, torch_sdpa_flash_cpu_backward
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel import _attention as cpa

    aten = torch.ops.aten
    fwd_op = aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd_op = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    seq = 2  # SDPA layout (batch, heads, seq, head_dim)

    def local(x, mesh):
        if tuple(x.placements) != (Shard(seq),):
            x = x.redistribute(mesh, [Shard(seq)])
        return x.to_local()

    def wrap(t, mesh):
        return DTensor.from_local(t, mesh, [Shard(seq)], run_check=False)

    def forward(op_call, args, kwargs):
        q, k, v = args[:3]
        dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
        is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
        if kwargs.get("attn_mask") is not None:
            raise NotImplementedError("CPU ring attention takes is_causal, not an attention mask")
        mesh = q.device_mesh
        out, lse = cpa._templated_ring_attention(
            mesh.get_group(), seq, fwd_op, local(q, mesh), local(k, mesh), local(v, mesh),
            is_causal=is_causal, dropout_p=dropout_p, scale=kwargs.get("scale"),
        )  # fmt: skip
        return wrap(out, mesh), wrap(lse, mesh)

    def backward(op_call, args, kwargs):
        names = ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal")
        a = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
        mesh = a["query"].device_mesh
        t = {n: local(a[n], mesh) for n in names[:6]}
        grads = cpa._templated_ring_attention_backward(
            mesh.get_group(), seq, bwd_op, grad_out=t["grad_out"], grad_out_name="grad_out",
            query=t["query"], key=t["key"], value=t["value"], out=t["out"], logsumexp=t["logsumexp"],
            is_causal=a["is_causal"], dropout_p=a["dropout_p"], scale=kwargs.get("scale"),
        )  # fmt: skip
        return tuple(wrap(g, mesh) for g in grads[:3])

    cpa.custom_ops[fwd_op] = forward
    cpa.custom_ops[bwd_op] = backward


def _cpu_grouped_experts():
    """TorchTitan's GroupedExperts with one float32 matmul per expert (use_float32_experts says why)."""
    global _CpuGroupedExperts
    if _CpuGroupedExperts is None:
        from dataclasses import dataclass

        import torch.nn.functional as F
        from torch.distributed.tensor import DTensor
        from torchtitan.models.common.moe import GroupedExperts

        class CpuGroupedExperts(GroupedExperts):
            @dataclass(kw_only=True, slots=True)
            class Config(GroupedExperts.Config):
                pass

            def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
                w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
                counts = num_tokens_per_expert_E.tolist()
                rest = x_RD.shape[0] - sum(counts)  # rows past the last group (padding): zero, as no expert reads them
                outs, mm = [], self._expert_mm
                for e, x in enumerate(torch.split(x_RD, [*counts, rest])[: len(counts)]):
                    outs.append(mm(F.silu(mm(x, w1[e])) * mm(x, w3[e]), w2[e]))
                return torch.cat([*outs, x_RD.new_zeros(rest, x_RD.shape[1])])

            def _expert_mm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                """x @ w.T for one expert's tokens (w as TorchTitan stores it: out x in)."""
                return x @ w.T

        _CpuGroupedExperts = CpuGroupedExperts
    return _CpuGroupedExperts


_CpuGroupedExperts = None
_CpuFp8GroupedExperts = None


def _cpu_fp8_grouped_experts():
    """The float32 CPU experts whose matmuls run the float8 rowwise emulation (runner/run/titan/fp8_emulation.py)."""
    global _CpuFp8GroupedExperts
    if _CpuFp8GroupedExperts is None:
        from dataclasses import dataclass

        from runner.run.titan.fp8_emulation import RowwiseFp8ExpertMatmul

        base = _cpu_grouped_experts()

        class EmulatedFp8RowwiseGroupedExperts(base):
            @dataclass(kw_only=True, slots=True)
            class Config(base.Config):
                pass

            def _expert_mm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                return RowwiseFp8ExpertMatmul.apply(x, w)

        _CpuFp8GroupedExperts = EmulatedFp8RowwiseGroupedExperts
    return _CpuFp8GroupedExperts


def _swap_experts(model_config, cls) -> list[str]:
    """Swap TorchTitan's plain GroupedExperts configs for `cls`'s, same parameters; return the swapped FQNs. gpt-oss's
    biased experts (a GroupedExperts subclass) are not trained on CPU (family_support) and stay."""
    from torchtitan.models.common.moe import GroupedExperts

    swapped = []
    for fqn, old, parent, attr in list(model_config.traverse(GroupedExperts.Config)):
        if type(old) is not GroupedExperts.Config:
            continue
        new = cls.Config(dim=old.dim, hidden_dim=old.hidden_dim, num_experts=old.num_experts, param_init=old.param_init)
        if isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
        swapped.append(fqn)
    return swapped


def use_float32_experts(model_config) -> None:
    """TorchTitan's experts cast to bfloat16 for torch._grouped_mm; CPU _grouped_mm is slow in any dtype, and
    on AVX2-only CPUs bf16 GEMMs are ~200x slower than fp32 (docs/CPU.md): swap in experts with the same
    parameters that run one float32 matmul per expert, as every other CPU matmul here does."""
    _swap_experts(model_config, _cpu_grouped_experts())


def emulated_fp8_experts(model_config) -> list[str]:
    """precision.experts=fp8_rowwise on CPU: torchao's scaled grouped GEMM is CUDA-only (Triton scaling kernels,
    torch._scaled_grouped_mm), so the float32 CPU experts run each expert's GEMMs through the float8 rowwise emulation
    (runner/run/titan/fp8_emulation.py: torchao's scales, real e4m3 casts); return the converted experts' FQNs."""
    return _swap_experts(model_config, _cpu_fp8_grouped_experts())
