"""Hang forensics: which collective each rank was in when the job stopped.

Three pieces, so that the answer survives a rank that can no longer write (SIGSTOP, a dead node):
- `rank_env`: the flight-recorder environment every rank receives before its process group exists
  (NCCL's recorder on CUDA, torch's backend-generic one on gloo) and the dump folder in the run folder.
- `RankRecorder`, inside each rank: the step loop marks its phase (a few attribute writes); a daemon
  thread writes `logs/ranks/rank_<r>.json` every `distributed.heartbeat_s` with the phase, step and the
  per-group collective sequence numbers (cheap counters of c10d). When neither moves for a heartbeat the
  rank is stalled, and the thread reads the flight recorder once for the collective it is in.
- `build_report`, in the launcher after the agent has stopped the job: reads those files and names the
  ranks that did not enter the collective their peers wait in (`hang_report.json`), or, when no
  collective timed out, which ranks raised what (`failure_report.json`).

Torch-free at import: the launcher and the tests use the pure parts.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

from runner.formats import runfiles
from runner.schema import RunConfig

STALE_HEARTBEATS = 3  # a record older than this many heartbeats before the freshest one is a frozen rank
WATCHDOG = "Watchdog caught collective operation timeout"
"""What NCCL's watchdog logs (ProcessGroupNCCL) before TORCH_NCCL_ASYNC_ERROR_HANDLING=3 takes the process down."""
_WATCHDOG_LINE = re.compile(r"\[rank(\d+)\]:.*" + WATCHDOG)  # c10d prefixes its log lines with the global rank


# private_api: torchft_update_fr_path
QUORUM_TAG = "_quorum_"
"""torchft's Manager appends _quorum_<id> to the dump prefix's folder for every quorum."""


def dump_folder(cfg: RunConfig, run_dir: Path) -> Path:
    return run_dir / cfg.distributed.flight_recorder.folder


def rank_env(cfg: RunConfig, run_dir: Path) -> dict[str, str]:
    """Environment for every rank, set before init_process_group (the recorders read it there)."""
    fr = cfg.distributed.flight_recorder
    size = str(fr.buffer_size if fr.enable else 0)
    prefix = str(dump_folder(cfg, run_dir) / "rank_")  # torchfrtrace reads <folder>/<prefix><rank>
    env = {"TORCH_FR_BUFFER_SIZE": size, "TORCH_FR_DUMP_TEMP_FILE": prefix}
    from runner.run.device import DevicePolicy  # here: the launcher reads this module before torch is imported

    policy = DevicePolicy.of(cfg.cluster, cfg.distributed)
    env |= policy.flight_recorder_env(size, prefix, fr.enable and fr.dump_on_timeout, fr.enable_timing)
    return env


def dump_path(cfg: RunConfig, run_dir: Path, rank: int) -> Path:
    """Where this rank's recorder dump goes: <folder>/rank_<r>, or under fault_tolerance=torchft the file torchft's
    Manager named in TORCH_FR_DUMP_TEMP_FILE for the current quorum (Manager._update_fr_path:
    <folder>/rank__quorum_<id>/<global rank>)."""
    live = os.environ.get("TORCH_FR_DUMP_TEMP_FILE", "")
    return Path(live) if QUORUM_TAG in live else dump_folder(cfg, run_dir) / f"rank_{rank}"


def analyse_commands(folder: Path) -> list[str]:
    """torchfrtrace commands for the dumps in `folder`: its rank_<r> files, and each torchft quorum's sub-folder
    (files named by global rank alone, so the prefix is empty)."""
    out = [f"torchfrtrace {folder} --prefix rank_ --allow-incomplete-ranks"] if any(folder.glob("rank_[0-9]*")) else []
    for sub in sorted(p for p in folder.glob(f"rank_{QUORUM_TAG}*") if p.is_dir() and any(p.iterdir())):
        out.append(f"torchfrtrace {sub} --prefix '' --allow-incomplete-ranks")
    return out


def process_groups() -> dict[str, dict[str, Any]]:
    """This rank's process groups: name -> description, member ranks and the group object."""
    # private_api: torch_c10d_world
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    out = {}
    me = dist.get_rank()
    for pg, name in list(_world.pg_names.items()):
        ranks = sorted(_world.pg_group_ranks.get(pg, {}))
        if me in ranks and dist.get_backend(pg) in ("gloo", "nccl"):  # the fake groups of size-1 mesh axes have no counters
            out[name] = {"desc": getattr(pg, "group_desc", ""), "ranks": ranks, "pg": pg}
    return out


def _sequence_numbers(groups: dict[str, dict[str, Any]]) -> dict[str, int]:
    # private_api: torch_pg_sequence_number
    return {name: int(g["pg"]._get_sequence_number_for_group()) for name, g in groups.items()}


def make_dump_folders() -> None:
    """Create the folders of the recorders' dump prefixes (the environment's, as the recorders will read it) before the
    process group starts: NCCL's dump writer opens <prefix><rank> and does not create a missing folder."""
    for key in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        if os.environ.get(key):
            Path(os.environ[key]).parent.mkdir(parents=True, exist_ok=True)


def _last_collectives(nccl: bool) -> dict[str, dict[str, Any]]:
    """Last flight-recorder entry per process group (on gloo every entry reads 'scheduled', so the last is the one in flight).
    With `nccl` the NCCL groups' entries are NCCL's recorder's, read beside the generic one (the host group, on gloo)."""
    import torch._C._distributed_c10d as c10d

    # private_api: torch_dump_fr_trace_json, torch_dump_nccl_trace_json
    dumps = [c10d._dump_fr_trace_json(True, False)]
    if nccl:
        dumps.append(c10d._dump_nccl_trace_json(True, False))
    last: dict[str, dict[str, Any]] = {}
    for e in (e for d in dumps for e in json.loads(d).get("entries", [])):
        name, desc = e["process_group"]
        last[name] = {
            "op": e["profiling_name"],
            "group": name,
            "group_desc": desc,
            "seq": e["collective_seq_id"],
            "record_id": e["record_id"],
            "input_sizes": e.get("input_sizes"),
        }
    return last


def dump_flight_recorder(path: Path) -> None:
    """torch's flight recorder as a pickle torchfrtrace can read. On gloo its process-group table comes
    out empty (torchfrtrace then fails with KeyError: ('0', 0)), so fill it from c10d's own registry."""
    import pickle

    import torch._C._distributed_c10d as c10d

    # private_api: torch_dump_fr_trace
    body = pickle.loads(c10d._dump_fr_trace())
    body["pg_config"] = {
        name: {"name": name, "desc": g["desc"] or "undefined", "ranks": str(g["ranks"])} for name, g in process_groups().items()
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(body))


class RankRecorder:
    """Per-rank record of phase, step and collective counters, kept on disk by a daemon thread."""

    def __init__(self, cfg: RunConfig, run_dir: Path, rank: int, coords: dict[str, int]):
        self.path = run_dir / runfiles.RANK_RECORDS / f"rank_{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.interval = cfg.distributed.heartbeat_s
        self.use_fr = cfg.distributed.flight_recorder.enable
        from runner.run.device import DevicePolicy  # here: the launcher reads this module before torch is imported

        self.nccl = DevicePolicy.of(cfg.cluster, cfg.distributed).backend == "nccl"
        self.step, self.phase, self.since = 0, "start-up", time.time()
        self.static = {
            "rank": rank,
            "host": socket.gethostname(),
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
            "pid": os.getpid(),
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "coords": coords,
            "env": {k: v for k, v in os.environ.items() if k.startswith(("TORCH_FR_", "TORCH_NCCL_"))},
        }
        self.groups: dict[str, dict[str, Any]] = {}
        self.state, self.error, self.stall = "running", None, None
        self.progress: float | None = None  # when this rank last finished a step (wall clock)
        self._lock = threading.Lock()  # the step loop and the heartbeat thread both write the record
        self._last = None  # (phase, step, seqs) at the previous heartbeat
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="runner-heartbeat", daemon=True)

    def start(self) -> None:
        self.groups = process_groups()
        self._write(_sequence_numbers(self.groups))
        self._thread.start()

    def mark(self, phase: str, step: int | None = None) -> None:
        """Called by the step loop at each phase boundary: a clock read and three attribute writes."""
        self.phase, self.since = phase, time.time()
        if step is not None:
            self.step = step

    def finished_step(self) -> None:
        """The rank finished a step: its record goes to disk at once, so a rank that then dies without a word (SIGKILL, a
        lost node) leaves its last progress behind (the failure time of runner.outputs.goodput)."""
        self.progress = time.time()
        self._write(_sequence_numbers(self.groups))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.beat()

    def beat(self) -> None:
        if len(self.groups) != len(process_groups()):
            self.groups = process_groups()
        seqs = _sequence_numbers(self.groups)
        now = (self.phase, self.step, seqs)
        if now == self._last and self.stall is None:  # nothing moved for a heartbeat: stalled
            self.stall = {"since": time.time() - self.interval, "collectives": self._in_flight()}
        elif now != self._last:
            self.stall = None
        self._last = now
        self._write(seqs)

    def _in_flight(self) -> dict[str, Any] | None:
        """Last flight-recorder entry per group: with FSDP's prefetch the last one issued need not be the one waited in."""
        return _last_collectives(self.nccl) if self.use_fr else None

    def _write(self, seqs: dict[str, int]) -> None:
        body = {
            **self.static,
            "time": time.time(),
            "state": self.state,
            "step": self.step,
            "phase": self.phase,
            "phase_since": self.since,
            "seq": seqs,
            "groups": {n: {"desc": g["desc"], "ranks": g["ranks"]} for n, g in self.groups.items()},
            "stall": self.stall,
            "error": self.error,
            "progress": self.progress,
        }
        with self._lock:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(body))
            tmp.replace(self.path)

    def failed(self, exc: BaseException, cfg: RunConfig, run_dir: Path) -> None:
        """The rank is leaving with an error (e.g. a collective timed out): final record and, on gloo, the recorder dump."""
        self._stop.set()
        self.state, self.error = "failed", f"{type(exc).__name__}: {str(exc)[:500]}"
        if self.stall is None:
            self.stall = {"since": time.time(), "collectives": self._in_flight()}
        self._write(_sequence_numbers(self.groups))
        fr = cfg.distributed.flight_recorder
        hang = "timed out" in str(exc).lower()  # a rank that raised on its own is no hang: its traceback says it all
        from runner.run.device import DevicePolicy

        if hang and fr.enable and fr.dump_on_timeout and not DevicePolicy.of(cfg.cluster, cfg.distributed).collective_library_dumps:
            dump_flight_recorder(dump_path(cfg, run_dir, self.static["rank"]))

    def done(self) -> None:
        self._stop.set()
        self._thread.join()
        self.state, self.phase = "done", "done"
        self._write(_sequence_numbers(self.groups))


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
