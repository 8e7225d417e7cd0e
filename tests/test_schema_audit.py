"""Audit of every schema field: one bad value per field that has one (what torch, TorchTitan or
torchao would refuse at start-up, or what would silently switch a feature off), each refused
with its field named; and, with a reason each, the fields that have no bad value."""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
import typing
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner import schema
from runner.config import compose, validate
from runner.schema.problems import Problem
from tests import composing

GPU = ["cluster=h100_node", "parallelism=fsdp", "precision=bf16", "training.global_batch_size=16"]  # bf16: a GPU refuses fp32
SLURM = [
    *("cluster=slurm_h100", "cluster.num_nodes=2", "cluster.slurm.partition=gpu"),
    *("parallelism=fsdp", "precision=bf16", "training.global_batch_size=32"),
]
MOE = ["model=debug_moe", "parallelism=single"]
PP2 = ["parallelism=dp2_pp2"]

# (overrides, the field the error must name). Enum fields are refused by OmegaConf at composition.
TORCHFT = ["fault_tolerance=torchft", "parallelism=hsdp2x2"]
BAD = [
    (["mode=fly"], "mode"),
    (["model.name=gpt2"], "model.name"),
    (["model.flavor=9B"], "model.flavor"),
    (["model.dim=0"], "model.dim"),
    (["model.num_layers=0"], "model.num_layers"),
    (["model.num_heads=7"], "model.num_heads"),
    (["model.num_kv_heads=3"], "model.num_kv_heads"),
    (["model.vocab_size=0"], "model.vocab_size"),
    (["model.ffn_hidden_dim=0"], "model.ffn_hidden_dim"),
    (["model.num_experts=-1"], "model.num_experts"),
    ([*MOE, "model.num_experts_per_token=9"], "model.num_experts_per_token"),
    ([*MOE, "model.load_balance_coeff=-0.001"], "model.load_balance_coeff"),
    ([*MOE, "model.num_shared_experts=-1"], "model.num_shared_experts"),
    ([*MOE, "model.moe_hidden_dim=0"], "model.moe_hidden_dim"),
    ([*MOE, "model.num_dense_layers=6"], "model.num_dense_layers"),
    (["model.num_mtp_layers=1"], "model.num_mtp_layers"),  # llama3 has no MTP blocks
    (["model.mtp_loss_scale=-1"], "model.mtp_loss_scale"),
    ([*MOE, "model.kv_lora_rank=-1"], "model.kv_lora_rank"),
    (["model.q_lora_rank=-1"], "model.q_lora_rank"),
    (["model.qk_nope_head_dim=-1"], "model.qk_nope_head_dim"),
    (["model.qk_rope_head_dim=-1"], "model.qk_rope_head_dim"),
    (["model.v_head_dim=-1"], "model.v_head_dim"),
    (["model.head_dim=-1"], "model.head_dim"),
    (["model.sliding_window=-1"], "model.sliding_window"),
    (["model.full_attention_interval=0"], "model.full_attention_interval"),
    (["model.rope_max_seq_len=0"], "model.rope_max_seq_len"),
    (["model.rope_theta=0"], "model.rope_theta"),
    (["model.rope_dim=-1"], "model.rope_dim"),
    (["model.init_from=/nonexistent/hf", "mode=validate"], "model.init_from"),
    (["+model.init_record.config_sha256=abc"], "model.init_record"),
    (["model=qwen3_5_debugmodel", "model.num_linear_key_heads=3"], "model.num_linear_value_heads"),  # 4 value heads
    (["model=qwen3_5_debugmodel", "model.num_linear_key_heads=0"], "model.num_linear_key_heads"),
    (["model=qwen3_5_debugmodel", "model.linear_key_head_dim=0"], "model.linear_key_head_dim"),
    (["model=qwen3_5_debugmodel", "model.linear_value_head_dim=0"], "model.linear_value_head_dim"),
    (["model=qwen3_5_debugmodel", "model.linear_conv_kernel=0"], "model.linear_conv_kernel"),
    (["parallelism.dp_replicate=0"], "parallelism.dp_replicate"),
    (["parallelism.dp_shard=-2"], "parallelism.dp_shard"),
    (["parallelism.tp=0"], "parallelism.tp"),
    (["parallelism.pp=0"], "parallelism.pp"),
    (["parallelism.cp=0"], "parallelism.cp"),
    (["parallelism.ep=0"], "parallelism.ep"),
    (["parallelism=single", "parallelism.pp_schedule=Zigzag"], "parallelism.pp_schedule"),  # refused at pp=1 too
    ([*PP2, "parallelism.pp_virtual_stages=0"], "parallelism.pp_virtual_stages"),
    ([*PP2, "parallelism.pp_first_stage_less_layers=-1"], "parallelism.pp_first_stage_less_layers"),
    ([*PP2, "parallelism.pp_last_stage_less_layers=-1"], "parallelism.pp_last_stage_less_layers"),
    (["parallelism.async_tp=true"], "parallelism.async_tp"),
    (["parallelism.fsdp_reshard_after_forward=sometimes"], "parallelism.fsdp_reshard_after_forward"),
    (["model=debug_moe", "parallelism=ep2", "parallelism.moe_comm_backend=deepep"], "parallelism.moe_comm_backend"),  # CPU
    (["precision.param_dtype=float16"], "precision.param_dtype"),
    (["precision.reduce_dtype=float64"], "precision.reduce_dtype"),
    (["precision=mxfp8"], "precision.fp8"),  # no CPU path
    (["precision.experts=fp8_rowwise"], "precision.experts"),  # the default model is dense
    (["checkpoint.interval=0"], "checkpoint.interval"),
    (["checkpoint.keep=-1"], "checkpoint.keep"),
    (["checkpoint.resume=true"], "checkpoint.resume"),  # with checkpoints off
    (["checkpoint.min_free_gb=-1"], "checkpoint.min_free_gb"),
    (["checkpoint=local", "checkpoint.local.folder=ckpt"], "checkpoint.local.folder"),  # relative: inside the run folder
    (["checkpoint=local", "checkpoint.local.folder=/l", "checkpoint.local.interval=0"], "checkpoint.local.interval"),
    (["checkpoint=local", "checkpoint.local.folder=/l", "checkpoint.local.keep=0"], "checkpoint.local.keep"),
    (["checkpoint.export_hf=true"], "checkpoint.export_hf"),  # with checkpoints off
    (["checkpoint.init_from=/nonexistent/run", "mode=validate"], "checkpoint.init_from"),
    (["+checkpoint.init_record.step=4"], "checkpoint.init_record"),  # without checkpoint.init_from
    ([*SLURM, "cluster.slurm.partition=null"], "cluster.slurm.partition"),
    ([*SLURM, "cluster.slurm.time_min=0"], "cluster.slurm.time_min"),
    ([*SLURM, "cluster.slurm.gpus_per_node_max=0"], "cluster.slurm.gpus_per_node_max"),
    ([*SLURM, "cluster.slurm.cpus_per_node=0"], "cluster.slurm.cpus_per_node"),
    ([*SLURM, "cluster.slurm.mem_gb=0"], "cluster.slurm.mem_gb"),
    ([*SLURM, "cluster.slurm.signal_s=0"], "cluster.slurm.signal_s"),
    ([*SLURM, "cluster.slurm.max_requeues=-1"], "cluster.slurm.max_requeues"),
    (["cluster.num_nodes=0"], "cluster.num_nodes"),
    (["cluster.devices_per_node=0"], "cluster.devices_per_node"),
    (["cluster.device=tpu"], "cluster.device"),
    (["cluster.backend=nccl"], "cluster.backend"),
    (["cluster.intra_node_bandwidth_gbs=-1"], "cluster.intra_node_bandwidth_gbs"),
    (["cluster.inter_node_bandwidth_gbs=-1"], "cluster.inter_node_bandwidth_gbs"),
    ([*GPU, "cluster.peak_tflops.bfloat16=0"], "cluster.peak_tflops"),
    ([*GPU, "cluster.compute_capability=nine"], "cluster.compute_capability"),
    (["cluster.high_precision_dtype=float16"], "cluster.high_precision_dtype"),
    (["cluster.device_memory_gb=-1"], "cluster.device_memory_gb"),
    (["cluster.launcher=pbs"], "cluster.launcher"),
    (["cluster.max_restarts=-1"], "cluster.max_restarts"),
    ([*GPU, "cluster.worker_start=fork"], "cluster.worker_start"),
    (["cluster.rdzv_port=70000"], "cluster.rdzv_port"),
    (["cluster.rank_overhead_gb=-1"], "cluster.rank_overhead_gb"),
    (["cluster.achievable_mfu=0"], "cluster.achievable_mfu"),
    (["cluster.matmul_efficiency=1.5"], "cluster.matmul_efficiency"),
    (["cluster.mtbf_hours=-1"], "cluster.mtbf_hours"),
    (["cluster.checkpoint_write_gbs=-1"], "cluster.checkpoint_write_gbs"),
    (["cluster.local_write_gbs=-1"], "cluster.local_write_gbs"),
    (["cluster.memory_bandwidth_gbs=-1"], "cluster.memory_bandwidth_gbs"),
    (["cluster.profile=/nonexistent/profile.json"], "cluster.profile"),
    (["data.name=web"], "data.name"),
    (["data=text", "data.tokenizer=tokenizer.json"], "data.files"),  # text with no files
    (["data.format=csv"], "data.format"),
    (["data=text", "data.files=[corpus.jsonl]"], "data.tokenizer"),  # text with no tokenizer
    (["data=tokens"], "data.path"),  # tokens with no prepared folder
    (["data=tokens", "data.path=a", "data.mix=[{path:b,weight:1}]"], "data.mix"),  # one folder and a mixture at once
    (["data=tokens", "data.path=a", "parallelism=cp2"], "data.document_mask"),  # CPU ring attention takes no document mask
    (["logging.wandb.mode=cloud"], "logging.wandb.mode"),
    (["logging.log_every=0"], "logging.log_every"),
    (["training.steps=0"], "training.steps"),
    (["training.seed=-1"], "training.seed"),
    (["training.seq_len=0"], "training.seq_len"),
    (["training.global_batch_size=0"], "training.global_batch_size"),
    (["training.microbatch_size=0"], "training.microbatch_size"),
    (["optimizer.lr=0"], "optimizer.lr"),
    (["optimizer.weight_decay=-0.1"], "optimizer.weight_decay"),
    (["lr_scheduler.warmup_steps=-1"], "lr_scheduler.warmup_steps"),
    (["lr_scheduler.decay_type=exponential"], "lr_scheduler.decay_type"),
    (["lr_scheduler.decay_ratio=1.5"], "lr_scheduler.decay_ratio"),
    (["lr_scheduler.min_lr_factor=2"], "lr_scheduler.min_lr_factor"),
    (["optimizer.name=SGD"], "optimizer.name"),
    (["optimizer.betas=[0.9,1.0]"], "optimizer.betas"),
    (["optimizer.eps=0"], "optimizer.eps"),
    (["optimizer.implementation=fast"], "optimizer.implementation"),
    (["training.gc_every=-1"], "training.gc_every"),
    (["training.max_norm=0"], "training.max_norm"),
    (["training.activation_checkpoint=selective"], "training.activation_checkpoint"),
    (["training.ac_layer_frequency=0"], "training.ac_layer_frequency"),
    (["search.top_k=-1"], "search.top_k"),  # with search.verify = 0 > top_k, which is not the problem
    (["search.max_virtual_stages=1"], "search.max_virtual_stages"),
    (["search.max_cp=0"], "search.max_cp"),
    (["search.max_microbatch_size=0"], "search.max_microbatch_size"),
    (["search.verify=-1"], "search.verify"),
    (["search.verify=1", "search.verify_steps=1"], "search.verify_steps"),
    (["mode=plan", "objective=final_loss"], "objective"),
    (["monitor.straggler.interval=0"], "monitor.straggler.interval"),
    (["monitor.straggler.factor=1"], "monitor.straggler.factor"),
    (["monitor.straggler.windows=0"], "monitor.straggler.windows"),
    (["monitor.straggler.min_seconds=-1"], "monitor.straggler.min_seconds"),
    (["monitor.straggler.min_excess_s=-1"], "monitor.straggler.min_excess_s"),
    (["monitor.straggler.min_step_frac=1"], "monitor.straggler.min_step_frac"),
    (["monitor.guard.factor=0.5"], "monitor.guard.factor"),
    (["monitor.guard.window=0"], "monitor.guard.window"),
    (["monitor.guard.warmup_steps=25"], "monitor.guard.warmup_steps"),  # > window 20: detection never starts
    (["monitor.guard.action=rewind"], "monitor.guard.action"),  # with checkpoints off
    (["monitor.guard.max_consecutive=0"], "monitor.guard.max_consecutive"),
    (["monitor.inject.delay_rank=4"], "monitor.inject.delay_rank"),  # 4 ranks: 0..3
    (["monitor.inject.delay_frac=-1"], "monitor.inject.delay_frac"),
    (["monitor.inject.hang_rank=-2"], "monitor.inject.hang_rank"),
    (["monitor.inject.hang_rank=0", "monitor.inject.hang_at_step=11"], "monitor.inject.hang_at_step"),
    (["monitor.inject.hang_s=-1"], "monitor.inject.hang_s"),
    (["monitor.inject.corrupt_steps=[0]"], "monitor.inject.corrupt_steps"),
    (["monitor.inject.norm_shift_step=11"], "monitor.inject.norm_shift_step"),
    (["monitor.inject.norm_shift_scale=0"], "monitor.inject.norm_shift_scale"),
    (["monitor.inject.kill_rank=9"], "monitor.inject.kill_rank"),
    (["monitor.inject.kill_rank=0", "monitor.inject.kill_at_step=0"], "monitor.inject.kill_at_step"),
    (["monitor.straggler.last_frac=0"], "monitor.straggler.last_frac"),
    (["monitor.straggler.min_late_s=-1"], "monitor.straggler.min_late_s"),
    (["monitor.integrity.interval=-1"], "monitor.integrity.interval"),
    (["monitor.integrity.replay_interval=-1"], "monitor.integrity.replay_interval"),
    (["monitor.integrity.on_mismatch=rewind"], "monitor.integrity.on_mismatch"),  # with checkpoints off
    (["monitor.moe_load.hot_factor=1"], "monitor.moe_load.hot_factor"),
    (["monitor.moe_load.rank_factor=0.5"], "monitor.moe_load.rank_factor"),
    (["monitor.moe_load.windows=0"], "monitor.moe_load.windows"),
    (["monitor.moe_load.min_tokens=0"], "monitor.moe_load.min_tokens"),
    (["monitor.inject.flip_rank=4"], "monitor.inject.flip_rank"),  # 4 ranks: 0..3
    (["monitor.inject.flip_rank=0", "monitor.inject.flip_at_step=0"], "monitor.inject.flip_at_step"),
    (["monitor.inject.replay_rank=-2"], "monitor.inject.replay_rank"),
    (["monitor.inject.fault_rank=4"], "monitor.inject.fault_rank"),  # 4 ranks: 0..3
    (["monitor.inject.fault_rank=0", "monitor.inject.fault_at_step=0"], "monitor.inject.fault_at_step"),
    (["monitor.inject.node_names=[a,b]"], "monitor.inject.node_names"),  # 4 ranks
    (["monitor.inject.lose_local=node:x"], "monitor.inject.lose_local"),
    (["distributed.timeout_s=0"], "distributed.timeout_s"),
    (["distributed.heartbeat_s=1000"], "distributed.heartbeat_s"),
    (["distributed.host_group=nccl"], "distributed.host_group"),
    (["dryrun.ranks=[4]"], "dryrun.ranks"),
    (["mode=dryrun", "dryrun.device=cuda"], "dryrun.device"),  # the CPU default cluster: the CUDA rehearsal plays a CUDA one
    (["checkpoint=local", "checkpoint.resume_from=/nonexistent/step-4"], "checkpoint.resume_from"),
    (["distributed.shutdown_timeout_s=-1"], "distributed.shutdown_timeout_s"),
    (["fault_tolerance.name=fly"], "fault_tolerance.name"),
    ([*TORCHFT, "fault_tolerance.lighthouse=nowhere"], "fault_tolerance.lighthouse"),
    ([*TORCHFT, "fault_tolerance.lighthouse_port=0"], "fault_tolerance.lighthouse_port"),
    ([*TORCHFT, "fault_tolerance.min_replicas=0"], "fault_tolerance.min_replicas"),
    ([*TORCHFT, "fault_tolerance.join_timeout_ms=0"], "fault_tolerance.join_timeout_ms"),
    ([*TORCHFT, "fault_tolerance.heartbeat_timeout_ms=0"], "fault_tolerance.heartbeat_timeout_ms"),
    ([*TORCHFT, "fault_tolerance.timeout_s=0"], "fault_tolerance.timeout_s"),
    ([*TORCHFT, "fault_tolerance.quorum_timeout_s=0"], "fault_tolerance.quorum_timeout_s"),
    ([*TORCHFT, "fault_tolerance.connect_timeout_s=0"], "fault_tolerance.connect_timeout_s"),
    ([*TORCHFT, "fault_tolerance.process_group_timeout_ms=0"], "fault_tolerance.process_group_timeout_ms"),
    ([*TORCHFT, "fault_tolerance.replica_id=2"], "fault_tolerance.replica_id"),
    (["distributed.flight_recorder.buffer_size=0"], "distributed.flight_recorder.buffer_size"),
    (["plan.flops_convention=8N"], "plan.flops_convention"),
    (["plan.moe_imbalance=0.5"], "plan.moe_imbalance"),
    (["eval.interval=-1"], "eval.interval"),
    (["eval.steps=0"], "eval.steps"),
    (["data.eval_fraction=1.0"], "data.eval_fraction"),
    (["data=text", "data.files=[a.jsonl]", "data.tokenizer=tok.json", "eval.interval=5"], "data.eval_files"),  # no held-out split
    (["profile.steps=[11]"], "profile.steps"),  # a 10-step run
    (["profile.every=2", "profile.warmup=2"], "profile.every"),  # a cycle of 3 steps
    (["profile.warmup=-1"], "profile.warmup"),
    (["profile.active=0"], "profile.active"),
    (["profile.ranks=[4]"], "profile.ranks"),  # 4 ranks: 0..3
]

# Fields with no value the config layer can call wrong, and why.
NO_BAD_VALUE = [
    ("model.weight_tying", "the model is built from TorchTitan's registry flavor; a test keeps the copied numbers equal to it"),
    ("model.fuse_qkv", "either setting builds; scripts/gen_models.py writes the flavor's from TorchTitan's registry"),
    ("model.qk_norm", "either setting builds; scripts/gen_models.py writes the flavor's from TorchTitan's registry"),
    ("model.attention_bias", "either setting builds; scripts/gen_models.py writes the flavor's from TorchTitan's registry"),
    ("model.attention_sinks", "either setting builds; scripts/gen_models.py writes the flavor's from TorchTitan's registry"),
    ("model.moe_bias", "either setting builds; scripts/gen_models.py writes the flavor's from TorchTitan's registry"),
    ("model.attention_output_gate", "either setting builds; scripts/gen_models.py writes the flavor's from TorchTitan's registry"),
    ("model.shared_expert_gate", "either setting builds; scripts/gen_models.py writes the flavor's from TorchTitan's registry"),
    ("model.rope_cos_sin", "either setting builds; scripts/gen_models.py writes the flavor's from TorchTitan's registry"),
    ("model.init_format", "one choice (hf): OmegaConf refuses any other name at composition"),
    ("parallelism.name", "a label for reports"),
    ("parallelism.sequence_parallel", "both settings run with any tp (validation checks seq_len against tp when it is on)"),
    ("precision.name", "a label for reports"),
    ("precision.keep_high_precision", "presets list non-Linear modules on purpose; a pattern that matches nothing keeps nothing"),
    (
        "precision.allow_fp32_on_gpu",
        "either setting runs: false makes float32 on a CUDA cluster a problem of precision.param_dtype (tests/test_recipes.py)",
    ),
    ("checkpoint.enable", "either setting runs"),
    ("checkpoint.folder", "any path; whether it can be written is a launch-time check (validate.preflight)"),
    ("checkpoint.async_save", "either setting runs"),
    ("checkpoint.export_final_model", "either setting runs"),
    ("cluster.name", "a label for reports"),
    ("cluster.rdzv_host", "any host name; reachability is the rendezvous's own check"),
    ("cluster.slurm.account", "free text passed to sbatch; null = the user's default"),
    ("cluster.slurm.constraint", "free text passed to sbatch"),
    ("cluster.slurm.exclusive", "either setting submits"),
    ("cluster.slurm.container_image", "free text passed to pyxis"),
    ("data.text_field", "any column name; its presence is checked when the files are read"),
    ("data.eos_token", "a bare tokenizer's EOS: one it lacks is refused with the files (tests/test_documents.py), skipped when off"),
    ("data.shuffle", "either setting runs"),
    ("logging.name", "a label for reports"),
    ("logging.progress", "either setting runs"),
    ("logging.verbose", "either setting runs"),
    (
        "fault_tolerance.lighthouse_bind",
        'any host the machine has, or "" for the default; an address it lacks fails torchft\'s bind, which names it',
    ),
    ("logging.wandb.enable", "either setting runs"),
    ("logging.wandb.project", "any name W&B accepts"),
    ("logging.wandb.entity", "null = the account default"),
    ("logging.wandb.group", "null = the sweep folder"),
    ("training.compile", "either setting runs (async TP's need for it is checked under parallelism.async_tp)"),
    ("monitor.straggler.enable", "either setting runs"),
    ("monitor.straggler.arrival", "either setting runs"),
    ("monitor.moe_load.enable", "either setting runs"),
    ("monitor.layer_stats", "either setting runs"),
    ("monitor.guard.enable", "off is a documented choice; non-finite values are caught either way"),
    ("monitor.inject.corrupt_scale", "any float is a corruption, nan included"),
    ("distributed.flight_recorder.enable", "either setting runs"),
    ("distributed.flight_recorder.dump_on_timeout", "either setting runs"),
    ("distributed.flight_recorder.folder", "any path inside or outside the run folder"),
    ("distributed.flight_recorder.enable_timing", "CUDA-only by its docstring; ignored on gloo"),
    ("distributed.audit_collectives", "test-only; either setting runs"),
    ("eval.cpu_flex_attention", "test-only; runner.run.layout_parity evaluates with it, and the preflight refuses it in a launch"),
    ("checkpoint.checksum", "either setting runs (off: completeness by file size only)"),
    ("dryrun.full_batch", "either setting runs (the reduced batch's peak differs only by the receive buffers the note names)"),
    ("cluster.peak_cache_dir", "any folder, created when the peak is cached; null turns the cache off"),
    ("profile.memory", "either setting runs (on CPU the run says allocator snapshots are CUDA-only)"),
    ("provenance", "filled by the runner, ignored on input"),
    ("optimizer.no_decay_1d_and_embeddings", "either setting trains (tests/test_titan.py checks the groups it builds)"),
    (
        "optimizer.param_groups",
        "a pattern that is not a regex is refused (tests/test_validate_rules.py), one that matches no parameter before launch",
    ),
]


def _leaves(kind: type, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(kind)
    out = []
    for f in dataclasses.fields(kind):
        t = hints[f.name]
        out += _leaves(t, f"{prefix}{f.name}.") if dataclasses.is_dataclass(t) else [f"{prefix}{f.name}"]
    return out


def test_every_schema_field_is_audited():
    bad = [field for _, field in BAD]
    assert len(bad) == len(set(bad))
    assert sorted(bad + [f for f, _ in NO_BAD_VALUE]) == sorted(_leaves(schema.RunConfig))


@functools.cache
def _composed(overrides: tuple[str, ...]) -> DictConfig | validate.ConfigError:
    """Each case composed once for the tests below (tests/composing.py: its group selections once per set); a wrong
    type or enum name is refused at composition, as a ConfigError."""
    try:
        return composing.compose_dict(list(overrides))
    except validate.ConfigError as e:
        return e


def _problems(composed: DictConfig | validate.ConfigError) -> list[Problem]:
    if isinstance(composed, validate.ConfigError):
        return composed.problems
    try:
        cfg = compose.to_object(composed)
        lay = validate.check(cfg)
        if cfg.mode == schema.Mode.validate:  # mode=validate also runs the preflight (the files the config names)
            validate.preflight(cfg, Path("/nonexistent-run"), lay)
    except validate.ConfigError as e:
        return e.problems
    return []


@pytest.mark.parametrize("overrides,field", BAD, ids=[f for _, f in BAD])
def test_bad_value_is_refused_naming_its_field(overrides, field):
    problems = _problems(_composed(tuple(overrides)))
    assert field in [p.field for p in problems], "\n".join(map(str, problems))


LEAVES = set(_leaves(schema.RunConfig))
GROUPS = {p.name for p in compose.CONF.iterdir() if p.is_dir()}
_ASSIGN = re.compile(r"(?<![\w.<>=!])([a-z_][\w.]*)=(\[[^\]]*\]|\"[^\"]*\"|[^\s,;]+)")  # field=value, group=option
_BOUND = re.compile(r"(?:at most|at least|<=|>=) (-?\d+(?:\.\d+)?)\b")  # "set X to at most 4", "use X <= 20"
_EXAMPLE = re.compile(r"\b(?:e\.g\.|use) (\"[^\"]*\"|-?\d[\d.]*(?:e-?\d+)?)(?![\w.=])")  # "use e.g. 3e-4", "use 0 for unknown"


def _field(key: str, near: str) -> str | None:
    """`key` as a schema field: whole, or under a parent of the problem's field (a fix may say `ep=1` for parallelism.ep)."""
    parts = near.split(".")
    return next((f for f in (".".join([*parts[:i], key]) for i in range(len(parts))) if f in LEAVES), None)


def _concrete(p: Problem) -> list[str]:
    """The overrides the fix of `p` names, each a fix on its own: `field=value` and `group=option`; "at most N" and
    "<= N" (also "at least", ">=") of the field named before it, else of p.field; "e.g. V" and "use V" of p.field."""
    text = re.sub(r"\([^()]*\)", "", p.fix)  # a parenthesis explains; the alternatives are outside it
    found = []
    for m in _ASSIGN.finditer(text):
        key = m[1] if m[1] in GROUPS else _field(m[1], p.field)
        if key and not re.fullmatch(r"<.*>|[A-Z]", m[2]):  # not a placeholder (`=<name>`, `=N`)
            found.append(f"{key}={m[2]}")
    for m in _BOUND.finditer(text):
        named = [f for f in (_field(t, p.field) for t in re.findall(r"[a-z_][\w.]*", text[: m.start()])) if f]
        found.append(f"{named[-1] if named else p.field}={m[1]}")
    found += [f"{p.field}={m[1]}" for m in _EXAMPLE.finditer(text)]
    return found


def _rule(p: Problem) -> tuple[str, str]:
    """What identifies the rule that reported `p`: its field and its reason, numbers aside (they move with the fix)."""
    return p.field, re.sub(r"-?\d[\d.e+-]*", "#", p.why)


def _apply(overrides: tuple[str, ...], fix: str) -> list[Problem]:
    """The problems of the case with `fix` in place of its own override of that key: composed again for a group,
    else set on the composed tree (Hydra's composition is most of the time)."""
    override = OverridesParser.create().parse_override(fix)
    key, rest = override.key_or_group, tuple(o for o in overrides if o.split("=")[0] != override.key_or_group)
    if key in GROUPS or isinstance(_composed(rest), validate.ConfigError):
        return _problems(_composed((*rest, fix)))
    fixed = copy.deepcopy(_composed(rest))
    try:
        OmegaConf.update(fixed, key, override.value())
    except OmegaConfBaseException as e:
        return [Problem(key, fix, f"refused at composition: {e}", "")]
    return _problems(fixed)


def test_every_concrete_fix_fixes_its_problem_and_is_not_refused_itself():
    """Each fix of the audit's problems that names a value is applied alone: the problem's rule must pass, and no rule
    may refuse the value it suggests (`search.top_k=-1` once got "set search.verify to at most -1")."""
    failures, applied, prose = [], 0, 0
    for overrides, _ in BAD:
        before = _problems(_composed(tuple(overrides)))
        for p in before:
            fixes = _concrete(p)
            prose += not fixes
            for fix in fixes:
                applied += 1
                after = _apply(tuple(overrides), fix)
                key = fix.split("=")[0]
                still = [str(q) for q in after if _rule(q) == _rule(p)]
                refused = [str(q) for q in after if q.field == key and _rule(q) not in map(_rule, before)]
                if still or refused:
                    failures.append(f"{' '.join(overrides)} + {fix}: {'; '.join(still + refused)}")
    assert failures == [], "\n".join(failures)
    assert applied >= 100, f"{applied} fixes applied, {prose} problems whose fix is prose"  # the parser still reads the fixes
