"""Goodput accounting (runner.outputs.goodput) on hand-written timelines: a restart, a requeue, a rewind.

The launched runs that write real timelines are read by the tests that make them: the SIGKILL restart
(tests/test_checkpoint.py), the SLURM requeue (tests/test_slurm.py), the default run (tests/test_train.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.outputs import goodput, timeline


def _marks(job: int, attempt: int, t: float, restored: int = 0) -> list[dict]:
    """Start-up marks 0.5 s apart from t, the restore at t + 2.5."""
    names = ["rank_start", "main", "process_group", "built", "data"]
    out = [{"event": "mark", "job": job, "attempt": attempt, "name": n, "time": t + 0.5 * i} for i, n in enumerate(names)]
    return out + [{"event": "mark", "job": job, "attempt": attempt, "name": "restored", "time": t + 2.5, "step": restored}]


def _step(job: int, attempt: int, step: int, start: float, **extra) -> dict:
    """A step of 1 s on rank 0: 0.8 s of step time (0.1 s of it waiting for data), a 0.1 s save, 0.05 s of overhead."""
    body = {"event": "step", "job": job, "attempt": attempt, "step": step, "start": start, "end": start + 1.0}
    return body | {"step_s": 0.8, "data_s": 0.1, "checkpoint_s": 0.1, "eval_s": 0.0, "overhead_s": 0.05} | extra


def _end(job: int, attempt: int, t: float, stopped: bool = False) -> dict:
    return {
        "event": "end",
        "job": job,
        "attempt": attempt,
        "time": t + 0.3,
        "finish_from": t + 0.1,
        "checkpoint_s": 0.1,
        "stopped": stopped,
    }


def test_sigkilled_attempt_loses_the_steps_after_its_checkpoint_and_the_step_in_flight():
    """Attempt 0 logs steps 1-3; rank 1 dies silently in step 4, last alive at t=14.4 (its record), its peers hear of it at
    14.6; the agent restarts the ranks at t=15, and attempt 1 resumes from step 2's checkpoint."""
    events = [{"event": "launch", "job": 0, "attempt": 0, "time": 0.0}, *_marks(0, 0, 8.0)]
    events += [_step(0, 0, s, 10.5 + (s - 1)) for s in (1, 2, 3)]
    events += [
        {"event": "failure", "job": 0, "attempt": 0, "time": 14.6, "by": "rank 0: Connection closed by peer"},
        {"event": "failure", "job": 0, "attempt": 0, "time": 14.65, "by": "rank 2: Connection closed by peer"},
        {"event": "failure", "job": 0, "attempt": 0, "time": 14.4, "by": "rank 1: no error (its last record)"},
        {"event": "failure", "job": 0, "attempt": 0, "time": 15.0, "by": "agent: restarting the ranks"},
    ]
    events += [*_marks(0, 1, 16.0, restored=2), *[_step(0, 1, s, 18.5 + (s - 3)) for s in (3, 4)], _end(0, 1, 20.5)]
    got = goodput.account(events)
    parts = got["parts_s"]
    assert got["total_s"] == pytest.approx(20.8)  # the first launch to the last attempt's end record
    assert parts["lost"] == pytest.approx(14.4 - 12.5)  # step 3 and step 4's partial work, after step 2's end
    assert parts["restart_gap"] == pytest.approx(16.0 - 14.4)  # the failure to the restarted rank 0's start
    assert parts["startup"] == pytest.approx(10.5 + 2.5)  # the launch to step 1; attempt 1's rank start to its step 3
    assert parts["productive"] == pytest.approx(4 * 0.7)  # steps 1, 2 of attempt 0 and 3, 4 of attempt 1
    assert (parts["data_wait"], parts["checkpoint"], parts["finish"]) == pytest.approx((0.4, 0.4 + 0.1, 0.2))
    assert got["unaccounted_s"] == pytest.approx(20.8 - sum(parts.values()))
    assert parts["overhead"] == pytest.approx(4 * 0.05)
    assert got["unaccounted_s"] == pytest.approx(4 * 0.05)  # each counted step: 1 s on rank 0 less its 0.95 s of timed parts
    assert (got["restarts"], got["requeues"], got["repeated_steps"], got["steps_counted"]) == (1, 0, 1, 4)
    assert got["goodput"] == pytest.approx(2.8 / 20.8)
    first = got["attempts"][0]
    assert (first["how"], first["failure"]) == ("failed", {"time": 14.4, "by": "rank 1: no error (its last record)"})
    assert first["startup"] == {"launcher": 8.0, "imports": 0.5, "rendezvous": 0.5, "build": 0.5, "data": 0.5, "restore": 0.5}
    assert "launcher" not in got["attempts"][1]["startup"] and got["attempts"][1]["resumed_from_step"] == 2


def test_silent_failure_noticed_only_by_the_agent_ends_at_its_notice():
    events = [*_marks(0, 0, 0.0), _step(0, 0, 1, 2.5), {"event": "failure", "job": 0, "attempt": 0, "time": 5.0, "by": "agent"}]
    events += [*_marks(0, 1, 6.0, restored=1), _step(0, 1, 2, 8.5), _end(0, 1, 9.5)]
    got = goodput.account(events)
    assert (got["parts_s"]["lost"], got["parts_s"]["restart_gap"]) == pytest.approx((5.0 - 3.5, 1.0))
    assert got["total_s"] == pytest.approx(9.8)  # no launch record (a parity harness run): from rank 0's start


def test_requeued_job_has_a_requeue_gap_and_repeats_nothing():
    """Job 0 stops after step 2 with a checkpoint (SLURM's warning signal); the requeued job 1 resumes from it."""
    events = [{"event": "launch", "job": 0, "attempt": 0, "time": 0.0}, *_marks(0, 0, 1.0)]
    events += [_step(0, 0, 1, 3.5), _step(0, 0, 2, 4.5), _end(0, 0, 5.5, stopped=True)]
    events += [{"event": "launch", "job": 1, "attempt": 0, "time": 40.0}, *_marks(1, 0, 41.0, restored=2), _step(1, 0, 3, 43.5)]
    events += [_end(1, 0, 44.5)]
    got = goodput.account(events)
    assert got["parts_s"]["requeue_gap"] == pytest.approx(40.0 - 5.8) and got["parts_s"]["restart_gap"] == 0
    assert (got["requeues"], got["restarts"], got["repeated_steps"], got["parts_s"]["lost"]) == (1, 0, 0, 0)
    assert got["parts_s"]["startup"] == pytest.approx(3.5 + 3.5)  # each job's launch to its first step
    assert [a["how"] for a in got["attempts"]] == ["stopped", "ended"]


def test_rewind_loses_the_steps_after_the_checkpoint_it_goes_back_to():
    """Step 4 is the third spike in a row: the loop reloads step 1's checkpoint (at the end of step 4) and trains 2-4 again."""
    events = [*_marks(0, 0, 0.0), *[_step(0, 0, s, 2.5 + (s - 1)) for s in (1, 2, 3)]]
    events += [_step(0, 0, 4, 5.5, rewound_to=1), *[_step(0, 0, s, 6.5 + (s - 2)) for s in (2, 3, 4)], _end(0, 0, 9.5)]
    got = goodput.account(events)
    assert got["parts_s"]["lost"] == pytest.approx(6.5 - 3.5)  # steps 2, 3 and the rewinding step 4
    assert (got["steps_counted"], got["repeated_steps"]) == (4, 3)
    assert got["parts_s"]["productive"] == pytest.approx(4 * 0.7)


def test_line_and_flat_figures_list_every_part(tmp_path):
    events = [*_marks(0, 0, 0.0), _step(0, 0, 1, 2.5), _end(0, 0, 3.5)]
    flat = goodput.flat(goodput.account(events))
    assert sorted(flat) == sorted(
        ["fraction", "total_s", "unaccounted_s", "restarts", "requeues", "repeated_steps", *[f"{p.name}_s" for p in goodput.PARTS]]
    )
    text = goodput.line(flat, tmp_path / "goodput.json")
    assert text.startswith("goodput: 18.4 % (0.70 s productive of 3.80 s since the first launch; start-up 2.50 s, checkpoints 0.20 s, ")
    assert text.endswith(f"0 restarts, 0 requeues, 0 repeated steps) in {tmp_path / 'goodput.json'}")


def test_timeline_appends_one_line_per_event_with_job_and_attempt(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    tl = timeline.Timeline(tmp_path)
    tl.mark("built", 5.0)
    tl.failure("agent: restarting the ranks", attempt=0)
    tl.step({"step": 3, "step_time_s": 0.5, "data_s": 0.1, "checkpoint_s": 0.2, "rewound_to": 1}, 7.0, overhead_s=0.01, publish_s=0.03)
    got = goodput.read(tmp_path)
    assert got[0] == {"event": "mark", "job": 2, "attempt": 1, "name": "built", "time": 5.0}
    assert (got[1]["event"], got[1]["job"], got[1]["attempt"], got[1]["by"]) == ("failure", 2, 0, "agent: restarting the ranks")
    step = {k: got[2][k] for k in ("step", "start", "step_s", "data_s", "eval_s", "overhead_s", "rewound_to")}
    assert step == {"step": 3, "start": 7.0, "step_s": 0.5, "data_s": 0.1, "eval_s": 0.0, "overhead_s": 0.01, "rewound_to": 1}
    assert got[2]["checkpoint_s"] == pytest.approx(0.23)  # the save's blocking part and publishing the one before


def test_the_rank_that_went_quiet_first_marks_a_silent_failure(tmp_path):
    """runner.observe.forensics.last_alive, read by the agent before it restarts attempt 1's ranks: rank 1 raised
    nothing and finished its last step at t=8.5; rank 0 raised; rank 2 is alive (its heartbeat is recent); rank 3's
    record is an earlier attempt's."""
    from runner.observe import forensics

    folder = tmp_path / "logs" / "ranks"
    folder.mkdir(parents=True)
    rows = {0: ("failed", 1, 10.0, 9.0), 1: ("running", 1, 8.0, 8.5), 2: ("running", 1, 10.2, 9.1), 3: ("running", 0, 5.0, None)}
    for rank, (state, attempt, at, progress) in rows.items():
        body = {"rank": rank, "state": state, "attempt": attempt, "time": at, "progress": progress}
        (folder / f"rank_{rank}.json").write_text(json.dumps(body))
    assert forensics.last_alive(tmp_path, attempt=1) == (1, 8.5)
    assert forensics.last_alive(tmp_path, attempt=2) is None


@pytest.mark.parametrize(("restored", "lost", "stop"), [(2, 13.2 - 12.5, 13.2), (3, 0.0, 13.5)], ids=["from_step_2", "from_step_3"])
def test_rank_that_dies_while_rank_0_finishes_its_step(restored, lost, stop):
    """Rank 1 dies silently at t=13.2, while rank 0 still saves and logs step 3 (its record ends at 13.5). Resumed from
    step 2: step 3's record is thrown away and the lost work ends at the death; resumed from step 3: nothing is lost
    and the attempt stops once rank 0 has finished the step kept."""
    events = [*_marks(0, 0, 8.0), *[_step(0, 0, s, 10.5 + (s - 1)) for s in (1, 2, 3)]]
    events += [{"event": "failure", "job": 0, "attempt": 0, "time": 13.2, "by": "rank 1: no error (its last record)"}]
    events += [{"event": "failure", "job": 0, "attempt": 0, "time": 14.0, "by": "rank 0: Connection closed by peer"}]
    events += [*_marks(0, 1, 16.0, restored=restored), *[_step(0, 1, s, 18.5 + (s - restored - 1)) for s in range(restored + 1, 5)]]
    events += [_end(0, 1, 18.5 + 4 - restored)]
    got = goodput.account(events)
    assert got["parts_s"]["lost"] == pytest.approx(lost) and got["attempts"][0]["stop"] == stop
    assert got["parts_s"]["restart_gap"] == pytest.approx(16.0 - stop)
    assert got["steps_counted"] == 4 and got["unaccounted_s"] == pytest.approx(4 * 0.05)  # no record counted twice


def test_process_start_is_this_process_start_by_ps():
    """The launch and a restarted rank's start: this process's start from /proc, against ps's elapsed seconds."""
    import os
    import subprocess
    import time

    elapsed = int(subprocess.run(["ps", "-o", "etimes=", "-p", str(os.getpid())], capture_output=True, text=True, check=True).stdout)
    assert timeline.process_start() == pytest.approx(time.time() - elapsed, abs=1.1)  # ps counts whole seconds


def test_a_torchft_replica_group_down_is_lost_capacity_not_lost_work():
    """Replica group 1 under torchft: steps 1-3 committed with group 0, rank 1 SIGKILLed in step 4 (its peers hear at
    14.6), the agent restarts the group at 16; it heals from group 0 in a committed step that trains nothing (step 7)
    and trains steps 8-9. Nothing is recomputed (group 0 trained steps 4-7 alone, group 1's shards of them skipped):
    the group's time from the end of step 3 to the start of step 8 is lost capacity, no lost work, no restart gap."""
    ft = {"ft_committed": True, "ft_trained": True}
    events = [*_marks(0, 0, 8.0), *[_step(0, 0, s, 10.5 + (s - 1), **ft) for s in (1, 2, 3)]]
    events += [{"event": "failure", "job": 0, "attempt": 0, "time": 14.6, "by": "rank 0: Connection closed by peer"}]
    events += [*_marks(0, 1, 16.0, restored=3), _step(0, 1, 7, 18.5, ft_committed=True, ft_trained=False)]
    events += [*[_step(0, 1, s, 19.5 + (s - 8), **ft) for s in (8, 9)], _end(0, 1, 21.5)]
    got = goodput.account(events)
    parts = got["parts_s"]
    assert parts["outage"] == pytest.approx(19.5 - 13.5)  # step 3's end to step 8's start
    assert (parts["lost"], parts["restart_gap"], got["restarts"]) == (0.0, 0.0, 0)
    assert parts["startup"] == pytest.approx(10.5 - 8.0)  # attempt 1's start-up is inside the outage
    assert parts["productive"] == pytest.approx(5 * 0.7) and got["steps_counted"] == 5  # steps 1-3, 8, 9: not the healing step
    assert got["unaccounted_s"] == pytest.approx(5 * 0.05)  # each counted step's 1 s span less its 0.95 s of parts
    healthy = goodput.account([*_marks(0, 0, 8.0), *[_step(0, 0, s, 10.5 + (s - 1), **ft) for s in range(1, 10)], _end(0, 0, 19.5)])
    run = goodput.combine([healthy, got])  # group 0 trained every step: the run's account in group-seconds
    assert run["total_s"] == pytest.approx(healthy["total_s"] + got["total_s"])
    assert run["parts_s"]["outage"] == pytest.approx(6.0) and run["goodput"] == pytest.approx((9 + 5) * 0.7 / run["total_s"])
    assert "lost capacity 6.00 s" in goodput.line(goodput.flat(run), goodput.runfiles.GOODPUT)


def test_compilation_is_its_own_part_not_productive_time():
    """Issue 54: with training.compile=true the first step's 19.8 s of compilation counted as productive time."""
    first = _step(0, 0, 1, 2.5, step_s=20.8, compile_s=19.8) | {"end": 23.5}  # 20 s longer than the 1 s of _step
    events = [*_marks(0, 0, 0.0), first, _step(0, 0, 2, 23.5), _end(0, 0, 24.5)]
    got = goodput.account(events)
    assert got["parts_s"]["compile"] == pytest.approx(19.8)
    assert got["parts_s"]["productive"] == pytest.approx((20.8 - 0.1 - 19.8) + 0.7)  # less data waits and compilation
    assert "compilation 19.80 s" in goodput.line(goodput.flat(got), Path("goodput.json"))


def test_compile_clock_times_compilations_not_compiled_calls():
    """runner.run.accounting.CompileClock on torch's compile callbacks as Dynamo fires them around a frame's compilation
    and a lazily compiled backward (a nested one counts once); a compiled call outside them adds nothing."""
    import time as clock_time

    from torch._dynamo.callback import CallbackTrigger, callback_handler

    from runner.run.accounting import CompileClock

    clock = CompileClock().install()
    try:
        with callback_handler.install_callbacks(CallbackTrigger.DYNAMO, "0/0"):
            clock_time.sleep(0.02)
            with callback_handler.install_callbacks(CallbackTrigger.LAZY_BACKWARD, "0/0"):
                clock_time.sleep(0.02)
        first = clock.take()
        clock_time.sleep(0.02)  # running compiled code: no callback
        assert 0.04 <= first < 0.5 and clock.take() == 0
    finally:
        clock.remove()
    with callback_handler.install_callbacks(CallbackTrigger.DYNAMO, "1/0"):
        pass
    assert clock.take() == 0  # removed
