"""mode=dryrun: one CPU process plays a rank of the real layout and measures its memory for one step.

The rank runs the same set-up the real ranks run, with torch's fake process group of the cluster's world size:
TorchTitan's ParallelDims and mesh, the model from its registry, the precision converters, TP/SP/FSDP/HSDP/CP/EP
parallelize and its pipeline stage (runner.run.titan.build, on meta). It is then materialized on fake tensors
(FakeTensorMode: building under it fails inside FSDP's set-up), warms up (warm_up: what a first step leaves, AdamW's
lazy state and the pipeline's set-up) and runs one step of the runner's own step parts under the ledger
(runner.run.dryrun.ledger).

`python -m runner.run.dryrun.rehearse NPROC OUT FROZEN` forks NPROC real ranks that do the same (the ledger's ground
truth); `python -m runner.run.dryrun.rehearse OUT FROZEN` under torchrun is one such rank.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runner.config import freeze
from runner.estimate import dryrun_report
from runner.observe.fault_injection import Faults
from runner.run import step_loop, titan
from runner.run.device import DevicePolicy
from runner.run.dryrun import batches, ledger
from runner.run.titan import cpu as titan_cpu
from runner.schema import DeviceType, InjectConfig, RunConfig, layout
from runner.schema.layout import Layout


def rank_config(cfg: RunConfig, lay: Layout, device: DeviceType = DeviceType.cpu) -> RunConfig:
    """The rehearsed config: the build path of `device` (CPU; or CUDA on fake CUDA tensors, runner.run.dryrun.cuda_rehearse,
    where torch.compile is off: it needs a GPU) and the batch runner.estimate.dryrun_report chose."""
    dry = copy.deepcopy(cfg)
    dry.cluster.device = device
    if device == DeviceType.cuda:
        dry.training.compile = False
        dry.parallelism.async_tp = False  # needs compile
    _, m = dryrun_report.microbatches(cfg, lay)
    dry.training.global_batch_size = m * lay.dp * cfg.training.microbatch_size
    return dry


class _Silent:
    """The step monitor's interface (step_loop.forward_backward), observing nothing and planting no fault."""

    faults = Faults(InjectConfig(), rank=0)

    @contextmanager
    def phase(self, name: str):
        yield


@contextmanager
def fake_pipeline(cfg: RunConfig, lay: Layout, pd, device: str = "cpu"):
    """The fake process group delivers no message, so answer locally what stages would tell each other in the
    first step: the static-vs-dynamic vote (all stages vote alike: same model, fixed microbatch shapes) and, for
    shape inference, the metadata of the gradient from the next stage (this stage's outputs) and of the hidden
    state from the previous one (what every Llama stage passes on: (mb, seq [/tp with SP]), dim) in param_dtype)."""
    # private_api: torch_pipeline_inference_mode, torch_pipeline_stage_forward_meta, torch_pipeline_stage_backward_meta,
    # private_api: torch_pipeline_extract_tensor_metas
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining import stage as stage_mod
    from torch.distributed.pipelining._utils import InferenceMode, _StageBackwardMeta, _StageForwardMeta, extract_tensor_metas
    from torch.distributed.tensor import DTensor, Replicate, Shard

    t = cfg.training
    sp = cfg.parallelism.sequence_parallel and lay.tp > 1
    h = torch.empty(
        t.microbatch_size,
        t.seq_len // lay.tp if sp else t.seq_len,
        cfg.model.dim,
        dtype=getattr(torch, cfg.precision.param_dtype.value),
        device=device,
        requires_grad=True,  # the previous stage's output is part of the graph: this stage sends its gradient back
    )
    tp_mesh = pd.get_optional_mesh("tp")
    if tp_mesh is not None:
        h = DTensor.from_local(h, tp_mesh, [Shard(1) if sp else Replicate()], run_check=False)
    hidden = extract_tensor_metas((h,))

    # private_api: torch_stage_user_meta, torch_stage_inference_mode
    def warmup_p2p(self, stages, has_backward, p2p_done):
        for st in stages:
            dynamic = InferenceMode.needs_dynamic(st._user_meta, has_backward)
            st._inference_mode = InferenceMode.DYNAMIC if dynamic else InferenceMode.STATIC

    # private_api: torch_stage_meta
    def recv_meta(self, src_stage):
        if src_stage == self.stage_index + 1:
            return _StageBackwardMeta(backward_metas=tuple(self._stage_meta.outputs))
        return _StageForwardMeta(forward_metas=hidden)

    # private_api: torch_pipeline_warmup_p2p, torch_pipeline_recv_meta
    saved = schedules._PipelineSchedule._warmup_p2p, stage_mod.PipelineStage._recv_meta
    schedules._PipelineSchedule._warmup_p2p, stage_mod.PipelineStage._recv_meta = warmup_p2p, recv_meta
    try:
        yield
    finally:
        schedules._PipelineSchedule._warmup_p2p, stage_mod.PipelineStage._recv_meta = saved


@contextmanager
def balanced_routing(parts: list[torch.nn.Module], ep: int, on_exchange=None):
    """Expert parallelism sizes its all-to-all from the router's token counts, values fake tensors do not have:
    send and receive tokens x top-k / ep to and from every EP rank (perfectly balanced routing). The dispatcher's
    class is taken from the built model, so that only runner.run.titan imports TorchTitan. `on_exchange` is called
    where TorchTitan would read the splits to the host."""
    kinds = {type(m.token_dispatcher) for p in parts for m in p.modules() if getattr(m, "token_dispatcher", None) is not None}
    # private_api: titan_token_dispatcher_local_reorder, titan_token_count_exchange
    kinds = {k for k in kinds if hasattr(k, "_sync_token_count_exchange")}
    saved = {k: (k._local_reorder, k._sync_token_count_exchange) for k in kinds}

    def patched(reorder):
        def local_reorder(self, x, scores, ids):
            out = reorder(self, x, scores, ids)
            self._dryrun_routed = out[0].shape[0]  # tokens x top-k leaving this rank
            return out

        return local_reorder

    def sync(self, local_counts, global_counts, ep_size):
        if on_exchange is not None:  # the CUDA rehearsal counts the device-to-host copy of the splits this replaces
            on_exchange()
        n = self._dryrun_routed
        splits = [n // ep_size + (1 if i < n % ep_size else 0) for i in range(ep_size)]
        return global_counts.reshape(-1), splits, list(splits)

    for k, (reorder, _) in saved.items():
        k._local_reorder, k._sync_token_count_exchange = patched(reorder), sync
    try:
        yield
    finally:
        for k, (reorder, exchange) in saved.items():
            k._local_reorder, k._sync_token_count_exchange = reorder, exchange


def one_step(
    cfg: RunConfig,
    built,
    opt,
    microbatches: list,
    led: ledger.Ledger | None,
    after_clip: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> None:
    """One training step of this rank on `microbatches`: the pipeline schedule or forward/backward per microbatch, clip,
    the optimizer update. `after_clip(local loss, grad norm)` sees the step's results before the update, as the step
    loop's host read does (runner.run.dryrun.cuda_rehearse)."""
    t = cfg.training
    global_tokens = torch.tensor(float(t.global_batch_size * t.seq_len))
    mark = led.phase if led is not None else (lambda name: None)
    mark("forward/backward")
    if built.schedule is not None:
        local = titan.pipeline_step(built, microbatches, global_tokens)
    else:
        local = step_loop.forward_backward(built, titan.loss_fn(cfg), microbatches, global_tokens, _Silent())
    mark("clip")
    norm = titan.clip_grad_norm_tensor(built.parts, t.max_norm, built.parallel_dims)
    if after_clip is not None:
        after_clip(local, norm)
    mark("optimizer")
    if led is not None:
        led.in_optimizer = True
    opt.step()
    if led is not None:
        led.in_optimizer = False
    mark("zero_grad")
    opt.zero_grad(set_to_none=True)


def param_shards(parts: list[torch.nn.Module]) -> list[dict[str, Any]]:
    from torch.distributed.tensor import DTensor

    out = []
    for m in parts:
        for name, p in m.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            out.append(
                {"name": name, "shape": list(local.shape), "global_shape": list(p.shape), "dtype": str(local.dtype).removeprefix("torch.")}
            )
    return out


def _materialize_fake(parts: list[torch.nn.Module]) -> None:
    """On fake tensors (inside FakeTensorMode). No init_weights: it draws data-dependently (trunc_normal_),
    and values do not change memory; but the tie of a tied embedding that its init_states makes, which does."""
    for part in parts:
        part.to_empty(device="cpu")
        titan.tie_weights(part)
        titan_cpu.force_sum_reduction(part)
        part.train()


def warm_up(cfg: RunConfig, lay: Layout, built, opt) -> None:
    """What a first step leaves for the measured one, at the cost of one microbatch instead of all (on fake tensors most
    of a rank's time: Qwen3-235B's rank 0 runs 32 microbatches of full recomputation a step): the pipeline's own set-up
    (titan.pipeline_set_up: shape inference, every microbatch's receive buffers) or forward/backward of the first
    microbatch, so that torch's caches meet every shape once; the clip; AdamW's first update, which makes its state (a
    parameter left without a gradient updates from zeros: the state is the same whatever the gradients hold). FSDP's
    gathered-parameter storages are then made by the measured step's first all-gather: the same bytes at the same point."""
    microbatches = batches.synthetic_microbatches(cfg, lay)
    global_tokens = torch.tensor(float(cfg.training.global_batch_size * cfg.training.seq_len))
    if built.schedule is not None:
        titan.pipeline_set_up(built, microbatches, global_tokens)
    else:
        step_loop.forward_backward(built, titan.loss_fn(cfg), microbatches[:1], global_tokens, _Silent())
    for p in (p for part in built.parts for p in part.parameters() if p.requires_grad and p.grad is None):
        p.grad = torch.zeros_like(p)
    titan.clip_grad_norm_tensor(built.parts, cfg.training.max_norm, built.parallel_dims)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _warm_up_and_step(cfg: RunConfig, lay: Layout, built, opt) -> tuple[dict[str, Any], dict[str, Any]]:
    """The warm-up unmeasured (warm_up: the lazy optimizer state, the pipeline's set-up), a step under the ledger."""
    t1 = time.perf_counter()
    warm_up(cfg, lay, built, opt)
    t2 = time.perf_counter()
    led = ledger.Ledger()
    ledger.label_state(led, built.parts, opt)
    if built.schedule is not None:
        ledger.label_pipeline(led, built.schedule)
    with ledger.fsdp_labels(led), led:
        one_step(cfg, built, opt, batches.synthetic_microbatches(cfg, lay), led)
    return led.sweep(), {"warm_up_s": t2 - t1, "step_s": [time.perf_counter() - t2]}


def measure(cfg: RunConfig, lay: Layout, run_dir: Path, fake: bool) -> dict[str, Any]:
    """Build this rank (the default process group is up), warm up, run a step, return its ledger."""
    # private_api: torch_fake_tensor_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    t0 = time.perf_counter()
    pd = titan.build_mesh(cfg, lay)
    torch.manual_seed(cfg.training.seed)
    # CPU tensors (fake ones in a dry run) whatever the cluster: the layout is the cluster's, the device this machine's
    built = titan.build(cfg, lay, pd, run_dir, torch.device("cpu"), materialize=not fake)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext()
    pipe = fake_pipeline(cfg, lay, pd) if fake and built.schedule is not None else nullcontext()
    routing = balanced_routing(built.parts, lay.ep) if fake and lay.ep > 1 else nullcontext()
    with fake_mode, pipe, routing:
        if fake:
            _materialize_fake(built.parts)
        opt, _ = titan.build_optimizer(cfg, built.parts)
        titan.register_optimizer_hooks(built, opt)
        build_s = time.perf_counter() - t0
        result, times = _warm_up_and_step(cfg, lay, built, opt)
        shards = param_shards(built.parts)
    return rank_report(lay, built, result, shards, fake=fake, build_s=build_s, t0=t0, **times)


def rank_report(lay: Layout, built, result: dict[str, Any], shards: list[dict[str, Any]], **timing: Any) -> dict[str, Any]:
    """What a rehearsed rank reports, on CPU and in the CUDA rehearsal alike: where it sits, its measured storages by
    category (`result`: the ledger's sweep), its parameter shards; `timing`: fake, build_s, step_s (the steps run), t0
    (its start), and on CPU warm_up_s (the unmeasured set-up before its one step)."""
    rank = dist.get_rank()
    return {
        "rank": rank,
        "coords": {k: v for k, v in lay.coords(rank).items() if getattr(lay, k) > 1},
        "has_first_stage": built.has_first,
        "has_last_stage": built.has_last,
        "fake": timing["fake"],
        "build_s": timing["build_s"],
        "step_s": timing["step_s"],
        **({"warm_up_s": timing["warm_up_s"]} if "warm_up_s" in timing else {}),
        "wall_s": time.perf_counter() - timing["t0"],
        **result,
        "categories_at_peak": ledger.by_category(result["at_peak"]),
        "categories_max": ledger.by_category(result["max_each"]),
        "num_params_local": sum(math.prod(s["shape"]) for s in shards),
        "param_shards": shards,
    }


def rehearse_rank(cfg: RunConfig, lay: Layout, rank: int, run_dir: Path) -> dict[str, Any]:
    """One simulated rank in this process: a fake process group of the layout's world size, torn down after."""
    # private_api: torch_fake_store
    from torch.testing._internal.distributed.fake_pg import FakeStore

    titan.quiet_torchao(cfg)
    titan_cpu.patch_device_globals()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=lay.world_size)
    try:
        return measure(cfg, lay, run_dir, fake=True)
    finally:
        dist.destroy_process_group()


def in_fork(fn, *args) -> Any:
    """fn(*args) in a child forked from this process, its JSON result read back through a pipe. A second fake
    world in one process fails: state from the first leaks in ("Could not resolve the process group registered
    under the name ..." in the second rank's first DTensor redistribute)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            out = {"result": fn(*args)}
        except BaseException:  # noqa: BLE001 - the parent re-raises it with this text
            out = {"error": traceback.format_exc()}
        with os.fdopen(write, "w") as f:
            json.dump(out, f)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # not the parent's exit handlers
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    os.waitpid(pid, 0)
    out = json.loads(text) if text else {"error": "the simulated rank died without a result"}
    if "error" in out:
        raise RuntimeError(f"dry run of {args[2] if len(args) > 2 else '?'} failed:\n{out['error']}")
    return out["result"]


def rehearse(cfg: RunConfig, lay: Layout, ranks: list[int], run_dir: Path) -> dict[str, Any]:
    """Every chosen rank of the layout, one after another, each in a child forked after the imports
    (about 1 s each; re-importing in a fresh interpreter costs ~10 s)."""
    dry = rank_config(cfg, lay)
    titan.preload(dry)
    out = []
    for r in ranks:
        out.append(in_fork(rehearse_rank, dry, lay, r, run_dir))
        print(f"rank {r}: simulated in {out[-1]['wall_s']:.1f} s", flush=True)
    return {"substitutions": dryrun_report.substitutions(cfg), "ranks": out, "block_mask": in_fork(batches.block_mask_probe, cfg, lay)}


def main(out_dir: str, frozen: str) -> None:
    """Real ranks (under torchrun): the same warm-up and step, measured by the same ledger; one JSON per rank."""
    cfg = freeze.load(Path(frozen))
    lay = layout.resolve(cfg.parallelism, cfg.cluster)
    titan.init_process_group(cfg, DevicePolicy.of(cfg.cluster, cfg.distributed))
    res = measure(rank_config(cfg, lay), lay, Path(out_dir), fake=False)
    Path(out_dir, f"ledger_rank{res['rank']}.json").write_text(json.dumps(res, indent=1))
    dist.destroy_process_group()


def launch_real(nproc: int, out_dir: str, frozen: str) -> None:
    """`nproc` real ranks of main(out_dir, frozen), forked by torch's elastic agent after the imports (as
    runner.parity starts its ranks): one import of torch and TorchTitan instead of one per rank."""
    from runner.run import procs

    titan.preload(freeze.load(Path(frozen)))
    rdzv = ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", f"--rdzv-id=ledger-{os.getpid()}"]  # torchrun --standalone
    procs.fork_ranks([*rdzv, f"--nproc-per-node={nproc}"], _forked_main, out_dir, frozen)
    procs.exit_now(0)


def _forked_main(out_dir: str, frozen: str) -> None:
    from runner.run import procs

    procs.drop_agent_signal_handlers()
    main(out_dir, frozen)


if __name__ == "__main__":
    if len(sys.argv) == 4:
        launch_real(int(sys.argv[1]), sys.argv[2], sys.argv[3])
    else:
        main(*sys.argv[1:])
