"""The torch-free config layer: every config file composes and validates; bad input is
rejected with field, value and fix, exit code 2, no traceback and no run folder."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from runner.config import families, validate
from runner.estimate import host_memory, memory, plan
from runner.schema import Mode, layout
from tests import import_graph, in_process, text_assets
from tests.conftest import ROOT, run_cli

# Options that need a context to validate (the rest validate with the defaults).
CONTEXT = {
    "parallelism/fsdp.yaml": ["cluster.devices_per_node=4"],
    "fault_tolerance/torchft.yaml": ["parallelism=hsdp2x2"],  # torchft needs dp_replicate >= 2
    "parallelism/tp8_pp4.yaml": ["recipe=llama3_70b_h100x1024"],
    "parallelism/tp4_pp4.yaml": ["recipe=llama3_70b_h100x1024"],
    # 405B at seq 8192 with 1F1B keeps pp microbatches in flight on the first stage: 91.7 GB per GPU at pp=16 without
    # activation checkpointing (the dry run measured more), so these contexts checkpoint
    "parallelism/tp8_pp8.yaml": ["recipe=llama3_70b_h100x1024", "model=llama3_405b", "training.activation_checkpoint=full"],
    "parallelism/tp8_pp16.yaml": ["recipe=llama3_70b_h100x1024", "model=llama3_405b", "training.activation_checkpoint=full"],
    "parallelism/tp8_pp16_cp16.yaml": [
        "recipe=llama3_70b_h100x1024",
        "model=llama3_405b",
        "cluster.num_nodes=2048",
        "training.seq_len=131072",
        "training.global_batch_size=128",
        "training.activation_checkpoint=full",  # 16 microbatches in flight x 4.5 GB of activations do not fit in 80 GB without it
    ],
    "parallelism/ep2.yaml": ["model=debug_moe"],
    "model/llama3_8b.yaml": ["parallelism=single"],
    "model/llama3_70b.yaml": ["recipe=llama3_70b_h100x1024"],
    "model/llama3_405b.yaml": ["recipe=llama3_70b_h100x1024", "parallelism=tp8_pp16", "training.activation_checkpoint=full"],
    # a GPU cluster refuses the CPU default precision=fp32 (validate.fields): these contexts compute in bf16
    "cluster/h100_node.yaml": ["parallelism=fsdp", "precision=bf16", "training.global_batch_size=16"],
    "cluster/h100x1024.yaml": ["parallelism=fsdp", "precision=bf16", "training.global_batch_size=2048"],
    "cluster/slurm_h100.yaml": [
        "cluster.num_nodes=2",
        "cluster.slurm.partition=gpu",
        "parallelism=fsdp",
        "precision=bf16",
        "training.global_batch_size=32",
    ],
    "cluster/b200_node.yaml": ["parallelism=fsdp", "precision=bf16", "training.global_batch_size=16"],
    "cluster/a100_node.yaml": ["parallelism=fsdp", "precision=bf16", "training.global_batch_size=16"],
    "cluster/h100_96gb_node.yaml": ["parallelism=fsdp", "precision=bf16", "training.global_batch_size=16"],
    "cluster/h100x64.yaml": ["parallelism=fsdp", "precision=bf16", "training.global_batch_size=128"],
    "cluster/h800x2048.yaml": ["parallelism=fsdp", "precision=bf16", "training.global_batch_size=4096"],
    "precision/mxfp8.yaml": ["cluster=b200_node", "parallelism=fsdp", "training.global_batch_size=16"],
    # a GPU's datasheet is picked by a cluster file (conf/cluster/*.yaml): tried under an 8-GPU node
    **{
        f"gpu/{p.name}": ["cluster=h100_node", "parallelism=fsdp", "precision=bf16", "training.global_batch_size=16"]
        for p in ROOT.glob("conf/gpu/*.yaml")
    },
    # Qwen3.5's Gated DeltaNet runs only as Triton kernels: its options validate for GPU clusters, not local_cpu
    **{
        # the MoE flavors with EP: FSDP alone would gather all 512 experts of a block on every GPU
        f"model/{p.name}": ["cluster=h100x1024", "parallelism=fsdp", "precision=bf16", "training.global_batch_size=2048"]
        + (["parallelism.ep=8"] if "num_experts:" in p.read_text() else [])
        for p in ROOT.glob("conf/model/qwen3_5_*.yaml")
    },
    # gpt-oss's sinks and sliding window need FlexAttention, which has no CPU backward (runner.config.family_support)
    **{f"model/{p.name}": ["recipe=gpt_oss_120b_h100x64"] for p in ROOT.glob("conf/model/gpt_oss_*.yaml")},
}


def _config_files():
    files = sorted(
        p.relative_to(ROOT).as_posix()
        for d in ("conf", "recipes", "sweeps")
        for p in (ROOT / d).rglob("*.yaml")
        if not p.relative_to(ROOT).as_posix().startswith(("conf/recipe/", "conf/sweep/"))  # symlinks to the top-level folders
    )
    assert len(files) >= 25, files  # a non-recursive listing once validated 3 of 197 files
    return files


def _overrides(path: str) -> list[str]:
    top, _, rest = path.partition("/")
    if top == "conf" and rest == "config.yaml":
        return []
    if top == "conf":
        group, option = rest.rsplit("/", 1)
        ctx = CONTEXT.get(rest, [])
        key = "gpu@cluster" if group == "gpu" else group  # the datasheet a cluster's defaults list picks (/gpu@_here_)
        return [*ctx, f"{key}={option.removesuffix('.yaml')}"]
    group = {"recipes": "recipe", "sweeps": "sweep"}[top]
    return [f"{group}={rest.removesuffix('.yaml')}"]


@pytest.mark.parametrize("path", _config_files())
def test_every_config_file_composes_and_validates(compose, path, tmp_path):
    extra = []
    if path == "conf/data/text.yaml":  # validation reads the files: give it a real corpus and tokenizer
        corpus, tokenizer = text_assets.make(tmp_path)
        extra = [f"data.files=[{corpus}]", f"data.tokenizer={tokenizer}"]
    if path == "conf/data/tokens.yaml":  # validation reads the prepared folder: prepare one
        extra = [f"data.path={text_assets.prepared(tmp_path)}"]
    if path == "recipes/llama3_8b_continue_h100x64.yaml":  # validation reads config.json and the index, and the tokens
        from tests.hf_models import published_llama

        extra = [f"data.path={text_assets.prepared(tmp_path)}", f"model.init_from={published_llama(tmp_path / 'hf', '8B')}"]
    cfg = compose([*extra, *_overrides(path), "mode=validate"])
    lay = validate.check(cfg)
    p, c = cfg.parallelism, cfg.cluster
    assert (lay.pp, lay.dp_replicate, lay.cp, lay.tp, lay.ep) == (p.pp, p.dp_replicate, p.cp, p.tp, p.ep)
    if c.devices_per_node == -1:  # local CPU: the layout sizes the job, so every degree is given
        assert (c.num_nodes, lay.dp_shard, lay.world_size) == (1, p.dp_shard, p.pp * p.dp_replicate * p.dp_shard * p.cp * p.tp)
    else:
        assert lay.world_size == c.num_nodes * c.devices_per_node
        assert lay.dp_shard == (p.dp_shard if p.dp_shard != -1 else lay.world_size // (p.pp * p.dp_replicate * p.cp * p.tp))
    assert cfg.mode == Mode.validate


def test_model_files_name_their_titan_flavor(compose):
    flavors = {m: compose([f"model={m}", "parallelism=single"]).model.flavor for m in ("debug", "llama3_8b", "llama3_70b", "llama3_405b")}
    assert flavors == {"debug": "debugmodel", "llama3_8b": "8B", "llama3_70b": "70B", "llama3_405b": "405B"}


def test_seed_layout_resolves_to_worked_example(compose):
    cfg = compose(["recipe=llama3_70b_h100x1024"])
    lay = validate.check(cfg)
    assert (lay.world_size, lay.tp, lay.pp, lay.dp) == (1024, 8, 4, 32)
    assert cfg.training.global_batch_size // (lay.dp * cfg.training.microbatch_size) == 32  # m = 32 microbatches


BAD = [
    (
        ["cluster=h100_node", "parallelism=fsdp", "cluster.worker_start=fork"],
        "cluster.worker_start = fork: a CUDA rank forked from an agent that has imported torch cannot initialize CUDA reliably. "
        "Fix: use cluster.worker_start=exec",
    ),
    (
        ["cluster=h100_node", "parallelism.dp_shard=3"],
        "parallelism = pp x dp_replicate x dp_shard x cp x tp = 6: must equal the world size 8",
    ),
    (
        ["cluster=h100_node", "parallelism.dp_shard=-1", "parallelism.tp=3"],
        "the world size 8 (cluster h100_node), so dp_shard=-1 cannot absorb",
    ),
    (
        ["parallelism.tp=3"],
        "parallelism.tp = 3: must divide model.num_heads = 16 and model.num_kv_heads = 16. Fix: use tp in [1, 2, 4, 8, 16]",
    ),
    (
        ["model=llama3_8b", "parallelism=fsdp", "cluster=h100_node", "parallelism.tp=16", "parallelism.dp_shard=1", "cluster.num_nodes=2"],
        "parallelism.tp = 16: a TP group must fit inside one node of 8 devices",
    ),
    (
        [
            "parallelism.pp=4",
            "parallelism.dp_shard=1",
            "parallelism.tp=1",
            "parallelism.pp_schedule=Interleaved1F1B",
            "parallelism.pp_virtual_stages=3",
        ],
        "parallelism.pp = 4: model.num_layers = 6 (+ 1 for the embedding, + 1 for the head) cannot be split into "
        "pp x pp_virtual_stages = 12 stages: 12 stages for 8 effective layers would leave stages empty",
    ),
    (
        ["parallelism=single", "parallelism.pp=2", "training.global_batch_size=2", "training.microbatch_size=2"],
        "training.global_batch_size = 2: gives m = 1 microbatches per pipeline; 1F1B needs at least as many microbatches as stages (2). "
        "Fix: use global_batch_size >= 4 or a smaller training.microbatch_size",
    ),
    (
        ["parallelism=dp2_pp2", "parallelism.pp_schedule=Interleaved1F1B"],
        "parallelism.pp_virtual_stages = 1: Interleaved1F1B is a looped schedule and needs at least 2 stages per rank. "
        "Fix: set parallelism.pp_virtual_stages=2",
    ),
    (
        ["parallelism=pp2_interleaved", "parallelism.pp_schedule=1F1B"],
        "parallelism.pp_virtual_stages = 2: 1F1B runs one stage per rank",
    ),
    (
        ["parallelism=pp2_interleaved", "parallelism.pp_schedule=ZBVZeroBubble", "parallelism.pp_virtual_stages=3"],
        "ZBVZeroBubble is a V-shaped schedule and needs exactly 2 stages per rank",
    ),
    (
        ["parallelism=pp2_interleaved", "parallelism.pp_schedule=DualPipeV", "training.global_batch_size=6"],
        "gives m = 3 microbatches per pipeline; DualPipeV needs at least as many microbatches as stages (pp x v = 4)",
    ),
    (
        ["parallelism=pp2_interleaved", "training.global_batch_size=10", "training.microbatch_size=2"],
        "gives m = 5 microbatches per pipeline; Interleaved1F1B runs m // pp = 2 rounds and needs m to be a multiple of them",
    ),
    (["parallelism=dp2_pp2", "parallelism.pp_schedule=Zigzag"], "parallelism.pp_schedule = Zigzag: not a pipeline schedule"),
    (
        ["parallelism=tp2", "parallelism.async_tp=true", "training.compile=true"],
        "parallelism.async_tp = True: async TP overlaps TP collectives with matmuls through Inductor's micro-pipeline TP pass "
        "on CUDA symmetric memory (torch.distributed._symmetric_memory); cluster local_cpu computes on cpu with gloo",
    ),
    (
        ["recipe=llama3_70b_h100x1024", "parallelism.async_tp=true"],
        "parallelism.async_tp = True: async TP is a torch.compile (Inductor) pass, and training.compile is false. "
        "Fix: set training.compile=true",
    ),
    (["training.global_batch_size=6"], "training.global_batch_size = 6: must be divisible by DP degree 2 x training.microbatch_size 2 = 4"),
    (["parallelism=tp2", "training.seq_len=63"], "training.seq_len = 63: sequence parallelism splits the sequence over tp = 2"),
    (
        ["parallelism=single", "parallelism.cp=2", "training.seq_len=66"],
        "training.seq_len = 66: context parallelism with load balancing splits the sequence into 2 x cp = 4",
    ),
    (["cluster.backend=nccl"], "cluster.backend = nccl: NCCL needs CUDA devices; cluster.device is cpu. Fix: use cluster.backend=gloo"),
    (["parallelism=fsdp"], "parallelism.dp_shard = -1: cluster local_cpu takes its world size from the layout"),
    (
        ["cluster=h100_node", "parallelism=fsdp", "training.global_batch_size=16", "~cluster.peak_tflops.bfloat16", "precision=bf16"],
        "cluster.peak_tflops = {'float32': 67.0, 'float8': 1979.0}: has no dense peak for bfloat16",
    ),
    (["parallelism.ep=2", "parallelism.dp_shard=1"], "parallelism.ep = 2: expert parallelism needs a mixture-of-experts model"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_validation_rejects(refusal, overrides, message):
    assert message in refusal(overrides)


def test_all_problems_reported_at_once(compose):
    with pytest.raises(validate.ConfigError) as e:
        validate.check(compose(["parallelism.tp=3", "training.global_batch_size=7"]))
    assert str(e.value).startswith("Invalid config (3 problems):")
    assert [p.field for p in e.value.problems] == ["parallelism.tp", "training.seq_len", "training.global_batch_size"]


def test_launch_rules(compose, tmp_path):
    cfg = compose(["recipe=llama3_8b_fsdp8_h100"])
    lay = validate.check(cfg)  # a valid config for a real node ...
    with pytest.raises(validate.ConfigError, match="this machine has no NVIDIA driver"):
        validate.preflight(cfg, tmp_path, lay)  # ... that this CPU machine cannot start
    seed = compose(["recipe=llama3_70b_h100x1024"])
    with pytest.raises(validate.ConfigError) as e:
        validate.preflight(seed, tmp_path, validate.check(seed))
    assert [p.field for p in e.value.problems] == ["cluster.num_nodes", "cluster.device"]  # its pp=4 is not refused on CUDA
    assert "starts the ranks of one node; a multi-node job starts the per-node launcher on every node" in str(e.value)
    big = compose(["parallelism=fsdp", "cluster.devices_per_node=64", "training.global_batch_size=128"])
    with pytest.raises(validate.ConfigError) as e:
        validate.preflight(big, tmp_path, validate.check(big))
    per_rank = host_memory.cpu_rank_gb(big, validate.check(big))
    assert f"64 ranks x {per_rank:.2f} GB estimated = {64 * per_rank:.1f} GB exceeds this machine's" in str(e.value)


def test_rank_memory_estimate_of_debug_rank(compose):
    """The CPU estimate uses the plan's activation model: Korthikanti's s*b*h*34/tp with SP at fp32 (x 4/2),
    no attention-score term (CPU SDPA is the fused flash kernel), and recomputation's 2*s*b*h/tp with AC."""
    cfg = compose([])
    lay = validate.check(cfg)
    # 6,163,712 params x 16 B / (fsdp 2 x tp 2) + activations 6 layers x 256 x 2 x 256 x 34 / 2 x 2 + logits 3 x 256 x 2 x 2048 x 4
    want = 0.6 + (6_163_712 * 16 / 4 + 6 * 256 * 2 * 256 * 34 + 3 * 256 * 2 * 2048 * 4) / 1e9
    assert host_memory.cpu_rank_gb(cfg, lay) == pytest.approx(want)
    ac = compose(["training.activation_checkpoint=full"])
    want_ac = want - 6 * 256 * 2 * 256 * (34 - 2) / 1e9
    assert host_memory.cpu_rank_gb(ac, validate.check(ac)) == pytest.approx(want_ac)
    per_layer = memory.activation_bytes_per_layer(cfg, lay, recompute=False)
    assert per_layer == 256 * 2 * 256 * 34 / 2 * 2
    assert plan.compute(cfg, lay)["activations_gb_per_microbatch_worked_example"] == pytest.approx(
        6 * per_layer / 1e9
    )  # the worked example's budget uses it


def test_layout_coordinates_tp_fastest():
    lay = layout.Layout(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=2)
    assert lay.coords(5) == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1}
    assert [lay.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def _no_traceback_exit2(proc):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.e2e
@pytest.mark.parametrize(
    "args,message",
    [
        (["parallelism.tp=3"], "parallelism.tp = 3: must divide model.num_heads"),
        (["training.stepz=3"], "training.stepz = 3: not a field of TrainingConfig (override training.stepz=3)"),
        (
            ["training.steps=abc"],
            "Invalid config (1 problem):\n  - training.steps = abc: not an integer (override training.steps=abc). "
            "Fix: use an integer, e.g. training.steps=10.",
        ),
        (["parallelism=nope"], "parallelism = nope: not an option of the parallelism group (override parallelism=nope)"),
        (
            ["precision.param_dtype=float16"],
            "precision.param_dtype = float16: not one of float32, bfloat16 (override precision.param_dtype=float16). "
            "Fix: use one of float32, bfloat16, e.g. precision.param_dtype=float32.",
        ),
    ],
)
def test_cli_rejects_with_exit_2_and_leaves_nothing(tmp_path, args, message):
    run_dir = tmp_path / "run"
    proc = run_cli(*args, run_dir=run_dir)
    _no_traceback_exit2(proc)
    assert message in proc.stderr
    assert not run_dir.exists()


def test_a_refused_config_leaves_nothing_in_outputs(monkeypatch, capsys, tmp_path):
    """Every refusal after Hydra made the run folder (outputs/<date>/<time> of the folder it starts in) removes it, with
    what the runner wrote before refusing: a dry run whose CUDA rehearsal cannot start left .hydra/, frozen.yaml and
    runner.log. A run folder that held a run when the task began is kept as it was."""
    from runner.run.dryrun import cuda_env

    monkeypatch.setattr(cuda_env, "find_python", lambda root: None)  # no .venv-cuda, whatever this machine has
    monkeypatch.chdir(tmp_path)
    blocker, shared = tmp_path / "a-file", tmp_path / "shared"
    blocker.write_text("")
    refusals = {
        "the CUDA rehearsal, after the frozen file": (
            *("mode=dryrun", "dryrun.device=cuda", "cluster=h100_node", "parallelism=fsdp", "precision=bf16"),
            "training.global_batch_size=16",
        ),
        "a rule of the config": ("parallelism.tp=3",),
        "mode=train's preflight": ("checkpoint=local", f"checkpoint.local.folder={blocker}"),
        "mode=validate's preflight": (
            "mode=validate",
            "checkpoint=local",
            f"checkpoint.folder={shared}",
            f"checkpoint.local.folder={shared}",
        ),
    }
    for what, argv in refusals.items():
        code, err = in_process.cli(monkeypatch, capsys, *argv)
        assert code == 2 and "Traceback" not in err, (what, err)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"], (what, err)
    held = tmp_path / "held"
    held.mkdir()
    (held / "frozen.yaml").write_text("a run\n")
    code, err = in_process.cli(monkeypatch, capsys, f"hydra.run.dir={held}")
    assert code == 2 and "already holds a run" in err and (held / "frozen.yaml").read_text() == "a run\n"


def test_ctrl_c_before_a_launch_is_one_line_and_exit_130(monkeypatch, capsys, tmp_path):
    """Ctrl-C while a check runs (here in mode=validate's preflight, which opens the files a run reads; any mode that
    trains nothing ends the same way) or while Hydra composes: one line, exit 130, and no run folder left behind."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(validate, "preflight", ctrl_c)
    code, err = in_process.cli(monkeypatch, capsys, "mode=validate", f"hydra.run.dir={tmp_path / 'out' / 'run'}")
    assert (code, err) == (130, "interrupted: mode=validate stopped before it finished; nothing was started\n")
    assert list(tmp_path.iterdir()) == []  # out/ and out/run/, made by Hydra, removed
    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", ctrl_c)
    code, err = in_process.cli(monkeypatch, capsys, "mode=validate", f"hydra.run.dir={tmp_path / 'out' / 'run'}")
    assert (code, err, list(tmp_path.iterdir())) == (130, "interrupted\n", [])


@pytest.fixture
def frozen(compose, tmp_path):
    """A run folder holding the frozen file of the default config."""
    from runner.config import freeze

    cfg = compose([])
    (tmp_path / "run").mkdir()
    return freeze.write(cfg, validate.check(cfg), tmp_path / "run")


@pytest.mark.parametrize(
    "new,first",
    [
        ("\tsteps: 10", "{n}:1: found character '\\t' that cannot start any token (while scanning for the next token)"),
        ("  steps: 10\n  steps: 20", "{n+1}:3: found duplicate key steps (while constructing a mapping at line {n})"),
        ("  steps: [10", "{n+1}:7: expected ',' or ']', but got ':' (while parsing a flow sequence at line {n})"),
    ],
    ids=["tab", "duplicate key", "unclosed list"],
)
def test_a_yaml_error_in_a_frozen_file_names_file_line_and_column(monkeypatch, capsys, tmp_path, frozen, new, first):
    """Hydra printed its traceback (54-80 lines) for these; now the first line is `file:line:column: what`."""
    text = frozen.read_text()
    n = text.splitlines().index("  steps: 10") + 1
    frozen.write_text(text.replace("\n  steps: 10\n", f"\n{new}\n", 1))
    code, err = in_process.cli(
        monkeypatch, capsys, "--config-dir", str(frozen.parent), "--config-name", "frozen", f"hydra.run.dir={tmp_path / 'r'}"
    )
    assert code == 2 and "Traceback" not in err
    head, fix = err.splitlines()
    assert head == f"{frozen}:" + first.replace("{n+1}", str(n + 1)).replace("{n}", str(n))
    assert fix.startswith("Fix: ") and not (tmp_path / "r").exists()


def test_a_frozen_file_cut_short_is_refused_naming_it(monkeypatch, capsys, tmp_path, frozen):
    """Cut at a line boundary a frozen file is still valid YAML, and the replay ran the schema's defaults for what it
    lost (noticed only when the default batch of 8 failed the batch rule)."""
    from runner.config import freeze

    lines = frozen.read_text().splitlines(keepends=True)
    assert lines[-1] == freeze.END + "\n" and freeze.cut_short(frozen) is None
    assert freeze.load(frozen).training.steps == 10  # a whole file loads
    cut = lines[: lines.index("training:\n") + 2]  # ... up to `  steps: 10`
    frozen.write_text("".join(cut))
    code, err = in_process.cli(
        monkeypatch, capsys, "--config-dir", str(frozen.parent), "--config-name", "frozen", f"hydra.run.dir={tmp_path / 'r'}"
    )
    assert code == 2 and not (tmp_path / "r").exists()
    assert err.splitlines()[0] == (
        f"{frozen}:{len(cut)}:12: the file ends here, without the line that ends every frozen file ({freeze.END!r}): "
        "it was cut short, and a replay would fill what it lost with the schema's defaults"
    )
    with pytest.raises(ValueError, match="it was cut short"):
        freeze.load(frozen)  # the ranks' load refuses it too
    whole = "".join(lines)
    frozen.write_text(whole[: whole.index("created: '") + 15])  # cut mid-line, inside a quoted value
    code, err = in_process.cli(monkeypatch, capsys, "--config-dir", str(frozen.parent), "--config-name", "frozen")
    assert code == 2 and err.startswith(f"{frozen}:{whole[: whole.index('created: ')].count(chr(10)) + 1}:18: the file ends here")


def test_a_value_of_the_wrong_type_is_a_problem_naming_type_and_example(monkeypatch, capsys, compose):
    """OmegaConf's raw "Value '[1, 2]' of type 'list' could not be converted to Float" and Hydra's "Set the environment
    variable HYDRA_FULL_ERROR=1" became a Problem like every other: field, value, the type, an example."""
    with pytest.raises(validate.ConfigError) as e:
        compose(["cluster.device_memory_gb=[1,2]"])
    assert [str(p) for p in e.value.problems] == [
        "cluster.device_memory_gb = [1, 2]: not a number (override cluster.device_memory_gb=[1,2]). "
        "Fix: use a number, e.g. cluster.device_memory_gb=0.0."
    ]
    for override, message in [  # a list's items, a null-able field, a list's element, a bool
        (  # the item is named by its index, and the fix is the whole override with that value replaced
            "data.mix=[{path:a,weight:1},{path:b,weight:x}]",
            "data.mix[1].weight = x: not a number (override data.mix=[{path:a,weight:1},{path:b,weight:x}]). Fix: use a number, "
            "e.g. data.mix=[{path:a,weight:1},{path:b,weight:1.0}].",
        ),
        (
            "optimizer.param_groups=[{pattern:'norm\\.weight$',weight_decay:abc}]",
            "optimizer.param_groups[0].weight_decay = abc: not a number (override optimizer.param_groups=[{pattern:'norm\\.weight$',"
            "weight_decay:abc}]). Fix: use a number, e.g. optimizer.param_groups=[{pattern:'norm\\.weight$',weight_decay:0.0}].",
        ),
        ("cluster.num_nodes=two", "cluster.num_nodes = two: not an integer or null (override cluster.num_nodes=two). Fix: use an "),
        ("dryrun.ranks=[a]", "dryrun.ranks[0] = a: not an integer (override dryrun.ranks=[a]). Fix: use an integer, e.g. dryrun."),
        ("training.compile=maybe", "training.compile = maybe: not true or false (override training.compile=maybe). Fix: use true "),
    ]:
        with pytest.raises(validate.ConfigError) as e:
            compose([override])
        assert str(e.value.problems[0]).startswith(message)
    code, err = in_process.cli(monkeypatch, capsys, "optimizer.lr=[1,2]")
    assert code == 2 and err == (
        "Invalid config (1 problem):\n  - optimizer.lr = [1, 2]: not a number (override optimizer.lr=[1,2]). "
        "Fix: use a number, e.g. optimizer.lr=0.0008.\n"
    )


USER_RECIPES = {
    "bad_option": "# @package _global_\ndefaults:\n  - override /model: llama3_8\n",
    "bad_key": "# @package _global_\ntraining:\n  stepz: 3\n",
    "bad_nested_key": "# @package _global_\nmonitor:\n  guard:\n    windw: 5\n",
}
"""A user's own recipes (`--config-dir <folder>`, `recipe/<name>.yaml`), each with one mistake Hydra refuses."""


@pytest.mark.parametrize(
    "argv,line,fix",
    [
        (["foo=1"], "foo = 1: not a field of RunConfig (override foo=1). Fix: remove it; the fields here are mode, model,", None),
        (
            ["training.stepz=1"],
            "training.stepz = 1: not a field of TrainingConfig (override training.stepz=1). Fix: did you mean training.steps?",
            "training.steps=1",
        ),
        (
            ["optimizer.param_groups=[{pattern:norm,weight_decy:0}]"],
            "optimizer.param_groups[0].weight_decy = 0: not a field of ParamGroup (override optimizer.param_groups=[{pattern:norm,"
            "weight_decy:0}]). Fix: did you mean weight_decay? optimizer.param_groups=[{pattern:norm,weight_decay:0}] (the fields "
            "of an item are pattern, weight_decay).",
            "optimizer.param_groups=[{pattern:norm,weight_decay:0}]",
        ),
        (
            ["model=llama3_8"],
            "model = llama3_8: not an option of the model group (override model=llama3_8). Fix: use model=llama3_8b (the "
            "closest; also llama3_3b, llama3_1b); `python -m runner --help` lists the 40 options.",
            "model=llama3_8b",
        ),
        (
            ["recipe=nope"],
            "recipe = nope: not an option of the recipe group (override recipe=nope). Fix: use recipe=<option>; the options: "
            "debug_dp2_tp2_cpu, deepseek_v3_671b_h800x2048,",
            None,
        ),
        (
            ["--config-dir", "{mine}", "recipe=bad_option"],
            "model = llama3_8: not an option of the model group (asked by {mine}/recipe/bad_option.yaml). Fix: use "
            "`- override /model: llama3_8b` in that file (the closest; also llama3_3b, llama3_1b);",
            None,
        ),
        (
            ["--config-dir", "{mine}", "recipe=bad_key"],
            "training.stepz = 3: not a field of TrainingConfig (in recipe/bad_key: {mine}/recipe/bad_key.yaml). Fix: did you "
            "mean training.steps?",
            None,
        ),
        (
            ["--config-dir", "{mine}", "recipe=bad_nested_key"],
            "monitor.guard.windw = 5: not a field of LossGuardConfig (in recipe/bad_nested_key: {mine}/recipe/bad_nested_key.yaml). "
            "Fix: did you mean monitor.guard.window?",
            None,
        ),
    ],
    ids=[
        "top_level_key",
        "nested_key",
        "param_group_key",
        "option",
        "recipe_option",
        "user_recipe_option",
        "user_recipe_key",
        "user_recipe_nested_key",
    ],
)
def test_hydras_composition_errors_are_worded_as_the_runners(monkeypatch, capsys, tmp_path, compose, argv, line, fix):
    """What Hydra refuses while composing (a key without `+`, at the top and nested; a group option that does not exist,
    on the command line or asked by a user's recipe; a key a schema lacks inside a user's recipe file) reads as every
    other problem: the key or option, the override or file that asked, the closest names, the fix; exit 2, no Hydra
    hint to set HYDRA_FULL_ERROR. A fix that is an override composes."""
    mine = tmp_path / "mine"
    (mine / "recipe").mkdir(parents=True)
    for name, text in USER_RECIPES.items():
        (mine / "recipe" / f"{name}.yaml").write_text(text)
    code, err = in_process.cli(monkeypatch, capsys, *(a.replace("{mine}", str(mine)) for a in argv), "mode=validate")
    assert code == 2 and "HYDRA_FULL_ERROR" not in err and "Traceback" not in err, err
    assert err.startswith(f"Invalid config (1 problem):\n  - {line.replace('{mine}', str(mine))}"), err
    if fix:
        validate.check(compose([fix]))


@pytest.mark.parametrize(
    "override,words",
    [
        ("+training.steps=1", "Could not append to config. An item is already at 'training.steps'."),
        ("~training.stepz", "Could not delete from config. 'training.stepz' does not exist."),
        ("training.steps=[1", "no viable alternative at input '[1'"),
    ],
)
def test_hydras_other_composition_errors_keep_its_words_without_its_hint(monkeypatch, capsys, override, words):
    """Hydra's other refusals name the override themselves: its words, the runner's fix line, exit 2, no hint."""
    from runner import cli

    code, err = in_process.cli(monkeypatch, capsys, override, "mode=validate")
    assert code == 2 and err.startswith(words) and err.endswith(f"{cli.FIX_OVERRIDE}\n"), err
    assert "HYDRA_FULL_ERROR" not in err and "Traceback" not in err


def test_every_composition_refuses_a_key_the_schema_lacks(capsys):
    """The command line, the tests' compose and `python -m runner.calibrate --variant` compose through
    runner.config.compose, which refuses `+typo=` (the calibration's own composition once skipped that check)."""
    from runner.calibrate import measure
    from runner.config import compose

    with pytest.raises(validate.ConfigError, match=r"training.lr_warmup = 100: not a field of TrainingConfig"):
        compose.compose(["+training.lr_warmup=100"])
    assert measure.main(["--variant", "+training.lr_warmup=100"]) == 2
    err = capsys.readouterr().err
    assert "training.lr_warmup = 100: not a field of TrainingConfig" in err and "did you mean lr_scheduler.warmup_steps?" in err


@pytest.mark.e2e
def test_cli_validate_mode_prints_layout_and_writes_nothing(tmp_path):
    """From any folder, with Hydra's default run folder (outputs/<date>/<time>): nothing is left, outputs/ included."""
    proc = run_cli("recipe=llama3_70b_h100x1024", "mode=validate", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "1024 ranks, layout tp8_pp4_1F1B_dp32 [pp=4 x dp_shard=32 x tp=8]" in proc.stdout
    assert "4,194,304 tokens/step, 32 microbatches of 1 per DP rank" in proc.stdout
    assert list(tmp_path.iterdir()) == []


TORCH_FREE = ("runner.schema", "runner.formats", "runner.estimate", "runner.config", "runner.data", "runner.outputs")


@pytest.mark.e2e
def test_config_layer_is_torch_free():
    """Every module of the torch-free packages (TORCH_FREE), and `python -m runner --cfg job`, run without importing
    torch."""
    code = (
        "import sys, pkgutil, importlib, runpy\n"
        f"for name in {TORCH_FREE!r}:\n"
        "    p = importlib.import_module(name)\n"
        "    for m in pkgutil.walk_packages(p.__path__, name + '.'):\n"
        "        if not m.name.endswith('.__main__'): importlib.import_module(m.name)\n"
        "sys.argv = ['runner', '--cfg', 'job']\n"
        "try:\n    runpy.run_module('runner', run_name='__main__')\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('TORCH_LOADED', 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "TORCH_LOADED False" in out.stdout
    assert "name: dp2_tp2" in out.stdout  # the job config was printed


LAYERS = {
    "runner.schema": 0,
    "runner.formats": 1,
    "runner.estimate": 2,
    "runner.config": 3,
    "runner.data": 4,
    "runner.outputs": 4,
    "runner.run": 5,
    "runner.observe": 5,
}
"""The packages of runner/ from the bottom up (docs/ARCHITECTURE.md's picture); every other module (the commands,
runner/calibrate/) is above them all. A package imports its own modules and the layers below it, nothing beside or
above it, but for the step loop's observers: runner.run imports runner.observe, which of runner.run imports only
the device policy."""
SIDEWAYS = {("runner.run", "runner.observe"), ("runner.observe", "runner.run.device")}


def _package(module: str) -> str:
    return next((p for p in LAYERS if module == p or module.startswith(p + ".")), "the commands")


def layer_offence(imp: import_graph.Import, importer: str) -> str | None:
    """Why one import of runner/ breaks the layers (None if it does not)."""
    top, own = imp.module.split(".")[0], _package(importer)
    if top == "torchtitan" and not imp.path.startswith("runner/run/titan/"):
        return "only the TorchTitan adapter (runner/run/titan/) imports torchtitan"
    if top == "torch" and LAYERS.get(own, 6) < LAYERS["runner.run"]:
        return f"{own} is torch-free"
    if top != "runner" or imp.module == "runner":
        return None
    other = _package(imp.module)
    below, level = LAYERS.get(other, 6), LAYERS.get(own, 6)
    if other == own or below < level:
        return None
    if (own, other) in SIDEWAYS or (own, imp.module) in SIDEWAYS:
        return None
    return f"{own} may not import {other} ({'above' if below > level else 'beside'} it)"


def test_layers_import_only_downwards():
    """Every import of every module under runner/, lazy ones inside functions included, runs down LAYERS; torch stays
    out of the torch-free packages and torchtitan inside the adapter."""
    known = import_graph.modules()
    names = {path.relative_to(ROOT).as_posix(): name for name, path in known.items()}
    offenders = [
        f"{imp.path}:{imp.line} imports {imp.module}: {why}"
        for imp in import_graph.of_package()
        if (why := layer_offence(imp, names[imp.path]))
    ]
    assert offenders == []


def test_layer_offences_are_found():
    """The judge itself, on imports no module has: upward, sideways, lazy torch and torchtitan outside the adapter."""
    case = lambda path, module: import_graph.Import(path, 1, module, None)  # noqa: E731
    assert layer_offence(case("runner/estimate/flops.py", "runner.config.validate"), "runner.estimate.flops") == (
        "runner.estimate may not import runner.config (above it)"
    )
    assert layer_offence(case("runner/data/cli.py", "runner.outputs.goodput"), "runner.data.cli") == (
        "runner.data may not import runner.outputs (beside it)"
    )
    assert layer_offence(case("runner/run/train.py", "runner.sweep"), "runner.run.train") == (
        "runner.run may not import the commands (above it)"
    )
    assert layer_offence(case("runner/observe/monitor.py", "runner.run.train"), "runner.observe.monitor") is not None
    assert layer_offence(case("runner/observe/monitor.py", "runner.run.device"), "runner.observe.monitor") is None
    assert layer_offence(case("runner/formats/checkpoint.py", "torch"), "runner.formats.checkpoint") == "runner.formats is torch-free"
    assert layer_offence(case("runner/run/train.py", "torchtitan.train"), "runner.run.train") is not None
    assert layer_offence(case("runner/modes.py", "runner.run.node_launch"), "runner.modes") is None


def test_every_runner_import_names_what_exists():
    """Each `runner.*` import, lazy ones too, names a module of the tree, and a `from m import name` a submodule or a
    name m defines: an import a move left stale fails here, not in the one run that reaches the function."""
    known = import_graph.modules()
    stale = []
    for imp in import_graph.of_package():
        if imp.module.split(".")[0] != "runner":
            continue
        if imp.module not in known:
            stale.append(f"{imp.path}:{imp.line}: no module {imp.module}")
        elif imp.attribute and imp.attribute not in import_graph.defined_names(known[imp.module]):
            stale.append(f"{imp.path}:{imp.line}: {imp.module} defines no {imp.attribute}")
    assert stale == []


@pytest.mark.e2e
def test_help_and_info():
    help_ = run_cli("--help")
    assert help_.returncode == 0
    lines = help_.stdout.splitlines()
    offered = [f"{name}_{flavor}" for name, fam in families.FAMILIES.items() for flavor in fam.flavors]
    models = sorted(["debug", "debug_moe", *(re.sub(r"[.\-]", "_", o).lower() for o in offered)])
    for line in (
        f"model: {', '.join(models)}",
        "parallelism: cp2, dp2, dp2_pp2, dp2_tp2, ep2, fsdp, hsdp2x2, pp2_interleaved, single, tp2, tp2_pp2, tp4_pp4, tp8_pp16, "
        "tp8_pp16_cp16, tp8_pp4, tp8_pp8",
        "recipe: debug_dp2_tp2_cpu, deepseek_v3_671b_h800x2048, gpt_oss_120b_h100x64, llama3_70b_h100x1024, llama3_8b_continue_h100x64, "
        "llama3_8b_fsdp8_h100, qwen3_235b_a22b_h100x1024",
        "sweep: cpu_layouts, llama3_70b_layouts",
    ):
        assert line in lines  # whole lines: a prefix would hide a missing or extra option
    assert any(ln.strip().startswith("python -m runner --config-dir <run folder> --config-name frozen") for ln in lines)
    modes = lines[lines.index("== Modes ==") + 1 : lines.index("== Configuration groups ==")]
    assert [ln.split()[0] for ln in modes if ln.startswith("  ")] == [m.value for m in Mode]  # one line each, all of them
    info = run_cli("--info")
    assert info.returncode == 0
    assert "Config search path" in info.stdout and f"file://{ROOT}/conf" in info.stdout


def test_only_the_device_policy_branches_on_the_device():
    """Every CPU-vs-CUDA difference of the runtime is runner.run.device's decision; the dry run, which rehearses a
    CUDA layout on CPU, is the one other module that names the device (to say what it substitutes)."""
    allowed = {"runner/run/device.py", "runner/run/dryrun/rehearse.py"}
    branching = re.compile(r"cluster\.device\s*[=!]=|DeviceType\.(cpu|cuda)|\.is_cuda\b|cuda\.is_available\(")
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for d in ("runner/run", "runner/observe")
        for p in sorted((ROOT / d).rglob("*.py"))
        if p.relative_to(ROOT).as_posix() not in allowed
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if branching.search(line)
    ]
    assert found == []


def test_test_only_faults_live_in_one_module():
    """Every fault a test plants (a switch of monitor.inject) is read by runner.observe.fault_injection and by no other
    module of the runtime; only the simulated node names (`node_names`, the mesh and the local tier's nodes) are read
    where nodes are."""
    from runner.schema import InjectConfig

    switches = [f.name for f in dataclasses.fields(InjectConfig) if f.name != "node_names"]
    home = ROOT / "runner/observe/fault_injection.py"
    assert [s for s in switches if not re.search(rf"\.{s}\b", home.read_text())] == []
    found = [
        f"{p.relative_to(ROOT)}:{i}: {s}"
        for d in ("runner/run", "runner/observe")
        for p in sorted((ROOT / d).rglob("*.py"))
        if p != home
        for i, line in enumerate(p.read_text().splitlines(), 1)
        for s in switches
        if re.search(rf"\binject\.{s}\b|\b(c|i)\.{s}\b", line)
    ]
    assert found == []


def test_no_test_module_imports_another():
    """Test modules share helpers through helper modules of tests/ (conftest, points, hf_models, in_process, ...),
    never by importing each other: an import of a test module runs its module-level code and collects nothing."""
    known = import_graph.modules("tests")
    found = [
        f"{imp.path}:{imp.line} imports {imp.module}"
        for name, path in known.items()
        if name.split(".")[-1].startswith("test_")
        for imp in import_graph.of_file(path, name, known)
        if imp.module.split(".")[-1].startswith("test_") or (imp.attribute or "").startswith("test_")
    ]
    assert found == []


def test_no_module_reads_another_modules_private_names():
    """A name that starts with `_` is its module's own: what another module of runner/ needs is public where it lives
    (issue 53: the CUDA rehearsal once called four private helpers of the CPU one, the torchft launcher a private rule)."""
    known = import_graph.modules()
    found = [use for name, path in known.items() for use in import_graph.private_uses(path, name, known)]
    assert found == []
