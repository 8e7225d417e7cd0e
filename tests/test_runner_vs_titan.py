"""The runner trains what TorchTitan's own Trainer trains (issue 49): its Trainer.train() on 4 ranks (torchrun's agent,
the ranks forked once imported: bench/titan_trainer.fork_launch), on a config built from the same runner overrides
(bench/titan_trainer.py), from the same Hugging Face weights and synthetic batches, gives the runner's losses and
gradient norms. The runner's side is a point of the shared 4-rank parity launch (tests/points.py, TITAN_TRAINER);
bench/runner_vs_titan.py compares 10 steps on dp2_tp2 and tp2_pp2 and their speed (bench/README.md). On real documents
(issue 55) TorchTitan's side reads them with its own text dataset and tokenizer, on tp2_pp2 (one DP replica: the same
batches as the runner's data.shuffle=false, docs/training.md). Under expert parallelism (issue 56) debug_moe on dp2 x ep2
trains to the same losses, grad norms and expert biases from the runner's initial weights."""

from __future__ import annotations

import pytest

from tests import points
from tests.conftest import run_module

RTOL = 1e-5
"""Relative tolerance on each step's loss and grad norm in fp32 (measured: 3e-8, the last bit of a float32 loss)."""


@pytest.mark.e2e
def test_runner_losses_are_titan_trainers(parity_runs, hf_folders, tmp_path):
    _equals_titan_trainer(parity_runs[points.TITAN_TRAINER]["rows"], points.titan_trainer(hf_folders), tmp_path)


@pytest.mark.e2e
def test_runner_trains_documents_as_titan_trainer(parity_runs, titan_text, tmp_path):
    """data=text with document masks: TorchTitan's Trainer with its HuggingFaceTextDataset, its HuggingFaceTokenizer (BOS and
    EOS from tokenizer_config.json) and its per-batch masks (the CPU's dense form, bench/titan_trainer.cpu_document_masks)
    trains the runner's losses and grad norms (bench/runner_vs_titan.py --data text: bitwise equal on tp2_pp2)."""
    _equals_titan_trainer(parity_runs[points.TITAN_TRAINER_TEXT]["rows"], points.titan_trainer_text(*titan_text), tmp_path)


@pytest.mark.e2e
def test_runner_trains_moe_under_ep_as_titan_trainer(parity_runs, tmp_path):
    """debug_moe with expert parallelism (EP 2 inside FSDP 4, tokens to the experts by all-to-all) and TorchTitan's
    auxiliary-loss-free load balancing: the same losses and grad norms, and after the last step the same expert bias in
    every MoE block (bench/runner_vs_titan.py --model debug_moe: bitwise equal over 10 steps on ep2 and dp2_ep2)."""
    mine = parity_runs[points.TITAN_TRAINER_MOE]
    theirs = _equals_titan_trainer(mine["rows"], points.titan_trainer_moe(), tmp_path)
    assert sorted(mine["expert_bias"], key=int) == sorted(theirs["expert_bias"], key=int) == ["1", "2", "3", "4", "5"]  # 0 is dense
    for block, bias in mine["expert_bias"].items():  # moved by 3 sign steps of 1e-3 each
        assert bias == pytest.approx(theirs["expert_bias"][block], abs=1e-7), block
    assert any(abs(b) > 0 for bias in mine["expert_bias"].values() for b in bias)


def _equals_titan_trainer(runner: list[dict], spec_args, tmp_path) -> dict:
    """TorchTitan's Trainer on 4 forked ranks (bench/titan_trainer.py) trains steps 1-3 to the runner's losses and grad
    norms within RTOL; returns its result file."""
    from bench import titan_trainer

    spec = titan_trainer.write_spec(tmp_path, spec_args)
    proc = run_module(*titan_trainer.launch_args(spec, 4, fork=True), env=titan_trainer.launch_env(4), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = titan_trainer.output(spec)
    titan = out["rows"]
    assert [r["step"] for r in runner] == [r["step"] for r in titan] == [1, 2, 3]
    for mine, theirs in zip(runner, titan, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=RTOL), (mine["step"], mine["loss"], theirs["loss"])
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=RTOL), (mine["step"], mine["grad_norm"], theirs["grad_norm"])
    return out
