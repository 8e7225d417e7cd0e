"""The Checkpointer's device handling, in-process on one rank: what a CUDA rank saves and restores, through a policy
whose device calls are recorded (no GPU here)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import torch

from runner.observe.loss_guard import LossGuard
from runner.run import checkpointer
from runner.run.device import DevicePolicy
from runner.run.loader import SyntheticData
from runner.schema import CheckpointConfig, DeviceType, LossGuardConfig


class CudaLikePolicy(DevicePolicy):
    """A CUDA policy whose device RNG is a tensor of our own; restores are recorded."""

    def __init__(self, device_rng: torch.Tensor):
        super().__init__(DeviceType.cuda, "nccl", dedicated_host_group=True)
        self.device_rng, self.restored = device_rng, []

    def rng_state(self):
        return torch.get_rng_state(), self.device_rng

    def set_rng_state(self, state) -> None:
        self.restored.append(state)


def _state():
    data = SyntheticData(seed=0, seq_len=8, vocab=64, global_batch=4, microbatch=2, dp_rank=0, dp=1)
    sched = SimpleNamespace(state_dict=lambda: {"last_epoch": 3}, load_state_dict=lambda s: None)
    return SimpleNamespace(parts=[]), sched, data, LossGuard(LossGuardConfig())


def test_device_rng_is_saved_and_restored_through_the_policy(monkeypatch, tmp_path: Path):
    """Dropout and any sampling on the GPU draw from the device's generator: a resume that restores only the host's
    continues with another device stream than the uninterrupted run."""
    monkeypatch.setattr(checkpointer.dist, "get_rank", lambda: 0)
    saved = {}
    monkeypatch.setattr(
        checkpointer.titan, "save_state", lambda parts, opt, extra, path, group, stager: saved.update(extra) or (None, None)
    )
    monkeypatch.setattr(checkpointer.titan, "load_state", lambda parts, opt, template, path: saved)
    monkeypatch.setattr(checkpointer.checkpoint, "file_records", lambda partial, checksum: {})
    monkeypatch.setattr(checkpointer.checkpoint, "publish", lambda partial, final, info, files: final)
    policy = CudaLikePolicy(torch.tensor([7, 8, 9], dtype=torch.uint8))
    cfg = CheckpointConfig(enable=True, async_save=False)
    ckpt = checkpointer.Checkpointer(cfg, tmp_path, num_steps=4, origin={"world_size": 1}, policy=policy)
    built, sched, data, guard = _state()
    ckpt.save(2, built, None, sched, data, guard)
    assert sorted(saved["rng"]) == ["rank0", "rank0_device"] and saved["rng"]["rank0_device"].tolist() == [7, 8, 9]
    info = {"world_size": 1, "layout": "dp1", "degrees": {}, "model": {}}
    monkeypatch.setattr(ckpt, "_choose", lambda before: ("step-2", info))
    monkeypatch.setattr(ckpt, "_check", lambda path, info: None)
    assert ckpt.restore(built, None, sched, data, guard) == 2
    ((host, device),) = policy.restored
    assert torch.equal(host, saved["rng"]["rank0"]) and device.tolist() == [7, 8, 9]


def test_async_saves_keep_one_stager_with_the_devices_options(monkeypatch, tmp_path: Path):
    """One DCP stager for the run: on CUDA pinned buffers reused across saves and the copy in a background thread (the
    optimizer waits for it), on CPU neither (torch refuses both without CUDA)."""
    from torch.distributed.checkpoint.staging import StagingOptions

    monkeypatch.setattr(checkpointer.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(checkpointer.dist, "new_group", lambda backend, group_desc: "ckpt-group")
    made, used = [], []
    monkeypatch.setattr(checkpointer, "DefaultStager", lambda options: made.append(options) or SimpleNamespace(options=options))
    copied = Future()
    monkeypatch.setattr(
        checkpointer.titan, "save_state", lambda parts, opt, extra, path, group, stager: used.append((group, stager)) or (None, copied)
    )
    for policy in (CudaLikePolicy(torch.zeros(1)), DevicePolicy(DeviceType.cpu, "gloo", dedicated_host_group=False)):
        made.clear(), used.clear()
        ckpt = checkpointer.Checkpointer(CheckpointConfig(enable=True), tmp_path, num_steps=4, origin={}, policy=policy)
        built, sched, data, guard = _state()
        ckpt.save(1, built, None, sched, data, guard)
        ckpt.save(2, built, None, sched, data, guard)
        cuda = not policy.cpu
        assert made == [StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=cuda, use_non_blocking_copy=cuda)]
        assert len(used) == 2 and all(u == ("ckpt-group", used[0][1]) for u in used) and used[0][1].options is made[0]
    waiter = threading.Thread(target=ckpt.staged)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # the optimizer waits while the copy is being taken
    copied.set_result(None)
    waiter.join(5)
    assert not waiter.is_alive() and ckpt.staging is None
