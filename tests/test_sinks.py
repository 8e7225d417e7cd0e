"""metrics.jsonl marks the attempt and repeated steps; the W&B summary keeps nested values under flat keys."""

from __future__ import annotations

from runner.run import metrics
from tests.conftest import metrics as read_metrics


def _row(step: int) -> dict:
    return {"step": step, "loss": 1.0 / step}


def test_rows_after_an_elastic_restart_are_marked(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    first = metrics.JsonlSink(tmp_path)
    for s in (1, 2, 3):
        first.log(_row(s))
    first.file.close()  # the rank died after step 3; the checkpoint was at step 1
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second = metrics.JsonlSink(tmp_path)
    for s in (2, 3, 4):
        second.log(_row(s))
    second.close({"final_loss": 0.25})
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["attempt"], r.get("repeat", False)) for r in rows] == [
        (1, 0, False),
        (2, 0, False),
        (3, 0, False),
        (2, 1, True),
        (3, 1, True),
        (4, 1, False),
    ]
    last = {r["step"]: r for r in rows}  # one row per step: the last attempt's
    assert sorted(last) == [1, 2, 3, 4] and last[3]["attempt"] == 1


def test_rewound_step_in_one_attempt_is_a_repeat(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    sink = metrics.JsonlSink(tmp_path)
    for s in (10, 11, 12, 11, 12):  # the loss guard rewound to step 10
        sink.log(_row(s))
    sink.file.close()
    assert [r.get("repeat", False) for r in read_metrics(tmp_path)] == [False, False, False, True, True]


SUMMARY = {  # the shape train.run writes (keys abridged), nested parts included
    "final_loss": 7.9,
    "layout": "tp2_dp2",
    "plan_check": {"step_time_ratio": 1.7, "bubble_measured": None, "peak_tflops_per_rank": 0.05},
    "monitor": {"skipped_steps": 0, "bad_steps": [12, 13], "stragglers": {"windows": 3}},
}


def test_wandb_summary_keeps_nested_values():
    flat = metrics.flatten(SUMMARY)
    assert flat == {
        "final_loss": 7.9,
        "layout": "tp2_dp2",
        "plan_check/step_time_ratio": 1.7,
        "plan_check/bubble_measured": None,
        "plan_check/peak_tflops_per_rank": 0.05,
        "monitor/skipped_steps": 0,
        "monitor/bad_steps": [12, 13],
        "monitor/stragglers/windows": 3,
    }


def test_wandb_sink_writes_the_flat_summary(tmp_path, monkeypatch, compose):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    cfg = compose(["logging=wandb", "logging.wandb.mode=offline", "parallelism=single"])
    sink = metrics.WandbSink(cfg, tmp_path, {"model": {"name": "llama3"}})
    assert sink.run.name.startswith("single-")  # the layout that ran
    finish, seen = sink.run.finish, {}

    def finish_after_reading():  # offline runs keep the summary in a binary log; read it from the run first
        seen.update({k: sink.run.summary[k] for k in sink.run.summary.keys()})
        finish()

    monkeypatch.setattr(sink.run, "finish", finish_after_reading)
    sink.close(SUMMARY)
    assert seen["plan_check/step_time_ratio"] == 1.7 and list(seen["monitor/bad_steps"]) == [12, 13]
    assert "plan_check" not in seen


def test_known_harmless_warnings_leave_the_console_only(monkeypatch):
    """runner.run.known_warnings on a console process (local rank 0, the launcher) and on a rank with a log file."""
    import logging
    import warnings

    from runner.run import known_warnings

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    pytree, redistribute = logging.getLogger("torch.utils._pytree"), logging.getLogger("torch.distributed.tensor._redistribute")
    handler = Keep()
    for logger in (pytree, redistribute):
        logger.addHandler(handler)
    enum = "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile as an opaque value type. "
    enum += "Calling register_constant() on Enum subclasses is deprecated and will be an error in a future release."
    norm = "While redistributing from (_NormPartial(2.0), _NormPartial(2.0)) to (Replicate(), Replicate()), 2 sequential all_reduce ops"
    other = "While redistributing from (Shard(0), Shard(1)) to (Replicate(), Replicate()), 2 sequential all_gather ops"

    def emitted(console: bool) -> tuple[list[str], list[str]]:
        records.clear()
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            monkeypatch.setenv("LOCAL_RANK", "0" if console else "1")
            known_warnings.apply(known_warnings.on_console())
            warnings.warn("DTensor random operators may not have complete support on cpu device mesh", UserWarning, stacklevel=1)
            warnings.warn("DTensor random operators may not have complete support on meta device mesh", UserWarning, stacklevel=1)
            pytree.warning(enum)
            redistribute.warning(norm)
            redistribute.warning(other)
        return [str(w.message) for w in got], list(records)

    try:
        assert emitted(console=True) == (["DTensor random operators may not have complete support on meta device mesh"], [other])
        shown, logged = emitted(console=False)  # a rank whose output is its log file: everything, as without the filter
        assert len(shown) == 2 and logged == [enum, norm, other]
    finally:
        known_warnings.apply(False)
        for logger in (pytree, redistribute):
            logger.removeHandler(handler)


def test_library_log_lines_take_the_runners_format(capsys):
    """TorchTitan logs on the root logger: on the console WARNING and up as `WARNING: <message>` (a named logger's name
    before it), everything with logging.verbose; a rank log (not the console) keeps everything."""
    import logging

    from runner.run import console

    root = logging.getLogger()
    before = root.level, list(root.handlers)
    try:
        console.route_logs(verbose=False, console=True)
        root.info("Building device mesh with parallelism: pp=1")
        root.warning("Peak flops undefined")
        logging.getLogger("torchft.manager").error("quorum failed")
        assert capsys.readouterr() == ("", "WARNING: Peak flops undefined\nERROR: torchft.manager: quorum failed\n")
        for verbose, is_console in ((True, True), (False, False)):
            console.route_logs(verbose=verbose, console=is_console)
            root.info("Applied FSDP to the model")
            assert capsys.readouterr() == ("INFO: Applied FSDP to the model\n", "")
    finally:
        root.handlers[:] = before[1]
        root.setLevel(before[0])


def test_a_resumed_schedule_warns_only_in_the_rank_logs(compose):
    """TorchTitan's LRSchedulersContainer.load_state_dict (a resumed run) calls get_lr() outside step(): torch's
    "please use `get_last_lr()`" UserWarning, registered with runner.run.known_warnings, stays off the console; the rate
    it sets is the schedule's at the restored step."""
    import warnings

    import torch

    from runner.run import known_warnings
    from runner.run.titan import optim

    cfg = compose(["training.steps=10"])
    _, fresh = optim.build_optimizer(cfg, [torch.nn.Linear(2, 2)])
    for _ in range(3):
        fresh.step()

    def resumed(console: bool) -> tuple[list[str], float]:
        opt, sched = optim.build_optimizer(cfg, [torch.nn.Linear(2, 2)])
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            known_warnings.apply(console)
            sched.load_state_dict(fresh.state_dict())
        return [str(w.message) for w in got if "get_last_lr" in str(w.message)], sched.schedulers[0].get_last_lr()[0]

    try:
        assert resumed(console=True) == ([], fresh.schedulers[0].get_last_lr()[0])
        shown, _ = resumed(console=False)  # a rank whose output is its log file keeps it
        assert shown == ["To get the last learning rate computed by the scheduler, please use `get_last_lr()`."]
    finally:
        known_warnings.apply(False)


def _documented_keys() -> dict[str, str]:
    """docs/outputs.md's table of metrics.jsonl keys: key -> when it is written ('every row' or a condition)."""
    from tests.conftest import ROOT

    text = (ROOT / "docs/outputs.md").read_text()
    section = text[text.index("## metrics.jsonl, key by key") :]
    section = section[: section.index("\n## ", 1)]
    out = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `"):
            out |= dict.fromkeys((k.strip().strip("`") for k in cells[0].split(",")), cells[1])
    return out


def test_the_documented_metrics_keys_are_the_step_rows_fields():
    """docs/outputs.md lists every key of metrics.jsonl, and only those, with the keys of every row marked alike in the
    doc and the dataclass (a field with no default of None)."""
    from runner.formats import metrics_row

    documented = _documented_keys()
    assert sorted(documented) == sorted(metrics_row.FIELDS | set(metrics.JsonlSink.KEYS))
    every = {k for k, when in metrics.JsonlSink.KEYS.items() if when == "every row"}
    assert sorted(k for k, when in documented.items() if when == "every row") == sorted(metrics_row.ALWAYS | every)
    assert {k: documented[k] for k in metrics.JsonlSink.KEYS} == metrics.JsonlSink.KEYS


def test_a_step_row_leaves_out_what_did_not_happen_and_refuses_an_unknown_key():
    import dataclasses

    import pytest

    from runner.formats.metrics_row import StepRow

    every = {f.name: 1 for f in dataclasses.fields(StepRow) if f.default is dataclasses.MISSING}
    row = StepRow(**every).add({"eval_loss": 2.0, "eval_ppl": 7.4, "eval_s": 0.5})
    assert row.as_json() == every | {"host_syncs": 0, "eval_loss": 2.0, "eval_ppl": 7.4, "eval_s": 0.5}
    with pytest.raises(KeyError, match=r"no field \['eval_perplexity'\]; add it to runner.formats.metrics_row.StepRow"):
        row.add({"eval_perplexity": 7.4})
