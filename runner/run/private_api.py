"""Every private name of torch, TorchTitan, Hydra, OmegaConf, submitit, torchft and Python the runner imports, calls,
reads, subclasses or patches, and every library function it patches: one table, each entry with the module, the
attribute path, the version it was written for, where the runner uses it and why.

A private name can change or vanish in any release, and a patch that no longer applies changes what the runner
measures without a word. Each use site carries a `# private_api: <name>` comment naming its entries;
tests/test_private_api.py resolves every entry against the installed libraries (one message naming the entry, its
version and its use site when a name is gone) and scans runner/ and hydra_plugins/ for private names no entry lists.
Data only and torch-free: the config layer's and the CLI's uses are listed too.
"""

from __future__ import annotations

from dataclasses import dataclass

TORCH = "torch 2.13.0"
TITAN = "torchtitan 0.3.0"
HYDRA = "hydra-core 1.3.8"
OMEGACONF = "omegaconf 2.3.1"
SUBMITIT = "submitit 1.5.4"
TORCHFT = "torchft 0.2.0"
TORCHAO = "torchao 0.18.0"
PYTHON = "python 3.11"


@dataclass(frozen=True)
class Private:
    name: str
    """The entry's key, as the use sites' `# private_api:` comments name it."""
    module: str
    """The module to import."""
    attr: str
    """The attribute path inside the module ("" for the module itself)."""
    version: str
    """The library and version the use was written for."""
    where: tuple[str, ...]
    """The use sites, `path:function` (path from the repository root; function, Class.method or a module-level name)."""
    why: str
    """Why the runner uses it; "patched:" where it replaces the name for a while or for the process."""
    instance: bool = False
    """The last name of `attr` is set on instances (in `__init__`), so the class's code is searched for it."""
    nccl: bool = False
    """Exists only in builds of torch with NCCL (the CUDA wheels); resolved only there."""


P = Private


def _cuda(name: str, module: str, attr: str, why: str) -> Private:
    """A patch of the CUDA rehearsal's fake device (a CUDA build of torch, no GPU, no driver), for its process only."""
    return Private(name, module, attr, TORCH, (FAKE_DEVICE,), f"patched for a CUDA rehearsal: {why}")


CLI, SWEEPER = "runner/cli.py", "hydra_plugins/runner_sweeper/__init__.py"
RECORDER, WAITS, PROCS = "runner/observe/rank_recorder.py", "runner/observe/waits.py", "runner/run/procs.py"
LEDGER, REHEARSE = "runner/run/dryrun/ledger.py", "runner/run/dryrun/rehearse.py"
PROFILING, CPU, MODEL = "runner/run/profiling.py", "runner/run/titan/cpu.py", "runner/run/titan/model.py"
C10D, FUNCOL = "torch.distributed.distributed_c10d", "torch.distributed._functional_collectives"
PIPE_UTILS, SCHEDULES, STAGE = (
    "torch.distributed.pipelining._utils",
    "torch.distributed.pipelining.schedules",
    "torch.distributed.pipelining.stage",
)
AGENT, LOCAL_AGENT = "torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.agent.server.local_elastic_agent"
DISPATCHER = "torchtitan.models.common.token_dispatcher"
CUDA_REHEARSE, FAKE_CUDA = "runner/run/dryrun/cuda_rehearse.py", "runner/run/dryrun/fake_cuda.py"
FAKE_DEVICE = f"{FAKE_CUDA}:_replacements"
"""The use site of every patch the CUDA rehearsal's fake device installs (runner.run.dryrun.fake_cuda.install walks them)."""
CUDA = "torch.cuda"
STEP_PROBE, CUDA_CHECKS = "runner/run/dryrun/step_probe.py", "runner/run/dryrun/cuda_checks.py"
SCHEDULE_READERS = ("runner/run/titan/step.py:pipeline_stages",)
WEIGHT_PASS = ("runner/run/titan/weight_pass.py:recompute_once", "runner/run/layout_parity.py:_block_forwards")
FSDP_GROUP, RING = (
    "torch.distributed.fsdp._fully_shard._fsdp_param_group",
    "torch.distributed.tensor.experimental._context_parallel._attention",
)

# a table, one entry per two or three lines
# fmt: off
PRIVATE = (
    # ---- Hydra, OmegaConf, submitit: the CLI, the config layer and the sweeper plugin ----
    P("hydra_run_and_report", "hydra._internal.utils", "run_and_report", HYDRA, (f"{CLI}:_word_config_errors",),
      "patched: a YAML syntax error or a wrong type while Hydra composes is worded as a Problem, exit 2"),
    P("hydra_is_env_set", "hydra._internal.utils", "_is_env_set", HYDRA, (f"{CLI}:_word_config_errors",),
      "HYDRA_FULL_ERROR=1 read as Hydra reads it: the full traceback stays Hydra's"),
    P("hydra_get_args_parser", "hydra._internal.utils", "get_args_parser", HYDRA, (f"{CLI}:refuse_cut_replay",),
      "Hydra's own argv parser: --config-dir and --config-name before Hydra composes a frozen file"),
    P("hydra_basic_sweeper", "hydra._internal.core_plugins.basic_sweeper", "BasicSweeper", HYDRA, (f"{SWEEPER}:RunnerSweeper",),
      "subclassed: the runner's sweeper is Hydra's basic sweeper composing each point once"),
    P("hydra_basic_sweeper_conf", "hydra._internal.core_plugins.basic_sweeper", "BasicSweeperConf", HYDRA,
      (f"{SWEEPER}:RunnerSweeperConf",), "subclassed: the sweeper's schema"),
    P("hydra_parse_config", "hydra._internal.core_plugins.basic_sweeper", "BasicSweeper._parse_config", HYDRA,
      (f"{SWEEPER}:RunnerSweeper._modes",), "the overrides of hydra.sweeper.params, to compose each point's mode"),
    P("hydra_basic_launcher", "hydra._internal.core_plugins.basic_launcher", "BasicLauncher", HYDRA, (f"{SWEEPER}:ArrayPreview",),
      "subclassed: a SLURM preview sweep runs its points here with Hydra's basic launcher"),
    P("omegaconf_yaml_dumper", "omegaconf._utils", "get_omega_conf_dumper", OMEGACONF, ("runner/config/freeze.py:write",),
      "OmegaConf's own YAML dumper (what OmegaConf.to_yaml uses): strings that read back as numbers stay quoted"),
    P("omegaconf_get_node", "omegaconf", "DictConfig._get_node", OMEGACONF, ("runner/config/validate/keys.py:unknown",),
      "the child node itself, not its value, to recurse into a typed section"),
    P("omegaconf_is_none", "omegaconf", "DictConfig._is_none", OMEGACONF, ("runner/config/validate/keys.py:unknown",),
      "a None section has no keys to check"),
    P("omegaconf_is_missing", "omegaconf", "DictConfig._is_missing", OMEGACONF, ("runner/config/validate/keys.py:unknown",),
      "a ??? section has no keys to check"),
    P("submitit_equivalence_dict", "submitit.slurm.slurm", "SlurmExecutor._equivalence_dict", SUBMITIT,
      ("runner/config/slurm.py:sbatch_script",), "submitit's mapping of the launcher's generic names to sbatch's"),
    P("submitit_make_sbatch_string", "submitit.slurm.slurm", "_make_sbatch_string", SUBMITIT, ("runner/config/slurm.py:sbatch_script",),
      "the sbatch file submitit would write, for the preview and the submission check"),
    P("submitit_submit_module", "submitit.core._submit", "", SUBMITIT, ("runner/config/slurm.py:sbatch_script",),
      "the command SlurmExecutor puts in the sbatch file (python -u -m submitit.core._submit <folder>)"),
    P("torchft_update_fr_path", "torchft.manager", "Manager._update_fr_path", TORCHFT,
      (f"{RECORDER}:dump_path", f"{RECORDER}:QUORUM_TAG"),
      "the flight-recorder dump path torchft sets per quorum (<prefix>_quorum_<id>/<global rank>), read back by its format"),
    P("python_run_exitfuncs", "atexit", "_run_exitfuncs", PYTHON, (f"{PROCS}:exit_now",),
      "the exit handlers run before os._exit skips the interpreter's finalization"),
    # ---- torch: the elastic agent and the forked ranks ----
    P("torch_agent_stop_workers", LOCAL_AGENT, "LocalElasticAgent._stop_workers", TORCH, (f"{PROCS}:honour_shutdown_timeout",),
      "patched: the ranks of a failed group are stopped with distributed.shutdown_timeout_s, not a fixed 30 s"),
    P("torch_agent_shutdown", LOCAL_AGENT, "LocalElasticAgent._shutdown", TORCH, (f"{PROCS}:honour_shutdown_timeout",),
      "what the patched _stop_workers calls, with the timeout the agent was given"),
    P("torch_agent_shutdown_timeout", LOCAL_AGENT, "LocalElasticAgent._shutdown_timeout", TORCH, (f"{PROCS}:honour_shutdown_timeout",),
      "the --shutdown-timeout the agent was given", instance=True),
    P("torch_agent_restart_workers", AGENT, "SimpleElasticAgent._restart_workers", TORCH, (f"{PROCS}:note_agent_restarts",),
      "patched: the launcher is told when the agent restarts its ranks after a failure (the agent only logs it)"),
    P("torch_agent_remaining_restarts", AGENT, "SimpleElasticAgent._remaining_restarts", TORCH, (f"{PROCS}:note_agent_restarts",),
      "the attempt number of the restart", instance=True),
    P("torch_spawn_join", "torch.multiprocessing.spawn", "ProcessContext.join", TORCH, (f"{PROCS}:_fork_grace",),
      "patched: forked ranks get the configured grace period after SIGTERM, not a fixed 30 s"),
    # ---- torch: process groups, the flight recorder, collectives ----
    P("torch_c10d_world", C10D, "_world", TORCH, (f"{RECORDER}:process_groups", "runner/run/titan/distributed.py:_set_group_timeouts"),
      "c10d's registry of process groups: their names and ranks"),
    P("torch_set_pg_timeout", C10D, "_set_pg_timeout", TORCH, ("runner/run/titan/distributed.py:_set_group_timeouts",),
      "DeviceMesh's groups get the configured timeout, not the backend's default"),
    P("torch_resolve_process_group", C10D, "_resolve_process_group", TORCH, (f"{LEDGER}:_group_of", f"{PROFILING}:CollectiveNames._group"),
      "the process group behind a group name (what the functional collectives and the c10d ops take)"),
    P("torch_pg_sequence_number", "torch.distributed", "ProcessGroup._get_sequence_number_for_group", TORCH,
      (f"{RECORDER}:_sequence_numbers",), "how many collectives each group has issued, to tell which rank is behind in a hang report"),
    P("torch_dump_fr_trace_json", "torch._C._distributed_c10d", "_dump_fr_trace_json", TORCH, (f"{RECORDER}:_last_collectives",),
      "the flight recorder's entries, for the last collective of each group"),
    P("torch_dump_nccl_trace_json", "torch._C._distributed_c10d", "_dump_nccl_trace_json", TORCH, (f"{RECORDER}:_last_collectives",),
      "NCCL's flight recorder, beside the generic one", nccl=True),
    P("torch_dump_fr_trace", "torch._C._distributed_c10d", "_dump_fr_trace", TORCH, (f"{RECORDER}:dump_flight_recorder",),
      "the flight recorder as the pickle torchfrtrace reads"),
    P("torch_work_wait", "torch._C._distributed_c10d", "Work.wait", TORCH, (f"{WAITS}:_WORK", f"{WAITS}:Waits.start"),
      "patched while a step runs: each rank's waits inside collectives are timed"),
    P("torch_funcol", FUNCOL, "", TORCH, (f"{WAITS}:Waits.start", f"{PROFILING}:CollectiveNames.__init__"),
      "the functional collectives (DTensor's, ring attention's, TorchTitan's): patched, each public one taking a group, "
      "while a traced step runs"),
    P("torch_funcol_wait_tensor", FUNCOL, "wait_tensor", TORCH, (f"{WAITS}:Waits.start",),
      "patched while a step runs: waits on functional collectives are timed"),
    P("torch_funcol_resolve_group_name", FUNCOL, "_resolve_group_name", TORCH, (f"{PROFILING}:CollectiveNames._group",),
      "the group name of a functional collective's group argument, to name its mesh axis in the trace"),
    P("torch_distributed_collectives", "torch.distributed", "", TORCH,
      ("runner/run/collective_audit.py:audit", f"{PROFILING}:CollectiveNames.__enter__"),
      "patched: the collectives of collective_audit.AUDITED are recorded (test-only audit), those of profiling.DIST_OPS named in traces"),
    P("torch_pipeline_wait_batch_p2p", SCHEDULES, "_wait_batch_p2p", TORCH, (f"{PROFILING}:CollectiveNames.__enter__",),
      "patched while a traced step runs: the schedules' P2P waits get a span of their own"),
    P("torch_checkpoint_rerun", "torch.utils.checkpoint", "_run_fn_with_dynamo_disabled", TORCH,
      (f"{PROFILING}:CollectiveNames.__enter__",),
      "patched while a traced step runs: non-reentrant activation checkpointing's recompute gets a span"),
    P("torch_profiler_prev_action", "torch.profiler", "profile._prev_schedule_action", TORCH, (f"{PROFILING}:StepProfiler.__init__",),
      "set with current_action and step_num: a profiler started mid-run is in the schedule's state of the step before", instance=True),
    P("torch_cuda_record_memory_history", "torch.cuda.memory", "_record_memory_history", TORCH,
      ("runner/run/device.py:DevicePolicy.record_allocator_history",), "the allocator's history, for profile.memory's snapshots"),
    P("torch_cuda_snapshot", "torch.cuda.memory", "_snapshot", TORCH, ("runner/run/device.py:DevicePolicy.allocator_snapshot",),
      "the allocator's segments and history, as memory_viz reads them"),
    P("torch_scaled_mm", "torch", "_scaled_mm", TORCH, ("runner/run/peak.py:_matmul",),
      "the FP8 GEMM torchao's Float8Linear runs, timed for the FP8 peak"),
    P("torch_dynamo_compile_callbacks", "torch._dynamo.callback", "callback_handler", TORCH,
      ("runner/run/accounting.py:CompileClock.install", "runner/run/accounting.py:CompileClock.remove"),
      "torch.compile's start and end of each outermost compilation (lazy backward included), timed for goodput"),
    P("torch_redistribute_logger", "torch.distributed.tensor._redistribute", "", TORCH, ("runner/run/known_warnings.py:HARMLESS",),
      "the logger of a harmless message dropped on the console"),
    P("torch_pytree_logger", "torch.utils._pytree", "", TORCH, ("runner/run/known_warnings.py:HARMLESS",),
      "the logger of a harmless message dropped on the console"),
    # ---- torch: mode=dryrun's ledger and rehearsal ----
    P("torch_dispatch_mode", "torch.utils._python_dispatch", "TorchDispatchMode", TORCH, (f"{LEDGER}:Ledger", f"{STEP_PROBE}:StepProbe"),
      "subclassed: the ledger (and the CUDA rehearsal's probe) sees every op below DTensor, with the local shards a rank holds"),
    P("torch_is_traceable_wrapper_subclass", "torch.utils._python_dispatch", "is_traceable_wrapper_subclass", TORCH,
      (f"{LEDGER}:storages",), "the inner tensors of a tensor subclass, whose storages hold the bytes"),
    P("torch_tree_flatten", "torch.utils._pytree", "tree_flatten", TORCH, (f"{LEDGER}:Ledger.__torch_dispatch__",),
      "the tensors in an op's arguments and outputs"),
    P("torch_active_fake_mode", "torch._guards", "active_fake_mode", TORCH,
      (f"{LEDGER}:Ledger.__enter__", f"{LEDGER}:Ledger.__torch_dispatch__"),
      "whether the ledger runs under fake tensors (collectives then never complete)"),
    P("torch_current_graph_task_id", "torch._C", "_current_graph_task_id", TORCH, (f"{LEDGER}:Ledger.current_label",),
      "-1 outside autograd's backward: a tensor made inside it is a backward temporary"),
    P("torch_op_schema", "torch._ops", "OpOverload._schema", TORCH, (f"{LEDGER}:Ledger._collective",),
      "an op's name, to tell the collectives apart", instance=True),
    P("torch_c10d_functional_ops", "torch", "ops._c10d_functional.wait_tensor.default", TORCH,
      (f"{LEDGER}:Ledger.__torch_dispatch__", "runner/outputs/breakdown.py:_visit"),
      "the functional collectives' op namespace, as dispatched and as named in traces"),
    P("torch_wrap_tensor_autograd", "torch", "ops._c10d_functional._wrap_tensor_autograd.default", TORCH,
      (f"{LEDGER}:_NOT_COLLECTIVES", "runner/outputs/breakdown.py:_visit"), "an op of the collective namespace that sends nothing"),
    P("torch_c10d_allgather_base", "torch", "ops.c10d._allgather_base_.default", TORCH, (f"{LEDGER}:Ledger._collective",),
      "FSDP's flat all-gather, whose buffer the ledger labels"),
    P("torch_c10d_reduce_scatter_base", "torch", "ops.c10d._reduce_scatter_base_.default", TORCH,
      (f"{LEDGER}:Ledger._collective", f"{STEP_PROBE}:REDUCTIONS"), "FSDP's flat reduce-scatter, whose buffer the ledger labels"),
    P("torch_storage_resize", "torch", "UntypedStorage.resize_", TORCH, (f"{LEDGER}:Ledger.__enter__",),
      "patched while the ledger runs: FSDP2 frees and re-allocates gathered parameters with resize_, which is not dispatched"),
    P("torch_sharding_prop_tensor_meta", "torch.distributed.tensor._sharding_prop", "ShardingPropagator._propagate_tensor_meta_non_cached",
      TORCH, (f"{LEDGER}:Ledger._untracked_propagation", f"{LEDGER}:Ledger.__exit__"),
      "patched while the ledger runs: the global-shaped fake tensors of DTensor's shape propagation are no rank's memory"),
    P("torch_fsdp_wait_for_unshard", FSDP_GROUP, "FSDPParamGroup.wait_for_unshard", TORCH, (f"{LEDGER}:fsdp_labels",),
      "patched while the ledger runs: gathered parameters labelled as such"),
    P("torch_fsdp_post_backward", FSDP_GROUP, "FSDPParamGroup.post_backward", TORCH, (f"{LEDGER}:fsdp_labels",),
      "patched while the ledger runs: unsharded gradients labelled as such"),
    P("torch_fsdp_unsharded_param", "torch.distributed.fsdp._fully_shard._fsdp_param", "FSDPParam._unsharded_param", TORCH,
      (f"{LEDGER}:fsdp_labels",), "the gathered parameter and its gradient", instance=True),
    P("torch_pipeline_inference_mode", PIPE_UTILS, "InferenceMode", TORCH, (f"{REHEARSE}:fake_pipeline",),
      "the stages' static or dynamic shapes, set as the skipped warm-up would"),
    P("torch_pipeline_stage_forward_meta", PIPE_UTILS, "_StageForwardMeta", TORCH, (f"{REHEARSE}:fake_pipeline",),
      "the shapes a stage would receive from the previous one"),
    P("torch_pipeline_stage_backward_meta", PIPE_UTILS, "_StageBackwardMeta", TORCH, (f"{REHEARSE}:fake_pipeline",),
      "the shapes a stage would receive from the next one"),
    P("torch_pipeline_extract_tensor_metas", PIPE_UTILS, "extract_tensor_metas", TORCH, (f"{REHEARSE}:fake_pipeline",),
      "the hidden state's shape as the stages exchange it"),
    P("torch_pipeline_warmup_p2p", SCHEDULES, "_PipelineSchedule._warmup_p2p", TORCH, (f"{REHEARSE}:fake_pipeline",),
      "patched for a rehearsal: one process plays a rank, so the stages' shape exchange is answered locally"),
    P("torch_pipeline_recv_meta", STAGE, "PipelineStage._recv_meta", TORCH, (f"{REHEARSE}:fake_pipeline",),
      "patched for a rehearsal: a stage's metadata comes from the layout, not from its neighbour"),
    P("torch_stage_user_meta", STAGE, "PipelineStage._user_meta", TORCH, (f"{REHEARSE}:fake_pipeline",),
      "the stage's declared shapes, to choose its inference mode", instance=True),
    P("torch_stage_inference_mode", STAGE, "PipelineStage._inference_mode", TORCH, (f"{REHEARSE}:fake_pipeline",),
      "set as the skipped warm-up would", instance=True),
    P("torch_stage_meta", STAGE, "PipelineStage._stage_meta", TORCH, (f"{REHEARSE}:fake_pipeline",),
      "the stage's own output shapes, sent back as the gradients' shapes", instance=True),
    P("torch_schedule_stages", SCHEDULES, "PipelineScheduleMulti._stages", TORCH, SCHEDULE_READERS,
      "the stages of a multi-stage schedule (torch has no public accessor)", instance=True),
    P("torch_schedule_stage", SCHEDULES, "PipelineScheduleSingle._stage", TORCH, SCHEDULE_READERS,
      "the stage of a single-stage schedule", instance=True),
    P("torch_stage_chunk_methods", STAGE, "PipelineStage.forward_one_chunk", TORCH, ("runner/observe/plan_check.py:StageTimer.__init__",),
      "patched on this rank's stages: plan_check.CHUNK_METHODS timed, the compute of the bubble measurement"),
    P("torch_stage_weight_pass", STAGE, "PipelineStage.backward_weight_one_chunk", TORCH, WEIGHT_PASS,
      "a split backward's weight pass, wrapped in one GraphExecGroup under AC (a recompute per pass, not per parameter group)"),
    P("torch_schedule_step_microbatches", SCHEDULES, "_PipelineSchedule._step_microbatches", TORCH,
      ("runner/run/titan/step.py:pipeline_set_up",),
      "patched on one schedule for the dry run's warm-up: the first step's stage set-up without running the microbatches"),
    P("torch_schedule_check_inputs", SCHEDULES, "_PipelineSchedule._check_inputs", TORCH, ("runner/run/titan/step.py:pipeline_set_up",),
      "the microbatches as every schedule's _step_microbatches checks them before its stage set-up"),
    P("torch_schedule_initialize", SCHEDULES, "PipelineScheduleMulti._initialize_stages", TORCH,
      ("runner/run/titan/step.py:pipeline_set_up",), "the stages' set-up a first step runs (shape inference, receive buffers)"),
    P("torch_schedule_initialize_single", SCHEDULES, "PipelineScheduleSingle._initialize_stage", TORCH,
      ("runner/run/titan/step.py:pipeline_set_up",), "the single-stage schedules' set-up (1F1B, GPipe)"),
    P("torch_computation_type", SCHEDULES, "_ComputationType", TORCH, ("runner/run/titan/step.py:_forward_actions_only",),
      "the kinds of action in a schedule's order, to keep only the forward ones for evaluation"),
    P("torch_fake_tensor_mode", "torch._subclasses.fake_tensor", "FakeTensorMode", TORCH,
      (f"{REHEARSE}:measure", f"{CUDA_REHEARSE}:measure"),
      "mode=dryrun runs a rank's step on tensors without storage"),
    P("torch_fake_store", "torch.testing._internal.distributed.fake_pg", "FakeStore", TORCH,
      (f"{REHEARSE}:rehearse_rank", f"{CUDA_REHEARSE}:rehearse_rank"),
      "the fake process group's store: one process plays a rank of any world size"),
    # ---- the CUDA rehearsal (mode=dryrun dryrun.device=cuda) ----
    P("torch_higher_order_operator", "torch._ops", "HigherOrderOperator", TORCH, (f"{LEDGER}:Ledger.__torch_dispatch__",),
      "FlexAttention's ops are higher-order ops: the ledger passes them through and counts their outputs"),
    P("torch_foreach_norm", "torch", "_foreach_norm", TORCH, ("runner/observe/layer_stats.py:LayerStats._shards",),
      "per-block statistics: every gradient's norm and every weight's max |w| in one foreach call, as torch's own "
      "clip_grad_norm_ computes its norms (torch.nn.utils.get_total_norm)"),
    P("torch_fake_tensor", "torch._subclasses.fake_tensor", "FakeTensor", TORCH,
      (f"{STEP_PROBE}:StepProbe.__torch_dispatch__", f"{FAKE_CUDA}:_fill_normal"),
      "the probe lets other tensor subclasses (DTensor, float8) desugar first; the fake init tells them from fake tensors"),
    P("torch_unset_fake_temporarily", "torch._subclasses.fake_tensor", "unset_fake_temporarily", TORCH,
      (f"{STEP_PROBE}:StepProbe.__torch_dispatch__", f"{FAKE_CUDA}:_outside_fake"),
      "a real zero tensor for a device-to-host copy; torch helpers that need values run outside the fake mode"),
    P("torch_aten_local_scalar_dense", "torch", "ops.aten._local_scalar_dense", TORCH, (f"{STEP_PROBE}:SYNC_OPS",),
      "item()/tolist() on a CUDA tensor: a host synchronization, counted"),
    P("torch_aten_to_copy", "torch", "ops.aten._to_copy", TORCH, (f"{STEP_PROBE}:StepProbe.__torch_dispatch__",),
      "device-to-host copies (synchronizations) and non-blocking copies from pageable memory, counted"),
    P("torch_aten_scaled_mm", "torch", "ops.aten._scaled_mm", TORCH, (f"{STEP_PROBE}:MATMULS",),
      "an FP8 matmul: its operands' dtype is reported"),
    P("torch_aten_grouped_mm", "torch", "ops.aten._grouped_mm", TORCH, (f"{STEP_PROBE}:MATMULS",), "MoE's grouped GEMM, as above"),
    P("torch_aten_scaled_grouped_mm", "torch", "ops.aten._scaled_grouped_mm", TORCH, (f"{STEP_PROBE}:MATMULS",), "its FP8 form"),
    P("torch_ensure_cuda_device_guard", "torch._C", "_ensureCUDADeviceGuardSet", TORCH, (f"{FAKE_CUDA}:devices_on",),
      "installs FakeTensorMode's no-op CUDA guard while the shim still reports no device"),
    # ---- the CUDA rehearsal's fake device: every patch runner/run/dryrun/fake_cuda.py installs (FAKE_DEVICE) ----
    _cuda("torch_cuda_is_available", CUDA, "is_available",
          "the runner's and torch's CUDA-only Python branches (FSDP2, autocast) need True"),
    _cuda("torch_cuda_device_count", CUDA, "device_count", "devices per node of the rehearsed cluster"),
    _cuda("torch_cuda_current_device", CUDA, "current_device", "FSDP2's lazy init asks it; the driver would say 'Found no NVIDIA driver'"),
    _cuda("torch_cuda_set_device", CUDA, "set_device", "DevicePolicy.start_group's set_device: recorded, nothing to select"),
    _cuda("torch_cuda_get_device_capability", CUDA, "get_device_capability",
          "FP8 checks (torchao, the runner) read the cluster's compute capability"),
    _cuda("torch_cuda_get_device_properties", CUDA, "get_device_properties", "the rehearsed GPU's name, capability and memory"),
    _cuda("torch_cuda_get_device_name", CUDA, "get_device_name", "as get_device_properties"),
    _cuda("torch_cuda_is_bf16_supported", CUDA, "is_bf16_supported", "True on the GPUs the runner targets; False without a driver"),
    _cuda("torch_cuda_mem_get_info", CUDA, "mem_get_info", "free and total memory of the rehearsed GPU"),
    _cuda("torch_cuda_max_memory_allocated", CUDA, "max_memory_allocated",
          "no allocator here: the ledger measures memory (DevicePolicy.max_memory_gb)"),
    _cuda("torch_cuda_Stream", CUDA, "Stream", "FSDP2 and the DCP stager make side streams: Python stand-ins"),
    _cuda("torch_Stream", "torch", "Stream", "DCP's DefaultStager makes its staging stream with torch.Stream(): the stand-in stream"),
    _cuda("torch_cuda_Event", CUDA, "Event", "CUDA events (DevicePolicy's clocks, FSDP2): stand-ins whose synchronize counts a host sync"),
    _cuda("torch_cuda_current_stream", CUDA, "current_stream", "the stand-in stream"),
    _cuda("torch_cuda_default_stream", CUDA, "default_stream", "the stand-in stream"),
    _cuda("torch_cuda_stream", CUDA, "stream", "a no-op stream context"),
    _cuda("torch_cuda_synchronize", CUDA, "synchronize", "counted as a host synchronization (DevicePolicy.sync)"),
    _cuda("torch_cuda_set_sync_debug_mode", CUDA, "set_sync_debug_mode",
          "DevicePolicy.count_syncs turns it on; the rehearsal counts syncs itself"),
    _cuda("torch_cuda_get_rng_state", CUDA, "get_rng_state", "the device generator's state, 16 bytes as a GPU's (DevicePolicy.rng_state)"),
    _cuda("torch_cuda_set_rng_state", CUDA, "set_rng_state", "recorded; no generator to set"),
    _cuda("torch_cuda_get_rng_state_all", CUDA, "get_rng_state_all", "dynamo and checkpointing save every device's generator"),
    _cuda("torch_cuda_set_rng_state_all", CUDA, "set_rng_state_all", "as set_rng_state"),
    _cuda("torch_cuda_manual_seed", CUDA, "manual_seed", "torch.manual_seed seeds CUDA too, which needs the driver"),
    _cuda("torch_cuda_manual_seed_all", CUDA, "manual_seed_all", "as manual_seed"),
    _cuda("torch_pin_memory_utils_pin", "torch.cuda._pin_memory_utils", "pin_memory",
          "DCP's stager registers its host buffers (cudaHostRegister): recorded in PINNED_BYTES"),
    _cuda("torch_pin_memory_utils_unpin", "torch.cuda._pin_memory_utils", "unpin_memory", "its finalizer unregisters them: nothing to do"),
    _cuda("torch_tensor_pin_memory", "torch", "Tensor.pin_memory",
          "pinned host memory needs the driver: the tensor is kept and remembered as pinned"),
    _cuda("torch_tensor_is_pinned", "torch", "Tensor.is_pinned", "True for what pin_memory remembered"),
    _cuda("torch_fake_avoid_device_init", "torch._subclasses.fake_tensor", "FakeTensorMode.avoid_device_init",
          "FakeTensorMode decides from CUDA being available whether to install its no-op CUDA guard; it must stay True"),
    _cuda("torch_device_mesh_concatenate", "torch.distributed.device_mesh", "DeviceMesh._concatenate",
          "FSDP2 over a TP mesh concatenates meshes with nonzero/tolist, which fake tensors refuse "
          "(DynamicOutputShapeException); run outside the fake mode, as torch already does for _create_sub_mesh"),
    _cuda("torch_dtensor_first_shard_size", "torch.distributed.tensor._random", "_calc_first_shard_size",
          "DTensor's random init on a _StridedShard (FSDP + TP) computes a shard size from tensor values "
          "(DataDependentOutputException under fake tensors): run outside the fake mode"),
    _cuda("torch_nn_init_trunc_normal", "torch.nn.init", "trunc_normal_",
          "rejection sampling with .item() in a loop (data-dependent under fake tensors): normal_ then clamp_; values do not matter here"),
    _cuda("torch_cp_compiled_create_block_mask", RING, "_compiled_create_block_mask",
          "context parallelism shards FlexAttention's block masks with a torch.compile'd create_block_mask (fullgraph), "
          "which cannot compile here: the eager one, set before its first use"),
    _cuda("torch_flex_disable_compile_debug", "torch.nn.attention.flex_attention", "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG",
          "eager flex_attention still goes through torch.compile(backend='eager'), and dynamo asks the real CUDA stream: "
          "call the higher-order op directly (TorchTitan's compiled flex is swapped for eager by "
          "runner.run.titan.cpu.eager_flex_attention)"),
    # ---- torch under the TorchTitan adapter ----
    P("torch_checkpoint_prefix", "torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "_CHECKPOINT_PREFIX", TORCH,
      (f"{CPU}:init_like_one_rank",), "the name part activation checkpointing adds, dropped to match the unwrapped model's names"),
    P("torch_checkpoint_impl", "torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "CheckpointImpl", TORCH,
      ("runner/run/titan/moe.py:_recomputed",), "how TorchTitan's MoE pre-hook tells a recomputed block (its counts doubled)"),
    P("torch_ring_attention", RING, "_templated_ring_attention", TORCH, (f"{CPU}:enable_ring_attention",),
      "context parallelism's ring attention, given CPU's flash-attention op"),
    P("torch_ring_attention_backward", RING, "_templated_ring_attention_backward", TORCH, (f"{CPU}:enable_ring_attention",),
      "its backward"),
    P("torch_sdpa_flash_cpu", "torch", "ops.aten._scaled_dot_product_flash_attention_for_cpu.default", TORCH,
      (f"{CPU}:enable_ring_attention",), "CPU's attention op, given a sharding rule for ring attention"),
    P("torch_sdpa_flash_cpu_backward", "torch", "ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default", TORCH,
      (f"{CPU}:enable_ring_attention",), "its backward"),
    # ---- torchao ----
    P("torchao_blockwise_fp8_linear", "torchao.prototype.blockwise_fp8_training.linear", "Float8BlockwiseLinear", TORCHAO,
      ("runner/run/titan/fp8_conversion.py:blockwise_linear_config",),
      "subclassed: blockwise FP8 training is a torchao prototype (no compatibility promise), as a TorchTitan module"),
    # ---- TorchTitan ----
    P("titan_compiled_flex_attn", "torchtitan.models.common.attention", "FlexAttention._compiled_flex_attn", TITAN,
      (f"{CPU}:eager_flex_attention",), "patched (test-only): eager flex_attention instead of minutes of CPU compiles"),
    P("titan_compiled_create_block_mask", "torchtitan.models.common.attention", "_compiled_create_block_mask", TITAN,
      (f"{CPU}:eager_flex_attention",), "patched (test-only): eager create_block_mask, as above"),
    P("titan_disable_dynamo_lru_cache", "torchtitan.distributed.activation_checkpoint", "_disable_dynamo_lru_cache", TITAN,
      ("runner/run/titan/build.py:_every_nth_block_ac",), "what TorchTitan's full AC does before wrapping blocks"),
    P("titan_full_ac_wrap_block", "torchtitan.distributed.activation_checkpoint", "FullAC._wrap_block", TITAN,
      ("runner/run/titan/build.py:_every_nth_block_ac",), "full AC's wrapper, applied to every N-th block only"),
    P("titan_fqn_per_model_part", "torchtitan.distributed.pipeline_parallel", "_generate_llm_fqn_per_model_part", TITAN,
      ("runner/run/titan/distributed.py:stage_modules",), "TorchTitan's split of the layers into pipeline stages"),
    P("titan_build_param_groups", "torchtitan.components.optimizer", "OptimizersContainer._build_param_groups", TITAN,
      ("runner/run/titan/optim.py:_container_class",), "overridden: a stage skips the groups taking none of its parameters (first match)"),
    P("titan_output_linear_init", "torchtitan.models.llama3", "_output_linear_init", TITAN, (f"{MODEL}:_decoder",),
      "the output head's initializer at m's width, where a family scales it (else the flavor's)"),
    P("titan_build_llama3_layers", "torchtitan.models.llama3", "_build_llama3_layers", TITAN, (f"{MODEL}:_llama3",),
      "a llama3 flavor's blocks at model.*'s shape"),
    P("titan_build_qwen3_layers", "torchtitan.models.qwen3", "_build_qwen3_layers", TITAN, (f"{MODEL}:_qwen3",),
      "a dense qwen3 flavor's blocks at model.*'s shape"),
    P("titan_build_qwen3_moe_layers", "torchtitan.models.qwen3", "_build_qwen3_moe_layers", TITAN, (f"{MODEL}:_qwen3",),
      "a qwen3 MoE flavor's blocks at model.*'s shape"),
    P("titan_build_dsv3_layers", "torchtitan.models.deepseek_v3", "_build_dsv3_layers", TITAN, (f"{MODEL}:_mla_moe",),
      "a deepseek_v3 flavor's blocks at model.*'s shape"),
    P("titan_build_kimi_layers", "torchtitan.models.kimi_k2_7", "_build_kimi_layers", TITAN, (f"{MODEL}:_mla_moe",),
      "a kimi_k2_7 flavor's blocks at model.*'s shape"),
    P("titan_build_mtp_layers", "torchtitan.models.deepseek_v3", "_build_mtp_layers", TITAN, (f"{MODEL}:_mla_moe",),
      "model.num_mtp_layers multi-token-prediction blocks, as model_registry(num_mtp_layers=D) builds them"),
    P("titan_build_gptoss_layers", "torchtitan.models.gpt_oss", "_build_gptoss_layers", TITAN, (f"{MODEL}:_gpt_oss",),
      "a gpt_oss flavor's blocks at model.*'s shape"),
    P("titan_make_gptoss_attn_config", "torchtitan.models.gpt_oss", "_make_gptoss_attn_config", TITAN, (f"{MODEL}:_gpt_oss",),
      "gpt_oss's attention (sliding or full) per block"),
    P("titan_token_dispatcher_local_reorder", DISPATCHER, "AllToAllTokenDispatcher._local_reorder", TITAN,
      (f"{REHEARSE}:balanced_routing",), "patched for a rehearsal: the tokens leaving this rank are counted"),
    P("titan_token_count_exchange", DISPATCHER, "AllToAllTokenDispatcher._sync_token_count_exchange", TITAN,
      (f"{REHEARSE}:balanced_routing",), "patched for a rehearsal: perfectly balanced all-to-all splits, which fake tensors cannot count"),
)
# fmt: on

BY_NAME = {p.name: p for p in PRIVATE}


def at(site: str) -> tuple[Private, ...]:
    """The entries used at `site` (`path:function`), in the table's order."""
    return tuple(p for p in PRIVATE if site in p.where)
