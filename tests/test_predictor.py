"""The step-time predictor (runner/estimate/predict/steptime.py): published GPU runs, the held-out Llama 3 paper
runs, machine profiles (round trip, named constants, what they change) and the labels."""

from __future__ import annotations

import json

import pytest

from runner.calibrate import refs as steptime_refs
from runner.config import validate
from runner.estimate import plan
from runner.estimate.predict import machine_profile as steptime_profile
from runner.estimate.predict import steptime, work
from runner.estimate.predict.machine import DATASHEET
from tests import composing
from tests.machine_profiles import round_profile

CPU = ["model=debug", "parallelism=dp2_tp2"]


@pytest.fixture(scope="module")
def references():
    """Every reference run priced, each composed as runner.calibrate.refs composes it, through tests/composing.py (its
    group selections once per set)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(steptime_refs.compose, "compose", composing.compose)
        return {r.id: r for r in steptime_refs.checked()}


def test_published_runs_within_20_percent(references):
    """TorchTitan's A100 and H100 tables (runner/calibrate/reference_runs.csv, role fit)."""
    fit = {k: r for k, r in references.items() if r.role == "fit"}
    assert len(fit) == 18  # 13 bf16 runs and TorchTitan's 5 Float8 runs on Grand Teton H100s
    off = {k: f"{100 * r.error:+.1f} %" for k, r in fit.items() if abs(r.error) > 0.20}
    assert not off, off
    # the two cases: the 8B FSDP run at 5,762 tokens/s per GPU, the 405B run at 29.0 % MFU
    assert 16 * 8192 / (8 * fit["gt_8b_fsdp8"].predicted.step_s) == pytest.approx(5762, rel=0.2)
    assert fit["h100_405b_fsdp16_tp8"].predicted.binding == "compute"


def test_float8_runs_within_20_percent_and_the_8b_speed_up(references):
    """TorchTitan's Float8 rows (tensorwise, compiled) priced by the FP8 model (runner/estimate/predict/fp8_cost.py): within 20 %,
    each with its cast kernels; the 8B FSDP 8 run's speed-up over its bf16 twin within 0.1 of the published
    8,532 / 6,667 = 1.28; the TP runs pay tensorwise's amax all-reduces."""
    fp8_rows = {k: r for k, r in references.items() if k.endswith("float8")}
    assert len(fp8_rows) == 5 and all(r.role == "fit" for r in fp8_rows.values())
    off = {k: f"{100 * r.error:+.1f} %" for k, r in fp8_rows.items() if abs(r.error) > 0.20}
    assert not off, off
    assert all(r.predicted.terms["fp8_cast"] > 0 for r in fp8_rows.values())
    assert fp8_rows["gt_70b_2d_float8"].predicted.terms["fp8_amax"] > 0 and fp8_rows["gt_8b_fsdp8_float8"].predicted.terms["fp8_amax"] == 0
    speed_up = references["gt_8b_fsdp8_compile"].predicted.step_s / fp8_rows["gt_8b_fsdp8_float8"].predicted.step_s
    assert speed_up == pytest.approx(8532 / 6667, abs=0.1)
    assert all(r.predicted.terms["fp8_cast"] == 0 for k, r in references.items() if k not in fp8_rows)


def test_llama3_paper_held_out_within_15_percent(references):
    """The Llama 3 paper's table 4 (405B on 8,192 and 16,384 H100), never used to choose a constant."""
    held = {k: r for k, r in references.items() if r.role == "heldout"}
    assert set(held) == {"l3_405b_8k_gpus", "l3_405b_16k_gpus", "l3_405b_16k_gpus_cp16"}
    off = {k: f"{100 * r.error:+.1f} %" for k, r in held.items() if abs(r.error) > 0.15}
    assert not off, off
    assert all(r.predicted.terms["bubble"] > 0 and r.predicted.terms["tp"] > 0 for r in held.values())
    assert held["l3_405b_16k_gpus_cp16"].predicted.terms["cp"] > 0


def test_reference_error_band_is_the_rms_error_of_the_reference_runs(references):
    """mode=search's error band on the datasheet model (machine.REFERENCE_ERROR, kept as a figure because pricing the rows
    takes seconds) is the RMS of predicted / measured - 1 over every modelled reference run."""
    import math

    from runner.estimate.predict import machine

    errors = [r.error for r in references.values()]
    assert machine.REFERENCE_ERROR == pytest.approx(math.sqrt(sum(e * e for e in errors) / len(errors)), abs=5e-4)


def test_calibration_residuals_are_its_runs_predicted_by_the_finished_profile(compose):
    """runner.calibrate records each of its runs predicted by the profile it made; their RMS error is the band."""
    from runner.calibrate import runs as calibrate_runs

    prof = round_profile()
    cfgs = [compose(["model=debug", f"parallelism={p}", *calibrate_runs.RUN_AT_SHAPE]) for p in ("single", "tp2")]
    predicted = [steptime.predict(c, validate.check(c), prof).step_s for c in cfgs]
    found = calibrate_runs.residuals(prof, [(cfgs[0], predicted[0] / 1.1), (cfgs[1], predicted[1] / 0.9)])
    assert [(r["run"], r["predicted_s"]) for r in found] == [
        ("single, 6 blocks of dim 256", predicted[0]),
        ("tp2, 6 blocks of dim 256", predicted[1]),
    ]
    assert steptime_profile.error_band({"residuals": found}) == pytest.approx(0.1)
    rows = {name: value for name, value, _ in steptime_profile.describe(prof | {"residuals": found})}
    assert rows["error band"] == "+/-10.0 %" and "error band" not in {name for name, _, _ in steptime_profile.describe(prof)}


def test_reference_file_names_every_source():
    rows = steptime_refs.rows()
    assert {"fit", "heldout"} <= {r["role"] for r in rows} <= {"fit", "heldout", "not_modelled"}  # no row is unmodelled now
    header = steptime_refs.DATA.read_text()
    assert all(f"#  {r['source']}:" in header for r in rows)


def test_datasheet_prediction_is_labelled(compose):
    cfg = compose(["cluster=h100_node", "parallelism=fsdp", "precision=bf16", "model=llama3_8b", "training.global_batch_size=16"])
    pred = steptime.predict(cfg, validate.check(cfg))
    assert (pred.calibrated, pred.source) == (False, DATASHEET)
    assert pred.step_s == pytest.approx(sum(pred.terms.values()))
    assert pred.binding == max(pred.terms, key=pred.terms.get) and set(pred.terms) == set(steptime.TERMS)
    b = plan.compute(cfg, validate.check(cfg))
    assert b["estimated_step_time_s"] == pred.step_s and b["predicted_source"] == DATASHEET
    assert DATASHEET in plan.one_line(b)


def test_each_mtp_depth_adds_a_block_and_a_head_pass(compose):
    """model.num_mtp_layers=D: the last stage runs D more blocks and D more passes through the head, per microbatch
    (DeepSeek-V3 16B on an H100 node, FSDP, datasheet figures)."""
    base = ["cluster=h100_node", "parallelism=fsdp", "precision=bf16", "model=deepseek_v3_16b", "training.global_batch_size=16"]
    cfgs = [compose([*base, f"model.num_mtp_layers={d}"]) for d in (0, 2)]
    lay = validate.check(cfgs[0])
    without, with_mtp = (steptime.predict(c, lay) for c in cfgs)
    mach = steptime.resolve_machine(cfgs[0], lay, peak_tflops=None, link_gbs=None, efficiency=None)
    c, t = cfgs[0], cfgs[0].training
    shares = work.recomputed_share(t.activation_checkpoint.value, steptime._layer_frequency(c))
    blk, head = steptime._block(c, lay, mach, steptime._kinds(c, lay), shares), steptime._head(c, lay, mach)
    micro = t.global_batch_size // (lay.dp * t.microbatch_size)
    assert with_mtp.terms["compute"] - without.terms["compute"] == pytest.approx(2 * micro * (blk.compute + head.compute))


def test_profile_round_trip_and_its_named_constants(compose, tmp_path):
    path = steptime_profile.write(round_profile(), tmp_path / "profile.json")
    saved = json.loads(path.read_text())
    assert saved["kind"] == "runner machine profile" and saved["version"] == 2
    assert {k: v["unit"] for k, v in saved["constants"].items()} == {
        "layer_overhead_s": "s",
        "collective_fixed_s": "s",
        "comm_overlap": "fraction",
    }
    assert all(v["meaning"] for v in saved["constants"].values())
    rows = {name: value for name, value, _ in steptime_profile.describe(saved)}
    assert rows["layer_overhead_s"] == "0.002 s" and rows["all_gather@2 (4 ranks running)"] == "1000 us + bytes / 1.00 GB/s"
    cfg = compose([*CPU, f"cluster.profile={path}"])
    pred = steptime.predict(cfg, validate.check(cfg))
    assert (pred.calibrated, pred.source) == (True, str(path))
    assert plan.compute(cfg, validate.check(cfg))["predicted_source"] == str(path)


def test_profile_constants_move_their_terms(compose):
    """4 ranks on 2 cores share them: compute stretches 2x; the fixed block cost is 2 passes x 6 blocks x m."""
    cfg = compose(CPU)
    lay = validate.check(cfg)
    a, b = steptime.predict(cfg, lay, round_profile(0.0)), steptime.predict(cfg, lay, round_profile(2e-3))
    micro = cfg.training.global_batch_size // (lay.dp * cfg.training.microbatch_size)
    assert b.terms["overhead"] - a.terms["overhead"] == pytest.approx(2 * 2e-3 * 6 * micro * 2)  # x2: 4 ranks on 2 cores
    assert a.terms["tp"] > 0 and a.terms["dp"] > 0 and a.terms["pp"] == 0


def test_fixed_costs_are_what_the_short_runs_take_beyond_the_measured_kernels(compose):
    """runner.calibrate's fit inverts the predictor: short runs timed as a profile with a 1.5 ms block cost and a
    4 ms collective predicts them give back those two constants, whatever the measured kernels are."""
    from runner.calibrate import runs as calibrate_runs

    truth = round_profile(layer_overhead_s=1.5e-3)
    truth["constants"]["collective_fixed_s"] = steptime_profile.constant("collective_fixed_s", 4e-3)
    runs = []
    for layers in calibrate_runs.LAYERS:
        for par in ("single", "tp2"):
            cfg = compose([*calibrate_runs.TINY, *calibrate_runs.RUN, f"model.num_layers={layers}", f"parallelism={par}"])
            runs.append((cfg, steptime.predict(cfg, validate.check(cfg), truth).step_s))
    fit = calibrate_runs.fit_fixed_costs(round_profile(layer_overhead_s=0.0), runs)
    assert fit["layer_overhead_s"]["value"] == pytest.approx(1.5e-3)
    assert fit["collective_fixed_s"]["value"] == pytest.approx(4e-3)
    assert fit["comm_overlap"]["value"] == 0.0  # gloo: its collectives need the cores the compute holds


def test_in_run_share_is_the_kernels_rate_inside_a_step(compose):
    """A run that takes what a profile with in_run_share 0.8 predicts gives back 0.8, and that share slows every
    kernel term by 1 / 0.8 (compute, elementwise, and FSDP's memory-bound copies in dp) and nothing else."""
    from runner.calibrate import runs as calibrate_runs

    slow = round_profile()
    slow["by_ranks"]["2"]["in_run_share"] = 0.8
    cfg = compose(["model=debug", "parallelism=fsdp", "parallelism.dp_shard=2", *calibrate_runs.RUN_AT_SHAPE])
    lay = validate.check(cfg)
    a, b = steptime.predict(cfg, lay, round_profile()), steptime.predict(cfg, lay, slow)
    assert calibrate_runs.fit_in_run_shares(round_profile(), [(cfg, b.step_s)]) == ({2: pytest.approx(0.8)}, {}, {})
    assert b.terms["compute"] == pytest.approx(a.terms["compute"] / 0.8)
    assert b.terms["non_matmul"] == pytest.approx(a.terms["non_matmul"] / 0.8)
    micro = cfg.training.global_batch_size // (lay.dp * cfg.training.microbatch_size)
    copies = cfg.model.num_layers * steptime._fsdp_copies_s(cfg, lay, steptime.resolve_machine(cfg, lay, round_profile()), micro)
    assert copies > 0.05 * a.terms["dp"]  # the debug model's 6 blocks: memory-bound copies of every block, every microbatch
    assert b.terms["dp"] - a.terms["dp"] == pytest.approx(copies * (1 / 0.8 - 1))  # the collectives do not move
    assert b.terms["overhead"] == a.terms["overhead"]
    rows = {name: value for name, value, _ in steptime_profile.describe({**slow, "machine": slow["machine"]})}
    assert rows["in_run_share, 2 rank(s)"] == "0.800"


def test_share_and_collective_cost_come_from_runs_of_the_model(compose):
    """Runs timed as a profile with in-run shares 0.9 (2 ranks) and 0.7 (4 ranks) and a collective of 5 ms with 2
    ranks running and 7 ms with 4 give those back: the 2-rank pipeline and TP runs solved together for the share and
    the collective's cost (the pipeline's sends cost it too), the 4-rank runs (2 stages x FSDP 2, TP 2 x FSDP 2)
    then for the 4-rank share and cost. Without the 4-rank TP run the 4-rank cost is the 2-rank one stretched by the
    cores' sharing (2x). Without the 2-rank pipeline an FSDP run on 2 ranks gives its share, which then takes in
    what its collectives cost beyond the old figure."""
    from runner.calibrate import runs as calibrate_runs

    truth = round_profile()
    truth["by_ranks"]["2"]["in_run_share"], truth["by_ranks"]["4"]["in_run_share"] = 0.9, 0.7
    truth["by_ranks"]["4"]["collective_fixed_s"] = 7e-3
    truth["constants"]["collective_fixed_s"] = steptime_profile.constant("collective_fixed_s", 5e-3)

    def timed(overrides):
        cfg = compose(["model=debug", *calibrate_runs.RUN_AT_SHAPE, *overrides])
        return cfg, steptime.predict(cfg, validate.check(cfg), truth).step_s

    runs = [timed(["parallelism=fsdp", "parallelism.dp_shard=1"]), timed(["parallelism=dp2_pp2"])]
    pipeline = [timed(["parallelism=single", "parallelism.pp=2", "parallelism.pp_schedule=1F1B"])]
    tp = [timed(["parallelism=tp2"]), timed(["parallelism=dp2_tp2"])]
    shares, fixed, per_ranks = calibrate_runs.fit_in_run_shares(round_profile(), runs, pipeline, tp)
    assert shares == {1: pytest.approx(1.0), 2: pytest.approx(0.9), 4: pytest.approx(0.7)}
    assert fixed == {"collective_fixed_s": pytest.approx(5e-3)} and per_ranks == {4: pytest.approx(7e-3)}
    fitted = calibrate_runs.with_fit(round_profile(), shares, fixed, per_ranks)
    assert steptime_profile.machine_of(fitted, 4, "p").collective_fixed_s == pytest.approx(7e-3)  # measured: not stretched
    assert steptime_profile.machine_of(fitted, 8, "p").collective_fixed_s == pytest.approx(14e-3)  # 8 ranks share 2 cores 2x more
    assert steptime_profile.machine_of(fitted, 2, "p").collective_fixed_s == pytest.approx(5e-3)
    rows = {name: value for name, value, _ in steptime_profile.describe(fitted)}
    assert rows["collective_fixed_s, 4 rank(s)"] == "0.007 s"
    _, _, none = calibrate_runs.fit_in_run_shares(round_profile(), runs, pipeline, tp[:1])
    without = calibrate_runs.with_fit(round_profile(), {}, fixed, none)
    assert none == {} and steptime_profile.machine_of(without, 4, "p").collective_fixed_s == pytest.approx(10e-3)
    alone, none, _ = calibrate_runs.fit_in_run_shares(round_profile(), [timed(["parallelism=fsdp", "parallelism.dp_shard=2"])])
    assert none == {} and alone[2] < 0.9  # the profile's 1 ms per collective stays; the share takes the other 4 ms in
    cfg = pipeline[0][0]
    assert calibrate_runs._median_points([[(cfg, 1.0)], [(cfg, 3.0)], [(cfg, 1.5)]]) == [(cfg, 1.5)]  # over repetitions


def test_shape_factors_are_the_shares_fitted_at_each_calibrated_shape(compose):
    """Runs at a wider, longer shape timed as a profile whose shares there are 0.8x (1 rank) and 1.25x (2 ranks) the
    first shape's give those factors back; a shape is predicted with the nearest calibrated one's factor (4 ranks
    with the 2-rank one), and a profile without shapes predicts as before."""
    from runner.calibrate import runs as calibrate_runs

    truth = round_profile()
    truth["by_ranks"]["1"]["in_run_share"], truth["by_ranks"]["2"]["in_run_share"] = 0.9, 0.8
    wide = ["model.dim=512", "model.ffn_hidden_dim=1536", "training.seq_len=512"]
    truth["by_shape"] = [
        {"dim": 256, "seq_len": 256, "factors": {"1": 1.0, "2": 1.0}},
        {"dim": 512, "seq_len": 512, "factors": {"1": 0.8, "2": 1.25}},
    ]
    fitted = {**truth, "by_shape": []}

    def timed(overrides):
        cfg = compose(["model=debug", *calibrate_runs.RUN_AT_SHAPE, *overrides])
        return cfg, steptime.predict(cfg, validate.check(cfg), truth).step_s

    layouts = (["parallelism=single"], ["parallelism=single", "parallelism.pp=2", "parallelism.pp_schedule=1F1B"])
    first, at_wide = [timed(o) for o in layouts], [timed([*o, *wide]) for o in layouts]
    assert calibrate_runs.fit_shape_factors(fitted, first, at_wide) == [
        {"dim": 256, "seq_len": 256, "factors": {"1": pytest.approx(1.0), "2": pytest.approx(1.0)}},
        {"dim": 512, "seq_len": 512, "factors": {"1": pytest.approx(0.8), "2": pytest.approx(1.25)}},
    ]
    cfg = compose(["model=debug", *calibrate_runs.RUN_AT_SHAPE, "parallelism=dp2_pp2", "model.dim=512", "training.seq_len=1024"])
    lay = validate.check(cfg)
    assert steptime_profile.shape_factor(truth, lay.world_size, cfg.model.dim, cfg.training.seq_len) == 1.25
    slow, plain = steptime.predict(cfg, lay, truth), steptime.predict(cfg, lay, fitted)
    assert slow.terms["compute"] == pytest.approx(plain.terms["compute"] / 1.25, rel=1e-3)
    assert steptime_profile.shape_factor(truth, 1, 300, 200) == 1.0  # nearest: the first shape
    rows = {name: value for name, value, _ in steptime_profile.describe({**truth, "residuals": []})}
    assert rows["in-run share at dim 512, seq 512"] == "x0.800 (1 rank(s)), x1.250 (2 rank(s))"


def test_refit_recovers_a_drifted_machine_from_the_share_runs_alone(compose):
    """share_points' runs (1, 2, 4 ranks and a wider shape), timed as a machine with other shares, collective costs and
    shape factors than a stale profile's, give that machine's figures back through refit: what the grid bench fits
    from the share runs it trains between its points. The stale profile's timed kernels stay."""
    from runner.calibrate import runs as calibrate_runs

    wide = ["model.dim=512", "model.ffn_hidden_dim=1536"]
    truth = round_profile()
    for n, share in (("1", 0.95), ("2", 0.9), ("4", 0.7)):
        truth["by_ranks"][n]["in_run_share"] = share
    truth["by_ranks"]["4"]["collective_fixed_s"] = 7e-3
    truth["constants"]["collective_fixed_s"] = steptime_profile.constant("collective_fixed_s", 5e-3)
    truth["by_shape"] = [
        {"dim": 256, "seq_len": 256, "factors": {"1": 1.0, "2": 1.0, "4": 1.0}},
        {"dim": 512, "seq_len": 256, "factors": {"1": 0.8, "2": 1.25}},
    ]
    stale = round_profile()
    for n in ("1", "2", "4"):
        stale["by_ranks"][n]["in_run_share"] = 0.5
    stale["by_ranks"]["4"]["collective_fixed_s"] = 20e-3
    stale["by_shape"] = [{"dim": 512, "seq_len": 256, "factors": {"1": 2.0, "2": 2.0}}]
    pts, common = calibrate_runs.share_points(["model=debug"], [1, 2, 4], False, {(512, 256): wide})
    assert list(pts) == ["single", "pp2", "tp2", "pp2_fsdp2", "tp2_fsdp2", "single_shape1", "pp2_shape1"]

    def timed(overrides):
        cfg = compose([*common, *overrides])
        return cfg, steptime.predict(cfg, validate.check(cfg), truth).step_s

    runs = [timed(o) for o in pts.values()]
    fitted = calibrate_runs.refit(stale, [runs, runs[::-1]], {(512, 256): wide})
    assert {n: e["in_run_share"] for n, e in fitted["by_ranks"].items()} == {
        "1": pytest.approx(0.95),
        "2": pytest.approx(0.9),
        "4": pytest.approx(0.7),
    }
    assert fitted["constants"]["collective_fixed_s"]["value"] == pytest.approx(5e-3)
    assert fitted["by_ranks"]["4"]["collective_fixed_s"] == pytest.approx(7e-3)
    assert fitted["by_shape"][1] == {"dim": 512, "seq_len": 256, "factors": {"1": pytest.approx(0.8), "2": pytest.approx(1.25)}}
    assert fitted["by_ranks"]["2"]["matmul_tflops"] == stale["by_ranks"]["2"]["matmul_tflops"]
    assert "residuals" not in fitted
    for cfg, t in runs:
        assert steptime.predict(cfg, validate.check(cfg), fitted).step_s == pytest.approx(t, rel=1e-3)


def test_pipeline_bubble_is_the_fill_and_drain_through_the_other_ranks_first_stages(compose):
    """pp 2 x 2 virtual stages on the 6-block debug model: TorchTitan's split is 1, 2, 2, 1 blocks (embedding and head
    count as a layer each); rank 0 holds stages 0 and 2, rank 1 stages 1 and 3 and the head. Rank 1 is the busiest
    and waits for one microbatch through stage 0 (1 block) at the start and the end: one block's chunk, not (p - 1)
    x the largest stage (2 blocks). Split 3, 3 without interleaving, rank 1 holds the same work and waits for stage
    0's 3 blocks: the classical sum of the stages + (m - 1) x the slowest."""
    plain = round_profile(layer_overhead_s=0.0)

    def pred(overrides):
        cfg = compose(["model=debug", "training.global_batch_size=8", "training.microbatch_size=2", *overrides])
        return steptime.predict(cfg, validate.check(cfg), plain)

    interleaved = pred(["parallelism=pp2_interleaved"])
    even = pred(["parallelism=single", "parallelism.pp=2", "parallelism.pp_schedule=1F1B"])
    assert even.terms["compute"] == pytest.approx(interleaved.terms["compute"])  # rank 1: 3 blocks and the head
    assert even.terms["bubble"] == pytest.approx(3 * interleaved.terms["bubble"])
    assert 12 * interleaved.terms["bubble"] < even.terms["compute"] + even.terms["non_matmul"]  # 4 microbatches x 3 blocks + head


def test_in_run_collective_cost_replaces_the_microbenchmark_latency(compose):
    """A profile's collective costs its in-run fixed cost plus bytes / bandwidth: the fitted link latency
    (1 ms here) does not count, so raising the fixed cost by 1 ms adds exactly 1 ms per TP collective."""
    cfg = compose(["model=debug", "parallelism=tp2", "training.global_batch_size=4", "training.microbatch_size=2"])
    lay = validate.check(cfg)
    lo, hi = round_profile(), round_profile()
    hi["constants"]["collective_fixed_s"] = steptime_profile.constant("collective_fixed_s", 2e-3)
    a, b = steptime.predict(cfg, lay, lo).terms["tp"], steptime.predict(cfg, lay, hi).terms["tp"]
    collectives = 2 * 2 * 2 * cfg.model.num_layers * 2  # (gather + scatter) x 2 sites x 2 passes x blocks x microbatches
    assert b - a == pytest.approx(1e-3 * collectives)
    n_bytes = 2 * cfg.training.seq_len * cfg.model.dim * 4  # one microbatch's hidden state, fp32
    bandwidth_only = collectives / 2 * 2 * (n_bytes / 2) / 1e9  # gather and scatter each send half of it at 1 GB/s
    assert a == pytest.approx(bandwidth_only + 1e-3 * collectives)


def test_fit_link_recovers_latency_and_bandwidth():
    pts = [(n, 2e-4 + n / 0.5e9) for n in (1e4, 1e5, 1e6, 1e7)]
    fit = steptime_profile.fit_link(pts)
    assert fit["latency_s"] == pytest.approx(2e-4) and fit["gbs"] == pytest.approx(0.5)
    rate = steptime_profile.fit_gemm_rate([[d, 4 * d, 4 * d, 0.3 * d / (d + 40)] for d in (16, 64, 256, 1024)])
    assert rate["matmul_tflops"] == pytest.approx(0.3) and rate["gemm_half_dim"] == pytest.approx(40)


def test_bad_profile_is_a_config_error(compose, tmp_path):
    bad = tmp_path / "notes.json"
    bad.write_text('{"kind": "something else"}')
    with pytest.raises(validate.ConfigError) as e:
        validate.check(compose([*CPU, f"cluster.profile={bad}"]))
    assert "cluster.profile" in str(e.value) and "python -m runner.calibrate" in str(e.value)


def test_calibrate_measures_the_per_rank_shapes(compose):
    """python -m runner.calibrate times the GEMMs each rank runs: TP shards the projections, CP the tokens."""
    from runner.calibrate import measure as calibrate

    gemms, attention = calibrate.shapes([compose(["model=debug", "training.seq_len=256", "training.microbatch_size=2"])], 4)
    assert {(512, 256, 256), (512, 256, 128), (512, 128, 256), (512, 256, 384), (256, 256, 768), (512, 256, 1024)} <= gemms
    assert (512, 768, 256) in gemms and (512, 384, 256) in gemms  # w2 whole and row-parallel under TP 2
    assert attention == {(2, 16, 256, 16), (2, 8, 256, 16), (2, 4, 256, 16)}  # heads over TP 1, 2, 4


def test_calibrate_times_kernels_once_per_thread_count_and_neighbours(monkeypatch):
    """2 and 4 ranks on 2 cores both run 1 thread next to 1 busy neighbour: one measurement serves both."""
    from runner.calibrate import measure as calibrate

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert calibrate.conditions([1, 2, 4]) == {(2, 1): [1], (1, 2): [2, 4]}
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert calibrate.conditions([1, 2, 4, 8]) == {(8, 1): [1], (4, 2): [2], (2, 4): [4], (1, 8): [8]}


def test_calibrate_refuses_bad_input_before_measuring(capsys):
    from runner.calibrate import measure as calibrate

    assert calibrate.main(["--ranks", "3"]) == 2
    assert "--ranks '3': give rank counts that are 1 or powers of two, e.g. --ranks 1,2,4" in capsys.readouterr().err
    assert calibrate.main(["model.dim=0"]) == 2
    assert "model.dim = 0: must be >= 1" in capsys.readouterr().err


MOE_PLAN = ["mode=plan", "parallelism=fsdp", "cluster=h100x64", "precision=bf16", "training.seq_len=4096", "training.global_batch_size=512"]


@pytest.mark.parametrize("model", ["deepseek_v3_16b", "qwen3_30b_a3b"])
def test_moe_expert_flops_per_gpu_do_not_change_with_ep(compose, model):
    """EP changes the routed experts' GEMM shapes (more tokens per local expert), not the FLOPs a GPU does: under
    ep a rank's num_experts / ep local experts receive the tokens of all ep ranks of its group. So a block's GEMM
    FLOPs are equal for ep 1, 2, 4 and 8, the routed ones n x top-k x 3 GEMMs of dim x moe_hidden_dim, and the
    compute term never falls below the plan's ideal (all model FLOPs at 100 % of the peak)."""
    import dataclasses

    from runner.estimate.predict import work

    base = compose([f"model={model}", *MOE_PLAN, "training.microbatch_size=4"])

    def at(tp: int, ep: int):
        cfg = dataclasses.replace(base, parallelism=dataclasses.replace(base.parallelism, tp=tp, ep=ep))
        return cfg, validate.check(cfg)

    runs = {ep: at(1, ep) for ep in (1, 2, 4, 8)}
    totals = {ep: sum(work.gemm_flops(g) for g in work.block(cfg, lay).gemms) for ep, (cfg, lay) in runs.items()}
    assert len(set(totals.values())) == 1, totals
    for ep, (cfg, lay) in runs.items():
        b = plan.compute(cfg, lay)
        assert b["predicted_terms_s"]["compute"] >= b["ideal_compute_s"], ep
    m, n = base.model, work.tokens(*runs[1])

    def routed(cfg, lay) -> float:
        return sum(work.gemm_flops(g) for g in work.routed_gemms(cfg, lay, work.tokens(cfg, lay)))

    assert {routed(*r) for r in runs.values()} == {2.0 * n * m.num_experts_per_token * 3 * m.dim * m.moe_hidden_dim}
    # TP 2: the experts' hidden dim is split without EP, the tokens with it; half the FLOPs either way
    assert routed(*at(2, 1)) == routed(*at(2, 4)) == routed(*runs[1]) / 2
