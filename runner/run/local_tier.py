"""The node-local checkpoint tier (checkpoint.local): fast saves between the shared ones, replicated to a partner node.

Every rank saves its own shard of the whole training state (what the shared tier saves) as a DCP checkpoint of this rank
alone (`no_dist`: no collective, one `.metadata` per shard) into its node's local folder, asynchronously when
checkpoint.async_save is on, and publishes it like a shared checkpoint (COMPLETE.json with every file's size and CRC-32,
then one rename). A worker thread then sends the shard's files to the partner rank (the same local rank on the next
node) over a gloo group of its own, and keeps the copy its own source sent, so the loss of one node leaves every shard
somewhere. Folders and the restore rule: runner.formats.local_checkpoint.

At a restart every rank reports the intact shards on its node, all agree (runner.formats.local_checkpoint.choose) on the
newest local step that is whole across nodes and newer than the newest shared checkpoint; a rank whose own copy is gone
or damaged gets it from a rank that holds a copy, then every rank loads its own shard.
"""

from __future__ import annotations

import io
import pickle
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager

from runner.formats import checkpoint, local_checkpoint
from runner.run import mesh, titan
from runner.schema import CheckpointConfig


class LocalTier:
    def __init__(self, c: CheckpointConfig, shared: Path, *, origin: dict[str, Any], policy):
        """`shared`: the shared tier's folder (names this run's local root); `origin`: what the state is saved from
        (runner.formats.checkpoint.origin); `policy`: the device policy, whose host group gathers the nodes."""
        self.cfg, self.checksum, self.async_save, self.origin, self.policy = c.local, c.checksum, c.async_save, origin, policy
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        places = mesh.places(policy, self.rank)
        self.node = places[self.rank][0]
        self.root = local_checkpoint.root(c.local, self.node, shared)
        self.partner, self.source = local_checkpoint.partner(places, self.rank), local_checkpoint.source(places, self.rank)
        self.nodes = len({node for node, _ in places})
        self.first_on_node = self.rank == min(r for r, (node, _) in enumerate(places) if node == self.node)
        # the copies to and from the partner go over a group of their own, from this rank's worker thread
        self.group = dist.new_group(backend="gloo", group_desc="checkpoint_local")
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="ckpt-local")
        self.stager = DefaultStager(policy.staging_options()) if c.async_save else None
        self.staging: Future | None = None
        self.pending: Future | None = None
        self.published: list[int] = []

    def due(self, step: int) -> bool:
        return step % self.cfg.interval == 0

    def save(self, step: int, parts, opt, extra: dict[str, Any]) -> None:
        """Start (async) or write (sync) this rank's shard of the state after `step`, then its copy to the partner."""
        self.wait()
        partial = local_checkpoint.partial_path(self.root, step, self.rank)
        if partial.exists():  # cut off by a crash
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
        written, self.staging = titan.save_state(parts, opt, extra, partial, stager=self.stager, no_dist=True, asynchronous=self.async_save)
        if self.async_save:
            self.pending = self.worker.submit(self._publish, step, written, partial)
        else:
            self._publish(step, written, partial)

    def _publish(self, step: int, written: Future | None, partial: Path) -> None:
        if written is not None:
            written.result()
        info = {"step": step, "rank": self.rank, "node": self.node, **self.origin, "published": time.time()}
        final = local_checkpoint.shard_path(self.root, step, self.rank)
        checkpoint.publish(partial, final, info, checkpoint.file_records(partial, self.checksum))
        if self.partner is not None:
            got = self._exchange(_pack(final), self.partner, self.source)
            _unpack(got, self.root, step, self.source)
        local_checkpoint.prune(self.root, self.cfg.keep, [r for r in (self.rank, self.source) if r is not None])
        self.published.append(step)

    def _exchange(self, payload: bytes, to: int, frm: int) -> bytes:
        """Send `payload` to rank `to` and receive rank `frm`'s, over this tier's group."""
        out = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
        size_out, size_in = torch.tensor([out.numel()]), torch.zeros(1, dtype=torch.int64)
        for req in (dist.isend(size_out, to, group=self.group), dist.irecv(size_in, frm, group=self.group)):
            req.wait()
        buf = torch.empty(int(size_in.item()), dtype=torch.uint8)
        for req in (dist.isend(out, to, group=self.group), dist.irecv(buf, frm, group=self.group)):
            req.wait()
        return buf.numpy().tobytes()

    def staged(self) -> None:
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def poll(self) -> None:
        if self.pending is not None and self.pending.done():
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight is published here and copied to the partner (raises its error, if any)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def restore(self, shared_step: int | None, before: int | None, load: Callable[[Path], dict]) -> tuple[int | None, dict | None, str]:
        """Every rank: agree on the local step to restore (runner.formats.local_checkpoint.choose against the shared tier's
        newest `shared_step`), fetch this rank's shard from a rank holding a copy when its own is gone, and `load` it.
        Returns the step (None: use the shared tier), what `load` returned, and the reason in words."""
        self.wait()
        mine, skipped = local_checkpoint.held(self.root, self.origin)
        if self.first_on_node:
            for why in skipped:
                print(f"WARNING: skipping {why}", flush=True)
        choice = local_checkpoint.choose(self.policy.all_gather_object(mine), shared_step, before)
        if choice.step is None:
            return None, None, choice.why
        for rank, holder in sorted(choice.holders.items()):  # in one order on every rank: the pairs never wait in a cycle
            if holder == rank or self.rank not in (rank, holder):
                continue
            if self.rank == holder:
                for req in _send(_pack(local_checkpoint.shard_path(self.root, choice.step, rank)), rank, self.group):
                    req.wait()
            else:
                _unpack(_recv(holder, self.group), self.root, choice.step, rank)
        return choice.step, load(local_checkpoint.shard_path(self.root, choice.step, self.rank)), choice.why

    def remove(self) -> None:
        """A run that ended well deletes its local checkpoints (the first rank of each node, once all are done with them)."""
        self.wait()
        self.policy.barrier()
        if self.first_on_node and self.root.exists():
            shutil.rmtree(self.root)


def _pack(shard: Path) -> bytes:
    """A shard folder's files (its COMPLETE.json included) as one pickled {relative name: bytes}."""
    files = {str(p.relative_to(shard)): p.read_bytes() for p in sorted(shard.rglob("*")) if p.is_file()}
    buf = io.BytesIO()
    pickle.dump(files, buf, protocol=pickle.HIGHEST_PROTOCOL)
    return buf.getvalue()


def _unpack(payload: bytes, root: Path, step: int, rank: int) -> Path:
    """Write a packed shard of `rank` as this node's copy of it (atomically: a `.partial` folder renamed)."""
    partial, final = local_checkpoint.partial_path(root, step, rank), local_checkpoint.shard_path(root, step, rank)
    if partial.exists():
        shutil.rmtree(partial)
    for name, data in pickle.loads(payload).items():
        (partial / name).parent.mkdir(parents=True, exist_ok=True)
        (partial / name).write_bytes(data)
    if final.exists():  # a damaged copy, replaced
        shutil.rmtree(final)
    partial.rename(final)
    return final


def _send(payload: bytes, to: int, group) -> list:
    out = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return [dist.isend(torch.tensor([out.numel()]), to, group=group), dist.isend(out, to, group=group)]


def _recv(frm: int, group) -> bytes:
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, frm, group=group)
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(buf, frm, group=group)
    return buf.numpy().tobytes()
