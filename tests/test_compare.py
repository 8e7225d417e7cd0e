"""runner.compare's predicted column (what the predictor said beside what a run measured) and the rank correlation
mode=search's verify and bench/predictor_grid.py share."""

from __future__ import annotations

import json

import pytest

from runner.config import compare


def test_a_measured_run_shows_its_predicted_step_time_and_the_error(tmp_path, capsys):
    base = {"degrees": "dp_shard=2", "memory_gb_max": 1.0, "step_time_s_median": 0.25, "mfu_median": 0.1}
    runs = {"pred": {"calibration": {"step_time_predicted_s": 0.2}}, "nopred": {"calibration": {}}}
    for name, extra in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(base | extra))
    assert compare.main([str(tmp_path)]) == 0
    lines = [ln.split("│") for ln in capsys.readouterr().out.splitlines() if ln.startswith("│")]
    rows = {cells[1].strip(): [c.strip() for c in cells[7:10]] for cells in lines}  # step time, predicted, error
    assert rows == {"pred": ["0.250 s", "0.200 s", "-20.0 %"], "nopred": ["0.250 s", "-", "-"]}


def test_spearman_ranks_ties_by_their_mean_rank():
    assert compare.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert compare.spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert compare.spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(0.8660254)  # ranks 0.5, 0.5, 2
    assert compare.spearman([1, 1, 1], [1, 2, 3]) != compare.spearman([1, 1, 1], [1, 2, 3])  # NaN: no order to agree with
