"""Fake CUDA for the CUDA rehearsal (mode=dryrun dryrun.device=cuda): a CUDA build of torch, no GPU, no driver.

Every patch of torch the rehearsal needs is an entry of runner.run.private_api's register (FAKE_DEVICE: the version
it was written for and why); tests/test_private_api.py resolves each against the installed torch in the main suite and
fails, naming the entry, when an upgrade moves a name. What each becomes is `_replacements`, by entry name. The C
side (c10::cuda::device_count, the device properties, a libcuda.so.1 with the one driver call the autograd engine
makes) is runner/run/dryrun/shim/, built by `scripts/setup.sh --cuda-rehearsal` into
.venv-cuda/fake_cuda/ and loaded with LD_PRELOAD when the process starts (runner.run.dryrun.cuda_env).

What it fakes is the device, never the runner: the runner's CUDA branches (runner.run.device.DevicePolicy with
device=cuda), TorchTitan's parallelize and FSDP2/TP/PP run as on a GPU, on FakeTensorMode "cuda" tensors.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections import namedtuple
from typing import Any

from runner.run import private_api
from runner.run.dryrun import cuda_env

STATE_BYTES = 16
"""Size of a CUDA generator's state (Philox seed and offset), what torch.cuda.get_rng_state returns."""


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


def _replacements(capability: tuple[int, int], memory_gb: float, name: str, devices: int) -> dict[str, Any]:
    """What each patch of the register's FAKE_DEVICE entries (runner.run.private_api) becomes, by entry name; None: the
    original, run outside the fake mode (install)."""
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
        with torch.no_grad():
            return _fill_normal(tensor, mean, std, a, b, generator)

    def synchronize(device: Any = None) -> None:
        SYNCS.note("torch.cuda.synchronize")

    from torch.nn.attention.flex_attention import create_block_mask

    # private_api: torch_cuda_is_available, torch_cuda_device_count, torch_cuda_current_device, torch_cuda_set_device
    # private_api: torch_cuda_get_device_capability, torch_cuda_get_device_properties, torch_cuda_get_device_name
    # private_api: torch_cuda_is_bf16_supported, torch_cuda_mem_get_info, torch_cuda_max_memory_allocated, torch_cuda_Stream
    # private_api: torch_Stream, torch_cuda_Event, torch_cuda_current_stream, torch_cuda_default_stream, torch_cuda_stream
    # private_api: torch_cuda_synchronize, torch_cuda_set_sync_debug_mode, torch_cuda_get_rng_state, torch_cuda_set_rng_state
    # private_api: torch_cuda_get_rng_state_all, torch_cuda_set_rng_state_all, torch_cuda_manual_seed, torch_cuda_manual_seed_all
    # private_api: torch_pin_memory_utils_pin, torch_pin_memory_utils_unpin, torch_tensor_pin_memory, torch_tensor_is_pinned
    # private_api: torch_fake_avoid_device_init, torch_device_mesh_concatenate, torch_dtensor_first_shard_size
    # private_api: torch_nn_init_trunc_normal, torch_cp_compiled_create_block_mask, torch_flex_disable_compile_debug
    return {
        "torch_cuda_is_available": lambda: True,
        "torch_cuda_device_count": lambda: devices,
        "torch_cuda_current_device": lambda: int(os.environ.get("LOCAL_RANK", 0)),
        "torch_cuda_set_device": lambda device: RECORDED.__setitem__("set_device", str(device)),
        "torch_cuda_get_device_capability": lambda device=None: capability,
        "torch_cuda_get_device_properties": lambda device=None: props,
        "torch_cuda_get_device_name": lambda device=None: name,
        "torch_cuda_is_bf16_supported": lambda including_emulation=True: True,
        "torch_cuda_mem_get_info": lambda device=None: (props.total_memory, props.total_memory),
        "torch_cuda_max_memory_allocated": lambda device=None: 0,
        "torch_cuda_Stream": FakeStream,
        "torch_Stream": FakeStream,
        "torch_cuda_Event": FakeEvent,
        "torch_cuda_current_stream": lambda device=None: stream,
        "torch_cuda_default_stream": lambda device=None: stream,
        "torch_cuda_stream": lambda s=None: contextlib.nullcontext(s),
        "torch_cuda_synchronize": synchronize,
        "torch_cuda_set_sync_debug_mode": lambda mode: RECORDED.__setitem__("sync_debug_mode", mode),
        "torch_cuda_get_rng_state": state,
        "torch_cuda_set_rng_state": lambda new_state, device="cuda": RECORDED.__setitem__("set_rng_state", tuple(new_state.shape)),
        "torch_cuda_get_rng_state_all": lambda: [state() for _ in range(devices)],
        "torch_cuda_set_rng_state_all": lambda states: None,
        "torch_cuda_manual_seed": lambda seed: None,
        "torch_cuda_manual_seed_all": lambda seed: None,
        "torch_pin_memory_utils_pin": lambda data_ptr, size: PINNED_BYTES.append(size),
        "torch_pin_memory_utils_unpin": lambda data_ptr: None,
        "torch_tensor_pin_memory": pin_memory,
        "torch_tensor_is_pinned": pinned,
        "torch_fake_avoid_device_init": property(lambda self: True),
        "torch_device_mesh_concatenate": None,  # wrapped in install
        "torch_dtensor_first_shard_size": None,  # wrapped in install
        "torch_nn_init_trunc_normal": trunc_normal_,
        "torch_cp_compiled_create_block_mask": create_block_mask,
        "torch_flex_disable_compile_debug": True,
    }


def _owner(p: private_api.Private):
    """The object that holds the patched name, and the name."""
    import importlib

    obj = importlib.import_module(p.module)
    *path, last = p.attr.split(".")
    for part in path:
        obj = getattr(obj, part)
    return obj, last


def _outside_fake(fn):
    # private_api: torch_unset_fake_temporarily
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def wrapped(*args: Any, **kwargs: Any):
        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    return wrapped


_INSTALLED: dict[str, Any] = {}


def install(capability: str, memory_gb: float, name: str, devices: int) -> None:
    """Apply every patch of the fake device (runner.run.private_api's FAKE_DEVICE entries; tests/test_private_api.py
    resolves each against the installed torch), for this process (a rehearsal process only). Before TorchTitan is
    imported: it binds nn.init.trunc_normal_ in partials at import."""
    if _INSTALLED:
        return
    if not cuda_env.shim_loaded():
        raise RuntimeError("the fake-CUDA shim is not preloaded (LD_PRELOAD): start this process through runner.run.dryrun.cuda_env.launch")
    major, _, minor = capability.partition(".")
    new = _replacements((int(major), int(minor or 0)), memory_gb, name, devices)
    for p in private_api.at(private_api.FAKE_DEVICE):
        obj, last = _owner(p)
        value = new[p.name]
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


def _fill_normal(tensor: Any, mean: float, std: float, a: float, b: float, generator: Any) -> Any:
    """trunc_normal_'s stand-in: normal_ then clamp_ (values do not matter in a rehearsal)."""
    import torch

    # private_api: torch_fake_tensor
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else None
    if local is not None and type(local) not in (torch.Tensor, FakeTensor):
        # a DTensor over a wrapper subclass (torchao's float8 MoE expert weights): under fake mode DTensor's random
        # ops take the RNG HOP run_dtensor_rng_op (_are_we_tracing: a fake mode is tracing), which has no rule
        # for the subclass; a GPU's eager run takes the subclass branch (_distribute_region). Fill the shard.
        local.normal_(mean, std, generator=generator).clamp_(min=a, max=b)
        return tensor
    return tensor.normal_(mean, std, generator=generator).clamp_(min=a, max=b)
