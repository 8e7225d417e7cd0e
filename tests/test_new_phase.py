"""A new phase from a checkpoint's weights (checkpoint.init_from, issue 49 item 6): the model of the runner's own
checkpoint, under any layout, with a fresh optimizer, learning-rate schedule and data position.

One in-process gloo rank (over a file store) trains the source: 4 steps of the small debug model (SMALL), checkpointed
at steps 2 and 4. A new one-rank run from that run folder starts from step-4's weights: its optimizer holds no state after the
start, its first batch and learning rate are the source's first, and its first loss is the forward loss of step-4's
weights on that batch (computed here from the checkpoint, read with DCP into an unsharded model). A 2-rank launch under
TP (another layout: DCP reshards) does the same through the CLI: pinned and recorded in frozen.yaml, the step-0 line.
Validation runs on fake checkpoints (runner.config only): refusals with field, value, reason and fix.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from runner.config import freeze, validate
from runner.formats import checkpoint, runfiles
from runner.schema import Mode, ModelConfig
from runner.schema.problems import ConfigError
from tests.conftest import dcp_metadata, metrics, run_cli
from tests.one_rank import SMALL, gloo_rank

SHAPE = [
    "parallelism=single",
    *SMALL,
    "training.seq_len=32",
    "training.global_batch_size=4",
    "training.microbatch_size=2",
    "lr_scheduler.warmup_steps=2",
    "logging.progress=false",
]
SOURCE = [*SHAPE, "training.steps=4", "checkpoint.enable=true", "checkpoint.interval=2", "checkpoint.async_save=false"]
LOSS_RTOL = 1e-6
"""The first step's loss against the forward loss of the same weights on the same batch (one rank; measured: 4e-8, the
float32 rounding of the logged loss)."""
LOSS_ATOL_TP = 1e-5
"""The same under tp2, read by DCP into TP shards (float32 reduction order; measured: 2e-7)."""


@pytest.fixture(scope="module")
def one_rank(compose, tmp_path_factory):
    """One in-process gloo rank and its one-rank mesh: (layout of parallelism=single, mesh, policy)."""
    from runner.run import titan
    from runner.run.device import DevicePolicy
    from runner.schema import layout

    cfg = compose(SHAPE)
    lay = layout.resolve(cfg.parallelism, cfg.cluster)
    with gloo_rank(cfg, tmp_path_factory.mktemp("store")):
        yield lay, titan.build_mesh(cfg, lay), DevicePolicy.of(cfg.cluster, cfg.distributed)


def _data(cfg):
    from runner.run import loader

    t = cfg.training
    return loader.SyntheticData(
        seed=t.seed,
        seq_len=t.seq_len,
        vocab=cfg.model.vocab_size,
        global_batch=t.global_batch_size,
        microbatch=t.microbatch_size,
        dp_rank=0,
        dp=1,
    )


def _loop_parts(cfg, one_rank, run_dir: Path):
    """A freshly built model and what train.run takes besides it, on the module's rank."""
    import torch

    from runner.run import accounting, titan

    lay, mesh, policy = one_rank
    built = titan.build(cfg, lay, mesh, run_dir, torch.device("cpu"))
    acc = accounting.Accounting(1.0, 1e12, "test", built.flops_per_token, built.flops_per_token, "float32", False, built.num_params, None)
    return lay, built, _data(cfg), acc, policy


def _train(cfg, one_rank, run_dir: Path) -> list[dict]:
    from runner.run import train

    run_dir.mkdir(parents=True, exist_ok=True)
    lay, built, data, acc, policy = _loop_parts(cfg, one_rank, run_dir)
    return train.run(cfg, lay, built, data, acc, [], run_dir, policy)


@pytest.fixture(scope="module")
def source(compose, one_rank, tmp_path_factory):
    """The source run: its folder (checkpoints/step-2 and step-4) and its rows."""
    run_dir = tmp_path_factory.mktemp("source")
    rows = _train(compose(SOURCE), one_rank, run_dir)
    assert [p.name for p in sorted((run_dir / "checkpoints").iterdir())] == ["step-2", "step-4"]
    return run_dir, rows


def expected_loss(cfg, ckpt: Path) -> float:
    """The mean token cross-entropy of the checkpoint's weights (read with DCP into an unsharded model in this process)
    on the first batch of cfg's synthetic data."""
    import torch

    from tests import hf_compare

    model = hf_compare.titan_from_checkpoint(cfg, ckpt)
    inputs, labels = (torch.cat(t) for t in list(zip(*_data(cfg).microbatches(0), strict=True))[:2])
    with torch.no_grad():
        logits = model(inputs).double()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()


def test_a_new_phase_starts_from_the_weights_alone(compose, one_rank, source, tmp_path, monkeypatch, capsys):
    """From the run folder: its newest checkpoint (step-4), weights only. After the start the optimizer holds no state;
    the first step reads the source's first batch at the source's first learning rate, and its loss is the forward
    loss of step-4's weights on that batch (lower than the untrained weights' on it)."""
    import torch

    from runner.run import titan, train
    from tests import hf_compare

    src, src_rows = source
    cfg = compose([*SHAPE, "training.steps=2", f"checkpoint.init_from={src}"])
    seen = {}
    start = train.start

    def observed(loop):
        step = start(loop)
        seen.update(step=step, state=[dict(o.state) for o in loop.opt])
        seen["weights"] = {k: titan.local_value(v).clone() for k, v in loop.built.parts[0].state_dict().items()}  # one rank: whole
        return step

    monkeypatch.setattr(train, "start", observed)
    rows = _train(cfg, one_rank, tmp_path / "phase")
    step4 = src / "checkpoints" / "step-4"
    rec = checkpoint.weights_record(step4)
    out = capsys.readouterr().out
    sha = rec["files_sha256"]
    assert f"step 0: started from the model weights of checkpoint {step4} (step 4, layout single; COMPLETE.json files sha256 {sha};" in out
    assert "optimizer, learning-rate schedule and data position start fresh" in out
    assert seen["step"] == 1 and seen["state"] == [{}]
    saved = hf_compare.titan_from_checkpoint(cfg, step4).state_dict()
    assert set(seen["weights"]) == set(saved) and all(torch.equal(seen["weights"][k], saved[k]) for k in saved)
    first, src_first = rows[0], src_rows[0]
    assert (first["step"], first["data_hash"], first["lr"]) == (1, src_first["data_hash"], src_first["lr"])
    assert first["loss"] == pytest.approx(expected_loss(cfg, step4), rel=LOSS_RTOL)
    assert first["loss"] < src_first["loss"] - 0.05  # 4 steps trained on the same batches


def test_the_runs_own_checkpoint_takes_precedence(compose, one_rank, source, tmp_path, capsys):
    """A resume of the new phase loads its own checkpoint (weights, optimizer, step) and not checkpoint.init_from's."""
    from runner.run import train

    src, _ = source
    own = tmp_path / "own"
    phase = [*SHAPE, "training.steps=2", f"checkpoint.init_from={src}", "checkpoint.enable=true", "checkpoint.interval=1"]
    phase += [f"checkpoint.folder={own}", "checkpoint.async_save=false"]
    _train(compose(phase), one_rank, tmp_path / "phase")
    cfg = compose([*phase, "checkpoint.resume=true", f"checkpoint.resume_from={own / 'step-1'}"])
    capsys.readouterr()
    lay, built, data, acc, policy = _loop_parts(cfg, one_rank, tmp_path / "resumed")
    loop = train.build(cfg, lay, built, data, acc, [], tmp_path / "resumed", None, None, policy)
    try:
        assert train.start(loop) == 2
    finally:
        loop.feed.close()
    out = capsys.readouterr().out
    assert f"checkpoint: resumed from {own / 'step-1'} (step 1" in out and "step 0: started from" not in out
    assert all(o.state for o in loop.opt)  # AdamW's moments of the phase's step 1


@pytest.mark.e2e
def test_a_two_rank_phase_under_tp_is_pinned_and_recorded(source, tmp_path):
    """python -m runner under tp2 from the one-rank run folder: frozen.yaml names step-4 and its record, the step-0 line
    says so, and the first loss is the forward loss of step-4's weights (resharded by DCP) on the first batch."""
    src, src_rows = source
    run_dir = tmp_path / "tp2"
    shape = [o for o in SHAPE if not o.startswith("lr_scheduler.warmup_steps=")]
    argv = [*shape, "parallelism=tp2", "training.steps=1", "lr_scheduler.warmup_steps=1", f"checkpoint.init_from={src}"]
    proc = run_cli(*argv, run_dir=run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    step4 = src / "checkpoints" / "step-4"
    frozen = freeze.load(run_dir / runfiles.FROZEN)
    assert (frozen.checkpoint.init_from, frozen.checkpoint.init_record) == (str(step4), checkpoint.weights_record(step4))
    assert f"# This run started from the model weights of {step4} (checkpoint.init_from" in (run_dir / runfiles.FROZEN).read_text()
    assert f"step 0: started from the model weights of checkpoint {step4} (step 4, layout single;" in proc.stdout
    (row,) = metrics(run_dir)
    assert row["data_hash"] == src_rows[0]["data_hash"]
    assert row["loss"] == pytest.approx(expected_loss(frozen, step4), abs=LOSS_ATOL_TP)


# ---- validation on fake checkpoints (runner.config only) -------------------------------------------------------


def _fake(folder: Path, step: int, shard: bytes = b"x" * 10, **model) -> Path:
    """A published checkpoint as DCP and the Checkpointer leave it, of the debug model (with `model`'s changes)."""
    part = checkpoint.partial_path(folder, step)
    part.mkdir(parents=True)
    (part / ".metadata").write_bytes(dcp_metadata())
    (part / "__0_0.distcp").write_bytes(shard)
    info = {"step": step, "layout": "single", "model": {**checkpoint.model_identity(ModelConfig()), **model}}
    return checkpoint.publish(part, checkpoint.final_path(folder, step), info, checkpoint.file_records(part))


def _problems(fn, *args) -> list[tuple[str, object, str]]:
    with pytest.raises(ConfigError) as e:
        fn(*args)
    return [(p.field, p.value, p.why) for p in e.value.problems]


def test_a_run_folder_or_a_checkpoint_folder_names_its_newest_intact_checkpoint(tmp_path):
    run = tmp_path / "run"
    for s in (2, 4):
        _fake(run / "checkpoints", s)
    _fake(run / "checkpoints", 6)
    (run / "checkpoints" / "step-6" / "__0_0.distcp").write_bytes(b"y" * 10)  # changed in place: only its CRC-32 tells
    (run / "checkpoints" / "step-8.partial").mkdir()
    step4 = run / "checkpoints" / "step-4"
    for given in (run, run / "checkpoints"):
        pick, skipped = checkpoint.weights_source(given)
        assert pick == step4 and len(skipped) == 1 and "step-6: __0_0.distcp has crc32" in skipped[0]
    assert checkpoint.weights_source(run / "checkpoints" / "step-2") == (run / "checkpoints" / "step-2", [])
    # a run folder whose frozen.yaml put its checkpoints elsewhere
    other = tmp_path / "other"
    other.mkdir()
    (other / runfiles.FROZEN).write_text(f"checkpoint:\n  folder: {run / 'checkpoints'}\n")
    assert checkpoint.weights_source(other)[0] == step4
    assert checkpoint.weights_source(tmp_path / "nowhere") == (None, ["no such folder"])


def test_freezing_pins_the_checkpoint_and_a_replay_refuses_a_changed_one(compose, tmp_path):
    run = tmp_path / "run"
    step4 = _fake(run / "checkpoints", 4)
    cfg = compose(["parallelism=single", f"checkpoint.init_from={run}"])
    validate.preflight(cfg, tmp_path / "phase")
    freeze.pin(cfg, tmp_path / "phase")
    files = json.dumps(checkpoint.marker(step4)["files"], sort_keys=True).encode()
    record = {"step": 4, "num_files": 2, "files_sha256": hashlib.sha256(files).hexdigest()}
    assert (cfg.checkpoint.init_from, cfg.checkpoint.init_record) == (str(step4), record)
    (tmp_path / "phase").mkdir()
    frozen = freeze.load(freeze.write(cfg, validate.check(cfg), tmp_path / "phase"))
    assert (frozen.checkpoint.init_from, frozen.checkpoint.init_record) == (str(step4), record)
    _fake(run / "checkpoints", 6)  # newer: the replay still starts from step-4
    validate.preflight(frozen, tmp_path / "replay")
    freeze.pin(frozen, tmp_path / "replay")
    assert frozen.checkpoint.init_from == str(step4)
    shutil.rmtree(step4)
    _fake(run / "checkpoints", 4, shard=b"y" * 12)  # saved again: the same step, other weights
    ((field, value, why),) = _problems(validate.preflight, frozen, tmp_path / "replay")
    assert (field, value) == ("checkpoint.init_from", str(step4))
    now = checkpoint.weights_record(step4)["files_sha256"]
    was = record["files_sha256"]
    assert why == f"changed since this run was frozen (files_sha256 {was} -> {now}): the replay would start from other weights"


def test_what_cannot_be_started_from_is_refused_before_launch(compose, tmp_path):
    run = tmp_path / "run"
    _fake(run / "checkpoints", 4, ffn_hidden_dim=1024)
    (tmp_path / "empty").mkdir()  # no checkpoint
    empty = tmp_path / "empty"
    cases = {
        tmp_path / "nowhere": "no such folder",
        empty: f"holds no checkpoint: no step-<n> folder in it or in its checkpoint folder {empty / 'checkpoints'}",
        run: f"the checkpoint {run / 'checkpoints' / 'step-4'} holds another model: ffn_hidden_dim 1024 (this run 768)",
    }
    for given, why in cases.items():
        cfg = compose(["parallelism=single", f"checkpoint.init_from={given}"])
        assert _problems(validate.preflight, cfg, tmp_path / "phase") == [("checkpoint.init_from", str(given), why)]
        cfg.mode = Mode.validate  # mode=validate runs the same preflight
        assert _problems(validate.preflight, cfg, tmp_path / "phase") == [("checkpoint.init_from", str(given), why)]
    (run / "checkpoints" / "step-4" / "__0_0.distcp").write_bytes(b"x")  # truncated
    cfg = compose(["parallelism=single", f"checkpoint.init_from={run / 'checkpoints' / 'step-4'}"])
    ((_, _, why),) = _problems(validate.preflight, cfg, tmp_path / "phase")
    assert why == "is not an intact checkpoint: __0_0.distcp has 1 bytes, 10 were written"


def test_one_source_of_weights_and_a_folder_of_its_own(compose, tmp_path):
    both = compose(["parallelism=single", f"checkpoint.init_from={tmp_path}", f"model.init_from={tmp_path}"])
    (problem,) = [p for p in _problems_of(both) if p.field == "checkpoint.init_from"]
    assert problem.why == "model.init_from names weights to start from too: a run starts from one source of weights"
    assert problem.fix == "drop checkpoint.init_from or model.init_from"
    stray = compose(["parallelism=single", "+checkpoint.init_record.step=4"])
    assert [(p.field, p.why) for p in _problems_of(stray)] == [
        ("checkpoint.init_record", "records a checkpoint to start from, but checkpoint.init_from is empty")
    ]
    step4 = _fake(tmp_path / "ckpt", 4)
    cfg = compose(["parallelism=single", "checkpoint=local", f"checkpoint.folder={tmp_path / 'ckpt'}", f"checkpoint.init_from={step4}"])
    ((field, _, why),) = _problems(validate.preflight, cfg, tmp_path / "phase")
    assert field == "checkpoint.folder" and why.startswith(f"holds {step4}, the checkpoint checkpoint.init_from starts from")


def _problems_of(cfg) -> list:
    with pytest.raises(ConfigError) as e:
        validate.check(cfg)
    return e.value.problems
