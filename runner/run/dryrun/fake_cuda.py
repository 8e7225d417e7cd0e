"""Fake CUDA for the CUDA rehearsal (mode=dryrun dryrun.device=cuda): a CUDA build of torch, no GPU, no driver.

Every patch of torch internals the rehearsal needs is here, in PATCHES, each with the version it was written for and
why; tests/test_cuda_rehearsal.py::test_patched_names_exist fails in one place, naming the patch, when an upgrade
moves a name. The C side (c10::cuda::device_count, the device properties, a libcuda.so.1 with the one driver call the
autograd engine makes) is runner/run/dryrun/shim/, built by `scripts/setup.sh --cuda-rehearsal` into
.venv-cuda/fake_cuda/ and loaded with LD_PRELOAD when the process starts (runner.run.dryrun.cuda_env).

What it fakes is the device, never the runner: the runner's CUDA branches (runner.run.device.DevicePolicy with
device=cuda), TorchTitan's parallelize and FSDP2/TP/PP run as on a GPU, on FakeTensorMode "cuda" tensors.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections import namedtuple
from dataclasses import dataclass
from typing import Any

from runner.run.dryrun import cuda_env

TORCH = "torch 2.13.0"
STATE_BYTES = 16
"""Size of a CUDA generator's state (Philox seed and offset), what torch.cuda.get_rng_state returns."""


@dataclass(frozen=True)
class Patch:
    module: str
    attr: str
    """Attribute path inside the module (Class.attr for a class attribute)."""
    version: str
    why: str


# private_api: torch_pin_memory_utils_pin, torch_pin_memory_utils_unpin, torch_fake_avoid_device_init, torch_device_mesh_concatenate
# private_api: torch_dtensor_first_shard_size, torch_flex_disable_compile_debug, torch_cp_compiled_create_block_mask
PATCHES: tuple[Patch, ...] = (
    Patch("torch.cuda", "is_available", TORCH, "the runner's and torch's CUDA-only Python branches (FSDP2, autocast) need True"),
    Patch("torch.cuda", "device_count", TORCH, "devices per node of the rehearsed cluster"),
    Patch("torch.cuda", "current_device", TORCH, "FSDP2's lazy init asks it; the driver would say 'Found no NVIDIA driver'"),
    Patch("torch.cuda", "set_device", TORCH, "DevicePolicy.start_group's set_device: recorded, nothing to select"),
    Patch("torch.cuda", "get_device_capability", TORCH, "FP8 checks (torchao, the runner) read the cluster's compute capability"),
    Patch("torch.cuda", "get_device_properties", TORCH, "the rehearsed GPU's name, capability and memory"),
    Patch("torch.cuda", "get_device_name", TORCH, "as get_device_properties"),
    Patch("torch.cuda", "is_bf16_supported", TORCH, "True on the GPUs the runner targets; False without a driver"),
    Patch("torch.cuda", "mem_get_info", TORCH, "free and total memory of the rehearsed GPU"),
    Patch("torch.cuda", "max_memory_allocated", TORCH, "no allocator here: the ledger measures memory (DevicePolicy.max_memory_gb)"),
    Patch("torch.cuda", "Stream", TORCH, "FSDP2 and the DCP stager make side streams: Python stand-ins"),
    Patch("torch", "Stream", TORCH, "DCP's DefaultStager makes its staging stream with torch.Stream(): the stand-in stream"),
    Patch("torch.cuda", "Event", TORCH, "CUDA events (DevicePolicy's clocks, FSDP2): stand-ins whose synchronize counts a host sync"),
    Patch("torch.cuda", "current_stream", TORCH, "the stand-in stream"),
    Patch("torch.cuda", "default_stream", TORCH, "the stand-in stream"),
    Patch("torch.cuda", "stream", TORCH, "a no-op stream context"),
    Patch("torch.cuda", "synchronize", TORCH, "counted as a host synchronization (DevicePolicy.sync)"),
    Patch("torch.cuda", "set_sync_debug_mode", TORCH, "DevicePolicy.count_syncs turns it on; the rehearsal counts syncs itself"),
    Patch("torch.cuda", "get_rng_state", TORCH, f"the device generator's state, {STATE_BYTES} bytes as a GPU's (DevicePolicy.rng_state)"),
    Patch("torch.cuda", "set_rng_state", TORCH, "recorded; no generator to set"),
    Patch("torch.cuda", "get_rng_state_all", TORCH, "dynamo and checkpointing save every device's generator"),
    Patch("torch.cuda", "set_rng_state_all", TORCH, "as set_rng_state"),
    Patch("torch.cuda", "manual_seed", TORCH, "torch.manual_seed seeds CUDA too, which needs the driver"),
    Patch("torch.cuda", "manual_seed_all", TORCH, "as manual_seed"),
    Patch(
        "torch.cuda._pin_memory_utils",
        "pin_memory",
        TORCH,
        "DCP's stager registers its host buffers (cudaHostRegister): recorded in PINNED_BYTES",
    ),
    Patch("torch.cuda._pin_memory_utils", "unpin_memory", TORCH, "its finalizer unregisters them: nothing to do"),
    Patch("torch.Tensor", "pin_memory", TORCH, "pinned host memory needs the driver: the tensor is kept and remembered as pinned"),
    Patch("torch.Tensor", "is_pinned", TORCH, "True for what pin_memory remembered"),
    Patch(
        "torch._subclasses.fake_tensor",
        "FakeTensorMode.avoid_device_init",
        TORCH,
        "FakeTensorMode decides from CUDA being available whether to install its no-op CUDA guard; it must stay True",
    ),
    Patch(
        "torch.distributed.device_mesh",
        "DeviceMesh._concatenate",
        TORCH,
        "FSDP2 over a TP mesh concatenates meshes with nonzero/tolist, which fake tensors refuse (DynamicOutputShapeException); "
        "run outside the fake mode, as torch already does for _create_sub_mesh",
    ),
    Patch(
        "torch.distributed.tensor._random",
        "_calc_first_shard_size",
        TORCH,
        "DTensor's random init on a _StridedShard (FSDP + TP) computes a shard size from tensor values "
        "(DataDependentOutputException under fake tensors): run outside the fake mode",
    ),
    Patch(
        "torch.nn.init",
        "trunc_normal_",
        TORCH,
        "rejection sampling with .item() in a loop (data-dependent under fake tensors): normal_ then clamp_; values do not matter "
        "here (on a DTensor over torchao's float8 expert weights, of its shard: DTensor's RNG HOP has no rule for that subclass)",
    ),
    Patch(
        "torch.distributed.tensor.experimental._context_parallel._attention",
        "_compiled_create_block_mask",
        TORCH,
        "context parallelism shards FlexAttention's block masks with a torch.compile'd create_block_mask (fullgraph), which "
        "cannot compile here: the eager one, set before its first use",
    ),
    Patch(
        "torch.nn.attention.flex_attention",
        "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG",
        TORCH,
        "eager flex_attention still goes through torch.compile(backend='eager'), and dynamo asks the real CUDA stream: "
        "call the higher-order op directly (TorchTitan's compiled flex is swapped for eager by runner.run.titan.cpu.eager_flex_attention)",
    ),
)
"""Every patch, applied by `install` (for the process: the rehearsal process does nothing else)."""


Props = namedtuple("Props", "name major minor total_memory multi_processor_count L2_cache_size warp_size is_integrated uuid gcnArchName")


class FakeEvent:
    """torch.cuda.Event without a device: recording is free, waiting for one is a host synchronization."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        SYNCS.note(EVENT_WAIT)

    def elapsed_time(self, other: Any) -> float:
        return 1.0  # ms; no kernel runs, and a span of zero would be no span (the monitor divides by a pipeline's)


class FakeStream:
    """torch.cuda.Stream without a device."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        import torch

        self.device, self.priority = torch.device("cuda", 0), priority

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> FakeEvent:
        return event or FakeEvent()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        SYNCS.note("torch.cuda.Stream.synchronize")

    def __enter__(self) -> FakeStream:
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False


class _Syncs:
    """Host synchronizations with the (fake) device in order, by what caused them: the stand-ins' synchronize calls
    here, and the copies and scalar reads runner.run.dryrun.step_probe sees on fake CUDA tensors."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def note(self, what: str) -> None:
        self.events.append(what)


SYNCS = _Syncs()
EVENT_WAIT = "torch.cuda.Event.synchronize"
PINNED: set[int] = set()
"""The storages (by id) Tensor.pin_memory was asked to pin: is_pinned answers from it."""
PINNED_BYTES: list[int] = []
"""Host buffers registered as pinned (cudaHostRegister, as DCP's stager does), in bytes."""
RECORDED: dict[str, Any] = {}
"""What the patched setters were asked (set_device, set_sync_debug_mode, set_rng_state)."""


def _replacements(capability: tuple[int, int], memory_gb: float, name: str, devices: int) -> dict[tuple[str, str], Any]:
    import torch

    props = Props(name, capability[0], capability[1], int(memory_gb * 1e9), 132, 50 << 20, 32, 0, "fake", "")
    stream = FakeStream()
    state = lambda device="cuda": torch.zeros(STATE_BYTES, dtype=torch.uint8)  # noqa: E731
    pin, is_pinned = torch.Tensor.pin_memory, torch.Tensor.is_pinned

    def pin_memory(self, *args: Any, **kwargs: Any):
        if self.device.type != "cpu":
            return pin(self, *args, **kwargs)  # torch raises as it would
        PINNED.add(id(self.untyped_storage()))
        return self

    def pinned(self, *args: Any, **kwargs: Any) -> bool:
        return self.device.type == "cpu" and id(self.untyped_storage()) in PINNED or is_pinned(self, *args, **kwargs)

    def trunc_normal_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
        # private_api: torch_fake_tensor
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            local = tensor.to_local() if isinstance(tensor, DTensor) else None
            if local is not None and type(local) not in (torch.Tensor, FakeTensor):
                # a DTensor over a wrapper subclass (torchao's float8 MoE expert weights): under fake mode DTensor's random
                # ops take the RNG HOP run_dtensor_rng_op (_are_we_tracing: a fake mode is tracing), which has no rule
                # for the subclass; a GPU's eager run takes the subclass branch (_distribute_region). Fill the shard.
                local.normal_(mean, std, generator=generator).clamp_(min=a, max=b)
                return tensor
            return tensor.normal_(mean, std, generator=generator).clamp_(min=a, max=b)

    def synchronize(device: Any = None) -> None:
        SYNCS.note("torch.cuda.synchronize")

    from torch.nn.attention.flex_attention import create_block_mask

    # private_api: torch_pin_memory_utils_pin, torch_pin_memory_utils_unpin, torch_fake_avoid_device_init, torch_device_mesh_concatenate
    # private_api: torch_dtensor_first_shard_size, torch_flex_disable_compile_debug, torch_cp_compiled_create_block_mask
    return {
        ("torch.cuda", "is_available"): lambda: True,
        ("torch.cuda", "device_count"): lambda: devices,
        ("torch.cuda", "current_device"): lambda: int(os.environ.get("LOCAL_RANK", 0)),
        ("torch.cuda", "set_device"): lambda device: RECORDED.__setitem__("set_device", str(device)),
        ("torch.cuda", "get_device_capability"): lambda device=None: capability,
        ("torch.cuda", "get_device_properties"): lambda device=None: props,
        ("torch.cuda", "get_device_name"): lambda device=None: name,
        ("torch.cuda", "is_bf16_supported"): lambda including_emulation=True: True,
        ("torch.cuda", "mem_get_info"): lambda device=None: (props.total_memory, props.total_memory),
        ("torch.cuda", "max_memory_allocated"): lambda device=None: 0,
        ("torch.cuda", "Stream"): FakeStream,
        ("torch", "Stream"): FakeStream,
        ("torch.cuda", "Event"): FakeEvent,
        ("torch.cuda", "current_stream"): lambda device=None: stream,
        ("torch.cuda", "default_stream"): lambda device=None: stream,
        ("torch.cuda", "stream"): lambda s=None: contextlib.nullcontext(s),
        ("torch.cuda", "synchronize"): synchronize,
        ("torch.cuda", "set_sync_debug_mode"): lambda mode: RECORDED.__setitem__("sync_debug_mode", mode),
        ("torch.cuda", "get_rng_state"): state,
        ("torch.cuda", "set_rng_state"): lambda new_state, device="cuda": RECORDED.__setitem__("set_rng_state", tuple(new_state.shape)),
        ("torch.cuda", "get_rng_state_all"): lambda: [state() for _ in range(devices)],
        ("torch.cuda", "set_rng_state_all"): lambda states: None,
        ("torch.cuda", "manual_seed"): lambda seed: None,
        ("torch.cuda", "manual_seed_all"): lambda seed: None,
        ("torch.cuda._pin_memory_utils", "pin_memory"): lambda data_ptr, size: PINNED_BYTES.append(size),
        ("torch.cuda._pin_memory_utils", "unpin_memory"): lambda data_ptr: None,
        ("torch.Tensor", "pin_memory"): pin_memory,
        ("torch.Tensor", "is_pinned"): pinned,
        ("torch._subclasses.fake_tensor", "FakeTensorMode.avoid_device_init"): property(lambda self: True),
        ("torch.distributed.device_mesh", "DeviceMesh._concatenate"): None,  # wrapped in install
        ("torch.distributed.tensor._random", "_calc_first_shard_size"): None,  # wrapped in install
        ("torch.nn.init", "trunc_normal_"): trunc_normal_,
        ("torch.distributed.tensor.experimental._context_parallel._attention", "_compiled_create_block_mask"): create_block_mask,
        ("torch.nn.attention.flex_attention", "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG"): True,
    }


def _owner(patch: Patch):
    import importlib

    obj = importlib.import_module(patch.module) if patch.module != "torch.Tensor" else __import__("torch").Tensor
    *path, last = patch.attr.split(".")
    for p in path:
        obj = getattr(obj, p)
    return obj, last


def missing() -> list[str]:
    """The patches whose name no longer exists (written for TORCH), one line each: what the upgrade broke."""
    out = []
    for p in PATCHES:
        try:
            obj, last = _owner(p)
        except (ImportError, AttributeError) as e:
            out.append(f"{p.module}.{p.attr} ({p.version}): {e}; it was patched because {p.why}")
            continue
        if not hasattr(obj, last):
            out.append(f"{p.module}.{p.attr} ({p.version}): gone; it was patched because {p.why}")
    return out


def _outside_fake(fn):
    # private_api: torch_unset_fake_temporarily
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def wrapped(*args: Any, **kwargs: Any):
        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    return wrapped


_INSTALLED: dict[str, Any] = {}


def install(capability: str, memory_gb: float, name: str, devices: int) -> None:
    """Apply every patch of PATCHES, for this process (a rehearsal process only). Before TorchTitan is imported:
    it binds nn.init.trunc_normal_ in partials at import."""
    if _INSTALLED:
        return
    if not cuda_env.shim_loaded():
        raise RuntimeError("the fake-CUDA shim is not preloaded (LD_PRELOAD): start this process through runner.run.dryrun.cuda_env.launch")
    gone = missing()
    if gone:
        raise RuntimeError("the CUDA rehearsal's patches do not apply to this torch:\n" + "\n".join(gone))
    major, _, minor = capability.partition(".")
    new = _replacements((int(major), int(minor or 0)), memory_gb, name, devices)
    for p in PATCHES:
        obj, last = _owner(p)
        value = new[(p.module, p.attr)]
        if value is None:
            orig = getattr(obj, last)
            value = staticmethod(_outside_fake(orig)) if isinstance(obj, type) else _outside_fake(orig)
        _INSTALLED[f"{p.module}.{p.attr}"] = getattr(obj, last)
        setattr(obj, last, value)


def devices_on(n: int = 127) -> None:
    """After FakeTensorMode's no-op CUDA guard is in place (it needs device_count() == 0), let the shim report n
    devices, so the autograd engine's hasPrimaryContext(index) passes its index check."""
    import torch

    # private_api: torch_ensure_cuda_device_guard
    torch._C._ensureCUDADeviceGuardSet()
    lib = ctypes.CDLL(None)
    lib.fake_cuda_set_device_count(n)
