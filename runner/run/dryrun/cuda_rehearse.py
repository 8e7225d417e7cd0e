"""mode=dryrun dryrun.device=cuda: one process plays a rank of a CUDA layout through the runner's own CUDA code.

The same rehearsal as runner.run.dryrun.rehearse, but the rank keeps the cluster's device: DevicePolicy's CUDA branch,
titan.build materializing and initializing on "cuda" (FP8 conversion for the cluster's compute capability, FlexAttention
masks), the step loop's batch moves (pinned host batches, step_loop.on_device) and its one host read
(DevicePolicy.read), the device RNG state and the checkpoint staging options. Tensors are FakeTensorMode "cuda" tensors
on a CUDA build of torch with no GPU; the device itself is faked by runner.run.dryrun.fake_cuda (every patch there).

Per rank it reports the ledger's memory (as mode=dryrun), and per step the collectives by mesh axis and bytes, the
host synchronizations (device-to-host copies and scalar reads on CUDA tensors, CUDA synchronize calls, non-blocking
copies from pageable memory) and the attention kernels dispatched; plus the checks the CUDA test tier holds.

`python -m runner.run.dryrun.cuda_rehearse JOBS` (started by runner.modes with fake_cuda.environment) reads a JSON list
of {"frozen", "ranks", "out"} and writes each job's result to its "out"; one import of torch for all of them.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

# private_api: torch_dispatch_mode
from torch.utils._python_dispatch import TorchDispatchMode

from runner.run.dryrun import fake_cuda

# private_api: torch_aten_local_scalar_dense
SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "is_nonzero")
"""Ops that wait for the device on a GPU (their result is a host value or a data-dependent shape)."""
# private_api: torch_aten_scaled_mm, torch_aten_grouped_mm, torch_aten_scaled_grouped_mm
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
        if first is not None and first.device.type == "cuda" and name in MATMULS:
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


def _step(cfg, lay, built, opt, policy, probe: StepProbe, led) -> dict[str, Any]:
    """One step as StepLoop runs it: the batch pinned and moved (step_loop.on_device), forward/backward or the pipeline
    schedule, the global-norm clip, the step's one host read (DevicePolicy.read), the optimizer update."""
    import torch

    from runner.run import step_loop, titan
    from runner.run.dryrun import rehearse

    t = cfg.training
    local_batch = t.global_batch_size // lay.dp
    host = [
        (x.pin_memory(), y.pin_memory()) if policy.pins_host_batches else (x, y)  # what loader.Prefetch hands the step
        for x, y in zip(
            torch.randint(0, cfg.model.vocab_size, (local_batch, t.seq_len)).split(t.microbatch_size),
            torch.randint(0, cfg.model.vocab_size, (local_batch, t.seq_len)).split(t.microbatch_size),
            strict=True,
        )
    ]
    global_tokens = torch.tensor(float(t.global_batch_size * t.seq_len))
    mark = led.phase if led is not None else (lambda name: None)
    with probe:
        microbatches = step_loop.on_device(host, policy.compute_device())
        mark("forward/backward")
        if built.schedule is not None:
            local = titan.pipeline_step(built, microbatches, global_tokens)
        else:
            local = step_loop.forward_backward(built, titan.loss_fn(cfg), microbatches, global_tokens, rehearse._Silent())
        mark("clip")
        norm = titan.local_value(titan.clip_grad_norm_tensor(built.parts, t.max_norm, built.parallel_dims))
        policy.read(local, norm)
        grads = _grads(built)
        mark("optimizer")
        if led is not None:
            led.in_optimizer = True
        opt.step()
        if led is not None:
            led.in_optimizer = False
        mark("zero_grad")
        opt.zero_grad(set_to_none=True)
    return probe.take() | grads | {"batch_devices": sorted({str(x.device.type) for mb in microbatches for x in mb})}


def _devices_and_dtypes(built, opt) -> dict[str, Any]:
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


def _grads(built) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    grads = [p.grad for m in built.parts for p in m.parameters() if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    return {
        "grad_devices": sorted({g.device.type for g in local}),
        "grad_dtypes": sorted({str(g.dtype).removeprefix("torch.") for g in local}),
    }


def _fp8_modules(built) -> list[str]:
    return sorted(
        {
            type(m).__name__
            for part in built.parts
            for m in part.modules()
            if "Float8" in type(m).__name__ or "fp8" in type(m).__name__.lower()
        }
    )


def _staging(policy) -> dict[str, Any]:
    opts = policy.staging_options()
    return {
        "use_pinned_memory": opts.use_pinned_memory,
        "use_async_staging": opts.use_async_staging,
        "non_blocking": opts.use_non_blocking_copy,
    }


def _staged(cfg, built, opt, policy) -> dict[str, Any]:
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


def _rng(policy) -> dict[str, Any]:
    host, device = policy.rng_state()
    return {"host_bytes": int(host.numel()), "device_bytes": None if device is None else int(device.numel())}


def _masks_per_stage(built, captured: list[int]) -> dict[str, Any]:
    return {"stages": [getattr(s, "stage_index", 0) for s in _stages(built)], "forwards_with_masks": list(captured)}


def _stages(built) -> list:
    # private_api: torch_schedule_stages, torch_schedule_stage
    if built.schedule is None:
        return []
    return list(getattr(built.schedule, "_stages", None) or [built.schedule._stage])


def _capture_masks(built) -> list[int]:
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


LOOP_STEPS = 3
"""Steps of the real step loop after the measured ones: a logging first step, a plain one, the last one."""


def _step_loop(cfg, lay, built, policy, run_dir: Path, probe: StepProbe) -> list[dict[str, Any]]:
    """The runner's own StepLoop (runner.run.train.build: the prefetching loader with pinned batches, the monitor's CUDA
    event clocks, the loss guard, the step's host read and host collective, the deferred update) for LOOP_STEPS steps
    on the synthetic data, no sinks and no checkpoint: per step its row's fields and what the probe saw."""
    import copy

    from runner.run import peak, per_rank, train

    cfg = copy.deepcopy(cfg)
    cfg.training.steps, cfg.logging.log_every, cfg.checkpoint.enable, cfg.eval.interval = LOOP_STEPS, LOOP_STEPS, False, 0
    pk = peak.write(cfg, lay.world_size, run_dir) if not (run_dir / "peak.json").exists() else peak.read(run_dir)
    from runner.run import accounting

    acc = accounting.accounting(cfg, built, pk)
    data = per_rank.data_for(cfg, lay, policy_rank(), run_dir, policy)
    # the fake process group delivers no object: every rank answers as this one (the values fake tensors carry are zeros)
    policy.all_gather_object = lambda obj: [obj] * lay.world_size
    policy.broadcast_object = lambda obj, src: obj
    with probe:
        loop = train.build(cfg, lay, built, data, acc, [], run_dir, None, None, policy)
    probe.take()
    rows = []
    for step in range(1, LOOP_STEPS + 1):
        with probe:
            loop.step(step)
        seen = probe.take()
        r = loop.rows[-1]
        rows.append(
            {
                "step": step,
                "logged": step % cfg.logging.log_every == 0 or step == cfg.training.steps,
                "row_host_syncs": r["host_syncs"],
                **seen,
            }
        )
    loop.feed.close() if hasattr(loop.feed, "close") else None
    return rows


def policy_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def measure(cfg, lay, run_dir: Path, loop: bool = True) -> dict[str, Any]:
    """Build this rank on fake CUDA tensors through the runner's CUDA path and run two steps (the second measured), then
    (with `loop`) LOOP_STEPS steps of the runner's own StepLoop."""
    import torch
    import torch.distributed as dist

    # private_api: torch_fake_tensor_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    from runner.run import titan
    from runner.run.device import DevicePolicy
    from runner.run.dryrun import ledger

    t0 = time.perf_counter()
    policy = DevicePolicy.of(cfg.cluster, cfg.distributed)
    assert not policy.cpu, "the CUDA rehearsal plays a CUDA cluster's rank"
    torch.cuda.set_device(policy.compute_device())  # as DevicePolicy.start_group; the group itself is the fake one
    pd = titan.build_mesh(cfg, lay)
    torch.manual_seed(cfg.training.seed)
    from runner.run.dryrun import rehearse

    with FakeTensorMode(allow_non_fake_inputs=True), contextlib.ExitStack() as stack:
        fake_cuda.devices_on()
        built = titan.build(cfg, lay, pd, run_dir, policy.compute_device())
        if built.schedule is not None:
            stack.enter_context(rehearse._fake_pipeline(cfg, lay, pd, "cuda"))
        if lay.ep > 1:
            stack.enter_context(rehearse._balanced_routing(built.parts, lay.ep))
        masks = _capture_masks(built)
        opt, _ = titan.build_optimizer(cfg, built.parts)
        titan.register_optimizer_hooks(built, opt)
        build_s = time.perf_counter() - t0
        probe = StepProbe()
        t1 = time.perf_counter()
        first = _step(cfg, lay, built, opt, policy, probe, None)
        t2 = time.perf_counter()
        led = ledger.Ledger()
        ledger.label_state(led, built.parts, opt)
        if built.schedule is not None:
            ledger.label_pipeline(led, built.schedule)
        with ledger.fsdp_labels(led), led:
            second = _step(cfg, lay, built, opt, policy, probe, led)
        result = led.sweep()
        checks = _devices_and_dtypes(built, opt) | _staging(policy) | {"rng": _rng(policy), "fp8_modules": _fp8_modules(built)}
        checks["masks"] = _masks_per_stage(built, masks) | {"attention_masks": built.attention_masks}
        if cfg.checkpoint.enable and cfg.checkpoint.async_save:
            checks["checkpoint"] = _staged(cfg, built, opt, policy)
        loop_steps = _step_loop(cfg, lay, built, policy, run_dir, probe) if loop else []
        shards = rehearse._shards(built.parts)
    rank = dist.get_rank()
    return {
        "rank": rank,
        "coords": {k: v for k, v in lay.coords(rank).items() if getattr(lay, k) > 1},
        "has_first_stage": built.has_first,
        "has_last_stage": built.has_last,
        "fake": True,
        "device": "cuda",
        "build_s": build_s,
        "step_s": [t2 - t1, time.perf_counter() - t2],
        "wall_s": time.perf_counter() - t0,
        **result,
        "categories_at_peak": ledger.by_category(result["at_peak"]),
        "categories_max": ledger.by_category(result["max_each"]),
        "num_params_local": sum(int(torch.Size(s["shape"]).numel()) for s in shards),
        "param_shards": shards,
        "steps": [first, second],
        "loop_steps": loop_steps,
        "checks": checks,
    }


def rehearse_rank(cfg, lay, rank: int, run_dir: Path, loop: bool = True) -> dict[str, Any]:
    """One rank in this (forked) process: a fake process group of the layout's world size."""
    import torch.distributed as dist

    # private_api: torch_fake_store
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from runner.run import titan

    os.environ["LOCAL_RANK"] = str(rank % cfg.cluster.devices_per_node)
    titan.quiet_torchao(cfg)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=lay.world_size)
    try:
        return measure(cfg, lay, run_dir, loop)
    finally:
        dist.destroy_process_group()


def run_job(frozen: str, ranks: list[int], run_dir: str, loop: bool = True) -> dict[str, Any]:
    from runner.config import freeze, layout
    from runner.config.dryrun import report as dryrun_report
    from runner.run.dryrun import rehearse

    cfg = freeze.load(Path(frozen))
    lay = layout.resolve(cfg.parallelism, cfg.cluster)
    dry = rehearse.rank_config(cfg, lay, device=cfg.cluster.device)
    del dryrun_report
    out = []
    for r in ranks:
        out.append(rehearse._forked(rehearse_rank, dry, lay, r, Path(run_dir), loop))
        print(f"rank {r}: rehearsed on fake CUDA in {out[-1]['wall_s']:.1f} s", flush=True)
    return {"substitutions": substitutions(cfg), "ranks": out}


def substitutions(cfg) -> list[str]:
    """What the CUDA rehearsal runs in place of the cluster's own: the kernels (no kernel runs), and the compiled
    FlexAttention (eager here: torch.compile needs a GPU)."""
    out = ["no kernel runs: fake CUDA tensors carry shapes, dtypes and devices, not values (the step's host read returns zeros)"]
    if cfg.training.compile:
        out.append("torch.compile: off (it needs a GPU and Triton)")
    out.append("FlexAttention and its block masks: eager, not TorchTitan's torch.compile'd ones")
    return out


def main(jobs_path: str) -> None:
    jobs = json.loads(Path(jobs_path).read_text())
    c = jobs[0]["gpu"]
    fake_cuda.install(c["capability"], c["memory_gb"], c["name"], c["devices_per_node"])
    from runner.config import freeze
    from runner.run import titan

    titan.preload(freeze.load(Path(jobs[0]["frozen"])))
    from runner.run.titan import cpu as titan_cpu

    titan_cpu.eager_flex_attention()
    for job in jobs:
        try:
            res = {"result": run_job(job["frozen"], job["ranks"], job["run_dir"], job.get("loop", True))}
        except RuntimeError as e:
            res = {"error": str(e)}
        Path(job["out"]).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
