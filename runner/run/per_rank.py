"""Per-rank entry: `python -m runner.worker <run folder>/frozen.yaml`.

Started by torch's elastic agent (runner/launch.py locally, or torchrun on a cluster);
it reads the rank from the environment the agent sets.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from runner.config import freeze
from runner.data import corpus
from runner.estimate import precision
from runner.formats import data_manifest as manifest
from runner.formats import runfiles
from runner.observe import rank_recorder
from runner.outputs.timeline import Timeline, process_start
from runner.run import (
    accounting,
    collective_audit,
    console,
    evaluate,
    ft,
    known_warnings,
    loader,
    mesh,
    metrics,
    peak,
    preempt,
    procs,
    startup,
    titan,
    token_data,
    train,
)
from runner.run.device import DevicePolicy
from runner.schema import DataSource, Fp8Recipe, layout, wording


def start_rank(cfg) -> DevicePolicy:
    """What every rank does first (here and in the parity harness): the device policy, its threads,
    torchao's logging, the process groups."""
    policy = DevicePolicy.of(cfg.cluster, cfg.distributed)
    if cfg.monitor.inject.node_names:  # TEST-ONLY: simulated nodes on one machine (runner.run.mesh.node_name)
        os.environ[mesh.NODE_NAMES_ENV] = ",".join(cfg.monitor.inject.node_names)
    policy.set_threads(int(os.environ["LOCAL_WORLD_SIZE"]))
    titan.quiet_torchao(cfg)
    rank_recorder.make_dump_folders()  # the recorders' dump folders, before the process group reads their prefixes
    titan.init_process_group(cfg, policy)
    return policy


def build_mesh(cfg, lay: layout.Layout, policy: DevicePolicy):
    """TorchTitan's mesh for this layout, and the proof that it is the layout (mesh.check)."""
    pd = titan.build_mesh(cfg, lay)
    return pd, mesh.check(lay, titan.mesh_coords(pd), dist.get_rank(), policy)


def record_fp8(cfg, built: titan.Built, pk: dict, run_dir: Path, policy: DevicePolicy) -> str:
    """precision.json: the recipe, its path here, which Linear layers it converted or kept, and which routed experts
    precision.experts converted; the start-up lines that say it."""
    kept = precision.conversion(cfg)[1] if cfg.precision.fp8 != Fp8Recipe.none else {}
    req = precision.RECIPES.get(cfg.precision.fp8)
    experts = built.experts_converted or []
    ereq = precision.EXPERT_RECIPES.get(cfg.precision.experts)
    rec = {
        "name": cfg.precision.name,
        "fp8": cfg.precision.fp8.value,
        "path": None if req is None else f"CPU: {req.on_cpu}" if policy.cpu else req.gpu_path,
        "emulated": pk["emulated"],
        "high_precision_dtype": cfg.precision.param_dtype.value,
        "converted": built.fp8_converted,
        "kept_high_precision": kept,
        "grouped_experts": precision.grouped_experts(cfg),
        "experts": {
            "precision": cfg.precision.experts.value,
            "path": None if ereq is None else f"CPU: {ereq.on_cpu}" if policy.cpu else ereq.gpu_path,
            "converted": experts,
        },
    }
    (run_dir / runfiles.PRECISION).write_text(json.dumps(rec, indent=2) + "\n")
    lines = [_linear_line(cfg, built, pk, kept)] if req is not None else []
    if experts:
        lines.append(f"routed experts {cfg.precision.experts.value}: {len(experts)} MoE blocks ({precision.grouped_experts(cfg)})")
    return "\n".join(lines)


def _linear_line(cfg, built: titan.Built, pk: dict, kept: dict[str, str]) -> str:
    emulated = " EMULATED in PyTorch ops (torchao's blockwise kernels are Triton-only)" if pk["emulated"] else ""
    why: dict[str, list[str]] = {}  # the pattern (or reason) that kept them -> the layers it kept
    for fqn, pattern in kept.items():
        why.setdefault(pattern, []).append(fqn)
    return (
        f"fp8 {cfg.precision.fp8.value}{emulated}: converted {len(built.fp8_converted)} Linear layers "
        f"({precision.by_pattern(built.fp8_converted)}); kept in {cfg.precision.param_dtype.value}: "
        + ", ".join(f"{precision.by_pattern(fqns)} ({pattern})" for pattern, fqns in why.items())
    )


def _load(frozen: Path):
    cfg = freeze.load(frozen)
    return cfg, layout.resolve(cfg.parallelism, cfg.cluster)


@record
def main(frozen_path: str) -> None:
    preempt.watch_rank()  # before anything slow: SLURM's USR2 would otherwise end the rank
    entered = time.time()
    known_warnings.apply(known_warnings.on_console())  # a forked rank inherits the launcher's: ranks 1.. keep every warning
    frozen = Path(frozen_path)
    run_dir = frozen.parent
    cfg, lay = ft.job_view(*_load(frozen))  # fault_tolerance=torchft: this replica group's job
    console.rank(cfg.logging.verbose, run_dir, runfiles.RUNNER_LOG)  # rank 0 writes runner.log; TorchTitan's lines as ours
    for key, value in rank_recorder.rank_env(cfg, run_dir).items():  # the launcher set these; torchrun-started ranks set them here
        os.environ.setdefault(key, value)
    timeline = Timeline(run_dir) if os.environ.get("RANK") == "0" else None  # rank 0 keeps the run's timeline
    if timeline is not None:
        timeline.mark("rank_start", process_start())
        timeline.mark("main", entered)
    policy = start_rank(cfg)
    if timeline is not None:
        timeline.mark("process_group")
    audited = cfg.distributed.audit_collectives
    with collective_audit.audit(policy, run_dir / runfiles.COLLECTIVES / f"rank_{dist.get_rank()}.json") if audited else nullcontext():
        recorder = _start_and_train(cfg, lay, run_dir, policy, timeline)
    recorder.done()
    dist.destroy_process_group()


def _start_and_train(cfg, lay: layout.Layout, run_dir: Path, policy: DevicePolicy, timeline: Timeline | None):
    """Mesh and placement check, then training under this rank's forensics recorder (returned)."""
    rank = dist.get_rank()
    try:
        pd, places = build_mesh(cfg, lay, policy)
    except mesh.PlacementError as e:
        if rank == 0:
            print(f"refusing to train: {e}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        sys.exit(2)
    recorder = rank_recorder.RankRecorder(cfg, run_dir, rank, lay.coords(rank))
    recorder.start()
    try:
        _train(cfg, lay, pd, rank, run_dir, recorder, places, policy, timeline)
    except Exception as e:  # e.g. a collective timed out: leave the rank's last state and recorder dump, then fail
        Timeline(run_dir).failure(f"rank {rank}: {type(e).__name__}: {e}")  # when the attempt's work ended (goodput)
        recorder.failed(e, cfg, run_dir)
        raise
    return recorder


def data_for(cfg, lay: layout.Layout, rank: int, run_dir: Path, policy: DevicePolicy, split: str = "train"):
    """This rank's inputs of `split`: the synthetic stream, the tokenized text files or the prepared token folders
    ("eval": the held-out split: for text data.eval_files or the documents data.eval_fraction holds out of data.files,
    for tokens the prepared eval split; never shuffled)."""
    t, d = cfg.training, cfg.data
    dp_rank, dp, global_batch = ft.data_coords(cfg, lay, rank)  # under torchft: this replica's shards of the whole batch
    common = dict(seq_len=t.seq_len, global_batch=global_batch, microbatch=t.microbatch_size, dp_rank=dp_rank, dp=dp)
    if d.name == DataSource.synthetic:
        return loader.SyntheticData(seed=t.seed, vocab=cfg.model.vocab_size, split=split, **common)
    if d.name == DataSource.tokens:
        sources = [(folder, w) for _, folder, w in manifest.sources(cfg.data.path, cfg.data.mix)]
        shuffle = d.shuffle and split == "train"
        return token_data.TokenData(sources, split=split, seed=t.seed, shuffle=shuffle, documents=d.document_mask, **common)
    files, fraction = (d.eval_files, 0.0) if split == "eval" and d.eval_files else (d.files, d.eval_fraction)
    first = int(os.environ["LOCAL_RANK"]) == 0  # builds the datasets cache of this node; the others then read it
    if not first:
        policy.barrier()
    cache = run_dir / runfiles.DATA_CACHE
    c = corpus.build(files, d.format.value, d.text_field, d.tokenizer, d.eos_token, cache, split, fraction, d.document_mask)
    if first:
        policy.barrier()
    ends = c.ends if d.document_mask else None
    return loader.TextData(torch.from_numpy(c.tokens), seed=t.seed, shuffle=d.shuffle and split == "train", ends=ends, source=c, **common)


def eval_data_for(cfg, lay: layout.Layout, rank: int, run_dir: Path, policy: DevicePolicy):
    """This rank's held-out inputs (runner.run.evaluate), checked to hold eval.steps batches; None when eval is off."""
    if cfg.eval.interval == 0:
        return None
    data = data_for(cfg, lay, rank, run_dir, policy, split="eval")
    evaluate.check_split(data, cfg.eval.steps)
    return data


def _train(cfg, lay: layout.Layout, pd, rank: int, run_dir: Path, recorder, places: list, policy: DevicePolicy, timeline=None) -> None:
    built = titan.build(cfg, lay, pd, run_dir, policy.compute_device())
    if timeline is not None:
        timeline.mark("built")
    pk = peak.read(run_dir)
    peak_tflops, source = pk["peak_tflops"], pk["peak_source"]
    acc = accounting.accounting(cfg, built, pk)
    data = data_for(cfg, lay, rank, run_dir, policy)
    eval_data = eval_data_for(cfg, lay, rank, run_dir, policy)
    if timeline is not None:
        timeline.mark("data")
    sinks = []
    if rank == 0:
        header = (
            f"runner: {cfg.model.flavor} ({built.num_params / 1e6:.1f}M params), layout {layout.label(lay, cfg.parallelism)} "
            f"[{lay.describe()}], {wording.count(lay.world_size, 'rank')}, {cfg.precision.name}, peak {peak_tflops:.3g} TFLOP/s "
            f"{pk['dtype']} ({source}{peak.spread_text(pk)}{', FP8 EMULATED' if pk['emulated'] else ''}), run folder {run_dir}\n"
            f"nodes: {mesh.describe_nodes(places)}"
        )
        if precision.any_fp8(cfg):
            header += "\n" + record_fp8(cfg, built, pk, run_dir, policy)
        frozen, fr = run_dir / runfiles.FROZEN, rank_recorder.dump_folder(cfg, run_dir)
        print(startup.report(cfg, lay, frozen, fr, built.fp8_converted, pk["peak_flops_total"] / lay.world_size / 1e12), flush=True)
        slow_fp8 = accounting.slow_fp8(cfg, acc, pk)  # a CPU whose FP8 GEMMs are a reference loop: say so before the first step
        if slow_fp8:
            print(slow_fp8, flush=True)
        sinks = metrics.sinks(cfg, run_dir, header, freeze.to_container(cfg))
    train.run(cfg, lay, built, data, acc, sinks, run_dir, policy, recorder, eval_data=eval_data, timeline=timeline)


def forked_main(frozen_path: str) -> None:
    procs.drop_agent_signal_handlers()
    main(frozen_path)


def cli() -> None:
    """`python -m runner.worker` (runner/worker.py)."""
    try:
        main(sys.argv[1])
    except KeyboardInterrupt:  # Ctrl-C: the launcher says where the run stopped (runner.run.node_launch.interrupted), not each rank
        procs.exit_now(130)
    procs.exit_now(0)  # an exec-started rank: skip the interpreter's teardown
