"""The measured CPU peak: stable from one measurement to the next, outliers refused, cached per machine."""

from __future__ import annotations

import json
import re
import time

import pytest

from runner.run import peak

# Two measurements in a row on this machine agree within this (rounds at the plateau, median of
# best-of rounds); the 2-core test machine is shared with other jobs, which is what the rounds absorb.
AGREE = 0.20


def test_two_measurements_in_a_row_agree():
    a, b = peak.measure_share("float32", threads=1), peak.measure_share("float32", threads=1)
    assert abs(a["tflops"] - b["tflops"]) <= AGREE * min(a["tflops"], b["tflops"]), (a, b)
    assert a["size"] in peak.SIZES and len(a["rounds"]) == peak.ROUNDS
    assert 0 <= a["spread"] <= 2 * peak.OUTLIER


def test_an_outlier_round_is_refused():
    r = peak.robust([1.00, 1.02, 0.98, 0.40, 1.01])  # one round slowed by another process
    assert r["refused"] == [0.40]
    assert r["tflops"] == pytest.approx(1.005)
    assert r["spread"] == pytest.approx((1.02 - 0.98) / 1.005)


def test_thread_layout_follows_the_ranks(monkeypatch):
    monkeypatch.setattr(peak.os, "cpu_count", lambda: 16)
    assert [peak.layout(n) for n in (1, 2, 3, 4, 32)] == [(16, 1), (8, 2), (5, 3), (4, 4), (1, 16)]


def test_peak_is_cached_per_machine_dtype_and_layout(compose, tmp_path, monkeypatch):
    calls = []
    real = peak.measure_share

    def counted(dtype, threads):
        calls.append((dtype, threads))
        return real(dtype, threads)

    monkeypatch.setattr(peak, "measure_share", counted)
    monkeypatch.setattr(peak.concurrent.futures, "ProcessPoolExecutor", _InProcess)  # count the calls here, not in a child
    cfg = compose(["parallelism=single", f"cluster.peak_cache_dir={tmp_path / 'cache'}"])
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    first, second = peak.write(cfg, 1, tmp_path / "a"), peak.write(cfg, 1, tmp_path / "b")
    assert len(calls) == 1  # the second run reads the first one's figure
    assert (first["peak_tflops"], first["peak_spread"]) == (second["peak_tflops"], second["peak_spread"])
    assert first["measurement"]["cached"] is False and second["measurement"]["cached"] is True
    (cache,) = (tmp_path / "cache").iterdir()
    assert cache.name == f"peak-{re.sub(r'[^A-Za-z0-9]+', '-', peak.cpu_model()).strip('-')}-float32.json"
    stored = json.loads(cache.read_text())
    assert list(stored) == [peak._cache_key(1)] and stored[peak._cache_key(1)]["cpu_model"] == peak.cpu_model()
    assert json.loads((tmp_path / "b" / "peak.json").read_text())["peak_spread"] == first["peak_spread"]
    peak.write(cfg, 2, tmp_path / "b")  # two ranks per node: another thread layout, measured anew
    assert len(calls) == 2 and len(json.loads(cache.read_text())) == (2 if peak.layout(2) != peak.layout(1) else 1)


def test_a_cached_peak_beaten_by_its_check_round_is_measured_again(compose, tmp_path, monkeypatch):
    """A figure cached while other processes held the cores (here 1 GFLOP/s) is beaten by the next run's check round
    and replaced by a new measurement, which records what it replaced; a figure the check round does not beat
    stays (one check round, no measurement)."""
    monkeypatch.setattr(peak.concurrent.futures, "ProcessPoolExecutor", _InProcess)
    cfg = compose(["parallelism=single", f"cluster.peak_cache_dir={tmp_path / 'cache'}"])
    threads, _ = peak.layout(1)
    path = peak._cache_file(str(tmp_path / "cache"), "float32")
    path.parent.mkdir()
    stale = {
        "tflops": 0.001,
        "share_tflops": 0.001,
        "spread": 0.0,
        "rounds": [0.001] * 5,
        "refused": [],
        "size": 256,
        "threads": threads,
        "shares": 1,
        "measured_at": "2026-01-01T00:00:00",
    }
    path.write_text(json.dumps({peak._cache_key(1): stale}))
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    fresh = peak.write(cfg, 1, tmp_path / "a")
    m = fresh["measurement"]
    assert m["cached"] is False and fresh["peak_tflops"] > 0.001 * (1 + peak.OUTLIER)
    assert m["replaced"]["share_tflops"] == 0.001 and m["replaced"]["check_tflops"] > 0.001 * (1 + peak.OUTLIER)
    assert json.loads(path.read_text())[peak._cache_key(1)]["share_tflops"] == m["share_tflops"]
    calls = []
    monkeypatch.setattr(peak, "measure_share", lambda *a: calls.append(a))
    monkeypatch.setattr(peak, "check_round", lambda dtype, threads, n: m["share_tflops"])  # no faster than the figure
    monkeypatch.setattr(peak, "CHECK_EVERY_S", 0)  # checked every run
    again = peak.write(cfg, 1, tmp_path / "b")
    assert again["measurement"]["cached"] is True and again["peak_tflops"] == fresh["peak_tflops"] and calls == []
    assert again["measurement"]["check_tflops"] == m["share_tflops"]
    monkeypatch.setattr(peak, "CHECK_EVERY_S", 600)  # just checked: not again
    monkeypatch.setattr(peak, "check_round", lambda *a: pytest.fail("checked again within CHECK_EVERY_S"))
    assert peak.write(cfg, 1, tmp_path / "b")["measurement"]["cached"] is True


class _InProcess:
    """ProcessPoolExecutor stand-in that runs the submitted call in this process."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *args):
        from concurrent.futures import Future

        f = Future()
        f.set_result(fn(*args))
        return f


def test_spread_is_shown_beside_a_measured_peak_only():
    assert peak.spread_text({"peak_spread": 0.031}) == ", spread 3.1 %"
    assert peak.spread_text({"peak_spread": None}) == ""


def _policy(cfg):
    from runner.run.device import DevicePolicy

    return DevicePolicy.of(cfg.cluster, cfg.distributed)


def _cached(cache, machine: dict, created: str):
    """A profile (tests/test_predictor.py's, with round figures) stored in the cache as runner.calibrate stores it."""
    from runner.estimate.predict import machine_profile as steptime_profile
    from tests.machine_profiles import round_profile

    prof = round_profile() | {"machine": machine | {"created": created}}
    path = steptime_profile.write(prof, cache / "made.json")
    return peak.store_profile(str(cache), path)


def test_a_cpu_run_without_a_profile_predicts_nothing_and_says_how_to_make_one(compose, tmp_path):
    """The datasheet model describes GPUs (2.4x off on this CPU): with no profile of this machine in the cache the
    summary has no predicted step time, records why, and the console's one line names python -m runner.calibrate."""
    from runner.config import validate
    from runner.observe import plan_check
    from runner.run import metrics

    cfg = compose([f"cluster.peak_cache_dir={tmp_path / 'cache'}"])
    cal = plan_check.compare(cfg, validate.check(cfg), peak.profile_source(cfg, _policy(cfg)), 0.05, 1.0, 1.354, None)
    assert (cal["step_time_predicted_s"], cal["step_time_ratio"], cal["prediction_source"]) == (None, None, None)
    assert (cal["profile"], cal["profile_from"]) == (None, "none")
    assert metrics.plan_check_line(cal) == (
        "plan check: step time measured 1.354 s; no prediction without a machine profile of this CPU: "
        "make one with `python -m runner.calibrate` (later runs here use it; or set cluster.profile)"
    )


def test_calibrate_caches_its_profile_and_cpu_runs_use_the_newest_of_this_machine(compose, tmp_path, monkeypatch, capsys):
    """python -m runner.calibrate (its measurements replaced by a fixture's figures) writes --out and a copy in
    cluster.peak_cache_dir named after the machine; a run without cluster.profile predicts with the newest profile
    measured on this machine, passing over older ones, another machine's, and files that are no profile."""
    import torch

    from runner.calibrate import measure as calibrate
    from runner.calibrate import runs as calibrate_runs
    from runner.config import validate
    from runner.estimate.predict import steptime
    from runner.observe import plan_check
    from runner.run import metrics
    from tests.machine_profiles import round_profile

    fixture, cache = round_profile(), tmp_path / "cache"
    run = compose(["model=debug", "parallelism=single", *calibrate_runs.RUN_AT_SHAPE])
    monkeypatch.setattr(calibrate, "by_ranks", lambda *a: fixture["by_ranks"])
    monkeypatch.setattr(calibrate_runs, "collectives", lambda cfg, n, *a: fixture["collectives"][str(n)])
    monkeypatch.setattr(calibrate_runs, "fixed_costs", lambda *a, **k: (dict(fixture["constants"]), []))
    monkeypatch.setattr(calibrate_runs, "in_run_shares", lambda *a, **k: ({}, {}, {}, [], [(run, 1.0)]))
    assert calibrate.main([f"cluster.peak_cache_dir={cache}", "--out", str(tmp_path / "p.json"), "--ranks", "1,2,4"]) == 0
    made = json.loads((tmp_path / "p.json").read_text())
    assert made["residuals"] == [
        {"run": "single, 6 blocks of dim 256", "measured_s": 1.0, "predicted_s": steptime.predict(run, validate.check(run), made).step_s}
    ]
    (stored,) = cache.glob("profile-*.json")
    slug = re.sub(r"[^A-Za-z0-9]+", "-", peak.cpu_model()).strip("-")
    assert stored.name == f"profile-{slug}-float32-{re.sub(r'[^0-9T]', '', made['machine']['created'].split('+')[0])}.json"
    assert json.loads(stored.read_text()) == made and f"stored in the cache as {stored}" in capsys.readouterr().out

    here = {k: made["machine"][k] for k in ("cpu", "cores", "device", "backend", "torch", "dtype")}
    _cached(cache, here, "2020-01-01T00:00:00+00:00")  # older
    _cached(cache, here | {"cores": here["cores"] + 1}, "2099-01-01T00:00:00+00:00")  # newer, another machine
    _cached(cache, here | {"torch": "1.0"}, "2099-01-02T00:00:00+00:00")  # newer, another torch
    (cache / f"profile-{slug}-float32-29990101T000000.json").write_text("{not json")
    assert peak.cached_profile(str(cache), "float32") == stored and here["torch"] == torch.__version__
    assert peak.cached_profile(str(cache), "bfloat16") is None and peak.cached_profile(None, "float32") is None

    cfg = compose([f"cluster.peak_cache_dir={cache}"])
    lay = validate.check(cfg)
    cal = plan_check.compare(cfg, lay, peak.profile_source(cfg, _policy(cfg)), 0.05, 1.0, 1.354, None)
    predicted = steptime.predict(cfg, lay, str(stored)).step_s
    assert (cal["profile"], cal["profile_from"], cal["prediction_source"]) == (str(stored), "cache", str(stored))
    assert cal["step_time_predicted_s"] == predicted and cal["step_time_ratio"] == pytest.approx(1.354 / predicted)
    assert f"measured 1.354 s (measured/predicted {1.354 / predicted:.2f}), {stored} (the newest cached profile of this machine)" in (
        metrics.plan_check_line(cal)
    )
    given = compose([f"cluster.peak_cache_dir={cache}", f"cluster.profile={tmp_path / 'p.json'}"])
    assert peak.profile_source(given, _policy(given)) == (str(tmp_path / "p.json"), "cluster.profile")
    assert plan_check.compare(given, lay, peak.profile_source(given, _policy(given)), 0.05, 1.0, 1.354, None)["profile_from"] == (
        "cluster.profile"
    )


def test_fp8_beside_float32_is_measured_here_in_well_under_a_second():
    """The real measurement (no patch) at a small size: both GEMMs timed, whatever this CPU's FP8 kernel is."""
    t0 = time.perf_counter()
    m = peak.fp8_slowdown(threads=1, n=128)
    took = time.perf_counter() - t0
    assert took < 0.5, took
    assert (m["size"], m["threads"]) == (128, 1) and m["float8_tflops"] > 0 and m["float32_tflops"] > 0
    assert m["slowdown"] == pytest.approx(m["float32_tflops"] / m["float8_tflops"])


def _fp8_run(compose, tmp_path, monkeypatch, fp8_tflops: float, fp32_tflops: float, folder: str):
    """peak.write and the start-up accounting of the reported command (dp2_tp2, fp8_tensorwise, seq_len 128), with
    the GEMM measurements replaced by these rates; returns (config, accounting, peak record)."""
    from types import SimpleNamespace

    from runner.estimate import flops
    from runner.run import accounting

    monkeypatch.setattr(peak.concurrent.futures, "ProcessPoolExecutor", _InProcess)
    threads, _ = peak.layout(4)
    share = {"tflops": fp8_tflops, "spread": 0.0, "rounds": [fp8_tflops] * 5, "refused": [], "size": 256, "threads": threads}
    monkeypatch.setattr(peak, "measure_share", lambda dtype, threads: dict(share))
    monkeypatch.setattr(peak, "check_round", lambda dtype, threads, n: {"float8": fp8_tflops, "float32": fp32_tflops}[dtype])
    cfg = compose(
        ["parallelism=dp2_tp2", "precision=fp8_tensorwise", "training.seq_len=128", f"cluster.peak_cache_dir={tmp_path / folder}"]
    )
    (tmp_path / folder).mkdir()
    pk = peak.write(cfg, 4, tmp_path / folder)
    built = SimpleNamespace(flops_per_token=flops.flops_per_token(cfg.model, cfg.training.seq_len), num_params=flops.num_params(cfg.model))
    return cfg, accounting.accounting(cfg, built, pk), pk


def test_a_cpu_whose_fp8_gemms_crawl_says_so_before_the_first_step(compose, tmp_path, monkeypatch):
    """FP8 250x slower than float32 (0.4 vs 100 GFLOP/s, as on the Intel machine that ran 400 ms GEMMs): one line with
    the slowdown and the step time the FLOPs per step take at each rate; 2x slower (this EPYC's ~2-4x): no line."""
    from runner.run import accounting

    cfg, acc, pk = _fp8_run(compose, tmp_path, monkeypatch, 0.0004, 0.1, "slow")
    assert pk["dtype"] == "float8" and pk["fp8_vs_fp32"]["slowdown"] == pytest.approx(250)
    step_flops = acc.flops_per_token * cfg.training.global_batch_size * 128
    fp8_s = step_flops / (0.0004e12 * peak.layout(4)[1])  # the node's FP8 rate: a share's rate x the shares at once
    line = accounting.slow_fp8(cfg, acc, pk)
    assert line.startswith("WARNING: this CPU runs FP8 GEMMs 250x slower than float32 (torch._scaled_mm 0.4 vs torch.mm 100 GFLOP/s")
    assert f"expect about {accounting._about(fp8_s)} s a step (an estimate: {step_flops / 1e9:.3g} GFLOP per step" in line
    assert line.endswith(f"precision=fp32 runs them in about {accounting._about(fp8_s / 250)} s") and "\n" not in line
    cached = json.loads(peak._cache_file(str(tmp_path / "slow"), "float8").read_text())[peak._cache_key(4)]
    assert cached["fp8_vs_fp32"] == pk["fp8_vs_fp32"]  # kept with the FP8 figure: the next run reads it
    assert accounting.slow_fp8(*_fp8_run(compose, tmp_path, monkeypatch, 0.05, 0.1, "fast")) is None
    fp32 = {"peak_tflops": 0.1, "peak_flops_total": 1e11, "peak_source": "measured", "dtype": "float32", "emulated": False}
    assert accounting.slow_fp8(cfg, acc, fp32 | {"peak_spread": 0.0}) is None  # not an FP8 run: nothing measured


CPU_PEAKS = {"float32": 0.175, "bfloat16": 0.02, "float8": 0.00014}
"""TFLOP/s per node, issue 54's Intel CPU: float32 GEMMs at 175 GFLOP/s, torch._scaled_mm's reference loop 0.14."""
STEP_FLOPS = 1.2471 * CPU_PEAKS["float8"] * 1e12
"""The model FLOP/s of its FP8 step, which printed `mfu 124.71%` against the float8 figure."""


def _cpu_precisions() -> list[str]:
    from runner.config.compose import CONF
    from runner.estimate import precision

    names = sorted(p.stem for p in (CONF / "precision").glob("*.yaml"))
    fp8 = {n: precision.RECIPES[precision.Fp8Recipe(n.removeprefix("fp8_"))] for n in names if n not in ("fp32", "bf16")}
    return [n for n in names if n not in fp8 or fp8[n].on_cpu != "rejected"]


@pytest.mark.parametrize("name", _cpu_precisions())
def test_mfu_is_at_most_one_on_every_cpu_precision(compose, name, tmp_path, monkeypatch):
    """MFU divides by param_dtype's peak for every precision, measured on CPU as the GEMMs' is (float32 beside an FP8
    recipe's float8 one, as a GPU run takes bf16's beside float8's); `mfu_of_gemm_peak` keeps the float8 figure."""
    from types import SimpleNamespace

    from runner.estimate import flops
    from runner.run import accounting

    def measured(cfg, dtype, ranks_per_node):
        one = {"tflops": CPU_PEAKS[dtype], "spread": 0.0, "rounds": [CPU_PEAKS[dtype]] * 5, "refused": []}
        return one | {"size": 512, "threads": 1, "shares": 1}

    monkeypatch.setattr(peak, "cpu_peak", measured)
    cfg = compose(["parallelism=single", f"precision={name}"])
    pk = peak.write(cfg, 1, tmp_path)
    fpt = flops.flops_per_token(cfg.model, cfg.training.seq_len, "titan")
    acc = accounting.accounting(cfg, SimpleNamespace(flops_per_token=fpt, num_params=flops.num_params(cfg.model)), pk)
    tokens = cfg.training.global_batch_size * cfg.training.seq_len
    row = accounting.row(1, 1.0, 1.0, tokens * fpt / STEP_FLOPS, 1e-3, cfg, acc, 0.0)
    assert pk["mfu_dtype"] == cfg.precision.param_dtype.value and pk["mfu_peak_tflops"] == CPU_PEAKS[pk["mfu_dtype"]]
    assert 0 < row["mfu"] <= 1 and row["mfu"] == pytest.approx(STEP_FLOPS / (CPU_PEAKS[pk["mfu_dtype"]] * 1e12))
    if pk["dtype"] == "float8":  # the GEMMs' own figure, beside
        assert row["mfu_of_gemm_peak"] == pytest.approx(1.2471)
        assert json.loads((tmp_path / "peak.json").read_text())["mfu_dtype"] == "float32"
