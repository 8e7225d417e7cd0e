"""The node-local checkpoint tier (checkpoint.local): the restore rule, partners, folders and validation without ranks;
with ranks, three SIGKILLed runs on two simulated nodes (tests/points.py, local_tier) in the session's shared multirun,
each resumed by the elastic agent after part of the local tier was destroyed, every one with the losses of the
uninterrupted reference run of test_checkpoint (the same 6 steps, schedule and data) bit for bit. A plain kill is not a
run of its own: in the flipped one every rank but rank 1 restores its own shard."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from runner.config import freeze
from runner.config.validate import checkpoint_rules
from runner.estimate import plan
from runner.formats import checkpoint, local_checkpoint, runfiles
from runner.outputs import goodput
from runner.run import startup
from runner.schema import LocalCheckpointConfig
from runner.schema.layout import resolve
from tests.conftest import dcp_metadata, metrics
from tests.points import CHECKPOINT_KILL_AT as KILL_AT
from tests.points import CHECKPOINT_STEPS as STEPS

PLACES = [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("c", 0), ("c", 1)]


def test_partner_is_the_same_position_on_the_next_node():
    assert [local_checkpoint.partner(PLACES, r) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert [local_checkpoint.source(PLACES, r) for r in range(6)] == [4, 5, 0, 1, 2, 3]
    # simulated nodes under one launcher: torchrun's local ranks run 0-3, the position on the node is what counts
    assert [local_checkpoint.partner([("n0", 0), ("n0", 1), ("n1", 2), ("n1", 3)], r) for r in range(4)] == [2, 3, 0, 1]
    assert local_checkpoint.partner([("a", 0), ("a", 1)], 1) is None  # one node: no copy survives its loss


def test_restore_rule_takes_the_newest_whole_local_step_only_if_newer_than_shared():
    # 4 ranks on 2 nodes: ranks 0-1 report node a's folder, 2-3 node b's (each node holds its own shards and the copies)
    both = {5: [0, 1, 2, 3], 3: [0, 1, 2, 3]}
    lost_b = {3: [0, 1, 2, 3]}  # node b's step-5 folder is gone: node a still has ranks 2-3's copies of step 5
    got = local_checkpoint.choose([both, both, lost_b, lost_b], shared_step=4)
    assert (got.step, got.holders) == (5, {0: 0, 1: 1, 2: 0, 3: 0})
    assert got.why == "local step 5 is whole and newer than shared step 4; rank(s) [2, 3] from their partner copies"
    # rank 1's shard of step 5 on no node: step 3 is whole, but the shared tier's step 4 is newer
    no_1 = {5: [0, 2, 3], 3: [0, 1, 2, 3]}
    got = local_checkpoint.choose([no_1, no_1, no_1, no_1], shared_step=4)
    assert got.step is None
    assert (
        got.why
        == "local step 5 lacks rank(s) [1] (no intact copy on any node); shared step 4 is at least as new as the newest whole local step 3"
    )
    assert local_checkpoint.choose([no_1] * 4, shared_step=2).step == 3
    assert local_checkpoint.choose([both] * 4, shared_step=None, before=5).step == 3  # a rewind to before step 5
    none = local_checkpoint.choose([{}] * 4, shared_step=2)
    assert (none.step, none.why) == (None, "no local checkpoint of this layout on any node")


def _shard(root: Path, step: int, rank: int, origin: dict, metadata: bytes | None = None) -> Path:
    partial = local_checkpoint.partial_path(root, step, rank)
    partial.mkdir(parents=True)
    (partial / ".metadata").write_bytes(dcp_metadata() if metadata is None else metadata)
    (partial / "__0_0.distcp").write_bytes(bytes(range(200)))
    info = {"step": step, "rank": rank, **origin}
    return checkpoint.publish(partial, local_checkpoint.shard_path(root, step, rank), info, checkpoint.file_records(partial))


def test_held_skips_damaged_shards_and_other_layouts_and_prune_keeps_the_newest(tmp_path):
    origin = {"world_size": 4, "layout": "tp2_dp2"}
    for step in (1, 3, 5):
        for rank in (0, 2):
            _shard(tmp_path, step, rank, origin)
    _shard(tmp_path, 5, 1, {"world_size": 2, "layout": "dp2"})
    flipped = local_checkpoint.shard_path(tmp_path, 3, 2) / "__0_0.distcp"
    flipped.write_bytes(bytes(reversed(range(200))))  # same size, other bytes
    (tmp_path / "step-5" / "rank-3.partial").mkdir()  # a save cut off: not a candidate, not reported
    held, skipped = local_checkpoint.held(tmp_path, origin)
    assert held == {5: [0, 2], 3: [0], 1: [0, 2]}
    assert len(skipped) == 2
    assert skipped[0].endswith("rank-1: saved by layout dp2 (2 ranks), this run is tp2_dp2")
    assert "rank-2: __0_0.distcp has crc32" in skipped[1] and skipped[1].endswith("(its content changed after the save)")
    gone = local_checkpoint.prune(tmp_path, 2, [0])  # rank 0's own shards (and no copy) beyond the newest 2 steps
    assert gone == [local_checkpoint.shard_path(tmp_path, 1, 0)]
    assert (local_checkpoint.shard_path(tmp_path, 1, 2)).is_dir()  # another rank's: left to it
    local_checkpoint.prune(tmp_path, 2, [2])
    assert not (tmp_path / "step-1").exists()  # empty once both ranks pruned it


def test_local_root_is_per_node_and_per_run(tmp_path):
    c = LocalCheckpointConfig(folder="/local/%N/ckpt")
    a, b = local_checkpoint.root(c, "n0", tmp_path / "x"), local_checkpoint.root(c, "n1", tmp_path / "x")
    assert a.parent == Path("/local/n0/ckpt") and b.parent == Path("/local/n1/ckpt") and a.name == b.name
    assert local_checkpoint.root(c, "n0", tmp_path / "y").name != a.name  # another run's shared folder


LOCAL = ["checkpoint=local", "checkpoint.interval=10"]


@pytest.mark.parametrize(
    "overrides, field, why",
    [
        (["checkpoint.local.folder=/l"], "checkpoint.local.folder", "is a tier of checkpoints, and none are written"),
        ([*LOCAL, "checkpoint.local.folder=ckpt"], "checkpoint.local.folder", "must be an absolute path to node-local storage"),
        ([*LOCAL, "checkpoint.local.folder=/l", "checkpoint.local.interval=10"], "checkpoint.local.interval", "is not shorter than"),
        (
            [*LOCAL, "checkpoint.local.folder=/l", "checkpoint.local.interval=2", "checkpoint.local.keep=0"],
            "checkpoint.local.keep",
            "must be >= 1",
        ),
        (
            [*LOCAL, "checkpoint.local.folder=/l", "checkpoint.local.interval=2", "fault_tolerance=torchft"],
            "checkpoint.local.folder",
            "torchft",
        ),
    ],
)
def test_local_tier_config_is_refused_with_field_and_fix(compose, overrides, field, why):
    from runner.config import validate
    from runner.schema.problems import ConfigError

    with pytest.raises(ConfigError) as e:
        validate.check(compose(overrides))
    (p,) = [p for p in e.value.problems if p.field == field]
    assert why in p.why and p.fix


def test_local_folder_inside_the_shared_one_is_refused(compose, tmp_path):
    cfg = compose([*LOCAL, f"checkpoint.local.folder={tmp_path / 'run' / 'checkpoints' / 'fast'}", "checkpoint.local.interval=2"])
    assert (
        checkpoint_rules.local_inside_shared(cfg, tmp_path / "run")
        == f"is inside the shared checkpoint.folder {tmp_path / 'run' / 'checkpoints'}"
    )
    cfg.checkpoint.local.folder = str(tmp_path / "elsewhere" / "%N")
    assert checkpoint_rules.local_inside_shared(cfg, tmp_path / "run") is None


def test_a_restart_by_hand_finds_a_whole_local_step_where_every_node_folder_is_visible(compose, tmp_path):
    """checkpoint.resume=true with no shared checkpoint was refused ("nothing to resume") although the local tier held a
    whole step: where every node's folder is visible here (one node, or simulated nodes) the preflight finds it as the
    ranks' restore does; where it is not (several nodes), the refusal says the tier is restored inside the job only."""
    from runner.config import validate
    from runner.schema.problems import ConfigError

    shared, run = tmp_path / "shared", tmp_path / "run"
    over = ["checkpoint=local", "checkpoint.resume=true", f"checkpoint.folder={shared}", f"checkpoint.local.folder={tmp_path}/%N"]
    cfg = compose([*over, "monitor.inject.node_names=[a,a,b,b]", "checkpoint.local.interval=2"])
    lay = validate.check(cfg)
    roots = {n: local_checkpoint.root(cfg.checkpoint.local, n, shared) for n in "ab"}
    for rank, node in enumerate("aabb"):
        _shard(roots[node], 4, rank, checkpoint.origin(cfg, lay))
    validate.preflight(cfg, run, lay)  # step 4 is whole over nodes a and b: the ranks restore it

    def refusal(cfg) -> str:
        with pytest.raises(ConfigError) as e:
            validate.preflight(cfg, run, lay, node=True)
        (p,) = [p for p in e.value.problems if p.field == "checkpoint.resume"]
        return p.why

    metadata = local_checkpoint.shard_path(roots["b"], 4, 3) / ".metadata"
    shutil.rmtree(metadata.parent)
    _shard(roots["b"], 4, 3, checkpoint.origin(cfg, lay), metadata=b"")  # its marker's sizes and CRC-32s match
    assert refusal(cfg).endswith(f"its node-local tier's step 4 cannot be loaded: {metadata} is not the pickle DCP wrote "
                                 "(pickle exhausted before seeing STOP): cut short or overwritten")  # fmt: skip
    shutil.rmtree(metadata.parent)
    assert refusal(cfg) == (
        f"nothing to resume: the checkpoint folder {shared} does not exist; nor does its node-local tier in {roots['a']}, "
        f"{roots['b']} (local step 4 lacks rank(s) [3] (no intact copy on any node))"
    )
    cfg.monitor.inject.node_names, cfg.cluster.num_nodes = [], 2  # two real nodes: this machine sees one folder
    assert refusal(cfg) == (
        f"nothing to resume: the checkpoint folder {shared} does not exist; the node-local tier (checkpoint.local.folder) "
        "of a 2-node run is restored only by a restart inside the job (the elastic agent's, a SLURM requeue): this machine "
        "sees its own node's folder only"
    )


def test_a_restart_by_hand_restores_the_local_step_on_the_ranks(compose, tmp_path):
    """The ranks' side of a restart by hand with only local checkpoints (checkpoint.resume=true, no shared one): one gloo
    rank restores the local step as an elastic restart does (it refused before); with the local tier gone too, it
    refuses naming both tiers."""
    from types import SimpleNamespace

    import torch

    from runner.run.checkpointer import Checkpointer, CheckpointMismatch
    from runner.run.device import DevicePolicy
    from runner.schema import DeviceType
    from tests.one_rank import gloo_rank

    class Saved:  # the schedule, guard and data position, as the Checkpointer saves and restores them
        got = None

        def state_dict(self, step=None):
            return {"at": step}

        def load_state_dict(self, state, step=None):
            self.got = state

    over = ["parallelism=single", "checkpoint=local", "checkpoint.async_save=false", "checkpoint.resume=true"]
    cfg = compose([*over, f"checkpoint.local.folder={tmp_path / 'local'}"])
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = [torch.optim.AdamW(model.parameters(), lr=0.1)]
    built, sched, data, guard = SimpleNamespace(parts=[model]), Saved(), Saved(), Saved()
    with gloo_rank(cfg, tmp_path):
        policy = DevicePolicy(DeviceType.cpu, "gloo", dedicated_host_group=False)
        ckpt = Checkpointer(cfg.checkpoint, tmp_path / "shared", num_steps=100, origin={"world_size": 1, "layout": "single"}, policy=policy)
        ckpt.save(3, built, opt, sched, data, guard)
        assert ckpt.last_tier == "local" and not (tmp_path / "shared").exists()
        saved = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.zero_()
        assert ckpt.restore(built, opt, sched, data, guard) == 3
        assert torch.equal(model.weight, saved) and data.got == {"at": 3} and ckpt.restored_from["tier"] == "local"
        ckpt.local.remove()
        with pytest.raises(CheckpointMismatch) as e:
            ckpt.restore(built, opt, sched, data, guard)
    assert str(e.value) == (
        f"checkpoint.resume=true but {tmp_path / 'shared'} holds no intact checkpoint, nor the local tier a whole step "
        "(no local checkpoint of this layout on any node)"
    )


def test_plan_suggests_both_tiers_and_start_up_shows_them(compose):
    cfg = compose(["recipe=llama3_70b_h100x1024", "cluster.mtbf_hours=5", "cluster.checkpoint_write_gbs=50", "cluster.local_write_gbs=5"])
    lay = resolve(cfg.parallelism, cfg.cluster)
    b = plan.compute(cfg, lay)
    nodes = lay.world_size // cfg.cluster.devices_per_node
    assert b["local_checkpoint_gb_per_node"] == pytest.approx(2 * b["checkpoint_gb"] / nodes)  # its share and a partner's copy
    assert b["local_checkpoint_write_s"] == pytest.approx(b["local_checkpoint_gb_per_node"] / 5)
    assert b["local_checkpoint_interval_s"] == pytest.approx(math.sqrt(2 * b["local_checkpoint_write_s"] * 5 * 3600))
    assert b["local_checkpoint_interval_steps"] == round(b["local_checkpoint_interval_s"] / b["step_time_s"])
    assert b["local_checkpoint_interval_steps"] < b["checkpoint_interval_steps"]
    cfg.checkpoint.enable, cfg.checkpoint.local.folder, cfg.checkpoint.local.interval = True, "/local_ssd/ckpt", 20
    line = startup.checkpoint_line(cfg, lay, None).splitlines()[1]
    w, s = b["local_checkpoint_write_s"], b["local_checkpoint_interval_s"]
    steps = b["local_checkpoint_interval_steps"]
    assert line == (
        f"local checkpoints: every 20 steps (keep 2, a copy on the next node) into /local_ssd/ckpt; "
        f"planner suggests {steps} (Young/Daly, {s:.0f} s: write {w:.3g} s)"
    )


# ---- with ranks: three SIGKILLed runs on two simulated nodes ---------------------------------------------------------


def _by_step(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in metrics(run_dir)}


@pytest.fixture(scope="module")
def reference(shared_runs):
    return _by_step(shared_runs["ckpt-reference"][0])


def _resumed(shared_runs, name: str, reference: dict[int, dict]) -> tuple[Path, str, list[dict]]:
    """The point's run folder, console and rows, after checking its losses against the reference at every step."""
    run_dir, console = shared_runs[f"local-{name}"]
    got = _by_step(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in got:
        keys = ("loss", "grad_norm", "data_hash", "lr")
        assert [got[s][k] for k in keys] == [reference[s][k] for k in keys], (name, s)
    return run_dir, console, metrics(run_dir)


def _local_folder(run_dir: Path) -> Path:
    """The folder that holds the point's per-node local folders (<assets>/local/<name>)."""
    return Path(freeze.load(run_dir / runfiles.FROZEN).checkpoint.local.folder).parent


FLIPPED_WHY = "local step 3 is whole and newer than shared step 2; rank(s) [1] from their partner copies"


@pytest.mark.e2e
def test_killed_rank_resumes_from_the_newer_local_save(shared_runs, reference):
    """The flipped point (rank 1's own shard damaged, its partner copy used; the other ranks restore their own)."""
    run_dir, console, rows = _resumed(shared_runs, "flipped", reference)
    assert f"checkpoint: resumed from the local tier, step 3 ({FLIPPED_WHY})" in console
    assert "assuming the intent is to save in a single process" not in console  # DCP's no_dist notice: runner.run.known_warnings
    # nothing recomputed: step 4 was never finished; the local saves of steps 1 and 3 held the loop, as the shared ones do
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [(r["step"], r["checkpoint_tier"]) for r in rows if r.get("checkpoint_s")] == [
        (1, "local"),
        (2, "shared"),
        (3, "local"),
        (4, "shared"),
        (5, "local"),
        (6, "shared"),
    ]
    g = json.loads((run_dir / runfiles.GOODPUT).read_text())
    second = g["attempts"][1]
    assert (second["resumed_from_step"], second["resumed_from_tier"]["tier"], g["repeated_steps"]) == (3, "local", 0)
    assert second["resumed_from_tier"]["why"] == FLIPPED_WHY
    (mark,) = [e for e in goodput.read(run_dir) if e.get("name") == "restored" and e["attempt"] == 1]
    assert mark["tier"] == "local"
    # the run ended well: its local checkpoints are gone from both nodes
    local = _local_folder(run_dir)
    assert sorted(p.name for p in local.iterdir()) == ["n0", "n1"] and not any(local.rglob("step-*"))
    assert checkpoint.verify(run_dir / "checkpoints" / f"step-{STEPS}") is None


@pytest.mark.e2e
def test_lost_node_resumes_from_partner_copies(shared_runs, reference):
    _, console, rows = _resumed(shared_runs, "node_lost", reference)
    assert "inject: deleted node n1's local folder " in console
    why = "local step 3 is whole and newer than shared step 2; rank(s) [2, 3] from their partner copies"
    assert f"checkpoint: resumed from the local tier, step 3 ({why})" in console
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))


@pytest.mark.e2e
def test_both_copies_of_a_shard_lost_resumes_from_the_shared_tier(shared_runs, reference):
    run_dir, console, rows = _resumed(shared_runs, "shards_lost", reference)
    assert "inject: deleted 2 copies of rank 1's step-3 local shard" in console
    why = "local step 3 lacks rank(s) [1] (no intact copy on any node); shared step 2 is at least as new as the newest whole local step 1"
    assert f"checkpoint: local tier not used: {why}" in console
    assert f"checkpoint: resumed from {run_dir / 'checkpoints' / 'step-2'} (step 2" in console
    assert [r["step"] for r in rows] == [1, 2, 3, *range(3, STEPS + 1)]  # step 3 again, from the shared step 2
    g = json.loads((run_dir / runfiles.GOODPUT).read_text())
    assert g["attempts"][1]["resumed_from_tier"] == {"tier": "shared", "why": why} and g["repeated_steps"] == 1


@pytest.mark.e2e
def test_corrupted_local_shard_fails_its_checksum_and_the_partner_copy_is_used(shared_runs, reference):
    _, console, _ = _resumed(shared_runs, "flipped", reference)
    (flip,) = [ln for ln in console.splitlines() if ln.startswith("inject: flipped a byte of ")]
    shard = Path(flip.rsplit(" ", 1)[1])
    assert shard.parent.name == "rank-1" and shard.parent.parent.name == "step-3" and "/n0/" in str(shard)
    (warn,) = [ln for ln in console.splitlines() if ln.startswith("WARNING: skipping local shard ")]
    assert warn.startswith(f"WARNING: skipping local shard {shard.parent}: {shard.name} has crc32 ")
    assert warn.endswith("was written (its content changed after the save)")
    assert f"checkpoint: resumed from the local tier, step 3 ({FLIPPED_WHY})" in console
    assert KILL_AT == 4


def test_async_local_save_is_published_and_restored_in_process(compose, tmp_path):
    """One gloo rank (one node: no partner): an asynchronous save of the local tier through DCP's no_dist async_save is
    published with its marker once the worker is done, pruned to `keep`, and loads back into the same model and
    optimizer; the run's end deletes the rank's local root."""
    import torch

    from runner.run.device import DevicePolicy
    from runner.run.local_tier import LocalTier
    from runner.run.titan import state
    from runner.schema import DeviceType
    from tests.one_rank import gloo_rank

    cfg = compose(["checkpoint=local", "checkpoint.interval=10", f"checkpoint.local.folder={tmp_path / 'local' / '%N'}"])
    cfg.checkpoint.local.interval, cfg.checkpoint.local.keep = 2, 1
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = [torch.optim.AdamW(model.parameters(), lr=0.1)]
    model(torch.randn(2, 8)).sum().backward()
    opt[0].step()
    origin = {"world_size": 1, "layout": "single"}
    with gloo_rank(cfg, tmp_path):
        policy = DevicePolicy(DeviceType.cpu, "gloo", dedicated_host_group=False)
        tier = LocalTier(cfg.checkpoint, tmp_path / "shared", origin=origin, policy=policy)
        assert (tier.partner, tier.nodes, tier.async_save) == (None, 1, True)
        tier.save(2, [model], opt, {"train": {"step": 2}})
        tier.staged()
        saved = model.weight.detach().clone()
        tier.wait()
        tier.save(4, [model], opt, {"train": {"step": 4}})
        tier.wait()
        assert tier.published == [2, 4] and not (tier.root / "step-2").exists()  # keep 1
        shard = local_checkpoint.shard_path(tier.root, 4, 0)
        assert checkpoint.verify(shard) is None and checkpoint.marker(shard)["step"] == 4
        with torch.no_grad():
            model.weight.zero_()
        step, got, why = tier.restore(None, None, lambda p: state.load_state([model], opt, {"train": {"step": 0}}, p, no_dist=True))
        assert (step, got["train"]["step"], why) == (4, 4, "local step 4 is whole and no shared checkpoint")
        assert torch.equal(model.weight, saved)
        tier.remove()
        assert not tier.root.exists()
