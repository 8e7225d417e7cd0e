"""Every name a run writes into its run folder, for writers and readers alike (like Hydra's `.hydra/`).

<run folder>/
  frozen.yaml          the resolved config with provenance; `python -m runner --config-dir ...` replays it
  runner.log           the run's console as printed from the launch on: the launcher's and rank 0's stdout and stderr
  plan.json            the step budget (mode=plan, and every launched run)
  invalid.json         a sweep point that failed validation: its overrides and problems
  failed.json          a run whose ranks failed: overrides, exit code, error, rank log folder, report
  peak.json            the dense peak FLOP/s the run's MFU uses (measured on CPU, from the cluster otherwise)
  precision.json       the FP8 recipe, its path on this device, the Linear layers converted and kept, the FP8 experts
  metrics.jsonl        one row per step (rank 0)
  summary.json         the run's medians (rank 0); runner.compare reads it
  timeline.jsonl       launch, start-up marks, steps, failures and ends of every attempt, timestamped (runner.outputs.goodput)
  goodput.json         the run's wall time since its first launch, split into parts (runner.outputs.goodput.PARTS)
  preempted.json       each SLURM warning signal (time limit, preemption): the step checkpointed before the requeue
  stragglers.jsonl     the straggler monitor's per-window tables
  spikes.jsonl         every step the loss guard flagged, replayed: its verdict (data or hardware), ranks, action
  left_out.jsonl       steps a rewind left out: each step's global samples and where each is read from
  moe_load.jsonl       MoE models: hot experts, hot EP ranks and dead experts the hot-expert judge named
  integrity_report.json  replicas that diverged, steps that did not replay bitwise (monitor.integrity)
  hang_report.json     a hang (collective timeout): which collective each rank was in when the job stopped
  failure_report.json  a rank that raised: each rank's exception and last state
  parity.json          losses and norms of a runner.parity launch
  search.json          mode=search: the space, rejections per reason, the ranked candidates
  search/              mode=search: the sweep of the top candidates (`--config-dir <run folder>/search sweep=search_top`)
  search/verify/       mode=search with search.verify=k: the top k trained briefly, one multirun job folder each
  dryrun.json          mode=dryrun: per simulated rank, memory by category beside the plan, shards, collectives
  profile/rank_<r>/step_<s>.json.gz  torch.profiler's Chrome/Perfetto trace of a traced step (profile.*)
  profile/breakdown.json   the busiest traced rank's step time by the predictor's terms (runner.outputs.breakdown)
  profile/memory_snapshot_rank_<r>.pickle  CUDA allocator history at traced steps and on OOM (profile.memory)
  comparison.png       runner.compare's plot (in the folder the given paths share, never a failed run)
  logs/ranks/          each rank's last state (the forensics records)
  logs/collectives/    the runner's collectives per rank (distributed.audit_collectives, tests only)
  logs/<rdzv id>/      torchrun's per-rank stdout/stderr
  data_cache/          the tokenized text corpus (Hugging Face datasets' cache)
  checkpoints/step-<n>/    one DCP checkpoint, published with COMPLETE.json (checkpoint.folder)
  checkpoints/model-hf/    the last checkpoint as a Hugging Face folder (checkpoint.export_hf)
  flight_recorder/     per-rank collective dumps (distributed.flight_recorder.folder)
  replica_<r>/         fault_tolerance=torchft: replica group r's own frozen.yaml, logs/, metrics.jsonl, summary.json
  ft_ready/            fault_tolerance=torchft: one file per replica group whose torchft manager started
  logs/lighthouse.log  fault_tolerance=torchft: the torchft lighthouse the runner started
"""

from __future__ import annotations

import json
from pathlib import Path

FROZEN = "frozen.yaml"
RUNNER_LOG = "runner.log"  # the run's console (runner.run.console)
PLAN = "plan.json"
INVALID = "invalid.json"
FAILED = "failed.json"
PEAK = "peak.json"
PRECISION = "precision.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
TIMELINE = "timeline.jsonl"  # every attempt's timestamped events, across restarts and requeues (runner.outputs.goodput)
GOODPUT = "goodput.json"  # the wall time since the first launch, part by part (runner.outputs.goodput)
PREEMPTED = "preempted.json"  # SLURM interruptions: step, checkpoint, restart count (runner.run.preempt)
STRAGGLERS = "stragglers.jsonl"
LEFT_OUT = "left_out.jsonl"  # the batches a loss-guard rewind left out (runner.run.step_loop.StepLoop.step)
SPIKES = "spikes.jsonl"  # the loss guard's flagged steps and their attribution (runner.observe.attribution)
MOE_LOAD = "moe_load.jsonl"  # the hot-expert judge: hot and dead experts, hot EP ranks (runner.observe.moe_load)
HANG_REPORT = "hang_report.json"
INTEGRITY_REPORT = "integrity_report.json"
FAILURE_REPORT = "failure_report.json"
PARITY = "parity.json"
DRYRUN = "dryrun.json"  # mode=dryrun: per simulated rank, measured memory by category beside the plan
SEARCH = "search.json"  # mode=search: space, rejections, ranked candidates
SEARCH_SWEEP = "search"  # mode=search: the Hydra config folder of the top-k sweep
SEARCH_VERIFY = Path(SEARCH_SWEEP) / "verify"  # search.verify: the sweep folder of the top k trained briefly
PLOT = "comparison.png"
PROFILE = "profile"  # profile.*: traces, the breakdown, memory snapshots
BREAKDOWN = Path(PROFILE) / "breakdown.json"


def trace_path(rank: int, step: int) -> Path:
    """A traced step's Chrome/Perfetto trace, relative to the run folder."""
    return Path(PROFILE) / f"rank_{rank}" / f"step_{step}.json.gz"


def memory_snapshot_path(rank: int) -> Path:
    """A rank's CUDA allocator snapshot (the latest traced step's, or the one taken on an out-of-memory error)."""
    return Path(PROFILE) / f"memory_snapshot_rank_{rank}.pickle"


LOGS = "logs"
RANK_RECORDS = Path(LOGS) / "ranks"
COLLECTIVES = Path(LOGS) / "collectives"  # distributed.audit_collectives (tests)
DATA_CACHE = "data_cache"
FT_READY = "ft_ready"  # fault_tolerance=torchft: one file per replica group whose manager started (runner.run.ft)
LIGHTHOUSE_LOG = Path(LOGS) / "lighthouse.log"  # fault_tolerance=torchft: the lighthouse the runner started
HYDRA_OVERRIDES = Path(".hydra") / "overrides.yaml"
HYDRA_LOGS = (".hydra", RUNNER_LOG, "__main__.log", "cli.log")  # what Hydra puts in a run folder (runner.log: its job log once)
CHECKPOINT_MARKER = "COMPLETE.json"  # inside a checkpoint folder: written last, so its presence means complete
CHECKPOINT_PARTIAL = ".partial"  # suffix of a checkpoint folder still being written
CHECKPOINT_PREFIX = "step-"
FINAL_MODEL = "model-final"
HF_EXPORT = "model-hf"  # checkpoint.export_hf: the last checkpoint as a Hugging Face folder (runner.run.hf_export)


def write_json(path: Path, body: dict) -> Path:
    """A run file in the one JSON form the runner writes (indented, newline-terminated); its path."""
    path.write_text(json.dumps(body, indent=2) + "\n")
    return path
