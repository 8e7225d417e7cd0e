"""Checkpoint rules (torch-free). `check` is about the config alone (any cluster); `launch` looks at this machine
before any rank starts: the checkpoint folder's room for the checkpoints kept (whether it can be written is
folder_rules') and, when resuming, the checkpoint to start from: it must exist, be intact, have DCP metadata that opens
and belong to this model; with no shared one, a whole step of the node-local tier where every node's folder is
visible. `resume_point` is that checkpoint; runner.config.freeze.pin writes it into `checkpoint.resume_from`, so the
frozen file replays from the same step.
`init_check` and `init_files` are the same for checkpoint.init_from, the checkpoint whose weights a new phase starts
from (pinned by freeze.pin too, with its record in checkpoint.init_record).
"""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import runner.config.validate.folder_rules as folder_rules
from runner.estimate import flops
from runner.formats import checkpoint, hf_folder, local_checkpoint
from runner.schema import FaultTolerance, RunConfig
from runner.schema.layout import Layout
from runner.schema.problems import Problem


def check(cfg: RunConfig, out: list[Problem]) -> None:
    c = cfg.checkpoint
    if c.keep < 0:
        out.append(Problem("checkpoint.keep", c.keep, "must be >= 0", "keep N >= 1 newest checkpoints, or 0 to keep all"))
    if c.min_free_gb < 0:
        out.append(Problem("checkpoint.min_free_gb", c.min_free_gb, "must be >= 0", "use 0 for no margin"))
    if c.resume and not c.enable:
        out.append(Problem("checkpoint.resume", True, "resuming needs checkpoints", "use checkpoint=local (or checkpoint.enable=true)"))
    if c.export_hf and not c.enable:
        why = "exports the last checkpoint, and none is written"
        out.append(Problem("checkpoint.export_hf", True, why, "use checkpoint=local (or checkpoint.enable=true)"))
    if c.export_hf and (why := hf_folder.refusal(cfg.model)):
        out.append(Problem("checkpoint.export_hf", True, why, "set checkpoint.export_hf=false (train another family to export)"))
    if c.resume_from and not c.resume:
        out.append(
            Problem("checkpoint.resume_from", c.resume_from, "is read only when resuming", "add checkpoint.resume=true, or leave it empty")
        )
    if c.local.folder:
        _local(cfg, out)


def _local(cfg: RunConfig, out: list[Problem]) -> None:
    """The node-local tier (checkpoint.local): on top of the shared one, on node-local storage, saving between its saves."""
    c, lc = cfg.checkpoint, cfg.checkpoint.local
    if not c.enable:
        out.append(Problem("checkpoint.local.folder", lc.folder, "is a tier of checkpoints, and none are written", "use checkpoint=local"))
    if not Path(lc.folder).is_absolute():
        why = "must be an absolute path to node-local storage (a relative one would be inside the run folder, on shared storage)"
        out.append(Problem("checkpoint.local.folder", lc.folder, why, "name a local SSD or /dev/shm, e.g. /local_ssd/ckpt"))
    if lc.interval < 1:
        out.append(Problem("checkpoint.local.interval", lc.interval, "must be >= 1", "save to the local tier every N >= 1 steps"))
    elif lc.interval >= c.interval:
        why = f"is not shorter than checkpoint.interval {c.interval}: the shared tier would take every save the local one is due"
        out.append(Problem("checkpoint.local.interval", lc.interval, why, f"set it below {c.interval}, e.g. {max(1, c.interval // 5)}"))
    if lc.keep < 1:
        out.append(Problem("checkpoint.local.keep", lc.keep, "must be >= 1", "keep 1 or 2 local checkpoints per node"))
    if cfg.fault_tolerance.name != FaultTolerance.none:
        why = f"with fault_tolerance={cfg.fault_tolerance.name.value} a replica group recovers from a live one, and its layout changes"
        out.append(Problem("checkpoint.local.folder", lc.folder, why, "leave checkpoint.local.folder empty under torchft"))


def local_inside_shared(cfg: RunConfig, run_dir: Path) -> str | None:
    """Why the local tier's folder cannot be where it is (None: it can): the shared folder itself or inside it."""
    shared = checkpoint.folder(cfg.checkpoint, run_dir).resolve()
    local = Path(cfg.checkpoint.local.folder.replace("%N", "node")).resolve()
    if local == shared or shared in local.parents:
        return f"is {'the shared checkpoint.folder' if local == shared else 'inside the shared checkpoint.folder'} {shared}"
    return None


def _storage(cfg: RunConfig, where: Path, out: list[Problem]) -> None:
    """Room for the checkpoints kept (a folder that cannot be written is the folder rule's: folder_rules)."""
    c = cfg.checkpoint
    if folder_rules.unwritable(where) is not None:
        return
    probe = folder_rules.nearest(where)
    one = checkpoint.size_estimate_gb(flops.num_params(cfg.model))
    saves = math.ceil(cfg.training.steps / c.interval)  # every interval, plus the last step
    count = min(c.keep + 1, saves) if c.keep else saves  # a new one is written before the oldest goes
    need, free = count * one + c.min_free_gb, shutil.disk_usage(probe).free / 1e9
    if free < need:
        out.append(
            Problem(
                "checkpoint.folder",
                where,
                f"its filesystem has {free:.3g} GB free; {count} checkpoint(s) of {one:.3g} GB (fp32 weights + AdamW state)"
                f" + checkpoint.min_free_gb {c.min_free_gb:g} need {need:.3g} GB",
                "free space, point checkpoint.folder at a larger filesystem, or lower checkpoint.keep",
            )
        )


def resume_point(cfg: RunConfig, where: Path, out: list[Problem], *, warn: bool = True, lay: Layout | None = None) -> Path | None:
    """The checkpoint a resume starts from (pinned, else the newest intact one in `where`), or a problem saying why none.
    None without a problem: `where` holds none, but the local tier a whole step the ranks restore (given `lay`)."""
    c = cfg.checkpoint
    if c.resume_from:
        pick = Path(c.resume_from)
        why = checkpoint.verify(pick)
        if why is None:
            return pick
        out.append(
            Problem(
                "checkpoint.resume_from",
                c.resume_from,
                f"cannot be resumed from: {why}",
                "name an intact checkpoint folder (<folder>/step-<n>), or leave it empty to resume from the newest in checkpoint.folder",
            )
        )
        return None
    pick, warnings = checkpoint.choose(where)
    for w in warnings if warn else ():
        print(f"WARNING: {w}", file=sys.stderr, flush=True)
    if pick is None:
        state = "does not exist" if not where.exists() else "holds no intact checkpoint"
        local = _local_tier(cfg, lay, where) if lay is not None and cfg.checkpoint.local.folder else ""
        if local is not None:
            out.append(
                Problem(
                    "checkpoint.resume",
                    True,
                    f"nothing to resume: the checkpoint folder {where} {state}{local}",
                    "point checkpoint.folder at the stopped run's checkpoints (an absolute path), "
                    "or drop checkpoint.resume=true to start at step 1",
                )
            )
    return pick


def _local_tier(cfg: RunConfig, lay: Layout, where: Path) -> str | None:
    """With no shared checkpoint, the node-local tier: None when the local folders of every node are visible here (one
    node, or simulated ones) and hold a whole step with readable DCP metadata, which the ranks restore as at an elastic
    restart (runner.formats.local_checkpoint.choose); else the words that say why it cannot be resumed from."""
    c = cfg.checkpoint
    nodes = local_checkpoint.visible_nodes(cfg)
    if nodes is None:
        return (
            f"; the node-local tier (checkpoint.local.folder) of a {cfg.cluster.num_nodes}-node run is restored only by a "
            "restart inside the job (the elastic agent's, a SLURM requeue): this machine sees its own node's folder only"
        )
    origin = checkpoint.origin(cfg, lay)
    roots = sorted({local_checkpoint.root(c.local, n, where) for n in nodes})
    merged: dict[int, set[int]] = {}
    for r in roots:
        for step, ranks in local_checkpoint.held(r, origin)[0].items():
            merged.setdefault(step, set()).update(ranks)
    choice = local_checkpoint.choose([{s: sorted(v) for s, v in merged.items()}] * lay.world_size, None)
    if choice.step is None:
        return f"; nor does its node-local tier in {', '.join(map(str, roots))} ({choice.why})"
    for r in roots:
        for rank in range(lay.world_size):
            shard = local_checkpoint.shard_path(r, choice.step, rank)
            if shard.is_dir() and (why := checkpoint.metadata_problem(shard)):
                return f"; its node-local tier's step {choice.step} cannot be loaded: {why}"
    return None


def _resume(cfg: RunConfig, lay: Layout, where: Path, out: list[Problem]) -> None:
    c = cfg.checkpoint
    pick = resume_point(cfg, where, out, lay=lay)
    if pick is None:
        return
    if why := checkpoint.metadata_problem(pick):
        field, value = ("checkpoint.resume_from", c.resume_from) if c.resume_from else ("checkpoint.resume", True)
        fix = "resume from an older checkpoint (checkpoint.resume_from=<folder>/step-<n>), or restore the file from a copy"
        out.append(Problem(field, value, f"the checkpoint {pick} cannot be loaded: {why}", fix))
        return
    info = checkpoint.marker(pick)
    diff = checkpoint.identity_mismatch(info.get("model", {}), checkpoint.model_identity(cfg.model))  # none recorded: every field differs
    sched = checkpoint.schedule_mismatch(info.get("schedule"), checkpoint.schedule(cfg))
    if diff:
        out.append(Problem("checkpoint.resume", True, f"the checkpoint {pick} holds another model: {diff}", "resume with that model"))
    elif sched:
        field = sched.split(" ", 1)[0]
        out.append(
            Problem(
                field,
                checkpoint.schedule(cfg)[field],
                f"the checkpoint {pick} was trained under another learning-rate schedule ({sched}): resuming would continue "
                "a different schedule from its step",
                "resume with the checkpoint's values (a new phase starts a new run from its weights: checkpoint.init_from=<it>)",
            )
        )
    elif info["step"] >= cfg.training.steps:
        out.append(
            Problem(
                "training.steps",
                cfg.training.steps,
                f"the checkpoint {pick} is already at step {info['step']}: the run is complete",
                "train further as a new run from its weights: checkpoint.init_from=<it> (more training.steps stretch the schedule)",
            )
        )


def launch(cfg: RunConfig, lay: Layout, run_dir: Path, out: list[Problem]) -> None:
    """The checkpoint folder has room (folder_rules: it can be written); when resuming, what to resume from is intact and
    this model's."""
    if cfg.checkpoint.enable:
        where = checkpoint.folder(cfg.checkpoint, run_dir)
        _storage(cfg, where, out)
        local = cfg.checkpoint.local.folder
        if local and Path(local).is_absolute() and (why := local_inside_shared(cfg, run_dir)):
            out.append(Problem("checkpoint.local.folder", local, why, "name node-local storage outside it (a local SSD, /dev/shm)"))
        if cfg.checkpoint.resume:
            _resume(cfg, lay, where, out)


INIT = "checkpoint.init_from"
INIT_FIX = f"name a run folder, its checkpoint folder or one <folder>/step-<n> of it, or leave {INIT} empty"


def init_check(cfg: RunConfig, out: list[Problem]) -> None:
    """checkpoint.init_from against the rest of the config (the checkpoint it names: init_files, in the preflight)."""
    c = cfg.checkpoint
    if not c.init_from:
        if c.init_record:
            out.append(Problem("checkpoint.init_record", "(set)", f"records a checkpoint to start from, but {INIT} is empty", "drop it"))
        return
    if cfg.model.init_from:
        why = "model.init_from names weights to start from too: a run starts from one source of weights"
        out.append(Problem(INIT, c.init_from, why, f"drop {INIT} or model.init_from"))


def init_files(cfg: RunConfig, run_dir: Path, out: list[Problem]) -> None:
    """The checkpoint checkpoint.init_from names, on this machine now: intact (CRC-32s verified), of this model, outside
    this run's own checkpoint folder and, on a replay, the one the frozen file recorded."""
    c = cfg.checkpoint
    if not c.init_from or cfg.model.init_from:  # init_check refuses both
        return
    pick = init_source(cfg, out)
    if pick is None:
        return
    if why := checkpoint.metadata_problem(pick):
        fix = "start from another checkpoint (an older <folder>/step-<n>), or restore the file from a copy"
        out.append(Problem(INIT, c.init_from, f"the checkpoint {pick} cannot be loaded: {why}", fix))
        return
    if c.init_record and (diff := checkpoint.record_changes(c.init_record, checkpoint.weights_record(pick))):
        out.append(
            Problem(
                INIT,
                c.init_from,
                f"changed since this run was frozen ({'; '.join(diff)}): the replay would start from other weights",
                "restore the checkpoint the run started from, or start a new run from this one (without checkpoint.init_record)",
            )
        )
    if c.enable and pick.parent.resolve() == checkpoint.folder(c, run_dir).resolve():
        why = f"holds {pick}, the checkpoint {INIT} starts from: this run's saves would go beside it, and keep-last delete it"
        fix = "point checkpoint.folder elsewhere (by default a folder inside the run folder)"
        out.append(Problem("checkpoint.folder", c.folder, why, fix))


def init_source(cfg: RunConfig, out: list[Problem]) -> Path | None:
    """The checkpoint checkpoint.init_from names (runner.formats.checkpoint.weights_source), if it is intact and of this model."""
    c = cfg.checkpoint
    pick, notes = checkpoint.weights_source(Path(c.init_from))
    if pick is None:
        out.append(Problem(INIT, c.init_from, notes[0], INIT_FIX))
        return None
    for note in notes:
        print(f"WARNING: {INIT}: skipping checkpoint {note}; starting from {pick}", file=sys.stderr, flush=True)
    diff = checkpoint.identity_mismatch(checkpoint.marker(pick).get("model", {}), checkpoint.model_identity(cfg.model))
    if diff:
        fix = "start from a checkpoint of this model, or set model.* to the checkpoint's (the model of its COMPLETE.json)"
        out.append(Problem(INIT, c.init_from, f"the checkpoint {pick} holds another model: {diff}", fix))
        return None
    return pick
