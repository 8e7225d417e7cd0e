"""Every layout that fits on this machine trains the same model as one rank (real gloo ranks).

Three launches (1, 2 and 4 ranks) of runner.run.layout_parity, shared with tests/test_family_train.py (conftest's
parity_runs), run every preset and pipeline schedule one after another inside one process group each, with
clipping active (max_norm 0.01, far below the ~0.74 pre-clip norm), and the tests read their parity.json files.

cp2 (ring attention through TorchTitan's CP) and ep2 (deepseek_v3 debugmodel experts over 2 ranks, compared
with the same MoE model on one rank) ride in the 2-rank launch, cp2 x tp2 and cp2 x pp2 in the 4-rank one.

Tolerances (fp32 training): the step-1 global gradient norm from the full gradients in float64
within 1e-8 relative of one rank (measured: <= 1e-9); the logged pre-clip norm (TorchTitan's clip in
float32) within 1e-5 relative where the norm is taken over whole tensors (DP replicas, pipeline stages)
and 1e-4 where it is taken over shards (FSDP, TP: measured 1.4e-5 to 5.2e-5, because torch's CPU float32
vector norm rounds at ~4e-5 relative on the 0.5M-element output head -- one rank's own logged norm is
4.2e-5 below the float64 norm of the same gradients); per-step losses within 1e-5 absolute (measured:
<= 1e-6; pipeline schedules agree with each other to 1e-6); the global sums of the trained weights
within 1e-9 relative and of the clipped update within 1e-5 (measured: <= 1.3e-6).
"""

from __future__ import annotations

import pytest

from runner.estimate import pipeline
from tests.points import PARALLEL_COMMON, SCHEDULES, SPLIT_BACKWARD
from tests.points import PARALLEL_LAUNCHES as LAUNCHES

pytestmark = pytest.mark.e2e  # every test here starts processes

REFERENCE = {"ep2": "moe_single"}  # the one-rank run of the same model; the rest compare with the dense "single"
MULTI = [name for n, presets in LAUNCHES.items() if n > 1 for name in presets if not name.startswith("flex_")]  # flex_: eval only
EXACT_NORM_RTOL = 1e-8
GRAD_NORM_RTOL = 1e-5
SHARDED_GRAD_NORM_RTOL = 1e-4
LOSS_ATOL = 1e-5
SCHEDULE_LOSS_ATOL = 1e-6


@pytest.fixture(scope="session")
def trained(parity_runs):
    return parity_runs  # trained with the other module's points, one launch per rank count (conftest)


@pytest.mark.parametrize("name", MULTI)
def test_global_grad_norm_loss_and_clipped_update_match_one_rank(trained, name):
    ref, got = trained[REFERENCE.get(name, "single")], trained[name]
    assert [r["step"] for r in got["rows"]] == [1, 2]
    assert got["grad_norm_fp64"] == pytest.approx(ref["grad_norm_fp64"], rel=EXACT_NORM_RTOL)
    sharded = any(f"{a}=" in got["degrees"] for a in ("tp", "dp_shard", "cp", "ep"))  # FSDP also shards over cp
    rtol = SHARDED_GRAD_NORM_RTOL if sharded else GRAD_NORM_RTOL
    for a, b in zip(ref["rows"], got["rows"], strict=True):
        assert a["grad_norm"] > 50 * 0.01  # the clip is active at every step
        assert b["loss"] == pytest.approx(a["loss"], abs=LOSS_ATOL), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=rtol), a["step"]
    assert got["weights"]["weights_sq"] == pytest.approx(ref["weights"]["weights_sq"], rel=1e-9)
    assert got["weights"]["update_sq"] == pytest.approx(ref["weights"]["update_sq"], rel=1e-5)
    assert got["weights"]["update_sq"] > 0


@pytest.mark.parametrize("name", MULTI)
def test_held_out_loss_matches_one_rank(trained, name):
    """The eval loss of the trained weights on the held-out batch is one rank's in every layout and pipeline schedule
    (the forward-only schedule step, the DP slices of the eval batch and the loss reduction agree), and is what
    summary.json reports as the final eval loss."""
    ref, got = trained[REFERENCE.get(name, "single")], trained[name]
    assert ["eval_loss" in r for r in got["rows"]] == [False, True]
    assert got["rows"][1]["eval_loss"] == pytest.approx(ref["rows"][1]["eval_loss"], abs=LOSS_ATOL)
    assert got["summary"]["eval_loss_final"] == got["rows"][1]["eval_loss"]
    assert got["summary"]["eval_step_final"] == 2


def test_cp_and_ep_parallelize_through_torchtitan(trained):
    """cp2 ran ring attention on half-sequences (head-tail chunks); ep2 kept 4 of the 8 experts of each MoE block per rank."""
    assert trained["cp2"]["degrees"] == "cp=2" and trained["ep2"]["degrees"] == "dp_shard=2 x ep=2"
    assert trained["cp2_tp2"]["degrees"] == "cp=2 x tp=2"
    assert trained["cp2_pp2"]["degrees"] == "pp=2 x cp=2"
    # each CP rank's first block sees its half of the 64-token sequences, under the pipeline schedule too
    assert trained["cp2"]["norm_output_shape"][1] == trained["cp2_pp2"]["norm_output_shape"][1] == 32
    moe = trained["moe_single"]["rows"][0]
    assert 7.0 < moe["loss"] < 9.0 and moe["grad_norm"] > 1.0  # ln(2048) = 7.62 at init


def test_expert_load_is_measured_at_each_logged_step(trained):
    """debug_moe's MoE blocks 1-5 route each of a step's 128 tokens to 3 of 8 experts. Each logged row carries every
    layer's tokens per expert summed over the ranks, read with the step's one host read (host_syncs as a dense step's)
    and summed in its one host collective: ep2's counts are the one-rank run's at step 1 (same weights, same batch), and
    its busiest EP rank's share is reported (a half at best). A balanced run names no hot or dead expert."""
    ref, got = trained["moe_single"], trained["ep2"]
    for run in (ref, got):
        for r in run["rows"]:
            moe = r["moe"]
            assert (moe["layers"], moe["steps"], moe["dead"]) == ([1, 2, 3, 4, 5], 1, [])
            assert [sum(t) for t in moe["tokens"]] == [128 * 3] * 5
            assert all(1.0 < m < 2.0 for m in moe["max_mean"])  # under monitor.moe_load.hot_factor
            assert "moe_flags" not in r
        assert not (run["run_dir"] / "moe_load.jsonl").exists()
    assert [r["host_syncs"] for r in got["rows"]] == [r["host_syncs"] for r in trained["single"]["rows"]]
    assert got["rows"][0]["moe"]["tokens"] == ref["rows"][0]["moe"]["tokens"]
    assert "ep_share" not in ref["rows"][0]["moe"]
    assert all(0.5 <= s < 1.25 / 2 for r in got["rows"] for s in r["moe"]["ep_share"])


def test_single_rank_reference_is_sane(trained):
    rows = trained["single"]["rows"]
    assert 7.0 < rows[0]["loss"] < 9.0 and 0.5 < rows[0]["grad_norm"] < 1.0  # ln(2048) = 7.62 at init
    assert rows[0]["grad_norm"] == pytest.approx(trained["single"]["grad_norm_fp64"], rel=1e-4)  # float32 vs float64 norm
    assert trained["single"]["weights"]["update_sq"] > 0
    held_out = rows[1]["eval_loss"]  # other samples than training's, so not its loss
    assert 7.0 < held_out < 9.0 and abs(held_out - rows[1]["loss"]) > 1e-3


def test_pipeline_schedules_give_the_same_loss(trained):
    base = [r["loss"] for r in trained["pp2_1F1B"]["rows"]]
    for s in SCHEDULES:
        got = trained[f"pp2_{s}"]
        assert got["schedule"] == f"Schedule{s}"
        assert [r["loss"] for r in got["rows"]] == [pytest.approx(x, abs=SCHEDULE_LOSS_ATOL) for x in base], s


def test_a_split_backward_recomputes_a_checkpointed_block_once_per_weight_pass(trained):
    """Under full AC, the schedules that split a stage's backward run its weight pass with one forward of each
    checkpointed block (runner.run.titan.weight_pass): torch calls autograd once per parameter group there, and without
    the runner's GraphExecGroup each call recomputed the block (7 forwards of a debug-model block in one weight pass,
    measured 2026-12-05; the model's first stage, whose weight pass is a full backward, 1). The same losses and update
    as the schedule without AC; without AC a weight pass runs no forward."""
    for s in SPLIT_BACKWARD:
        got, plain = trained[f"pp2_{s}_ac"], trained[f"pp2_{s}"]
        assert got["block_forwards_per_weight_pass"] == [1] and plain["block_forwards_per_weight_pass"] == [], s
        assert [r["loss"] for r in got["rows"]] == [pytest.approx(r["loss"], abs=SCHEDULE_LOSS_ATOL) for r in plain["rows"]], s
        assert got["weights"]["update_sq"] == pytest.approx(plain["weights"]["update_sq"], rel=1e-9), s


def test_hfu_counts_the_recomputes_a_split_backward_runs(trained, compose):
    """A split backward reruns a checkpointed block in its input pass and again in its weight pass, but on the model's
    first stage (no input gradient: its weight pass is its only backward). The forwards each stage's block ran over
    the run, less those of the same run without AC, are the recomputes; their mean over the blocks is what HFU counts
    (runner.estimate.split_backward.recomputes_per_backward): every backward splits under the zero-bubble schedules,
    a quarter of them under DualPipeV with 4 microbatches on pp2. Within one forward per stage: torch's first step
    infers each stage's shapes with a forward of its own (PipelineStage._forward_metadata_inference) and, on the stages
    after the first, an input-gradient backward that recomputes under AC (_backward_metadata_inference)."""
    from runner.estimate import split_backward
    from runner.run import accounting
    from runner.schema.layout import resolve

    expected = {"InterleavedZeroBubble": 11 / 6, "ZBVZeroBubble": 11 / 6, "DualPipeV": 1 + 5 / 6 / 4}
    for s in SPLIT_BACKWARD:
        got, plain = trained[f"pp2_{s}_ac"], trained[f"pp2_{s}"]
        cfg = compose([*PARALLEL_COMMON, *LAUNCHES[2][f"pp2_{s}_ac"]])
        runs = len(got["rows"]) * cfg.training.global_batch_size // cfg.training.microbatch_size
        layers = {str(stage["index"]): stage["layers"] for rank in got["stages"] for stage in rank}
        again = {k: (got["block_forwards_per_stage"][k] - plain["block_forwards_per_stage"][k]) / runs for k in layers}
        assert again["0"] == pytest.approx(1.0, abs=1 / runs), s
        measured = sum(layers[k] * again[k] for k in layers) / sum(layers.values())
        planned = split_backward.recomputes_per_backward(cfg, resolve(cfg.parallelism, cfg.cluster))
        assert (planned, measured) == (pytest.approx(expected[s]), pytest.approx(expected[s], abs=1 / runs)), s
        assert [r["hfu"] / r["mfu"] for r in got["rows"]] == [pytest.approx(1 + planned / 3)] * len(got["rows"]), s
        assert accounting.hfu_factor(cfg) == pytest.approx(1 + planned / 3), s


def test_flex_attention_masks_pass_through_the_pipeline_schedule(trained):
    """FlexAttention (the GPU attention; kept on CPU by the test-only eval.cpu_flex_attention for one forward-only
    pass, as its CPU backward does not exist): the pipeline's eval step under 1F1B and interleaved 1F1B (v=2) gives
    one rank's eval loss. The batch's block mask is split by the schedule: every attention call of rank 0's stages
    sees a mask of one microbatch (2 samples), not of the whole local batch (4)."""
    ref = trained["flex_single"]
    assert ref["attention"] == ["FlexAttention"] and ref["schedule"] is None
    assert 7.0 < ref["rows"][0]["eval_loss"] < 9.0  # ln(2048) = 7.62 at init
    for name, schedule in (("flex_pp2", "Schedule1F1B"), ("flex_pp2_interleaved", "ScheduleInterleaved1F1B")):
        got = trained[name]
        assert (got["schedule"], got["attention"]) == (schedule, ["FlexAttention"])
        assert got["rows"][0]["eval_loss"] == pytest.approx(ref["rows"][0]["eval_loss"], abs=LOSS_ATOL), name
    # rank 0's blocks x 2 microbatches; a pipeline stage also runs its first microbatch once for shape inference
    calls = {"flex_single": 6 * 2, "flex_pp2": 3 * (2 + 1), "flex_pp2_interleaved": (1 + 2) * (2 + 1)}
    for name, n in calls.items():
        assert trained[name]["mask_batches"] == [2] * n, name


def test_stage_split_follows_torchtitan(trained):
    """6 layers; embedding and head count one layer each: 3 | 3 for pp=2, 1 | 2 | 2 | 1 for 2 x 2 virtual stages,
    looped (rank 0 holds stages 0 and 2) or V-shaped (rank 0 holds 0 and 3)."""
    assert trained["pp2_1F1B"]["stages"] == [[{"index": 0, "layers": 3}], [{"index": 1, "layers": 3}]]
    assert trained["pp2_Interleaved1F1B"]["stages"] == [
        [{"index": 0, "layers": 1}, {"index": 2, "layers": 2}],
        [{"index": 1, "layers": 2}, {"index": 3, "layers": 1}],
    ]
    assert trained["pp2_DualPipeV"]["stages"] == [
        [{"index": 0, "layers": 1}, {"index": 3, "layers": 1}],
        [{"index": 1, "layers": 2}, {"index": 2, "layers": 2}],
    ]
    assert pipeline.stage_layers(6, 4, 1, 1) == [1, 2, 2, 1]


def test_sequence_parallel_switch_is_honoured(trained):
    """Batch 2 x seq 64 x dim 256 at the first norm: TP ranks hold half the sequence with SP, all of it without."""
    assert trained["tp2"]["norm_output_shape"] == [2, 32, 256]
    assert trained["tp2_no_sp"]["norm_output_shape"] == [2, 64, 256]
    assert trained["dp2_tp2"]["norm_output_shape"] == [2, 32, 256]


def test_measured_pipeline_idle_beside_the_formula(trained):
    for name, m, v in (("pp2_1F1B", 4, 1), ("pp2_Interleaved1F1B", 4, 2), ("dp2_pp2", 2, 1)):
        cal = trained[name]["summary"]["plan_check"]
        assert cal["bubble_predicted"] == pytest.approx(1 / (v * m + 1)), name  # (p-1)/(v*m+p-1), p = 2
        assert 0 < cal["bubble_measured"] < 1, name
