"""mode=dryrun dryrun.device=cuda: one process plays a rank of a CUDA layout through the runner's own CUDA code.

The same rehearsal as runner.run.dryrun.rehearse, but the rank keeps the cluster's device: DevicePolicy's CUDA branch,
titan.build materializing and initializing on "cuda" (FP8 conversion for the cluster's compute capability, FlexAttention
masks), the step loop's batch moves (pinned host batches, step_loop.on_device) and its one host read
(DevicePolicy.read), the device RNG state and the checkpoint staging options. Tensors are FakeTensorMode "cuda" tensors
on a CUDA build of torch with no GPU; the device itself is faked by runner.run.dryrun.fake_cuda (every patch there).

Per rank it reports the ledger's memory (as mode=dryrun), and per step the collectives by mesh axis and bytes, the
host synchronizations (device-to-host copies and scalar reads on CUDA tensors, CUDA synchronize calls, non-blocking
copies from pageable memory) and the attention kernels dispatched; plus the checks the CUDA test tier holds.

`python -m runner.run.dryrun.cuda_rehearse JOBS` (started by runner.run.dryrun.cuda_env.launch) reads a JSON list
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

from runner.run.dryrun import batches, cuda_checks, fake_cuda
from runner.run.dryrun.step_probe import StepProbe


def _step(cfg, lay, built, opt, policy, probe: StepProbe, led) -> dict[str, Any]:
    """One step as StepLoop runs it: the batch pinned and moved (step_loop.on_device), forward/backward or the pipeline
    schedule, the global-norm clip, the step's one host read (DevicePolicy.read), the optimizer update."""
    from runner.estimate import block_mask
    from runner.run import step_loop, titan
    from runner.run.dryrun import rehearse

    host = [  # what loader.Prefetch hands the step (packed documents' positions on real data: masks built per batch)
        type(mb)(*(None if t is None else t.pin_memory() for t in mb)) if policy.pins_host_batches else mb
        for mb in batches.synthetic_microbatches(cfg, lay, documents=block_mask.documents(cfg))
    ]
    grads: dict[str, Any] = {}
    built_masks = cuda_checks.mask_builds(built)

    def read(local, norm) -> None:
        policy.read(local, titan.local_value(norm))
        grads.update(cuda_checks.grads(built))

    with probe:
        microbatches = step_loop.on_device(host, policy.compute_device())
        rehearse.one_step(cfg, built, opt, microbatches, led, read)
    devices = sorted({str(x.device.type) for mb in microbatches for x in mb if x is not None})
    return probe.take() | grads | {"batch_devices": devices, "block_masks_built": built_masks.take()}


LOOP_STEPS = 3
"""Steps of the runner's StepLoop after the measured ones: two plain steps (the second applies the first's deferred
update) and the last, which logs and applies its own update at once."""


def _step_loop(cfg, lay, built, policy, run_dir: Path, probe: StepProbe) -> list[dict[str, Any]]:
    """The runner's own StepLoop (runner.run.train.build: the prefetching loader with pinned batches, the monitor's CUDA
    event clocks, the loss guard, the step's host read and host collective, the deferred update) for LOOP_STEPS steps
    on the synthetic data, no sinks and no checkpoint: per step its row's fields and what the probe saw."""
    import copy

    import torch.distributed as dist

    from runner.run import accounting, peak, per_rank, train

    cfg = copy.deepcopy(cfg)
    cfg.training.steps, cfg.logging.log_every, cfg.checkpoint.enable, cfg.eval.interval = LOOP_STEPS, LOOP_STEPS, False, 0
    acc = accounting.accounting(cfg, built, peak.write(cfg, lay.world_size, run_dir))  # the datasheet's peak (peak.json)
    data = per_rank.data_for(cfg, lay, dist.get_rank(), run_dir, policy)
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
    loop.feed.close()
    return rows


def measure(cfg, lay, run_dir: Path, loop: bool = True) -> dict[str, Any]:
    """Build this rank on fake CUDA tensors through the runner's CUDA path and run two steps (the second measured), then
    (with `loop`) LOOP_STEPS steps of the runner's own StepLoop."""
    import torch

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
            stack.enter_context(rehearse.fake_pipeline(cfg, lay, pd, "cuda"))
        if lay.ep > 1:
            exchange = lambda: fake_cuda.SYNCS.note("MoE token-count exchange (device-to-host)")  # noqa: E731
            stack.enter_context(rehearse.balanced_routing(built.parts, lay.ep, exchange))
        masks = cuda_checks.capture_masks(built)
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
        checks = cuda_checks.devices_and_dtypes(built, opt) | cuda_checks.staging(policy)
        checks |= {"rng": cuda_checks.rng(policy), "fp8_modules": cuda_checks.fp8_modules(built)}
        checks["expert_modules"] = cuda_checks.expert_modules(built)
        checks["masks"] = cuda_checks.masks_per_stage(built, masks) | {"attention_masks": built.attention_masks}
        if cfg.checkpoint.enable and cfg.checkpoint.async_save:
            checks["checkpoint"] = cuda_checks.staged(cfg, built, opt, policy)
        loop_steps = _step_loop(cfg, lay, built, policy, run_dir, probe) if loop else []
        shards = rehearse.param_shards(built.parts)
    step_s = [t2 - t1, time.perf_counter() - t2]
    report = rehearse.rank_report(lay, built, result, shards, fake=True, build_s=build_s, step_s=step_s, t0=t0)
    return report | {"device": "cuda", "steps": [first, second], "loop_steps": loop_steps, "checks": checks}


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
    from runner.config import freeze
    from runner.estimate import dryrun_report
    from runner.run.dryrun import rehearse
    from runner.schema import layout

    cfg = freeze.load(Path(frozen))
    lay = layout.resolve(cfg.parallelism, cfg.cluster)
    dry = rehearse.rank_config(cfg, lay, device=cfg.cluster.device)
    del dryrun_report
    out = []
    for r in ranks:
        out.append(rehearse.in_fork(rehearse_rank, dry, lay, r, Path(run_dir), loop))
        print(f"rank {r}: rehearsed on fake CUDA in {out[-1]['wall_s']:.1f} s", flush=True)
    return {"substitutions": substitutions(cfg), "ranks": out, "block_mask": rehearse.in_fork(batches.block_mask_probe, cfg, lay)}


def substitutions(cfg) -> list[str]:
    """What the CUDA rehearsal runs in place of the cluster's own: the kernels (no kernel runs), and the compiled
    FlexAttention (eager here: torch.compile needs a GPU)."""
    out = ["no kernel runs: fake CUDA tensors carry shapes, dtypes and devices, not values (the step's host read returns zeros)"]
    if cfg.training.compile:
        out.append("torch.compile: off (it needs a GPU and Triton)")
    out.append("FlexAttention and its block masks: eager, not TorchTitan's torch.compile'd ones")
    if cfg.model.num_experts and cfg.parallelism.ep > 1:
        out.append(
            "MoE routing: perfectly balanced (tokens x top-k / ep to every EP rank); TorchTitan's token-count exchange, which "
            "copies the all-to-all splits to the host (a synchronization per MoE layer and microbatch), is counted, not run"
        )
    return out


def main(jobs_path: str) -> None:
    from runner.config import freeze
    from runner.run import console, known_warnings, titan

    jobs = json.loads(Path(jobs_path).read_text())
    first = freeze.load(Path(jobs[0]["frozen"]))
    known_warnings.apply(True)  # a console process, as the `python -m runner` that started it: before TorchTitan's imports
    console.route_logs(first.logging.verbose, console=True)
    c = jobs[0]["gpu"]
    fake_cuda.install(c["capability"], c["memory_gb"], c["name"], c["devices_per_node"])
    titan.preload(first)
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
