"""Real multi-rank training on CPU (gloo, ranks started by torch's elastic agent).

One session fixture trains every layout and FP8 recipe once, all in one Hydra multirun (each
launch would pay ~11 s of imports), and the tests read the run folders: loss parity with one
rank, frozen replay, MFU accounting, the files every run writes, W&B offline, activation
checkpointing, DCP checkpoints and FP8.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time

import pytest
import yaml

from tests.conftest import ROOT, metrics, run_cli, run_module, summary
from tests.multiruns import Lazy
from tests.points import FP8_RUNS, TRAIN
from tests.points import TRAIN_SHORT as SHORT

pytestmark = pytest.mark.e2e  # every test here starts processes

# Tolerances of the parity check: losses and grad norms agree to float32 reduction-order noise.
LOSS_ATOL = 1e-4
GRAD_NORM_RTOL = 1e-3


@pytest.fixture(scope="session")
def runs(shared_runs):
    """Every layout and FP8 recipe of this file (TRAIN in tests/points.py), trained in the session's Hydra multirun (W&B
    groups it by the sweep): runs[name] is the point's run folder, runs["_console"][name] its console; reading a point
    that failed fails the test that reads it."""
    consoles = Lazy(TRAIN, lambda name: shared_runs[name][1])
    return Lazy([*TRAIN, "_console"], lambda name: consoles if name == "_console" else shared_runs[name][0])


def test_default_command_trains_into_one_folder(tmp_path):
    """`python -m runner` with no arguments, from an empty folder, as a newcomer types it."""
    began = time.time()
    proc = run_cli(cwd=tmp_path)
    wall = time.time() - began
    assert proc.returncode == 0, proc.stderr[-3000:]
    made = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert len(made) == 1, made  # Hydra's outputs/<date>/<time>/, not one per rank
    assert sorted(p.name for p in made[0].iterdir() if not p.name.startswith(".")) == [
        "flight_recorder",  # made before the process group starts: NCCL's dump writer makes no folder
        "frozen.yaml",
        "goodput.json",
        "logs",
        "metrics.jsonl",
        "peak.json",
        "runner.log",
        "summary.json",
        "timeline.jsonl",
    ]
    rows, s = metrics(made[0]), summary(made[0])
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert all(r["tokens_per_s"] == pytest.approx(8 * 256 / r["step_time_s"]) for r in rows)
    assert (s["layout"], s["preset"], s["world_size"], s["degrees"]) == ("tp2_dp2", "dp2_tp2", 4, "dp_shard=2 x tp=2")
    assert sorted(p.name for p in (made[0] / "logs").rglob("stdout.log")) == ["stdout.log"] * 3  # ranks 1-3; rank 0 has the console
    assert "train" in proc.stdout and f"step   10  loss {rows[-1]['loss']:.4f}" in proc.stdout
    _one_line_per_step_off_a_terminal(proc.stdout, rows)
    _known_warnings_only_in_rank_logs(proc.stdout + proc.stderr, made[0] / "logs")
    _clean_run_goodput(made[0], rows, began, wall, proc.stdout)
    _runner_log_is_the_console(proc, made[0])


def _runner_log_is_the_console(proc, run_dir) -> None:
    """Issue 54: TorchTitan's INFO lines (root logger) stay off the console by default, in no other format, and runner.log
    is the console as printed, once (not Hydra's job log: those lines once per rank, none of the runner's)."""
    log = (run_dir / "runner.log").read_text().splitlines()
    out, err = proc.stdout.splitlines(), proc.stderr.splitlines()
    assert not [ln for ln in out + err if "][root][" in ln or "Building device mesh" in ln or "Applied FSDP" in ln]
    assert sorted(log) == sorted(out + err) and [ln for ln in log if ln in out] == out
    assert log[0].startswith("layout tp2_dp2: ") and sum(ln.startswith("step   10  loss ") for ln in log) == 1
    assert [ln for ln in log if ln.startswith("goodput: ")] == [ln for ln in out if ln.startswith("goodput: ")]
    rank_log = "".join(p.read_text() for p in (run_dir / "logs").rglob("stdout.log"))  # ranks 1-3 keep every line
    assert rank_log.count("INFO: Building device mesh with parallelism: ") == 3


def _clean_run_goodput(run_dir, rows: list[dict], began: float, wall: float, out: str) -> None:
    """goodput.json of a run without restarts: every part from its own records, under 2 % left unaccounted."""
    g = json.loads((run_dir / "goodput.json").read_text())
    parts = g["parts_s"]
    assert g["unaccounted_s"] == pytest.approx(g["total_s"] - sum(parts.values())) and g["unaccounted_s"] < 0.02 * g["total_s"], g
    assert g["total_s"] <= wall  # from the process start (after `began`) to rank 0's end record
    (launch,) = [json.loads(ln) for ln in (run_dir / "timeline.jsonl").read_text().splitlines() if '"launch"' in ln]
    assert launch["time"] >= began - 0.02  # the process's own start (10 ms ticks), not the task's
    assert parts["productive"] == pytest.approx(sum(r["step_time_s"] - r["data_s"] for r in rows))  # metrics.jsonl's steps
    assert (parts["lost"], parts["restart_gap"], parts["requeue_gap"], g["restarts"], g["repeated_steps"]) == (0, 0, 0, 0, 0)
    assert parts["startup"] > 0 and g["goodput"] == pytest.approx(parts["productive"] / g["total_s"])
    assert summary(run_dir)["goodput"] == {"fraction": g["goodput"], "total_s": g["total_s"]} | {f"{k}_s": v for k, v in parts.items()} | {
        k: g[k] for k in ("unaccounted_s", "restarts", "requeues", "repeated_steps")
    }
    (line,) = [ln for ln in out.splitlines() if ln.startswith("goodput: ")]
    assert line.startswith(f"goodput: {100 * g['goodput']:.1f} % ({parts['productive']:.2f} s productive of {g['total_s']:.2f} s")


def _one_line_per_step_off_a_terminal(out: str, rows: list[dict]) -> None:
    """stdout is a pipe here, as in SLURM and CI logs: rich would wrap at 80 columns, and must not."""
    steps = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert len(steps) == len(rows) and all(re.fullmatch(r"step +\d+  loss .*  step \d+\.\d\ds  mem \d+\.\d\dGB", ln) for ln in steps), steps
    (done,) = [ln for ln in out.splitlines() if ln.startswith("done: ")]
    assert re.search(r"median MFU .* of .* TFLOP/s \w+ \(measured, spread [\d.]+ %\)$", done), done  # the peak's dtype named
    (cal,) = [ln for ln in out.splitlines() if ln.startswith("plan check: step time")]
    # whole on one line, with a profile of this machine cached (the prediction beside the measured peak) or without
    with_profile = r"measured peak .* TFLOP/s per rank and all-reduce [\d.]+ GB/s$"
    without = r"step time measured [\d.]+ s; no prediction without a machine profile of this CPU: .* or set cluster.profile\)$"
    assert re.search(with_profile, cal) or re.search(without, cal), cal
    assert any(ln.startswith("runner: debugmodel") and "run folder " in ln for ln in out.splitlines())


KNOWN_WARNINGS = (  # runner.run.known_warnings: each fires once per run; none reaches the console
    "DTensor random operators may not have complete support on cpu device mesh",
    "While redistributing from (_NormPartial(2.0), _NormPartial(2.0)) to (Replicate(), Replicate()), 2 sequential all_reduce",
    "Calling register_constant() on Enum subclasses is deprecated",
)


def _known_warnings_only_in_rank_logs(console: str, logs) -> None:
    assert [w for w in KNOWN_WARNINGS if w in console] == []
    rank_logs = "".join(p.read_text() for p in logs.rglob("stderr.log"))  # ranks 1-3: everything kept
    assert [rank_logs.count(w) for w in KNOWN_WARNINGS[:2]] == [3, 3]  # the third fires in the launcher, before forking


@pytest.mark.parametrize("layout", ["dp2", "dp2_pp2", "dp2_tp2"])  # every preset: tests/test_parallel.py
def test_loss_parity_with_single_rank(runs, layout):
    ref, got = metrics(runs["single"]), metrics(runs[layout])
    assert [r["step"] for r in got] == [1, 2, 3]
    for a, b in zip(ref, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=LOSS_ATOL), (layout, a["step"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=GRAD_NORM_RTOL), (layout, a["step"])
    assert 7.0 < ref[0]["loss"] < 9.0  # ~ln(2048) = 7.62 at initialization


def test_frozen_replay_reproduces_losses_exactly(runs, tmp_path):
    original = runs["dp2"]  # two ranks: the cheapest multi-rank run to replay
    frozen = (original / "frozen.yaml").read_text()
    assert "${" not in frozen  # fully resolved
    body = yaml.safe_load(frozen)
    assert body["training"]["steps"] == 3 and body["parallelism"]["name"] == "dp2"
    prov = body["provenance"]
    assert prov["torch_version"].startswith("2.13.0") and prov["torchtitan_version"] == "0.3.0"
    assert (prov["world_size"], prov["layout"], prov["seed"]) == (2, "dp_replicate=2", 0)
    assert prov["git_commit"] != ""
    replay = tmp_path / "replay"
    proc = run_cli("--config-dir", str(original), "--config-name", "frozen", run_dir=replay)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = metrics(original), metrics(replay)
    assert [(r["loss"], r["grad_norm"]) for r in a] == [(r["loss"], r["grad_norm"]) for r in b]
    assert yaml.safe_load((replay / "frozen.yaml").read_text())["provenance"]["replay_of"] == str(original.resolve())


def test_metrics_and_summary_accounting(runs):
    run_dir = runs["dp2_tp2"]
    rows, s = metrics(run_dir), summary(run_dir)
    peak = json.loads((run_dir / "peak.json").read_text())
    assert peak["peak_source"] == "measured" and peak["dtype"] == "float32" and peak["peak_tflops"] > 0
    assert (s["peak_source"], s["peak_tflops"], s["world_size"], s["layout"]) == ("measured", peak["peak_tflops"], 4, "tp2_dp2")
    assert s["flops_per_token"] == 6 * (6_163_712 - 2048 * 256) + 6 * 6 * 16 * 32 * 64  # TorchTitan's convention at seq 64
    for r in rows:
        assert set(r) >= {"step", "loss", "tokens_per_s", "mfu", "grad_norm", "step_time_s"}
        assert r["tokens_per_s"] == pytest.approx(8 * 64 / r["step_time_s"])
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * s["flops_per_token"] / (peak["peak_tflops"] * 1e12))
        assert r["mfu_6n"] == pytest.approx(r["tokens_per_s"] * 6 * 6_163_712 / (peak["peak_tflops"] * 1e12))
    steady = sorted(r["mfu"] for r in rows[1:])
    assert s["mfu_median"] == pytest.approx((steady[0] + steady[1]) / 2)
    assert s["final_loss"] == rows[-1]["loss"]
    console = runs["_console"]["dp2_tp2"]
    assert "layout tp2_dp2 [dp_shard=2 x tp=2], 4 ranks" in console
    words = " ".join(console.split())  # rich wraps the header at the console width
    assert f"float32 (measured, spread {100 * peak['peak_spread']:.1f} %)" in words and s["peak_spread"] == peak["peak_spread"]
    assert f"step    3  loss {rows[-1]['loss']:.4f}" in console


def test_hfu_logged_with_activation_checkpointing(runs):
    rows = metrics(runs["dp2"])
    assert all(r["hfu"] == pytest.approx(r["mfu"] * 4 / 3) for r in rows)
    assert "hfu_median" in summary(runs["dp2"])
    assert "hfu" not in metrics(runs["single"])[0]


def test_dcp_checkpoints_written_at_interval_and_end(runs):
    ckpts = runs["dp2_pp2"] / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-2", "step-3"]
    assert (ckpts / "step-3" / ".metadata").is_file()
    assert len(list((ckpts / "step-3").glob("*.distcp"))) == 4  # one shard file per rank


def test_wandb_offline_run(runs):
    offline = list((runs["single"] / "wandb").glob("offline-run-*"))
    assert len(offline) == 1
    (record,) = offline[0].glob("run-*.wandb")  # protobuf records; history values are stored as JSON text
    blob = record.read_bytes()
    for r in metrics(runs["single"]):
        for key in ("loss", "mfu", "grad_norm", "memory_gb", "step_time_s"):
            assert json.dumps(r[key]).encode() in blob, (key, r[key])
    assert b"tokens_per_s_median" in blob  # summary logged
    g = json.loads((runs["single"] / "goodput.json").read_text())  # its parts as flat summary keys, with their values
    for key, value in [("fraction", g["goodput"]), ("total_s", g["total_s"])] + [(f"{k}_s", v) for k, v in g["parts_s"].items()]:
        got = re.search(re.escape(f"goodput/{key}".encode()) + rb"\x82\x01.([0-9.eE+-]+)", blob, re.S)  # key, then value as JSON text
        assert got is not None and float(got.group(1)) == pytest.approx(value, rel=1e-12), (key, value)
    assert re.search(rb'parallelism[^{]{1,8}\{"name":"single",', blob) and b'{"name":"dp2_tp2"' not in blob  # the config is this run's
    assert str(runs["single"].parent.resolve()).encode() in blob  # grouped by the Hydra sweep folder's full path
    assert yaml.safe_load((runs["single"] / "frozen.yaml").read_text())["logging"]["wandb"]["group"] is None  # not frozen
    assert "step    3  loss" in (offline[0] / "files" / "output.log").read_text()
    traced = json.loads((runs["single"] / "profile" / "breakdown.json").read_text())["ranks"]["0"]["2"]["terms_s"]
    for term in ("compute", "non_matmul", "overhead"):  # step 2's breakdown, logged at step 2
        assert f"breakdown/{term}_s".encode() in blob and json.dumps(traced[term]).encode() in blob, term


def test_bf16_runs_on_cpu(runs):
    s = summary(runs["bf16"])
    assert (s["peak_dtype"], s["peak_source"], s["steps"]) == ("bfloat16", "measured", 2)
    assert 7.0 < s["final_loss"] < 9.0


def test_memory_logged_per_step(runs):
    rows, s = metrics(runs["dp2_tp2"]), summary(runs["dp2_tp2"])
    assert all(0.3 < r["memory_gb"] < 4 for r in rows)  # a rank with torch + TorchTitan loaded: ~0.6 GB resident
    assert [r["memory_gb"] for r in rows] == sorted(r["memory_gb"] for r in rows)  # a running peak
    assert s["memory_gb_max"] >= rows[-1]["memory_gb"]


def test_calibration_sets_prediction_beside_measurement(runs):
    cal = summary(runs["dp2_pp2"])["plan_check"]
    assert cal["bubble_predicted"] == pytest.approx(1 / 3)  # p=2, m = 8 / (dp 2 x microbatch 2) = 2
    assert 0 < cal["bubble_measured"] < 1
    assert cal["allreduce_gbs_per_direction"] > 0 and cal["peak_tflops_per_rank"] > 0
    assert cal["step_time_measured_s"] == summary(runs["dp2_pp2"])["step_time_s_median"]
    out = runs["_console"]["dp2_pp2"]
    assert "plan check: pipeline bubble predicted 33.3 %, measured idle" in out
    words = " ".join(out.split())  # the console may wrap a long line at its width
    if cal["profile_from"] == "cache":  # python -m runner.calibrate ran on this machine: its newest profile predicts
        assert cal["prediction_source"] == cal["profile"] and f"{cal['profile']} (the newest cached profile of this machine)" in words
        assert cal["step_time_ratio"] == pytest.approx(cal["step_time_measured_s"] / cal["step_time_predicted_s"])
    else:  # no profile of this CPU: no datasheet number, a line saying how to make one
        assert (cal["profile_from"], cal["step_time_predicted_s"], cal["prediction_source"]) == ("none", None, None)
        measured = f"plan check: step time measured {cal['step_time_measured_s']:.3f} s; no prediction without a machine profile"
        assert f"{measured} of this CPU: make one with `python -m runner.calibrate`" in words
        assert "datasheet, not calibrated" not in words
    assert summary(runs["dp2_tp2"])["plan_check"]["tp_comm_predicted_s"] > 0
    assert summary(runs["dp2_tp2"])["plan_check"]["bubble_measured"] is None  # no pipeline


def test_compare_measured_runs_by_step_time(runs, tmp_path):
    names = ["dp2", "dp2_pp2", "dp2_tp2", "fp8_blockwise"]
    png = tmp_path / "mfu.png"
    proc = run_module("runner.compare", *(runs[n] for n in names), "--plot", png, timeout=60)
    assert proc.returncode == 0, proc.stderr
    table = [ln for ln in proc.stdout.splitlines() if ln.startswith("│") and "measured" in ln]
    assert len(table) == 4
    times = sorted(summary(runs[n])["step_time_s_median"] for n in names)
    assert [float(ln.split("│")[7].split()[0]) for ln in table] == [pytest.approx(t, abs=5e-4) for t in times]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_simulated_nodes_train_like_one(runs, tmp_path):
    """Two per-node launchers (torchrun agents) with a c10d rendezvous on 127.0.0.1, 2 ranks
    each: TP inside each simulated node, FSDP across them; the same losses as one node."""
    run_dir = tmp_path / "two_nodes"
    nodes = ["cluster.num_nodes=2", "cluster.devices_per_node=2", "cluster.rdzv_host=127.0.0.1", f"cluster.rdzv_port={_free_port()}"]
    plan = run_cli(*SHORT, *nodes, "mode=launch_plan", run_dir=run_dir)
    assert plan.returncode == 0, plan.stderr
    (command,) = [ln.strip() for ln in plan.stdout.splitlines() if "runner.launch" in ln]
    argv = [sys.executable, *shlex.split(command)[1:]]
    agents = [
        subprocess.Popen(
            argv, cwd=ROOT, env={**os.environ, "RUNNER_NODE_NAME": f"node{i}"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for i in range(2)
    ]
    outs = [a.communicate(timeout=600)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    console = next(o for o in outs if "nodes:" in o)
    assert "nodes: node0 ranks [0, 1]; node1 ranks [2, 3]" in console or "nodes: node1 ranks [0, 1]; node0 ranks [2, 3]" in console
    got, ref = metrics(run_dir), metrics(runs["dp2_tp2"])
    assert [r["loss"] for r in got] == [pytest.approx(r["loss"], abs=LOSS_ATOL) for r in ref]
    assert summary(run_dir)["world_size"] == 4


def test_round_robin_placement_refuses_to_train(tmp_path):
    """A launcher that deals ranks to nodes round-robin splits every TP group over two nodes."""
    env = {**os.environ, "RUNNER_NODE_NAMES": "node0,node1"}
    # also the exec start (a fresh interpreter per rank, as on a GPU node); the other local runs fork
    proc = run_cli(*SHORT, "parallelism=tp2", "cluster.worker_start=exec", run_dir=tmp_path / "rr", env=env)
    assert proc.returncode == 1
    assert "refusing to train: ranks are placed so that tensor-parallel groups cross nodes" in proc.stderr
    assert "TP group [0, 1] spans 2 nodes: rank 0 on node0 (local rank 0), rank 1 on node1 (local rank 1)" in proc.stderr
    assert "with srun use --distribution=block" in proc.stderr
    assert not (tmp_path / "rr" / "metrics.jsonl").exists()


def test_submitit_local_sweep_through_the_hydra_launcher(tmp_path):
    """hydra-submitit-launcher's local executor runs a two-layout sweep end to end."""
    sweep = tmp_path / "sweep"
    sweep_args = ["-m", "hydra/launcher=submitit_local", "parallelism=single,dp2", "training.steps=2", "training.seq_len=64"]
    proc = run_cli(*sweep_args, f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    layouts = {}
    for job in ("0", "1"):
        frozen = yaml.safe_load((sweep / job / "frozen.yaml").read_text())
        layouts[frozen["parallelism"]["name"]] = summary(sweep / job)
    assert sorted(layouts) == ["dp2", "single"]
    assert layouts["dp2"]["world_size"] == 2 and layouts["dp2"]["steps"] == 2
    assert len(list((sweep / ".submitit").glob("*/*_result.pkl"))) == 2  # each point ran as a submitit job


# FP8 recipes on dp2_tp2 against the fp32 run of the same shape (fp8_ref), 2 steps. torchao's recipes run CPU
# _scaled_mm, which costs 2x fp32 on one machine and 250x on another (a reference loop), so they train 16 tokens
# per rank and step (2 samples of 16 in microbatches of 1 over dp 2; 16 is the smallest GEMM side _scaled_mm takes):
# 32x fewer than the layouts' default batch.
# Measured |loss - fp32 loss| was at most 1.2e-4 per step at the default batch (512 tokens a step) and up to 1.1e-3
# (rowwise, step 2) at the small shape's 32: the loss averages the e4m3 rounding over 16x fewer tokens. The tolerances
# leave ~3x over what each shape measured, and a delta of exactly 0 would mean nothing was quantized. The runs: FP8_RUNS in
# tests/points.py.
FP8_REF = {"fp8_tensorwise": "fp8_ref", "fp8_rowwise": "fp8_ref"}
"""The fp32 run each FP8 run is compared with (dp2_tp2, the default, unless named)."""
FP8_LOSS_ATOL = {"fp8_tensorwise": 3e-3, "fp8_rowwise": 3e-3}
"""Per FP8 run (the small shape's); the default batch's runs allow FP8_LOSS_ATOL_DEFAULT."""
FP8_LOSS_ATOL_DEFAULT = 1e-3
FP8_GRAD_NORM_RTOL = 2e-3  # measured: 2e-4


@pytest.mark.parametrize("name", list(FP8_RUNS))
def test_fp8_loss_within_tolerance_of_fp32(runs, name):
    ref, got = metrics(runs[FP8_REF.get(name, "dp2_tp2")])[:2], metrics(runs[name])
    deltas = [abs(a["loss"] - b["loss"]) for a, b in zip(ref, got, strict=True)]
    assert len(deltas) == 2 and 0 < max(deltas) < FP8_LOSS_ATOL.get(name, FP8_LOSS_ATOL_DEFAULT), deltas
    for a, b in zip(ref, got, strict=True):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=FP8_GRAD_NORM_RTOL)


def test_fp8_converted_layers_and_accounting(runs):
    for name in FP8_RUNS:
        run_dir, console = runs[name], " ".join(runs["_console"][name].split())  # undo rich's line wrapping
        rec = json.loads((run_dir / "precision.json").read_text())
        assert len(rec["converted"]) == 30 and rec["kept_high_precision"] == {"lm_head": "lm_head"}
        assert not any(k in fqn for fqn in rec["converted"] for k in ("embed", "lm_head", "router", "norm")), rec["converted"]
        assert "converted 30 Linear layers (layers.*.attention.qkv_linear.wqkv x6" in console
        s, peak = summary(run_dir), json.loads((run_dir / "peak.json").read_text())
        emulated = name.startswith("fp8_blockwise")
        assert (s["peak_dtype"], s["fp8_emulated"], rec["emulated"]) == ("float32" if emulated else "float8", emulated, emulated)
        assert ("EMULATED in PyTorch ops" in console) == emulated
        assert ("square torch.mm " if emulated else "square torch._scaled_mm (e4m3) ") in peak["method"], peak["method"]
        assert peak["mfu_dtype"] == "float32"  # MFU against param_dtype's peak, as a GPU's against bf16's (issue 54)
        for r in metrics(run_dir):
            work = r["tokens_per_s"] * s["flops_per_token"]
            assert r["mfu"] == pytest.approx(work / (peak["mfu_peak_tflops"] * 1e12)) and 0 < r["mfu"] <= 1
            assert r["mfu_of_gemm_peak"] == pytest.approx(work / (peak["peak_tflops"] * 1e12))  # the GEMMs' own peak
    assert summary(runs["fp8_blockwise_tp2_pp2"])["degrees"] == "pp=2 x tp=2"


def test_a_tp2_pp2_step_traced_and_split_by_term(runs):
    """profile.steps=[2] on the multirun's tp2_pp2 point: traces of rank 0 and of stage 1's first rank, each step's
    ProfilerStep span the step metrics.jsonl reports, a breakdown whose unattributed remainder is small, the console
    lines, and runner.compare over the sweep showing the breakdown per traced layout."""
    from runner.outputs import breakdown, comparison

    run_dir, console = runs["fp8_blockwise_tp2_pp2"], " ".join(runs["_console"]["fp8_blockwise_tp2_pp2"].split())
    rows = metrics(run_dir)
    assert [r.get("profiled") for r in rows] == [True, True]  # step 1 warmed the profiler up, step 2 was traced
    assert sorted(p.relative_to(run_dir).as_posix() for p in (run_dir / "profile").rglob("*.gz")) == [
        "profile/rank_0/step_2.json.gz",
        "profile/rank_2/step_2.json.gz",
    ]
    rank0 = breakdown.steps(breakdown.load(run_dir / "profile" / "rank_0" / "step_2.json.gz"))[2]
    assert rank0["step_s"] == pytest.approx(rows[1]["step_time_s"], rel=0.05)  # metrics.jsonl's rows are rank 0's
    b = json.loads((run_dir / "profile" / "breakdown.json").read_text())
    assert b["step_s"] == pytest.approx(b["step_time_s_metrics"], rel=0.05)  # the busiest rank's span and its own step time
    assert sum(b["terms_s"].values()) == pytest.approx(b["step_s"], rel=1e-6)
    assert b["unattributed_share"] < 0.15, b["ranks"]
    assert min(b["terms_s"][k] for k in ("compute", "non_matmul", "overhead", "tp", "bubble")) > 0, b["terms_s"]
    assert b["terms_s"]["cp"] == b["terms_s"]["ep"] == b["terms_s"]["recompute"] == 0.0  # no CP, no experts, no AC here
    assert "profile: tracing steps 2 on ranks 0, 2 into" in console and "https://ui.perfetto.dev (or chrome://tracing)" in console
    # beside the prediction when a profile of this machine is cached, the measured terms alone without one
    by_term = r"plan check by term, (measured/predicted s \(ratio\)|measured s \(no prediction without a machine profile\)); "
    assert re.search(by_term + f"busiest traced rank {b['busiest_rank']}, steps \\[2\\], ", console), console[-2000:]
    assert summary(run_dir)["steps_profiled"] == 2
    assert "profile.memory: allocator snapshots are CUDA-only" in " ".join(runs["_console"]["single"].split())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert comparison.main([str(run_dir.parent), "--plot", str(run_dir.parent / "comparison.png")]) == 0
    by_term = out.getvalue().split("where the step time goes")[1]
    traced = [ln.split("│")[2].strip() for ln in by_term.splitlines() if ln.startswith("│ ")]
    assert sorted(traced) == ["pp=2 x tp=2", "single rank"], traced  # the two traced points, and no other


def test_runner_collectives_follow_the_device_policy(runs):
    """With host collectives on a group of their own (how CUDA runs them: NCCL rejects CPU tensors), every
    collective the runner's own modules issue goes through the device policy onto that group with CPU tensors;
    the exceptions are the bandwidth probe, which measures the model's links on the default group, and the per-block
    statistics, which reduce device tensors on the default group (the step's one host read takes their result)."""
    probe = "runner/observe/plan_check.py:allreduce_gbs"
    layers = "runner/observe/layer_stats.py:gather"
    want = {
        "runner/run/mesh.py:places",
        "runner/run/loader.py:check_inputs",
        "runner/run/step_sync.py:exchange",  # the step's one host collective: loss, data digest, stop flag
        "runner/run/train.py:summary",
        "runner/observe/monitor.py:__init__",
        "runner/observe/monitor.py:_judge",
        "runner/observe/plan_check.py:mean_over_ranks",
        probe,
        layers,
    }
    for rank in range(4):
        calls = json.loads((runs["dp2_pp2"] / "logs" / "collectives" / f"rank_{rank}.json").read_text())
        direct = [c for c in calls if not c["via_policy"]]
        assert {c["caller"] for c in direct} == {probe, layers}, direct
        assert all(c["op"] == "all_reduce" and c["group"] == "default" for c in direct), direct
        host = [c for c in calls if c["via_policy"]]
        assert [c for c in host if c["group"] != "host" or c["devices"] not in ([], ["cpu"])] == []
        assert {c["caller"] for c in calls} == want, rank


def _interrupt_after(*marks: str):
    """A `while_running` for run_cli: SIGINT to the command's process group, as Ctrl-C in a terminal sends it, once its
    stdout holds every one of `marks`."""
    import signal

    def interrupt(pid: int, stdout) -> None:
        deadline = time.monotonic() + 120
        while not (stdout.is_file() and all(m in stdout.read_text() for m in marks)) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(pid, signal.SIGINT)

    return interrupt


def test_ctrl_c_says_where_the_run_stopped_and_how_to_resume(tmp_path):
    """Ctrl-C once step 1 is logged: exit 130 with one line (the step reached, the command that resumes from the newest
    checkpoint, here the local tier's: a restart by hand resumes from it, tests/test_local_checkpoint.py), no failure
    (no failed.json, no torch-elastic death-signal warnings, no traceback)."""
    run_dir, local = tmp_path / "run", tmp_path / "local"
    args = ["parallelism=single", "training.steps=200", "training.seq_len=64", "logging.progress=false", "+cluster.peak_tflops.float32=1"]
    ckpt = ["checkpoint=local", "checkpoint.interval=100", "checkpoint.async_save=false", f"checkpoint.local.folder={local}"]
    proc = run_cli(*args, *ckpt, "checkpoint.local.interval=1", run_dir=run_dir, while_running=_interrupt_after("step    1 "))
    assert proc.returncode == 130, proc.stderr[-3000:]
    last = max(row["step"] for row in metrics(run_dir))
    (root,) = local.iterdir()
    newest = max(int(p.name.removeprefix("step-")) for p in root.glob("step-*") if (p / "rank-0").is_dir())
    line = proc.stderr.strip().splitlines()[-1]
    assert line == (
        f"interrupted at step {last}; resume from step {newest} with: python -m runner --config-dir {run_dir} "
        f"--config-name frozen checkpoint.resume=true checkpoint.folder={run_dir / 'checkpoints'}"
    )
    assert 1 <= newest <= last and "death signal" not in proc.stderr and "SIGINT" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (run_dir / "failed.json").exists()
