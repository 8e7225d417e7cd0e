"""The live side of hang forensics: what each rank records while it runs, so that a report survives a rank that can no
longer write (SIGSTOP, a dead node).

- `rank_env`: the flight-recorder environment every rank receives before its process group exists (NCCL's recorder on
  CUDA, torch's backend-generic one on gloo) and the dump folder in the run folder.
- `RankRecorder`, inside each rank: the step loop marks its phase (a few attribute writes); a daemon thread writes
  `logs/ranks/rank_<r>.json` every `distributed.heartbeat_s` with the phase, step and the per-group collective
  sequence numbers (cheap counters of c10d). When neither moves for a heartbeat the rank is stalled, and the thread
  reads the flight recorder once for the collective it is in.

What the launcher makes of these records after the job stopped is runner.observe.forensics. Torch-free at import: the
launcher reads `rank_env` before torch is imported.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from runner.formats import runfiles
from runner.schema import RunConfig

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
