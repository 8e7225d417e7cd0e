"""Run labels name the layout that ran, and printed counts take the right number and device words."""

from __future__ import annotations

import json

import pytest

from runner.config import validate
from runner.estimate import plan
from runner.run import startup
from runner.schema import layout
from runner.schema.wording import count, device_unit
from tests.conftest import run_cli

SWEEP_70B = ["recipe=llama3_70b_h100x1024", "mode=plan"]


@pytest.mark.parametrize(
    "overrides,label,preset",
    [
        ([*SWEEP_70B, "parallelism.tp=4", "parallelism.pp=8", "parallelism.cp=2"], "tp4_cp2_pp8_1F1B_dp16", "tp8_pp4"),
        ([*SWEEP_70B, "parallelism.tp=8", "parallelism.pp=16"], "tp8_pp16_1F1B_dp8", "tp8_pp4"),
        (["parallelism=pp2_interleaved", "parallelism.pp_schedule=DualPipeV"], "pp2_DualPipeV_v2", "pp2_interleaved"),
        (["parallelism=pp2_interleaved"], "pp2_Interleaved1F1B_v2", "pp2_interleaved"),
        (["parallelism=single", "parallelism.dp_replicate=2", "parallelism.dp_shard=1"], "dpr2", "single"),
        (["parallelism=single"], "single", "single"),
    ],
)
def test_plan_labels_the_layout_that_runs(budget, overrides, label, preset):
    b = budget(overrides)
    assert (b["layout"], b["preset"]) == (label, preset)


def test_every_point_of_the_70b_sweep_has_its_own_label(compose):
    labels = set()
    for tp in (4, 8):
        for pp in (4, 8, 16):
            for cp in (1, 2):
                cfg = compose([*SWEEP_70B, f"parallelism.tp={tp}", f"parallelism.pp={pp}", f"parallelism.cp={cp}"])
                labels.add(layout.label(layout.resolve(cfg.parallelism, cfg.cluster), cfg.parallelism))
    assert len(labels) == 12 and "tp8_pp4_1F1B_dp32" in labels


def test_counts_take_their_number():
    assert [count(1, "rank"), count(4, "rank"), count(1, "microbatch"), count(3, "microbatch")] == [
        "1 rank",
        "4 ranks",
        "1 microbatch",
        "3 microbatches",
    ]
    assert (device_unit("cpu"), device_unit("cuda")) == ("CPU rank", "GPU")


@pytest.mark.e2e
def test_validate_report_counts_and_labels(tmp_path):
    replicas = ["parallelism=single", "parallelism.dp_replicate=2", "parallelism.dp_shard=1"]
    proc = run_cli(*replicas, "training.global_batch_size=4", "mode=validate")
    assert proc.returncode == 0, proc.stderr
    assert "  cluster local_cpu: 2 ranks, layout dpr2 [dp_replicate=2]" in proc.stdout
    assert "tokens/step, 1 microbatch of 2 per DP rank" in proc.stdout


def test_cpu_plan_speaks_of_cpu_ranks(compose):
    cfg = compose(["parallelism=single"])
    b = plan.compute(cfg, validate.check(cfg))
    rows = {r[0]: r for r in plan.rows(b)}
    assert rows["layout"][2] == "1 CPU rank"
    assert "parameters per CPU rank" in rows and rows["activations in flight"][2] == "1 microbatch"
    assert not any("GPU" in cell for r in plan.rows(b) for cell in r)
    gpu = compose(["recipe=llama3_70b_h100x1024"])
    g = plan.compute(gpu, validate.check(gpu))
    assert {r[0]: r for r in plan.rows(g)}["layout"][2] == "1024 GPUs"
    assert json.loads(json.dumps(g))["device"] == "cuda"


def test_startup_block_counts(compose, tmp_path):
    cfg = compose(["parallelism=single", "checkpoint=local", "checkpoint.interval=1"])
    lay = validate.check(cfg)
    text = startup.report(cfg, lay, tmp_path / "frozen.yaml", tmp_path / "fr", None)
    assert text.splitlines()[0] == "layout single: single rank, 1 rank on 1 node of 1"
    assert "checkpoints: every 1 step (" in text


def test_compare_shows_a_cpu_plan_with_the_rank_overhead(compose, tmp_path):
    from runner.outputs import run_rows

    cfg = compose(["parallelism=single"])
    b = plan.compute(cfg, validate.check(cfg))
    plan.write(b, tmp_path)
    row = run_rows.load(tmp_path)
    model, over = b["total_gb_per_gpu"], cfg.cluster.rank_overhead_gb
    assert row["memory"] == f"{model + over:.3g} GB ? ({model:.3g} model + {over:g} rank overhead)"
    gpu = compose(["recipe=llama3_70b_h100x1024"])
    plan.write(plan.compute(gpu, validate.check(gpu)), tmp_path)
    assert "overhead" not in run_rows.load(tmp_path)["memory"]  # device memory on GPU: no host overhead
