"""The device policy: every difference between a CPU rank and a CUDA rank, decided here once.

|                                   | CPU                                | CUDA                                         |
|-----------------------------------|------------------------------------|----------------------------------------------|
| compute device                    | cpu                                | cuda:<local rank>                            |
| process-group backend             | gloo                               | nccl                                         |
| host collectives (losses, hashes, | the default group                  | a gloo group of their own: NCCL rejects CPU  |
| monitor windows, calibration)     |                                    | tensors                                      |
| bandwidth probe                   | the default group, CPU tensors     | the default group, CUDA tensors              |
| phase clock                       | the process's CPU time             | CUDA events around the phase                 |
| step timeline (stages, waits)     | wall clock                         | CUDA events                                  |
| step-end arrival (stragglers)     | stamps at the step's one host      | the same, after the step's one read (the     |
|                                   | collective (runner.run.step_sync)  | device finished the step)                    |
| host synchronizations counted     | the policy's reads and syncs       | every synchronizing CUDA op (sync debug mode)|
| memory probe                      | peak resident set                  | peak allocated device memory                 |
| host batches (Prefetch)           | plain memory                       | pinned, so copies to the device are async    |
| threads per rank                  | cores / ranks on the machine       | torch's default                              |
| flight recorder                   | torch's; the runner dumps on hang  | NCCL's, which dumps by itself                |
| a peak FLOP/s figure counts       | the node (its ranks share cores)   | one GPU                                      |
| step time predicted, no profile   | only from a cached machine profile | the datasheet model (its constants are GPUs')|
| profiler activities               | CPU ops, with profile_memory       | CPU ops and CUDA kernels                     |
| allocator snapshots (profile.memory)| none: CUDA-only                  | torch.cuda.memory history, pickled snapshots |

`distributed.host_group=dedicated` gives CPU runs the CUDA arrangement of host collectives (their
own gloo group), which is how the test suite proves on CPU that no runner collective bypasses the
policy (runner.run.collective_audit). Nothing else in the runtime branches on the device; the TorchTitan adapter's CPU
adaptations ask `policy.cpu`.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from runner.run import procs
from runner.run.clocks import CpuClock, CudaEventClock, WallClock
from runner.schema import ClusterConfig, DeviceType, DistributedConfig, HostGroup

SYNC_WARNING = "called a synchronizing CUDA operation"
"""What torch's sync debug mode warns (c10/cuda/CUDAFunctions.cpp, warn_or_error_on_sync)."""


@dataclass
class DevicePolicy:
    device: DeviceType
    backend: str
    dedicated_host_group: bool
    host_group: Any = field(default=None, repr=False)
    """The group of host collectives; None means the default group."""
    host_syncs: int = 0
    """Host synchronizations with the device so far (metrics.jsonl's `host_syncs` is their count in a step): on CPU the
    policy's own reads and syncs; on CUDA every synchronizing CUDA operation torch reports (count_syncs)."""

    @classmethod
    def of(cls, cluster: ClusterConfig, distributed: DistributedConfig) -> DevicePolicy:
        cuda = cluster.device == DeviceType.cuda
        dedicated = cuda or distributed.host_group == HostGroup.dedicated
        return cls(cluster.device, cluster.backend.value, dedicated)

    @property
    def cpu(self) -> bool:
        return self.device == DeviceType.cpu

    @property
    def collective_library_dumps(self) -> bool:
        """NCCL writes its own flight-recorder dump on a timeout; with gloo the runner writes it (runner.observe.forensics)."""
        return not self.cpu

    def flight_recorder_env(self, size: str, prefix: str, dump_on_timeout: bool, timing: bool) -> dict[str, str]:
        """The collective library's own recorder settings: NCCL's on CUDA; gloo has none beyond torch's TORCH_FR_*."""
        if self.cpu:
            return {}
        return {
            "TORCH_NCCL_TRACE_BUFFER_SIZE": size,
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1" if dump_on_timeout else "0",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
            "TORCH_NCCL_ENABLE_TIMING": "1" if timing else "0",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",  # tear down the communicator on timeout (default; made explicit)
        }

    @property
    def pins_host_batches(self) -> bool:
        """Whether the loader reads batches into pinned host memory: a non_blocking copy to a GPU is asynchronous only from
        pinned memory (runner.run.loader.Prefetch); a CPU rank copies nothing."""
        return not self.cpu

    @property
    def datasheet_predicts(self) -> bool:
        """Whether the predictor's datasheet model (NVIDIA GPU constants) may price this device's step: a CPU's it misses
        by 2x or more, so a CPU run predicts only from a machine profile (runner.run.peak.profile_source)."""
        return not self.cpu

    def peak_devices(self, world_size: int, num_nodes: int) -> int:
        """What one peak FLOP/s figure counts: a GPU; on CPU the node, whose ranks share its cores (runner.run.peak)."""
        return num_nodes if self.cpu else world_size

    def rng_state(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The generators a step draws from: the host's, and on CUDA the compute device's."""
        return torch.get_rng_state(), None if self.cpu else torch.cuda.get_rng_state(self.compute_device())

    def set_rng_state(self, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.compute_device())

    def staging_options(self):
        """How an async checkpoint copies the state off the device (torch's DCP stager, kept across saves): on CUDA into
        reused pinned buffers, in a background thread; on CPU plainly (torch raises for pinning or async staging without CUDA)."""
        from torch.distributed.checkpoint.staging import StagingOptions

        cuda = not self.cpu
        return StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=cuda, use_non_blocking_copy=cuda)

    @property
    def allocator_snapshots(self) -> bool:
        """Whether profile.memory can record the allocator's history and dump snapshots (pytorch.org/memory_viz): torch's
        caching allocator is CUDA's; a CPU rank's memory shows only in the traces' profile_memory events."""
        return not self.cpu

    def record_allocator_history(self, max_entries: int) -> None:
        """Start recording every allocation and free, as TorchTitan's MemoryProfiler does (Python stacks only: C++ frames
        make the dump take minutes)."""
        # private_api: torch_cuda_record_memory_history
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=max_entries)

    def allocator_snapshot(self) -> dict[str, Any]:
        """The allocator's segments and recorded history, as torch.cuda.memory._dump_snapshot would pickle them."""
        # private_api: torch_cuda_snapshot
        return torch.cuda.memory._snapshot()

    def profiler_activities(self) -> list:
        from torch.profiler import ProfilerActivity

        return [ProfilerActivity.CPU] if self.cpu else [ProfilerActivity.CPU, ProfilerActivity.CUDA]

    def compute_device(self) -> torch.device:
        return torch.device("cpu") if self.cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))

    def agent_env(self, ranks_on_machine: int) -> dict[str, str]:
        """Environment the elastic agent passes to its ranks: on CPU, OpenMP threads that do not oversubscribe the cores."""
        return {"OMP_NUM_THREADS": str(procs.threads_per_rank(ranks_on_machine))} if self.cpu else {}

    def set_threads(self, ranks_on_machine: int) -> None:
        if self.cpu:  # ranks of one CPU machine share its cores
            torch.set_num_threads(procs.threads_per_rank(ranks_on_machine))

    def start_group(self, timeout_s: float) -> None:
        """The default process group, then (collectively, on every rank) the host group when it is its own."""
        import datetime

        if not self.cpu:
            torch.cuda.set_device(self.compute_device())
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(self.backend, timeout=timeout)
        if self.dedicated_host_group:
            self.host_group = dist.new_group(backend="gloo", timeout=timeout, group_desc="host")

    def clock(self) -> CpuClock | CudaEventClock:
        """What a phase costs this rank: CPU time on CPU, CUDA events on CUDA (runner.observe.monitor.StepMonitor)."""
        return CpuClock() if self.cpu else CudaEventClock()

    def timeline_clock(self) -> WallClock | CudaEventClock:
        """The step's timeline: pipeline stages, waits inside collectives and the step itself (wall clock on CPU, CUDA
        events on CUDA). A rank's own work is its step on this clock less its waits (runner.observe.waits)."""
        return WallClock() if self.cpu else CudaEventClock()

    def read(self, *values: torch.Tensor) -> list[float]:
        """The step's one host synchronization: these device tensors (scalars; at logged steps of an MoE model also the
        experts' token counts) in one device-to-host copy, flattened in order, which waits for every kernel queued
        before it (the step's forward/backward and clip, and the previous step's optimizer)."""
        if self.cpu:
            self.host_syncs += 1  # on CUDA the copy is counted by count_syncs, as every synchronizing op is
        device = self.compute_device()
        return torch.cat([v.detach().reshape(-1).to(device, torch.float64) for v in values]).tolist()

    def count_syncs(self) -> None:
        """On CUDA: count every synchronizing CUDA operation into host_syncs (torch's sync debug mode warns on each;
        the warning is counted and kept off the console). GPU-only: pinned on CPU by a test that raises the warning."""
        if self.cpu:
            return
        import warnings

        torch.cuda.set_sync_debug_mode("warn")
        warnings.filterwarnings("always", message=SYNC_WARNING)
        shown = warnings.showwarning

        def counted(message, category, filename, lineno, file=None, line=None):
            if SYNC_WARNING in str(message):
                self.host_syncs += 1
                return
            shown(message, category, filename, lineno, file, line)

        warnings.showwarning = counted

    def max_memory_gb(self) -> float:
        """Peak memory of this rank so far: resident set on CPU, allocated device memory on CUDA."""
        if self.cpu:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB
        return torch.cuda.max_memory_allocated() / 1e9

    # Host collectives: small CPU tensors (losses, hashes, timings) on the host group.
    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        dist.all_reduce(t, op=op, group=self.host_group)
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        got = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(got, t, group=self.host_group)
        return got

    def all_gather_object(self, obj: Any) -> list[Any]:
        got: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(got, obj, group=self.host_group)
        return got

    def broadcast_object(self, obj: Any, src: int) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.host_group)
        return box[0]

    def barrier(self) -> None:
        dist.barrier(group=self.host_group)

    # The bandwidth probe: device tensors on the default group, the links the model's collectives use.
    def probe_tensor(self, numel: int) -> torch.Tensor:
        return torch.ones(numel, dtype=torch.float32, device=self.compute_device())

    def sync(self) -> None:
        if self.cpu:
            self.host_syncs += 1
        else:
            torch.cuda.synchronize()
