"""The CUDA rehearsal's probe of one step (runner.run.dryrun.cuda_rehearse): the host synchronizations a GPU would make,
the attention kernels dispatched, the dtypes of matmuls and reductions, on fake CUDA tensors.

Synchronizations are device-to-host copies and scalar reads of CUDA tensors, blocking host-to-device copies (torch's
copy is cudaMemcpyAsync then a stream synchronize), torch.cuda.synchronize and CUDA events waited for before the step's
read (runner.run.dryrun.fake_cuda's stand-ins note those): what torch's sync debug mode reports on a GPU, and the events
it does not. A read returns zeros: fake tensors hold no value.
"""

from __future__ import annotations

from typing import Any

# private_api: torch_dispatch_mode
from torch.utils._python_dispatch import TorchDispatchMode

from runner.run.dryrun import fake_cuda

# private_api: torch_aten_local_scalar_dense
SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "is_nonzero")
"""Ops that wait for the device on a GPU (their result is a host value or a data-dependent shape)."""
# private_api: torch_aten_scaled_mm, torch_aten_grouped_mm, torch_aten_scaled_grouped_mm
# torchao's blockwise FP8 GEMMs are custom ops (torchao::triton_fp8_gemm_*, torchao::blockwise_scaled_mm): matched by name
MATMULS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm", "_scaled_grouped_mm")
# private_api: torch_c10d_reduce_scatter_base
REDUCTIONS = ("_reduce_scatter_base_", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced_", "all_reduce", "allreduce_")


class StepProbe(TorchDispatchMode):
    """Host synchronizations and attention kernels of the fake CUDA step. A device-to-host copy or scalar read is a
    synchronization on a GPU; here it returns zeros (the step's read of loss and grad norm has no value to read)."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.attention: dict[str, int] = {}
        self.matmul_dtypes: set[str] = set()
        self.matmul_ops: set[str] = set()
        self.reduce_dtypes: set[str] = set()
        self.pageable_copies = 0
        self._read = None  # the storage of the last scalar read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import torch

        # private_api: torch_fake_tensor, torch_aten_to_copy, torch_unset_fake_temporarily
        from torch._subclasses.fake_tensor import FakeTensor

        if any(t not in (torch.Tensor, FakeTensor) and issubclass(t, torch.Tensor) for t in types):
            return NotImplemented  # DTensor, torchao's float8 tensors: see the plain ops they desugar to
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func)).split(".")[0]
        if "attention" in name:
            self.attention[name] = self.attention.get(name, 0) + 1
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        on_cuda = first is not None and first.device.type == "cuda"
        if first is not None and first.device.type == "cuda" and (name in MATMULS or "gemm" in name or name.endswith("scaled_mm")):
            self.matmul_dtypes.add(str(first.dtype).removeprefix("torch."))
            self.matmul_ops.add(f"{name}:{str(first.dtype).removeprefix('torch.')}:{tuple(first.shape)}")
        if first is not None and name in REDUCTIONS and first.dim() > 0 and first.numel() > 1:
            self.reduce_dtypes.add(str(first.dtype).removeprefix("torch."))
        if not on_cuda and name == "_local_scalar_dense" and first is not None:
            return False if first.dtype == torch.bool else 0 if not first.is_floating_point() else 0.0  # a host value: no sync
        if on_cuda and name in SYNC_OPS:
            if name == "_local_scalar_dense":
                # FakeTensor.tolist reads element by element; a GPU's tolist copies the tensor once: one read per storage
                st = first.untyped_storage()
                if st is not self._read:
                    fake_cuda.SYNCS.note("scalar read (item/tolist)")
                self._read = st
                return False if first.dtype == torch.bool else 0 if not first.is_floating_point() else 0.0
            fake_cuda.SYNCS.note(name)
        if name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
            dst, src = first, args[1]
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if src.device.type == "cuda" and dst.device.type == "cpu" and (blocking or not dst.is_pinned()):
                fake_cuda.SYNCS.note("device-to-host copy_")
            elif src.device.type == "cpu" and dst.device.type == "cuda" and blocking:
                fake_cuda.SYNCS.note("host-to-device copy (blocking)")
        if name == "_to_copy" and first is not None:
            to = kwargs.get("device")
            if on_cuda and to is not None and torch.device(to).type == "cpu":
                fake_cuda.SYNCS.note("device-to-host copy")
                # private_api: torch_unset_fake_temporarily
                from torch._subclasses.fake_tensor import unset_fake_temporarily

                with unset_fake_temporarily():
                    return torch.zeros(first.shape, dtype=kwargs.get("dtype") or first.dtype)
            if first.device.type == "cpu" and to is not None and torch.device(to).type == "cuda":
                if not kwargs.get("non_blocking"):
                    # a blocking host-to-device copy: cudaMemcpyAsync then cudaStreamSynchronize (c10::cuda::memcpy_and_sync),
                    # so the host waits for every kernel queued before it; torch's sync debug mode counts it
                    fake_cuda.SYNCS.note("host-to-device copy (blocking)")
                elif not first.is_pinned():
                    self.pageable_copies += 1  # from pageable memory: synchronous whatever non_blocking says
        return func(*args, **kwargs)

    def take(self) -> dict[str, Any]:
        events = fake_cuda.SYNCS.events
        first_read = next((i for i, e in enumerate(events) if e != fake_cuda.EVENT_WAIT), len(events))
        # an event waited for after the step's first read has completed on a GPU (the read waited for every kernel
        # queued before it): it reads a timing, it does not stall; one waited for before the read does
        out = {
            "syncs": [e for i, e in enumerate(events) if e != fake_cuda.EVENT_WAIT or i < first_read],
            "completed_event_reads": sum(1 for i, e in enumerate(events) if e == fake_cuda.EVENT_WAIT and i > first_read),
            "attention": dict(self.attention),
            "matmul_dtypes": sorted(self.matmul_dtypes),
            "matmul_ops": sorted(self.matmul_ops),
            "reduce_dtypes": sorted(self.reduce_dtypes),
            "pageable_copies": self.pageable_copies,
        }
        self.attention, self.pageable_copies, self._read = {}, 0, None
        self.matmul_dtypes, self.matmul_ops, self.reduce_dtypes = set(), set(), set()
        fake_cuda.SYNCS.events.clear()
        return out
