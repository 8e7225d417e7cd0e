"""Several layouts trained one after another inside one process group.

    python -m runner.parity <nproc> <run folder>/frozen.yaml [<run folder>/frozen.yaml ...]

starts `nproc` ranks with torch's elastic agent (like runner.run.node_launch), and every rank then
builds, for each frozen config in turn, TorchTitan's mesh, model and schedule and trains it
with the runner's own step loop (runner.run.train.run). Each run folder gets `parity.json`:
per-step rows (loss, pre-clip global grad norm, tokens/s), the summary (with the measured
pipeline idle fraction), the stage split, and a fingerprint of the weights before and after
training, gathered as full tensors (and an FP8 config's precision.json, as runs write it). Imports
cost ~10 s per rank, so tests and the benchmark check many layouts in one launch instead of one launch each.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runner.config import freeze
from runner.estimate import precision
from runner.formats import runfiles
from runner.run import accounting, evaluate, peak, per_rank, procs, step_loop, titan, train
from runner.schema import RunConfig, WorkerStart, layout


class Collect:
    """A metrics sink that keeps the rows and the summary in memory."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.summary: dict[str, Any] = {}

    def log(self, row: dict[str, Any]) -> None:
        self.rows.append(row)

    def log_breakdown(self, found: dict[str, Any]) -> None:
        row = next(r for r in reversed(self.rows) if r["step"] == found["step"])  # logged before its trace was read
        row["breakdown"] = found

    def close(self, summary: dict[str, Any]) -> None:
        self.summary = summary


def full_weights(parts: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Every parameter of this rank's stage(s) as a full float64 tensor (DTensor shards gathered)."""
    out = {}
    for part in parts:
        for name, p in part.named_parameters():
            out[name] = titan.local_value(p.detach()).double().clone()
    return out


def exact_grad_norm(parts: list[torch.nn.Module], lay: layout.Layout, policy) -> float:
    """The global gradient norm in float64 from the full gradients (DTensor shards gathered).

    The logged norm is TorchTitan's clip in float32, where torch's CPU vector norm rounds at ~4e-5 relative
    on the 0.5M-element output head, differently for each shard shape; this one compares layouts at ~1e-9."""
    grads = [titan.local_value(p.grad).double() for part in parts for p in part.parameters() if p.grad is not None]
    terms = [[g.square().sum()] for g in grads] if _is_stage_lead(lay) else []
    return float(global_sums(terms, 1, policy)[0].sqrt())


def global_sums(terms: list[list[torch.Tensor]], width: int, policy) -> torch.Tensor:
    """Sum over ranks of this rank's terms (rows of `width` scalars, on the device that computed them): added up on
    that device, then copied to the host once and summed over the ranks on the policy's host group (NCCL takes no
    host tensors; the default group would be NCCL on CUDA)."""
    local = torch.stack([torch.stack(row) for row in terms]).sum(0) if terms else torch.zeros(width, dtype=torch.float64)
    return policy.all_reduce(local.to("cpu", torch.float64))


def _is_stage_lead(lay: layout.Layout) -> bool:
    """This rank is at coordinate 0 of every axis but pp: it counts its stage's full tensors once."""
    c = lay.coords(dist.get_rank())
    return all(c[a] == 0 for a in ("dp_replicate", "dp_shard", "cp", "tp"))


def fingerprint(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], lay: layout.Layout, policy) -> dict[str, float]:
    """Global sums over all parameters (each counted once: by the rank at dp/cp/tp coordinate 0 of its
    pipeline stage): sum of squares of the weights, and of the update (after - before)."""
    terms = [[w.square().sum(), (w - before[name]).square().sum(), w.sum()] for name, w in after.items()] if _is_stage_lead(lay) else []
    sums = global_sums(terms, 3, policy)
    return {"weights_sq": float(sums[0]), "update_sq": float(sums[1]), "weights_sum": float(sums[2])}


def run_one(cfg: RunConfig, run_dir: Path, policy) -> dict[str, Any]:
    lay = layout.resolve(cfg.parallelism, cfg.cluster)
    if lay.world_size != dist.get_world_size():
        raise ValueError(f"{cfg.parallelism.name} needs {lay.world_size} ranks; this group has {dist.get_world_size()}")
    pd, _ = per_rank.build_mesh(cfg, lay, policy)
    rank = dist.get_rank()
    built = titan.build(cfg, lay, pd, run_dir, policy.compute_device())
    if rank == 0 and precision.any_fp8(cfg):
        per_rank.record_fp8(cfg, built, peak.read(run_dir), run_dir, policy)  # precision.json, as a run writes it
    eval_data = per_rank.eval_data_for(cfg, lay, rank, run_dir, policy)
    result = {
        "layout": cfg.parallelism.name,
        "degrees": lay.describe(),
        "schedule": type(built.schedule).__name__ if built.schedule is not None else None,
    }
    if cfg.eval.cpu_flex_attention:
        result |= _evaluate_only(cfg, lay, built, eval_data, policy)
    else:
        result |= _train(cfg, lay, built, run_dir, policy, eval_data)
    result["stages"] = policy.all_gather_object(_stages(built))
    if rank == 0:
        (run_dir / runfiles.PARITY).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _train(cfg: RunConfig, lay: layout.Layout, built: titan.Built, run_dir: Path, policy, eval_data) -> dict[str, Any]:
    """Train with the runner's step loop: per-step rows, the exact step-1 norm, the weights' fingerprint, the summary."""
    data = per_rank.data_for(cfg, lay, dist.get_rank(), run_dir, policy)
    seen = _first_norm_output(built)
    per_weight_pass, per_stage = _block_forwards(built)
    before = full_weights(built.parts)
    sink, exact, init = Collect(), [], []
    # step 1's exact norm, from the gradients the step loop itself computed, just before TorchTitan's clip
    hooks = step_loop.Hooks(
        before_clip=lambda step, parts: exact.append(exact_grad_norm(parts, lay, policy)) if step == 1 else None, after_init=init.append
    )
    acc = accounting.accounting(cfg, built, peak.read(run_dir))
    train.run(cfg, lay, built, data, acc, [sink], run_dir, policy, hooks=hooks, eval_data=eval_data)
    return {
        "rows": sink.rows,
        "norm_output_shape": seen,
        "block_forwards_per_weight_pass": sorted({n for got in policy.all_gather_object(per_weight_pass) for n in got}),
        "block_forwards_per_stage": {k: v for got in policy.all_gather_object(per_stage) for k, v in got.items()},
        "grad_norm_fp64": exact[0] if exact else None,  # None: a resumed run that starts after step 1
        "weights": fingerprint(before, full_weights(built.parts), lay, policy),
        "summary": sink.summary,
        "hf_init": policy.all_gather_object(_hf_read(init)),
        "expert_bias": {k: v for stage in policy.all_gather_object(titan.expert_biases(built.parts)) for k, v in stage.items()},
    }


def _evaluate_only(cfg: RunConfig, lay: layout.Layout, built: titan.Built, eval_data, policy) -> dict[str, Any]:
    """eval.cpu_flex_attention: one evaluation pass of the initial weights (FlexAttention has no backward on CPU), with
    the inner attention kinds the model holds and the batch of every block mask an attention call received."""
    if eval_data is None:
        raise ValueError(f"{cfg.parallelism.name}: eval.cpu_flex_attention only evaluates, and eval.interval=0 evaluates nothing")
    kinds = sorted({type(m.inner_attention).__name__ for part in built.parts for m in part.modules() if hasattr(m, "inner_attention")})
    mask_batches = _mask_batches(built)
    t = cfg.training
    batches = (step_loop.on_device(eval_data.microbatches(k), policy.compute_device()) for k in range(cfg.eval.steps))
    local = evaluate.local_loss(built, titan.loss_fn(cfg), batches, torch.tensor(float(t.global_batch_size * t.seq_len)))
    loss = evaluate.global_loss(local, lay, policy) / cfg.eval.steps
    return {"rows": [{"step": 0, "eval_loss": loss}], "attention": kinds, "mask_batches": mask_batches}


def _mask_batches(built: titan.Built) -> list[int]:
    """Filled during the forwards: the batch size of the BlockMask each inner attention call receives."""
    seen: list[int] = []

    def hook(module, args, kwargs):
        masks = kwargs.get("attention_masks")
        seen.append(int(masks.kv_num_blocks.shape[0]) if masks is not None else -1)

    for part in built.parts:
        for m in part.modules():
            if hasattr(m, "inner_attention"):
                m.inner_attention.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def _hf_read(init: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What this rank read of model.init_from: how many tensors, the blocks they belong to, its elements (None: not
    started from Hugging Face weights)."""
    if not init:
        return None
    keys = init[0]["keys"]
    blocks = sorted({int(k.split(".")[2]) for k in keys if k.startswith("model.layers.")})
    return {"tensors": len(keys), "blocks": blocks, "local_elements": init[0]["local_elements"], "keys": keys}


def _first_norm_output(built: titan.Built) -> list[int]:
    """Filled during the first forward with the local shape of the first transformer block's attention_norm
    output on this rank: [batch, seq / tp, dim] under sequence parallelism, [batch, seq, dim] without."""
    shape: list[int] = []
    blocks = [b for part in built.parts for b in part.layers.children()]
    if not blocks:
        return shape

    def hook(module, args, out):
        shape.extend((out.to_local() if hasattr(out, "to_local") else out).shape)
        handle.remove()  # one microbatch is enough

    handle = blocks[0].attention_norm.register_forward_hook(hook)
    return shape


def _block_forwards(built: titan.Built) -> tuple[list[int], dict[int, int]]:
    """Filled during training: for each weight pass of a split backward (a stage's backward_weight_one_chunk) that ran
    a block's forward (activation checkpointing's recompute), the most forwards one block ran in it; and per pipeline
    stage of this rank, the forwards its first block ran in the whole run, recomputes included."""
    if built.schedule is None:
        return [], {}
    found: list[int] = []
    counts: dict[int, int] = {}
    per_stage: dict[int, int] = {}

    def count(module, stage: int) -> None:
        counts[id(module)] = counts.get(id(module), 0) + 1
        if module is firsts[stage]:
            per_stage[stage] = per_stage.get(stage, 0) + 1

    firsts = {}
    for stage in titan.pipeline_stages(built.schedule):
        blocks = list(stage.submod.layers.children())
        firsts[stage.stage_index] = blocks[0].attention_norm if blocks else None
        for block in blocks:  # a block's first norm runs once per forward of the block, recomputes too
            block.attention_norm.register_forward_pre_hook(lambda module, args, i=stage.stage_index: count(module, i))

    def counted(weight_pass):
        def run(*args, **kwargs):
            counts.clear()
            out = weight_pass(*args, **kwargs)
            found.extend([max(counts.values())] if counts else [])
            return out

        return run

    for stage in titan.pipeline_stages(built.schedule):  # private_api: torch_stage_weight_pass
        stage.backward_weight_one_chunk = counted(stage.backward_weight_one_chunk)
    return found, per_stage


def _stages(built: titan.Built) -> list[dict[str, Any]]:
    """This rank's pipeline stages: index and transformer layers held."""
    return [{"index": s.stage_index, "layers": len(s.submod.layers)} for s in titan.pipeline_stages(built.schedule)]


def main(frozen_paths: list[str]) -> None:
    cfgs = [(freeze.load(p), Path(p).parent) for p in frozen_paths]
    first = cfgs[0][0]
    policy = per_rank.start_rank(first)
    for cfg, run_dir in cfgs:
        started = time.perf_counter()
        run_one(cfg, run_dir, policy)
        policy.barrier()
        if dist.get_rank() == 0:  # the point's wall time in the shared launch, build to the last rank's end
            path = run_dir / runfiles.PARITY
            path.write_text(json.dumps(json.loads(path.read_text()) | {"wall_s": round(time.perf_counter() - started, 3)}, indent=2) + "\n")
    dist.destroy_process_group()


def launch(nproc: int, frozen_paths: list[Path]) -> None:
    """Start `nproc` local ranks running main(frozen_paths); the CPU peak is measured once, before they start."""
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    cfg = freeze.load(frozen_paths[0])
    rec = peak.write(cfg, nproc, frozen_paths[0].parent)
    for p in frozen_paths[1:]:
        shutil.copy(frozen_paths[0].parent / runfiles.PEAK, p.parent / runfiles.PEAK)
    if rec["device"] == "cpu":
        os.environ.setdefault("OMP_NUM_THREADS", str(procs.threads_per_rank(nproc)))
    log_dir = frozen_paths[0].parent / runfiles.LOGS
    rdzv = ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", f"--rdzv-id=parity-{uuid.uuid4().hex[:8]}"]  # torchrun --standalone
    flags = [*rdzv, f"--nproc-per-node={nproc}", f"--log-dir={log_dir}", "--monitor-interval=0.5"]
    if cfg.cluster.worker_start == WorkerStart.fork:
        for c in {freeze.load(p).model.name: freeze.load(p) for p in frozen_paths}.values():  # one per model family
            titan.preload(c)
        procs.fork_ranks(flags, forked_main, *map(str, frozen_paths))
    else:
        torchrun(parse_args([*flags, "-m", "runner.parity", *map(str, frozen_paths)]))


def forked_main(*frozen_paths: str) -> None:
    procs.drop_agent_signal_handlers()
    main(list(frozen_paths))


def prepare(cfgs: dict[str, RunConfig], folder: Path) -> list[Path]:
    """One run folder with frozen.yaml per named config; returns the frozen paths in order."""
    paths = []
    for name, cfg in cfgs.items():
        run_dir = folder / name
        run_dir.mkdir(parents=True, exist_ok=True)
        paths.append(freeze.write(cfg, layout.resolve(cfg.parallelism, cfg.cluster), run_dir))
    return paths


def cli() -> None:
    """`python -m runner.parity` (runner/parity.py)."""
    if len(sys.argv) > 2 and sys.argv[1].isdigit():
        launch(int(sys.argv[1]), [Path(p) for p in sys.argv[2:]])
        procs.exit_now(0)
    else:
        main(sys.argv[1:])
