"""mode=dryrun: one CPU process plays a rank of the real layout on fake tensors and measures its memory.

The ledger is checked against reality: the debug model at dp2_tp2 on 4 real gloo ranks (the same warm-up and step,
the same ledger, on real tensors) against the dry run's rank 0 of that layout. Parameters, gradients and
optimizer state must agree byte for byte; activations within 1 % (measured: equal). The 8B FSDP recipe's dry
run is checked against hand-computed shard sizes.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from runner.config import freeze, validate
from runner.estimate import dryrun_report, flops
from runner.formats import runfiles
from runner.schema.problems import ConfigError
from tests.conftest import run_cli, run_module
from tests.points import DRYRUN_SMALL as SMALL

# The dry runs (tests/points.py's DRYRUNS), trained with tests/test_plan_memory.py's in one multirun (conftest's dry_runs)


def test_default_ranks_and_reduced_batch(compose):
    cfg = compose(["recipe=llama3_70b_h100x1024"])
    lay = validate.check(cfg)
    assert dryrun_report.ranks(cfg, lay) == [0, 512, 1023]  # stage 0, stage 2 (of 4), the last rank
    assert dryrun_report.microbatches(cfg, lay) == (32, 5)  # 1F1B: pp forwards, a backward, a forward beside its gradients
    assert "global batch 1024 reduced to 160" in dryrun_report.batch_note(cfg, lay)
    # a middle stage's receive buffers (input and gradient): 27 more microbatches of a bf16 hidden state (seq 4096 x dim 8192 / tp 8)
    assert f"the full batch peaks up to {2 * 27 * 2 * 4096 * 8192 / 8 / 1e9:.2f} GB higher" in dryrun_report.batch_note(cfg, lay)
    cfg.dryrun.full_batch = True
    assert dryrun_report.microbatches(cfg, lay) == (32, 32)
    single = compose(["recipe=llama3_8b_fsdp8_h100"])
    assert dryrun_report.ranks(single, validate.check(single)) == [0]


def test_ranks_outside_the_layout_are_named(compose):
    cfg = compose(["recipe=llama3_70b_h100x1024", "dryrun.ranks=[3,1024]"])
    with pytest.raises(ConfigError) as e:
        dryrun_report.ranks(cfg, validate.check(cfg))
    assert "dryrun.ranks = [3, 1024]: [1024] outside the layout's 1024 ranks. Fix: pick ranks in 0..1023." in str(e.value)


def test_a_cpu_rehearsal_that_disagrees_with_the_cluster_plan_says_its_kernels_are_not_the_clusters():
    """The DeepSeek-V3 recipe's CPU dry run of ranks 0 and 1920 (2026-12-05): the plan on the cluster's kernels fits
    (65.42 GB), the CPU's kernels peak at 105.01 GB (MLA's math SDPA keeps fp32 attention probabilities), planned for
    them at 79.89 and 75.99 GB. The line names the CPU's own plan and the CUDA rehearsal; a CUDA rehearsal that
    disagrees, or a CPU one that agrees, says nothing more."""
    ranks = [{"rows": [{"row": "total (peak)", "plan_gb": gb}]} for gb in (79.89, 75.99)]
    fits = {"device_memory_gb": 80.0, "plan": True, "measured": False, "largest_peak_gb": 105.01}
    rep = {"fits": fits, "plan": {"total_gb_per_gpu": 65.42}, "device": "cuda", "rehearsal": "cpu", "ranks": ranks}
    assert dryrun_report.fit_line(rep) == (
        "fits_memory: plan fits (65.42 GB per device, cluster kernels), dry run does not fit (largest peak 105.01 GB) in "
        "80 GB: DISAGREE (the CPU rehearsal's kernels, planned at 79.89 GB for these ranks, are not the cluster's: "
        "dryrun.device=cuda rehearses the cluster's kernels)"
    )
    assert dryrun_report.fit_line(rep | {"rehearsal": "cuda"}).endswith("in 80 GB: DISAGREE")
    agree = rep | {"fits": fits | {"measured": True, "largest_peak_gb": 61.35}}
    assert dryrun_report.fit_line(agree).endswith("(largest peak 61.35 GB) in 80 GB: agree")


@pytest.mark.e2e
def test_ranks_outside_the_layout_exit_2_with_nothing_written(tmp_path):
    proc = run_cli("mode=dryrun", "recipe=llama3_70b_h100x1024", "dryrun.ranks=[5000]", run_dir=tmp_path / "run")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "dryrun.ranks = [5000]" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def _real_ledger(cfg, tmp_path) -> dict:
    """Rank 0 of 4 real gloo ranks running runner.run.dryrun.rehearse's warm-up and step under the ledger (forked after the imports)."""
    tmp_path.mkdir()
    frozen = freeze.write(cfg, validate.check(cfg), tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_module("runner.run.dryrun.rehearse", "4", tmp_path, frozen, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / "ledger_rank0.json").read_text())


@pytest.mark.e2e
def test_ledger_of_the_dry_run_matches_real_ranks(tmp_path, compose, dry_runs):
    real = _real_ledger(compose(SMALL), tmp_path / "real")
    fake = json.loads((dry_runs["dryrun-ledger"][0] / runfiles.DRYRUN).read_text())["ranks"][0]
    assert fake["fake"] and not real["fake"]
    assert fake["param_shards"] == real["param_shards"]
    for label in ("param_shard", "param_gathered", "grad_shard", "grad_unsharded", "optimizer_state", "buffer"):
        assert fake["max_each"][label] == real["max_each"][label], label
        # at the peak instant, a real gloo rank's unsharded gradient is freed when the background thread finishes its
        # reduce-scatter (it holds the tensor until then), so under load it is sometimes still live: measured 0 or 1.7 MB
        if label != "grad_unsharded":
            assert fake["at_peak"][label] == real["at_peak"][label], label
    assert fake["max_each"]["activation"] == pytest.approx(real["max_each"]["activation"], rel=0.01)
    assert fake["peak_bytes"] == pytest.approx(real["peak_bytes"], rel=0.01)
    assert {(c["op"], c["group"], c["count"], c["bytes"]) for c in fake["collectives"]} == {
        (c["op"], c["group"], c["count"], c["bytes"]) for c in real["collectives"]
    }


@pytest.mark.e2e
def test_8b_fsdp_dry_run_writes_the_expected_shards(compose, dry_runs):
    run_dir, out = dry_runs["dryrun-8b"]
    rep = json.loads((run_dir / runfiles.DRYRUN).read_text())
    assert "plan GB" in out and "total (peak)" in out
    assert "substituted: attention: TorchTitan's causal SDPA in place of FlexAttention" in out  # a CUDA config, named
    assert rep["substitutions"] == [line.removeprefix("  substituted: ") for line in out.splitlines() if "substituted:" in line]
    r = rep["ranks"][0]
    n = flops.num_params(compose(["recipe=llama3_8b_fsdp8_h100"]).model)
    assert r["num_params_local"] * 8 == n  # every 8B dimension splits evenly over 8 FSDP ranks
    assert r["max_each"]["param_shard"] == n // 8 * 4  # fp32 master shards
    tensors = len(r["param_shards"])
    assert r["max_each"]["optimizer_state"] == 2 * n // 8 * 4 + 4 * tensors  # two fp32 moments + a step scalar per tensor
    assert r["max_each"]["param_gathered"] >= n // 32 * 2  # at least one of 32 blocks gathered in bf16
    assert [row["row"] for row in r["rows"]] == [
        "weights + gradients",
        "optimizer (master + moments)",
        "activations",
        "temporaries",
        "buffers",
        "collective buffers",
        "total (peak)",
    ]
    opt = r["rows"][1]
    assert opt["plan_gb"] == pytest.approx(n * 12 / 8 / 1e9)
    assert opt["ratio"] == pytest.approx(1.0, abs=1e-4)
    assert sum(c["bytes"] for c in r["collectives"] if c["op"] == "_reduce_scatter_base") > 0


def test_cuda_rehearsal_refuses_a_cpu_cluster(compose):
    cfg = compose(["mode=dryrun", "dryrun.device=cuda"])
    with pytest.raises(ConfigError) as e:
        validate.check(cfg)
    assert "dryrun.device = cuda: the CUDA rehearsal plays a CUDA cluster's ranks" in str(e.value)
    assert "Fix: pick a CUDA cluster" in str(e.value)


def test_cuda_rehearsal_without_its_environment_names_the_set_up(tmp_path, monkeypatch):
    """No .venv-cuda (or a visible GPU): exit 2 (a ConfigError) naming scripts/setup.sh --cuda-rehearsal, before any process."""
    from runner.run.dryrun import cuda_env

    job = {"frozen": "f", "ranks": [0], "run_dir": str(tmp_path), "gpu": {"capability": "9.0", "memory_gb": 80.0, "name": "x"}}
    with pytest.raises(ConfigError) as e:
        cuda_env.launch([job], tmp_path, tmp_path / "work")
    assert "dryrun.device = cuda" in str(e.value) and "bash scripts/setup.sh --cuda-rehearsal" in str(e.value)
    assert f"no {tmp_path / '.venv-cuda'}" in str(e.value)
    monkeypatch.setattr(cuda_env, "gpu_visible", lambda: True)
    (tmp_path / ".venv-cuda" / "bin").mkdir(parents=True)
    (tmp_path / ".venv-cuda" / "bin" / "python").touch()
    with pytest.raises(ConfigError) as e:
        cuda_env.launch([job], tmp_path, tmp_path / "work")
    assert "a GPU is visible here" in str(e.value)
    assert not (tmp_path / "work").exists()


@pytest.mark.e2e
def test_cuda_rehearsal_of_a_cpu_cluster_exits_2_without_a_traceback(tmp_path):
    proc = run_cli("mode=dryrun", "dryrun.device=cuda", run_dir=tmp_path / "run")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "dryrun.device = cuda" in proc.stderr and "Fix: pick a CUDA cluster" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.e2e
def test_tied_embedding_is_one_parameter_under_tp(dry_runs, compose):
    """Qwen3 ties tok_embeddings to lm_head; TP gives each module its own parameter and TorchTitan's Decoder.init_states
    ties them again, which real ranks run (measured 2026-12-05 with its 8 blocks on tp2 and dp2_tp2, the runner and
    TorchTitan's Trainer alike: 74 parameters, 74 in the optimizer, tok_embeddings.weight is lm_head.weight, equal
    losses). The dry run skips init_states; its rank holds the model's own parameters all the same (it held one more,
    an lm_head.weight shard, and its optimizer state). The dry-runs multirun's qwen3 dp2_tp2 point."""
    from runner.run import titan
    from tests.points import PLAN_MEMORY_CASES, PLAN_MEMORY_DEBUG

    run_dir, console = dry_runs["plan_memory-qwen3_tp_sp"]
    cfg = compose([*PLAN_MEMORY_DEBUG, *PLAN_MEMORY_CASES["qwen3_tp_sp"][0]])
    with torch.device("meta"):
        model = titan.model_config(cfg, validate.check(cfg), materialize=False)[0].model.build()
    own = [name for name, _ in model.named_parameters()]
    assert "lm_head.weight" not in own
    rank = json.loads((run_dir / runfiles.DRYRUN).read_text())["ranks"][0]
    assert [s["name"] for s in rank["param_shards"]] == own, console
    rows = {r["row"]: r for r in rank["rows"]}
    assert rows["optimizer (master + moments)"]["ratio"] == pytest.approx(1.0, abs=0.005)


def test_modes_that_train_nothing_print_library_lines_and_warnings_as_a_training_console(capsys):
    """A mode that starts no training (runner.cli) routes the root logger's lines through the runner's console (WARNING
    and up, in its format; TorchTitan's INFO lines once printed in Hydra's `[time][HYDRA]` format) and drops the known
    warnings, among them torch's CPU autocast notice that TorchTitan's MoE router raised on every MoE recipe's dry run;
    both put back after the mode (a sweep's next point, a test)."""
    import logging
    import warnings

    import torch

    from runner.run import console, known_warnings

    root = logging.getLogger()
    before = root.handlers[:], root.level
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with console.routed(verbose=False), known_warnings.applied():
            logging.getLogger().info("Building device mesh with parallelism: pp=1")
            logging.getLogger().warning("a warning of TorchTitan's")
            torch.autocast("cpu", dtype=torch.float32)
        torch.autocast("cpu", dtype=torch.float32)  # outside the mode: the filter is gone again
    assert (root.handlers, root.level) == before
    assert capsys.readouterr().err == "WARNING: a warning of TorchTitan's\n"
    assert [str(w.message).split(". ")[0] for w in got] == ["In CPU autocast, but the target dtype is not supported"]
