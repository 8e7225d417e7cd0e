"""The runner trains what TorchTitan's own Trainer trains (issue 49): its Trainer.train() on 4 ranks (torchrun's agent,
the ranks forked once imported: bench/titan_trainer.fork_launch), on a config built from the same runner overrides
(bench/titan_trainer.py), from the same Hugging Face weights and synthetic batches, gives the runner's losses and
gradient norms. The runner's side is a point of the shared 4-rank parity launch (tests/points.py, TITAN_TRAINER);
bench/runner_vs_titan.py compares 10 steps on dp2_tp2 and tp2_pp2 and their speed (bench/README.md). On real documents
(issue 55) TorchTitan's side reads them with its own text dataset and tokenizer, on tp2_pp2 (one DP replica: the same
batches as the runner's data.shuffle=false, docs/training.md)."""

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


def _equals_titan_trainer(runner: list[dict], spec_args, tmp_path) -> None:
    """TorchTitan's Trainer on 4 forked ranks (bench/titan_trainer.py) trains steps 1-3 to the runner's losses and grad
    norms within RTOL."""
    from bench import titan_trainer

    spec = titan_trainer.write_spec(tmp_path, spec_args)
    proc = run_module(*titan_trainer.launch_args(spec, 4, fork=True), env=titan_trainer.launch_env(4), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    titan = titan_trainer.result(spec)
    assert [r["step"] for r in runner] == [r["step"] for r in titan] == [1, 2, 3]
    for mine, theirs in zip(runner, titan, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=RTOL), (mine["step"], mine["loss"], theirs["loss"])
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=RTOL), (mine["step"], mine["grad_norm"], theirs["grad_norm"])
