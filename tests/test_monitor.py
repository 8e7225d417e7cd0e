"""Straggler monitor, loss guard, flight-recorder set-up and hang forensics, each proven by injecting its fault.

Two 4-rank launches (imports cost ~25-45 s each, so each launch carries several checks):
- `slow`: dp2_tp2 whose rank 2 the test stops for 60 ms of every 100 ms with SIGSTOP/SIGCONT from outside until
  step 11 (its own work, net of its waits inside collectives, must name it alone), step 8's batch is corrupted to NaN
  (guard: skip), and at step 11 rank 1 sleeps before its forward past distributed.timeout_s (the hang). The rank slowed
  from inside (a busy forward) rides on tests/test_integrity.py's launch: two slow ranks in one launch would move the
  median the judges compare against, and a busy rank's own work grows too, so the outside case would prove nothing.
- `clean`: 31 clean steps of 4-rank HSDP (2 replicas x 2 shards; nobody may be flagged, by phase time or by
  arrival, and the replica and replay checks of tests/test_integrity.py find nothing; HSDP steps cost 0.4x a
  dp2_tp2 step here), steps 12-13 corrupted x1e4 (guard: rewind to step 10's checkpoint), then the test freezes
  rank 1 from outside with SIGSTOP.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from runner.formats import runfiles
from runner.observe import forensics, loss_guard, monitor, rank_recorder
from runner.run import startup
from runner.schema import Backend, DeviceType, GuardAction, LossGuardConfig, RunConfig, StragglerConfig, layout
from tests.conftest import ROOT, metrics, run_cli

TIMEOUT_S = 12
# The job must end on its own within this after the hang starts: the collective timeout, then at most
# distributed.shutdown_timeout_s (5) for the agent to stop the ranks. torch's own 30 s SIGTERM-to-SIGKILL
# wait would miss it with a SIGSTOPped rank (measured: 18 s with the configured 5 s, ~47 s without).
LIMIT_S = TIMEOUT_S + 25
SHORT = ["training.seq_len=64", "logging.progress=false", f"distributed.timeout_s={TIMEOUT_S}", "distributed.shutdown_timeout_s=5"]
STRAGGLER = ["monitor.straggler.interval=3", "monitor.straggler.windows=2", "monitor.straggler.factor=1.3"]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"  # a zombie runs nothing


def _records(run_dir: Path) -> dict[int, dict]:
    return forensics.read_records(run_dir)


STOP_S, PERIOD_S = 0.06, 0.1


def _duty_cycle(proc: subprocess.Popen, record: Path, until_step: int, cycles: list[int]) -> None:
    """Stop the rank whose record this is for STOP_S of every PERIOD_S (a noisy neighbour, from outside), from its first
    training step until its record reaches `until_step` or the job ends."""
    rec: dict = {}
    while proc.poll() is None and rec.get("step", 0) < 1:
        time.sleep(0.05)
        try:
            rec = json.loads(record.read_text())
        except (OSError, ValueError):
            pass
    try:
        while proc.poll() is None and json.loads(record.read_text())["step"] < until_step:
            os.kill(rec["pid"], signal.SIGSTOP)
            time.sleep(STOP_S)
            os.kill(rec["pid"], signal.SIGCONT)
            time.sleep(PERIOD_S - STOP_S)
            cycles.append(1)
    except (ProcessLookupError, KeyError, OSError, ValueError):
        pass
    finally:
        if "pid" in rec and not _gone(rec["pid"]):
            os.kill(rec["pid"], signal.SIGCONT)


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("slow") / "run"
    args = [*SHORT, *STRAGGLER, "training.steps=20", "monitor.inject.corrupt_steps=[8]", "monitor.inject.corrupt_scale=nan"]
    args += ["monitor.inject.hang_rank=1", "monitor.inject.hang_at_step=11"]
    argv = [sys.executable, "-m", "runner", *args, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "WANDB_SILENT": "true"}
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    cycles: list[int] = []
    record = run_dir / runfiles.RANK_RECORDS / "rank_2.json"
    stopper = threading.Thread(target=_duty_cycle, args=(proc, record, 11, cycles), daemon=True)
    stopper.start()
    out, err = proc.communicate(timeout=900)
    stopper.join(timeout=5)
    return run_dir, subprocess.CompletedProcess(argv, proc.returncode, out, err), time.time(), len(cycles)


def _burn_one_core() -> subprocess.Popen:
    """A competing process that keeps one core busy (an oversubscribed machine), until the caller kills it."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """31 clean steps with a rewind in the middle, under load: a process burns one core from the first training step
    (after the launcher measured the peak on an idle machine) until rank 1 is frozen with SIGSTOP from this process."""
    run_dir = tmp_path_factory.mktemp("clean") / "run"
    args = [
        *SHORT,
        *STRAGGLER,
        "parallelism=hsdp2x2",
        "cluster.devices_per_node=4",
        "monitor.integrity.interval=5",
        "monitor.integrity.replay_interval=9",
        "training.steps=40",
        "checkpoint=local",
        "checkpoint.interval=5",
        "checkpoint.keep=2",  # 3 checkpoints of disk (the pre-flight check), not all 8: CI machines can be short of it
        "monitor.guard.action=rewind",
    ]
    args += ["monitor.guard.max_consecutive=2", "monitor.inject.corrupt_steps=[12,13]", "monitor.inject.corrupt_scale=1e4"]
    argv = [sys.executable, "-m", "runner", *args, f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "WANDB_SILENT": "true"}
    )
    record = run_dir / runfiles.RANK_RECORDS / "rank_1.json"
    stopped_at, burner = None, None
    deadline = time.time() + 900
    try:
        while time.time() < deadline and proc.poll() is None:
            if record.exists():
                rec = json.loads(record.read_text())
                if burner is None and rec["step"] >= 1:
                    burner = _burn_one_core()
                if rec["step"] >= 32:
                    burner.kill()
                    os.kill(rec["pid"], signal.SIGSTOP)
                    stopped_at = time.time()
                    break
            time.sleep(0.2)
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()
    out, err = proc.communicate(timeout=900)
    return run_dir, subprocess.CompletedProcess(argv, proc.returncode, out, err), stopped_at, time.time()


# ---------------------------------------------------------------- straggler monitor


@pytest.mark.e2e
def test_rank_slowed_from_outside_is_flagged_alone_under_tp(slow):
    """The TP and FSDP collectives keep dp2_tp2's ranks in lockstep, so every rank's step is as long as the stopped
    rank's and arrival at the host collective tells little; its own work (the step less its waits) is what grows."""
    run_dir, proc, _, cycles = slow
    assert cycles > 20, proc.stderr[-3000:]  # the duty cycle ran through the training steps
    flagged = [json.loads(line) for line in (run_dir / runfiles.STRAGGLERS).read_text().splitlines()]
    assert {f["rank"] for f in flagged} == {2}, flagged  # nobody else, in any phase
    assert {f["phase"] for f in flagged} <= {"own", "arrival"} and "forward" not in {f["phase"] for f in flagged}
    own = [f for f in flagged if f["phase"] == "own"]
    assert own, flagged
    # step 1 is not judged; windows end at steps 4, 7, 10 (then the hang): named within three windows
    assert own[0]["step"] in (7, 10) and own[0]["windows"] >= 2 and own[0]["slowdown"] > 1.3
    assert (own[0]["local_rank"], own[0]["coords"]) == (2, {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 0})
    row = next(r for r in metrics(run_dir) if r["step"] == own[0]["step"])
    assert any(f["rank"] == 2 for f in row["stragglers"])
    flat = " ".join(proc.stdout.split())  # rich wraps the console at its width
    assert "local rank 2, mesh pp=0 dp_replicate=0 dp_shard=1 cp=0 tp=0) own work (its step less its waits in collectives) " in flat


@pytest.mark.e2e
def test_clean_run_flags_nobody_over_30_steps(clean):
    """Under load (a process burning one of the machine's cores): every rank is descheduled now and then."""
    run_dir = clean[0]
    rows = metrics(run_dir)
    assert max(r["step"] for r in rows) >= 31
    assert max(r["straggler_windows"] for r in rows) >= 10  # windows ending at steps 4, 7, ..., 31 were all judged
    flagged = run_dir / runfiles.STRAGGLERS
    assert not flagged.exists(), flagged.read_text()
    assert not any("stragglers" in r for r in rows)


@pytest.mark.e2e
def test_clean_run_logs_per_block_statistics(clean):
    """Every logged step of the HSDP run (2 replicas x 2 shards: each shard held twice) carries its 6 blocks' statistics,
    finite, with no non-finite value; counted once per element, the blocks' squared gradient norms add up to less than
    the global one (the embeddings and the output hold the rest: a shard counted twice would overshoot)."""
    rows = metrics(clean[0])
    assert all(len(r["layers"]["grad_norm"]) == 6 for r in rows)
    for r in rows:
        got = r["layers"]
        assert got["nonfinite"] == [0] * 6 and all(0 < v < math.inf for f in ("grad_norm", "act_max", "weight_max") for v in got[f])
        assert sum(g * g for g in got["grad_norm"]) < r["grad_norm"] ** 2 * (1 + 1e-3)


@pytest.mark.e2e
def test_clean_run_replicas_agree_and_replays_reproduce(clean):
    """HSDP replicas (ranks 0|2 and 1|3) compared at steps 5, 10, 15, ..., 30 (across the rewind), replays at 9, 18, 27."""
    run_dir, proc = clean[0], clean[1]
    assert not (run_dir / runfiles.INTEGRITY_REPORT).exists()
    rows = metrics(run_dir)
    assert not any("integrity" in r for r in rows)
    by_step = {r["step"]: r for r in rows}  # the last row of a step (steps 11-13 ran twice)
    # checks at 5, 10, ..., 30 (the rewind restarts at 11), replays at 9, 18, 27
    assert (by_step[31]["integrity_checks"], by_step[31]["replay_checks"]) == (6, 3)
    line = "integrity: 2 groups of 2 replicas compare parameter checksums every 5 steps (on mismatch: stop); replay check every 9 steps"
    assert line in proc.stdout


def test_straggler_judge_needs_consecutive_windows():
    judge = monitor.StragglerJudge(StragglerConfig(factor=1.3, windows=3, min_seconds=0.005))
    even = [{"forward": 1.0, "backward": 2.0}] * 4
    slow2 = [*even[:2], {"forward": 1.5, "backward": 2.0}, even[3]]
    assert judge.update(slow2) == [] and judge.update(slow2) == []
    assert judge.update(even) == []  # the streak is broken
    assert judge.update(slow2) == [] and judge.update(slow2) == []
    (f,) = judge.update(slow2)
    assert (f["rank"], f["phase"], f["windows"]) == (2, "forward", 3) and f["slowdown"] == pytest.approx(1.5)
    tiny = [{"optimizer": 0.001}, {"optimizer": 0.001}, {"optimizer": 0.004}]
    assert all(monitor.StragglerJudge(StragglerConfig(windows=1), ("optimizer",)).update(tiny) == [] for _ in range(3))


def test_straggler_judge_floors_the_excess_in_seconds_and_against_the_step():
    """The clean run that flagged rank 2's optimizer at 1.33x (7.6 vs 5.7 ms, a 0.3 s step) flags nobody: 1.9 ms is under
    min_excess_s (5 ms). A 10 ms excess is over it but under 2 % of a 1 s step; the same excess in a 0.4 s step is flagged."""
    cfg = StragglerConfig(factor=1.3, windows=1, min_seconds=0.005, min_excess_s=0.005, min_step_frac=0.02)

    def window(slow: float, base: float, step: float) -> list[dict[str, float]]:
        return [{"optimizer": slow if r == 2 else base, "own": step / 2, "waits": step / 2} for r in range(4)]

    judge = monitor.StragglerJudge(cfg, ("optimizer",))
    assert judge.update(window(0.0076, 0.0057, 0.3)) == []  # 1.33x, but 1.9 ms
    assert judge.update(window(0.030, 0.020, 1.0)) == []  # 1.5x and 10 ms, but 1 % of the step
    (f,) = judge.update(window(0.030, 0.020, 0.4))  # 10 ms = 2.5 % of the step
    assert (f["rank"], f["slowdown"]) == (2, pytest.approx(1.5))
    off = monitor.StragglerJudge(StragglerConfig(windows=1, min_excess_s=0, min_step_frac=0), ("optimizer",))
    assert off.update(window(0.0076, 0.0057, 0.3))[0]["rank"] == 2  # without the floors the noise is flagged


# ---------------------------------------------------------------- loss guard


@pytest.mark.e2e
def test_non_finite_batch_is_skipped_and_never_reaches_the_weights(slow):
    run_dir, proc, _, _ = slow
    rows = {r["step"]: r for r in metrics(run_dir)}
    assert math.isnan(rows[8]["loss"]) and rows[8]["action"] == "skip" and "non-finite" in rows[8]["spike"]
    assert rows[8]["skipped_steps"] == 1 and rows[7]["skipped_steps"] == 0
    # one NaN update would make every later loss NaN
    assert all(math.isfinite(rows[s]["loss"]) and math.isfinite(rows[s]["grad_norm"]) for s in range(9, 11))
    assert "loss guard: step 8 non-finite (loss nan, grad norm nan): skip" in " ".join(proc.stdout.split())
    # replayed before the optimizer acted: the NaN reproduces bitwise on every rank, so it is the batch's
    (e,) = [json.loads(line) for line in (run_dir / runfiles.SPIKES).read_text().splitlines()]
    assert (e["step"], e["verdict"], e["ranks"], e["action"], e["metric"]) == (8, "data", [0, 1, 2, 3], "skip", "loss")
    # where it started: the NaN loss makes every block's gradients NaN, counted per block; the backward starts at block 5
    assert all(n > 0 for n in rows[8]["layers"]["nonfinite"]) and (e["block"]["block"], e["block"]["rise"]) == (5, math.inf)
    assert "block 5's gradient norm is non-finite" in proc.stdout
    assert (
        "spike attribution: step 8 non-finite (loss nan, grad norm nan): data (the replay reproduces it bitwise on all 4 ranks"
        in " ".join(proc.stdout.split())
    )


@pytest.mark.e2e
def test_repeated_spikes_rewind_to_last_checkpoint(clean):
    run_dir = clean[0]
    rows = metrics(run_dir)
    steps = [r["step"] for r in rows]
    assert steps[:15] == [*range(1, 14), 11, 14]  # 12 spikes (skip), 13 spikes again -> rewind to 10, replay 11, leave out 12-13
    r12, r13 = rows[11], rows[12]
    assert r12["action"] == "skip" and r12["spike"].startswith("loss ") and r12["loss"] > 1000
    assert r13["action"] == "rewind" and r13["rewound_to"] == 10 and r13["bad_steps"] == [12, 13]
    first11, replay11 = rows[10], rows[13]
    assert (replay11["loss"], replay11["grad_norm"]) == (first11["loss"], first11["grad_norm"])  # model + optimizer restored exactly
    assert replay11["repeat"] is True and "repeat" not in first11 and replay11["attempt"] == 0
    # the checkpoint rewound to stays until two newer ones are published (keep 2), then goes as any other
    log = (run_dir / "runner.log").read_text()
    assert (
        log.index("loss guard: step 13")
        < log.index("checkpoint: deleted step-10 (keep 2)")
        > log.index("published " + str(run_dir / "checkpoints" / "step-20"))
    )
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-25", "step-30"]
    assert all(r["loss"] < 10 for r in rows[13:])
    spikes = [json.loads(line) for line in (run_dir / runfiles.SPIKES).read_text().splitlines()]
    assert [(e["step"], e["verdict"], e["action"]) for e in spikes] == [(12, "data", "skip"), (13, "data", "rewind")]


def test_loss_guard_decisions():
    g = loss_guard.LossGuard(LossGuardConfig(factor=3.0, window=4, warmup_steps=2, action=GuardAction.rewind, max_consecutive=2))
    assert g.check(1, float("nan"), 1.0).action == "skip"  # non-finite is caught before any history exists
    assert g.check(2, 50.0, 1.0).action == "ok"  # no history yet: not judged
    assert g.check(3, 8.0, 1.0).action == "ok"
    assert g.check(4, 8.0, 3.5).spike.startswith("grad norm 3.5 > 3 x running median")
    v = g.check(5, 1e4, 1.0)
    assert (v.action, g.streak_start, g.rewinds, sorted(g.bad_steps)) == ("rewind", 4, 1, [1, 4, 5])
    assert g.check(6, 7.9, 1.0).action == "ok" and g.skipped == 3
    off = loss_guard.LossGuard(LossGuardConfig(enable=False, warmup_steps=0))
    assert off.check(1, 1.0, 1.0).action == "ok" and off.check(2, 1e9, 1.0).action == "ok"
    assert off.check(3, float("inf"), 1.0).action == "skip"  # a non-finite loss never updates weights, guard on or off


def _replay(g: loss_guard.LossGuard, losses: dict[int, float], every: int, last: int) -> tuple[list[int], list[str]]:
    """The step loop around a guard, as step_loop.step and rewind drive it: a rewind goes back to the newest checkpoint
    (one every `every` steps) before the streak and leaves the guard's bad steps out. Returns the steps trained or
    skipped in order and the verdict lines."""
    steps, lines, step = [], [], 1
    while step <= last:
        if step in g.bad_steps:
            step += 1
            continue
        steps.append(step)
        v = g.check(step, losses[step], 1.0)
        if v.action == "accept":
            lines.append(g.describe(step, v))
        step = (g.streak_start - 1) // every * every + 1 if v.action == "rewind" else step + 1
    return steps, lines


def test_a_lasting_level_shift_rewinds_once_then_is_accepted():
    """The issue's run: checkpoints every 4 steps, every loss x5 from step 8 on, action=rewind. Steps 8-10 spike, the
    run rewinds to step 4 and replays 5-7; 11-13 spike again right after the rewind: the same shift, accepted at 13
    (no second rewind) with the medians restarted, and 14-20 train. Before, every step from 11 on was skipped."""
    g = loss_guard.LossGuard(LossGuardConfig(action=GuardAction.rewind))  # factor 3, window 20, warm-up 5, 3 in a row
    losses = {s: (5.0 if s >= 8 else 1.0) * (1 + 0.01 * s) for s in range(1, 21)}
    steps, lines = _replay(g, losses, every=4, last=20)
    assert steps == [*range(1, 11), 5, 6, 7, *range(11, 21)]
    assert (g.rewinds, g.skipped, sorted(g.bad_steps)) == (1, 5, [8, 9, 10, 11, 12])
    assert lines == [
        "loss guard: step 13: loss 5.65 > 3 x running median 1.05 again right after the rewind at step 10: a lasting level "
        "shift, not a spike: accepted, no second rewind, the running medians restart from this step"
    ]
    assert list(g.losses) == [losses[s] for s in range(13, 21)]
    # a new streak later on (not right after a rewind) rewinds again
    assert [g.check(s, 1e3, 1.0).action for s in (21, 22, 23)] == ["skip", "skip", "rewind"] and g.rewinds == 2


def test_a_spike_after_non_finite_steps_is_judged_against_the_medians_before_them():
    """Three NaN steps then a finite spike: the spike is skipped (one finite spike, not max_consecutive of them in a
    row); before, the fourth bad step in a row was accepted as a level shift and trained."""
    g = loss_guard.LossGuard(LossGuardConfig(max_consecutive=3))
    for s in range(1, 7):
        assert g.check(s, 1.0, 1.0).action == "ok"
    assert [g.check(s, math.nan, 1.0).action for s in (7, 8, 9)] == ["skip"] * 3
    v = g.check(10, 50.0, 1.0)
    assert (v.action, v.metric, v.value, v.median) == ("skip", "loss", 50.0, 1.0)
    assert [g.check(s, 50.0, 1.0).action for s in (11, 12, 13)] == ["skip", "skip", "accept"]  # the 4th finite one
    assert g.check(14, 51.0, 1.0).action == "ok"  # judged against the new level
    g.check(15, math.nan, 1.0)
    g.revert()  # the step was not the data's (a hardware verdict): as if never judged
    assert 15 not in g.bad_steps and g.skipped == 6 and g.consecutive == 0


# ---------------------------------------------------------------- hangs


def _check_hang(run_dir: Path, proc, hang_started: float, ended: float, frozen_state: str, groups=("mesh_",)) -> dict:
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "collective timeout: report in" in proc.stderr and "Traceback" not in proc.stderr.split("collective timeout")[-1]
    assert ended - hang_started < LIMIT_S, ended - hang_started
    report = json.loads((run_dir / runfiles.HANG_REPORT).read_text())
    assert report["missing_ranks"] == [1], report
    assert report["ranks"]["1"]["state"] == frozen_state
    assert report["timeout_s"] == TIMEOUT_S
    others = [report["ranks"][str(r)] for r in (0, 2, 3)]
    assert all(o["state"].startswith("waiting in collective") for o in others), others
    assert any(o["waiting_for"] == [1] for o in others)  # at least one peer waits for rank 1 directly; the rest wait behind it
    for o in others:
        for w in o["waiting_in"]:
            assert w["op"].startswith("gloo:") and w["group_desc"].startswith(groups) and w["seq"] > 0
            assert set(o["waiting_for"]) & set(w["group_ranks"])
    assert all(_gone(rec["pid"]) for rec in _records(run_dir).values())  # nothing left running
    return report


@pytest.mark.e2e
def test_sleeping_rank_hang_is_reported(slow):
    run_dir, proc, ended, _ = slow
    rank1 = _records(run_dir)[1]
    assert (rank1["step"], rank1["phase"]) == (11, "forward")
    report = _check_hang(run_dir, proc, rank1["phase_since"], ended, "did not enter the collective its peers wait in")
    assert any(f"Timed out waiting {TIMEOUT_S * 1000}ms" in (report["ranks"][str(r)]["error"] or "") for r in (0, 2, 3))
    dumps = sorted(p.name for p in (run_dir / "flight_recorder").iterdir())
    assert "rank_1" not in dumps and dumps  # the ranks that timed out dumped their recorder; the sleeper did not
    body = pickle.loads((run_dir / "flight_recorder" / dumps[0]).read_bytes())
    assert body["entries"] and all(v["ranks"].startswith("[") for v in body["pg_config"].values())  # torchfrtrace-ready


@pytest.mark.e2e
def test_torchs_analyzer_names_the_rank_the_hang_report_names(slow):
    """torchfrtrace (torch's flight-recorder analyzer, run as `torchfrtrace <run>/flight_recorder -p rank_`) reads the
    gloo dumps of the ranks that timed out and names the rank that left none: the hang report's missing rank."""
    from torch.distributed.flight_recorder import fr_trace

    run_dir = slow[0]
    report = json.loads((run_dir / runfiles.HANG_REPORT).read_text())
    assert report["missing_ranks"] == [1]
    with pytest.raises(AssertionError, match=r"^Missing dump files from ranks \{1\}$"):
        fr_trace.main([str(run_dir / "flight_recorder"), "-p", "rank_"])


@pytest.mark.e2e
def test_sigstopped_rank_hang_is_reported(clean):
    run_dir, proc, stopped_at, ended = clean
    assert stopped_at is not None, proc.stderr[-3000:]
    # 1-D FSDP: the mesh's only axis is the whole world, so the peers may wait in the default group; a peer may also be
    # inside the async checkpoint writer's collective (the run saves every 5 steps), on that named group
    groups = ("mesh_", "default_pg", "checkpoint_async")
    report = _check_hang(run_dir, proc, stopped_at, ended, "frozen (record stale)", groups=groups)
    assert report["ranks"]["1"]["last_seen_s_before_end"] >= forensics.STALE_HEARTBEATS


def test_hang_report_follows_the_chain_to_the_missing_rank():
    """0 waits for 1 in TP; 2 waits for 0 in FSDP (0 never got there); 1 waits for nobody."""
    groups = {"tp01": {"desc": "mesh_tp", "ranks": [0, 1]}, "dp02": {"desc": "mesh_fsdp", "ranks": [0, 2]}}

    def rec(rank, seq, t=100.0, state="running"):
        own = {g: v for g, v in groups.items() if rank in v["ranks"]}
        return {"rank": rank, "host": "h", "local_rank": rank, "pid": 1, "coords": {}, "step": 3, "phase": "forward", "error": None} | {
            "time": t,
            "state": state,
            "seq": {g: seq[g] for g in own},
            "groups": own,
            "stall": {"collectives": {"tp01": {"op": "gloo:all_reduce", "seq": 8, "input_sizes": [[4]]}}},
        }

    records = {0: rec(0, {"tp01": 8, "dp02": 5}), 1: rec(1, {"tp01": 7}), 2: rec(2, {"dp02": 6})}
    report = forensics.build_report(records, 3, heartbeat_s=1.0)
    assert report["missing_ranks"] == [1]
    assert report["ranks"]["0"]["waiting_for"] == [1] and report["ranks"]["0"]["waiting_in"][0]["op"] == "gloo:all_reduce"
    assert report["ranks"]["2"]["waiting_for"] == [0] and "op" not in report["ranks"]["2"]["waiting_in"][0]
    records[1]["time"] = 90.0  # frozen ten heartbeats ago
    assert forensics.build_report(records, 3, 1.0)["ranks"]["1"]["state"] == "frozen (record stale)"
    del records[1]
    assert forensics.build_report(records, 3, 1.0)["missing_ranks"] == [1]


def _nccl_watchdog_run(run_dir: Path, logged: bool) -> None:
    """The files an NCCL job leaves when rank 1 never enters an FSDP all-gather its peers wait in, at step 11, and NCCL's
    watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING=3) aborts the peers after the timeout: their records stop at their last
    heartbeat, running, with no error (the worker's `except` never ran); rank 1's goes on until the agent stops it 8 s
    later. Ranks 1-3 log to logs/<rdzv id>/attempt_0/<local rank>/stderr.log (rank 0 keeps the console)."""
    group = {"0": {"desc": "default_pg", "ranks": [0, 1, 2, 3]}}
    folder = run_dir / runfiles.RANK_RECORDS
    folder.mkdir(parents=True)
    for rank in range(4):
        seq = 40 if rank == 1 else 41
        entry = {"op": "nccl:_allgather_base", "group": "0", "group_desc": "default_pg", "seq": seq, "record_id": 90, "input_sizes": [[64]]}
        body = {"rank": rank, "host": "gpu-node-1", "local_rank": rank, "pid": 100 + rank, "coords": {"dp_shard": rank}, "step": 11}
        body |= {"time": 1000.0 + (8.0 if rank == 1 else 0.0), "state": "running", "phase": "forward", "phase_since": 980.0}
        body |= {"seq": {"0": seq}, "groups": group, "stall": {"since": 985.0, "collectives": {"0": entry}}, "error": None}
        (folder / f"rank_{rank}.json").write_text(json.dumps(body))
    for local in (1, 2, 3):
        log = run_dir / runfiles.LOGS / "runner-1a2b3c4d_x7q" / "attempt_0" / str(local) / "stderr.log"
        log.parent.mkdir(parents=True)
        lines = [f"[rank{local}]:W1201 10:00:01.000000 100 site-packages/torch/distributed/tensor/_dispatch.py:342] UserWarning"]
        if logged and local != 1:
            lines += [
                f"[rank{local}]:[E1201 10:16:40.408271257 ProcessGroupNCCL.cpp:632] [Rank {local}] {forensics.WATCHDOG}: "
                f"WorkNCCL(SeqNum=41, OpType=_ALLGATHER_BASE, NumelIn=64, NumelOut=256, Timeout(ms)={TIMEOUT_S * 1000}) ran for "
                f"{TIMEOUT_S * 1000 + 4} milliseconds before timing out.",
                f"[rank{local}]:[E1201 10:16:40.409000000 ProcessGroupNCCL.cpp:695] [Rank {local}] To avoid data inconsistency, "
                "we are taking the entire process down.",
            ]
        log.write_text("\n".join(lines) + "\n")


SIGABRT_AGENT_ERROR = """runner.worker FAILED
Root Cause (first observed failure):
[0]:
  rank      : 2 (local_rank: 2)
  exitcode  : -6 (pid: 102)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 102"""


@pytest.mark.parametrize("logged", [True, False])
def test_nccl_watchdog_teardown_is_reported_as_a_hang(tmp_path, logged):
    """A watchdog timeout on NCCL is a hang, not a rank failure, from the ranks' logs (the watchdog's line) or, without
    them, from the agent's record (the ranks it lost died on SIGABRT) and the records (every rank stalled in a
    collective); the missing rank is named as on gloo, and the torn-down ranks, whose records stopped early, are not."""
    run_dir = tmp_path / "run"
    _nccl_watchdog_run(run_dir, logged)
    got = forensics.write_report(_cuda_run_config(), run_dir, 4, SIGABRT_AGENT_ERROR, {2: "SIGABRT"})
    assert got == ("collective timeout", run_dir / runfiles.HANG_REPORT)
    assert not (run_dir / runfiles.FAILURE_REPORT).exists()
    report = json.loads(got[1].read_text())
    assert report["missing_ranks"] == [1]
    assert report["ranks"]["1"]["state"] == "did not enter the collective its peers wait in"
    for r in ("0", "2", "3"):
        assert report["ranks"][r]["state"] == "waiting in collective (torn down by NCCL's watchdog)"
        assert report["ranks"][r]["waiting_for"] == [1] and report["ranks"][r]["waiting_in"][0]["op"] == "nccl:_allgather_base"
    assert report["watchdog"] == {"lost": {"2": "SIGABRT"}, "logged_timeout": [2, 3] if logged else []}


def test_a_rank_that_raised_on_nccl_stays_a_rank_failure(tmp_path):
    """The watchdog rule does not swallow real failures: a rank that raised (its record says so, exit code 1) is one."""
    run_dir = tmp_path / "run"
    _nccl_watchdog_run(run_dir, logged=False)
    rec = json.loads((run_dir / runfiles.RANK_RECORDS / "rank_3.json").read_text())
    rec |= {"state": "failed", "error": "ValueError: bad batch"}
    (run_dir / runfiles.RANK_RECORDS / "rank_3.json").write_text(json.dumps(rec))
    assert forensics.write_report(_cuda_run_config(), run_dir, 4, "exitcode  : 1", {3: "exit code 1"})[0] == "rank failure"
    failures = {3: SimpleNamespace(exitcode=-6, signal_name=lambda: "SIGABRT"), 0: SimpleNamespace(exitcode=1, signal_name=lambda: "<N/A>")}
    assert forensics.torn_down(failures) == {0: "exit code 1", 3: "SIGABRT"}


# ---------------------------------------------------------------- flight recorder set-up, start-up block, config


@pytest.mark.e2e
def test_ranks_receive_flight_recorder_environment(slow):
    run_dir = slow[0]
    for rec in _records(run_dir).values():
        assert rec["env"]["TORCH_FR_BUFFER_SIZE"] == "2000"
        assert rec["env"]["TORCH_FR_DUMP_TEMP_FILE"] == str(run_dir.resolve() / "flight_recorder" / "rank_")


def test_cuda_flight_recorder_environment(tmp_path):
    cfg = RunConfig()
    cfg.cluster.device = DeviceType.cuda
    cfg.distributed.flight_recorder.buffer_size = 5000
    cfg.distributed.flight_recorder.enable_timing = True
    env = rank_recorder.rank_env(cfg, tmp_path)
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "5000" and env["TORCH_FR_BUFFER_SIZE"] == "5000"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and env["TORCH_NCCL_ENABLE_TIMING"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "flight_recorder" / "rank_")
    cfg.distributed.flight_recorder.enable = False
    assert rank_recorder.rank_env(cfg, tmp_path)["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "0"


@pytest.mark.e2e
def test_startup_block(slow):
    out = slow[1].stdout
    assert "layout tp2_dp2: dp_shard=2 x tp=2, 4 ranks on 1 node of 4" in out
    assert (
        "  dp_shard      size 2    ranks [0, 2]  link intra-node" in out
        and "  tp            size 2    ranks [0, 1]  link intra-node" in out
    )
    assert "precision fp32 (params float32, reductions float32); no modules converted" in out
    assert f"collective timeout {TIMEOUT_S} s" in out and "flight recorder: buffer 2000 collectives, dumps to " in out
    assert f"frozen config: {slow[0].resolve() / 'frozen.yaml'}" in out
    # dp_shard=2 x tp=2 holds each parameter shard once: nothing to compare, the replay check alone runs
    assert "integrity: no replicas in this layout (dp_replicate=1: every parameter shard is held once), so no replica check" in out


def test_startup_links_across_nodes(compose):
    cfg = compose(["cluster=h100x1024", "parallelism=tp8_pp4", "model=llama3_70b"])
    lay = layout.resolve(cfg.parallelism, cfg.cluster)
    text = startup.report(cfg, lay, Path("f.yaml"), Path("fr"), ["layers.0.attention.wq"])
    assert "  tp            size 8    ranks [0, 1, 2, 3, 4, 5, 6, 7]  link intra-node" in text
    assert "link scale-out" in text.split("  pp ")[1].splitlines()[0]
    assert "1 converted modules: layers.0.attention.wq" in text


@pytest.mark.e2e
def test_monitor_and_distributed_values_are_validated():
    proc = run_cli(
        "mode=validate",
        "monitor.straggler.factor=1.0",
        "monitor.guard.action=rewind",
        "distributed.timeout_s=2",
        "monitor.inject.corrupt_steps=[0,99]",
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    for text in (
        "monitor.straggler.factor = 1.0: a slowdown factor must exceed 1",
        "monitor.guard.action = rewind: rewinding needs checkpoints to rewind to. Fix: add checkpoint=local",
        "distributed.heartbeat_s = 1.0: must be > 0 and at most distributed.timeout_s / 4 = 0.5",
        "monitor.inject.corrupt_steps = [0, 99]: outside steps 1..10",
    ):
        assert text in proc.stderr, proc.stderr


@pytest.mark.e2e
def test_monitor_config_side_is_torch_free():
    modules = "runner.config.validate.monitor_rules, runner.observe.forensics, runner.observe.loss_guard, runner.observe.monitor"
    modules += ", runner.run.startup"
    code = f"import sys, {modules}\nprint('TORCH_LOADED', 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "TORCH_LOADED False" in out.stdout


def test_agent_stops_ranks_within_the_configured_shutdown_timeout():
    """torch 2.13 stops the ranks of a failed group with its 30 s default; the runner passes the configured one."""
    from types import SimpleNamespace

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from runner.run import procs

    procs.honour_shutdown_timeout()
    calls = []
    agent = SimpleNamespace(_shutdown_timeout=5, _shutdown=lambda **kw: calls.append(kw))
    LocalElasticAgent._stop_workers(agent, None)
    assert calls == [{"timeout": 5}]


def _cuda_run_config() -> RunConfig:
    cfg = RunConfig()
    cfg.cluster.device, cfg.cluster.backend = DeviceType.cuda, Backend.nccl
    return cfg


def test_dump_folder_exists_before_the_process_group_starts(monkeypatch, tmp_path):
    """NCCL's dump writer opens <TORCH_NCCL_DEBUG_INFO_TEMP_FILE><rank> without creating its folder: a timeout's dump is lost
    unless the folder exists before the group (and its watchdog) starts, on every path that starts a rank's group."""
    from runner.run import per_rank

    cfg = _cuda_run_config()
    seen = []
    monkeypatch.setattr(per_rank.titan, "init_process_group", lambda cfg, policy: seen.append(sorted(p.name for p in tmp_path.rglob("*"))))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    for key, value in rank_recorder.rank_env(cfg, tmp_path / "run").items():
        monkeypatch.setenv(key, value)
    per_rank.start_rank(cfg)
    assert seen == [["flight_recorder", "run"]]


def test_nccl_recorder_is_read_beside_the_host_groups(monkeypatch, tmp_path):
    """On NCCL the model's collectives are in NCCL's recorder, the host group's (gloo) in torch's generic one: a stalled
    rank's record names the collective of each."""
    import torch._C._distributed_c10d as c10d

    def dump(group: str, op: str) -> str:
        entry = {"process_group": [group, "desc"], "profiling_name": op, "collective_seq_id": 7, "record_id": 3}
        return json.dumps({"entries": [entry]})

    monkeypatch.setattr(c10d, "_dump_fr_trace_json", lambda *a: dump("1", "gloo:barrier"))
    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", lambda *a: dump("0", "nccl:all_reduce"), raising=False)
    got = rank_recorder.RankRecorder(_cuda_run_config(), tmp_path, 0, {})._in_flight()
    assert {g: c["op"] for g, c in got.items()} == {"0": "nccl:all_reduce", "1": "gloo:barrier"}
    assert list(rank_recorder.RankRecorder(RunConfig(), tmp_path, 0, {})._in_flight()) == ["1"]  # gloo: the generic recorder only


def test_waits_inside_collectives_are_timed_on_the_step_thread(tmp_path):
    """A rank's own work is its step less its waits inside collectives: c10d's Work.wait (FSDP2, the host collectives)
    and the functional collectives' wait_tensor (DTensor's TP), also when an AsyncCollectiveTensor is first waited for
    inside another op. A wait on another thread (a checkpoint's writer) is not the step's. One in-process gloo rank."""
    import threading

    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from runner.observe.waits import Waits

    class Counting:
        def start(self):
            return None

        def stop(self, started):
            return 1.0

        def resolve(self, value):
            return value

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        waits, original, original_wait_tensor = Waits(Counting()), torch._C._distributed_c10d.Work.wait, funcol.wait_tensor
        waits.start()
        try:
            dist.all_reduce(torch.ones(2))  # Work.wait
            funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD).wait()  # wait_tensor
            assert torch.equal(funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD) + 1, torch.full((2,), 2.0))  # waited in add
            other = threading.Thread(target=lambda: dist.all_reduce(torch.ones(2)))
            other.start()
            other.join()
        finally:
            waits.stop()
        assert waits.take() == 3.0
        dist.all_reduce(torch.ones(2))
        assert waits.take() == 0.0  # stopped: Work.wait is torch's own again
        assert torch._C._distributed_c10d.Work.wait is original and funcol.wait_tensor is original_wait_tensor
    finally:
        dist.destroy_process_group()
