"""runner.compare's predicted column (what the predictor said beside what a run measured) and the rank correlation
mode=search's verify and bench/predictor_grid.py share."""

from __future__ import annotations

import json

import pytest

from runner.estimate.predict import accuracy
from runner.outputs import comparison, run_rows


def test_a_measured_run_shows_its_predicted_step_time_and_the_error(tmp_path, capsys):
    base = {"degrees": "dp_shard=2", "memory_gb_max": 1.0, "step_time_s_median": 0.25, "mfu_median": 0.1}
    runs = {"pred": {"plan_check": {"step_time_predicted_s": 0.2}}, "nopred": {"plan_check": {}}}
    runs["old"] = {"calibration": {"step_time_predicted_s": 0.5}}  # the key's name in run folders written before the rename
    for name, extra in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(base | extra))
    assert comparison.main([str(tmp_path)]) == 0
    lines = [ln.split("│") for ln in capsys.readouterr().out.splitlines() if ln.startswith("│")]
    rows = {cells[1].strip(): [c.strip() for c in cells[7:10]] for cells in lines}  # step time, predicted, error
    assert rows == {"pred": ["0.250 s", "0.200 s", "-20.0 %"], "nopred": ["0.250 s", "-", "-"], "old": ["0.250 s", "0.500 s", "+100.0 %"]}


def test_moe_runs_show_their_experts_load_beside_a_dense_run(tmp_path, capsys):
    """summary.json's medians of the worst layer's max/mean and busiest EP rank share (runner.run.accounting.moe_medians,
    from metrics.jsonl's `moe`) become the last column; a dense run shows "-"."""
    from runner.run.accounting import moe_medians

    windows = [{"max_mean": [1.2, 1.5], "ep_share": [0.52, 0.6]}, {"max_mean": [1.1, 1.3], "ep_share": [0.55, 0.5]}]
    windows.append({"max_mean": [1.4, 1.0], "ep_share": [0.7, 0.5]})
    assert moe_medians(windows) == {"moe_max_mean_median": 1.4, "moe_ep_share_median": 0.6}
    base = {"degrees": "dp_shard=2", "memory_gb_max": 1.0, "step_time_s_median": 0.25, "mfu_median": 0.1}
    for name, extra in {"moe": moe_medians(windows), "dense": {}}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(base | extra))
    assert comparison.main([str(tmp_path)]) == 0
    lines = [ln.split("│") for ln in capsys.readouterr().out.splitlines() if ln.startswith("│")]
    assert {cells[1].strip(): cells[12].strip() for cells in lines} == {"moe": "1.40 x, 60.0 %", "dense": "-"}


def test_spearman_ranks_ties_by_their_mean_rank():
    assert accuracy.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert accuracy.spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert accuracy.spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(0.8660254)  # ranks 0.5, 0.5, 2
    assert accuracy.spearman([1, 1, 1], [1, 2, 3]) != accuracy.spearman([1, 1, 1], [1, 2, 3])  # NaN: no order to agree with


def _plan(folder, tp: int, step_s: float, fits: bool, gb: float) -> None:
    folder.mkdir()
    (folder / ".hydra").mkdir()
    (folder / ".hydra" / "overrides.yaml").write_text(f"- mode=plan\n- parallelism.tp={tp}\n")
    plan = {"degrees": f"dp_shard=4 x tp={tp}", "device": "cuda", "total_gb_per_gpu": gb, "fits_memory": fits}
    plan |= {"bubble_fraction": 0.0, "tp_comm_share": 0.1, "estimated_step_time_s": step_s, "estimated_mfu": 0.4}
    (folder / "plan.json").write_text(json.dumps(plan))


def _sweep_with_a_layout_that_does_not_fit(tmp_path):
    """Plans of tp 1, 2, 4 (tp=2 the fastest, and 117 GB: it does not fit), an invalid tp=16 and a failed tp=8."""
    _plan(tmp_path / "0", 1, 1.2, True, 70.0)
    _plan(tmp_path / "1", 2, 0.9, False, 117.0)
    _plan(tmp_path / "2", 4, 1.0, True, 40.0)
    for name, tp, result, body in (
        ("3", 16, "invalid.json", {"overrides": [], "problems": ["parallelism.tp = 16: must divide model.num_heads = 64"]}),
        ("4", 8, "failed.json", {"overrides": [], "exit_code": 1, "error": "RuntimeError: loss guard", "logs": "/l", "report": None}),
    ):
        (tmp_path / name / ".hydra").mkdir(parents=True)
        (tmp_path / name / ".hydra" / "overrides.yaml").write_text(f"- mode=plan\n- parallelism.tp={tp}\n")
        (tmp_path / name / result).write_text(json.dumps(body))
    return run_rows.collect([tmp_path])


def test_layouts_that_do_not_fit_rank_after_those_that_fit_in_the_table(tmp_path, capsys):
    _sweep_with_a_layout_that_does_not_fit(tmp_path)
    assert comparison.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    order = [ln.split("│")[1].strip() for ln in out.splitlines() if ln.startswith("│ tp=")]
    assert order == ["tp=4", "tp=1", "tp=2", "tp=16", "tp=8"]  # tp=2 is the fastest, but 117 GB does not fit
    assert "1 layout does not fit in device memory: ranked after those that fit (yellow)" in out


def test_the_figure_marks_what_does_not_fit_and_lists_points_without_a_bar(tmp_path):
    fig = comparison.figure(_sweep_with_a_layout_that_does_not_fit(tmp_path))
    bars_ax, list_ax = fig.axes
    assert [t.get_text() for t in bars_ax.get_yticklabels()] == ["tp=4", "tp=1", "tp=2"]
    assert [bar.get_hatch() for bar in bars_ax.patches] == [None, None, "//"]
    assert [t.get_text() for t in bars_ax.texts] == ["1 s", "1.2 s", "0.9 s  117 GB DOES NOT FIT"]
    assert bars_ax.get_title(loc="left") == "1 layout does not fit in device memory: ranked after those that fit (hatched)"
    (listed,) = [t.get_text() for t in list_ax.texts]
    assert listed.splitlines() == [
        "not drawn: 2 points without a result",
        "tp=16 (invalid): parallelism.tp = 16: must divide model.num_heads = 64",
        "tp=8 (failed): exit code 1: RuntimeError: loss guard",
    ]


def _traced(folder, name: str, measured: dict, predicted: dict | None) -> None:
    """A traced run's summary.json: the busiest rank's terms (profile/breakdown.json) beside the predictor's."""
    (folder / name).mkdir()
    total = sum(measured.values())
    body = {"degrees": name, "memory_gb_max": 1.0, "step_time_s_median": total, "mfu_median": 0.1}
    body |= {"plan_check": {"step_time_predicted_s": sum(predicted.values()) if predicted else None, "terms_predicted_s": predicted}}
    body["profile"] = {"terms_s": measured}
    (folder / name / "summary.json").write_text(json.dumps(body))


def test_traced_layouts_show_each_term_measured_beside_predicted_and_the_term_behind_the_gap(tmp_path, capsys):
    _traced(tmp_path, "dp2_pp2", {"compute": 0.5, "bubble": 0.1, "pp": 0.02}, {"compute": 0.4, "bubble": 0.1, "pp": 0.01})
    _traced(tmp_path, "dp2_tp2", {"compute": 0.5, "tp": 0.6, "overhead": 0.2}, {"compute": 0.4, "tp": 0.2})
    _traced(tmp_path, "cp2", {"compute": 0.7, "cp": 0.1}, None)  # no machine profile: measured alone
    assert comparison.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "where the step time goes" in out
    rows = {
        ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")[3:-1]]
        for ln in out.split("where the step time goes")[1].splitlines()
        if ln.startswith("│ ")
    }
    # columns: compute, overhead, bubble, tp, pp, cp, largest gap
    assert rows["dp2_tp2"] == [
        "0.500 / 0.400 (1.25)",
        "0.200 / 0.000",
        "0.000 / 0.000",
        "0.600 / 0.200 (3.00)",
        "0.000 / 0.000",
        "0.000 / 0.000",
        "tp +0.400 s",
    ]
    assert rows["cp2"][0] == "0.700" and rows["cp2"][-1] == "-"
    fig = comparison.figure(run_rows.collect([tmp_path]))
    split = fig.axes[1]
    labels = [t.get_text() for t in split.get_yticklabels()]
    assert labels == [f"{n}  {w}" for n in ("dp2_pp2", "cp2", "dp2_tp2") for w in ("predicted", "measured")]  # fastest first
    notes = [t.get_text() for t in split.texts]
    assert notes[2] == "no prediction (no machine profile)" and notes[5] == "1.3 s; the gap is mostly tp (+0.4 s)"
    assert {t.get_text() for t in split.get_legend().get_texts()} == {"compute", "overhead", "bubble", "tp", "pp", "cp"}
    widths = [round(p.get_width(), 3) for p in split.patches[24:30]]  # dp2_tp2's predicted bar (the 5th), term by term
    assert widths == [0.4, 0.0, 0.0, 0.2, 0.0, 0.0]


def test_an_fp8_runs_cast_and_amax_terms_are_columns_of_the_breakdown(tmp_path, capsys):
    """runner.compare's breakdown has the FP8 terms as columns (runner.outputs.breakdown.TERMS): fp8_cast measured from
    the cast kernels beside the predictor's; fp8_amax predicted only, its all-reduces being tp in a trace."""
    _traced(
        tmp_path, "fp8_tp2", {"compute": 0.4, "tp": 0.11, "fp8_cast": 0.07}, {"compute": 0.4, "tp": 0.1, "fp8_cast": 0.05, "fp8_amax": 0.01}
    )
    assert comparison.main([str(tmp_path)]) == 0
    table = capsys.readouterr().out.split("where the step time goes")[1]
    head = next(ln for ln in table.splitlines() if ln.startswith("┃"))
    assert [c.strip() for c in head.split("┃")[3:-1]] == ["compute", "tp", "fp8_cast", "fp8_amax", "largest gap"]
    row = next(ln for ln in table.splitlines() if ln.startswith("│ "))
    cells = ["0.400 / 0.400 (1.00)", "0.110 / 0.100 (1.10)", "0.070 / 0.050 (1.40)", "0.000 / 0.010 (0.00)", "fp8_cast +0.020 s"]
    assert [c.strip() for c in row.split("│")[3:-1]] == cells
