"""Hydra's optimizing sweepers drive the runner: the task returns the config's objective (+inf for an invalid point,
which Optuna records as the worst trial instead of stopping the sweep). Also: selective activation checkpointing
trains the same losses as none, and the W&B summary carries the predicted figures beside the measured ones."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from runner.config.search import objective as search_objective
from runner.estimate import flops
from runner.run import metrics
from runner.schema import ActivationCheckpoint, ModelConfig
from tests.conftest import metrics as rows_of
from tests.conftest import run_cli

OPTUNA = ["-m", "hydra/sweeper=optuna", "hydra/sweeper/sampler=grid"]
GRID = {"parallelism.tp": (4, 8, 16), "parallelism.pp": (4, 8)}  # tp=16 does not fit a node of 8: invalid points


def _results(sweep) -> dict:
    return yaml.safe_load((sweep / "optimization_results.yaml").read_text())


@pytest.mark.e2e
def test_optuna_sweep_over_plans_finds_the_best_layout(tmp_path, budget):
    sweep = tmp_path / "optuna"
    space = [f"{k}=choice({','.join(map(str, v))})" for k, v in GRID.items()]
    proc = run_cli(*OPTUNA, "hydra.sweeper.n_trials=6", "mode=plan", "recipe=llama3_70b_h100x1024", *space, f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = {
        (tp, pp): budget(["recipe=llama3_70b_h100x1024", f"parallelism.tp={tp}", f"parallelism.pp={pp}"])["estimated_step_time_s"]
        for tp in GRID["parallelism.tp"][:2]
        for pp in GRID["parallelism.pp"]
    }
    (tp, pp), best = min(want.items(), key=lambda kv: kv[1])
    got = _results(sweep)
    assert got["best_params"] == {"parallelism.tp": tp, "parallelism.pp": pp}
    assert got["best_value"] == pytest.approx(best, rel=1e-12)
    assert len(list(sweep.glob("*/invalid.json"))) == 2 and len(list(sweep.glob("*/plan.json"))) == 4


def test_neg_mfu_and_an_invalid_point_as_objectives():
    plan = {"estimated_step_time_s": 2.5, "estimated_mfu": 0.4}
    from runner.schema import Objective, RunConfig

    cfg = RunConfig()
    assert search_objective.of_plan(cfg, plan) == 2.5
    cfg.objective = Objective.neg_mfu
    assert search_objective.of_plan(cfg, plan) == -0.4
    assert search_objective.of_plan(cfg, {"estimated_step_time_s": None, "estimated_mfu": None}) == math.inf
    cfg.objective = Objective.eval_loss
    with pytest.raises(search_objective.ConfigError) as e:
        search_objective.of_run(cfg, {"final_loss": 3.0})
    assert "objective = eval_loss: the run's summary.json has no eval_loss_final" in str(e.value)
    assert search_objective.of_run(cfg, {"eval_loss_final": 2.75}) == 2.75


AC_MODES = ("none", "selective_op", "selective_layer")


@pytest.mark.e2e
def test_trained_optuna_sweep_returns_the_measured_loss_and_selective_ac_keeps_the_math(tmp_path):
    """One short trained sweep: Optuna's grid over the AC modes on one rank. Each mode trains the same losses as none
    (recomputation does not change the math), logs its HFU, and the sweep's best value is the measured final loss."""
    sweep = tmp_path / "trained"
    short = ["parallelism=single", "training.steps=2", "training.seq_len=32", "training.global_batch_size=2", "logging.progress=false"]
    proc = run_cli(
        *OPTUNA, f"hydra.sweeper.n_trials={len(AC_MODES)}", "objective=final_loss", *short,
        f"training.activation_checkpoint=choice({','.join(AC_MODES)})", f"hydra.sweep.dir={sweep}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {yaml.safe_load((d / "frozen.yaml").read_text())["training"]["activation_checkpoint"]: d for d in sweep.iterdir() if d.is_dir()}
    assert sorted(runs) == sorted(AC_MODES)
    losses = {ac: [r["loss"] for r in rows_of(d)] for ac, d in runs.items()}
    for ac in AC_MODES[1:]:
        assert losses[ac] == pytest.approx(losses["none"], abs=1e-6), ac
    m = ModelConfig()
    for ac in AC_MODES[1:]:
        s = json.loads((runs[ac] / "summary.json").read_text())
        assert s["hfu_median"] / s["mfu_median"] == pytest.approx(flops.hfu_factor(m, ActivationCheckpoint(ac), 2))
    assert _results(sweep)["best_value"] == pytest.approx(
        min(json.loads((d / "summary.json").read_text())["final_loss"] for d in runs.values())
    )


def test_selective_ac_wraps_the_blocks_torchtitan_would():
    """selective_op is TorchTitan's SelectiveAC; selective_layer wraps every N-th block (N-1, 2N-1, ...) with FullAC's wrapper."""
    import torch
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    from runner.run.titan.build import ac_config
    from runner.schema import RunConfig

    cfg = RunConfig()
    cfg.training.activation_checkpoint = ActivationCheckpoint.selective_op
    assert isinstance(ac_config(cfg), SelectiveAC.Config)
    cfg.training.activation_checkpoint, cfg.training.ac_layer_frequency = ActivationCheckpoint.selective_layer, 3
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(4, 4) for i in range(7)})
    ac_config(cfg).build().apply(model)
    wrapped = [name for name, block in model.layers.items() if type(block).__name__ == "CheckpointWrapper"]
    assert wrapped == ["2", "5"]
    x = torch.ones(2, 4)
    assert torch.equal(model.layers["2"](x), model.layers["2"]._checkpoint_wrapped_module(x))
    cfg.training.activation_checkpoint = ActivationCheckpoint.none
    assert ac_config(cfg) is None


def test_wandb_summary_has_predicted_beside_measured(tmp_path, monkeypatch, compose):
    summary = {"step_time_s_median": 3.0, "mfu_median": 0.2, "mfu_6n_median": 0.25, "plan_check": {"step_time_predicted_s": 2.0}}
    assert metrics.predicted(summary) == {"step_time_s_predicted": 2.0, "mfu_predicted": pytest.approx(0.3), "mfu_6n_predicted": 0.375}
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    sink = metrics.WandbSink(compose(["logging=wandb", "logging.wandb.mode=offline", "parallelism=single"]), tmp_path, {})
    finish, seen = sink.run.finish, {}

    def finish_after_reading():  # offline runs keep the summary in a binary log; read it from the run first
        seen.update({k: sink.run.summary[k] for k in sink.run.summary.keys()})
        finish()

    monkeypatch.setattr(sink.run, "finish", finish_after_reading)
    sink.close(summary)
    assert seen["step_time_s_predicted"] == 2.0 and seen["step_time_s_median"] == 3.0
    assert seen["mfu_predicted"] == pytest.approx(0.3) and seen["mfu_median"] == 0.2
    assert seen["plan_check/step_time_predicted_s"] == 2.0
