"""scripts/gpu_check.py: what can be checked without a GPU (its assets, command lines, TorchTitan config,
table and exit status). The GPU runs themselves are for a user's machine (docs/clusters.md: the GPU check)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SEQ = 128


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # gpu_check_titan imports gpu_check by name
    spec.loader.exec_module(module)
    return module


gc = _load("gpu_check")
H100 = gc.Gpu("NVIDIA H100 80GB HBM3", (9, 0), 85.0)
CASES = {c.name: c for c in gc.GPU_CASES}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return gc.make_assets(tmp_path_factory.mktemp("gpu_check") / "assets", SEQ, num_docs=4)


@pytest.mark.e2e
def test_no_gpu_exits_2_with_the_reason():
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "gpu_check: no GPU: torch 2.13.0+cpu is the CPU build" in proc.stderr
    assert "scripts/setup.sh installs" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_probe_messages():
    with pytest.raises(gc.NoGpu, match=r"torch 2\.13\.0 \(CUDA 12\.8\) sees no CUDA device .*CUDA_VISIBLE_DEVICES"):
        gc.gpu_from_probe({"torch": "2.13.0", "cuda": "12.8", "available": False})
    got = gc.gpu_from_probe(
        {"torch": "2.13.0", "cuda": "12.8", "available": True, "name": "NVIDIA H200", "capability": [9, 0], "memory_gb": 150.0}
    )
    assert got == gc.Gpu("NVIDIA H200", (9, 0), 150.0)


def test_cluster_by_gpu_name_and_fp8_support():
    assert gc.cluster_for("NVIDIA H100 80GB HBM3") == ("h100_node", "")
    assert gc.cluster_for("NVIDIA B200")[0] == "b200_node"
    assert gc.cluster_for("NVIDIA H200")[0] == "h100_node" and "H200" in gc.cluster_for("NVIDIA H200")[1]
    assert gc.cluster_for("NVIDIA L40S") == (
        "h100_node",
        "unknown GPU 'NVIDIA L40S': MFU against the H100 SXM's dense peaks (conf/gpu/h100_sxm_80gb.yaml)",
    )
    ada = gc.Gpu("NVIDIA L40S", (8, 9), 48.0)
    assert gc.unsupported(CASES["fp8_rowwise"], ada) == ""
    assert gc.unsupported(CASES["fp8_blockwise"], ada) == "needs SM 9.0 (NVIDIA SM 9.0+ (Hopper H100/H200)); this GPU is SM 8.9"
    assert gc.unsupported(CASES["fp8_blockwise"], H100) == ""


def test_assets_one_document_per_titan_sample(assets, tmp_path, monkeypatch):
    """TorchTitan's loader (BOS + words + EOS, per-document positions) yields exactly one document per sample,
    so its FlexAttention mask is the plain causal one the runner uses."""
    import datasets
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    tok = HuggingFaceTokenizer(tokenizer_path=str(assets.tokenizer_dir))
    doc = json.loads(assets.corpus.read_text().splitlines()[0])["text"]
    assert len(tok.encode(doc, add_bos=True, add_eos=True)) == SEQ + 1
    assert tok.get_vocab_size() <= 2048  # model=debug's vocabulary
    ds = HuggingFaceTextDataset("c4_test", str(assets.corpus_dir), tok, seq_len=SEQ, infinite=False)
    samples = list(ds)
    assert len(samples) == 4
    for inputs, labels in samples:
        assert inputs["positions"].tolist() == list(range(SEQ))
        assert inputs["input"][0].item() == tok.bos_id and labels[-1].item() == tok.eos_id


def test_runner_commands_validate_for_one_h100(assets, tmp_path, compose):
    """The exact overrides of every GPU case, and the runner accepts each for one H100 (mode=validate on this machine)."""
    from runner.config import validate

    argv = gc.runner_command(CASES["fp8_rowwise"], assets, tmp_path / "run", gpu=H100, steps=30, seq_len=SEQ)
    assert argv[:3] == [sys.executable, "-m", "runner"]
    assert argv[3:] == [
        "mode=train",
        "model=debug",
        "parallelism=single",
        "cluster=h100_node",
        "cluster.devices_per_node=1",
        "cluster.compute_capability='9.0'",
        "cluster.device_memory_gb=85.0",
        "precision=fp8_rowwise",
        "training.compile=true",
        "training.steps=30",
        f"training.seq_len={SEQ}",
        "training.global_batch_size=8",
        "training.microbatch_size=8",
        "data=text",
        f"data.files=['{assets.corpus}']",
        f"data.tokenizer='{assets.tokenizer}'",
        "logging.progress=false",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    for case in gc.GPU_CASES:
        overrides = gc.runner_command(case, assets, tmp_path / "run", gpu=H100, steps=30, seq_len=SEQ, mode="validate")[3:-1]
        cfg = compose(overrides)
        lay = validate.check(cfg)
        assert (lay.world_size, cfg.cluster.device.value, cfg.precision.fp8, cfg.training.compile) == (1, "cuda", case.fp8, case.compile)


def test_titan_config_matches_the_runner_run(assets, tmp_path):
    """TorchTitan's Trainer.Config for a case: the runner's model, batch, steps, optimizer, schedule and recipe."""
    from torchtitan.models.llama3 import model_registry

    gct = _load("gpu_check_titan")
    spec = gc.titan_spec(CASES["bf16 compiled"], assets, tmp_path, steps=30, seq_len=SEQ)
    cfg = gct.trainer_config(spec)
    t = cfg.training
    assert (t.local_batch_size, t.seq_len, t.steps, t.max_norm, t.mixed_precision_param, t.disable_cuda_graphs) == (
        8,
        SEQ,
        30,
        1.0,
        "bfloat16",
        True,
    )
    assert cfg.compile.enable and cfg.activation_checkpoint is None and not cfg.checkpoint.enable and not cfg.validator.enable
    assert cfg.optimizer.param_groups[0].optimizer_kwargs | {} == {"lr": 8e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    s = cfg.lr_scheduler  # the runner's default schedule: warm-up 2, then TorchTitan's linear decay to 0
    assert (s.warmup_steps, s.decay_type, s.decay_ratio, s.min_lr_factor) == (2, "linear", None, 0.0)
    assert (cfg.dataloader.dataset, cfg.dataloader.dataset_path, cfg.hf_assets_path) == (
        "c4_test",
        str(assets.corpus_dir),
        str(assets.tokenizer_dir),
    )
    assert cfg.parallelism.spmd_backend == "partial_dtensor" and cfg.loss.global_vocab_size == 2048
    assert type(cfg.model_spec.model) is type(model_registry("debugmodel").model)
    fp8 = gct.converters(gc.titan_spec(CASES["fp8_tensorwise"], assets, tmp_path, steps=30, seq_len=SEQ))
    assert [(c.recipe_name, c.filter_fqns, c.model_compile_enabled) for c in fp8] == [("tensorwise", ["lm_head"], True)]
    assert gct.converters(spec) == []


def _summary(tps: float, mfu: float) -> dict:
    return {"tokens_per_s_median": tps, "mfu_median": mfu, "peak_tflops": 989.0, "peak_dtype": "bfloat16"}


def test_table_ratio_and_verdict():
    rows = [{"step": s, "tokens_per_s": v, "mfu": m} for s, v, m in [(1, 10.0, 0.01), (2, 400.0, 0.2), (3, 500.0, 0.3), (4, 600.0, 0.4)]]
    assert gc.titan_medians(rows) == {"tokens_per_s_median": 500.0, "mfu_median": 0.3, "steps": 4}
    assert gc.titan_medians([{**r, "mfu": None} for r in rows])["mfu_median"] is None
    done = gc.Result(
        CASES["bf16 eager"],
        runner=_summary(450_000, 0.1234),
        titan={"tokens_per_s_median": 500_000, "mfu_median": 0.137, "peak_tflops": 989.0},
    )
    fp8 = gc.Result(CASES["fp8_tensorwise"], runner=_summary(600_000, 0.08) | {"peak_tflops": 1979.0, "peak_dtype": "float8"})
    fp8.titan = {"tokens_per_s_median": 500_000, "mfu_median": None, "peak_tflops": 989.0}
    block = gc.Result(CASES["fp8_blockwise"], runner=_summary(300_000, 0.05))
    failed = gc.Result(CASES["fp8_rowwise"], errors=["runner: exit status 1"])
    skipped = gc.Result(CASES["bf16 compiled"], skipped="needs SM 9.0")
    got = gc.table_rows([done, fp8, block, failed, skipped])
    assert got[0] == ("bf16 eager", "450,000", "12.34% of 989 TFLOP/s bfloat16", "500,000", "13.70% of 989 TFLOP/s", "0.90", "ok")
    assert got[1][2:] == ("8.00% of 1979 TFLOP/s float8", "500,000", "n/a (none with FP8)", "1.20", "ok")
    assert got[2][3:] == ("n/a", "n/a", "n/a (TorchTitan has no blockwise FP8 recipe)", "ok")
    assert got[3] == ("fp8_rowwise", "-", "-", "-", "-", "-", "FAILED")
    assert got[4][-1] == "skipped: needs SM 9.0"
    assert gc.verdict([done, fp8, block, skipped]) == (True, "PASS: 3 cases trained; 1 skipped (this GPU lacks the recipe's hardware)")
    assert gc.verdict([done, failed]) == (False, "FAIL: 1 of 2 cases failed (fp8_rowwise)")


def test_time_budget_spent_is_a_failure(tmp_path, assets):
    r = gc.Result(CASES["bf16 eager"])
    gc.run_case(r, assets, tmp_path, deadline=0.0, gpu=H100, steps=30, seq_len=SEQ)
    assert r.runner is None and r.titan is None
    assert r.errors == [f"not run: less than 30 s of the {gc.BUDGET_S:.0f} s budget left"]
    assert gc.verdict([r])[0] is False


def test_node_list_prints_commands_that_validate(tmp_path, capsys, compose):
    """`gpu_check.sh --node --list` needs no GPU: it prints every node case's commands (plan, dry run, training, the
    resume, torchfrtrace, TorchTitan's trainer with its spec), and each printed runner config validates in-process for
    8 H100s, with TorchTitan's degrees equal to the runner layout's."""
    import dataclasses
    import shlex

    from runner.config import validate
    from runner.schema import Mode

    gct = _load("gpu_check_titan")
    assert gc.main(["--node", "--list", "--work-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    cases = [ln.removeprefix("# case: ") for ln in lines if ln.startswith("# case: ")]
    assert cases == [
        "dp_shard4 x tp2 bf16, checkpoint + resume",
        "dp_shard2 x tp2 x pp2 FlexAttention",
        "fp8_rowwise FSDP8",
        "injected hang, NCCL flight recorder",
        "async TP compiled",
    ]
    runner_lines = [shlex.split(ln) for ln in lines if " -m runner " in ln]
    modes, layouts, composed = [], {}, {}
    for argv in runner_lines:
        overrides = [a for a in argv[3:] if not a.startswith(("hydra.run.dir=", "mode="))]
        mode = argv[3].removeprefix("mode=")
        if tuple(overrides) not in composed:  # plan, dry run and training of a case differ only in mode: compose once
            composed[tuple(overrides)] = compose(overrides)
        cfg = dataclasses.replace(composed[tuple(overrides)], mode=Mode(mode))
        lay = validate.check(cfg)
        assert (lay.world_size, cfg.cluster.device.value, cfg.cluster.name) == (8, "cuda", "h100_node")
        modes.append(mode)
        layouts[Path(argv[-1].split("=", 1)[1]).parent.name] = lay
    assert modes.count("train") == 6 and modes.count("plan") == modes.count("dryrun") == 4  # 5 runs + the resume; no plan for the hang
    resume = next(a for a in runner_lines if "checkpoint.resume=true" in a)
    assert f"checkpoint.resume_from={tmp_path}/runs/dp_shard4_x_tp2_bf16/train/checkpoints/step-10" in resume
    assert any(ln.endswith("injected_hang/train/flight_recorder -p rank_") for ln in lines)
    specs = [json.loads(ln.split("): ", 1)[1]) for ln in lines if ln.startswith("# titan spec (")]
    assert len(specs) == 4
    from torchtitan.config import ParallelismConfig

    for spec in specs:
        p = gct.parallelism_config(spec, ParallelismConfig, "partial_dtensor")
        lay = layouts[Path(spec["dump_folder"]).parent.name]
        assert (p.data_parallel_shard_degree, p.tensor_parallel_degree, p.pipeline_parallel_degree) == (lay.dp_shard, lay.tp, lay.pp)
        assert spec["local_batch_size"] == 32 // lay.dp and spec["nproc"] == 8
    assert [spec["fp8_recipe"] for spec in specs] == [None, None, "rowwise", None]
    assert [spec["compile"] for spec in specs] == [False, False, True, True]


def test_host_syncs_are_counted_between_optimizer_steps(tmp_path, monkeypatch):
    """scripts/gpu_check_syncs/sitecustomize.py (first on the node runs' PYTHONPATH) counts, per optimizer step, the syncs
    torch's sync debug mode warns about and the explicit synchronize calls; gpu_check_node reads the median of steps 2..
    On this CPU build the CUDA calls are stand-ins that only count."""
    import warnings

    import torch

    gcn = _load("gpu_check_node")
    monkeypatch.setenv("GPU_CHECK_SYNC_DIR", str(tmp_path / "syncs"))
    monkeypatch.setenv("RANK", "3")
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda.Event, "synchronize", torch.cuda.Event.synchronize)  # wrapped by the module: put back after
    spec = importlib.util.spec_from_file_location("sitecustomize_under_test", ROOT / "scripts" / "gpu_check_syncs" / "sitecustomize.py")
    hooks = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings():
        spec.loader.exec_module(hooks)
        try:
            p = torch.nn.Parameter(torch.ones(2))
            opt = torch.optim.SGD([p], lr=0.1)
            for syncs in (1, 2, 2, 5):  # step 1 holds start-up; the debug mode is armed after it
                p.grad = torch.ones(2)
                torch.cuda.synchronize()  # one explicit sync per step
                for _ in range(syncs - 1):
                    warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)  # same call site each time
                opt.step()
        finally:
            hooks._handle.remove()
    got = json.loads((tmp_path / "syncs" / "rank_3.json").read_text())
    assert modes == ["warn"] and got == {"rank": 3, "per_step": [1, 2, 2, 5]}
    assert gcn.syncs_per_step(tmp_path / "syncs") == 2


def test_torchfrtrace_naming_the_hung_rank():
    gcn = _load("gpu_check_node")
    assert gcn.frtrace_check("AssertionError: Missing dump files from ranks {1}\n", 1) == "torchfrtrace: Missing dump files from ranks {1}"
    assert gcn.frtrace_check("INFO missing ranks: {1}\n", 1) == "torchfrtrace: missing ranks: {1}"
    assert gcn.frtrace_check("Missing dump files from ranks {2}\n", 1) == "FAILED torchfrtrace: rank 1 not named"


def test_node_checks_and_table(tmp_path):
    """The node check's verdicts from the files its runs leave: the resumed losses bitwise, the hang report's rank and
    dumps; and its row: tokens/s beside TorchTitan's with the ratio, the three peak memories, the syncs per step."""
    gcn = _load("gpu_check_node")
    first, resumed = tmp_path / "train", tmp_path / "resume"
    for run, tail in ((first, [7.25, 7.125]), (resumed, [7.25, 7.125])):
        run.mkdir()
        rows = [{"step": s, "loss": v} for s, v in zip((9, 10, 11, 12), [7.5, 7.375, *tail], strict=False)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if run is first or r["step"] > 10))
    assert gcn.resume_check(first, resumed, 10) == "resume from step 10: steps 11-12 bitwise equal"
    (resumed / "metrics.jsonl").write_text(json.dumps({"step": 11, "loss": 7.25 + 1e-12}) + "\n")
    assert gcn.resume_check(first, resumed, 10).startswith("FAILED resume from step 10")
    hang = tmp_path / "hang"
    (hang / "flight_recorder").mkdir(parents=True)
    assert gcn.hang_check(hang, 1) == f"FAILED hang: no hang_report.json in {hang}"
    (hang / "hang_report.json").write_text(json.dumps({"missing_ranks": [1]}))
    (hang / "flight_recorder" / "rank_0").write_text("x")
    assert gcn.hang_check(hang, 1) == "hang: rank 1 named, NCCL dumps ['rank_0']"
    case = gcn.CASES[0]
    r = gcn.NodeResult(case, runner={"tokens_per_s_median": 980_000.0, "memory_gb_max": 3.5}, titan={"tokens_per_s_median": 1_000_000.0})
    r.plan_gb, r.dryrun_gb, r.syncs, r.checks = 4.25, 3.0, 1.0, ["resume from step 10: steps 11-20 bitwise equal"]
    assert gcn.table_rows([r]) == [
        (case.name, "980,000", "1,000,000", "0.980", "3.50", "3.00", "4.25", "1", "resume from step 10: steps 11-20 bitwise equal")
    ]
    assert gcn.verdict([r]) == (True, "PASS: 1 cases on 8 GPUs")
    r.checks.append("FAILED torchfrtrace: rank 1 not named")
    assert gcn.verdict([r]) == (False, f"FAIL: 1 of 1 cases failed ({case.name})")
