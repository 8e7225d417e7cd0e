"""The step loop's side of fault_tolerance=torchft: one replica group's torchft Manager (runner/run/ft_launch.py starts
the groups). The loop calls `begin`, `global_loss`, `should_commit`, `saves`, `row` and `next_step`; with fault
tolerance off they are `OFF`'s no-ops, so the loop is the same code either way.

What torchft adds per step (docs/fault-tolerance.md): the quorum (`start_quorum` at the step's start, asynchronous,
waited for at the first cross-replica collective), one all-reduce per FSDP module's reduce-scatter output over
torchft's managed group (FSDP's all-reduce hook, as TorchTitan's TorchFTManager sets it), one of the loss, and
`should_commit` (a host round trip to the group's manager server) before the optimizer step; at
monitor.integrity.interval two more of the parameter checksum.
"""

from __future__ import annotations

import datetime
import json
import time
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runner.config import fault_tolerance as ftc
from runner.formats import runfiles
from runner.formats.metrics_row import StepRow
from runner.observe import integrity
from runner.run import titan
from runner.run.checkpointer import restarted
from runner.schema import RunConfig
from runner.schema.layout import Layout

MOMENT_MOD = 1 << 20
"""The checksum's low bits whose first and second moments are summed over the replicas (exact in float64 for any quorum)."""


def job_view(cfg: RunConfig, lay: Layout) -> tuple[RunConfig, Layout]:
    """One replica group's job: its layout has dp_replicate=1 and its batch is the global batch's 1/dp_replicate (the
    loss divides by the job's tokens; the managed group then averages over the live groups)."""
    if not ftc.enabled(cfg):
        return cfg, lay
    import dataclasses

    t = dataclasses.replace(cfg.training, global_batch_size=cfg.training.global_batch_size // lay.dp_replicate)
    return dataclasses.replace(cfg, training=t), ftc.group_layout(lay)


def data_coords(cfg: RunConfig, lay: Layout, rank: int) -> tuple[int, int, int]:
    """(dp rank, dp degree, global batch) of `rank` in the run's whole data order: a replica group reads its own
    replica's shards of every step, whichever groups are alive."""
    if not ftc.enabled(cfg):
        return lay.dp_rank(rank), lay.dp, cfg.training.global_batch_size
    groups = cfg.parallelism.dp_replicate
    r = cfg.fault_tolerance.replica_id
    return r * lay.dp + lay.dp_rank(rank), lay.dp * groups, cfg.training.global_batch_size * groups


class Off:
    """Fault tolerance off: every call is what the loop did before."""

    def resume_at(self, step: int) -> None:
        pass

    def begin(self, step: int) -> None:
        pass

    def global_loss(self, loss: float) -> float:
        return loss

    def should_commit(self) -> bool:
        return True

    def saves(self) -> bool:
        return True

    def row(self, step: int, r: StepRow, parts: list[torch.nn.Module]) -> dict[str, Any]:
        return {}

    def next_step(self, step: int) -> int:
        return step + 1

    def close(self) -> None:
        pass


OFF = Off()


class Replica:
    """This rank's view of its replica group under torchft: the Manager, the managed cross-replica group, the
    state a recovering group receives, and per step what was trained."""

    def __init__(self, cfg: RunConfig, parts: list[torch.nn.Module], opt, sched, policy, run_dir: Path):
        import torchft
        from torchft.process_group import ManagedProcessGroup

        f = cfg.fault_tolerance
        pg_timeout = datetime.timedelta(milliseconds=f.process_group_timeout_ms)
        pg = torchft.ProcessGroupGloo(timeout=pg_timeout) if policy.cpu else torchft.ProcessGroupNCCL(timeout=pg_timeout)
        seconds = datetime.timedelta(seconds=1)
        self.manager = torchft.Manager(
            pg=pg,
            min_replica_size=f.min_replicas,
            load_state_dict=None,
            state_dict=None,
            use_async_quorum=True,
            timeout=f.timeout_s * seconds,
            quorum_timeout=f.quorum_timeout_s * seconds,
            connect_timeout=f.connect_timeout_s * seconds,
            replica_id=f"runner_ft_{f.replica_id}",
            init_sync=False,  # every group builds the same seeded weights; init_sync would heal group 1 at step 1 (its batch lost)
        )
        self.group = ManagedProcessGroup(self.manager)
        self.group.register("dp_replicate")
        self.parts, self.opt, self.sched = parts, opt, sched
        self.groups, self.replica_id = cfg.parallelism.dp_replicate, f.replica_id
        self.job_samples = cfg.training.global_batch_size  # the job's share (job_view)
        self.seq_len = cfg.training.seq_len
        self.samples_skipped = 0
        self.check_every = cfg.monitor.integrity.interval
        self.live, self.trained, self.committed = 0, False, False
        self.manager.register_state_dict_fn("runner", self._load, self._state)
        _set_all_reduce_hook(parts, self.group)
        if not restarted():
            all_heartbeating(run_dir.parent, f.replica_id, self.groups, f.quorum_timeout_s, policy)

    def _state(self) -> dict[str, Any]:
        """What a recovering group receives from a live peer (torchft's checkpoint transport, rank by rank)."""
        return live_state(self.opt) | {"sched": self.sched.state_dict(), "skipped": self.samples_skipped}

    def _load(self, sd: dict[str, Any]) -> None:
        load_live_state(self.opt, sd)
        self.sched.load_state_dict(sd["sched"])
        self.samples_skipped = sd["skipped"]

    def resume_at(self, step: int) -> None:
        """After a checkpoint restore: the manager's count of committed steps is the checkpoint's."""
        self.manager.load_state_dict({"step": step - 1, "batches_committed": self.manager.batches_committed()})

    def begin(self, step: int) -> None:
        self.manager.start_quorum()

    def global_loss(self, loss: float) -> float:
        """The job's loss averaged over the groups that trained this step (a recovering group contributes nothing)."""
        t = torch.tensor([loss], dtype=torch.float32)  # the job's float32 sum: as float32 as the plain run's own all-reduce
        dist.all_reduce(t, group=self.group, op=dist.ReduceOp.AVG)
        return float(t)

    def should_commit(self) -> bool:
        """torchft's vote: every group's ranks succeeded; a recovering group loads the peer's state here."""
        self.manager.wait_quorum()  # the quorum thread is done with this step's state (a peer's copy is taken)
        self.live, self.trained = self.manager.num_participants(), self.manager.is_participating()
        self.committed = self.manager.should_commit()
        if self.committed:
            self.samples_skipped += (self.groups - self.live) * self.job_samples
        return self.committed

    def saves(self) -> bool:
        """Only the group at participating rank 0 writes the shared checkpoint (TorchTitan's torchft checkpoint rule)."""
        return self.committed and self.manager.participating_rank() == 0

    def row(self, step: int, r: StepRow, parts: list[torch.nn.Module]) -> dict[str, Any]:
        """Per step: live groups, what was trained, what was skipped; tokens/s and MFU count only trained tokens; at
        monitor.integrity.interval the replica groups' checksums compared."""
        out: dict[str, Any] = {
            "step": self.manager.current_step() if self.committed else step,  # a recovering group trained its peers' step
            "ft_replica_id": self.replica_id,
            "ft_live_groups": self.live,
            "ft_committed": self.committed,
            "ft_trained": self.trained and self.committed,
            "samples_trained": self.live * self.job_samples if self.committed else 0,
            "tokens_trained": self.live * self.job_samples * self.seq_len if self.committed else 0,
            "samples_skipped": self.samples_skipped,
        }
        share = 1.0 if out["ft_trained"] else 0.0
        out |= {k: v * share for k in ("tokens_per_s", "mfu", "mfu_6n", "hfu") if (v := getattr(r, k)) is not None}
        if self.check_every and step % self.check_every == 0 and out["ft_trained"]:
            out |= self.compare_replicas(parts)
        return out

    def compare_replicas(self, parts: list[torch.nn.Module]) -> dict[str, Any]:
        """This rank's parameter checksum against the same rank of every live group, through torchft's managed group:
        the sums of the checksum's low bits and of their squares equal n times this rank's only if all n agree."""
        values = list(integrity.checksums(parts).values())
        crc = zlib.crc32(json.dumps(values).encode())
        low = crc % MOMENT_MOD
        t = torch.tensor([float(low), float(low) ** 2], dtype=torch.float64)
        n = self.manager.num_participants()
        dist.all_reduce(t, group=self.group, op=dist.ReduceOp.SUM)
        agree = t.tolist() == [n * float(low), n * float(low) ** 2]
        if not agree:
            raise integrity.IntegrityError(
                f"torchft replica groups disagree: replica {self.replica_id}'s checksum {crc} is not every live group's"
            )
        return {"ft_checksum": crc, "ft_replicas_agree": agree}

    def next_step(self, step: int) -> int:
        """The step after the last one the quorum committed (a recovered group jumps to its peers' step)."""
        return self.manager.current_step() + 1

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def _params(opt) -> list[torch.nn.Parameter]:
    """The optimizer's parameters: FSDP's sharded DTensors, the same objects for the whole run. Not module.parameters():
    FSDP swaps a module's registered parameters for unsharded ones during its forward and backward, and another
    thread reading them then (torchft's quorum thread does) gets tensors whose storage FSDP frees (seen: a
    segmentation fault, and a full 256-element norm weight sent where its 128-element shard was expected)."""
    return [p for o in titan.optimizers(opt) for g in o.param_groups for p in g["params"]]


def _state(opt) -> dict:
    """Parameter -> the optimizer state of the container's optimizer that holds it (a torch optimizer's `state`, a
    defaultdict: a parameter that has not stepped yet gets an empty one to fill)."""
    return {p: o.state[p] for o in titan.optimizers(opt) for g in o.param_groups for p in g["params"]}


def live_state(opt) -> dict[str, Any]:
    """This rank's shards of the weights and the optimizer state, as plain tensors in parameter order. Called on
    torchft's quorum thread while the main thread trains, so it issues no collective (DCP's state-dict API gathers
    over the job's group, which the main thread's FSDP collectives share: gloo aborted on the interleaving)."""
    with torch.no_grad():
        params = _params(opt)
        held = _state(opt)
        state = [{k: integrity.local_shard(v).detach().clone() for k, v in held[p].items()} for p in params]
        groups = [{k: v for k, v in g.items() if k != "params"} for o in titan.optimizers(opt) for g in o.param_groups]
        return {"params": [integrity.local_shard(p).detach().clone() for p in params], "optim": state, "groups": groups}


def load_live_state(opt, sd: dict[str, Any]) -> None:
    """Copy a peer's live_state (the same rank of a group of the same layout) into this rank's shards, in place; an
    optimizer that has not stepped yet gets its state built around the received shards."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        held = _state(opt)
        for p, v, st in zip(_params(opt), sd["params"], sd["optim"], strict=True):
            integrity.local_shard(p).copy_(v)
            mine = held[p]
            for k, got in st.items():
                if k in mine:
                    integrity.local_shard(mine[k]).copy_(got)
                elif isinstance(p, DTensor) and got.shape == p.to_local().shape and got.dim() > 0:
                    mine[k] = DTensor.from_local(got, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                else:
                    mine[k] = got
        for g, src in zip([g for o in titan.optimizers(opt) for g in o.param_groups], sd["groups"], strict=True):
            g.update(src)


def _set_all_reduce_hook(parts: list[torch.nn.Module], group) -> None:
    """Average each FSDP module's reduce-scattered gradient over the live replica groups (TorchTitan's
    TorchFTManager.maybe_set_all_reduce_hook)."""
    from torch.distributed.fsdp import FSDPModule

    def hook(output: torch.Tensor) -> None:
        dist.all_reduce(output, group=group, op=dist.ReduceOp.AVG)

    for part in parts:
        for m in part.modules():
            if isinstance(m, FSDPModule):
                m.set_all_reduce_hook(hook)


def all_heartbeating(top: Path, replica_id: int, groups: int, timeout_s: float, policy) -> None:
    """A fresh run's first quorum must hold every group: the lighthouse waits (join_timeout_ms) only for groups whose
    manager already heartbeats, and groups reach that point seconds apart. Each group's rank 0 marks its manager
    started in the run folder (shared by the nodes) and waits for the others' marks; a restarted group does not wait."""
    if dist.get_rank() == 0:
        ready = top / runfiles.FT_READY
        ready.mkdir(exist_ok=True)
        (ready / str(replica_id)).touch()
        deadline = time.monotonic() + timeout_s
        while len(list(ready.iterdir())) < groups:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"torchft: only replica groups {sorted(p.name for p in ready.iterdir())} of {groups} started in {timeout_s} s"
                )
            time.sleep(0.1)
    policy.barrier()


def replica(cfg: RunConfig, parts: list[torch.nn.Module], opt, sched, policy, run_dir: Path) -> Off | Replica:
    return Replica(cfg, parts, opt, sched, policy, run_dir) if ftc.enabled(cfg) else OFF
