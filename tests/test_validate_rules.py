"""Validation reports every problem at once, refuses keys the schema lacks and layouts the plan
says do not fit, and catches settings that silently switch a feature off."""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import typing

import pytest
from omegaconf import OmegaConf, open_dict

from runner import schema
from runner.config import validate
from runner.config.validate import fields, finite
from tests.conftest import run_cli

BIG_405B = [
    *("model=llama3_405b", "parallelism=tp8_pp16", "cluster=h100x1024", "training.seq_len=8192", "training.global_batch_size=2048"),
    "precision.allow_fp32_on_gpu=true",  # float32 on purpose: the memory verdict's figures below are float32's
]


def _problems(compose, overrides: list[str]) -> list:
    with pytest.raises(validate.ConfigError) as e:
        validate.check(compose(overrides))
    return e.value.problems


@pytest.mark.parametrize(
    "overrides,fields",
    [
        (
            ["model=llama3_8b", "parallelism.tp=3", "cluster=h100_node", "precision=bf16"],  # the world size hid the 3 TP problems
            ["parallelism", "parallelism.tp", "parallelism.tp", "training.seq_len"],
        ),
        (
            ["training.steps=0", "precision=mxfp8", "parallelism=tp2_pp2", "training.global_batch_size=3"],  # a bad range used to stop here
            ["training.steps", "training.global_batch_size", "precision.fp8"],
        ),
    ],
)
def test_every_problem_is_reported_at_once(compose, overrides, fields):
    assert [p.field for p in _problems(compose, overrides)] == fields


def test_world_size_problem_does_not_hide_head_divisibility(compose):
    by_why = {p.why for p in _problems(compose, ["model=llama3_8b", "parallelism.tp=3", "cluster=h100_node", "precision=bf16"])}
    assert "must divide model.num_heads = 32 and model.num_kv_heads = 8" in by_why
    assert "a TP group must fit inside one node of 8 devices (cluster h100_node) and divide it" in by_why


@pytest.mark.parametrize(
    "override,field,fix",
    [
        ("+parallelism.bogus_field=1", "parallelism.bogus_field", "remove it; the fields here are name, dp_replicate, dp_shard"),
        ("+training.lr_warmup=100", "training.lr_warmup", "did you mean lr_scheduler.warmup_steps?"),
        ("++monitor.guard.windw=5", "monitor.guard.window", None),
    ],
)
def test_keys_added_with_plus_are_rejected(compose, override, field, fix):
    with pytest.raises(validate.ConfigError) as e:
        compose([override])
    (p,) = e.value.problems
    if fix is None:  # the typo'd key is named; the close match is suggested
        assert p.field == "monitor.guard.windw" and "did you mean monitor.guard.window" in p.fix
    else:
        assert p.field == field and p.fix.startswith(fix)
        assert "a `+` override adds keys the schema does not have" in p.why


@pytest.mark.e2e
def test_cli_rejects_a_plus_key_but_keeps_plus_groups_and_hydra_keys(tmp_path):
    proc = run_cli("+training.lr_warmup=100", "mode=validate", run_dir=tmp_path / "bad")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "training.lr_warmup = 100: not a field of TrainingConfig" in proc.stderr
    assert not (tmp_path / "bad").exists()
    (tmp_path / "conf" / "point").mkdir(parents=True)
    (tmp_path / "conf" / "point" / "a.yaml").write_text("# @package _global_\ntraining:\n  steps: 3\n")
    ok = run_cli("--config-dir", str(tmp_path / "conf"), "+point=a", "+hydra.job.env_set.RUNNER_PROBE=1", "mode=validate")
    assert ok.returncode == 0, ok.stderr
    assert "config OK" in ok.stdout


def test_guard_warmup_longer_than_window_is_refused(compose):
    (p,) = _problems(compose, ["monitor.guard.warmup_steps=21", "monitor.guard.window=20"])
    assert p.field == "monitor.guard.warmup_steps" and "exceeds monitor.guard.window = 20" in p.why
    assert p.fix == "use monitor.guard.warmup_steps <= 20, or monitor.guard.window >= 21"
    validate.check(compose(["monitor.guard.warmup_steps=20", "monitor.guard.window=20"]))  # equal: detection starts at step 21
    validate.check(compose(["monitor.guard.warmup_steps=50", "monitor.guard.enable=false"]))  # off on purpose: nothing to warn about


def test_validation_applies_the_plans_memory_verdict(compose, budget):
    (p,) = _problems(compose, [*BIG_405B, "mode=validate"])
    b = budget([*BIG_405B, "mode=plan"])  # mode=plan prints the verdict as its memory row instead of refusing
    assert b["fits_memory"] is False
    assert p.field == "parallelism" and p.value == "pp=16 x dp_shard=8 x tp=8"
    assert p.why.startswith(f"needs {b['total_gb_per_gpu']:.1f} GB per GPU (weights + gradients 26.4, optimizer 4.8, activations 570.0")
    assert "more than the 80 GB of a h100x1024 GPU (cluster.device_memory_gb)" in p.why
    for fix in ("raise parallelism.pp or parallelism.tp", "training.activation_checkpoint=full", "lower training.microbatch_size"):
        assert fix in p.fix
    fitted = compose([*BIG_405B, "precision=bf16", "training.microbatch_size=1", "training.activation_checkpoint=full", "mode=validate"])
    assert validate.check(fitted).world_size == 1024


SLURM = [
    *("cluster=slurm_h100", "cluster.num_nodes=2", "cluster.slurm.partition=gpu"),
    *("parallelism=fsdp", "precision=bf16", "training.global_batch_size=32"),
]


def test_a_job_too_short_for_its_signal_gets_a_fix_that_fits(compose):
    """time_min=1 with signal_s at its default 120 was told "e.g. 120", the very value refused."""
    (p,) = _problems(compose, [*SLURM, "cluster.slurm.time_min=1"])
    assert (p.field, p.value) == ("cluster.slurm.signal_s", 120)
    assert p.fix == (
        "give the seconds a step and a checkpoint need, below 60, e.g. cluster.slurm.signal_s=30, or cluster.slurm.time_min=3 to keep it"
    )
    for fix in ("cluster.slurm.signal_s=30", "cluster.slurm.time_min=3"):
        validate.check(compose([*SLURM, "cluster.slurm.time_min=1", fix]))


@pytest.mark.parametrize(
    "overrides,problem",
    [
        (["mode=search", "search.top_k=-1"], "search.top_k = -1: must be >= 1. Fix: set search.top_k to at least 1."),
        (["parallelism.ep=0"], "parallelism.ep = 0: a degree must be >= 1. Fix: use 1 to turn the axis off."),
        (["model.rope_max_seq_len=0"], "model.rope_max_seq_len = 0: must be >= 1. Fix: copy it from TorchTitan's registry for the flavor."),
    ],
)
def test_a_bad_value_is_one_problem_not_a_second_rule_misled_by_it(compose, overrides, problem):
    """search.top_k=-1 also refused search.verify = 0 ("set search.verify to at most -1, or search.top_k=0"), ep=0 was
    also "expert parallelism needs a mixture-of-experts model", and rope_max_seq_len=0 also told seq_len "use <= 0"."""
    assert [str(p) for p in _problems(compose, overrides)] == [problem]


def _float_fields(kind: type = schema.RunConfig, prefix: str = "") -> list[tuple[str, typing.Callable]]:
    """Every float the schema holds, as (key, what to set there to put a number in it): fields, mapping values, the
    fields of list items."""
    out = []
    for name, hint in typing.get_type_hints(kind).items():
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(hint):
            out += _float_fields(hint, f"{key}.")
        elif hint is float:
            out.append((key, lambda v: v))
        elif typing.get_origin(hint) is dict and typing.get_args(hint)[-1:] == (float,):  # dict[str, float]
            out.append((key, lambda v: {"float32": v}))
        elif typing.get_origin(hint) is list and typing.get_args(hint) == (float,):  # list[float]
            out.append((key, lambda v: [v, 0.5]))
        elif typing.get_origin(hint) is list and dataclasses.is_dataclass(item := typing.get_args(hint)[0]):
            out += [(key, lambda v, f=f: [{f: v}]) for f, h in typing.get_type_hints(item).items() if h is float]
    return out


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_every_float_field_refuses_a_non_finite_number(bad):
    """nan passed every bound ("more than the nan GB") and inf every lower one ("fits in inf GB")."""
    from runner.config import compose

    fields = _float_fields()
    assert len(fields) >= 25 and "cluster.device_memory_gb" in dict(fields)  # the walk sees the schema's floats
    base = compose.compose_dict([])
    for key, value in fields:
        cfg = copy.deepcopy(base)
        with open_dict(cfg):  # peak_tflops has no key of its own to set
            OmegaConf.update(cfg, key, value(bad))
        if key in finite.ALLOWED:
            compose.to_object(cfg)
            continue
        with pytest.raises(validate.ConfigError) as e:
            compose.to_object(cfg)
        (p,) = e.value.problems
        assert p.field.startswith(key) and p.why == "not a finite number (no bound can judge nan or inf)", key


def test_nan_device_memory_names_the_field_not_a_nan_budget(compose):
    with pytest.raises(validate.ConfigError) as e:
        compose(["cluster=h100_node", "parallelism=fsdp", "training.global_batch_size=16", "cluster.device_memory_gb=nan"])
    assert str(e.value) == (
        "Invalid config (1 problem):\n  - cluster.device_memory_gb = nan: not a finite number (no bound can judge nan or inf). "
        "Fix: use a finite number, e.g. cluster.device_memory_gb=0."
    )


@pytest.mark.parametrize(
    "overrides,warning",
    [
        (
            ["training.steps=1"],  # the smoke test: the default warm-up of 2 steps
            "lr_scheduler.warmup_steps = 2: warm-up 2 steps are longer than training.steps = 1; the run warms up over 1 and "
            "decays over 0 (TorchTitan's clipping). Fix: lr_scheduler.warmup_steps=1 configures that schedule and silences "
            "this warning.",
        ),
        (
            ["lr_scheduler.warmup_steps=3", "lr_scheduler.decay_ratio=0.8", "training.steps=10"],
            "lr_scheduler.warmup_steps = 3: warm-up 3 + decay 8 (decay_ratio 0.8) steps are longer than training.steps = 10; "
            "the run warms up over 3 and decays over 7 (TorchTitan's clipping). Fix: lr_scheduler.decay_ratio=null configures "
            "that schedule and silences this warning.",
        ),
        (
            ["lr_scheduler.warmup_steps=100000", "lr_scheduler.decay_ratio=0.5", "training.steps=10"],
            "lr_scheduler.warmup_steps = 100000: warm-up 100000 + decay 5 (decay_ratio 0.5) steps are longer than "
            "training.steps = 10; the run warms up over 10 and decays over 0 (TorchTitan's clipping). "
            "Fix: lr_scheduler.warmup_steps=10 lr_scheduler.decay_ratio=null configures that schedule and silences this warning.",
        ),
    ],
)
def test_a_schedule_longer_than_the_run_is_clipped_with_one_warning(compose, overrides, warning):
    """TorchTitan clips a warm-up or decay that does not fit in training.steps ("Adjusting warmup steps"): the runner
    validates it, prints one line saying what the run trains, and the line's fix configures exactly that schedule."""
    cfg = compose(overrides)
    validate.check(cfg)
    assert [str(w) for w in validate.warnings(cfg)] == [warning]
    fixed = compose([*overrides, *warning.split("Fix: ")[1].split(" configures")[0].split()])
    assert validate.warnings(fixed) == [] and fields.schedule_steps(fixed) == fields.schedule_steps(cfg)


def test_the_schedules_own_numbers_are_refused(compose):
    """What is wrong in itself (a negative warm-up, a share outside [0, 1], NaN) is still refused, and a schedule that
    fits draws no warning."""
    for fits in (["lr_scheduler.warmup_steps=10", "training.steps=10"], ["lr_scheduler.decay_ratio=0.8", "training.steps=10"]):
        validate.check(compose(fits))
        assert validate.warnings(compose(fits)) == []
    cases = [
        (["lr_scheduler.warmup_steps=-1"], "lr_scheduler.warmup_steps = -1: must be >= 0. Fix: use 0 for no warm-up"),
        (["lr_scheduler.decay_ratio=nan"], "lr_scheduler.decay_ratio = nan: "),
        (
            ["lr_scheduler.decay_ratio=1.5"],
            "lr_scheduler.decay_ratio = 1.5: a share of training.steps must be in [0, 1]. Fix: use e.g. 0.2",
        ),
        (["lr_scheduler.min_lr_factor=-0.1"], "lr_scheduler.min_lr_factor = -0.1: must be in [0, 1] (a share of optimizer.lr). Fix: use"),
        (
            ["optimizer.betas=[0.9,1.0]"],
            "optimizer.betas = [0.9, 1.0]: Adam takes two betas, each in [0, 1). Fix: use optimizer.betas=[0.9,0.95]",
        ),
        (["optimizer.eps=0"], "optimizer.eps = 0.0: must be > 0 (it keeps the update finite). Fix: use e.g. 1e-8"),
        (
            ["optimizer.param_groups=[{pattern:'norm(',weight_decay:0}]"],
            "optimizer.param_groups[0].pattern = norm(: not a regular expression",
        ),
    ]
    for overrides, message in cases:
        with pytest.raises(validate.ConfigError) as e:
            validate.check(compose(overrides))
        assert [str(p) for p in e.value.problems if str(p).startswith(message)], (message, [str(p) for p in e.value.problems])


@pytest.mark.parametrize(
    "override,field",
    [
        ("optimizer.param_groups=[{pattern:norm,weight_decay:0.0},{pattern:'wo\\.weight',weight_decay:abc}]", "[1].weight_decay"),
        ("optimizer.param_groups=[{pattern:norm,weight_decay:-1}]", "[0].weight_decay"),
        ("optimizer.param_groups=[{pattern:'wo\\.weight',weight_decay:0.0},{pattern:'norm(',weight_decay:0.0}]", "[1].pattern"),
    ],
    ids=["wrong_type", "negative", "not_a_regex"],
)
def test_a_wrong_field_of_a_param_group_is_named_by_index_with_a_fix_that_works(compose, override, field):
    """A group's field is named with its index (`optimizer.param_groups[1].weight_decay`, not `...param_groups.weight_decay`)
    and the fix is the whole override with that value corrected, which then composes and validates."""
    with pytest.raises(validate.ConfigError) as e:
        validate.check(compose([override]))
    (p,) = e.value.problems
    assert p.field == f"optimizer.param_groups{field}", str(p)
    fix = re.search(r"(optimizer\.param_groups=\[.*\])", p.fix)[1]
    validate.check(compose([fix]))


@pytest.mark.parametrize(
    "overrides,field,words",
    [
        (["parallelism=dp2_pp2"], "parallelism.pp", "with pipeline parallelism"),
        # a GPU cluster: CPU ranks refuse MLA under CP for a reason of their own (runner.config.family_support)
        (
            ["parallelism=cp2", "parallelism.dp_shard=-1", "cluster=h100_node", "precision=bf16"],
            "parallelism.cp",
            "with context parallelism",
        ),
    ],
)
def test_mtp_under_pp_or_cp_is_refused_as_titan_refuses_it(compose, overrides, field, words):
    """TorchTitan 0.3.0's MTPDecoder.Config.update_from_config raises NotImplementedError for MTP with PP or CP: the
    config is refused before any rank starts, with the way out; without MTP the same layout validates."""
    mtp = ["model=debug_moe", "model.num_mtp_layers=1", "training.global_batch_size=8", *overrides]
    problems = [p for p in _problems(compose, mtp) if p.field == field]
    assert len(problems) == 1 and words in problems[0].why and "model.num_mtp_layers = 1" in problems[0].why
    assert problems[0].fix == f"use {field}=1 (FSDP, TP or EP instead), or model.num_mtp_layers=0"
    validate.check(compose([*mtp[:1], *mtp[2:]]))
