"""Silent-data-corruption checks and a straggler slowed from inside, each proven by injecting its fault.

One 4-rank launch (`faults`, plain data parallel: 4 replicas of every parameter, so a flipped bit has a
majority against it): rank 2 computes 60 % longer in every forward (a slower device, busy: the phase judge
must name it alone), rank 3's replayed forwards at steps 5, 10, 15 and 20 differ by 1e-6 (the replay check
must name it), rank 1 flips a bit of a parameter at step 17 (the replica check at step 20 must name it and
rewind to step 16's checkpoint, after which the replicas agree again), and rank 2's loss at step 9 is x1e4 on the
first pass only (the spike's attribution replay must call it hardware, name rank 2 and rewind to step 8). The clean
side (nothing reported over 40 steps of HSDP with a rewind) rides on tests/test_monitor.py's `clean` launch, the rank
slowed from outside (SIGSTOP/SIGCONT from the test) on its dp2_tp2 `slow` launch.
"""

from __future__ import annotations

import json

import pytest
import torch

from runner.formats import runfiles
from runner.observe import fault_injection, integrity, loss_guard, monitor
from runner.run import startup
from runner.schema import InjectConfig, StragglerConfig, layout
from runner.schema.layout import Layout
from tests.conftest import ROOT, metrics, run_cli, summary

STRAGGLER = ["monitor.straggler.interval=5", "monitor.straggler.windows=2"]


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("faults") / "run"
    args = ["parallelism=dp2", "parallelism.dp_replicate=4", "cluster.devices_per_node=4", "training.seq_len=64", "training.steps=22"]
    args += ["logging.progress=false", *STRAGGLER, "monitor.integrity.interval=4", "monitor.integrity.replay_interval=5"]
    args += ["monitor.inject.flip_rank=1", "monitor.inject.flip_at_step=17", "monitor.inject.replay_rank=3"]
    args += ["monitor.inject.delay_rank=2", "monitor.inject.delay_frac=1.0"]  # the forward doubled: clear of the judge's floor
    args += ["monitor.inject.fault_rank=2", "monitor.inject.fault_at_step=9"]
    args += ["monitor.integrity.on_mismatch=rewind", "checkpoint=local", "checkpoint.interval=8", "checkpoint.keep=0"]
    proc = run_cli(*args, run_dir=run_dir, timeout=900)
    return run_dir, proc.returncode, proc.stdout, proc.stderr


@pytest.mark.e2e
def test_straggler_named_within_window_count(faults):
    run_dir, _, out, _ = faults
    flagged = [json.loads(line) for line in (run_dir / runfiles.STRAGGLERS).read_text().splitlines()]
    assert {f["rank"] for f in flagged} == {2}, flagged  # nobody else, in any phase
    first = next(f for f in flagged if f["phase"] == "forward")
    # step 1 is not judged; windows of 5 steps end at steps 6 and 10 (step 9 ran twice: the hardware rewind): the 2nd names it
    assert first["step"] == 10
    assert first["windows"] == 2 and first["slowdown"] > 1.3
    assert (first["local_rank"], first["coords"]) == (2, {"pp": 0, "dp_replicate": 2, "dp_shard": 0, "cp": 0, "tp": 0})
    assert first["host"] and first["median_s"] > 0
    row = next(r for r in metrics(run_dir) if r["step"] == 10)
    assert any(f["rank"] == 2 and f["phase"] == "forward" for f in row["stragglers"]) and row["straggler_windows"] == 2
    flat = " ".join(out.split())  # rich wraps the console at its width
    assert "straggler: rank 2 (host" in flat and "local rank 2, mesh pp=0 dp_replicate=2 dp_shard=0 cp=0 tp=0) forward" in flat


@pytest.mark.e2e
def test_flipped_bit_is_found_at_the_next_interval_and_rewinds(faults):
    run_dir, rc, out, err = faults
    assert rc == 0, err[-3000:]
    report = json.loads((run_dir / runfiles.INTEGRITY_REPORT).read_text())
    replica = [m for m in report["mismatches"] if m["check"] == "replica"]
    # the checks at steps 4, 8, 12, 16 found nothing; the flip at 17 is found at 20; after the rewind the check at 20 passes
    assert [m["step"] for m in replica] == [20]
    (m,) = replica
    assert m["parameter"] == "tok_embeddings.weight" and m["group"] == [0, 1, 2, 3]
    assert m["minority"]["ranks"] == [1] and m["majority"]["ranks"] == [0, 2, 3] and m["minority"]["hosts"]
    assert len({m["checksums"][str(r)] for r in (0, 2, 3)}) == 1 and m["checksums"]["1"] != m["checksums"]["0"]
    assert report["on_mismatch"] == "rewind"
    rows = metrics(run_dir)
    # rewound from 9 to step 8's checkpoint (hardware), from 20 to step 16's (the flip)
    assert [r["step"] for r in rows] == [*range(1, 10), *range(9, 21), *range(17, 23)]
    assert rows[20]["rewound_to"] == 16 and [x["check"] for x in rows[20]["integrity"]] == ["replay", "replica"]
    assert summary(run_dir)["monitor"]["integrity_checks"] == 6  # 4, 8, 12, 16, 20, and 20 again
    flat = " ".join(out.split())
    assert "integrity: step 20 parameter tok_embeddings.weight: ranks [1] (hosts " in flat
    assert "integrity: rewound to the checkpoint of step 16" in flat


def test_mismatch_stops_the_run_or_finds_no_checkpoint():
    from types import SimpleNamespace

    from runner.run.step_loop import StepLoop
    from runner.schema import MismatchAction, RunConfig

    found = [{"step": 8, "check": "replica", "parameter": "w", "group": [0, 1, 2], "checksums": {}}]
    found[0] |= {"majority": {"ranks": [0, 2], "hosts": ["a"]}, "minority": {"ranks": [1], "hosts": ["b"]}}
    checker = SimpleNamespace(check=lambda step, parts: found, path=ROOT / "integrity_report.json")
    cfg = RunConfig()
    loop = SimpleNamespace(cfg=cfg, integrity=checker, built=SimpleNamespace(parts=[]), opt=None, sched=None, data=None, guard=None)
    loop.mismatch = lambda step, found, report: StepLoop.mismatch(loop, step, found, report)  # also a hardware verdict's
    with pytest.raises(integrity.IntegrityError, match=r"step 8 parameter w: ranks \[1\] \(hosts b\) differ from the majority \[0, 2\]"):
        StepLoop.check_replicas(loop, 8)
    cfg.monitor.integrity.on_mismatch = MismatchAction.rewind
    loop.ckpt = SimpleNamespace(wait=lambda: None, restore=lambda *a, before: None)
    with pytest.raises(integrity.IntegrityError, match="no checkpoint to rewind to at or before step 8"):
        StepLoop.check_replicas(loop, 8)
    checker.check = lambda step, parts: []
    assert StepLoop.check_replicas(loop, 8) == {}


@pytest.mark.e2e
def test_spike_the_replay_does_not_reproduce_is_hardware_naming_the_rank(faults):
    """Rank 2's first pass of step 9 is off (x1e4): the guard flags the step, every rank replays it, rank 2's loss share
    differs: hardware, rank 2 named alone (its peers reproduce), the step is not applied (not a skipped step) and
    on_mismatch=rewind goes back to step 8's checkpoint; step 9 then trains (the fault fired once)."""
    run_dir, _, out, _ = faults
    (e,) = [json.loads(line) for line in (run_dir / runfiles.SPIKES).read_text().splitlines()]
    assert (e["step"], e["verdict"], e["ranks"], e["action"], e["metric"]) == (9, "hardware", [2], "rewind", "loss") and e["hosts"]
    first9, again9 = [r for r in metrics(run_dir) if r["step"] == 9]
    assert (first9["verdict"], first9["verdict_ranks"], first9["rewound_to"], first9["skipped_steps"]) == ("hardware", [2], 8, 0)
    assert again9["loss"] < 20 and "verdict" not in again9 and "spike" not in again9
    assert summary(run_dir)["monitor"]["spike_verdicts"] == {"data": 0, "hardware": 1}
    flat = " ".join(out.split())
    assert f"spike attribution: step 9 loss {e['value']:.4g} > 3 x running median" in flat
    assert f"hardware (the replay differs on rank 2, host {e['hosts'][0]}): step not applied; monitor.integrity.on_mismatch=rewind" in flat


def test_a_device_wrong_the_same_way_twice_disagrees_with_its_peers(tmp_path, capsys):
    """dp2_tp2 (TP groups [0, 1] and [2, 3]): rank 3's loss share reproduces in its replay but differs from its TP peer's,
    whose value it must equal: hardware, both peers named (two peers: no majority). A global grad norm off on one rank
    of four names that rank alone. Peers that agree give a data verdict."""
    from types import SimpleNamespace

    from runner.observe import attribution
    from runner.schema import MismatchAction

    who = [{"host": f"h{r}"} for r in range(4)]
    same = [{"loss": 1.0, "grad_sq": 4.0, "grad_norm": 2.0} for _ in range(4)]
    assert attribution.peer_mismatches(5, same, [[0, 1], [2, 3]], who) == []
    off = [*same[:3], same[3] | {"loss": 1.5}]
    assert [(m["rank"], m["value"], m["group"]) for m in attribution.peer_mismatches(5, off, [[0, 1], [2, 3]], who)] == [
        (2, "loss", [2, 3]),
        (3, "loss", [2, 3]),
    ]
    norm = [same[0], same[1] | {"grad_norm": 2.5}, *same[2:]]
    assert [(m["rank"], m["value"]) for m in attribution.peer_mismatches(5, norm, [[0, 1], [2, 3]], who)] == [(1, "grad_norm")]
    policy = SimpleNamespace(set_rng_state=lambda rng: None, all_gather_object=lambda mine: [(a, a) for a in off])
    judge = attribution.Attributor(policy, who, 0, tmp_path, MismatchAction.stop, [[0, 1], [2, 3]])
    verdict = loss_guard.Verdict("loss 40 > 3 x running median 1", "skip", "loss", 40.0, 1.0)
    mon = SimpleNamespace(faults=SimpleNamespace(attributing=False))
    e = judge.judge(5, verdict, (1.0, 2.0), lambda: (1.0, 2.0), [], lambda: None, None, mon, lambda: [])
    assert (e["verdict"], e["check"], e["ranks"], e["hosts"], e["action"]) == ("hardware", "peers", [2, 3], ["h2", "h3"], "stop")
    assert "step 5 loss 40 > 3 x running median 1: hardware (rank 2, 3, host h2, h3 disagrees with peers that must agree)" in (
        capsys.readouterr().out
    )
    assert integrity.describe(e["mismatches"][1]) == (
        "integrity: step 5 rank 3 (host h3) disagrees with its peers [2, 3] on its loss share: {'2': 1.0, '3': 1.5}"
    )


@pytest.mark.e2e
def test_replay_names_the_rank_that_does_not_reproduce(faults):
    run_dir, _, out, _ = faults
    report = json.loads((run_dir / runfiles.INTEGRITY_REPORT).read_text())
    replay = [m for m in report["mismatches"] if m["check"] == "replay"]
    assert [(m["step"], m["rank"]) for m in replay] == [(5, 3), (10, 3), (15, 3), (20, 3), (20, 3)]  # 20 ran twice
    for m in replay:
        assert m["first"]["loss"] != m["second"]["loss"]
        assert m["second"]["loss"] == pytest.approx(m["first"]["loss"] * (1 + 1e-6), rel=1e-7)
        assert m["grads_differ_on"] == [0, 1, 2, 3]  # rank 3's gradients reach every replica through the all-reduce
    row5 = next(r for r in metrics(run_dir) if r["step"] == 5)
    assert [m["rank"] for m in row5["integrity"]] == [3]
    assert "integrity: step 5 replay differs on rank 3 (host" in " ".join(out.split())


@pytest.mark.e2e
def test_startup_block_names_the_replica_groups(faults):
    out = faults[2]
    assert (
        "integrity: 1 groups of 4 replicas compare parameter checksums every 4 steps (on mismatch: rewind); replay check every 5 steps"
        in out
    )


# ---------------------------------------------------------------- plain parts


def test_replica_groups_follow_dp_replicate_only():
    assert integrity.replica_groups(Layout(pp=1, dp_replicate=2, dp_shard=2, cp=1, tp=1)) == [(0, 2), (1, 3)]
    assert integrity.replica_groups(Layout(pp=2, dp_replicate=2, dp_shard=1, cp=1, tp=2)) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert integrity.replica_groups(Layout(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=2)) == []  # FSDP x TP: each shard held once


def test_compare_names_majority_and_minority_and_a_tie():
    who = [{"host": f"h{r // 2}"} for r in range(4)]
    table = [{"w": 5, "b": 1}, {"w": 5, "b": 1}, {"w": 7, "b": 1}, {"w": 5, "b": 1}]
    (m,) = integrity.compare(3, table, [[0, 1, 2, 3]], who)
    assert (m["step"], m["parameter"], m["majority"], m["minority"]) == (
        3,
        "w",
        {"ranks": [0, 1, 3], "hosts": ["h0", "h1"]},
        {"ranks": [2], "hosts": ["h1"]},
    )
    (tie,) = integrity.compare(3, table, [[1, 2]], who)
    assert tie["majority"]["ranks"] == [] and tie["minority"]["ranks"] == [1, 2]
    assert "no majority among replicas [1, 2]" in integrity.describe(tie)
    assert integrity.compare(3, table, [[0, 1], [0, 3]], who) == []


def test_checksum_sees_one_flipped_bit():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    before = integrity.checksums([model])
    faults = fault_injection.Faults(InjectConfig(flip_rank=0, flip_at_step=2), rank=0)
    faults.flip(1, [model])
    assert integrity.checksums([model]) == before  # not the flip step
    w0, bit = model.weight[0, 0].item(), int(model.weight.detach().view(torch.int32)[0, 0]) & (1 << 22)
    faults.flip(2, [model])
    after = integrity.checksums([model])
    # one bit: the (wrapping int32) sum moves by its power of two
    assert (after["weight"] - before["weight"]) % (1 << 32) == (-(1 << 22) if bit else 1 << 22) % (1 << 32)
    assert after["bias"] == before["bias"] and model.weight[0, 0].item() != w0


def test_replay_verdict_prefers_the_rank_whose_loss_differs():
    same, other = {"loss": 2.0, "grad_sq": 0.5}, {"loss": 2.0, "grad_sq": 0.6}
    runs = [(same, other), (same, other), (same, {"loss": 2.1, "grad_sq": 0.6})]
    (m,) = integrity.replay_verdict(7, runs, [{"host": "a"}] * 3)
    assert (m["rank"], m["grads_differ_on"]) == (2, [0, 1, 2])
    only_grads = integrity.replay_verdict(7, runs[:2], [{"host": "a"}] * 2)
    assert [m["rank"] for m in only_grads] == [0, 1]  # the backward differs somewhere, after the reduction every rank sees it
    assert integrity.replay_verdict(7, [(same, dict(same))], [{"host": "a"}]) == []


def test_startup_says_when_a_layout_has_no_replicas(compose):
    cfg = compose([])
    lay = layout.resolve(cfg.parallelism, cfg.cluster)
    line = startup.integrity_line(cfg, lay)
    assert line == (
        "integrity: no replicas in this layout (dp_replicate=1: every parameter shard is held once), so no replica check; "
        "replay check every 500 steps"
    )


def _stamps(waits: list[list[float]], skew: list[float]) -> tuple[list[list[float]], list[list[float]]]:
    """Barrier stamps from waits: everyone departs together at 100 + k s (on a clock `skew` s off), arriving `wait` earlier."""
    depart = [[100.0 + k + skew[r] for k in range(len(w))] for r, w in enumerate(waits)]
    return [[d - w for d, w in zip(dr, wr, strict=True)] for dr, wr in zip(depart, waits, strict=True)], depart


def test_arrival_judge_needs_a_majority_of_steps_and_real_waiting():
    judge = monitor.ArrivalJudge(StragglerConfig(windows=2, last_frac=0.6, min_late_s=0.01))
    late2 = [[0.05, 0.04, 0.06], [0.05, 0.06, 0.04], [0.001, 0.002, 0.001], [0.04, 0.05, 0.05]]  # rank 2 barely waits
    arrive, depart = _stamps(late2, [0.0, 0.0, 0.0, 5.0])  # rank 3's host clock is 5 s ahead: taken out
    assert judge.update(arrive, depart, 1, 1.0) == []
    (f,) = judge.update(arrive, depart, 1, 1.0)
    assert (f["rank"], f["phase"], f["windows"], f["last_frac"]) == (2, "arrival", 2, 1.0)
    # peers arrive 50 ms (median) before it: 0.05 - 0.001, 0.05 - 0.002, 0.05 - 0.001
    assert f["late_s"] == pytest.approx(0.049) and f["slowdown"] == pytest.approx(1 / (1 - 0.049))
    two_points = [[w for w in row for _ in range(2)] for row in late2]  # two collectives per step: lateness adds up
    assert monitor.ArrivalJudge.lateness(*_stamps(two_points, [0.0] * 4), 2)[2] == pytest.approx([0.098, 0.096, 0.098])
    shuffled = [[0.001, 0.05, 0.05], [0.05, 0.001, 0.05], [0.05, 0.05, 0.001], [0.05, 0.05, 0.05]]  # each last once: noise
    assert monitor.ArrivalJudge(StragglerConfig(windows=1)).update(*_stamps(shuffled, [0.0] * 4), 1, 1.0) == []
    tiny = [[0.003, 0.003], [0.0, 0.0], [0.003, 0.003]]  # always last, but by 3 ms: nobody waits for it
    assert monitor.ArrivalJudge(StragglerConfig(windows=1)).update(*_stamps(tiny, [0.0] * 3), 1, 1.0) == []
