"""Hang forensics, after the fact: which collective each rank was in when the job stopped.

`build_report`, in the launcher after the agent has stopped the job, reads the records each rank's
runner.observe.rank_recorder.RankRecorder kept on disk and names the ranks that did not enter the collective their
peers wait in (`hang_report.json`), or, when no collective timed out, which ranks raised what (`failure_report.json`).
`last_alive`: where a rank that died silently stopped (the agent reads it before a restart).

Torch-free: the launcher and the tests use it before torch is imported.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from runner.formats import runfiles
from runner.observe.rank_recorder import QUORUM_TAG, dump_folder
from runner.schema import RunConfig

STALE_HEARTBEATS = 3  # a record older than this many heartbeats before the freshest one is a frozen rank
WATCHDOG = "Watchdog caught collective operation timeout"
"""What NCCL's watchdog logs (ProcessGroupNCCL) before TORCH_NCCL_ASYNC_ERROR_HANDLING=3 takes the process down."""
_WATCHDOG_LINE = re.compile(r"\[rank(\d+)\]:.*" + WATCHDOG)  # c10d prefixes its log lines with the global rank


def analyse_commands(folder: Path) -> list[str]:
    """torchfrtrace commands for the dumps in `folder`: its rank_<r> files, and each torchft quorum's sub-folder
    (files named by global rank alone, so the prefix is empty)."""
    out = [f"torchfrtrace {folder} --prefix rank_ --allow-incomplete-ranks"] if any(folder.glob("rank_[0-9]*")) else []
    for sub in sorted(p for p in folder.glob(f"rank_{QUORUM_TAG}*") if p.is_dir() and any(p.iterdir())):
        out.append(f"torchfrtrace {sub} --prefix '' --allow-incomplete-ranks")
    return out


def last_alive(run_dir: Path, attempt: int) -> tuple[int, float] | None:
    """The rank of `attempt` whose record went quiet first, among those that raised no error, and the last time it
    was known alive (its record's write or its last finished step): where a rank that died silently stopped."""
    quiet = [
        (max(r["time"], r.get("progress") or 0.0), rank)
        for rank, r in read_records(run_dir).items()
        if r["state"] == "running" and r.get("attempt") == attempt
    ]
    if not quiet:
        return None
    at, rank = min(quiet)
    return rank, at


def read_records(run_dir: Path) -> dict[int, dict[str, Any]]:
    out = {}
    for p in sorted((run_dir / runfiles.RANK_RECORDS).glob("rank_*.json")):
        body = json.loads(p.read_text())
        out[body["rank"]] = body
    return out


def _waiting_for(records: dict[int, dict], rank: int) -> dict[str, list[int]]:
    """Per group of `rank`: the members that have not entered a collective `rank` has entered (lower sequence number)."""
    rec, out = records[rank], {}
    for group, seq in rec["seq"].items():
        members = rec["groups"].get(group, {}).get("ranks", [])
        behind = [m for m in members if m != rank and (m not in records or records[m]["seq"].get(group, -1) < seq)]
        if behind:
            out[group] = behind
    return out


def _waiting_in(rec: dict[str, Any], groups: dict[str, list[int]]) -> list[dict[str, Any]]:
    """The collective `rec`'s rank waits in, per group: the flight-recorder entry with its sequence number."""
    known = (rec.get("stall") or {}).get("collectives") or {}
    out = []
    for group in groups:
        entry = known.get(group) if (known.get(group) or {}).get("seq") == rec["seq"][group] else None
        base = {"group": group, "group_desc": rec["groups"][group]["desc"], "group_ranks": rec["groups"][group]["ranks"]}
        out.append(base | {"seq": rec["seq"][group]} | ({"op": entry["op"], "input_sizes": entry["input_sizes"]} if entry else {}))
    return out


def build_report(records: dict[int, dict[str, Any]], world_size: int, heartbeat_s: float, torn_down: set[int] = frozenset()) -> dict:
    """missing_ranks: ranks with no record or a stale one (frozen), plus ranks that peers wait for and that wait for nobody.
    `torn_down`: ranks NCCL's watchdog ended (their records stop there, so they are not frozen; nor, then, is a rank whose
    record shows it waiting for peers)."""
    freshest = max((r["time"] for r in records.values()), default=0.0)
    stale = {r for r, rec in records.items() if rec["state"] == "running" and rec["time"] < freshest - STALE_HEARTBEATS * heartbeat_s}
    if torn_down:
        stale -= {r for r in stale if r in torn_down or _waiting_for(records, r)}
    waiting = {r: _waiting_for(records, r) for r in records if r not in stale}
    waiting = {r: w for r, w in waiting.items() if w}
    missing = set(range(world_size)) - set(records) | stale
    missing |= {m for w in waiting.values() for who in w.values() for m in who if m not in waiting}
    ranks = {}
    for r in range(world_size):
        rec = records.get(r)
        if rec is None:
            ranks[str(r)] = {"state": "no record"}
            continue
        entry = {k: rec[k] for k in ("host", "local_rank", "pid", "coords", "step", "phase", "error")}
        if r in missing:
            entry["state"] = "frozen (record stale)" if r in stale else "did not enter the collective its peers wait in"
            entry["last_seen_s_before_end"] = round(freshest - rec["time"], 1)
        elif r in waiting:
            how = " (timed out)" if rec["error"] else " (torn down by NCCL's watchdog)" if torn_down else ""
            entry["state"] = "waiting in collective" + how
            entry["waiting_in"] = _waiting_in(rec, waiting[r])
            entry["waiting_for"] = sorted({m for who in waiting[r].values() for m in who})
        else:
            entry["state"] = rec["state"]
        ranks[str(r)] = entry
    return {"missing_ranks": sorted(missing), "ranks": ranks}


def timed_out(agent_error: str, records: dict[int, dict[str, Any]]) -> bool:
    """A hang: a collective timed out (the agent's error or a rank's own), as opposed to a rank that raised."""
    errors = [agent_error, *((r.get("error") or "") for r in records.values())]
    return any("timed out" in e.lower() for e in errors)


def watchdog_ranks(run_dir: Path) -> list[int]:
    """Ranks whose torchrun log (logs/<rdzv id>/attempt_<n>/<local rank>/std{out,err}.log) has NCCL's watchdog timeout."""
    found = set()
    for log in (run_dir / runfiles.LOGS).glob("*/attempt_*/*/std*.log"):
        found |= {int(m.group(1)) for m in _WATCHDOG_LINE.finditer(log.read_text(errors="replace"))}
    return sorted(found)


def torn_down(failures: dict[int, Any]) -> dict[int, str]:
    """The agent's record of the ranks it lost (ChildFailedError.failures): rank -> the signal that ended it, or its exit code."""
    return {r: f.signal_name() if f.exitcode < 0 else f"exit code {f.exitcode}" for r, f in sorted(failures.items())}


def watchdog_timeout(records: dict[int, dict[str, Any]], lost: dict[int, str], logged: list[int]) -> bool:
    """NCCL's watchdog ended the job: with TORCH_NCCL_ASYNC_ERROR_HANDLING=3 it tears a timed-out rank down, so the rank's
    `except` never runs and its record carries no error. Either a rank's log has the watchdog's line, or every rank the
    agent lost died on SIGABRT while every rank's record shows it stalled (running, in a collective)."""
    if logged:
        return True
    stalled = all(rec["state"] == "running" and rec.get("stall") for rec in records.values())
    return bool(lost) and stalled and all(sig == "SIGABRT" for sig in lost.values())


def write_report(
    cfg: RunConfig, run_dir: Path, world_size: int, agent_error: str, lost: dict[int, str] | None = None
) -> tuple[str, Path] | None:
    """After the agent stopped a failed job: (cause, report path) from the ranks' records; None when no rank left one.
    `lost`: the ranks the agent saw fail (torn_down).

    A hang (collective timeout, raised on gloo, or NCCL's watchdog tearing ranks down) gets hang_report.json with the
    collective each rank was in and the flight-recorder dumps; a rank that raised gets failure_report.json with each
    rank's exception."""
    records = read_records(run_dir)
    if not records:
        return None
    lost, logged = lost or {}, watchdog_ranks(run_dir)
    watchdog = watchdog_timeout(records, lost, logged)
    if not (watchdog or timed_out(agent_error, records)):
        raised = {str(r): rec["error"] for r, rec in sorted(records.items()) if rec.get("error")}
        keys = ("host", "local_rank", "pid", "coords", "step", "phase", "state", "error")
        ranks = {str(r): {k: rec[k] for k in keys} for r, rec in sorted(records.items())}
        report = {"cause": "rank failure", "raised": raised, "ranks": ranks, "no_record": sorted(set(range(world_size)) - set(records))}
        path = run_dir / runfiles.FAILURE_REPORT
        path.write_text(json.dumps(report, indent=2) + "\n")
        return "rank failure", path
    report = {"cause": "collective timeout", "timeout_s": cfg.distributed.timeout_s}
    report |= build_report(records, world_size, cfg.distributed.heartbeat_s, set(lost) | set(logged) if watchdog else set())
    if watchdog:
        report["watchdog"] = {"lost": {str(r): why for r, why in lost.items()}, "logged_timeout": logged}
    folder = dump_folder(cfg, run_dir)
    if folder.is_dir():
        report["flight_recorder_dumps"] = str(folder)
        commands = analyse_commands(folder) or [f"torchfrtrace {folder} --prefix rank_ --allow-incomplete-ranks"]
        report["analyse_with"] = commands[0] if len(commands) == 1 else commands
    path = run_dir / runfiles.HANG_REPORT
    path.write_text(json.dumps(report, indent=2) + "\n")
    return "collective timeout", path
