"""torch.profiler traces of chosen steps (profile.*), and CUDA allocator snapshots at those steps and on OOM.

After TorchTitan's `torchtitan/tools/profiler.py` (its Profiler and MemoryProfiler): torch.profiler with
`record_shapes`, a `torch.profiler.schedule` of wait/warmup/active for `profile.every`, a Chrome trace per traced
step, and the allocator history recorded with Python stacks only and pickled with protocol 4 (what
pytorch.org/memory_viz reads). Two differences: `profile.steps` lists steps outright, and each step's
`ProfilerStep#<s>` span is closed when the step loop takes the step's time, so the span is the step that
metrics.jsonl reports (torch's own `step()` would leave it open over the logging and checkpointing between steps).
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerAction

from runner.formats import runfiles
from runner.outputs import breakdown
from runner.outputs.breakdown import COMM_SPAN, PP_WAIT_SPAN, RECOMPUTE_SPAN
from runner.run.device import DevicePolicy
from runner.schema import ProfileConfig
from runner.schema.layout import Layout

MAX_ENTRIES = 1_000_000
"""Allocation events the CUDA history keeps (a ring buffer; TorchTitan's memory_snapshot_max_entries default)."""

CUDA_ONLY = "profile.memory: allocator snapshots are CUDA-only; on CPU the traces carry profile_memory's allocation events"


def enabled(p: ProfileConfig) -> bool:
    return bool(p.steps) or p.every > 0


def traced_ranks(p: ProfileConfig, lay: Layout) -> list[int]:
    """profile.ranks, or rank 0 and the first rank of each pipeline stage."""
    if p.ranks is not None:
        return sorted(set(p.ranks))
    firsts = {}
    for r in range(lay.world_size):
        firsts.setdefault(lay.coords(r)["pp"], r)
    return sorted({0, *firsts.values()})


def action(p: ProfileConfig, step: int) -> ProfilerAction:
    """What the profiler does during `step` (1-based): a listed step is recorded after `warmup` steps of running
    unrecorded; `every` follows torch.profiler.schedule on step - 1, so that every=10 traces steps 10, 20, ..."""
    if step < 1:
        return ProfilerAction.NONE
    if step in p.steps:
        return ProfilerAction.RECORD_AND_SAVE
    if p.every:
        got = torch.profiler.schedule(wait=p.every - p.warmup - p.active, warmup=p.warmup, active=p.active)(step - 1)
        if got != ProfilerAction.NONE:
            return ProfilerAction.RECORD_AND_SAVE if got == ProfilerAction.RECORD else got
    if any(step + k in p.steps for k in range(1, p.warmup + 1)):
        return ProfilerAction.WARMUP
    return ProfilerAction.NONE


def profiled(p: ProfileConfig, step: int) -> bool:
    """The profiler runs during `step` (warming up or recording) on the traced ranks: its time is not the run's."""
    return enabled(p) and action(p, step) != ProfilerAction.NONE


class MemoryRecorder:
    """CUDA allocator history from the run's start; a snapshot at each traced step and on an out-of-memory error."""

    def __init__(self, policy: DevicePolicy, run_dir: Path, rank: int):
        self.policy, self.path = policy, run_dir / runfiles.memory_snapshot_path(rank)
        policy.record_allocator_history(MAX_ENTRIES)

    def dump(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "wb") as f:
            pickle.dump(self.policy.allocator_snapshot(), f, protocol=4)  # protocol 4: what memory_viz's parser reads
        return self.path


class StepProfiler:
    """One torch.profiler session over the run on a traced rank; `advance`, `open` and `end` bracket each step."""

    def __init__(self, p: ProfileConfig, lay: Layout, rank: int, run_dir: Path, policy: DevicePolicy, first_step: int, memory):
        self.p, self.rank, self.run_dir, self.memory = p, rank, run_dir, memory
        self.traces: list[tuple[int, Path]] = []
        self.recording = 0
        self.span = None
        self.names = CollectiveNames(lay, rank, policy)
        self.prof = torch.profiler.profile(
            activities=policy.profiler_activities(),
            schedule=lambda step: action(p, step),
            on_trace_ready=self._save,
            record_shapes=True,
            profile_memory=policy.cpu,  # on CUDA the allocator snapshots say more (profile.memory)
        )
        self.prof.record_steps = False  # the step spans are this class's: closed when the step loop takes the step's time
        self.prof.step_num = first_step - 1
        # private_api: torch_profiler_prev_action
        self.prof.current_action = self.prof._prev_schedule_action = action(p, first_step - 1)
        self.prof.start()

    def advance(self, step: int) -> None:
        """Enter `step` in the schedule (saving the trace of a step just recorded)."""
        self.prof.step()
        assert self.prof.step_num == step, (self.prof.step_num, step)
        self.recording = step

    def open(self, step: int) -> None:
        """The step's time starts: ProfilerStep#<step>, and its collectives named by process group."""
        if action(self.p, step) == ProfilerAction.NONE:
            return
        self.names.__enter__()
        self.span = torch.profiler.record_function(f"ProfilerStep#{step}")
        self.span.__enter__()

    def end(self) -> None:
        """The step's time is taken: its span ends here."""
        if self.span is not None:
            self.span.__exit__(None, None, None)
            self.span = None
            self.names.__exit__()

    def _save(self, prof) -> None:
        path = self.run_dir / runfiles.trace_path(self.rank, self.recording)
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        self.traces.append((self.recording, path))
        if self.memory is not None:
            self.memory.dump()

    def close(self) -> list[tuple[int, Path]]:
        """Stop (saving the last step's trace when it was recorded); every (step, trace) written."""
        self.end()
        self.prof.stop()
        return self.traces


@contextmanager
def oom_dump(memory: MemoryRecorder | None, rank: int) -> Iterator[None]:
    """On an out-of-memory error, dump the allocator's snapshot before the error ends the rank (TorchTitan dumps
    on exiting its profiler context with torch.OutOfMemoryError)."""
    try:
        yield
    except torch.OutOfMemoryError:
        if memory is not None:
            path = memory.dump()
            print(f"rank {rank}: out of memory; allocator snapshot {path} (open it at https://pytorch.org/memory_viz)", flush=True)
        raise


def console_lines(p: ProfileConfig, lay: Layout, run_dir: Path, policy: DevicePolicy) -> list[str]:
    """Where the traces go and how to open them (rank 0 prints these at start)."""
    ranks = traced_ranks(p, lay)
    where = run_dir / runfiles.PROFILE
    steps = ", ".join(map(str, p.steps)) + (f"; {p.active} of every {p.every}" if p.every else "")
    out = [
        f"profile: tracing steps {steps} on ranks {', '.join(map(str, ranks))} into {where}/rank_<r>/step_<s>.json.gz; "
        "open one at https://ui.perfetto.dev (or chrome://tracing); the breakdown by term goes to "
        f'{run_dir / runfiles.BREAKDOWN}. Traced steps are marked "profiled" in metrics.jsonl and left out of the medians'
    ]
    if p.memory:
        out.append(
            CUDA_ONLY
            if not policy.allocator_snapshots
            else f"profile.memory: allocator snapshots in {where}/memory_snapshot_rank_<r>.pickle; open at https://pytorch.org/memory_viz"
        )
    return out


DIST_OPS = (
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_gather",
    "broadcast",
    "barrier",
    "all_to_all_single",
    "send",
    "recv",
    "batch_isend_irecv",  # not isend/irecv themselves: P2POp checks them by identity
    "all_gather_object",
    "broadcast_object_list",
)


def funcol_ops(funcol) -> list[str]:
    """The functional collectives (DTensor's redistributes, ring attention, TorchTitan's clip): every public function of
    torch.distributed._functional_collectives that takes a group, but the legacy aliases."""
    import inspect

    return [
        name
        for name, fn in vars(funcol).items()
        if inspect.isfunction(fn) and not name.startswith(("_", "legacy_")) and "group" in inspect.signature(fn).parameters
    ]


DP_GROUPS = ("fsdp", "efsdp", "dp_shard", "dp_replicate", "dp_shard_cp", "dp_cp", "dp", "batch", "loss_mesh")


def axis_of_ranks(lay: Layout, rank: int, ranks: list[int]) -> str:
    """The mesh axis whose group through `rank` is `ranks`: the one axis along which they differ (dp_replicate, dp_shard
    and their product with cp, FSDP's group, are all dp); "host" for any other group."""
    me = lay.coords(rank)
    differing = {a for r in ranks for a, c in lay.coords(r).items() if c != me[a]}
    if differing & {"dp_replicate", "dp_shard"} and differing <= {"dp_replicate", "dp_shard", "cp"}:
        return "dp"
    return next(iter(differing)) if len(differing) == 1 else "host"


CALLERS = (("torch.distributed.tensor.experimental", "cp"), ("torchtitan.distributed.expert_parallel", "ep"))
"""Modules whose collectives belong to one axis whatever group they use: ring attention (CP) and the experts' all-to-all
(EP) run on groups that can be FSDP's own (same ranks: cp2 shards FSDP over dp_shard x cp = the CP ranks)."""


def axis_of(desc: str, ranks: list[int], caller: str, lay: Layout, rank: int) -> str:
    """The axis of a collective: by its caller where the group may be shared (CALLERS), else by the group's mesh name
    (TorchTitan's `mesh_<dim>`), else by its ranks."""
    for prefix, axis in CALLERS:
        if caller.startswith(prefix):
            return axis
    desc = desc.removeprefix("mesh_")
    if desc in ("tp", "pp", "cp", "ep"):
        return desc
    return "dp" if desc in DP_GROUPS else axis_of_ranks(lay, rank, ranks)


class CollectiveNames:
    """While a traced step runs, each torch.distributed and functional-collective call opens a span naming its process
    group's axis and ranks (`runner.comm tp [0, 1] reduce_scatter_tensor`), which runner.outputs.breakdown reads. The group
    is known at the call only; the trace's own collective events (gloo's, NCCL's) do not say it."""

    def __init__(self, lay: Layout, rank: int, policy: DevicePolicy):
        # private_api: torch_funcol
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        self.lay, self.rank, self.policy, self.dist, self.funcol = lay, rank, policy, dist, funcol
        self.saved: list[tuple[object, str, object]] = []
        self.names: dict[int, str] = {}

    def _label(self, group, caller: str) -> str:
        dist = self.dist
        key = (id(group), caller)
        if key not in self.names:
            if caller.startswith("runner.") or (group is not None and group is self.policy.host_group):
                self.names[key] = "host [all]"  # the runner's own host collectives (loss, hashes, monitors)
            else:  # a mesh axis may run on the default group itself (cp2's CP, dp2's FSDP: their ranks are the world)
                group = dist.group.WORLD if group is None else group
                ranks = dist.get_process_group_ranks(group)
                axis = axis_of(getattr(group, "group_desc", "") or "", ranks, caller, self.lay, self.rank)
                self.names[key] = f"{axis} {ranks}"
        return self.names[key]

    def _group(self, fn, op: str, args, kwargs, funcol: bool):
        import inspect

        if op == "batch_isend_irecv":
            return args[0][0].group if args and args[0] else None
        group = inspect.signature(fn).bind_partial(*args, **kwargs).arguments.get("group")
        if funcol and group is not None:
            # private_api: torch_funcol_resolve_group_name, torch_resolve_process_group
            name = self.funcol._resolve_group_name(group)
            group = self.dist.distributed_c10d._resolve_process_group(name)
        return group

    def _wrap(self, fn, op: str, funcol: bool):
        def named(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            with torch.profiler.record_function(f"{COMM_SPAN} {self._label(self._group(fn, op, args, kwargs, funcol), caller)} {op}"):
                return fn(*args, **kwargs)

        return named

    def __enter__(self) -> CollectiveNames:
        # private_api: torch_distributed_collectives, torch_pipeline_wait_batch_p2p, torch_checkpoint_rerun
        for module, ops, funcol in ((self.dist, DIST_OPS, False), (self.funcol, funcol_ops(self.funcol), True)):
            for op in ops:
                fn = getattr(module, op, None)
                if fn is not None:
                    self.saved.append((module, op, fn))
                    setattr(module, op, self._wrap(fn, op, funcol))

        self._name_span("torch.distributed.pipelining.schedules", "_wait_batch_p2p", PP_WAIT_SPAN)  # the schedules' P2P waits
        self._name_span("torch.utils.checkpoint", "_run_fn_with_dynamo_disabled", RECOMPUTE_SPAN)  # non-reentrant AC's rerun
        return self

    def _name_span(self, module_name: str, fn_name: str, span: str) -> None:
        """Run `module_name.fn_name` inside a span named `span`; a module nobody imported runs nothing."""
        module = sys.modules.get(module_name)
        if module is None:
            return
        fn = getattr(module, fn_name)

        def named(*args, **kwargs):
            with torch.profiler.record_function(span):
                return fn(*args, **kwargs)

        self.saved.append((module, fn_name, fn))
        setattr(module, fn_name, named)

    def __exit__(self, *exc) -> None:
        for module, op, fn in reversed(self.saved):
            setattr(module, op, fn)
        self.saved.clear()


class Session:
    """Every rank's part in profiling: the traced ranks' profiler; after a traced step every rank waits for the traced ranks
    to write and read their traces and gathers each one's terms, which rank 0 keeps for profile/breakdown.json."""

    def __init__(self, p: ProfileConfig, lay: Layout, rank: int, run_dir: Path, policy: DevicePolicy, first_step: int):
        self.p, self.rank, self.run_dir, self.policy = p, rank, run_dir, policy
        self.memory = MemoryRecorder(policy, run_dir, rank) if p.memory and policy.allocator_snapshots else None
        traced = enabled(p) and rank in traced_ranks(p, lay)
        self.prof = StepProfiler(p, lay, rank, run_dir, policy, first_step, self.memory) if traced else None
        self.dts: dict[int, float] = {}
        self.per_rank: dict[int, dict[int, dict]] = {}  # rank 0: every traced rank's steps (runner.outputs.breakdown.steps)

    def enter(self, step: int) -> dict | None:
        """Before `step`'s clock starts. After a traced step: the busiest rank's terms of it (rank 0; None elsewhere)."""
        if self.prof is not None:
            self.prof.advance(step)  # writes the trace of step - 1 when it was recorded
        found = self._gather(step - 1) if self._saved(step - 1) else None
        if self.prof is not None:
            self.prof.open(step)
        return found

    def end(self, step: int, dt: float) -> None:
        """`step`'s time `dt` is taken."""
        if self.prof is not None:
            self.prof.end()
        if self._saved(step):
            self.dts[step] = dt

    def close(self, last_step: int) -> dict | None:
        """After the last step that ran: stop the profiler; that step's terms when it was traced (rank 0)."""
        if self.prof is not None:
            self.prof.close()
        return self._gather(last_step) if self._saved(last_step) else None

    def _saved(self, step: int) -> bool:
        return step >= 1 and enabled(self.p) and action(self.p, step) == ProfilerAction.RECORD_AND_SAVE

    def _gather(self, step: int) -> dict | None:
        mine = None
        if self.prof is not None and self.prof.traces and self.prof.traces[-1][0] == step:
            mine = breakdown.steps(breakdown.load(self.prof.traces[-1][1])).get(step)
        got = self.policy.all_gather_object((mine, self.dts.get(step)))
        if self.rank != 0:
            return None
        for r, (terms, dt) in enumerate(got):
            if terms is not None:
                self.per_rank.setdefault(r, {})[step] = terms | {"step_time_s_metrics": dt}
        traced = {r: steps[step] for r, steps in self.per_rank.items() if step in steps}
        if not traced:
            return None
        busiest = max(traced, key=lambda r: breakdown.busy_s(traced[r]))
        return {"step": step, "busiest_rank": busiest, **traced[busiest]}

    def write(self) -> dict | None:
        """Rank 0: profile/breakdown.json over every traced step (runner.outputs.breakdown.combine); None elsewhere."""
        if self.rank != 0 or not self.per_rank:
            return None
        out = breakdown.combine(self.per_rank)
        out["traces"] = {str(r): [str(runfiles.trace_path(r, s)) for s in sorted(steps)] for r, steps in self.per_rank.items()}
        runfiles.write_json(self.run_dir / runfiles.BREAKDOWN, out)
        return out
