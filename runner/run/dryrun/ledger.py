"""Every tensor storage of one rank from its creation to its free, labelled by what it turns out to be.

A TorchDispatchMode that sits below DTensor (so it sees the local shards a rank really holds) and works
alike on real tensors and on fake ones (FakeTensorMode), which is what lets one CPU process measure a
rank of a 16,384-GPU layout. torch's FSDPMemTracker gives wrong figures under fake tensors; this does
not rely on any allocator. Labels are resolved after the run: a storage labelled late (a backward
temporary that becomes a gradient) counts in its final category over its whole life.
"""

from __future__ import annotations

import weakref
from collections import Counter, defaultdict
from contextlib import contextmanager

# private_api: torch_dispatch_mode, torch_is_traceable_wrapper_subclass, torch_tree_flatten
import torch
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from runner.run.titan.step import pipeline_stages

# Fine labels, least specific first: a storage keeps the most specific label it is given.
LABELS = (
    "activation",
    "backward_temp",
    "optimizer_temp",
    "collective",
    "buffer",
    "grad_unsharded",
    "grad_shard",
    "param_gathered",
    "optimizer_state",
    "param_shard",
)
_RANK = {name: i for i, name in enumerate(LABELS)}

# The categories a report shows, and the fine labels in each.
CATEGORIES = {
    "parameters": ("param_shard", "param_gathered"),
    "gradients": ("grad_shard", "grad_unsharded"),
    "optimizer_state": ("optimizer_state",),
    "activations": ("activation",),
    "temporaries": ("backward_temp", "optimizer_temp"),
    "buffers": ("buffer",),
    "collective_buffers": ("collective",),
}

# private_api: torch_wrap_tensor_autograd
CUSTOM_COLLECTIVES = {"cplib": ("flex_cp_allgather", "flex_cp_allgather_backward")}
"""Custom ops whose bodies run collectives (context parallelism's K/V all-gather for FlexAttention and its backward's
reduce-scatter): under fake tensors their fake kernel runs instead, so the op itself is the collective, on the group
its name argument gives, its input the tensors it is given."""
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")  # ops of the collective namespaces that send nothing
_DEVICE = torch.ops.prim.device.default
"""A tensor's device, dispatched for tensors that answer it themselves (fake ones): it makes no storage."""


def storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The untyped storages behind a tensor, through DTensor and other wrapper subclasses."""
    out, todo = [], [t]
    while todo:
        x = todo.pop()
        if is_traceable_wrapper_subclass(x):
            todo += [getattr(x, a) for a in x.__tensor_flatten__()[0] if isinstance(getattr(x, a), torch.Tensor)]
        else:
            out.append(x.untyped_storage())
    return out


def _local_bytes(x) -> int:
    if not isinstance(x, torch.Tensor):
        return sum(_local_bytes(y) for y in x) if isinstance(x, (list, tuple)) else 0
    x = x.to_local() if hasattr(x, "to_local") else x
    return x.numel() * x.element_size()


def _group_of(args) -> str:
    """The mesh axis (DeviceMesh's group description) a collective runs on."""
    # private_api: torch_resolve_process_group
    from torch.distributed.distributed_c10d import _resolve_process_group

    for a in args:
        if isinstance(a, str):
            try:
                a = _resolve_process_group(a)
            except (KeyError, RuntimeError, ValueError):
                continue
        elif isinstance(a, torch.ScriptObject):  # the c10d ops take the group boxed
            a = torch.distributed.ProcessGroup.unbox(a)
        if isinstance(a, torch.distributed.ProcessGroup):
            return f"{a.group_desc or 'default'}({a.size()})"
    return "?"


class Ledger(TorchDispatchMode):
    """Live bytes of this rank by label, as a list of (storage, delta) events, plus the collectives issued."""

    supports_higher_order_operators = True
    """FlexAttention is a higher-order op (the CUDA rehearsal runs it): it passes through, its outputs are counted."""

    def __init__(self) -> None:
        super().__init__()
        self._ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._size: dict[int, int] = {}
        self.label_of: dict[int, str] = {}
        self.events: list[tuple[int, int]] = []
        self.phases: list[tuple[int, str]] = []
        self.collectives: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        self.in_optimizer = False
        self._fake = None
        self._propagating = 0

    # --- storages -----------------------------------------------------------------------------
    def _register(self, st: torch.UntypedStorage, label: str) -> int:
        i = self._ids.get(st)
        if i is not None:
            return i
        i = len(self._size) + 1
        self._ids[st] = i
        self._size[i], self.label_of[i] = st.nbytes(), label
        if self._size[i]:
            self.events.append((i, self._size[i]))
        weakref.finalize(st, self._free, i)
        return i

    def _free(self, i: int) -> None:
        if self._size.get(i):
            self.events.append((i, -self._size[i]))
        self._size[i] = 0

    def _resized(self, st: torch.UntypedStorage) -> None:
        i = self._ids.get(st)
        if i is None:  # made before tracking began (FSDP keeps its gathered-parameter storages across steps)
            self._register(st, self.current_label())
            return
        n = st.nbytes()
        if n != self._size[i]:
            self.events.append((i, n - self._size[i]))
            self._size[i] = n

    def label(self, t: torch.Tensor | None, label: str) -> None:
        """Label the storages of `t` (a more specific label already there is kept)."""
        if t is None:
            return
        for st in storages(t):
            i = self._register(st, label)
            if _RANK[label] > _RANK[self.label_of[i]]:
                self.label_of[i] = label

    def current_label(self) -> str:
        if self.in_optimizer:
            return "optimizer_temp"
        # private_api: torch_current_graph_task_id
        return "backward_temp" if torch._C._current_graph_task_id() != -1 else "activation"

    def phase(self, name: str) -> None:
        self.phases.append((len(self.events), name))

    # --- dispatch -----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._guards import active_fake_mode
        from torch.distributed.tensor import DTensor

        if func is _DEVICE or self._propagating:  # a fake tensor's `.device` (most calls); DTensor's shape propagation
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor desugars to local ops first: we see the local shards
        kwargs = kwargs or {}
        # private_api: torch_higher_order_operator
        if isinstance(func, HigherOrderOperator):
            out = func(*args, **kwargs)
            if active_fake_mode() is self._fake:
                self._count(out)
            return out
        # private_api: torch_active_fake_mode, torch_c10d_functional_ops
        if func is torch.ops._c10d_functional.wait_tensor.default and active_fake_mode() is not None:
            out = args[0]  # eager returns its argument; the fake kernel would make a new tensor
        else:
            out = func(*args, **kwargs)
        if active_fake_mode() is not self._fake:
            return out  # DTensor's sharding propagation on its own fake mode: no memory of this rank
        if func.namespace in ("c10d", "_c10d_functional") or func.namespace in CUSTOM_COLLECTIVES:
            self._collective(func, args)
        self._count(out)
        return out

    def _count(self, out) -> None:
        label = self.current_label()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                for st in storages(t):
                    if st in self._ids:
                        self._resized(st)
                    else:
                        self._register(st, label)

    def _collective(self, func, args) -> None:
        # private_api: torch_op_schema, torch_c10d_allgather_base, torch_c10d_reduce_scatter_base
        name = func._schema.name.split("::")[-1]
        if name in _NOT_COLLECTIVES:
            return
        if func.namespace in CUSTOM_COLLECTIVES:
            rec = self.collectives[(name, _group_of(args))]
            rec[0] += 1
            rec[1] += _local_bytes([a for a in args if isinstance(a, torch.Tensor)])
            return
        if name in ("_allgather_base_", "allgather_into_tensor_coalesced_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
            for t in tree_flatten(args[:2])[0]:  # FSDP's flat all-gather / reduce-scatter buffers
                if isinstance(t, torch.Tensor):
                    self.label(t, "collective")
        # bytes this rank contributes: the input (the second argument of the in-place c10d output-first ops)
        inp = args[1] if name in ("_allgather_base_", "allgather_into_tensor_coalesced_", "_reduce_scatter_base_") else args[0]
        rec = self.collectives[(name.rstrip("_"), _group_of(args))]
        rec[0] += 1
        rec[1] += _local_bytes(inp)

    def __enter__(self):
        from torch._guards import active_fake_mode

        self._fake = active_fake_mode()
        # private_api: torch_active_fake_mode, torch_storage_resize
        self._resize = torch.UntypedStorage.resize_
        ledger = self

        def resize_(st, n):  # FSDP2 frees and re-allocates gathered parameters with storage.resize_, which is not dispatched
            ledger._resize(st, n)
            ledger._resized(st)

        torch.UntypedStorage.resize_ = resize_
        self._untracked_propagation()
        return super().__enter__()

    def _untracked_propagation(self) -> None:
        """DTensor's sharding propagation, on a cache miss, runs the op on global-shaped fake tensors to learn the
        output's shape, in the active fake mode (the rehearsal's, under fake tensors): no memory of this rank. Without
        this, how much of it a step counts would depend on what earlier steps left in the cache."""
        # private_api: torch_sharding_prop_tensor_meta
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        self._propagate = ShardingPropagator._propagate_tensor_meta_non_cached
        ledger, propagate = self, self._propagate

        def untracked(prop, op_schema):
            ledger._propagating += 1
            try:
                return propagate(prop, op_schema)
            finally:
                ledger._propagating -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = untracked

    def __exit__(self, *exc):
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        torch.UntypedStorage.resize_ = self._resize
        ShardingPropagator._propagate_tensor_meta_non_cached = self._propagate
        return super().__exit__(*exc)

    # --- result -------------------------------------------------------------------------------
    def sweep(self) -> dict:
        """The peak of the live total, its breakdown by label, each label's own maximum, and the phase of the peak."""
        cur, most, total, peak, at_peak, peak_phase = Counter(), Counter(), 0, 0, Counter(), "start"
        marks, phase = dict(self.phases), "start"
        for k, (i, d) in enumerate(self.events):
            phase = marks.get(k, phase)
            label = self.label_of[i]
            cur[label] += d
            total += d
            most[label] = max(most[label], cur[label])
            if total > peak:
                peak, at_peak, peak_phase = total, Counter(cur), phase
        return {
            "peak_bytes": peak,
            "peak_phase": peak_phase,
            "at_peak": {k: at_peak.get(k, 0) for k in LABELS},
            "max_each": {k: most.get(k, 0) for k in LABELS},
            "collectives": [{"op": op, "group": group, "count": n, "bytes": b} for (op, group), (n, b) in sorted(self.collectives.items())],
        }


def label_state(ledger: Ledger, parts: list[torch.nn.Module], optimizer) -> None:
    """Label what exists before the step: parameter shards, their gradients, buffers, optimizer state."""
    for m in parts:
        for p in m.parameters():
            ledger.label(p, "param_shard")
            ledger.label(p.grad, "grad_shard")
        for b in m.buffers():
            ledger.label(b, "buffer")
    for state in (s for o in optimizer for s in o.state.values()):  # the torch optimizers of TorchTitan's container
        for v in state.values():
            if isinstance(v, torch.Tensor):
                ledger.label(v, "optimizer_state")


def label_pipeline(ledger: Ledger, schedule) -> None:
    """Label the pipeline stages' receive buffers, which torch's PipelineStage makes in the first step, one per
    microbatch for the stage's input and one for its output's gradient, and keeps across steps."""
    for stage in pipeline_stages(schedule):
        for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
            for info in infos:
                ledger.label(getattr(info, "buffer", None), "activation")


@contextmanager
def fsdp_labels(ledger: Ledger):
    """Label FSDP2's own storages where FSDP2 makes them: gathered parameters once unsharded, unsharded
    and sharded gradients around its post-backward (class-level hooks, removed on exit)."""
    # private_api: torch_fsdp_wait_for_unshard, torch_fsdp_post_backward, torch_fsdp_unsharded_param
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    wait, post = FSDPParamGroup.wait_for_unshard, FSDPParamGroup.post_backward

    def wait_for_unshard(self, *a, **k):
        out = wait(self, *a, **k)
        for fp in self.fsdp_params:
            for t in getattr(fp, "all_gather_outputs", None) or []:
                ledger.label(t, "param_gathered")
            ledger.label(getattr(fp, "_unsharded_param", None), "param_gathered")
        return out

    def post_backward(self, *a, **k):
        for fp in self.fsdp_params:
            p = getattr(fp, "_unsharded_param", None)
            ledger.label(p.grad if p is not None else None, "grad_unsharded")
            ledger.label(fp.unsharded_accumulated_grad, "grad_unsharded")
        out = post(self, *a, **k)
        for fp in self.fsdp_params:
            ledger.label(fp.unsharded_accumulated_grad, "grad_unsharded")
            ledger.label(fp.sharded_param.grad, "grad_shard")
        return out

    FSDPParamGroup.wait_for_unshard, FSDPParamGroup.post_backward = wait_for_unshard, post_backward
    try:
        yield
    finally:
        FSDPParamGroup.wait_for_unshard, FSDPParamGroup.post_backward = wait, post


def by_category(labels: dict[str, int]) -> dict[str, int]:
    """Fine labels summed into the report's categories."""
    return {cat: sum(labels[x] for x in fine) for cat, fine in CATEGORIES.items()}
