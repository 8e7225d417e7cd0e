"""Silent data corruption: replicas of a parameter shard compare checksums; a replayed step must reproduce itself.

Replica check (`monitor.integrity.interval`, after Megatron's --check-weight-hash-across-dp-replicas-interval):
ranks that differ only in their dp_replicate coordinate hold bitwise-equal parameter shards (TorchTitan shards
over dp_shard x cp and tp, and splits pp into stages, never over dp_replicate). Every interval each rank sums
the bits of each local shard (the shard viewed as integers of its width and summed in that width, wrapping: any
single flipped bit changes the sum by a power of two modulo 2^width, and integer sums do not depend on the
order of the additions; in the element's own width the sum is vectorized, ~200x faster than accumulating
in int64), one all-gather brings every rank's sums to every rank, and each replica group is judged alike
everywhere: the checksum most of a group holds is the majority, the others the minority (with two replicas
neither side is a majority and both are named).

Replay check (`monitor.integrity.replay_interval`): the step's forward/backward runs twice on the same batch
from the same RNG state; each rank compares its loss share and the squared norm of its gradient shards bitwise.
A difference is a non-reproducible computation on that rank: it is reported and the run goes on (the replica
check decides about the state).
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from runner.formats import runfiles
from runner.schema import IntegrityConfig
from runner.schema.layout import Layout, group_of

INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class IntegrityError(RuntimeError):
    """Replicas diverged and monitor.integrity.on_mismatch=stop."""


def replica_groups(lay: Layout) -> list[list[int]]:
    """Groups of ranks that hold the same parameter shards (those differing only in dp_replicate); none without replicas."""
    if lay.dp_replicate < 2:
        return []
    return sorted({tuple(group_of(lay, r, "dp_replicate")) for r in range(lay.world_size)})


def local_shard(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores for a parameter (a DTensor's local shard), sharing its storage."""
    return p.to_local() if hasattr(p, "to_local") else p


def checksums(parts: list[torch.nn.Module]) -> dict[str, int]:
    """Per parameter: the wrapping sum of its local shard viewed as integers of the element width."""
    names, sums = [], []
    with torch.no_grad():
        for part in parts:
            for name, p in part.named_parameters():
                t = local_shard(p).detach().contiguous()
                names.append(name)
                width = INT_OF_WIDTH[t.element_size()]
                sums.append(t.view(width).sum(dtype=width).to(torch.int64))
    values = torch.stack(sums).cpu().tolist() if sums else []  # one device-to-host copy
    return dict(zip(names, values, strict=True))


def compare(step: int, table: list[dict[str, int]], groups: list[list[int]], who: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every parameter on which a replica group disagrees: majority and minority ranks, with their hosts."""
    found = []
    for group in groups:
        for name in table[group[0]]:
            values = {r: table[r].get(name) for r in group}
            if len(set(values.values())) == 1:
                continue
            top, n = Counter(values.values()).most_common(1)[0]
            major = [r for r in group if values[r] == top] if n > len(group) / 2 else []
            minor = [r for r in group if r not in major]
            side = lambda ranks: {"ranks": ranks, "hosts": sorted({who[r]["host"] for r in ranks})}  # noqa: E731
            found.append(
                {"step": step, "check": "replica", "parameter": name, "group": group}
                | {"majority": side(major), "minority": side(minor), "checksums": {str(r): values[r] for r in group}}
            )
    return found


def replay_verdict(step: int, runs: list[tuple[dict, dict]], who: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ranks whose replay differed. A loss share is computed by its rank alone, so a differing loss names the rank;
    gradients are reduced over ranks before anyone sees them, so a difference only there names every rank it reached."""
    by_loss = [r for r, (a, b) in enumerate(runs) if not same_bits(a["loss"], b["loss"])]
    by_grad = [r for r, (a, b) in enumerate(runs) if any(not same_bits(a[k], b[k]) for k in a if k != "loss")]
    out = []
    for r in by_loss or by_grad:
        a, b = runs[r]
        found = {"step": step, "check": "replay", "rank": r, "host": who[r]["host"], "first": a, "second": b}
        out.append(found | {"grads_differ_on": by_grad})
    return out


def bits(a: float) -> bytes:
    """A float's bits (a NaN reproduced as the same NaN compares equal; 0.0 and -0.0 do not)."""
    return struct.pack("<d", a)


def same_bits(a: float, b: float) -> bool:
    return bits(a) == bits(b)


def describe(m: dict[str, Any]) -> str:
    if m["check"] == "peers":  # runner.observe.attribution: a flagged step's first pass across ranks
        what = "global grad norm" if m["value"] == "grad_norm" else "loss share"
        who = f"rank {m['rank']} (host {m['host']})"
        return f"integrity: step {m['step']} {who} disagrees with its peers {m['group']} on its {what}: {m['values']}"
    if m["check"] == "replay":
        a, b = m["first"], m["second"]
        return (
            f"integrity: step {m['step']} replay differs on rank {m['rank']} (host {m['host']}): "
            f"loss share {a['loss']!r} then {b['loss']!r}; gradients (reduced over ranks) differ on ranks {m['grads_differ_on']}"
        )
    major, minor = m["majority"], m["minority"]
    if major["ranks"]:
        hosts = ", ".join(minor["hosts"]), ", ".join(major["hosts"])
        sides = f"ranks {minor['ranks']} (hosts {hosts[0]}) differ from the majority {major['ranks']} (hosts {hosts[1]})"
    else:
        sides = f"no majority among replicas {m['group']}: checksums {m['checksums']}"
    return f"integrity: step {m['step']} parameter {m['parameter']}: {sides}"


class Checker:
    """What the step loop calls: the replay, and the replica check at its interval (one per rank)."""

    def __init__(self, cfg: IntegrityConfig, lay: Layout, rank: int, policy, run_dir: Path, who: list[dict]):
        self.cfg, self.rank, self.policy, self.who = cfg, rank, policy, who
        self.groups = replica_groups(lay)
        self.path = run_dir / runfiles.INTEGRITY_REPORT
        self.found: list[dict[str, Any]] = []  # every mismatch of the run, as integrity_report.json lists them
        self.new: list[dict[str, Any]] = []  # those not yet attached to a metrics row (take)
        self.checks = self.replays = 0

    def replay_due(self, step: int) -> bool:
        return self.cfg.replay_interval > 0 and step % self.cfg.replay_interval == 0

    def replay(self, step: int, compute, parts: list[torch.nn.Module], zero_grad, mon) -> Any:
        """Run compute() twice from the same RNG state (gradients cleared between); compare bitwise; return the second result."""
        rng = self.policy.rng_state()
        first = compute()
        a = {"loss": float(first), "grad_sq": grad_sq(parts)}
        zero_grad()
        self.policy.set_rng_state(rng)
        mon.faults.replaying = True  # the test-only non-reproducible rank (fault_injection)
        try:
            second = compute()
        finally:
            mon.faults.replaying = False
        b = {"loss": float(second), "grad_sq": grad_sq(parts)}
        self.replays += 1
        self._record(replay_verdict(step, self.policy.all_gather_object((a, b)), self.who))
        return second

    def check_due(self, step: int) -> bool:
        return bool(self.groups) and self.cfg.interval > 0 and step % self.cfg.interval == 0

    def check(self, step: int, parts: list[torch.nn.Module]) -> list[dict[str, Any]]:
        """Compare every shard with its replicas; every rank returns the same mismatches."""
        table = self.policy.all_gather_object(checksums(parts))
        self.checks += 1
        found = compare(step, table, self.groups, self.who)
        self._record(found)
        return found

    def _record(self, found: list[dict[str, Any]]) -> None:
        if not found:
            return
        self.found += found
        self.new += found
        if self.rank == 0:
            body = {"on_mismatch": self.cfg.on_mismatch.value, "mismatches": self.found}
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(body, indent=1) + "\n")
            tmp.replace(self.path)
            for m in found:
                print(describe(m), flush=True)

    def take(self) -> list[dict[str, Any]]:
        """Mismatches found since the last call (for the step's metrics row)."""
        new, self.new = self.new, []
        return new

    def summary(self) -> dict[str, Any]:
        return {"integrity_checks": self.checks, "replay_checks": self.replays, "integrity_mismatches": len(self.found)}


def grad_sq(parts: list[torch.nn.Module]) -> float:
    """Sum of squares of this rank's local gradient shards (float64), a bitwise fingerprint of its backward."""
    total = torch.zeros((), dtype=torch.float64)
    for part in parts:
        for p in part.parameters():
            if p.grad is not None:
                total += local_shard(p.grad).detach().double().pow(2).sum().cpu()
    return float(total)
