"""mode=plan: the step budget reproduces the worked 70B / 1,024-GPU example and its two
variants; sweeps record invalid points; runner.outputs.comparison tables and plots runs."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.conftest import ROOT, run_cli, run_module

SEED = ["recipe=llama3_70b_h100x1024"]
REQUIRED_KEYS = (
    "tokens_per_step microbatches bubble_fraction weights_grads_gb_per_gpu optimizer_gb_per_gpu activations_gb_per_gpu "
    "step_time_s tp_comm_s dp_comm_s pp_comm_s mfu_assumed fits_memory"
).split()


def test_worked_example_reproduces_the_published_budget(budget):
    b = budget(SEED)
    assert b["params"] == pytest.approx(70.6e9, rel=0.001)
    assert b["tokens_per_step"] == 4_194_304
    assert b["microbatches"] == 32
    assert b["weights_grads_gb_per_gpu_worked_example"] == pytest.approx(
        70.553706496e9 / 32 * 2 * 2 / 1e9
    )  # bf16 weights + grads, worked example
    assert b["weights_grads_gb_per_gpu_worked_example"] < 10
    assert b["optimizer_gb_per_gpu_worked_example"] == pytest.approx(70.553706496e9 / 32 * 12 / 32 / 1e9)  # 12 B/param over DP=32
    assert b["optimizer_gb_per_gpu_worked_example"] < 1
    assert b["step_time_s"] == pytest.approx(4.35, rel=0.02)  # 6N at 40 % of 989 TFLOP/s
    assert b["flops_convention"] == "6N" and b["peak_tflops"] == 989.0
    assert b["tp_comm_gb"] == pytest.approx(300.6, abs=0.1)
    assert b["tp_comm_s"] == pytest.approx(0.67, abs=0.005)  # at 450 GB/s: NVLink 900 aggregate, one direction
    assert b["tp_comm_share"] == pytest.approx(0.15, abs=0.005)
    assert b["bubble_fraction"] == pytest.approx(3 / 35) and round(100 * b["bubble_fraction"], 1) == 8.6
    assert b["fits_memory"] is True and b["dp_hidden_behind_backward"] is True
    assert b["links"] == {"pp": "scale-out", "dp_shard": "scale-out", "tp": "intra-node"}


def test_worked_example_convention_is_named_and_the_two_tp_shares_say_what_of(budget, tmp_path):
    """The worked example's budget convention replaces "seed's convention" (and keys ending `_seed`): one row of the
    table says what it is; plan.json still carries the old key names, equal, for one release. The two TP figures each
    say what they are a share of: the step time at the assumed MFU, and the bottom-up estimate."""
    from runner.estimate import plan

    b = budget(SEED)
    rows = plan.rows(b)
    assert not any("seed" in " ".join(r) for r in rows) and not any(k.endswith("_seed") for k in b)
    notes = {name: note for name, _, note in rows}
    assert notes["memory"] == (
        "as TorchTitan allocates it; 'worked example' rows: the worked example's budget convention (training-dtype gradients, "
        "Korthikanti activations)"
    )
    assert [value for name, value, _ in rows if name == "  worked example"] == ["8.82 GB", "0.827 GB", "2.85 GB", "21.1 GB"]
    assert notes["TP traffic"] == f"300.6 GB, {100 * b['tp_comm_share']:.1f} % of the step time at 40 % MFU"
    share = 100 * b["predicted_terms_s"]["tp"] / b["estimated_step_time_s"]
    assert f"; shares of this estimate: compute 59 %, tp {share:.0f} %, non_matmul 13 %; " in notes["bottom-up step estimate"]
    saved = json.loads(plan.write(b, tmp_path).read_text())
    assert saved["renamed_keys"]["total_gb_per_gpu_seed"] == "total_gb_per_gpu_worked_example"
    assert saved["renamed_keys"]["fits_memory_seed"] == "fits_memory_worked_example" and len(saved["renamed_keys"]) == 7
    assert all(saved[old] == saved[new] == b[new] for old, new in saved["renamed_keys"].items())


def test_pp8_halves_weights_and_raises_bubble_to_9_9_percent(budget):
    base, b = budget(SEED), budget([*SEED, "parallelism.pp=8"])
    assert (b["degrees"], b["microbatches"]) == ("pp=8 x dp_shard=16 x tp=8", 64)
    assert b["weights_grads_gb_per_gpu_worked_example"] == pytest.approx(base["weights_grads_gb_per_gpu_worked_example"] / 2)
    assert b["bubble_fraction"] == pytest.approx(7 / 71) and round(100 * b["bubble_fraction"], 1) == 9.9


def test_tp4_cuts_tp_traffic_doubles_weights_and_bubble_16_percent(budget):
    base, b = budget(SEED), budget([*SEED, "parallelism.tp=4"])
    assert (b["degrees"], b["microbatches"]) == ("pp=4 x dp_shard=64 x tp=4", 16)
    assert b["tp_comm_s"] == pytest.approx(0.29, abs=0.005)
    assert b["weights_grads_gb_per_gpu_worked_example"] == pytest.approx(2 * base["weights_grads_gb_per_gpu_worked_example"])
    assert b["bubble_fraction"] == pytest.approx(3 / 19) and round(100 * b["bubble_fraction"]) == 16


def test_worked_example_activation_memory_follows_korthikanti(budget):
    sbh = 4096 * 1 * 8192
    with_sp = budget(SEED)
    assert with_sp["activations_gb_per_microbatch_worked_example"] == pytest.approx(20 * sbh * 34 / 8 / 1e9)
    assert with_sp["activations_gb_per_microbatch_recompute_worked_example"] == pytest.approx(20 * 2 * sbh / 8 / 1e9)
    assert with_sp["microbatches_in_flight"] == 4  # 1F1B: the first stage holds p microbatches
    assert with_sp["activations_gb_per_gpu_worked_example"] == pytest.approx(4 * with_sp["activations_gb_per_microbatch_worked_example"])
    no_sp = budget([*SEED, "parallelism.sequence_parallel=false"])
    assert no_sp["activations_gb_per_microbatch_worked_example"] == pytest.approx(20 * sbh * (10 + 24 / 8) / 1e9)
    ac = budget([*SEED, "training.activation_checkpoint=full"])
    assert ac["activations_gb_per_gpu_worked_example"] == pytest.approx(
        4 * with_sp["activations_gb_per_microbatch_recompute_worked_example"]
    )
    assert ac["tp_comm_gb"] == pytest.approx(with_sp["tp_comm_gb"] * 6 / 4)  # the recomputed forward repeats 2 all-reduces


def test_interleaved_bubble_and_sharded_weights_without_pp(budget):
    b = budget([*SEED, "parallelism.pp_schedule=Interleaved1F1B", "parallelism.pp_virtual_stages=2"])
    assert b["bubble_fraction"] == pytest.approx(3 / (2 * 32 + 3))
    assert b["bubble_formula"].startswith("(p-1)/(v*m+p-1) = 3/67")
    fsdp = budget(
        [
            "model=llama3_8b",
            "parallelism=fsdp",
            "precision=bf16",
            "cluster=h100_node",
            "training.global_batch_size=8",
            "training.microbatch_size=1",
        ]
    )
    n = 8.030261248e9
    layer = (4096 * 128 * (32 + 2 * 8) + 32 * 128 * 4096 + 3 * 4096 * 14336 + 2 * 4096) * 4  # two gathered bf16 blocks
    assert fsdp["weights_gathered_during_step"] is False  # no PP: TorchTitan reshards after forward
    assert fsdp["weights_grads_gb_per_gpu_worked_example"] == pytest.approx((n * 4 / 8 + layer) / 1e9, rel=1e-3)
    assert fsdp["dp_comm_gb"] == pytest.approx(n * (2 * 2 + 4) * 7 / 8 / 1e9, rel=1e-3)  # AG fwd + bwd (bf16), RS (fp32)


def test_fp8_blockwise_plans_mfu_against_bf16_and_the_gemms_against_float8(budget):
    """MFU and the assumed-MFU step use the bf16 peak whatever the GEMMs' dtype (comparable across precisions);
    mfu_of_gemm_peak the float8 one. The bottom-up estimate prices the FP8 model: faster than bf16, slower than the
    float8 peak's 2x, with its cast kernels."""
    bf16, fp8 = budget(SEED), budget([*SEED, "precision=fp8_blockwise"])
    assert (fp8["peak_dtype"], fp8["peak_tflops"]) == ("bfloat16", 989.0)
    assert (fp8["gemm_peak_dtype"], fp8["gemm_peak_tflops"]) == ("float8", 1979.0)
    assert fp8["step_time_s"] == pytest.approx(bf16["step_time_s"])  # 40 % of the bf16 peak, FP8 or not
    assert fp8["estimated_mfu_of_gemm_peak"] == pytest.approx(fp8["estimated_mfu"] * 989 / 1979)
    assert fp8["estimated_step_time_s"] > bf16["estimated_step_time_s"] / 2  # the FP8 model, not twice the peak
    assert fp8["predicted_terms_s"]["fp8_cast"] > 0 and bf16["predicted_terms_s"]["fp8_cast"] == 0
    assert fp8["weights_grads_gb_per_gpu"] == bf16["weights_grads_gb_per_gpu"]  # FP8 only in the GEMMs


def test_checkpoint_interval_is_young_daly(budget):
    b = budget(SEED)
    write_s = 70.553706496e9 * 12 / 100e9
    assert b["checkpoint_write_s"] == pytest.approx(write_s)
    assert b["checkpoint_interval_s"] == pytest.approx(math.sqrt(2 * write_s * 49.5 * 3600))
    assert b["checkpoint_interval_steps"] == round(b["checkpoint_interval_s"] / b["step_time_s"])


def test_titan_convention_on_request(budget):
    b = budget([*SEED, "plan.flops_convention=titan"])
    assert b["flops_per_token"] == budget(SEED)["flops_per_token_titan"] > budget(SEED)["flops_per_token"]
    assert b["flops_per_token_6N"] == 6 * b["params"]


@pytest.mark.e2e
def test_plan_cli_writes_plan_json_without_torch(tmp_path):
    run_dir = tmp_path / "plan"
    code = (
        f"import sys; sys.argv = ['runner', 'recipe=llama3_70b_h100x1024', 'mode=plan', 'hydra.run.dir={run_dir}']\n"
        "import runpy\ntry:\n    runpy.run_module('runner', run_name='__main__')\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('TORCH_LOADED', 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "TORCH_LOADED False" in out.stdout
    assert "│ pipeline bubble             │ 8.6 %" in out.stdout and "DOES NOT FIT" not in out.stdout
    written = json.loads((run_dir / "plan.json").read_text())
    assert set(REQUIRED_KEYS) <= set(written)
    assert written["tokens_per_step"] == 4_194_304 and written["overrides"] == ["recipe=llama3_70b_h100x1024", "mode=plan"]
    assert "mode: plan" in (run_dir / "frozen.yaml").read_text()


@pytest.mark.e2e
def test_plan_warns_when_memory_does_not_fit(tmp_path):
    proc = run_cli(
        *SEED, "mode=plan", "parallelism.pp=1", "parallelism.tp=1", "parallelism.fsdp_reshard_after_forward=never", run_dir=tmp_path / "p"
    )
    assert proc.returncode == 0, proc.stderr
    written = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert written["fits_memory"] is False and written["total_gb_per_gpu"] > 80
    assert "DOES NOT FIT in 80 GB" in proc.stdout


@pytest.mark.e2e
def test_sweep_records_invalid_points_and_compare_tables_them(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli("-m", *SEED, "mode=plan", "parallelism.tp=4,16", f"hydra.sweep.dir={sweep_dir}")
    assert proc.returncode == 0, proc.stderr
    assert "invalid sweep point recipe=llama3_70b_h100x1024 mode=plan parallelism.tp=16:" in proc.stderr
    assert "Traceback" not in proc.stderr
    invalid = json.loads((sweep_dir / "1" / "invalid.json").read_text())
    assert invalid["overrides"] == [*SEED, "mode=plan", "parallelism.tp=16"]
    assert any(p.startswith("parallelism.tp = 16: must divide model.num_heads = 64") for p in invalid["problems"])
    assert json.loads((sweep_dir / "0" / "plan.json").read_text())["microbatches"] == 16

    out = run_module("runner.compare", sweep_dir, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    (valid,) = [ln for ln in lines if ln.startswith("│ tp=4 ")]  # labelled by what differs between the points
    assert "pp=4 x dp_shard=64 x tp=4" in valid and "15.8 %" in valid and "plan" in valid
    assert any(ln.startswith("│ tp=16 ") and "invalid" in ln for ln in lines)
    png = sweep_dir / "comparison.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


@pytest.mark.e2e
def test_compare_rejects_a_folder_without_runs(tmp_path):
    out = run_module("runner.compare", tmp_path, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"paths = {tmp_path}: no run folder below them holds summary.json, plan.json, invalid.json or failed.json" in out.stderr


def test_sweeper_composes_one_point_per_new_override_value():
    """Hydra's basic sweeper composes all 20 points before running them; ours the 8 that bring a new value."""
    from types import SimpleNamespace

    from hydra_plugins.runner_sweeper import RunnerSweeper

    composed = []
    sweeper = RunnerSweeper(max_batch_size=None)
    sweeper.config = SimpleNamespace()
    sweeper.hydra_context = SimpleNamespace(
        config_loader=SimpleNamespace(load_sweep_config=lambda master_config, sweep_overrides: composed.append(sweep_overrides))
    )
    sweeper.validate_batch_is_legal([[f"tp={t}", f"pp={p}"] for t in (1, 2, 4, 8) for p in (1, 2, 4, 8, 16)])
    assert composed == [["tp=1", f"pp={p}"] for p in (1, 2, 4, 8, 16)] + [[f"tp={t}", "pp=1"] for t in (2, 4, 8)]


@pytest.mark.e2e
def test_bad_sweep_value_fails_before_any_point_runs(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli("-m", *SEED, "mode=plan", "parallelism.tp=4,8,x", f"hydra.sweep.dir={sweep_dir}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "parallelism.tp = x: not an integer (override parallelism.tp=x). Fix: use an integer, e.g. parallelism.tp=1." in proc.stderr
    assert not list(sweep_dir.glob("*/plan.json"))


@pytest.mark.e2e
def test_sweep_file_still_runs_as_a_multirun(tmp_path):
    proc = run_cli("sweep=llama3_70b_layouts", f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    points = sorted(p.parent.name for p in tmp_path.glob("*/plan.json")) + sorted(p.parent.name for p in tmp_path.glob("*/invalid.json"))
    assert len(points) == 12  # tp {4,8} x pp {4,8,16} x cp {1,2}
    assert json.loads((tmp_path / "0" / "plan.json").read_text())["overrides"] == [
        "parallelism.tp=4",
        "parallelism.pp=4",
        "parallelism.cp=1",
        "sweep=llama3_70b_layouts",
    ]
