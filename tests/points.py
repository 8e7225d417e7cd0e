"""The points the session's shared launches train, section by section after the test module that reads them: data only
(no fixtures, no tests), so conftest builds each launch without importing a test module. A table that names folders
is a function of them; conftest's session fixtures make the folders and return them to the tests.

Launches (conftest): `parity_runs`, one runner.run.layout_parity process group per rank count, for test_parallel,
test_family_train, test_titan, test_hf_load, test_hf_export and test_runner_vs_titan; `shared_runs`, one Hydra multirun, for test_train,
test_checkpoint, test_tokens and test_slurm; `dry_runs`, one Hydra multirun of mode=dryrun, for test_dryrun and
test_plan_memory.
"""

from __future__ import annotations

from pathlib import Path

from runner.estimate import pipeline
from tests import hf_models

# ---- tests/test_parallel.py: every layout that fits on this machine (parity_runs) --------------------------------

# eval: one held-out batch after the last step (forward only; under PP the schedule's eval step), in every layout
PARALLEL_COMMON = [
    "training.steps=2",
    "training.seq_len=64",
    "training.max_norm=0.01",
    "logging.progress=false",
    "eval.interval=2",
    "eval.steps=1",
]
PP2 = ["parallelism=single", "parallelism.name=pp2", "parallelism.pp=2"]
LOOPED = ["parallelism=pp2_interleaved"]
# TEST-ONLY: FlexAttention and its block masks, one forward-only eval pass of 2 microbatches of 2 samples
FLEX = ["eval.cpu_flex_attention=true", "training.global_batch_size=4"]
PARALLEL_MOE = [
    "model=debug_moe",
    "training.global_batch_size=2",
    "training.microbatch_size=1",
]  # 128 tokens a step: MLA + experts cost 5x the dense FLOPs
SCHEDULES = ["1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
SPLIT_BACKWARD = ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]  # a weight pass after the input's
PARALLEL_LAUNCHES = {
    1: {
        "single": ["parallelism=single"],
        "moe_single": [*PARALLEL_MOE, "parallelism=single"],
        "flex_single": [*FLEX, "parallelism=single"],
    },
    2: {
        "cp2": ["parallelism=cp2"],
        "ep2": [*PARALLEL_MOE, "parallelism=ep2"],
        "dp2": ["parallelism=dp2"],
        "tp2": ["parallelism=tp2"],
        "tp2_no_sp": ["parallelism=tp2", "parallelism.sequence_parallel=false"],
        "flex_pp2": [*FLEX, *PP2],
        "flex_pp2_interleaved": [*FLEX, *LOOPED],
        **{f"pp2_{s}": (PP2 if pipeline.SCHEDULES[s].style == "single" else LOOPED) + [f"parallelism.pp_schedule={s}"] for s in SCHEDULES},
        # split backwards under full AC: one recompute per weight pass (runner.run.titan.weight_pass)
        **{f"pp2_{s}_ac": [*LOOPED, f"parallelism.pp_schedule={s}", "training.activation_checkpoint=full"] for s in SPLIT_BACKWARD},
    },
    4: {
        "dp2_tp2": ["parallelism=dp2_tp2"],
        "tp2_pp2": ["parallelism=tp2_pp2"],
        "dp2_pp2": ["parallelism=dp2_pp2"],
        "hsdp2x2": ["parallelism=hsdp2x2"],
        "cp2_tp2": ["parallelism=cp2", "parallelism.name=cp2_tp2", "parallelism.tp=2"],  # ring attention x TP + SP
        "cp2_pp2": ["parallelism=cp2", "parallelism.name=cp2_pp2", "parallelism.pp=2"],  # every stage on the CP chunks
    },
}

# ---- tests/test_family_train.py: each family that trains on CPU (parity_runs) -------------------------------------

FAMILY_COMMON = ["training.steps=2", "training.seq_len=64", "training.max_norm=0.01", "logging.progress=false"]
FAMILY_COMMON += ["training.global_batch_size=4", "training.microbatch_size=2"]  # 256 tokens a step (see MOE_SP_ONE_SAMPLE)
FAMILIES = {  # the debug flavor of each family that trains on CPU, cut to 2 blocks
    "qwen3": ["model=qwen3_debugmodel", "model.num_layers=2"],
    "qwen3_moe": ["model=qwen3_debugmodel_moe", "model.num_layers=2", "model.num_experts=8", "model.num_experts_per_token=2"],
    "deepseek_v3": ["model=deepseek_v3_debugmodel", "model.num_layers=2"],
    "kimi": ["model=kimi_k2_7_debugmodel", "model.num_layers=2"],
}
FAMILY_MOE = ("qwen3_moe", "deepseek_v3", "kimi")  # deepseek_v3's ep2 is in test_parallel (model=debug_moe)
# Kimi's debugmodel is DeepSeek-V3's blocks and numbers: one reference (test_family_train checks it)
FAMILY_REFERENCE = {"kimi": "deepseek_v3"}
FAMILY_LAUNCHES = {
    1: {f"{f}-single": [*o, "parallelism=single"] for f, o in FAMILIES.items() if f not in FAMILY_REFERENCE},
    2: {
        **{f"{f}-ep2": [*FAMILIES[f], "parallelism=ep2"] for f in ("qwen3_moe", "kimi")},
        "qwen3-cp2": [*FAMILIES["qwen3"], "parallelism=cp2"],
        "kimi-pp2": [*FAMILIES["kimi"], "parallelism=single", "parallelism.name=pp2", "parallelism.pp=2"],
    },
    4: {f"{f}-dp2_tp2": [*o, "parallelism=dp2_tp2"] for f, o in FAMILIES.items()},
}

# ---- tests/test_titan.py: a widened debug model and the MoE model in FP8 (parity_runs) ----------------------------

TITAN_WIDE = ["model.dim=512", "model.ffn_hidden_dim=1536"]
TITAN_MOE_FP8 = ["model=debug_moe", "precision=fp8_tensorwise", "precision.experts=fp8_rowwise"]  # experts: the CPU emulation
TITAN_SHORT = ["parallelism=single", "training.steps=2", "training.seq_len=32", "training.global_batch_size=2", "logging.progress=false"]
# The MoE point trains one step of 16 tokens (the smallest GEMM side _scaled_mm takes): CPU FP8 GEMMs are a reference
# loop on some machines (measured: 130 s for 2 steps at 64 tokens, 18 s a step at 16).
TITAN_LAUNCHES = {
    1: {
        "titan-wide": TITAN_WIDE,
        "titan-moe_fp8": [
            *TITAN_MOE_FP8,
            "training.steps=1",
            "lr_scheduler.warmup_steps=1",
            "training.seq_len=16",
            "training.global_batch_size=1",
            "training.microbatch_size=1",
        ],
    }
}

# ---- tests/test_hf_load.py and tests/test_hf_export.py: start from Hugging Face weights (parity_runs) -----------

HF_COMMON = [
    "training.steps=1",
    "lr_scheduler.warmup_steps=1",
    "training.seq_len=64",
    "logging.progress=false",
    "training.global_batch_size=4",
    "training.microbatch_size=2",
]
HF_LAYOUTS = {1: ("single",), 2: ("ep2",), 4: ("dp2_tp2", "tp2_pp2", "hsdp2x2")}
HF_ONLY = {"dp2_tp2": ("llama3_gqa", "qwen3"), "tp2_pp2": ("llama3_gqa", "deepseek_v3"), "hsdp2x2": ("llama3_gqa",)}
"""The 4-rank layouts are tried on some models only (each 4-rank point costs a build and a step of 4 ranks on 2 cores):
FSDP x TP on Llama 3 with GQA (its KV heads split by TP) and on Qwen3 (q/k norms, the tied embedding sharded by TP);
PP on Llama 3 with GQA and on DeepSeek-V3 (latent attention, experts, the first block dense); HSDP, which reads like
FSDP once per replica, on Llama 3 with GQA. Qwen3's debug model ties its embedding, which TorchTitan cannot pipeline
(test_tied_embedding_under_pp_is_refused). Every model also loads on one rank, and the MoE models under EP."""
HF_RESUMED = "hf-resumed"
"""A point that resumes the one-rank Llama 3 point's checkpoint while naming model.init_from too: the checkpoint wins."""
HF_ROUND_TRIP = ("hf-llama3_gqa-single", "hf-llama3_gqa-dp2_tp2", "hf-llama3_gqa-tp2_pp2", "hf-qwen3_moe-ep2", "hf-deepseek_v3-ep2")
"""Points of the HF launches that also save a checkpoint after their one step, with a learning rate (1e-30) too small
to change a float32 weight: test_hf_export exports it and compares with the transformers folder it started from."""


def hf_layouts(name: str, nproc: int) -> list[str]:
    """The layouts of `nproc` ranks the tiny model `name` (tests/hf_models.py's TINY) starts from HF weights in."""
    fits = [p for p in HF_LAYOUTS[nproc] if p != "ep2" or name in hf_models.MOE]
    return [p for p in fits if name in HF_ONLY.get(p, (name,))]


def hf_launches(models: dict[str, Path], ckpt: Path, round_trip: dict[str, Path]) -> dict[int, dict[str, list[str]]]:
    """The parity points that start from each tiny model saved in models[name], per rank count. The one-rank Llama 3
    point trains 2 steps and checkpoints into `ckpt`; HF_RESUMED resumes it (2 steps, from step 1); each HF_ROUND_TRIP
    point checkpoints its untrained weights into round_trip[point]."""
    out: dict[int, dict[str, list[str]]] = {}
    for name in hf_models.TINY:
        for nproc in HF_LAYOUTS:
            for par in hf_layouts(name, nproc):
                extra = ["training.microbatch_size=1"] if par == "hsdp2x2" else []  # DP 4: one sample per rank
                overrides = [*HF_COMMON, *hf_models.overrides(name, models[name]), f"parallelism={par}", *extra]
                out.setdefault(nproc, {})[f"hf-{name}-{par}"] = overrides
    saves = ["checkpoint.enable=true", "checkpoint.interval=1", f"checkpoint.folder={ckpt}", "training.steps=2"]
    out[1]["hf-llama3-single"] += saves
    out[1]["hf-llama3-two-steps"] = [*out[1]["hf-llama3-single"], "checkpoint.enable=false"]
    # step 1's checkpoint of the same 2-step schedule (a 1-step run's would be another schedule: refused on resume)
    out[1][HF_RESUMED] = [*out[1]["hf-llama3-single"], "checkpoint.resume=true", f"checkpoint.resume_from={ckpt}/step-1"]
    for point, folder in round_trip.items():
        nproc = next(n for n, points in out.items() if point in points)
        out[nproc][point] += ["checkpoint.enable=true", f"checkpoint.folder={folder}", "checkpoint.async_save=false", "optimizer.lr=1e-30"]
    return out


# ---- tests/test_runner_vs_titan.py: the runner beside TorchTitan's own Trainer (parity_runs) ---------------------

TITAN_TRAINER = "titan_trainer-dp2_tp2"
"""The 4-rank parity point that test_runner_vs_titan trains again with TorchTitan's Trainer (bench/titan_trainer.py)."""


def titan_trainer(models: dict[str, Path]) -> list[str]:
    """TITAN_TRAINER's overrides, which TorchTitan's side composes too: 3 steps of the debug Llama 3 from its tiny
    Hugging Face folder (models["llama3"]) on dp2_tp2, seq 64, 2 microbatches of 2 samples per DP rank."""
    shape = ["training.steps=3", "training.seq_len=64", "training.global_batch_size=8", "training.microbatch_size=2"]
    return ["parallelism=dp2_tp2", *shape, "logging.progress=false", *hf_models.overrides("llama3", models["llama3"])]


TITAN_TRAINER_TEXT = "titan_trainer_text-tp2_pp2"
"""The 4-rank parity point on real documents that test_runner_vs_titan trains again with TorchTitan's own text loader."""


def titan_trainer_text(hf: Path, corpus: Path) -> list[str]:
    """TITAN_TRAINER_TEXT's overrides: TITAN_TRAINER's shape on tp2_pp2 (one DP replica: TorchTitan's order, docs/training.md)
    reading `corpus` in file order with the tokenizer of the Hugging Face folder `hf` (bench/runner_vs_titan.text_assets)."""
    shape = ["training.steps=3", "training.seq_len=64", "training.global_batch_size=8", "training.microbatch_size=2"]
    text = ["data=text", f"data.files=[{corpus}]", f"data.tokenizer={hf / 'tokenizer.json'}", "data.shuffle=false"]
    return ["parallelism=tp2_pp2", *shape, "logging.progress=false", *hf_models.overrides("llama3", hf), *text]


TITAN_TRAINER_MOE = "titan_trainer_moe-dp2_ep2"
"""The 4-rank MoE parity point (expert parallelism inside FSDP) that test_runner_vs_titan trains again with TorchTitan's Trainer."""


def titan_trainer_moe() -> list[str]:
    """TITAN_TRAINER_MOE's overrides: debug_moe from the runner's initial weights (no Hugging Face folder: TorchTitan's
    side initializes as the runner's CPU ranks do, bench/titan_trainer.runner_initial_weights), FSDP over 4 ranks with
    EP 2 inside it, 3 steps of 2 microbatches of 1 sample per DP rank (the token counts accumulate over both before
    each expert-bias update)."""
    shape = ["training.steps=3", "training.seq_len=64", "training.global_batch_size=8", "training.microbatch_size=1"]
    return ["model=debug_moe", "parallelism=ep2", "parallelism.name=dp2_ep2", "parallelism.dp_shard=4", *shape, "logging.progress=false"]


def parity_launches(
    models: dict[str, Path], ckpt: Path, round_trip: dict[str, Path], text: tuple[Path, Path] | None = None
) -> dict[int, dict[str, list[str]]]:
    """Every parity point, each with its section's common overrides, per rank count (ascending): test_parallel's,
    test_family_train's, test_titan's, then the HF ones (hf_launches' arguments) and test_runner_vs_titan's."""
    launches: dict[int, dict[str, list[str]]] = {}
    for common, table in ((PARALLEL_COMMON, PARALLEL_LAUNCHES), (FAMILY_COMMON, FAMILY_LAUNCHES), (TITAN_SHORT, TITAN_LAUNCHES)):
        for nproc, points in table.items():
            launches.setdefault(nproc, {}).update({name: [*common, *o] for name, o in points.items()})
    for nproc, points in hf_launches(models, ckpt, round_trip).items():  # their common overrides inside
        launches.setdefault(nproc, {}).update(points)
    launches[4][TITAN_TRAINER] = titan_trainer(models)
    launches[4][TITAN_TRAINER_MOE] = titan_trainer_moe()
    if text is not None:
        launches[4][TITAN_TRAINER_TEXT] = titan_trainer_text(*text)
    return dict(sorted(launches.items()))


# ---- tests/test_dryrun.py and tests/test_plan_memory.py: mode=dryrun (dry_runs) -----------------------------------

DRYRUN_SMALL = ["recipe=debug_dp2_tp2_cpu", "training.seq_len=64", "training.global_batch_size=4", "training.microbatch_size=1"]
PLAN_MEMORY_DEBUG = ["precision=bf16", "training.seq_len=512", "training.microbatch_size=1", "model.num_kv_heads=4", "model.num_layers=12"]
PLAN_MEMORY_CASES = {  # name: (overrides, dry-run ranks)
    "pp": (["parallelism=dp2_pp2", "training.global_batch_size=8"], [0, 3]),
    "pp_full_ac": (["parallelism=dp2_pp2", "training.global_batch_size=8", "training.activation_checkpoint=full"], [0]),
    "tp_sp": (["parallelism=dp2_tp2", "training.global_batch_size=4"], [0]),
    # Interleaved1F1B (v 2): each virtual stage holds torch's warm-up count of microbatches and its own receive buffers
    "pp_interleaved": (["parallelism=pp2_interleaved", "training.global_batch_size=8"], [0, 1]),
    # torchao's rowwise Float8Linear on the first stage, whose peak is inside w2's backward (its float8 casts): 3 s
    "pp_fp8_rowwise": (
        ["parallelism=dp2_pp2", "training.global_batch_size=8", "precision=fp8_rowwise", "precision.param_dtype=bfloat16"],
        [0],
    ),
    # Qwen3: per-head q/k RMSNorms; its tied embedding, one parameter under TP too; the peak inside the last block's backward
    "qwen3_tp_sp": (["model=qwen3_debugmodel", "parallelism=dp2_tp2", "training.global_batch_size=4"], [0]),
    # Qwen3 MoE (64 experts of 768) without AC: both stages peak past an MoE block's experts' backward
    "qwen3_moe_pp": (["model=qwen3_debugmodel_moe", "parallelism=dp2_pp2", "training.global_batch_size=8"], [0, 3]),
}
DRYRUNS = {"dryrun-ledger": [*DRYRUN_SMALL, "dryrun.ranks=[0]"], "dryrun-8b": ["recipe=llama3_8b_fsdp8_h100"]}
# MLA on CPU (SDPA's math path) at seq 2,048 with full AC: the peak inside an attention's backward (3 s)
DRYRUNS["plan_memory-mla_cpu"] = [
    *("model=debug_moe", "parallelism=ep2", "cluster=h100_node", "cluster.devices_per_node=2", "precision=bf16"),
    *("training.seq_len=2048", "training.global_batch_size=4", "training.microbatch_size=1", "training.activation_checkpoint=full"),
    "dryrun.ranks=[0]",
]
DRYRUNS |= {
    f"plan_memory-{case}": [*PLAN_MEMORY_DEBUG, *o, f"dryrun.ranks={ranks}".replace(" ", "")]
    for case, (o, ranks) in PLAN_MEMORY_CASES.items()
}
"""Both modules' dry runs, the common mode=dryrun aside."""
RECIPE_DRYRUNS = {
    name: "dryrun-8b" if name == "llama3_8b_fsdp8_h100" else f"recipe-{name}"  # the 8B recipe's default ranks are [0]
    for name in sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))
}
"""Every shipped recipe's rank 0 on the CPU (tests/test_recipes.py), by its point in DRYRUNS or MOE_DRYRUNS; gpt-oss an
invalid point (refused at validation)."""
MOE_RECIPES = ("deepseek_v3_671b_h800x2048", "qwen3_235b_a22b_h100x1024")
"""The recipes whose rank 0 costs most of a minute here (32 and 16 microbatches of MoE blocks with full recomputation on
fake tensors; bench/README.md): their dry runs are the CUDA tier's (`-m cuda_rehearsal`, after the main suite)."""
DRYRUNS |= {p: [f"recipe={n}", "dryrun.ranks=[0]"] for n, p in RECIPE_DRYRUNS.items() if n not in MOE_RECIPES and p not in DRYRUNS}
MOE_DRYRUNS = {RECIPE_DRYRUNS[n]: [f"recipe={n}", "dryrun.ranks=[0]"] for n in MOE_RECIPES}

# ---- tests/test_train.py: every layout and FP8 recipe (shared_runs) ----------------------------------------------

TRAIN_SHORT = ["training.steps=3", "training.seq_len=64", "logging.progress=false"]
TRAIN_LAYOUTS = {
    # traced at step 2 (the W&B run gets its breakdown); profile.memory on CPU says allocator snapshots are CUDA-only
    "single": ["parallelism=single", "logging=wandb", "logging.progress=false", "profile.steps=[2]", "profile.memory=true"],
    "dp2": ["parallelism=dp2", "training.activation_checkpoint=full"],
    # FSDP2 x 1F1B through TorchTitan's pipeline_llm; host collectives on their own group, as on CUDA, and audited
    "dp2_pp2": [
        "parallelism=dp2_pp2",
        "checkpoint=local",
        "checkpoint.interval=2",
        "distributed.host_group=dedicated",
        "distributed.audit_collectives=true",
        "monitor.straggler.interval=2",
    ],
    "dp2_tp2": [],  # the default layout
    "bf16": ["parallelism=single", "precision=bf16", "training.steps=2", "training.seq_len=32", "training.global_batch_size=2"],
    "fp8_ref": ["training.steps=2", "training.seq_len=16", "training.global_batch_size=2", "training.microbatch_size=1"],
}
FP8_STEPS = ["training.steps=2"]
FP8_SMALL = [*FP8_STEPS, "training.seq_len=16", "training.global_batch_size=2", "training.microbatch_size=1"]
FP8_RUNS = {
    "fp8_tensorwise": ["precision=fp8_tensorwise", *FP8_SMALL],
    "fp8_rowwise": ["precision=fp8_rowwise", *FP8_SMALL],
    "fp8_blockwise": ["precision=fp8_blockwise", *FP8_STEPS],  # emulated on CPU (fp32 matmuls): the default batch
    # traced at step 2 (step 1 warms the profiler up): tests/test_train.py::test_a_tp2_pp2_step_traced_and_split_by_term
    "fp8_blockwise_tp2_pp2": ["precision=fp8_blockwise", "parallelism=tp2_pp2", *FP8_STEPS, "profile.steps=[2]"],
}
TRAIN = {name: [*TRAIN_SHORT, *overrides] for name, overrides in (TRAIN_LAYOUTS | FP8_RUNS).items()}

# ---- tests/test_checkpoint.py: an uninterrupted reference and a SIGKILLed run, data=text (shared_runs) ------------

CHECKPOINT_STEPS, CHECKPOINT_KILL_AT = 6, 4
CHECKPOINT_POINTS = {
    "reference": [
        *("checkpoint.export_final_model=true", "checkpoint.export_hf=true"),
        *("cluster.mtbf_hours=0.01", "cluster.checkpoint_write_gbs=0.01"),
    ],
    "killed": ["monitor.inject.kill_rank=1", f"monitor.inject.kill_at_step={CHECKPOINT_KILL_AT}", "cluster.max_restarts=1"],
}


def checkpoint_common(text: tuple[Path, Path]) -> list[str]:
    """Every checkpoint run's overrides on the text corpus and tokenizer `text` (conftest's text_files)."""
    corpus, tok = text
    return [
        "data=text",
        f"data.files=[{corpus}]",
        f"data.tokenizer={tok}",
        "checkpoint=local",
        "checkpoint.interval=1",
        "checkpoint.keep=3",
        f"training.steps={CHECKPOINT_STEPS}",
        "training.seq_len=64",
        "logging.progress=false",
        "distributed.shutdown_timeout_s=5",
        # resumed bitwise with parameter groups and a decaying schedule (the killed run resumes mid-decay)
        "optimizer.no_decay_1d_and_embeddings=true",
        "lr_scheduler.decay_type=cosine",
        "lr_scheduler.min_lr_factor=0.1",
    ]


def checkpoint(text: tuple[Path, Path]) -> dict[str, list[str]]:
    """CHECKPOINT_POINTS as points of the shared multirun, named ckpt-<name>."""
    return {f"ckpt-{name}": [*checkpoint_common(text), *overrides] for name, overrides in CHECKPOINT_POINTS.items()}


# ---- tests/test_local_checkpoint.py: the node-local tier on two simulated nodes, each a SIGKILLed run (shared_runs) --

LOCAL_NODES = ["n0", "n0", "n1", "n1"]
"""Ranks 0-1 on node n0, 2-3 on n1 (monitor.inject.node_names): each rank's partner is the same position on the other."""
LOCAL_LOSSES = {"flipped": "flip:1", "node_lost": "node:n1", "shards_lost": "shard:1"}
"""Each point's monitor.inject.lose_local: what is destroyed of the local tier before the restart reads it. The plain
kill (nothing lost) is the flipped point: ranks 0, 2 and 3 restore their own shards there, rank 1 its partner copy."""


def local_tier(text: tuple[Path, Path]) -> dict[str, list[str]]:
    """LOCAL_LOSSES as points of the shared multirun, named local-<name>: CHECKPOINT_POINTS' reference run (6 steps) with
    synchronous shared saves every 2 steps and local ones between them (steps 1, 3, 5) into <assets>/local/<name>/<node>,
    rank 1 SIGKILLed at the start of step 4 (after the local save of step 3, newer than the shared one of step 2) and
    restarted by the elastic agent."""
    common = [o for o in checkpoint_common(text) if not o.startswith("checkpoint.interval=")]
    common += [
        "checkpoint.interval=2",
        "checkpoint.async_save=false",
        "checkpoint.local.interval=1",
        f"monitor.inject.node_names=[{','.join(LOCAL_NODES)}]",
    ]
    common += ["monitor.inject.kill_rank=1", f"monitor.inject.kill_at_step={CHECKPOINT_KILL_AT}", "cluster.max_restarts=1"]
    out = {}
    for name, loss in LOCAL_LOSSES.items():
        folder = text[0].parent / "local" / name / "%N"
        out[f"local-{name}"] = [*common, f"checkpoint.local.folder={folder}", f"monitor.inject.lose_local={loss}"]
    return out


# ---- tests/test_tokens.py: data=tokens references, killed runs and a resume under another layout (shared_runs) ----

TOKENS_STEPS, TOKENS_KILL_AT, TOKENS_SEQ = 3, 2, 64  # sync saves: step 1's checkpoint is published when step 2 starts
TOKENS_POINTS = ("tok_ref", "tok_killed", "mix_ref", "mix_killed", "tok_pp")


def tokens(a: Path, b: Path, ckpt: Path) -> dict[str, list[str]]:
    """TOKENS_POINTS, in this order (tok_pp resumes from tok_ref's checkpoint in `ckpt`), on the prepared folders a and
    b (conftest's token_folders)."""
    common = [
        "checkpoint=local",
        "checkpoint.interval=1",
        "checkpoint.keep=0",
        "checkpoint.async_save=false",
        f"training.steps={TOKENS_STEPS}",
        f"training.seq_len={TOKENS_SEQ}",
    ]
    common += ["logging.progress=false", "distributed.shutdown_timeout_s=5", "data=tokens"]
    tok, mix = [f"data.path={a}"], [f"data.mix=[{{path: {a}, weight: 0.7}}, {{path: {b}, weight: 0.3}}]"]
    kill = ["monitor.inject.kill_rank=1", f"monitor.inject.kill_at_step={TOKENS_KILL_AT}", "cluster.max_restarts=1"]
    points = {
        "tok_ref": [*tok, "parallelism=dp2_tp2", f"checkpoint.folder={ckpt}"],
        "tok_killed": [*tok, "parallelism=dp2_tp2", *kill],
        "mix_ref": [*mix, "parallelism=dp2"],
        "mix_killed": [*mix, "parallelism=dp2", *kill],
        "tok_pp": [*tok, "parallelism=tp2_pp2", "parallelism.tp=1", "checkpoint.resume=true", f"checkpoint.resume_from={ckpt}/step-1"],
    }
    assert tuple(points) == TOKENS_POINTS
    return {name: [*common, *overrides] for name, overrides in points.items()}


# ---- tests/test_slurm.py: the one-node reference of the two-node SLURM job (shared_runs) ---------------------------

SLURM_SHORT = ["training.steps=6", "training.seq_len=64", "logging.progress=false"]
SLURM = {"slurm-one_node": SLURM_SHORT}  # cluster=local_cpu: the default dp2_tp2 on 4 ranks of one node
