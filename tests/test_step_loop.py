"""The step loop's device handling, in-process: what it hands the model and the pipeline schedule."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from runner.observe import fault_injection, loss_guard, monitor
from runner.run import step_loop
from runner.run.device import DevicePolicy
from runner.run.loader import Prefetch, SyntheticData
from runner.schema import DeviceType, InjectConfig, LossGuardConfig, MonitorConfig


def test_microbatches_reach_the_model_on_the_policys_compute_device(monkeypatch):
    """The data streams make CPU tensors; on CUDA the model and the loss need them on the GPU (labels too, which
    FSDP's forward would not move). A policy whose compute device is `meta` shows where they go."""
    seen = []
    monkeypatch.setattr(step_loop, "forward_backward", lambda built, loss_fn, mbs, tokens, mon: seen.extend(mbs) or torch.zeros(()))
    monkeypatch.setattr(step_loop.titan, "clip_grad_norm_tensor", lambda parts, max_norm, pd: torch.zeros(()))
    data = SyntheticData(seed=0, seq_len=8, vocab=64, global_batch=4, microbatch=2, dp_rank=0, dp=1)
    loop = _loop(
        data=data,
        feed=Prefetch(data),
        integrity=SimpleNamespace(replay_due=lambda step: False),
        policy=SimpleNamespace(compute_device=lambda: torch.device("meta")),
        built=SimpleNamespace(schedule=None, parts=[], parallel_dims=None),
        mon=SimpleNamespace(phase=lambda name: nullcontext()),
        hooks=step_loop.Hooks(),
        cfg=SimpleNamespace(training=SimpleNamespace(max_norm=1.0, steps=10), logging=SimpleNamespace(log_every=10)),
        loss_fn=None,
        global_tokens=torch.tensor(32.0),
    )
    loop.train_step(1)
    assert len(seen) == 2 and all(t.device.type == "meta" for mb in seen for t in mb[:2]) and seen[0].positions is None
    assert [tuple(t.shape) for t in seen[0][:2]] == [(2, 8), (2, 8)]


def _loop(**parts) -> step_loop.StepLoop:
    """A StepLoop of the given parts; None for the others, which the test never reaches."""
    import dataclasses

    unset = dataclasses.MISSING
    required = [f.name for f in dataclasses.fields(step_loop.StepLoop) if f.default is unset and f.default_factory is unset]
    return step_loop.StepLoop(**(dict.fromkeys(required) | parts))


class _RecordingPolicy(DevicePolicy):
    """A CUDA policy whose device calls only record themselves, in order, into `events`."""

    def __init__(self, events: list[str]):
        super().__init__(DeviceType.cuda, "nccl", dedicated_host_group=True)
        self.events = events

    def sync(self) -> None:
        self.events.append("sync")

    def read(self, *values: torch.Tensor) -> list[float]:
        self.events.append("read")
        return [float(v) for v in values]

    def max_memory_gb(self) -> float:
        return 0.0


class _Optimizers(SimpleNamespace):
    """An optimizer that records itself, iterable as TorchTitan's OptimizersContainer is (over its one optimizer)."""

    def __iter__(self):
        return iter([self])


def _fake_loop(monkeypatch, events: list[str], losses: dict[int, float], steps: int = 5, due=()):
    """A step loop whose model, optimizer, checkpointer and host collective only record themselves into `events`;
    `losses[step]` is the step's global loss, `due` the steps a checkpoint is due after. opt.step records which step's
    gradients it applies (events "applied <k>")."""
    clock = iter(range(100))
    grads: list[int | None] = [None]
    monkeypatch.setattr(step_loop.time, "perf_counter", lambda: events.append("clock") or float(next(clock)))
    monkeypatch.setattr(step_loop.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(step_loop.loader, "digest_lanes", lambda data, k: (0.0, 0.0))

    def train_step(loop, step):  # StepLoop.train_step
        events.append("forward/backward")
        grads[0] = step
        return torch.tensor(losses[step]), torch.ones(())

    monkeypatch.setattr(step_loop.StepLoop, "train_step", train_step)
    shared = step_loop.step_sync.Shared
    monkeypatch.setattr(step_loop.step_sync, "exchange", lambda policy, lay, rank, share, lanes, stop, extra: shared(share, "d", False, []))

    def row(step, loss, norm, dt, *rest):
        events.append(f"row dt={dt:g}")
        zero = dict.fromkeys(("tokens_per_s", "lr", "mfu", "mfu_6n", "mfu_of_gemm_peak", "memory_gb"), 0.0)
        return {"step": step, "loss": loss, "grad_norm": norm, "step_time_s": dt} | zero

    monkeypatch.setattr(step_loop, "row", row)
    opt = _Optimizers(
        param_groups=[{"lr": 1e-3}],
        step=lambda: events.append(f"applied {grads[0]}"),
        zero_grad=lambda set_to_none: grads.__setitem__(0, None),
    )
    return _loop(
        mon=SimpleNamespace(
            begin_step=lambda s: None,
            phase=lambda name: nullcontext(),
            end_step=lambda: [],
            finished_step=lambda: None,
            windows_judged=0,
            faults=fault_injection.Faults(InjectConfig(), rank=0),
        ),
        integrity=SimpleNamespace(check_due=lambda s: False, checks=0, replays=0, take=lambda: []),
        guard=loss_guard.LossGuard(LossGuardConfig(warmup_steps=1)),
        opt=opt,
        sched=SimpleNamespace(step=lambda: None),
        built=SimpleNamespace(parts=[]),
        data=None,
        lay=None,
        policy=_RecordingPolicy(events),
        cfg=SimpleNamespace(logging=SimpleNamespace(log_every=10), training=SimpleNamespace(steps=steps), monitor=MonitorConfig()),
        acc=None,
        feed=SimpleNamespace(waited_s=0.0),
        eval_data=None,
        ckpt=SimpleNamespace(
            due=lambda s: s in due,
            poll=lambda: None,
            staged=lambda: events.append("staged"),
            save=lambda step, *a: events.append(f"save {step}") or 0.0,
            last_tier="shared",
        ),
        watch=SimpleNamespace(signalled=False),
        stopped=False,
        pending=False,
        sinks=[],
        rows=[],
        timeline=None,
        prof=None,
        ft=step_loop.ft.OFF,
    )


def test_step_time_is_taken_after_the_device_finished_the_step(monkeypatch):
    """On CUDA the host runs ahead of its kernels: a dt read right after `opt.step()` returns times the launches.
    A step's one host synchronization (the policy's read of its loss and grad norm) waits for every kernel queued before
    it: the last step's accepted update (run one step late, inside this step's time) and this step's forward/backward;
    dt is read after it and the host collective."""
    events: list[str] = []
    loop = _fake_loop(monkeypatch, events, {2: 2.0})
    loop.pending = True  # step 1 was accepted; its update has not run yet
    assert loop.step(2) == 3
    assert events == ["clock", "staged", "applied None", "forward/backward", "read", "clock", "row dt=1"]
    assert loop.pending  # step 2's own update waits for step 3


def test_a_spike_never_reaches_the_weights_and_updates_land_before_the_weights_are_read(monkeypatch):
    """Each accepted step's gradients are applied once, at the start of the next step; step 3's spike (100 x the median
    loss) is dropped; a checkpoint due after step 4 and the last step (5) get their own step's update first."""
    events: list[str] = []
    loop = _fake_loop(monkeypatch, events, {1: 1.0, 2: 1.0, 3: 100.0, 4: 1.0, 5: 1.0}, due=(4,))
    for step in range(1, 6):
        loop.step(step)
    assert [e for e in events if e.startswith(("applied", "save"))] == ["applied 1", "applied 2", "applied 4", "save 4", "applied 5"]
    assert loop.guard.bad_steps == {3} and not loop.pending


def _route_one_batch_a_step(loop, monkeypatch) -> list[list[float]]:
    """Give `loop` one MoE block whose `tokens_per_expert_E` (TorchTitan's per-expert token counts) each forward (each
    train_step) adds one batch to, 8 tokens per expert, and an optimizer step that reads the counts, then zeroes them
    (the expert-bias pre-hook): returns the list each update appends the counts it read to."""
    block = torch.nn.Module()
    block.moe_enabled, block.moe = True, torch.nn.Module()
    block.moe.load_balance_coeff = 1e-3
    block.moe.register_buffer("tokens_per_expert_E", torch.zeros(4))
    part = torch.nn.Module()
    part.layers = torch.nn.ModuleDict({"1": block})
    loop.built = SimpleNamespace(parts=[part])
    counts = block.moe.tokens_per_expert_E
    fwd = step_loop.StepLoop.train_step

    def routed(loop, step):
        counts.add_(8.0)
        return fwd(loop, step)

    monkeypatch.setattr(step_loop.StepLoop, "train_step", routed)
    seen = []
    loop.opt.step = lambda: seen.append(counts.tolist()) or counts.zero_()
    return seen


def test_a_skipped_step_leaves_the_next_expert_bias_update_one_batch_of_token_counts(monkeypatch):
    """TorchTitan's MoE adds each forward's tokens per expert to `tokens_per_expert_E`, and the optimizer's step pre-hook
    moves the expert bias from them and zeroes them. Step 3 spikes and runs no optimizer step: its counts are dropped
    with its gradients, so the update of step 4 counts step 4's batch alone, as every other update counts its own."""
    events: list[str] = []
    loop = _fake_loop(monkeypatch, events, {1: 1.0, 2: 1.0, 3: 100.0, 4: 1.0, 5: 1.0})
    seen = _route_one_batch_a_step(loop, monkeypatch)
    for step in range(1, 6):
        loop.step(step)
    assert seen == [[8.0] * 4] * 4  # the updates of steps 1, 2, 4 and 5


def test_a_rewound_step_leaves_the_next_expert_bias_update_one_batch_of_token_counts(monkeypatch):
    """monitor.guard.action=rewind with max_consecutive=1: step 3 spikes and the run goes back to step 2's checkpoint,
    then replays step 3 without its batch. The spike's counts are dropped before the restore (which brings back the
    expert bias, a persistent buffer, but not the counts, which are not saved), so the update after the rewind
    counts one batch."""
    from runner.schema import GuardAction

    events: list[str] = []
    loop = _fake_loop(monkeypatch, events, {1: 1.0, 2: 1.0, 3: 100.0, 4: 1.0, 5: 1.0})
    loop.guard = loss_guard.LossGuard(LossGuardConfig(warmup_steps=1, action=GuardAction.rewind, max_consecutive=1))
    seen = _route_one_batch_a_step(loop, monkeypatch)
    loop.ckpt.wait = lambda: None
    loop.ckpt.restore = lambda *a, before: events.append(f"restore before {before}") or 2
    loop.left_out = lambda step: events.append(f"left out {step}")  # left_out.jsonl: its own test (test_eval)
    step = 1
    while step <= 5:
        step = loop.step(step)
    assert "restore before 3" in events and loop.guard.bad_steps == {3}
    assert seen == [[8.0] * 4] * 4  # the updates of steps 1, 2, 4 and 5 (step 3 replayed without a batch: none)


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
        assert all(torch.equal(a, b) for (a, *_), (b, *_) in zip(got, data.microbatches(0), strict=True))
        feed.get(1)  # the read-ahead, already pinned
        feed.close()
        assert pinned[:8] == want, device  # 2 microbatches x (inputs, labels) x steps 0 and 1


class _HostGroupPolicy(DevicePolicy):
    """A CUDA policy (host collectives on a gloo group of their own) whose host collectives record what reaches them;
    one rank, so a sum over ranks is the rank's own value."""

    def __init__(self):
        super().__init__(DeviceType.cuda, "nccl", dedicated_host_group=True)
        self.calls: list[tuple] = []

    def all_reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        self.calls.append(("all_reduce", t.device.type, t.dtype, t.tolist()))
        return t


def test_parity_sums_go_through_the_policys_host_group(compose, monkeypatch):
    """runner.run.layout_parity's exact gradient norm and weight fingerprint reduce over ranks through the policy: CPU float64
    tensors on the host group (on CUDA the default group is NCCL, which takes no host tensors), never torch.distributed's
    default group directly."""
    from runner.run import layout_parity
    from runner.schema import layout

    def default_group(*args, **kwargs):
        raise AssertionError("a collective on the default group")

    monkeypatch.setattr(layout_parity.dist, "all_reduce", default_group)
    monkeypatch.setattr(layout_parity.dist, "get_rank", lambda: 0)
    cfg = compose(["parallelism=single"])
    lay = layout.resolve(cfg.parallelism, cfg.cluster)
    model = torch.nn.Linear(3, 2)
    model.weight.grad = torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 2.0]])
    model.bias.grad = torch.tensor([4.0, 0.0])
    policy = _HostGroupPolicy()
    assert layout_parity.exact_grad_norm([model], lay, policy) == 5.0  # sqrt(1 + 4 + 4 + 16)
    before = {"w": torch.tensor([1.0, 1.0], dtype=torch.float64)}
    after = {"w": torch.tensor([1.0, 3.0], dtype=torch.float64)}
    assert layout_parity.fingerprint(before, after, lay, policy) == {"weights_sq": 10.0, "update_sq": 4.0, "weights_sum": 4.0}
    assert policy.calls == [("all_reduce", "cpu", torch.float64, [25.0]), ("all_reduce", "cpu", torch.float64, [10.0, 4.0, 4.0])]


class _Clock:
    """A device clock that records its use: the k-th span started lasts `seconds[k]` when resolved."""

    measures_cpu_time = False

    def __init__(self, name: str, seconds: list[float], used: list[str]):
        self.name, self.seconds, self.used, self.started = name, seconds, used, 0

    def now(self) -> float:
        raise AssertionError(f"{self.name}: a host clock read")

    def start(self) -> int:
        self.started += 1
        return self.started - 1

    def stop(self, k: int) -> int:
        return k

    def resolve(self, k: int) -> float:
        self.used.append(f"{self.name} {k}")
        return self.seconds[k]


class _ClockPolicy(DevicePolicy):
    """A CUDA policy whose phase clock and timeline clock are _Clocks (all_gather_object answers for one rank)."""

    def __init__(self, phase: _Clock, timeline: _Clock):
        super().__init__(DeviceType.cuda, "nccl", dedicated_host_group=True)
        self.phase, self.timeline = phase, timeline

    def clock(self):
        return self.phase

    def timeline_clock(self):
        return self.timeline

    def all_gather_object(self, obj):
        return [obj]


def test_stage_and_phase_times_come_from_the_policys_device_clock(monkeypatch, tmp_path):
    """On CUDA the host clock times kernel launches: a pipeline step's stages, the schedule's span and the step itself
    are timed on the policy's timeline clock (CUDA events), its phases on the policy's phase clock; no host clock is read.
    Timeline spans: 0 the step (2 s), 1 the schedule (1 s), 2 and 3 its two stage chunks (0.25 s each)."""
    from runner.observe import plan_check
    from runner.schema import MonitorConfig

    used: list[str] = []
    policy = _ClockPolicy(_Clock("phase", [0.9], used), _Clock("timeline", [2.0, 1.0, 0.25, 0.25], used))
    mon = monitor.StepMonitor(MonitorConfig(), policy, lambda r: {}, 0, None, tmp_path)
    stage = SimpleNamespace(forward_one_chunk=lambda: None)
    timer = plan_check.StageTimer([stage], mon.timeline)
    chunks = lambda built, mbs, tokens: [stage.forward_one_chunk() for _ in mbs] and torch.ones(())  # noqa: E731
    monkeypatch.setattr(step_loop.titan, "pipeline_step", chunks)
    loop = _loop(built=SimpleNamespace(schedule=object()), mon=mon, timer=timer, global_tokens=None)
    mon.begin_step(2)
    loop.compute([1, 2])
    mon.end_step()
    assert mon.now["pipeline"] == 0.9  # the phase clock
    assert (mon.now["pp_compute"], mon.now["pp_wait"], mon.idle) == (0.5, 0.5, [0.5])  # busy 2 x 0.25 of the 1 s schedule
    assert (mon.now["own"], mon.now["waits"]) == (2.0, 0.0)  # the step on the timeline clock, less its waits (none here)
    assert sorted(used) == ["phase 0", "timeline 0", "timeline 1", "timeline 2", "timeline 3"]


def test_cuda_host_syncs_are_counted_from_torchs_sync_debug_mode(monkeypatch):
    """On CUDA every synchronizing CUDA operation (an .item(), a device-to-host copy, a synchronize) counts into
    host_syncs: torch's sync debug mode warns on each, and the policy counts the warning instead of printing it. GPU-only
    (CPU torch has no sync debug mode): here a CUDA policy gets the warning torch would raise."""
    import warnings

    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    policy = DevicePolicy(DeviceType.cuda, "nccl", dedicated_host_group=True)
    with warnings.catch_warnings(record=True) as shown:
        policy.count_syncs()
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)  # torch's wording
        warnings.warn("something else", UserWarning, stacklevel=1)
    assert modes == ["warn"] and policy.host_syncs == 3
    assert [str(w.message) for w in shown] == ["something else"]
    cpu = DevicePolicy(DeviceType.cpu, "gloo", dedicated_host_group=False)
    cpu.count_syncs()  # nothing to switch on
    cpu.read(torch.ones(()), torch.zeros(()))
    cpu.sync()
    assert modes == ["warn"] and cpu.host_syncs == 2  # on CPU the policy counts its own read and sync


def test_the_loop_state_and_its_builder_are_typed():
    """StepLoop's fields and train.build's parameters name their types (the data sources, TorchTitan's optimizer and
    scheduler containers, its loss, the torchft replica, the collector): no `Any`, no unannotated parameter."""
    import dataclasses
    import inspect

    from runner.run import train
    from runner.run.step_loop import StepLoop

    untyped = [f.name for f in dataclasses.fields(StepLoop) if f.type == "Any"]  # the annotations are strings here
    assert untyped == []
    params = inspect.signature(train.build).parameters.values()
    assert [p.name for p in params if p.annotation is inspect.Parameter.empty] == []
    assert inspect.signature(train.build).return_annotation == "StepLoop"


MTP = ["model=deepseek_v3_debugmodel", "model.num_mtp_layers=1", "parallelism=single", "training.seq_len=16"]
MTP += ["training.global_batch_size=2", "training.microbatch_size=2", "model.num_layers=2"]  # a dense block, an MoE one


class _Unobserved:
    """The step monitor's interface that forward_backward calls, observing nothing (its test-only faults inject none)."""

    faults = fault_injection.Faults(InjectConfig(), rank=0)

    def phase(self, name: str):
        return nullcontext()


def test_a_step_trains_titans_mtp_loss_and_evaluation_keeps_the_main_heads(compose, tmp_path):
    """model.num_mtp_layers=1 on the debug DeepSeek-V3 (2 blocks), built and stepped by the runner on one gloo rank: the step's loss
    is TorchTitan's MTPLoss (called directly on the model's two heads and the batch's labels) and, by hand, the main
    head's summed next-token cross-entropy plus mtp_loss_scale x depth 1's of the token after next (the 15 positions
    that have one), over the batch's 32 tokens; its backward reaches the MTP block; the held-out loss is the main head's."""
    import torch.nn.functional as F
    from torchtitan.models.deepseek_v3 import MTPLoss

    from runner.run import titan
    from runner.schema import layout
    from tests.one_rank import gloo_rank

    cfg = compose(MTP)
    lay = layout.resolve(cfg.parallelism, cfg.cluster)
    tokens = torch.tensor(32.0)
    with gloo_rank(cfg, tmp_path):
        built = titan.build(cfg, lay, titan.build_mesh(cfg, lay), tmp_path / "run", torch.device("cpu"))
        data = SyntheticData(seed=cfg.training.seed, seq_len=16, vocab=cfg.model.vocab_size, global_batch=2, microbatch=2, dp_rank=0, dp=1)
        (mb,) = data.microbatches(0)
        loss_fn = titan.loss_fn(cfg)
        stepped = step_loop.forward_backward(built, loss_fn, [mb], tokens, _Unobserved()).item()
        model = built.parts[0]
        grads = [model.mtp_layers[0].get_parameter(n).grad for n in ("eh_proj.weight", "enorm.weight", "attention.wkv_b.weight")]
        with torch.no_grad():
            main, depth1 = (titan.local_value(p) for p in model(mb.inputs))
            held_out = titan.next_token_loss(loss_fn, [main, depth1], mb.labels, tokens).item()
    positions = torch.arange(16).expand(2, 16)
    titans, _ = MTPLoss(MTPLoss.Config(mtp_scale=0.3, global_vocab_size=2048))([main, depth1], mb.labels, tokens, positions=positions)
    main_sum = F.cross_entropy(main.double().flatten(0, 1), mb.labels.flatten(), reduction="sum")
    depth1_sum = F.cross_entropy(depth1[:, :-1].double().flatten(0, 1), mb.labels[:, 1:].flatten(), reduction="sum")
    assert stepped == titans.item()
    assert stepped == pytest.approx(((main_sum + 0.3 * depth1_sum) / 32).item(), rel=1e-6)
    assert depth1_sum / 30 > 1  # a real term (about log 2048 per position at initialization), not a rounding
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    assert held_out == pytest.approx((main_sum / 32).item(), rel=1e-6)
