"""The step loop's device handling, in-process: what it hands the model and the pipeline schedule."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import torch

from runner.config.schema import DeviceType, LossGuardConfig
from runner.observe import monitor
from runner.run import train
from runner.run.device import DevicePolicy
from runner.run.loader import Prefetch, SyntheticData


def test_microbatches_reach_the_model_on_the_policys_compute_device(monkeypatch):
    """The data streams make CPU tensors; on CUDA the model and the loss need them on the GPU (labels too, which
    FSDP's forward would not move). A policy whose compute device is `meta` shows where they go."""
    seen = []
    monkeypatch.setattr(train, "forward_backward", lambda built, loss_fn, mbs, tokens, mon: seen.extend(mbs) or torch.zeros(()))
    monkeypatch.setattr(train.titan, "clip_grad_norm", lambda parts, max_norm, pd: 0.0)
    data = SyntheticData(seed=0, seq_len=8, vocab=64, global_batch=4, microbatch=2, dp_rank=0, dp=1)
    loop = SimpleNamespace(
        data=data,
        feed=Prefetch(data),
        integrity=SimpleNamespace(replay_due=lambda step: False),
        policy=SimpleNamespace(compute_device=lambda: torch.device("meta")),
        built=SimpleNamespace(schedule=None, parts=[], parallel_dims=None),
        mon=SimpleNamespace(phase=lambda name: nullcontext()),
        hooks=train.Hooks(),
        cfg=SimpleNamespace(training=SimpleNamespace(max_norm=1.0)),
        loss_fn=None,
        global_tokens=torch.tensor(32.0),
    )
    train._train_step(loop, 1)
    assert len(seen) == 2 and all(t.device.type == "meta" for mb in seen for t in mb)
    assert [tuple(t.shape) for t in seen[0]] == [(2, 8), (2, 8)]


class _RecordingPolicy(DevicePolicy):
    """A CUDA policy whose device calls only record themselves, in order, into `events`."""

    def __init__(self, events: list[str]):
        super().__init__(DeviceType.cuda, "nccl", dedicated_host_group=True)
        self.events = events

    def sync(self) -> None:
        self.events.append("sync")

    def max_memory_gb(self) -> float:
        return 0.0


def test_step_time_is_taken_after_the_device_finished_the_optimizer(monkeypatch):
    """On CUDA the host runs ahead of its kernels: a dt read right after `opt.step()` returns times the launches.
    The step loop waits for the device (the policy's sync) after the optimizer and only then reads the clock."""
    events: list[str] = []
    clock = iter(range(100))
    monkeypatch.setattr(train.time, "perf_counter", lambda: events.append("clock") or float(next(clock)))
    monkeypatch.setattr(train, "_train_step", lambda loop, step: (torch.zeros(()), 1.0))
    monkeypatch.setattr(train, "global_loss", lambda local, lay, policy: 2.0)
    monkeypatch.setattr(train.loader, "global_digest", lambda data, k, policy: "d")
    monkeypatch.setattr(train, "row", lambda step, loss, norm, dt, *a: events.append(f"row dt={dt:g}") or {})
    opt = SimpleNamespace(param_groups=[{"lr": 1e-3}], step=lambda: events.append("optimizer"), zero_grad=lambda set_to_none: None)
    loop = SimpleNamespace(
        mon=SimpleNamespace(begin_step=lambda s: None, phase=lambda name: nullcontext(), end_step=lambda: [], windows_judged=0),
        integrity=SimpleNamespace(begin_step=lambda s, p: None, check_due=lambda s: False, checks=0, replays=0, take=lambda: []),
        guard=monitor.LossGuard(LossGuardConfig()),
        opt=opt,
        sched=SimpleNamespace(step=lambda: None),
        built=SimpleNamespace(parts=[]),
        data=None,
        lay=None,
        policy=_RecordingPolicy(events),
        cfg=SimpleNamespace(logging=SimpleNamespace(log_every=10), training=SimpleNamespace(steps=5)),
        acc=None,
        feed=SimpleNamespace(waited_s=0.0),
        eval_data=None,
        ckpt=SimpleNamespace(due=lambda s: False, poll=lambda: None, staged=lambda: events.append("staged")),
        watch=SimpleNamespace(agreed=lambda policy: False),
        stopped=False,
        sinks=[],
        rows=[],
        ft=train.ft.OFF,  # fault_tolerance=none: the loop's torchft calls are no-ops
    )
    assert train._step(loop, 2) == 3
    assert events == ["clock", "staged", "optimizer", "sync", "clock", "row dt=1"]


def test_prefetch_pins_its_batches_when_the_compute_device_is_cuda(monkeypatch):
    """`non_blocking=True` copies from pageable memory are synchronous: on CUDA the read-ahead thread pins each batch
    (the step's copy to the GPU then overlaps), on CPU nothing is pinned (and pinning would fail without CUDA)."""
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.append(tuple(t.shape)) or t)
    data = SyntheticData(seed=0, seq_len=8, vocab=64, global_batch=4, microbatch=2, dp_rank=0, dp=1)
    for device, want in ((DeviceType.cpu, []), (DeviceType.cuda, [(2, 8)] * 8)):
        pinned.clear()
        feed = Prefetch(data, pin=DevicePolicy(device, "gloo", dedicated_host_group=False).pins_host_batches)
        got = feed.get(0)  # read on the spot, then step 1's read ahead starts
        assert all(torch.equal(a, b) for (a, _), (b, _) in zip(got, data.microbatches(0), strict=True))
        feed.get(1)  # the read-ahead, already pinned
        feed.close()
        assert pinned[:8] == want, device  # 2 microbatches x (inputs, labels) x steps 0 and 1
