"""Attribution of a flagged step: the data or the hardware, decided before the optimizer acts.

When the loss guard flags a step (a finite spike or a non-finite value), every rank replays that step's forward and
backward on the same batch from the same RNG state, clips again, and compares its loss share, the squared norm of
its gradient shards and the global gradient norm bitwise with the first pass (the replay check's machinery,
runner.observe.integrity). A batch that makes the loss explode does so again, bit for bit: a **data** verdict, and
the guard's action applies. A replay that differs on some rank is a computation that does not reproduce: a
**hardware** verdict naming the rank and its host; the step is not applied and `monitor.integrity.on_mismatch`
decides, as for a replica mismatch. Every rank judges alike (one all-gather of the two passes' fingerprints).

A device that is wrong the same way twice reproduces itself, so the first passes are also compared across ranks
where they must agree: every rank holds the same global grad norm (the clip all-reduces it), and the ranks of a
tensor-parallel group the same loss share (TorchTitan replicates the loss over tp). A rank off the majority of its
peers (with two peers, both) is a hardware verdict too.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runner.formats import runfiles
from runner.observe import integrity, layer_stats
from runner.schema import MismatchAction

DATA, HARDWARE = "data", "hardware"


class Attributor:
    """Replays flagged steps, records each verdict in spikes.jsonl (rank 0) and counts them (one per rank)."""

    def __init__(
        self, policy, who: list[dict[str, Any]], rank: int, run_dir: Path, on_mismatch: MismatchAction, tp_groups: list[list[int]]
    ):
        self.policy, self.who, self.rank, self.on_mismatch, self.tp_groups = policy, who, rank, on_mismatch, tp_groups
        self.path = run_dir / runfiles.SPIKES
        self.counts = {DATA: 0, HARDWARE: 0}

    def judge(
        self, step: int, verdict, first: tuple[float, float], again: Callable[[], tuple[float, float]], parts, zero_grad, rng, mon, samples,
        blame: Callable[[], dict[str, Any] | None] = lambda: None,
    ):  # fmt: skip
        """first: this rank's loss share and the global grad norm of the first pass, whose (clipped) gradients are still in
        place; again() recomputes the step and clips, from the RNG state `rng`; samples() lists the step's global samples
        and their origin (recorded with a data verdict); blame() the block where the replay's statistics say the spike
        started (runner.observe.layer_stats; None without them). Returns the verdict's record."""
        a = {"loss": first[0], "grad_sq": integrity.grad_sq(parts), "grad_norm": first[1]}
        zero_grad()
        self.policy.set_rng_state(rng)
        mon.faults.attributing = True  # the test-only transient fault does not strike again
        try:
            loss, norm = again()
        finally:
            mon.faults.attributing = False
        b = {"loss": loss, "grad_sq": integrity.grad_sq(parts), "grad_norm": norm}
        runs = self.policy.all_gather_object((a, b))
        differ = integrity.replay_verdict(step, runs, self.who) or peer_mismatches(step, [a for a, _ in runs], self.tp_groups, self.who)
        kind = HARDWARE if differ else DATA
        ranks = sorted({m["rank"] for m in differ}) if differ else list(range(len(runs)))
        action = self.on_mismatch.value if differ else verdict.action
        entry = {"step": step, "metric": verdict.metric, "value": verdict.value, "median": verdict.median, "verdict": kind}
        entry |= {"ranks": ranks, "hosts": sorted({self.who[r]["host"] for r in ranks}), "action": action, "spike": verdict.spike}
        if differ:
            entry["check"] = differ[0]["check"]  # replay: a pass that did not reproduce; peers: ranks that must agree did not
        if where := blame():
            entry["block"] = where
        if kind == DATA:
            entry["samples"] = samples()  # the batch that spiked: every global sample of the step, left out unless accepted
        self.counts[kind] += 1
        if self.rank == 0:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(entry) + "\n")
            print(line(entry), flush=True)
        return entry | {"mismatches": differ}

    def summary(self) -> dict[str, Any]:
        return {"spike_verdicts": dict(self.counts)}


def peer_mismatches(step: int, first: list[dict], tp_groups: list[list[int]], who: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ranks whose first pass disagrees with peers that must agree: the global grad norm over all ranks, the loss share
    over each TP group. The majority's value is the reference; without a majority every rank of the group is named."""
    out = []
    for key, groups in (("grad_norm", [list(range(len(first)))]), ("loss", tp_groups)):
        for group in groups:
            bits = {r: integrity.bits(first[r][key]) for r in group}
            top, n = Counter(bits.values()).most_common(1)[0]
            if n == len(group):
                continue
            odd = [r for r in group if bits[r] != top] if n > len(group) / 2 else group
            for r in odd:
                out.append({"step": step, "check": "peers", "rank": r, "host": who[r]["host"], "value": key, "group": group})
                out[-1]["values"] = {str(p): first[p][key] for p in group}
    return out


def line(e: dict[str, Any]) -> str:
    """The console's one line for a verdict."""
    head = f"spike attribution: step {e['step']} {e['spike']}: {e['verdict']}"
    block = f"; {layer_stats.describe(e['block'])}" if "block" in e else ""
    if e["verdict"] == DATA:
        n = len(e["ranks"])
        return f"{head} (the replay reproduces it bitwise on all {n} ranks: the batch, not the machine): {e['action']}{block}"
    where = f"rank {', '.join(map(str, e['ranks']))}, host {', '.join(e['hosts'])}"
    why = f"the replay differs on {where}" if e["check"] == "replay" else f"{where} disagrees with peers that must agree"
    return f"{head} ({why}): step not applied; monitor.integrity.on_mismatch={e['action']}{block}"
