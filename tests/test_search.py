"""mode=search: the space it states, the rules and memory model it rejects with (validation's own), pruning that
never loses the best candidate (checked against brute force over a small space), and the sweep it writes, run as it
is with mode=plan."""

from __future__ import annotations

import dataclasses
import json

import pytest

from runner.config import search, validate
from runner.config.search import render as search_render
from runner.config.search import verify as search_verify
from runner.config.validate import model_rules
from runner.estimate import flops, memory, plan, precision
from runner.estimate.predict import accuracy, steptime
from runner.estimate.predict import fp8_cost as fp8_model
from runner.schema import Mode
from runner.schema.problems import ConfigError
from tests.conftest import run_cli

# Llama 3 8B on one 8-GPU node at seq 8,192: small enough to brute-force, large enough that memory rejects layouts
SMALL = [
    "model=llama3_8b",
    "cluster=h100_node",
    "precision=bf16",
    "training.seq_len=8192",
    "training.global_batch_size=16",
    "search.max_microbatch_size=2",
    "search.max_virtual_stages=2",
    "search.max_cp=2",
    "mode=search",
]


@pytest.fixture(scope="module")
def small(compose):
    cfg = compose(SMALL)
    return cfg, search.run(cfg)


def _space(cfg):
    """Every candidate of the stated space, enumerated the obvious way."""
    for tp, cp, pp, dpr, dps, ep in search.layouts(cfg, search.world_size(cfg)):
        for sched, v in search.schedules(pp, cfg.search.max_virtual_stages):
            for mbs in range(1, cfg.search.max_microbatch_size + 1):
                for ac in search.AC:
                    for r in search.reshard_policies(dps):
                        yield search.Candidate(tp, cp, pp, dpr, dps, ep, sched, v, mbs, ac, r)


def test_every_candidate_is_accounted_for(small):
    cfg, res = small
    assert res.candidates == len(list(_space(cfg))) > 1000
    assert sum(res.rejected.values()) + len(res.ranked) == res.candidates
    assert min(res.rejected[k] for k in (search.MEMORY, search.DOMINATED, "slower", "training.global_batch_size")) > 0
    for r in res.ranked:  # every kept candidate passes every rule of validation
        validate.check(_as_plan(r.candidate.config(cfg)))


def _brute_force(cfg) -> dict:
    """Every candidate through validate.check (every rule) and memory.memory (the plan's verdict): key -> fits."""
    fits = {}
    for cand in _space(cfg):
        c = _as_plan(cand.config(cfg))
        try:
            lay = validate.check(c)
        except ConfigError:
            continue
        micro = c.training.global_batch_size // (lay.dp * c.training.microbatch_size)
        fits[cand] = memory.memory(c, lay, micro, None)["fits_memory"]
    return fits


def _undominated(fits: dict) -> list:
    """Of each layout, schedule and microbatch, the fitting candidates of the lowest AC tier (none < selective < full),
    each AC with the first fitting of never, always: what the search may keep."""
    out = []
    for cand, ok in fits.items():
        policies = search.reshard_policies(cand.dp_shard)
        if not ok or cand.ac not in next(
            t for t in search.AC_TIERS if any(fits.get(cand._replace(ac=a, reshard=r)) for a in t for r in policies)
        ):
            continue
        if cand.reshard == search.ReshardPolicy.always and fits.get(cand._replace(reshard=search.ReshardPolicy.never)):
            continue
        out.append(cand)
    return out


def test_pruning_keeps_the_brute_force_best(small):
    """Brute force over the whole space, then the dominance rule (less recomputation, or no re-gathering, that fits
    wins): the search's best ten are its best ten, with the same step time, recomputation and memory."""
    cfg, res = small
    fits = _brute_force(cfg)
    keep = _undominated(fits)
    assert sum(fits.values()) > len(keep) > 20  # the dominance rule removes some, not all
    keys = []
    for cand in keep:
        c, lay = _as_plan(cand.config(cfg)), cand.layout()
        recompute = flops.recompute_fraction(c.model, cand.ac, c.training.ac_layer_frequency)
        micro = c.training.global_batch_size // (lay.dp * cand.microbatch_size)
        keys.append((steptime.predict(c, lay).step_s, recompute, memory.memory(c, lay, micro, None)["total_gb_per_gpu"]))
    # the same functions: equal to the bit; candidates only the schedule tells apart, priced alike, are one (search.TIED)
    keys = [k for _, k in {(cand._replace(schedule=""), k) for cand, k in zip(keep, keys, strict=True)}]
    assert [r.key() for r in res.ranked] == sorted(keys)[: len(res.ranked)]
    top = res.ranked[0]
    budget = plan.compute(_as_plan(top.candidate.config(cfg)), top.candidate.layout())
    assert budget["estimated_step_time_s"] == pytest.approx(top.step_s) and budget["total_gb_per_gpu"] == pytest.approx(top.memory_gb)


def _as_plan(cfg):
    cfg.mode = Mode.plan
    return cfg


def test_a_rule_rejects_every_candidate_under_its_layout(compose):
    """debug model with 4 KV heads on 8 GPUs: every tp=8 candidate falls to the TP rule, in validation's words."""
    cfg = compose(
        ["cluster=h100_node", "precision=bf16", "model.num_kv_heads=4", "search.max_cp=1", "search.max_microbatch_size=1", "mode=search"]
    )
    res = search.run(cfg)
    tp8 = [c for c in _space(cfg) if c.tp == 8]
    assert res.rejected["parallelism.tp"] == len(tp8) > 0
    with pytest.raises(ConfigError) as e:
        validate.check(_as_plan(tp8[0].config(cfg)))
    assert res.examples["parallelism.tp"] == e.value.problems[0]
    assert "must divide model.num_heads = 16 and model.num_kv_heads = 4" in str(res.examples["parallelism.tp"])


def test_bounds_and_why_line_are_printed(small):
    cfg, res = small
    text = "\n".join(search_render.lines(cfg, res))
    assert f"{res.candidates:,} candidates" in text and "search.max_cp = 2" in text and "v = 2..search.max_virtual_stages = 2" in text
    assert "selective_op, selective_layer (every 2), full" in text
    assert f"rule training.global_batch_size (e.g. {res.examples['training.global_batch_size']})" in text
    why = search_render.why_first(res)
    assert text.count("\n  1  ") == 1 and why in text
    second = res.ranked[1]  # not tied here: the line names #2, the term that separates them and both values
    gap, term = second.step_s - res.ranked[0].step_s, why.split("its ")[1].split(" term")[0]
    assert (
        why.startswith(f"#1 beats #2 ({second.label}) by {gap:.3g} s")
        and f"({res.ranked[0].terms[term]:.3g} s vs {second.terms[term]:.3g} s)" in why
    )


def test_search_space_names_the_precision_and_warns_once_at_the_debug_defaults(compose, small):
    """A GPU cluster searched with the CPU smoke run's batch 8 and seq 256 ranks layouts for a toy problem: one
    warning names the fields at their defaults; the search-space lines name the precision. Set, no warning; a CPU
    cluster (where those defaults are the point) none either. The CPU default fp32 is refused before any layout."""
    base = ["cluster=h100_node", "search.max_cp=1", "search.max_microbatch_size=1", "mode=search"]
    with pytest.raises(validate.ConfigError, match="precision.param_dtype = float32: precision fp32 computes in float32"):
        search.run(compose(base))
    cfg = compose([*base, "precision=bf16"])
    text = "\n".join(search_render.lines(cfg, search.run(cfg)))
    warning = (
        "warning: cluster h100_node is searched with the debug defaults training.global_batch_size=8, training.seq_len=256, "
        "so the layouts are ranked for that toy problem; set training.global_batch_size and training.seq_len to the run's own"
    )
    assert text.count("warning:") == 1 and warning in text.splitlines()
    assert "  8 devices (1 nodes x 8), global batch 8, seq_len 256, precision bf16 (bfloat16 compute)" in text.splitlines()
    small_cfg, res = small
    assert res.warning is None and "warning" not in "\n".join(search_render.lines(small_cfg, res))
    assert res.bounds[0].endswith("global batch 16, seq_len 8192, precision bf16 (bfloat16 compute)")
    assert search.debug_defaults(compose(["cluster=h100_node", "precision=bf16", "training.seq_len=4096", "mode=search"])) == (
        "warning: cluster h100_node is searched with the debug defaults training.global_batch_size=8, so the layouts are ranked "
        "for that toy problem; set training.global_batch_size to the run's own"
    )
    assert search.debug_defaults(compose(["cluster.devices_per_node=4", "mode=search"])) is None


@pytest.mark.e2e
def test_search_cli_writes_a_sweep_that_runs_as_it_is(tmp_path):
    run = tmp_path / "search"
    proc = run_cli(
        "model=llama3_8b",
        "cluster=h100_node",
        "precision=bf16",
        "training.seq_len=8192",
        "training.global_batch_size=16",
        "search.top_k=3",
        "mode=search",
        run_dir=run,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads((run / "search.json").read_text())
    assert "top 10 by predicted step time" in proc.stdout and found["why_first"] in proc.stdout
    assert sum(found["rejected"].values()) + len(found["ranked"]) <= found["candidates"]
    sweep = tmp_path / "sweep"
    proc = run_cli("--config-dir", str(run / "search"), "sweep=search_top", "mode=plan", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for i, want in enumerate(found["ranked"][:3]):
        got = json.loads((sweep / str(i) / "plan.json").read_text())
        assert got["estimated_step_time_s"] == pytest.approx(want["step_s"]) and got["total_gb_per_gpu"] == pytest.approx(want["memory_gb"])
        assert got["layout"] == want["label"]
    assert not (sweep / "3").exists()


@pytest.mark.e2e
def test_search_needs_a_fixed_device_count(tmp_path):
    proc = run_cli("mode=search", run_dir=tmp_path / "r")
    assert proc.returncode == 2
    assert "cluster.devices_per_node = -1" in proc.stderr and "set cluster.num_nodes and cluster.devices_per_node" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "r" / "search.json").exists()


def test_no_surviving_candidate_is_an_error_naming_the_binding_reason(compose, tmp_path, capsys):
    """local_cpu measures its peak at start-up: without a profile the predictor has nothing to price with. The report
    still prints, then the reason that rejected the most candidates is a ConfigError (exit 2, nothing written; in a
    multirun an invalid point); a model no device holds names memory."""
    from runner import modes

    cfg = compose(["cluster.devices_per_node=4", "mode=search"])
    with pytest.raises(ConfigError) as e:
        modes.search(cfg, None, None, tmp_path)
    (p,) = e.value.problems
    assert (p.field, p.value) == ("cluster.profile", None)
    res = search.run(cfg)
    assert res.rejected.most_common(1)[0][0] == search.UNPRICED
    assert p.why == (
        f"no candidate of mode=search survived: {res.rejected[search.UNPRICED]:,} of the {res.candidates:,} were rejected as "
        "unpriced: cluster local_cpu has no float32 peak or link bandwidth to predict with"
    )
    assert "python -m runner.calibrate" in p.fix and list(tmp_path.iterdir()) == []
    out = capsys.readouterr().out
    assert "unpriced: the cluster has no peak or link bandwidth" in out and out.rstrip().endswith("no candidate survived")
    big = compose(["model=llama3_70b", "cluster=h100_node", "precision=bf16", "training.seq_len=2048", "search.max_cp=1", "mode=search"])
    with pytest.raises(ConfigError) as e:
        modes.search(big, None, None, tmp_path)
    assert (e.value.problems[0].field, e.value.problems[0].value) == ("cluster.device_memory_gb", 80.0)
    assert "were rejected by memory: even the lightest setting (full recomputation, resharding) needs more than a device's 80 GB" in str(
        e.value
    )


def test_v_schedules_are_ranked_on_their_own_memory_and_the_one_line_plan_names_the_schedule(compose, tmp_path):
    """ZBVZeroBubble and DualPipeV are priced alike in time, but each holds what its own action order leaves in flight
    (runner.estimate.pipeline_ranks.v_held) and what its split backward holds at its weight halves
    (runner.estimate.split_backward), so the pair is two rows, each with its own plan's memory. (They were one row with
    "(also: ...)" while the memory model gave both 1F1B's count.) Candidates that tie exactly are still counted as tied,
    never two rows; the one-line plan of a sweep point names its schedule."""
    cfg = compose(
        [
            "model=llama3_70b",
            "cluster=h100x64",
            "precision=bf16",
            "training.seq_len=4096",
            "training.global_batch_size=64",
            "search.max_microbatch_size=1",
            "search.max_virtual_stages=2",
            "search.max_cp=1",
            "mode=search",
        ]
    )
    res = search.run(cfg, keep=40)
    rows = {r.label: r for r in res.ranked}
    zbv, dualpipe = rows["tp8_pp4_ZBVZeroBubble_v2_dp2"], rows["tp8_pp4_DualPipeV_v2_dp2"]
    assert zbv.step_s == dualpipe.step_s and not zbv.also and not dualpipe.also
    for r in (zbv, dualpipe):  # each row's memory is its own plan's
        assert r.memory_gb == pytest.approx(plan.compute(_as_plan(r.candidate.config(cfg)), r.candidate.layout())["total_gb_per_gpu"])
    assert zbv.memory_gb != pytest.approx(dualpipe.memory_gb, rel=0.01)
    twin = zbv.candidate._replace(schedule="DualPipeV")
    assert steptime.predict(twin.config(cfg), twin.layout()).step_s == zbv.step_s
    shapes = [(r.candidate._replace(schedule=""), r.key()) for r in res.ranked]
    assert len(set(shapes)) == len(shapes)  # no two rows that only the schedule tells apart
    assert res.rejected[search.TIED] >= sum(len(r.also) for r in res.ranked)
    assert sum(res.rejected.values()) + len(res.ranked) == res.candidates
    lines = [plan.one_line(plan.compute(_as_plan(c.config(cfg)), c.layout())) for c in (zbv.candidate, twin)]
    assert lines[0].startswith("plan tp8_pp4_ZBVZeroBubble_v2_dp2 [pp=4 x dp_shard=2 x tp=8]: estimated step")
    assert lines[1].startswith("plan tp8_pp4_DualPipeV_v2_dp2 [")


def _verify_profile(tmp_path):
    """The CPU test profile with a slow point-to-point link (1 MB/s), so that no pipeline ties the top 3 (dp2, dpr2, tp2)."""
    from runner.estimate.predict import machine_profile as steptime_profile
    from tests.machine_profiles import round_profile

    prof = round_profile()
    for links in prof["collectives"].values():
        links["send_recv@2"] = {"latency_s": 0.05, "gbs": 0.001}  # a profile's collectives cost their bytes + collective_fixed_s
    return steptime_profile.write(prof, tmp_path / "profile.json")


def test_candidates_closer_than_the_error_band_are_one_tier(compose, tmp_path):
    """The same search (local_cpu, 2 ranks: dp2 at 0.159 s, then 2.4 %, 11 % and 15 % slower, the 5th 32 %) on two
    profiles that differ only in their calibration residuals: predicted within a +/-17 % band, the first four are one
    tier and search.verify is the next step; with a +/-1 % band #1 is a clear winner and no tier is reported."""
    from runner.estimate.predict import machine_profile as steptime_profile
    from tests.machine_profiles import round_profile

    def searched(error: float, name: str):
        prof = round_profile()
        for links in prof["collectives"].values():
            links["send_recv@2"] = {"latency_s": 0.05, "gbs": 0.001}  # no pipeline near the top
        prof["residuals"] = [
            {"run": "a", "measured_s": 1.0, "predicted_s": 1 + error},
            {"run": "b", "measured_s": 2.0, "predicted_s": 2 - 2 * error},
        ]
        path = steptime_profile.write(prof, tmp_path / name)
        cfg = compose(
            ["cluster.devices_per_node=2", f"cluster.profile={path}", "training.seq_len=64", "training.global_batch_size=4", "mode=search"]
        )
        res = search.run(cfg)
        (tmp_path / name.removesuffix(".json")).mkdir()
        found, _ = search_render.write(cfg, res, tmp_path / name.removesuffix(".json"), [])
        return path, res, search_render.lines(cfg, res), json.loads(found.read_text())

    path, res, text, found = searched(0.17, "wide.json")
    steps = [r.step_s for r in res.ranked]
    assert steps[3] / steps[0] - 1 < 0.17 < steps[4] / steps[0] - 1  # the band ends after #4
    assert text[-1] == (
        f"tier: #1-#4 are predicted within {100 * (steps[3] / steps[0] - 1):.1f} % of #1, inside the predictor's error band of "
        f"+/-17.0 % (RMS error of the 2 calibration runs of {path}): it cannot order them; measure them here with search.verify=4"
    )
    assert found["tier"]["ranks"] == [1, 2, 3, 4] and found["tier"]["band"] == pytest.approx(0.17)
    _, res, text, found = searched(0.01, "narrow.json")
    assert res.ranked[1].step_s / res.ranked[0].step_s - 1 > 0.01  # #2 is further from #1 than the band
    assert not any(line.startswith("tier:") for line in text) and found["tier"] is None


@pytest.mark.e2e
def test_verify_trains_the_top_k_and_prints_measured_beside_predicted(tmp_path):
    """search.verify=3 on this machine: one multirun of the written sweep's first 3 points, 3 steps each; every row of
    the printed table is the search's prediction and the job folder's measured median, and the rank agreement is
    computed from those same numbers."""
    run = tmp_path / "search"
    proc = run_cli(
        "cluster=local_cpu",
        "cluster.devices_per_node=2",
        f"cluster.profile={_verify_profile(tmp_path)}",
        "training.seq_len=64",
        "training.global_batch_size=4",
        "search.top_k=3",
        "search.verify=3",
        "search.verify_steps=3",
        "mode=search",
        run_dir=run,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads((run / "search.json").read_text())
    v = found["verify"]
    # dpr2 after tp2: FSDP copies all of its parameters into and out of the gather buffers (dp_shard 1)
    assert [p["label"] for p in v["points"]] == [r["label"] for r in found["ranked"][:3]] == ["dp2", "tp2", "dpr2"]
    table = proc.stdout[proc.stdout.index("verify: the top 3 trained here for 3 steps each") :].splitlines()
    assert table[0].endswith(f"in {run / 'search' / 'verify'}")
    for i, (row, want) in enumerate(zip(table[2:5], found["ranked"][:3], strict=True)):
        job = run / "search" / "verify" / str(i)
        s = json.loads((job / "summary.json").read_text())
        assert s["steps"] == 3 and s["layout"] == want["label"]
        measured, err = s["step_time_s_median"], want["step_s"] / s["step_time_s_median"] - 1
        mbs = {"dp2": "2", "tp2": "4", "dpr2": "2"}[want["label"]]
        assert row.split() == [str(i + 1), want["label"], mbs, "none", f"{want['step_s']:.3f}", f"{measured:.3f}", f"{100 * err:+.1f}", "%"]
        assert v["points"][i]["measured_s"] == measured and v["points"][i]["folder"] == str(job)
    assert not (run / "search" / "verify" / "3").exists()
    pred, meas = [p["predicted_s"] for p in v["points"]], [p["measured_s"] for p in v["points"]]
    rho = accuracy.spearman(pred, meas)
    assert v["spearman"] == rho and table[5] == f"rank agreement, predicted vs measured: Spearman {rho:.2f} over 3 measured candidates"
    fastest = min(range(3), key=meas.__getitem__)
    if fastest == 0:
        assert table[6] == "predicted #1 (dp2, mbs 2) is the measured fastest"
    else:
        p = v["points"][fastest]
        gap, name = meas[0] / meas[fastest] - 1, f"{p['label']}, mbs {p['microbatch_size']}"
        assert table[6] == f"predicted #1 (dp2, mbs 2) measures {100 * gap:.1f} % slower than the measured fastest, #{fastest + 1} ({name})"
    assert v["first_slower_by"] == meas[0] / meas[fastest] - 1


def test_verify_lists_a_failed_point_with_its_reason(small, tmp_path):
    """A job folder with failed.json is a row with the reason, not a crash; under 3 measured points there is no
    Spearman, and the best predicted that ran stands for #1 when #1 failed."""
    _, res = small
    folder = tmp_path / "search" / "verify"
    results = {
        "0": ("failed.json", {"exit_code": 1, "error": "RuntimeError: out of memory"}),
        "1": ("summary.json", {"step_time_s_median": 2.0}),
        "2": ("summary.json", {"step_time_s_median": 1.5}),
    }  # top4's job never ran: no folder
    for job, (name, body) in results.items():
        (folder / job / ".hydra").mkdir(parents=True)
        (folder / job / ".hydra" / "overrides.yaml").write_text(f"- +search_top=top{int(job) + 1}\n- training.steps=4\n")
        (folder / job / name).write_text(json.dumps(body))
    v = search_verify.collect(res, tmp_path, 4, 4, 1)
    text = search_verify.lines(v)
    r = res.ranked

    def ac(ranked):
        return "" if ranked.candidate.ac == search.AC.none else f", AC {ranked.candidate.ac.value}"

    assert text[2].split("failed: ")[1] == "exit code 1: RuntimeError: out of memory"
    assert "failed: no result (the multirun exited with code 1; its output is above)" in text[5]
    assert text[6] == "rank agreement, predicted vs measured: Spearman needs >= 3 measured candidates, 2 measured"
    assert text[7] == (
        f"predicted #2 ({r[1].label}, mbs {r[1].candidate.microbatch_size}{ac(r[1])}) (the best predicted that ran) measures 33.3 % "
        f"slower than the measured fastest, #3 ({r[2].label}, mbs {r[2].candidate.microbatch_size}{ac(r[2])})"
    )
    assert (v["spearman"], v["first"], v["fastest"]) == (None, 2, 3)


@pytest.mark.e2e
def test_verify_is_refused_before_anything_runs(tmp_path):
    """More than the sweep holds, on a cluster whose runs start elsewhere: both problems, exit 2, no search.json."""
    overrides = ["cluster=h100x64", "model=llama3_8b", "precision=bf16", "search.top_k=2", "search.verify=3", "mode=search"]
    proc = run_cli(*overrides, run_dir=tmp_path / "r")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (
        "search.verify = 3: trains candidates of the written sweep, which holds search.top_k = 2. "
        "Fix: set search.verify to at most 2, or search.top_k=3." in proc.stderr
    )
    assert (
        "search.verify = 3: trains the candidates on this machine, and cluster h100x64 starts its runs elsewhere (8 nodes). "
        "Fix: set search.verify=0 and run the written sweep on the cluster" in proc.stderr
    )
    assert "Traceback" not in proc.stderr and not (tmp_path / "r").exists()


FP8_70B = [
    "model=llama3_70b",
    "cluster=h100x64",
    "training.seq_len=4096",
    "training.global_batch_size=64",
    "training.compile=true",
    "search.max_microbatch_size=1",
    "search.max_virtual_stages=2",
    "search.max_cp=1",
    "mode=search",
]
FP8_8B_TP8 = [
    "model=llama3_8b",
    "cluster=h100_node",
    "parallelism=tp2",
    "parallelism.name=tp8",
    "parallelism.tp=8",
    "training.seq_len=8192",
    "training.global_batch_size=8",
    "training.microbatch_size=1",
    "training.compile=true",
]


def test_fp8_search_prints_each_candidates_speed_up_over_the_same_candidate_in_bf16(compose, monkeypatch):
    """mode=search precision=fp8_tensorwise ranks with the FP8 model and prints, per candidate, its predicted bf16 step
    over its FP8 one: where FP8 pays (the 70B's large GEMMs on 64 H100s, compiled casts: x1.23 for #1) and where it does
    not (the 8B at TP 8, whose sharded GEMMs gain less while every cast and tensorwise amax all-reduce stays: x0.99 in its
    one-line plan). Each printed figure is the bf16 config's own prediction (composed with precision=bf16) over the FP8
    one's; MFU is of the bf16 peak in both precisions."""
    cfg, bf16 = compose([*FP8_70B, "precision=fp8_tensorwise"]), compose([*FP8_70B, "precision=bf16"])
    walks = []  # the FP8 model walks the model's layers once per TP degree, not per candidate (a 30x slower search)
    monkeypatch.setattr(precision, "conversion", lambda c, real=precision.conversion: walks.append(1) or real(c))
    fp8_model._LAYERS.clear()
    model_rules._FP8_LAYERS.clear()
    res = search.run(cfg)
    tps = {d[0] for d in search.layouts(cfg, search.world_size(cfg))}
    assert len(walks) == len(tps) + 1  # validation's FP8 shape rule once a search, the FP8 model once per TP
    monkeypatch.undo()
    text = search_render.lines(cfg, res)
    head = next(i for i, t in enumerate(text) if t.startswith("  #  layout"))
    assert "vs bf16" in text[head] and "'vs bf16': the same candidate's predicted bf16 step time over its FP8 one" in text[head - 1]
    for i, r in enumerate(res.ranked[:3]):
        fp8_s = steptime.predict(r.candidate.config(cfg), r.candidate.layout()).step_s
        bf16_s = steptime.predict(r.candidate.config(bf16), r.candidate.layout()).step_s
        assert (r.step_s, r.fp8_speed_up) == (fp8_s, pytest.approx(bf16_s / fp8_s))
        assert f" {search_render.speed_up(bf16_s / fp8_s)}  " in text[head + 1 + i]
        assert r.mfu == pytest.approx(search.mfu(bf16, bf16_s) * bf16_s / fp8_s)  # of the bf16 peak (989), not float8's
    gain_70b = res.ranked[0].fp8_speed_up
    assert gain_70b > 1.15 and search_render.to_json(res)["ranked"][0]["fp8_speed_up"] == gain_70b
    small, small_bf16 = _as_plan(compose([*FP8_8B_TP8, "precision=fp8_tensorwise"])), _as_plan(compose([*FP8_8B_TP8, "precision=bf16"]))
    lay = validate.check(small)
    budget = plan.compute(small, lay)
    gain_8b = plan.compute(small_bf16, lay)["estimated_step_time_s"] / budget["estimated_step_time_s"]
    assert budget["fp8_speed_up"] == pytest.approx(gain_8b) and gain_8b < 1.0 < gain_70b
    assert plan.one_line(budget).endswith(f", FP8 {search_render.speed_up(gain_8b)} vs bfloat16")
    assert budget["predicted_terms_s"]["fp8_amax"] > 0.05 * budget["estimated_step_time_s"]  # TP 8's amax all-reduces: 9 %


class _Direct(search._Search):
    """The search with nothing cached: each price steptime.predict's and memory.memory's own, computed at each call."""

    def predict(self, cand):
        return steptime.predict(cand.config(self.cfg), cand.layout())

    def peak_gb(self, cfg, lay):
        micro = cfg.training.global_batch_size // (lay.dp * cfg.training.microbatch_size)
        return memory.memory(cfg, lay, micro, self.cap)["total_gb_per_gpu"]

    def fits(self, cfg, lay):
        return self.cap is None or self.peak_gb(cfg, lay) <= self.cap


@pytest.mark.parametrize("precision", ["bf16", "fp8_tensorwise"])
def test_the_search_prices_less_and_reports_what_direct_pricing_reports(compose, monkeypatch, precision):
    """The search's shortcuts (one prediction per candidate without its schedule, which the predictor reads only as v;
    a block's work once per layout, microbatch and AC; a memory check that stops at the first stage over the device)
    change nothing it reports: the same search pricing every candidate directly, with steptime.predict and
    memory.memory (every stage), ranks the same candidates with the same times, terms, memory and MFU, and rejects as
    many for each reason, while the search prices a third of the blocks and fewer stages."""
    cfg = compose([*SMALL, f"precision={precision}"])
    calls = {"_block": 0, "stage": 0}

    def count(module, name):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **k: calls.__setitem__(name, calls[name] + 1) or real(*a, **k))

    count(steptime, "_block")
    count(memory, "stage")
    cached, used = search.run(cfg), dict(calls)
    monkeypatch.setattr(search, "_Search", _Direct)
    calls.update(_block=0, stage=0)
    direct = search.run(cfg)
    assert cached.rejected[search.MEMORY] > 0 and len(cached.ranked) == 10
    assert [dataclasses.astuple(r) for r in cached.ranked] == [dataclasses.astuple(r) for r in direct.ranked]
    assert (cached.rejected, cached.examples, cached.predictions) == (direct.rejected, direct.examples, direct.predictions)
    assert 3 * used["_block"] < calls["_block"] and used["stage"] < calls["stage"]
