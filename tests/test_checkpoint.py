"""Checkpoints and text data: atomic publishing, keep-last, corrupted-latest fallback, exact resume.

Launches are shared (each costs ~11 s of imports): the session's one Hydra multirun (conftest's shared_runs)
trains an uninterrupted 4-rank reference run (FSDP2 x TP, data=text, an async checkpoint every step) that every
resume is compared with, and a run whose rank 1 is SIGKILLed at step 4 and restarted by the elastic agent; one
restart by hand (frozen-YAML replay with checkpoint.resume=true) from a copy of the reference checkpoints whose
newest is gone and next-newest truncated; one 2-rank pipeline run that resumes the FSDP2 x TP checkpoint under
another layout.
The folder logic itself is unit-tested without ranks.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from runner.config import freeze, validate
from runner.formats import checkpoint, runfiles
from runner.outputs import goodput
from runner.schema import ModelConfig
from runner.schema.problems import ConfigError
from tests import text_assets
from tests.conftest import dcp_metadata, metrics, run_cli
from tests.multiruns import Lazy
from tests.points import CHECKPOINT_KILL_AT as KILL_AT
from tests.points import CHECKPOINT_POINTS as POINTS
from tests.points import CHECKPOINT_STEPS as STEPS
from tests.points import checkpoint_common as _common

LOSS_ATOL = 1e-4  # another layout: float32 reduction-order noise (as in test_train's parity)


@pytest.fixture(scope="module")
def assets(text_files):
    return text_files  # the same files the shared runs read


def _ok(proc, name: str) -> None:
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def _by_step(run_dir: Path) -> dict[int, dict]:
    """Last row logged for each step (a restarted run logs the steps after its checkpoint again)."""
    return {r["step"]: r for r in metrics(run_dir)}


@pytest.fixture(scope="module")
def trained(shared_runs):
    """The reference and the killed run (POINTS in tests/points.py): {name: (run folder, its console)}; reading a point
    that failed fails the test that reads it."""
    return Lazy(POINTS, lambda name: (shared_runs[f"ckpt-{name}"][0], SimpleNamespace(stdout=shared_runs[f"ckpt-{name}"][1])))


@pytest.fixture(scope="module")
def reference(trained):
    return trained["reference"]


@pytest.fixture(scope="module")
def killed(trained):
    return trained["killed"]


# ---- with ranks -------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_reference_run_keeps_last_three_complete_and_exports_model(reference):
    run_dir, proc = reference
    folder = run_dir / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["model-final", "model-hf", "step-4", "step-5", "step-6"]
    for step in (4, 5, 6):
        path = folder / f"step-{step}"
        assert checkpoint.verify(path) is None  # the async save of the last step completed before exit
        info = checkpoint.marker(path)
        assert (info["step"], info["world_size"], info["degrees"], info["async_save"]) == (step, 4, "dp_shard=2 x tp=2", True)
        assert sorted(info["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
        assert info["files"] == checkpoint.file_records(path)  # sizes and CRC-32s of the files as they are on disk
        assert info["model"] == checkpoint.model_identity(ModelConfig())  # every architecture field of the debug model
    assert (folder / "model-final" / ".metadata").is_file()
    # model-only: its shards are a third of a full checkpoint's (weights vs weights + two AdamW moments)
    full = sum(f["bytes"] for f in checkpoint.marker(folder / "step-6")["files"].values())
    model = sum(p.stat().st_size for p in (folder / "model-final").iterdir())
    assert 0.25 < model / full < 0.4
    assert [f"checkpoint: deleted step-{s} (keep 3)" in proc.stdout for s in (1, 2, 3)] == [True] * 3
    assert not list(folder.glob("*.partial"))


@pytest.mark.e2e
def test_reference_start_up_shows_planner_interval_and_data_check(reference):
    run_dir, proc = reference
    assert "checkpoints: every 1 step (async, keep 3) into checkpoints; planner suggests " in proc.stdout
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("checkpoints:"))
    assert "Young/Daly" in line and "MTBF 0.01 h" in line
    # global batch 8 over 2 DP replicas: samples 0-3 and 4-7
    check = "data check: first batch identical on the 2 ranks of each TP/CP/PP group, disjoint samples across 2 DP replica(s)"
    assert f"{check} (global samples 0-3, 4-7)" in proc.stdout
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert len({r["data_hash"] for r in rows}) == STEPS  # every step reads new samples
    assert all(r["checkpoint_s"] > 0 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]


@pytest.mark.e2e
def test_sigkilled_rank_restarted_by_agent_resumes_exactly(reference, killed):
    ref, got = _by_step(reference[0]), _by_step(killed[0])
    out = killed[1].stdout
    resumed = [ln for ln in out.splitlines() if ln.startswith("checkpoint: resumed from")]
    assert len(resumed) == 1, out[-3000:]
    back = int(resumed[0].split("(step ")[1].split(",")[0])
    assert 1 <= back < KILL_AT
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):  # bit-identical losses, the same samples and learning rates at every step
        keys = ("loss", "grad_norm", "data_hash", "lr")
        assert [got[s][k] for k in keys] == [ref[s][k] for k in keys], s
    assert ref[STEPS]["lr"] < ref[2]["lr"]  # the schedule decays (cosine to 0.1 x), with parameter groups
    rows = metrics(killed[0])
    assert [r["step"] for r in rows] == list(range(1, KILL_AT)) + list(range(back + 1, STEPS + 1))
    assert [(r["attempt"], r.get("repeat", False)) for r in rows] == [(0, False)] * (KILL_AT - 1) + [
        (1, s < KILL_AT) for s in range(back + 1, STEPS + 1)
    ]


@pytest.mark.e2e
def test_sigkilled_run_reports_its_lost_work_and_one_restart_gap(killed):
    """goodput.json of the killed run: lost work is attempt 0's time from the end of the step the restart resumed from
    to the kill (rank 1's log says when: monitor.inject), then one restart gap up to the restarted rank 0's start."""
    run_dir, proc = killed
    g, events = json.loads((run_dir / runfiles.GOODPUT).read_text()), goodput.read(run_dir)
    back = int(next(ln for ln in proc.stdout.splitlines() if ln.startswith("checkpoint: resumed from")).split("(step ")[1].split(",")[0])
    (kill,) = [ln for p in (run_dir / runfiles.LOGS).rglob("stdout.log") for ln in p.read_text().splitlines() if ln.startswith("inject: ")]
    assert kill.startswith(f"inject: SIGKILL rank 1 at step {KILL_AT}, time ")
    (checkpointed,) = [e["end"] for e in events if e["event"] == "step" and (e["attempt"], e["step"]) == (0, back)]
    expected = float(kill.rsplit(" ", 1)[1]) - checkpointed  # the steps after `back` and the start of step 4
    # within 5 %; 20 ms at least: the ranks mark their phases that far apart (a checkpoint of step 3 leaves ~10 ms)
    assert g["parts_s"]["lost"] == pytest.approx(expected, rel=0.05, abs=0.02), (g["parts_s"], expected)
    first, second = g["attempts"]
    assert (first["how"], second["how"], second["resumed_from_step"], g["restarts"], g["requeues"]) == ("failed", "ended", back, 1, 0)
    assert g["parts_s"]["restart_gap"] == pytest.approx(second["start"] - first["failure"]["time"]) and g["parts_s"]["restart_gap"] > 0
    assert g["repeated_steps"] == KILL_AT - 1 - back == sum(r.get("repeat", False) for r in metrics(run_dir))
    assert g["unaccounted_s"] < 0.02 * g["total_s"], g
    assert "1 restart, 0 requeues" in next(ln for ln in proc.stdout.splitlines() if ln.startswith("goodput: "))


def _copy_checkpoints(reference, dest: Path, steps: list[int]) -> Path:
    dest.mkdir(parents=True)
    for s in steps:
        shutil.copytree(reference[0] / "checkpoints" / f"step-{s}", dest / f"step-{s}")
    return dest


def _corrupt(shard: Path) -> tuple[str, str]:
    """Flip one byte in the middle of a file (its size unchanged); return its CRC-32 before and after."""
    before = checkpoint.crc32(shard)
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    return before, checkpoint.crc32(shard)


@pytest.mark.e2e
def test_manual_restart_skips_corrupted_latest_and_resumes_exactly(reference, tmp_path):
    """The job stopped after step 5 (no step 6); step-5 has a shard corrupted in place (same size); a leftover
    .partial is ignored. The resumed run's frozen.yaml replays it: from the same step-4, not from the newest."""
    folder = _copy_checkpoints(reference, tmp_path / "ckpt", [4, 5])
    written, now = _corrupt(folder / "step-5" / "__1_0.distcp")
    (folder / "step-7.partial").mkdir()
    run_dir = tmp_path / "manual"
    replay = ["--config-dir", str(reference[0]), "--config-name", "frozen"]
    proc = run_cli(*replay, "checkpoint.resume=true", f"checkpoint.folder={folder}", "checkpoint.export_final_model=false", run_dir=run_dir)
    _ok(proc, "manual resume")
    why = f"__1_0.distcp has crc32 {now}, {written} was written (its content changed after the save)"
    assert f"WARNING: skipping checkpoint {folder / 'step-5'}: {why}; falling back to {folder / 'step-4'}" in proc.stderr
    assert f"checkpoint: resumed from {folder / 'step-4'} (step 4, layout tp2_dp2)" in proc.stdout
    ref, got = _by_step(reference[0]), _by_step(run_dir)
    assert sorted(got) == [5, 6]
    for s in (5, 6):
        assert (got[s]["loss"], got[s]["grad_norm"], got[s]["data_hash"]) == (ref[s]["loss"], ref[s]["grad_norm"], ref[s]["data_hash"])
    assert checkpoint.verify(folder / "step-6") is None and not (folder / "step-7.partial").exists()
    # the frozen file names the checkpoint the run started from; its replay resumes from it although step-6 is newer
    text = (run_dir / runfiles.FROZEN).read_text()
    assert f"# This run resumed from {folder / 'step-4'} (checkpoint.resume_from)." in text
    frozen = freeze.load(run_dir / runfiles.FROZEN)
    assert (frozen.checkpoint.resume, frozen.checkpoint.resume_from) == (True, str(folder / "step-4"))
    assert frozen.provenance["resumed_from"] == str(folder / "step-4")
    validate.preflight(frozen, tmp_path / "replay")  # before the fix: "step-6 is already at step 6"
    assert frozen.checkpoint.resume_from == str(folder / "step-4")


@pytest.mark.e2e
def test_pipeline_run_resumes_fsdp_tp_checkpoint_and_saves_its_own(reference, assets, tmp_path):
    """dp_shard=2 x tp=2 -> pp=2 through DCP resharding: same samples, losses within reduction-order noise."""
    folder = _copy_checkpoints(reference, tmp_path / "ckpt", [4])
    run_dir = tmp_path / "pp"
    layout = ["parallelism=tp2_pp2", "parallelism.tp=1"]
    proc = run_cli(*_common(assets), *layout, "checkpoint.resume=true", f"checkpoint.folder={folder}", run_dir=run_dir)
    _ok(proc, "pp resume")
    assert "RNG states not restored: saved by 4 ranks" in proc.stdout
    ref, got = _by_step(reference[0]), _by_step(run_dir)
    assert sorted(got) == [5, 6]
    for s in (5, 6):
        assert got[s]["data_hash"] == ref[s]["data_hash"]
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], abs=LOSS_ATOL)
    info = checkpoint.marker(folder / "step-6")
    assert (info["world_size"], info["degrees"]) == (2, "pp=2") and checkpoint.verify(folder / "step-6") is None
    assert sorted(info["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one shard per pipeline stage
    # the pipeline layout's checkpoint (one file per stage) exports too, with the logits of the runner's model
    from runner.run import hf_export
    from tests import hf_compare

    code = hf_export.main([str(folder / "step-6"), "--format", "hf", "--out", str(tmp_path / "hf")])
    assert code == 0
    cfg = freeze.load(run_dir / runfiles.FROZEN)
    gap, top = hf_compare.logits_gap(
        hf_compare.titan_from_checkpoint(cfg, folder / "step-6"), hf_compare.load_hf(tmp_path / "hf"), _held_out(assets)
    )
    assert gap <= hf_compare.LOGITS_RTOL * top


def _held_out(assets):
    """2 x 64 tokens of documents the runs never read (another seed of the same made-up language)."""
    import torch
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(assets[1])).encode(" ".join(text_assets.documents(8, seed=99))).ids
    return torch.tensor(ids[:128]).view(2, 64)


HF_FILES = [
    "config.json",
    "generation_config.json",
    "model-00001-of-00001.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
]


@pytest.mark.e2e
def test_reference_exports_hf_that_transformers_reads_with_the_runner_logits(reference, assets):
    """checkpoint.export_hf: the FSDP2 x TP run's last checkpoint (4 ranks' shards) as a Hugging Face folder with the
    run's tokenizer; transformers' logits on held-out tokens equal the runner's model of the same checkpoint."""
    import torch

    from tests import hf_compare

    run_dir, proc = reference
    folder = run_dir / "checkpoints" / "model-hf"
    assert f"checkpoint: Hugging Face export of step-6 in {folder}" in proc.stdout
    assert sorted(p.name for p in folder.iterdir()) == HF_FILES
    cfg = freeze.load(run_dir / runfiles.FROZEN)
    model, hf = hf_compare.titan_from_checkpoint(cfg, run_dir / "checkpoints" / "step-6"), hf_compare.load_hf(folder)
    hf_compare.assert_round_trip(model, cfg, folder)  # the 4 ranks' shards, whole and bitwise
    tokens = _held_out(assets)
    gap, top = hf_compare.logits_gap(model, hf, tokens)
    assert gap <= hf_compare.LOGITS_RTOL * top
    with torch.no_grad():  # the runner's loss on the same tokens, as its evaluation computes it, and transformers'
        want = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        got = torch.nn.functional.cross_entropy(hf(tokens[:, :-1]).logits.flatten(0, 1), tokens[:, 1:].flatten())
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    assert float(want) < 7.5  # 6 steps trained (the rate decaying over them): below the uniform ln(2048) = 7.62 on unseen text


# ---- without ranks -----------------------------------------------------------------------------------


def _fake(folder: Path, step: int, sizes=(10, 20), publish=True, metadata: bytes | None = None) -> Path:
    """A checkpoint folder as DCP leaves it (.metadata + one shard per rank), published or still partial."""
    part = checkpoint.partial_path(folder, step)
    part.mkdir(parents=True)
    (part / ".metadata").write_bytes(dcp_metadata() if metadata is None else metadata)
    for r, n in enumerate(sizes):
        (part / f"__{r}_0.distcp").write_bytes(b"x" * n)
    if not publish:
        return part
    return checkpoint.publish(part, checkpoint.final_path(folder, step), {"step": step}, checkpoint.file_records(part))


def test_publish_is_a_rename_with_a_marker_of_every_file(tmp_path):
    final = _fake(tmp_path, 3)
    assert final == tmp_path / "step-3" and not (tmp_path / "step-3.partial").exists()
    crc = {n: f"{zlib.crc32(c * k):08x}" for n, c, k in (("__0_0.distcp", b"x", 10), ("__1_0.distcp", b"x", 20))}
    meta = dcp_metadata()
    assert checkpoint.marker(final) == {
        "step": 3,
        "files": {
            ".metadata": {"bytes": len(meta), "crc32": f"{zlib.crc32(meta):08x}"},
            "__0_0.distcp": {"bytes": 10, "crc32": crc["__0_0.distcp"]},
            "__1_0.distcp": {"bytes": 20, "crc32": crc["__1_0.distcp"]},
        },
    }
    assert checkpoint.verify(final) is None
    assert checkpoint.file_records(final, checksum=False) == {
        ".metadata": {"bytes": len(meta)},
        "__0_0.distcp": {"bytes": 10},
        "__1_0.distcp": {"bytes": 20},
    }


def test_shard_changed_in_place_falls_back_like_a_truncated_one(tmp_path):
    """Same size, other content: only the checksum tells. Keep-last judges by size (it runs after every save)."""
    for s in (1, 2):
        _fake(tmp_path, s)
    (tmp_path / "step-2" / "__0_0.distcp").write_bytes(b"y" * 10)
    pick, warnings = checkpoint.choose(tmp_path)
    want = f"{zlib.crc32(b'x' * 10):08x}"
    assert pick == tmp_path / "step-1"
    assert warnings == [
        f"skipping checkpoint {tmp_path / 'step-2'}: __0_0.distcp has crc32 {zlib.crc32(b'y' * 10):08x}, {want} was written "
        f"(its content changed after the save); falling back to {pick}"
    ]
    assert checkpoint.verify(tmp_path / "step-2", deep=False) is None
    # a checkpoint saved with checkpoint.checksum=false is judged by its sizes
    part = _fake(tmp_path, 3, publish=False)
    checkpoint.publish(part, checkpoint.final_path(tmp_path, 3), {"step": 3}, checkpoint.file_records(part, checksum=False))
    (tmp_path / "step-3" / "__0_0.distcp").write_bytes(b"y" * 10)
    assert checkpoint.choose(tmp_path) == (tmp_path / "step-3", [])


def test_choose_newest_complete_and_warn_about_broken_newer(tmp_path):
    for s in (1, 2, 3, 4):
        _fake(tmp_path, s)
    _fake(tmp_path, 6, publish=False)  # a save in flight or killed: never chosen, never warned about
    (tmp_path / "step-4" / "__1_0.distcp").write_bytes(b"x" * 7)  # truncated
    (tmp_path / "step-3" / runfiles.CHECKPOINT_MARKER).unlink()  # never marked
    (tmp_path / "step-5").mkdir()  # no marker, no files
    pick, warnings = checkpoint.choose(tmp_path)
    assert pick == tmp_path / "step-2"
    assert warnings == [
        f"skipping checkpoint {tmp_path / 'step-5'}: no COMPLETE.json (the save never finished); falling back to {pick}",
        f"skipping checkpoint {tmp_path / 'step-4'}: __1_0.distcp has 7 bytes, 20 were written; falling back to {pick}",
        f"skipping checkpoint {tmp_path / 'step-3'}: no COMPLETE.json (the save never finished); falling back to {pick}",
    ]
    assert checkpoint.choose(tmp_path, before=2) == (tmp_path / "step-1", [])
    (tmp_path / "step-2" / ".metadata").unlink()
    assert checkpoint.choose(tmp_path)[0] == tmp_path / "step-1"
    assert checkpoint.choose(tmp_path / "missing") == (None, [])


def test_keep_last_deletes_only_old_complete_checkpoints(tmp_path):
    for s in (1, 2, 3, 5, 6):
        _fake(tmp_path, s)
    _fake(tmp_path, 7, publish=False)
    (tmp_path / "step-5" / "__0_0.distcp").unlink()  # broken: not counted, not deleted
    assert checkpoint.prune(tmp_path, keep=2) == [tmp_path / "step-2", tmp_path / "step-1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3", "step-5", "step-6", "step-7.partial"]
    assert checkpoint.prune(tmp_path, keep=0) == []


def test_text_data_shards_are_disjoint_and_position_survives_a_batch_change(assets, tmp_path):
    import torch

    from runner.run import loader as data

    corpus, tok = assets
    tokens = data.load_tokens([str(corpus)], "json", "text", str(tok), text_assets.EOS, tmp_path / "cache")
    eos = json.loads(tok.read_text())["added_tokens"][0]["id"]
    assert int((tokens == eos).sum()) == 300  # one EOS after each document

    def shard(r, dp, gb=8):
        return data.TextData(tokens, seed=0, shuffle=True, seq_len=64, global_batch=gb, microbatch=2, dp_rank=r, dp=dp)

    whole = shard(0, 1)
    parts = [shard(r, 4) for r in range(4)]
    assert torch.cat([p.positions(3) for p in parts]).tolist() == whole.positions(3).tolist()
    starts = [s for _, s in whole.positions(3).tolist()]
    assert len(set(starts)) == 8 and all(s % 64 == 0 for s in starts)  # 8 different pieces of the stream
    inp, lab, _ = whole.microbatches(3)[0]
    assert torch.equal(inp[:, 1:], lab[:, :-1]) and torch.equal(inp[0], tokens[starts[0] : starts[0] + 64])
    # resume after 5 steps of 8 samples with a global batch of 4: the next samples are 40..43
    resumed = shard(0, 1, gb=4)
    resumed.load_state_dict(whole.state_dict(5), 5)
    assert resumed.indices(5) == [40, 41, 42, 43] and resumed.indices(6) == [44, 45, 46, 47]
    # a second epoch visits every piece again in another order
    n = whole.num_samples
    first, second = [whole.token_start(i) for i in range(n)], [whole.token_start(n + i) for i in range(n)]
    assert sorted(first) == sorted(second) and first != second


@pytest.mark.e2e
def test_checkpoint_folder_and_text_data_fail_before_launch(tmp_path, assets):
    """Not writable (a file where a folder should be), no room, missing data: exit 2, one message, nothing written."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    run_dir = tmp_path / "run"
    proc = run_cli(
        "checkpoint=local",
        f"checkpoint.folder={blocker / 'ckpt'}",
        "data=text",
        f"data.files=[{tmp_path / 'nope.jsonl'}]",
        f"data.tokenizer={assets[1]}",
        run_dir=run_dir,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and not run_dir.exists()
    assert "Invalid config (2 problems):" in proc.stderr
    why = f"{blocker} is a file, so the folder cannot be made. Fix: name a folder path."
    assert f"checkpoint.folder = {blocker / 'ckpt'}: {why}" in proc.stderr
    assert f"data.files = ['{tmp_path / 'nope.jsonl'}']: not found" in proc.stderr


def test_tokenizer_larger_than_the_model_vocabulary_is_rejected(compose, assets, tmp_path):
    cfg = compose(["data=text", f"data.files=[{assets[0]}]", f"data.tokenizer={assets[1]}"])
    validate.preflight(cfg, tmp_path)  # 512 tokens fit the debug model's 2048
    cfg.model.vocab_size = 256
    with pytest.raises(ConfigError) as e:
        validate.preflight(cfg, tmp_path)
    (p,) = e.value.problems
    assert p.field == "data.tokenizer" and p.why == "its vocabulary has 512 tokens, more than model.vocab_size 256"


def test_full_checkpoint_filesystem_is_rejected(compose, tmp_path):
    cfg = compose(["checkpoint=local", "checkpoint.min_free_gb=1e12", "training.steps=10", "checkpoint.interval=5"])
    with pytest.raises(ConfigError) as e:
        validate.preflight(cfg, tmp_path)
    (p,) = e.value.problems
    one = checkpoint.size_estimate_gb(6_163_712)
    assert p.field == "checkpoint.folder" and f"2 checkpoint(s) of {one:.3g} GB (fp32 weights + AdamW state)" in p.why
    assert f"checkpoint.min_free_gb 1e+12 need {2 * one + 1e12:.3g} GB" in p.why


def _with_model(path: Path, **changes) -> None:
    marker = path / runfiles.CHECKPOINT_MARKER
    body = json.loads(marker.read_text())
    body["model"] = {**checkpoint.model_identity(ModelConfig()), **changes}
    marker.write_text(json.dumps(body))


def test_resume_of_another_model_is_rejected_before_launch(compose, tmp_path):
    """Any architecture field counts: the same name, flavor, dim, layers and vocabulary with another FFN width is another model."""
    _with_model(_fake(tmp_path / "checkpoints", 4), ffn_hidden_dim=1024)
    cfg = compose(["checkpoint=local", "checkpoint.resume=true", "training.steps=8"])
    with pytest.raises(ConfigError) as e:
        validate.preflight(cfg, tmp_path)
    (p,) = e.value.problems
    assert (p.field, p.why) == (
        "checkpoint.resume",
        f"the checkpoint {tmp_path / 'checkpoints' / 'step-4'} holds another model: ffn_hidden_dim 1024 (this run 768)",
    )
    assert cfg.checkpoint.resume_from == ""  # nothing pinned


def test_resume_under_another_schedule_is_rejected_before_launch(compose, tmp_path):
    """The learning rate of a step depends on training.steps (the decay ends at the last step): a resume with another
    run length, or another warm-up, decay or peak rate, would continue another schedule and is refused, naming both
    values; a checkpoint written before schedules were recorded is not judged."""
    folder = _fake(tmp_path / "checkpoints", 4)
    marker = folder / runfiles.CHECKPOINT_MARKER
    body = json.loads(marker.read_text())
    body["model"] = checkpoint.model_identity(ModelConfig())
    body["schedule"] = checkpoint.schedule(compose(["training.steps=8"]))
    marker.write_text(json.dumps(body))
    cfg = compose(["checkpoint=local", "checkpoint.resume=true", "training.steps=12"])
    with pytest.raises(ConfigError) as e:
        validate.preflight(cfg, tmp_path)
    (p,) = e.value.problems
    assert (p.field, p.value) == ("training.steps", 12)
    assert p.why.startswith(
        f"the checkpoint {folder} was trained under another learning-rate schedule (training.steps 8 in the checkpoint, 12 now)"
    )
    validate.preflight(compose(["checkpoint=local", "checkpoint.resume=true", "training.steps=8"]), tmp_path)  # the same: resumes
    body.pop("schedule")
    marker.write_text(json.dumps(body))
    validate.preflight(compose(["checkpoint=local", "checkpoint.resume=true", "training.steps=12"]), tmp_path)


def test_a_file_where_the_run_writes_a_folder_is_refused_naming_it(compose, tmp_path):
    """A checkpoint.local.folder that is a file passed the preflight and failed rank 0 after its first local save
    (NotADirectoryError, a rank traceback); every folder the run writes is checked, and each file named."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for name in ("local", "run/checkpoints/model-hf", "run/profile"):
        (tmp_path / name).write_text("")
    cfg = compose(["checkpoint=local", f"checkpoint.local.folder={tmp_path / 'local'}", "checkpoint.export_hf=true", "profile.steps=[2]"])
    with pytest.raises(ConfigError) as e:
        validate.preflight(cfg, run)
    assert [str(p) for p in e.value.problems] == [
        f"checkpoint.export_hf = True: {run}/checkpoints/model-hf is a file, not a folder (the run writes the Hugging Face "
        "export there). Fix: name a folder, or move that file away.",
        f"checkpoint.local.folder = {tmp_path}/local: {tmp_path}/local is a file, not a folder. Fix: name a folder, or move "
        "that file away.",
        f"hydra.run.dir = {run}: {run}/profile is a file, not a folder (the run writes the profiler's traces there). "
        "Fix: name a folder, or move that file away.",
    ]


@pytest.mark.parametrize(
    "metadata, why",
    [
        (b"m" * 5, "is not the pickle DCP wrote (at position 0, opcode b'm' unknown): cut short or overwritten"),
        (b"\x80\x04\x95", "is not the pickle DCP wrote (not enough data in stream to read uint8): cut short or overwritten"),
        (b"\x80\x04}\x94.", "holds a pickle of no class, not DCP's Metadata"),
    ],
    ids=["overwritten", "cut short", "another object"],
)
def test_a_checkpoint_whose_dcp_metadata_does_not_open_is_refused_before_launch(compose, tmp_path, metadata, why):
    """Its marker's sizes and CRC-32s match (recorded from the bad file), so it passed, and every rank failed with DCP's
    "metadata is None" and torch's elastic error page; a resume and checkpoint.init_from now name the file, exit 2."""
    step4 = _fake(tmp_path / "checkpoints", 4, metadata=metadata)
    _with_model(step4)
    assert checkpoint.verify(step4) is None  # intact as far as its marker tells
    resume = compose(["checkpoint=local", "checkpoint.resume=true", "training.steps=8"])
    init = compose([f"checkpoint.init_from={step4}"])
    for cfg, field, value in ((resume, "checkpoint.resume", True), (init, "checkpoint.init_from", str(step4))):
        with pytest.raises(ConfigError) as e:
            validate.preflight(cfg, tmp_path)
        (p,) = e.value.problems
        assert (p.field, p.value, p.why) == (field, value, f"the checkpoint {step4} cannot be loaded: {step4}/.metadata {why}")


def test_ctrl_c_line_names_the_step_reached_and_removes_a_save_it_cut_off(compose, tmp_path):
    """What `python -m runner` prints when Ctrl-C stops a run (runner.run.node_launch.interrupted; a real one in
    tests/test_train.py): the last step of the timeline, the newest checkpoint and the command that resumes from it."""
    from runner.run import node_launch

    steps = "".join(json.dumps({"event": "step", "step": s}) + "\n" for s in (1, 2, 3))
    (tmp_path / runfiles.TIMELINE).write_text(steps + '{"event": "st')  # rank 0 stopped mid-line: no step is known
    replay = f"python -m runner --config-dir {tmp_path} --config-name frozen"
    assert node_launch.interrupted(compose([]), tmp_path) == (
        f"interrupted at start-up (no step finished); checkpoints are off, so a rerun starts at step 1: {replay}"
    )
    (tmp_path / runfiles.TIMELINE).write_text(steps)
    cfg = compose(["checkpoint=local"])
    folder = tmp_path / "checkpoints"
    assert node_launch.interrupted(cfg, tmp_path) == (
        f"interrupted at step 3; no checkpoint to resume from in {folder} yet, so a rerun starts at step 1: {replay}"
    )
    _fake(folder, 2)
    _fake(folder, 3, publish=False)  # the save Ctrl-C cut off
    cfg.checkpoint.resume_from = str(folder / "step-1")  # this run resumed from step 1: its replay would again
    assert node_launch.interrupted(cfg, tmp_path) == (
        f"interrupted at step 3 (removed step-3.partial, a save it cut off); resume from step 2 with: {replay} "
        f"checkpoint.resume=true checkpoint.folder={folder} checkpoint.resume_from="
    )
    assert sorted(p.name for p in folder.iterdir()) == ["step-2"]


def test_resume_pins_the_checkpoint_it_starts_from(compose, tmp_path):
    for s in (2, 4):
        _with_model(_fake(tmp_path / "checkpoints", s))
    cfg = compose(["checkpoint=local", "checkpoint.resume=true", "training.steps=8", "data.files=[a.jsonl]"])
    before = copy.deepcopy(cfg)
    validate.preflight(cfg, tmp_path)
    assert cfg == before  # the preflight only reports: pinning is its own step, before freezing
    freeze.pin(cfg, tmp_path)
    assert cfg.checkpoint.resume_from == str(tmp_path / "checkpoints" / "step-4")
    assert cfg.data.files == [os.path.abspath("a.jsonl")]
    # a replay names it: the newest is not taken, and a pinned checkpoint that is gone is an error, not a fresh start
    _with_model(_fake(tmp_path / "checkpoints", 6))
    validate.preflight(cfg, tmp_path)
    freeze.pin(cfg, tmp_path)
    assert cfg.checkpoint.resume_from == str(tmp_path / "checkpoints" / "step-4")
    shutil.rmtree(tmp_path / "checkpoints" / "step-4")
    with pytest.raises(ConfigError) as e:
        validate.preflight(cfg, tmp_path)
    (p,) = e.value.problems
    assert (p.field, p.value, p.why) == (
        "checkpoint.resume_from",
        str(tmp_path / "checkpoints" / "step-4"),
        "cannot be resumed from: no such folder",
    )


@pytest.mark.parametrize("state", ["missing", "empty", "broken"])
def test_resume_with_nothing_to_resume_fails_before_launch(compose, tmp_path, state):
    where = tmp_path / "stopped" / "checkpoints"
    if state != "missing":
        where.mkdir(parents=True)
    if state == "broken":
        (_fake(where, 3) / "__0_0.distcp").unlink()
    cfg = compose(["checkpoint=local", "checkpoint.resume=true", f"checkpoint.folder={where}"])
    with pytest.raises(ConfigError) as e:
        validate.preflight(cfg, tmp_path / "run")
    (p,) = e.value.problems
    held = "does not exist" if state == "missing" else "holds no intact checkpoint"
    assert (p.field, p.why) == ("checkpoint.resume", f"nothing to resume: the checkpoint folder {where} {held}")


def test_resume_from_needs_resume(compose):
    from runner.config import validate

    with pytest.raises(ConfigError) as e:
        validate.check(compose(["checkpoint=local", "checkpoint.resume_from=/x/step-3"]))
    assert [(p.field, p.why) for p in e.value.problems] == [("checkpoint.resume_from", "is read only when resuming")]


LM_EVAL_TASK = """task: runner_export_check
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
  cache_dir: {cache}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
target_delimiter: ""
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
"""
"""A local lm-evaluation-harness task (docs/huggingface.md shows the same): `dataset_path: json` over a local file, so
nothing is downloaded; each item is scored by the log-likelihood of its continuation after its context."""


def _lm_eval_items(n: int = 4) -> list[dict[str, str]]:
    """Sentences the runs never read: the first three words as the context, the rest of the sentence as the continuation."""
    out = []
    for doc in text_assets.documents(n, seed=5):
        words = doc.split(".")[0].split(" ")
        out.append({"context": " ".join(words[:3]), "continuation": " " + " ".join(words[3:]) + "."})
    return out


def _no_network(monkeypatch) -> list[str]:
    """Every connection but a local (AF_UNIX) one fails and is recorded, and the Hugging Face libraries are told they
    are offline: what lm-eval and transformers read must be on disk."""
    import socket

    tried, connect, connect_ex = [], socket.socket.connect, socket.socket.connect_ex

    def local_only(original):
        def call(self, address):
            if self.family != socket.AF_UNIX:
                tried.append(str(address))
                raise OSError(f"no network in this test (a connection to {address})")
            return original(self, address)

        return call

    monkeypatch.setattr(socket.socket, "connect", local_only(connect))
    monkeypatch.setattr(socket.socket, "connect_ex", local_only(connect_ex))
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    return tried


@pytest.mark.e2e
def test_lm_eval_scores_the_export_with_transformers_log_likelihoods(reference, tmp_path, monkeypatch):
    """lm-evaluation-harness (`--model hf`, pretrained=<the export>) on a local task, with no network: each item's
    log-likelihood equals transformers' on the same tokens, and the task's perplexity is exp(-mean) of them.
    lm-eval (with its `hf` extra) is a dev dependency."""
    tried = _no_network(monkeypatch)
    import lm_eval
    import torch
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    from tests import hf_compare

    folder = reference[0] / "checkpoints" / "model-hf"
    items = _lm_eval_items()
    (tmp_path / "items.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "check.yaml").write_text(LM_EVAL_TASK.format(items=tmp_path / "items.jsonl", cache=tmp_path / "cache"))
    res = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={folder},dtype=float32",
        tasks=["runner_export_check"],
        device="cpu",
        batch_size=1,
        task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
        log_samples=True,
    )
    samples = sorted(res["samples"]["runner_export_check"], key=lambda s: s["doc_id"])
    tok, hf = AutoTokenizer.from_pretrained(str(folder)), hf_compare.load_hf(folder)
    wants = []
    for item, sample in zip(items, samples, strict=True):
        context, whole = tok(item["context"])["input_ids"], tok(item["context"] + item["continuation"])["input_ids"]
        assert whole[: len(context)] == context and len(whole) > len(context)
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([whole])).logits[0], dim=-1)
        want = sum(float(logp[i - 1, whole[i]]) for i in range(len(context), len(whole)))
        assert want < 0 and sample["resps"][0][0][0] == pytest.approx(want, rel=1e-5), item
        wants.append(want)
    perplexity = res["results"]["runner_export_check"]["perplexity,none"]
    assert perplexity == pytest.approx(math.exp(-sum(wants) / len(wants)), rel=1e-5)
    assert tried == []
