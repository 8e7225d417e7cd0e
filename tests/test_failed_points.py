"""A sweep point whose ranks fail is recorded (failed.json, failure_report.json) and the sweep goes on;
runner.compare lists it and keeps its plot out of the failed run's folder; the tests' shared multiruns fail only the
tests that read a failed point."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from runner.formats import runfiles
from runner.outputs import comparison
from runner.sweep import wandb_group
from tests.conftest import run_cli
from tests.multiruns import Lazy, multirun_status, point

ERROR = "RuntimeError: loss guard: 1 spikes in a row and no checkpoint before step 1"


@pytest.mark.e2e
def test_failed_point_is_recorded_and_the_sweep_goes_on(tmp_path, capsys):
    sweep = tmp_path / "lr"
    # a NaN loss at step 1 with the guard set to rewind and no checkpoint before it: every rank raises at run time
    guard = ["checkpoint=local", "monitor.guard.action=rewind", "monitor.guard.max_consecutive=1", "monitor.inject.corrupt_steps=[1]"]
    args = ["-m", "parallelism=single", "training.steps=1", "lr_scheduler.warmup_steps=1", "training.global_batch_size=2", *guard]
    args += ["monitor.inject.corrupt_scale=nan,1.0"]
    proc = run_cli(*args, f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "1 sweep point failed (failed.json in each run folder): parallelism=single training.steps=1" in proc.stderr
    bad, good = sweep / "0", sweep / "1"
    assert (good / runfiles.SUMMARY).is_file()  # the point after the failure ran
    frozen = yaml.safe_load((good / runfiles.FROZEN).read_text())
    assert frozen["logging"]["wandb"]["group"] is None  # the sweep's W&B group is not frozen: a replay gets its own
    failed = json.loads((bad / runfiles.FAILED).read_text())
    assert failed["overrides"][-1] == "monitor.inject.corrupt_scale=nan" and failed["exit_code"] == 1
    assert failed["error"] == ERROR
    assert failed["failed_ranks"] == {"0": {"exit_code": 1, "error": ERROR}}
    assert failed["logs"] == str(bad / runfiles.LOGS) and failed["report"] == str(bad / runfiles.FAILURE_REPORT)
    report = json.loads((bad / runfiles.FAILURE_REPORT).read_text())
    assert report["cause"] == "rank failure" and report["raised"] == {"0": ERROR}
    assert not (bad / runfiles.HANG_REPORT).exists() and not any((bad / "flight_recorder").iterdir())  # a raise is no hang: no dump

    capsys.readouterr()
    assert comparison.main([str(bad), str(good)]) == 0  # the failed run first: the plot still goes to the sweep folder
    out = capsys.readouterr().out
    assert "monitor.inject.corrupt_scale=nan" in out and "failed" in out and "exit code 1: RuntimeError: loss guard: 1 spikes" in out
    assert f"plot saved to {sweep / runfiles.PLOT}" in out and not (bad / runfiles.PLOT).exists()


def test_plot_folder_is_never_a_failed_run(tmp_path):
    run = tmp_path / "sweep" / "0"
    run.mkdir(parents=True)
    (run / runfiles.FAILED).write_text("{}")
    assert comparison.plot_folder([run]) == tmp_path / "sweep"
    assert comparison.plot_folder([tmp_path / "sweep"]) == tmp_path / "sweep"
    assert comparison.plot_folder([run, tmp_path / "other"]) == tmp_path


def test_wandb_group_names_the_whole_sweep_folder(tmp_path):
    a, b = tmp_path / "one" / "x" / "wbm", tmp_path / "two" / "x" / "wbm"
    assert wandb_group(a) == str(a) and wandb_group(a) != wandb_group(b)  # not "x/wbm" for both
    deep = tmp_path / ("d" * 60) / ("e" * 60) / "wbm"
    long_a, long_b = wandb_group(deep), wandb_group(tmp_path / ("f" * 60) / ("e" * 60) / "wbm")
    assert len(long_a) <= 128 and long_a.startswith("...") and long_a != long_b


def _sweep(folder: Path, records: dict[int, tuple[str, dict]]) -> Path:
    """A made-up multirun folder of points 0-2 (point 3 never started): records[i] = (file, its content) in point i's run folder."""
    for i in range(3):
        (folder / str(i)).mkdir(parents=True)
        (folder / str(i) / runfiles.SUMMARY).write_text("{}")
    for i, (name, record) in records.items():
        (folder / str(i) / name).write_text(json.dumps(record))
    return folder


def test_a_failed_point_fails_only_the_tests_that_read_it(tmp_path):
    """conftest's shared multiruns, read point by point (tests/multiruns.py): a point whose ranks failed (failed.json, the
    multirun's exit code 1), an invalid one and one that never started fail the test that reads them, with the record
    and the tails of the point's console and rank logs; the other points' tests read their run folders."""
    sweep = _sweep(tmp_path / "sweep", {1: (runfiles.FAILED, {"error": ERROR}), 2: (runfiles.INVALID, {"problems": ["steps = 0"]})})
    log = sweep / "1" / runfiles.LOGS / "job_x" / "attempt_0" / "1" / "stderr.log"  # local rank 1's log file (torchrun)
    log.parent.mkdir(parents=True)
    log.write_text("Traceback: rank 1 raised\n")
    names = ["a", "b", "c", "d"]
    stdout = "".join(f"[HYDRA]        #{i} : +point={n}\nconsole of {n}\n" for i, n in enumerate(names[:3]))
    runs = multirun_status(names, sweep, subprocess.CompletedProcess([], 1, stdout, "1 sweep point failed"))
    assert runs["a"] == (sweep / "0", "+point=a\nconsole of a\n") == point(runs, "a")
    assert list(runs) == names and "b" in runs and sorted(runs.failed) == ["b", "c", "d"] and runs.error is None
    for name, words in {"b": [ERROR, "console of b", "Traceback: rank 1 raised"], "c": ["steps = 0"], "d": ["no run folder"]}.items():
        with pytest.raises(pytest.fail.Exception) as failed:
            runs[name]
        assert all(w in str(failed.value) for w in [f"sweep point {name} failed", *words]), str(failed.value)
    view = Lazy(["a", "b"], lambda name: runs[name][0])  # how a test module hands its points to its tests
    assert view["a"] == sweep / "0"
    with pytest.raises(pytest.fail.Exception):
        view["b"]


@pytest.mark.parametrize("code, folders", [(-9, True), (2, True), (1, True), (0, False)])
def test_a_multirun_failed_as_a_whole_fails_every_point(tmp_path, code, folders):
    """Killed, refused (exit 2), an exit 1 that no point's failed.json explains, or no run folder at all: every point
    fails, with the multirun's console and stderr."""
    sweep = _sweep(tmp_path / "sweep", {}) if folders else tmp_path / "sweep"
    runs = multirun_status(["a", "b"], sweep, subprocess.CompletedProcess([], code, "[HYDRA]        #0 : +point=a\n", "the stderr"))
    for name in runs:
        with pytest.raises(pytest.fail.Exception) as failed:
            runs[name]
        assert f"multirun failed (exit code {code})" in str(failed.value) and "the stderr" in str(failed.value)
