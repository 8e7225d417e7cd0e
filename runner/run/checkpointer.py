"""Saving and resuming a whole training state on every rank (DCP through runner.run.titan, folders through runner.formats.checkpoint),
and loading the model alone of another run's checkpoint (checkpoint.init_from, a new phase).

State: model, optimizer, LR schedule, step, loss-guard history, every rank's RNGs (host and device) and the data loader position.
Like TorchTitan's CheckpointManager, the Checkpointer takes its own config section plus the few run values it needs.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager

from runner.formats import checkpoint, local_checkpoint, runfiles
from runner.observe import fault_injection
from runner.run import titan
from runner.schema import CheckpointConfig, ModelConfig


class CheckpointMismatch(RuntimeError):
    """The checkpoint cannot be loaded into this run; raised on every rank before training starts."""


def restarted() -> bool:
    """This rank was started again by the elastic agent after a failure."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


class Checkpointer:
    def __init__(
        self, c: CheckpointConfig, folder: Path, *, num_steps: int, origin: dict[str, Any], policy, shared: bool = False, inject=None
    ):
        """`folder`: where checkpoints go (runner.formats.checkpoint.folder); `num_steps`: the run's last step (always
        saved); `origin`: what the state is saved from (runner.formats.checkpoint.origin), its model checked on resume;
        `policy`: the device policy, whose host group carries the choice of checkpoint and the export barrier; `shared`:
        other jobs write the folder too (torchft's replica groups), so a save in flight may be theirs; `inject`: the
        test-only fault injection (runner.observe.fault_injection.lose_local)."""
        self.inject = inject
        self.cfg, self.folder, self.num_steps, self.origin, self.policy = c, folder, num_steps, origin, policy
        self.shared = shared
        self.rank = dist.get_rank()
        self.enabled = c.enable
        # async saves run their collectives on a group of their own (every rank creates it, in the same order)
        self.group = dist.new_group(backend="gloo", group_desc="checkpoint_async") if self.enabled and c.async_save else None
        # rank 0 checksums an async save's files in a thread of its own, once DCP has written them
        self.hasher = ThreadPoolExecutor(1, thread_name_prefix="ckpt-crc") if self.group is not None and self.rank == 0 else None
        # one stager for every save, so its (pinned, on CUDA) buffers are reused: DCP makes and frees its own per save otherwise
        self.stager = DefaultStager(policy.staging_options()) if self.group is not None else None
        self.staging: Future | None = None
        self.pending: tuple[Future | None, int] | None = None
        self.published: list[int] = []
        self.blocked_s: list[float] = []
        """Seconds each save held the step loop (the copy for async saves, the whole write and checksums for sync ones)."""
        self.local = None
        if self.enabled and c.local.folder:
            from runner.run.local_tier import LocalTier

            self.local = LocalTier(c, folder, origin=origin, policy=policy)
        self.last_tier = "shared"
        """The tier of the last save ("shared" or "local"): metrics.jsonl's checkpoint_tier."""
        self.restored_from: dict[str, Any] = {}
        """Which tier the last restore read and why (the timeline's `restored` mark)."""

    def _extra(self, step: int, sched, data, guard, rng: bool = True) -> dict[str, Any]:
        extra = {
            "train": {"step": step, "lr_scheduler": json.dumps(sched.state_dict()), "guard": json.dumps(guard.state_dict())},
            "data": data.state_dict(step),
        }
        if rng:  # per rank, so each rank gets its own streams back: the host's, and the compute device's on CUDA
            host, device = self.policy.rng_state()
            extra["rng"] = {f"rank{self.rank}": host} | ({} if device is None else {f"rank{self.rank}_device": device})
        return extra

    def shared_due(self, step: int) -> bool:
        return self.enabled and (step % self.cfg.interval == 0 or step == self.num_steps)

    def due(self, step: int) -> bool:
        """A save of either tier is due after `step` (the local tier's only where the shared one's is not)."""
        return self.shared_due(step) or (self.local is not None and self.local.due(step))

    def save(self, step: int, built: titan.Built, opt, sched, data, guard, *, shared: bool = False) -> float:
        """Start (async) or write (sync) the checkpoint of the state after `step`, to the shared tier when it is due there
        (or `shared`), else to the local tier; return the seconds the loop was held."""
        t0 = time.perf_counter()
        self.wait()  # a previous async save still writing (normally long done)
        self.last_tier = "local" if self.local is not None and not (shared or self.shared_due(step)) else "shared"
        if self.last_tier == "local":
            self.local.save(step, built.parts, opt, self._extra(step, sched, data, guard))
            held = time.perf_counter() - t0
            self.blocked_s.append(held)
            return held
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = checkpoint.partial_path(self.folder, step)
        fut, self.staging = titan.save_state(built.parts, opt, self._extra(step, sched, data, guard), partial, self.group, self.stager)
        if fut is not None and self.hasher is not None:
            fut = self.hasher.submit(self._records, fut, partial)
        self.pending = (fut, step)
        if fut is None:
            self._done()
        held = time.perf_counter() - t0
        self.blocked_s.append(held)
        return held

    def staged(self) -> None:
        """Block until an async save's copy of the state is taken: before the optimizer changes the weights it copies."""
        if self.local is not None:
            self.local.staged()
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def _records(self, written: Future, partial: Path) -> dict[str, dict[str, Any]]:
        written.result()  # every rank's shard is on disk (see runner.formats.checkpoint)
        return checkpoint.file_records(partial, self.cfg.checksum)

    def poll(self) -> None:
        """Publish an async save as soon as it has finished (rank 0; the others only collect their futures)."""
        if self.local is not None:
            self.local.poll()
        if self.pending is not None and self.pending[0] is not None and self.pending[0].done():
            self._done()

    def wait(self) -> None:
        """Block until the save in flight is written and published (before the next one, and before exit)."""
        if self.local is not None:
            self.local.wait()
        if self.pending is not None:
            self._done()

    def _done(self) -> None:
        fut, step = self.pending
        self.pending = None
        got = fut.result() if fut is not None else None  # raises the writer's error, if any
        if self.rank == 0:
            partial = checkpoint.partial_path(self.folder, step)
            files = got if self.hasher is not None else checkpoint.file_records(partial, self.cfg.checksum)
            info = {"step": step, **self.origin, "async_save": self.cfg.async_save, "published": time.time()}
            final = checkpoint.publish(partial, checkpoint.final_path(self.folder, step), info, files)
            self.published.append(step)
            print(f"checkpoint: published {final}", flush=True)
            for old in checkpoint.prune(self.folder, self.cfg.keep):
                print(f"checkpoint: deleted {old.name} (keep {self.cfg.keep})", flush=True)

    def export_model(self, built: titan.Built) -> None:
        path = self.folder / runfiles.FINAL_MODEL
        if self.rank == 0 and path.exists():
            shutil.rmtree(path)
        self.policy.barrier()
        titan.save_model(built.parts, path)
        if self.rank == 0:
            print(f"checkpoint: model-only export in {path}", flush=True)

    def export_hf(self, cfg) -> None:
        """Rank 0 writes the last published checkpoint as a Hugging Face folder (runner.run.hf_export); the others wait."""
        if self.rank == 0:
            from runner.run import hf_export

            last = checkpoint.final_path(self.folder, self.published[-1])
            src = hf_export.run_source(last, ModelConfig(**self.origin["model"]), cfg)
            out = hf_export.export(src, self.folder / runfiles.HF_EXPORT)
            print(f"checkpoint: Hugging Face export of {last.name} in {out}", flush=True)
            if src.note:
                print(f"WARNING: export: {src.note}", file=sys.stderr, flush=True)  # the run's own: never a bare checkpoint
        self.policy.barrier()

    def _pick(self, before: int | None) -> tuple[Path | None, str | None]:
        """Rank 0: the checkpoint to load, or why there is none that may be loaded."""
        if before is None and self.cfg.resume_from and not restarted():
            # pinned (and checksummed) by the pre-launch check, so a replay starts from the same step; sizes suffice here
            pick = Path(self.cfg.resume_from)
            why = checkpoint.verify(pick, deep=False)
            return (None, f"checkpoint.resume_from {pick} cannot be resumed from: {why}") if why else (pick, None)
        pick, warnings = checkpoint.choose(self.folder, before)
        for w in warnings:
            print(f"WARNING: {w}", file=sys.stderr, flush=True)
        if pick is None and self._by_hand(before) and self.local is None:  # with a local tier: restore() asks it first
            return None, f"checkpoint.resume=true but {self.folder} holds no intact checkpoint"
        return pick, None

    def _by_hand(self, before: int | None) -> bool:
        """A restart by hand (checkpoint.resume=true at the job's start), which must find something to resume."""
        return before is None and self.cfg.resume and not restarted()

    def _choose(self, before: int | None) -> tuple[str | None, dict | None]:
        """Rank 0 picks (and warns about what it skips); every rank gets the same answer or the same error."""
        box: list[Any] = [None, None, None]
        if self.rank == 0:
            pick, error = self._pick(before)
            if before is None and not self.shared:  # a fresh start of the job: no save is in flight, leftovers are from a crash
                for p in self.folder.glob(f"{runfiles.CHECKPOINT_PREFIX}*{runfiles.CHECKPOINT_PARTIAL}"):
                    shutil.rmtree(p)
            box = [str(pick) if pick else None, checkpoint.marker(pick) if pick else None, error]
        box = self.policy.broadcast_object(box, src=0)
        if box[2] is not None:
            raise CheckpointMismatch(box[2])
        return box[0], box[1]

    def _check(self, path: str, info: dict) -> None:
        diff = checkpoint.identity_mismatch(info["model"], self.origin["model"])
        if diff:
            raise CheckpointMismatch(
                f"checkpoint {path} holds another model ({diff}). "
                "Fix: resume with the model it was saved from, or start without checkpoint.resume"
            )
        sched = checkpoint.schedule_mismatch(info.get("schedule"), self.origin["schedule"])
        if sched:
            raise CheckpointMismatch(
                f"checkpoint {path} was trained under another learning-rate schedule ({sched}). "
                "Fix: resume with the checkpoint's values (a new phase starts a new run from its weights: checkpoint.init_from)"
            )

    def load_weights(self, built: titan.Built, source: str) -> tuple[Path, dict[str, Any]]:
        """Load only the model of the checkpoint `source` names (checkpoint.init_from: a `step-<n>` folder, or the newest
        intact one of a run or checkpoint folder; another run's, any layout) into this run's; return the checkpoint and
        its COMPLETE.json. Rank 0 picks and checks the model, every rank gets the same answer or the same error."""
        box: list[Any] = [None, None, None]
        if self.rank == 0:
            pick, notes = checkpoint.weights_source(Path(source), deep=False)  # pinned and checksummed by the preflight
            info = checkpoint.marker(pick) if pick is not None else None
            diff = checkpoint.identity_mismatch(info.get("model", {}), self.origin["model"]) if info is not None else None
            error = f"checkpoint.init_from {source} {notes[0]}" if pick is None else None
            if diff:
                error = f"checkpoint {pick} (checkpoint.init_from) holds another model ({diff}). Fix: start from a checkpoint of this model"
            box = [str(pick) if pick else None, info, error]
        path, info, error = self.policy.broadcast_object(box, src=0)
        if error is not None:
            raise CheckpointMismatch(error)
        try:
            titan.load_model(built.parts, Path(path))
        except Exception as e:  # DCP names the first key or shape it could not map
            raise CheckpointMismatch(
                f"the model of checkpoint {path} (layout {info.get('layout')}) cannot be loaded into layout {self.origin['layout']} "
                f"({self.origin['degrees']}): {type(e).__name__}: {e}"
            ) from e
        return Path(path), info

    def restore(self, built: titan.Built, opt, sched, data, guard, *, before: int | None = None) -> int | None:
        """Load the checkpoint to resume from (pinned, else the newest intact one; of a step < `before` when given);
        return its step, None when there is none. A rewind (`before` given) keeps the guard's own record of the bad steps."""
        path, info = self._choose(before)
        if self.local is not None:
            step = self._restore_local(built, opt, sched, data, guard, before, checkpoint.step_of(Path(path)) if path else None)
            if step is not None:
                return step
        if path is None and self._by_hand(before):
            why = self.restored_from["why"]
            raise CheckpointMismatch(
                f"checkpoint.resume=true but {self.folder} holds no intact checkpoint, nor the local tier a whole step ({why})"
            )
        if path is None:
            self.restored_from = {"tier": "none"} | ({"why": self.restored_from["why"]} if self.local is not None else {})
            return None
        self.restored_from = {"tier": "shared"} | ({"why": self.restored_from["why"]} if self.local is not None else {})
        self._check(path, info)
        same_ranks = info["world_size"] == self.origin["world_size"]
        template = self._extra(0, sched, data, guard, rng=same_ranks)
        try:
            got = titan.load_state(built.parts, opt, template, Path(path))
        except Exception as e:  # DCP names the first key or shape it could not map
            raise CheckpointMismatch(
                f"checkpoint {path} (layout {info['layout']}: {info['degrees']}, {info['world_size']} ranks) cannot be loaded into "
                f"layout {self.origin['layout']} ({self.origin['degrees']}): {type(e).__name__}: {e}. "
                "Fix: resume with the layout it was saved from"
            ) from e
        step = self._apply(got, sched, data, guard, before, same_ranks)
        if self.rank == 0:
            rng = "" if same_ranks else f" (RNG states not restored: saved by {info['world_size']} ranks)"
            print(f"checkpoint: resumed from {path} (step {step}, layout {info['layout']}){rng}", flush=True)
        return step

    def _apply(self, got: dict, sched, data, guard, before: int | None, same_ranks: bool) -> int:
        """Put a loaded state's schedule, guard, data position and this rank's RNGs in place; return its step."""
        step = int(got["train"]["step"])
        sched.load_state_dict(json.loads(got["train"]["lr_scheduler"]))
        if before is None:
            guard.load_state_dict(json.loads(got["train"]["guard"]))
        data.load_state_dict(got["data"], step)
        if same_ranks:
            mine = got["rng"]
            self.policy.set_rng_state((mine[f"rank{self.rank}"], mine.get(f"rank{self.rank}_device")))
        return step

    def _restore_local(self, built: titan.Built, opt, sched, data, guard, before: int | None, shared_step: int | None) -> int | None:
        """The local tier's newest whole step, when it is newer than the shared tier's `shared_step` (runner.run.local_tier);
        None: the shared tier is used. Either way one console line says which and why."""
        if self.inject is not None and fault_injection.loses_local(self.inject) and restarted() and before is None:
            if self.rank == 0:
                shared = self.folder
                done = fault_injection.lose_local(self.inject, lambda node: local_checkpoint.root(self.cfg.local, node, shared))
                print(f"inject: {done}", flush=True)
            self.policy.barrier()
        template = self._extra(0, sched, data, guard)
        step, got, why = self.local.restore(shared_step, before, lambda p: titan.load_state(built.parts, opt, template, p, no_dist=True))
        self.restored_from = {"tier": "shared" if step is None else "local", "why": why}
        if step is None:
            if self.rank == 0:
                print(f"checkpoint: local tier not used: {why}", flush=True)
            return None
        self._apply(got, sched, data, guard, before, same_ranks=True)
        if self.rank == 0:
            print(f"checkpoint: resumed from the local tier, step {step} ({why})", flush=True)
        return step
