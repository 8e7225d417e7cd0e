"""Through a real scheduler: the localhost SLURM cluster (scripts/slurm_local/, two nodes n1 and n2,
started once per session by the slurm_cluster fixture) runs `python -m runner -m cluster=slurm_local`.

Two submissions in all: a 2-point layout sweep (two jobs, each 2 nodes x 2 CPU ranks, rendezvous by
job id) and one job that gets SLURM's warning signal mid-run, checkpoints, is requeued and finishes.
The sweep's dp2_tp2 job is the uninterrupted reference of the requeued one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.run import preempt
from tests.conftest import ROOT, _free_port, metrics, run_cli, summary
from tests.points import SLURM_SHORT as SHORT

LOSS_ATOL = 1e-4  # one node vs two: the same float32 reduction-order noise as tests/test_train.py's parity


def _argv(sweep: Path, *args: str) -> list[str]:
    port = f"cluster.rdzv_port={_free_port()}"  # the rendezvous of both nodes is on 127.0.0.1
    return [sys.executable, "-m", "runner", "-m", "cluster=slurm_local", port, *SHORT, *args, f"hydra.sweep.dir={sweep}"]


def _job_dirs(sweep: Path) -> list[Path]:
    """submitit's folder of each job (logs and pickles), in job order: `<array id>_<point>` for a sweep, `<job id>` for one job."""
    folders = sorted((p for p in (sweep / ".submitit").iterdir() if p.is_dir()), key=lambda p: p.name)
    tasks = [p for p in folders if "_" in p.name]
    return tasks or folders


def _node_logs(job: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(job.glob("*_log.out")))


@pytest.fixture(scope="module")
def layout_sweep(slurm_cluster, tmp_path_factory):
    """parallelism=dp2_tp2,hsdp2x2 in one submission: one job per point."""
    sweep = tmp_path_factory.mktemp("slurm_sweep") / "sweep"
    argv = _argv(sweep, "parallelism=dp2_tp2,hsdp2x2")
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, env=slurm_cluster.env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return sweep


@pytest.mark.e2e
def test_layout_sweep_runs_as_two_two_node_jobs(layout_sweep):
    jobs = _job_dirs(layout_sweep)
    assert [j.name.rsplit("_", 1)[1] for j in jobs] == ["0", "1"]  # one array job, a task per point
    assert jobs[0].name.split("_")[0] == jobs[1].name.split("_")[0]
    for num, (job, layout) in enumerate(zip(jobs, ["dp2_tp2", "hsdp2x2"], strict=True)):
        run = layout_sweep / str(num)
        assert summary(run)["preset"] == layout and summary(run)["world_size"] == 4
        assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5, 6]
        # rendezvous by job id: torchrun's log folders are named after it, one per node
        # torchrun names its log folders tempfile.mkdtemp(prefix=f"{rdzv id}_"), whose random part may hold "_" too
        folders = [p.name for p in (run / "logs").iterdir() if p.name != "ranks"]
        assert len(folders) == 2 and all(f.startswith(f"{job.name}_") for f in folders), folders
        # the two slurmd share this machine's hostname; SLURMD_NODENAME tells the nodes apart
        nodes = next(ln for ln in _node_logs(job).splitlines() if ln.startswith("nodes: "))
        assert sorted(part.split(" ranks ")[0] for part in nodes[len("nodes: ") :].split("; ")) == ["n1", "n2"], nodes


@pytest.mark.e2e
def test_two_node_job_matches_one_node_losses(layout_sweep, shared_runs):
    one_node = shared_runs["slurm-one_node"][0]  # the one-node reference (SLURM in tests/points.py), a shared run
    got, ref = metrics(layout_sweep / "0"), metrics(one_node)
    assert [r["loss"] for r in got] == [pytest.approx(r["loss"], abs=LOSS_ATOL) for r in ref]
    assert [r["data_hash"] for r in got] == [r["data_hash"] for r in ref]


def _wait(what: str, done, timeout_s: float = 300.0, every_s: float = 0.3):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = done()
        if got:
            return got
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _signal_then_release(cluster, run: Path) -> dict[str, float]:
    """USR2 once step 1 is logged, as SLURM sends it before a time limit; once the job is requeued,
    release it: SLURM holds a requeued job for two minutes (Reason=BeginTime) before it may start again."""
    t0 = time.monotonic()
    _wait("step 1 in metrics.jsonl", lambda: (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().strip())
    (job_id,) = cluster.run("squeue", "-h", "-o", "%i").stdout.split()
    cluster.run("scancel", "--signal=USR2", job_id)
    signalled = time.monotonic()

    def held() -> bool:
        state = cluster.run("squeue", "-h", "-j", job_id, "-o", "%T %r").stdout.split()
        return state == ["PENDING", "BeginTime"]

    _wait("the requeued job", held)
    requeued, released_at = time.monotonic(), time.time()
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    times = {"first_step_s": signalled - t0, "signal_to_requeue_s": requeued - signalled, "job_id": job_id}
    return times | {"released_at": released_at}  # wall clock, as the run's timeline


@pytest.fixture(scope="module")
def requeued(slurm_cluster, layout_sweep, tmp_path_factory):
    """One dp2_tp2 job that gets USR2 after step 1 and is requeued: (its sweep folder, console, timings)."""
    sweep = tmp_path_factory.mktemp("slurm_requeue") / "sweep"
    argv = _argv(sweep, "parallelism=dp2_tp2", "checkpoint=local")
    job = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=slurm_cluster.env)
    try:
        times = _signal_then_release(slurm_cluster, sweep / "0")
        out = job.communicate(timeout=600)[0]
    finally:
        job.kill()
    assert job.returncode == 0, out[-3000:]
    return sweep, times


@pytest.mark.e2e
def test_signalled_job_checkpoints_requeues_and_resumes_bitwise(requeued, layout_sweep):
    sweep, times = requeued
    run, ref = sweep / "0", metrics(layout_sweep / "0")
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and not any("repeat" in r for r in rows)  # none repeated or skipped
    assert [(r["loss"], r["grad_norm"]) for r in rows] == [(r["loss"], r["grad_norm"]) for r in ref]  # bitwise
    (stopped,) = [r for r in rows if "preempted" in r]
    k = stopped["step"]
    assert stopped["preempted"] == "SIGUSR2" and k < 6
    assert [r.get("slurm_restart", 0) for r in rows] == [0] * k + [1] * (6 - k)
    (entry,) = json.loads((run / "preempted.json").read_text())
    assert entry["job_id"] == times["job_id"] and entry["step"] == k and entry["slurm_restart_count"] == 0
    assert (Path(entry["checkpoint"]) / "COMPLETE.json").is_file()
    logs = _node_logs(_job_dirs(sweep)[0])
    assert f"preempt: SIGUSR2: stopped after step {k}, checkpoint {entry['checkpoint']}" in logs
    # SLURM's own proof of the requeue is the restart count the resumed steps carry (asserted above); submitit's
    # "Requeued job" line is not asserted: SLURM truncates the job's output file when the requeued job starts
    assert f"checkpoint: resumed from {entry['checkpoint']} (step {k}" in logs
    print(f"requeue timings: {times}")


@pytest.mark.e2e
def test_requeued_job_reports_its_requeue_gap_and_no_repeated_step(requeued):
    """goodput.json of the requeued run: two jobs; the gap between them spans the moment the test released the requeued
    job from SLURM's hold, and nothing was thrown away."""
    sweep, times = requeued
    run = sweep / "0"
    g = json.loads((run / "goodput.json").read_text())
    (entry,) = json.loads((run / "preempted.json").read_text())
    first, second = g["attempts"]
    assert [(a["job"], a["attempt"], a["how"]) for a in g["attempts"]] == [(0, 0, "stopped"), (1, 0, "ended")]
    assert (g["requeues"], g["restarts"], g["repeated_steps"], g["parts_s"]["lost"], g["parts_s"]["restart_gap"]) == (1, 0, 0, 0, 0)
    assert second["resumed_from_step"] == entry["step"] and g["steps_counted"] == 6
    assert g["parts_s"]["requeue_gap"] == pytest.approx(second["start"] - first["stop"])
    assert entry["stopped_at"] <= first["stop"] <= times["released_at"] <= second["start"] + 0.02
    assert g["unaccounted_s"] < 0.02 * g["total_s"], g


@pytest.mark.e2e
def test_launch_plan_prints_the_script_that_was_submitted(requeued, tmp_path):
    """mode=launch_plan with the submission's overrides prints exactly the sbatch file submitit wrote."""
    sweep, _ = requeued
    args = ["cluster=slurm_local", *SHORT, "parallelism=dp2_tp2", "checkpoint=local", "mode=launch_plan", f"hydra.sweep.dir={sweep}"]
    proc = run_cli(*args, run_dir=tmp_path / "p")
    assert proc.returncode == 0, proc.stderr
    printed = proc.stdout.split("nothing is submitted):\n\n", 1)[1].split("\n\neach node of the job runs", 1)[0]
    (submitted,) = _job_dirs(sweep)[0].glob("*_submission.sh")
    assert printed.strip() == submitted.read_text().strip()


def test_takeover_hands_usr2_to_submitit_only_after_this_runs_checkpoint(tmp_path, monkeypatch):
    """No cluster needed: submitit's handler stays held while the ranks save, and runs only for a checkpoint of this run."""
    calls: list[int] = []
    before = signal.signal(signal.SIGUSR2, lambda signum, frame: calls.append(signum))  # stands in for submitit's
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    try:
        take = preempt.AgentTakeover(tmp_path)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert take.received_at is not None and calls == []  # held: the ranks have not saved yet
        preempt.record(tmp_path, 3, tmp_path / "checkpoints" / "step-3", 0.5, None)
        (entry,) = preempt.interruptions(tmp_path)
        assert (entry["step"], entry["slurm_restart_count"], entry["job_id"]) == (3, 1, "7")
        take.hand_over()
        assert calls == [signal.SIGUSR2]  # submitit requeues now
        monkeypatch.setenv("SLURM_RESTART_COUNT", "2")  # the next run of the job finished without a signal
        preempt.AgentTakeover(tmp_path).hand_over()
        assert calls == [signal.SIGUSR2]  # the earlier run's record requeues nothing
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_the_agents_signal_handlers_end_with_its_ranks(tmp_path):
    """A SLURM task's SIGTERM handler is submitit's bypass again once torch's agent is done: the requeue's SIGTERM
    reached a task still writing its result after the ranks exited and left submitit's temporary file behind, which
    failed the requeued task (CI, 2026-12-04). torch's own process context installs its raising handler here."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    from runner.run import procs

    bypassed: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: bypassed.append(signum))  # stands in for submitit's bypass
    try:
        with procs.agent_signal_handlers():
            ctx = start_processes("rank", "/bin/sh", {0: ("-c", "exit 0")}, {0: {}}, DefaultLogsSpecs(log_dir=str(tmp_path)))
            inside = signal.getsignal(signal.SIGTERM)
            assert not ctx.wait(timeout=60).failures
            ctx.close()
        assert inside.__name__ == "_terminate_process_handler"  # the agent's, while its ranks run
        os.kill(os.getpid(), signal.SIGTERM)
        assert bypassed == [signal.SIGTERM]  # after them: the earlier handler, no exception
    finally:
        signal.signal(signal.SIGTERM, before)


SIGNALLED_RANK = r"""
import json, os, signal, sys, time
from runner.run import preempt

watch = preempt.watch_rank()  # first, as runner.run.per_rank.main does: before torch starts a thread
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

rank, n = int(os.environ["RANK"]), 1 << 14
dist.init_process_group("gloo", rank=rank, world_size=2)
torch.set_num_threads(2)  # OpenMP threads too
print("ready", flush=True)
done = wrong = 0
start = time.monotonic()
while True:
    go = torch.tensor([float(time.monotonic() - start < float(sys.argv[1]))])
    dist.all_reduce(go, op=dist.ReduceOp.MIN)  # both ranks stop after the same round
    if not go.item():
        break
    x = torch.arange(n, dtype=torch.float32) + rank
    part = fc.wait_tensor(fc.reduce_scatter_tensor(x, "sum", 0, dist.group.WORLD))  # as FSDP's and TP's steps
    whole = fc.wait_tensor(fc.all_gather_tensor(part, 0, dist.group.WORLD))
    y = torch.full((n,), float(rank + 1))
    dist.all_reduce(y)
    wrong += int(not torch.equal(whole, 2 * torch.arange(n, dtype=torch.float32) + 1)) + int(not bool((y == 3).all()))
    done += 3
bit = 1 << (signal.SIGUSR2 - 1)
masks = [int(next(ln for ln in open(f"/proc/self/task/{t}/status") if ln.startswith("SigBlk:")).split()[1], 16)
         for t in os.listdir("/proc/self/task")]
print(json.dumps({"done": done, "wrong": wrong, "signalled": watch.signalled_at is not None, "threads": len(masks),
                  "unblocked": sum(not m & bit for m in masks)}), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.e2e
def test_gloo_collectives_are_right_while_a_rank_gets_usr2_every_20_ms():
    """SLURM's USR2 once crashed a rank (SIGSEGV inside gloo). For 10 s of gloo collectives the test sends rank 0 USR2
    every 20 ms: every collective completes with the right values on both ranks, and no thread but the rank's
    watcher can be interrupted by it (runner.run.preempt.RankWatch blocks it in every thread the rank starts)."""
    env = {**os.environ, "SLURM_JOB_ID": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", SIGNALLED_RANK, "10"], cwd=ROOT, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, text=True
        )
        for r in (0, 1)
    ]
    try:
        assert ranks[0].stdout.readline() == "ready\n"
        sent = 0
        while ranks[0].poll() is None:
            ranks[0].send_signal(signal.SIGUSR2)
            sent += 1
            time.sleep(0.02)
        results = [json.loads(p.communicate(timeout=60)[0].splitlines()[-1]) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert [p.returncode for p in ranks] == [0, 0]
    assert sent > 100 and results[0]["signalled"] and not results[1]["signalled"]
    assert results[0]["done"] == results[1]["done"] > 0 and [r["wrong"] for r in results] == [0, 0]
    assert results[0]["threads"] > 3 and results[0]["unblocked"] <= 1  # gloo's and OpenMP's threads never take it
