"""Pipeline rules without ranks: TorchTitan's layer split, torch's schedule constraints, bubble formulas,
the large TP x PP presets and the async TP switch (the multi-rank runs are in test_parallel.py)."""

from __future__ import annotations

import pytest

from runner.config import validate
from runner.estimate import pipeline, plan

SEED = ["recipe=llama3_70b_h100x1024"]
L405 = [*SEED, "model=llama3_405b", "mode=plan"]  # planned, not started: validation leaves the memory verdict to the plan


@pytest.mark.parametrize(
    "layers,stages,split",
    [
        (126, 16, [7] + [8] * 14 + [7]),  # Llama 3 405B at pp=16: first and last stage one layer lighter
        (126, 8, [15] + [16] * 6 + [15]),
        (80, 4, [20, 21, 20, 19]),  # 82 effective layers: the first stages take the remainder
        (6, 2, [3, 3]),
        (6, 4, [1, 2, 2, 1]),  # debug model, 2 ranks x 2 virtual stages (not 6 % 4 == 0, yet TorchTitan runs it)
        (6, 8, [0, 1, 1, 1, 1, 1, 1, 0]),  # embedding-only and head-only stages
        (6, 1, [6]),
    ],
)
def test_stage_split_is_torchtitans(layers, stages, split):
    assert pipeline.stage_layers(layers, stages, 1, 1) == split
    assert sum(split) == layers


def test_stage_split_rejects_what_torchtitan_rejects():
    with pytest.raises(ValueError, match="12 stages for 8 effective layers would leave stages empty"):
        pipeline.stage_layers(6, 12, 1, 1)
    with pytest.raises(ValueError, match="fewer than 0 layers"):
        pipeline.stage_layers(6, 4, 3, 1)
    assert pipeline.stage_layers(8, 4, 0, 0) == [2, 2, 2, 2]  # no weighting: an even split


@pytest.mark.parametrize(
    "schedule,v,ok",
    [
        ("1F1B", 1, True),
        ("GPipe", 2, False),
        ("Interleaved1F1B", 1, False),
        ("Interleaved1F1B", 3, True),
        ("LoopedBFS", 2, True),
        ("InterleavedZeroBubble", 4, True),
        ("ZBVZeroBubble", 2, True),
        ("ZBVZeroBubble", 3, False),
        ("DualPipeV", 1, False),
    ],
)
def test_virtual_stage_rules(schedule, v, ok):
    assert (pipeline.virtual_stages_rule(schedule, v) is None) == ok


def test_microbatch_rules_are_torchs():
    assert pipeline.microbatch_rule("1F1B", 4, 1, 3) == ("1F1B needs at least as many microbatches as stages (4)", 4)
    assert pipeline.microbatch_rule("GPipe", 4, 1, 1) is None
    assert pipeline.microbatch_rule("DualPipeV", 2, 2, 3)[1] == 4
    assert pipeline.microbatch_rule("Interleaved1F1B", 4, 2, 10) is None  # torch's example: 10 // 4 = 2 rounds of 5
    assert pipeline.microbatch_rule("Interleaved1F1B", 4, 2, 3) is None  # one round
    assert pipeline.microbatch_rule("Interleaved1F1B", 4, 2, 9)[0].endswith("needs m to be a multiple of them")
    assert pipeline.microbatch_rule("InterleavedZeroBubble", 4, 2, 9) is not None  # 2 rounds, 9 % 2


def test_bubble_formula_per_schedule():
    assert pipeline.bubble(4, 32, "1F1B", 1) == (3 / 35, "(p-1)/(m+p-1) = 3/35")
    assert pipeline.bubble(4, 32, "GPipe", 1)[0] == 3 / 35
    assert pipeline.bubble(4, 32, "Interleaved1F1B", 2) == (3 / 67, "(p-1)/(v*m+p-1) = 3/67, v=2")
    assert pipeline.bubble(4, 32, "Interleaved1F1B", 4)[0] == 3 / 131
    zbv = pipeline.bubble(2, 4, "ZBVZeroBubble", 2)
    assert zbv[0] == 1 / 9 and "upper bound" in zbv[1]
    assert pipeline.bubble(1, 8, "1F1B", 1) == (0.0, "no pipeline")


def test_405b_layouts_plan_with_the_uneven_split(budget):
    b16 = budget([*L405, "parallelism=tp8_pp16"])
    assert (b16["degrees"], b16["microbatches"]) == ("pp=16 x dp_shard=8 x tp=8", 128)
    assert b16["layers_per_stage"] == [7] + [8] * 14 + [7]
    assert b16["bubble_fraction"] == pytest.approx(15 / 143)
    assert ("layers per stage", "7 | 8 x 14 | 7", "1 stage per pipeline rank") in plan.rows(b16)
    b8 = budget([*L405, "parallelism=tp8_pp8"])
    assert (b8["microbatches"], b8["layers_per_stage"]) == (64, [15] + [16] * 6 + [15])
    vi = budget([*L405, "parallelism=tp8_pp16", "parallelism.pp_schedule=Interleaved1F1B", "parallelism.pp_virtual_stages=2"])
    assert vi["bubble_fraction"] == pytest.approx(15 / (2 * 128 + 15))
    assert vi["layers_per_stage"] == [3] + [4] * 30 + [3]
    tp4 = budget([*SEED, "parallelism=tp4_pp4"])
    assert (tp4["degrees"], tp4["bubble_fraction"]) == ("pp=4 x dp_shard=64 x tp=4", pytest.approx(3 / 19))


def test_async_tp_validates_on_cuda_with_compile(compose):
    lay = validate.check(compose([*SEED, "parallelism.async_tp=true", "training.compile=true"]))
    assert lay.tp == 8
    with pytest.raises(validate.ConfigError) as e:
        validate.check(compose(["parallelism=tp2", "parallelism.async_tp=true"]))  # CPU and no compile: both reasons
    assert [p.field for p in e.value.problems] == ["parallelism.async_tp", "parallelism.async_tp"]
    assert "set parallelism.async_tp=false here (mode=validate checks it for a CUDA cluster)" in str(e.value)


def test_hsdp_layout(compose):
    lay = validate.check(compose(["parallelism=hsdp2x2"]))
    assert (lay.dp_replicate, lay.dp_shard, lay.dp, lay.world_size) == (2, 2, 4, 4)
    assert lay.describe() == "dp_replicate=2 x dp_shard=2"
