"""Saving and resuming a whole training state on every rank (DCP through runner.run.titan, folders through runner.config.checkpoint).

State: model, optimizer, LR schedule, step, loss-guard history, every rank's RNG and the data loader position.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runner.config import checkpoint, runfiles
from runner.config.layout import Layout, label
from runner.config.schema import RunConfig
from runner.run import titan


class CheckpointMismatch(RuntimeError):
    """The checkpoint cannot be loaded into this run; raised on every rank before training starts."""


def folder_of(cfg: RunConfig, run_dir: Path) -> Path:
    f = Path(cfg.checkpoint.folder)
    return f if f.is_absolute() else run_dir / f


def restarted() -> bool:
    """This rank was started again by the elastic agent after a failure."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def _info(cfg: RunConfig, lay: Layout, step: int) -> dict[str, Any]:
    m, t = cfg.model, cfg.training
    return {
        "step": step,
        "world_size": lay.world_size,
        "layout": label(lay, cfg.parallelism),
        "degrees": lay.describe(),
        "model": {"name": m.name, "flavor": m.flavor, "dim": m.dim, "num_layers": m.num_layers, "vocab_size": m.vocab_size},
        "seq_len": t.seq_len,
        "global_batch_size": t.global_batch_size,
        "data": cfg.data.name.value,
        "async_save": cfg.checkpoint.async_save,
        "published": time.time(),
    }


class Checkpointer:
    def __init__(self, cfg: RunConfig, lay: Layout, run_dir: Path):
        self.cfg, self.lay = cfg, lay
        self.folder = folder_of(cfg, run_dir)
        self.rank = dist.get_rank()
        self.enabled = cfg.checkpoint.enable
        # async saves run their collectives on a group of their own (every rank creates it, in the same order)
        self.group = dist.new_group(backend="gloo") if self.enabled and cfg.checkpoint.async_save else None
        self.pending: tuple[Any, int] | None = None
        self.published: list[int] = []
        self.blocked_s: list[float] = []
        """Seconds each save held the step loop (the copy for async saves, the whole write for sync ones)."""

    def _extra(self, step: int, sched, data, guard, rng: bool = True) -> dict[str, Any]:
        extra = {
            "train": {"step": step, "lr_scheduler": json.dumps(sched.state_dict()), "guard": json.dumps(guard.state_dict())},
            "data": data.state_dict(step),
        }
        if rng:  # per rank, so each rank gets its own stream back
            extra["rng"] = {f"rank{self.rank}": torch.get_rng_state()}
        return extra

    def due(self, step: int) -> bool:
        return self.enabled and (step % self.cfg.checkpoint.interval == 0 or step == self.cfg.training.steps)

    def save(self, step: int, built: titan.Built, opt, sched, data, guard) -> float:
        """Start (async) or write (sync) the checkpoint of the state after `step`; return the seconds the loop was held."""
        t0 = time.perf_counter()
        self.wait()  # a previous async save still writing (normally long done)
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = checkpoint.partial_path(self.folder, step)
        fut = titan.save_state(built.parts, opt, self._extra(step, sched, data, guard), partial, self.group)
        self.pending = (fut, step)
        if fut is None:
            self._done()
        held = time.perf_counter() - t0
        self.blocked_s.append(held)
        return held

    def poll(self) -> None:
        """Publish an async save as soon as it has finished (rank 0; the others only collect their futures)."""
        if self.pending is not None and self.pending[0] is not None and self.pending[0].done():
            self._done()

    def wait(self) -> None:
        """Block until the save in flight is written and published (before the next one, and before exit)."""
        if self.pending is not None:
            self._done()

    def _done(self) -> None:
        fut, step = self.pending
        self.pending = None
        if fut is not None:
            fut.result()  # raises the writer's error, if any
        if self.rank == 0:
            final = checkpoint.publish(
                checkpoint.partial_path(self.folder, step), checkpoint.final_path(self.folder, step), _info(self.cfg, self.lay, step)
            )
            self.published.append(step)
            print(f"checkpoint: published {final}", flush=True)
            for old in checkpoint.prune(self.folder, self.cfg.checkpoint.keep):
                print(f"checkpoint: deleted {old.name} (keep {self.cfg.checkpoint.keep})", flush=True)

    def export_model(self, built: titan.Built) -> None:
        path = self.folder / runfiles.FINAL_MODEL
        if self.rank == 0 and path.exists():
            shutil.rmtree(path)
        dist.barrier()
        titan.save_model(built.parts, path)
        if self.rank == 0:
            print(f"checkpoint: model-only export in {path}", flush=True)

    def _choose(self, before: int | None) -> tuple[str | None, dict | None]:
        """Rank 0 picks (and warns about what it skips); every rank gets the same answer."""
        box: list[Any] = [None, None]
        if self.rank == 0:
            pick, warnings = checkpoint.choose(self.folder, before)
            for w in warnings:
                print(f"WARNING: {w}", file=sys.stderr, flush=True)
            if before is None:  # a fresh start of the job: no save is in flight, leftovers are from a crash
                for p in self.folder.glob(f"{runfiles.CHECKPOINT_PREFIX}*{runfiles.CHECKPOINT_PARTIAL}"):
                    shutil.rmtree(p)
            box = [str(pick) if pick else None, checkpoint.marker(pick) if pick else None]
        dist.broadcast_object_list(box, src=0)
        return box[0], box[1]

    def _check(self, path: str, info: dict) -> None:
        m = self.cfg.model
        want = {"name": m.name, "flavor": m.flavor, "dim": m.dim, "num_layers": m.num_layers, "vocab_size": m.vocab_size}
        if info["model"] != want:
            raise CheckpointMismatch(
                f"checkpoint {path} holds model {info['model']}, this run builds {want}. "
                "Fix: resume with the model it was saved from, or start without checkpoint.resume"
            )

    def restore(self, built: titan.Built, opt, sched, data, guard, *, before: int | None = None) -> int | None:
        """Load the newest complete checkpoint (of a step < `before`); return its step, None when there is none.
        A rewind (`before` given) keeps the guard's own record of the bad steps."""
        path, info = self._choose(before)
        if path is None:
            return None
        self._check(path, info)
        same_ranks = info["world_size"] == self.lay.world_size
        template = self._extra(0, sched, data, guard, rng=same_ranks)
        try:
            got = titan.load_state(built.parts, opt, template, Path(path))
        except Exception as e:  # DCP names the first key or shape it could not map
            raise CheckpointMismatch(
                f"checkpoint {path} (layout {info['layout']}: {info['degrees']}, {info['world_size']} ranks) cannot be loaded into "
                f"layout {label(self.lay, self.cfg.parallelism)} ({self.lay.describe()}): {type(e).__name__}: {e}. "
                "Fix: resume with the layout it was saved from"
            ) from e
        step = int(got["train"]["step"])
        sched.load_state_dict(json.loads(got["train"]["lr_scheduler"]))
        if before is None:
            guard.load_state_dict(json.loads(got["train"]["guard"]))
        data.load_state_dict(got["data"], step)
        if same_ranks:
            torch.set_rng_state(got["rng"][f"rank{self.rank}"])
        if self.rank == 0:
            rng = "" if same_ranks else f" (RNG states not restored: saved by {info['world_size']} ranks)"
            print(f"checkpoint: resumed from {path} (step {step}, layout {info['layout']}){rng}", flush=True)
        return step
