"""What the CUDA tier holds the GPU path to, read off a rehearsed rank (runner.run.dryrun.cuda_rehearse): where its state
lives and in which dtypes, its FP8 modules, the attention masks its model parts received, the checkpoint staging an
async save takes, the RNG state it saves."""

from __future__ import annotations

import weakref
from typing import Any

from runner.run.dryrun import fake_cuda
from runner.run.titan.step import pipeline_stages


def devices_and_dtypes(built, opt) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    params = [p for m in built.parts for p in m.parameters()]
    states = [v for o in opt for s in o.state.values() for v in s.values() if hasattr(v, "device") and v.dim() > 0]
    return {
        "param_devices": sorted({local(p).device.type for p in params}),
        "param_dtypes": sorted({str(local(p).dtype).removeprefix("torch.") for p in params}),
        "optimizer_state_devices": sorted({local(v).device.type for v in states}),
        "optimizer_state_dtypes": sorted({str(local(v).dtype).removeprefix("torch.") for v in states}),
        "num_optimizer_states": len(states),
    }


def grads(built) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    grads = [p.grad for m in built.parts for p in m.parameters() if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    return {
        "grad_devices": sorted({g.device.type for g in local}),
        "grad_dtypes": sorted({str(g.dtype).removeprefix("torch.") for g in local}),
    }


def fp8_modules(built) -> list[str]:
    return sorted(
        {
            type(m).__name__
            for part in built.parts
            for m in part.modules()
            if "Float8" in type(m).__name__ or "fp8" in type(m).__name__.lower()
        }
    )


def expert_modules(built) -> dict[str, int]:
    """The routed experts' module classes on this rank, counted: TorchTitan's GroupedExperts, or the class its
    grouped-experts converter made of it (Float8GroupedExperts, MXFP8GroupedExperts). Matched by the class's ancestry's
    names: only runner.run.titan imports TorchTitan."""
    out: dict[str, int] = {}
    for part in built.parts:
        for m in part.modules():
            if any(c.__name__ == "GroupedExperts" for c in type(m).__mro__):
                out[type(m).__name__] = out.get(type(m).__name__, 0) + 1
    return out


def staging(policy) -> dict[str, Any]:
    opts = policy.staging_options()
    return {
        "use_pinned_memory": opts.use_pinned_memory,
        "use_async_staging": opts.use_async_staging,
        "non_blocking": opts.use_non_blocking_copy,
    }


def staged(cfg, built, opt, policy) -> dict[str, Any]:
    """An async checkpoint's copy of the state, as runner.run.checkpointer takes it: the training state (titan.training_state,
    with every RNG as Checkpointer._extra keeps it) through DCP's DefaultStager with the policy's staging options. The
    write itself (DCP's writer on a gloo group of its own) is not rehearsed: fake tensors have no bytes to write."""
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager
    from torch.distributed.tensor import DTensor

    from runner.run import titan

    host, device = policy.rng_state()
    rank = torch.distributed.get_rank()
    extra = {"rng": {f"rank{rank}": host} | ({} if device is None else {f"rank{rank}_device": device})}
    fake_cuda.PINNED_BYTES.clear()
    stager = DefaultStager(policy.staging_options())
    got = stager.stage(titan.training_state(built.parts, opt, extra))
    staged = got.result() if hasattr(got, "result") else got
    stager.close()
    flat = []

    def walk(x):
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, torch.Tensor):
            flat.append(x.to_local() if isinstance(x, DTensor) else x)

    walk(staged)
    big = [t for t in flat if t.dim() > 0]
    return {
        "staged_tensors": len(big),
        "staged_devices": sorted({t.device.type for t in big}),
        "staged_bytes": sum(t.numel() * t.element_size() for t in big),
        "pinned_bytes": sum(fake_cuda.PINNED_BYTES),
        "rng_keys": sorted(staged["rng"]),
    }


def rng(policy) -> dict[str, Any]:
    host, device = policy.rng_state()
    return {"host_bytes": int(host.numel()), "device_bytes": None if device is None else int(device.numel())}


def masks_per_stage(built, captured: list[int]) -> dict[str, Any]:
    return {"stages": [getattr(s, "stage_index", 0) for s in pipeline_stages(built.schedule)], "forwards_with_masks": list(captured)}


def capture_masks(built) -> list[int]:
    """Count, per model part, the forwards that receive attention_masks (FlexAttention: every stage needs them)."""
    counts = [0] * len(built.parts)

    def hook(i):
        def pre(module, args, kwargs):
            if kwargs.get("attention_masks") is not None:
                counts[i] += 1

        return pre

    for i, part in enumerate(built.parts):
        part.register_forward_pre_hook(hook(i), with_kwargs=True)
    return counts


class MaskBuilds:
    """The bytes of each block mask the model part builds (its get_attention_masks, wrapped on the instance), until `take`."""

    def __init__(self, part):
        self.sizes: list[int] = []
        build = part.get_attention_masks

        def counted(*args, **kwargs):
            mask = build(*args, **kwargs)
            masks = mask.values() if isinstance(mask, dict) else [mask]
            for m in masks:
                self.sizes.append(sum(t.numel() * t.element_size() for t in m.as_tuple() if hasattr(t, "numel")))
            return mask

        part.get_attention_masks = counted

    def take(self) -> list[int]:
        out, self.sizes = self.sizes, []
        return out


def mask_builds(built) -> MaskBuilds:
    """Count the masks the step builds (runner.run.titan.step builds them through the first part's get_attention_masks)."""
    part = built.parts[0]
    if part not in _MASK_BUILDS:
        _MASK_BUILDS[part] = MaskBuilds(part)
    return _MASK_BUILDS[part]


_MASK_BUILDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Each model part's counter, installed once (a part outlives none of its steps)."""
