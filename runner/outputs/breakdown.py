"""A traced step's time split into the predictor's terms (runner/estimate/predict/steptime.py), from its Chrome trace.

Read from the step's `ProfilerStep#<s>` span on the thread that ran it (on CPU the ranks compute there; autograd's
CPU backward runs on the calling thread). Every microsecond of the span goes to exactly one term, by the innermost
event covering it (its self time):
- compute: GEMMs and attention kernels (COMPUTE);
- recompute: the ops of the forward that activation checkpointing runs again inside backward (torch.utils.checkpoint's
  recompute, named `runner/recompute` in the trace by runner.run.profiling); its collectives stay their axis's;
- non_matmul: every other ATen op: elementwise, norms, the loss, copies, the optimizer's fused kernel;
- fp8_cast: an FP8 recipe's scale and cast kernels by name (FP8_CAST: the amax reductions, torchao's own
  quantization ops); the float8 conversion itself (`aten::_to_copy`) and the clamp before it keep non_matmul, their
  names being those of every dtype conversion (gpt-oss's SwiGLU clamps too);
- fp8_amax: the amax all-reduces are collectives on the TP group, so they count as tp in a trace;
- tp, pp, cp, ep, dp: collectives, by the process group each ran on: the runner names each collective call in the
  trace (`runner.comm <axis> [<ranks>] <op>`, runner.run.profiling) with its group's ranks; a functional
  collective's later `wait_tensor` goes to the axis of the collective whose output it waits for; FSDP's own spans
  (its copy-in/out around the gathers and reduce-scatters) count as dp;
- bubble: pipeline idle: the schedule's waits for its sends and receives (`runner/pp_wait`), which on one host also
  hold the transfers themselves (a host trace cannot tell them apart; pp keeps the P2P calls' own time);
- data_wait: the step's wait for its batch (`runner/data_wait`);
- overhead: what the trace shows outside those: view and metadata ops, DTensor's and autograd's dispatch spans,
  the runner's host collectives, and the framework's Python time between ops (no event covers it);
- unattributed: events the tables here do not know. A large share means the tables miss an op.
Torch-free: it reads JSON (gzip) only.
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

AXES = ("tp", "pp", "cp", "ep", "dp")
TERMS = (
    "compute",
    "non_matmul",
    "recompute",
    "overhead",
    "bubble",
    "tp",
    "pp",
    "cp",
    "ep",
    "dp",
    "fp8_cast",
    "fp8_amax",
    "data_wait",
    "unattributed",
)
STEP_SPAN = re.compile(r"ProfilerStep#(\d+)$")
COMM_SPAN = "runner.comm"
DATA_SPAN = "runner/data_wait"
PP_WAIT_SPAN = "runner/pp_wait"  # runner.run.profiling: the pipeline schedule waits for its sends and receives
RECOMPUTE_SPAN = "runner/recompute"  # runner.run.profiling: torch.utils.checkpoint runs a block's forward again

SPANS = {DATA_SPAN: "data_wait", PP_WAIT_SPAN: "bubble", RECOMPUTE_SPAN: "recompute"}  # the runner's own spans and their terms
COMPUTE = re.compile(
    r"(aten::(mm|addmm|bmm|baddbmm|_scaled_mm|_grouped_mm|_scaled_grouped_mm|_int_mm|"
    r"_scaled_dot_product_\w+|_flash_attention_\w+|_efficient_attention_\w+|_cudnn_attention_\w+)|"
    r"torchao::(\w*_gemm_\w+|blockwise_scaled_mm))$"
)
"""GEMMs and attention: ATen's, and torchao's blockwise FP8 GEMMs (Triton, torchao 0.18: triton_fp8_gemm_1x128_128x128,
triton_fp8_gemm_1x128_128x1, blockwise_scaled_mm), matched before FP8_CAST."""
FP8_CAST = re.compile(r"(aten::(amax|abs|reciprocal)|torchao::\w+)$")
"""Ops that only an FP8 recipe's scaling issues in a training step (torchao's tensorwise amax is abs then max, rowwise
amax; its blockwise and MX casts are torchao custom ops: triton_fp8_blockwise_*_quant_*, triton_to_mxfp8_dim0/1,
mxfp8_quantize)."""
METADATA = re.compile(
    r"aten::(view|_unsafe_view|view_as|as_strided|reshape|_reshape_alias|t|transpose|permute|slice|narrow|select|expand|"
    r"expand_as|unsqueeze|squeeze|split|split_with_sizes|chunk|unbind|tensor_split|detach|detach_|alias|empty|empty_strided|"
    r"empty_like|resolve_conj|resolve_neg|_conj|lift_fresh|contiguous|to|result_type|item|_local_scalar_dense|linear|matmul|"
    r"scaled_dot_product_attention|view_as_real|view_as_complex|_has_compatible_shallow_copy_type|is_same_size|size|stride|"
    r"numel|dim|set_|_to_dense|_nested_tensor_from_mask_left_aligned)$"
)
DISPATCH = re.compile(
    r"(autograd::engine::evaluate_function: .*|.*Backward\d*|torch::autograd::.*|PythonSubclass|PythonDispatchMode|Redistribute|"
    r"NestedRedistribute|"
    r"_FromTorchTensor|_ToTorchTensor|Optimizer\..*|detach|_c10d_functional::_wrap_tensor_autograd|aten::_foreach_\w*\.?\w*_?zero_|"
    r"record_param_comms|cudaLaunchKernel|cudaMemcpyAsync|cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventRecord)$"
)
COMM_OP = re.compile(r"(c10d::|_c10d_functional::|gloo:|nccl:|c10d_functional::)")
ASYNC = re.compile(r"(gloo|nccl):")  # the backend's own spans: on gloo from issue to completion, overlapping the thread's ops


@dataclass
class _Event:
    name: str
    ts: float
    dur: float
    dims: Any = None
    kids: list[_Event] = field(default_factory=list)

    @property
    def end(self) -> float:
        return self.ts + self.dur

    def self_time(self) -> float:
        return max(0.0, self.dur - sum(k.dur for k in self.kids))


def load(path: Path) -> dict[str, Any]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _tree(events: list[dict[str, Any]], span: dict[str, Any]) -> list[_Event]:
    """The events of the span's thread inside it, nested by time (a child starts before its parent ends)."""
    start, end = span["ts"], span["ts"] + span["dur"]
    mine = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("tid") == span["tid"] and e is not span and start <= e["ts"] < end and not ASYNC.match(e["name"])
    ]
    mine.sort(key=lambda e: (e["ts"], -e["dur"]))
    roots: list[_Event] = []
    stack: list[_Event] = []
    for e in mine:
        node = _Event(e["name"], e["ts"], min(e["dur"], end - e["ts"]), (e.get("args") or {}).get("Input Dims"))
        while stack and stack[-1].end <= node.ts:
            stack.pop()
        if stack:
            node.dur = min(node.dur, stack[-1].end - node.ts)
            stack[-1].kids.append(node)
        else:
            roots.append(node)
        stack.append(node)
    return roots


@dataclass
class _Walk:
    terms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TERMS, 0.0))
    pending: list[tuple[str, str]] = field(default_factory=list)  # (output dims, axis) of functional collectives not yet waited
    last_axis: str = "unattributed"
    unknown: dict[str, float] = field(default_factory=dict)


def _comm_axis(name: str) -> str:
    """`runner.comm <axis> [<ranks>] <op>` -> its term: a mesh axis, or overhead for the runner's own host collectives."""
    axis = name.split(" ", 2)[1]
    return axis if axis in AXES else "overhead"


def _by_name(e: _Event, w: _Walk) -> str:
    """The term of an event's self time from its name alone."""
    n = e.name
    if n.endswith("wait_tensor"):
        key = json.dumps(e.dims[0] if e.dims else None)
        for i, (dims, axis) in enumerate(w.pending):
            if dims == key:
                del w.pending[i]
                return axis
        return w.last_axis
    if COMPUTE.match(n):
        return "compute"
    if FP8_CAST.match(n):
        return "fp8_cast"
    if METADATA.match(n) or DISPATCH.match(n):
        return "overhead"
    if COMM_OP.match(n):
        return w.last_axis
    if n.startswith("aten::"):
        return "non_matmul"
    w.unknown[n] = w.unknown.get(n, 0.0) + e.self_time()
    return "unattributed"


def _context(name: str, ctx: str | None) -> str | None:
    """The term an event imposes on everything under it (a collective's axis also inside a recomputed forward)."""
    if ctx not in (None, "recompute"):
        return ctx
    if name.startswith(COMM_SPAN + " "):
        return _comm_axis(name)
    if ctx is not None:
        return ctx
    return {DATA_SPAN: "data_wait", PP_WAIT_SPAN: "bubble", RECOMPUTE_SPAN: "recompute"}.get(
        name, "dp" if name.startswith("FSDP::") else None
    )


def _visit(e: _Event, ctx: str | None, w: _Walk) -> None:
    sub = _context(e.name, ctx)
    term = _by_name(e, w) if sub in (None, "recompute") and e.name not in SPANS else sub
    if sub == "recompute" and term in ("compute", "non_matmul", "overhead"):
        term = "recompute"
    if e.name.startswith(COMM_SPAN + " "):
        w.last_axis = term
    # private_api: torch_c10d_functional_ops, torch_wrap_tensor_autograd
    if e.name.startswith("_c10d_functional::") and not e.name.endswith(("wait_tensor", "_wrap_tensor_autograd")) and sub in AXES:
        w.pending.append((json.dumps(e.dims[0] if e.dims else None), sub))
    w.terms[term] += e.self_time()
    for k in e.kids:
        _visit(k, sub, w)


def steps(trace: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Each traced step of one rank's trace: its span in seconds, its terms in seconds (they add up to the span) and the
    names behind the unattributed time."""
    events = trace["traceEvents"]
    out = {}
    for span in events:
        m = STEP_SPAN.match(span.get("name", ""))
        if not m or span.get("ph") != "X":
            continue
        roots = _tree(events, span)
        w = _Walk()
        for r in roots:
            _visit(r, None, w)
        w.terms["overhead"] += max(0.0, span["dur"] - sum(r.dur for r in roots))  # Python between ops: no event covers it
        unknown = sorted(w.unknown.items(), key=lambda kv: -kv[1])[:5]
        out[int(m.group(1))] = {
            "step_s": span["dur"] / 1e6,
            "terms_s": {k: v / 1e6 for k, v in w.terms.items()},
            "unattributed_top": {k: v / 1e6 for k, v in unknown},
        }
    return out


def busy_s(step: dict[str, Any]) -> float:
    """A rank's working time in a step: its span less pipeline idle and the wait for data."""
    t = step["terms_s"]
    return step["step_s"] - t["bubble"] - t["data_wait"]


def combine(per_rank: dict[int, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """breakdown.json: per traced step every traced rank's terms, and the busiest rank's (most working time, summed over
    the traced steps) terms averaged over the steps, beside its step time in metrics.jsonl (`step_time_s_metrics`)."""
    ranks = sorted(r for r, s in per_rank.items() if s)
    if not ranks:
        return {}
    busiest = max(ranks, key=lambda r: sum(busy_s(s) for s in per_rank[r].values()))
    mine = per_rank[busiest]
    n = len(mine)
    terms = {k: sum(s["terms_s"][k] for s in mine.values()) / n for k in TERMS}
    span = sum(s["step_s"] for s in mine.values()) / n
    measured = [s["step_time_s_metrics"] for s in mine.values() if s.get("step_time_s_metrics") is not None]
    return {
        "busiest_rank": busiest,
        "steps": sorted(mine),
        "step_s": span,
        "step_time_s_metrics": sum(measured) / len(measured) if measured else None,
        "terms_s": terms,
        "unattributed_share": terms["unattributed"] / span if span else None,
        "largest": max((k for k in TERMS if k != "unattributed"), key=terms.get),
        "ranks": {str(r): {str(s): v for s, v in per_rank[r].items()} for r in ranks},
    }
