"""profile.*: which steps and ranks are traced, the trace of a step, its split into the predictor's terms
(runner.outputs.breakdown), the allocator snapshot on OOM through the device policy, and the medians without the
traced steps. No process starts here; tests/test_train.py traces tp2_pp2 (and the span against metrics.jsonl) inside
its multirun."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from torch.profiler import ProfilerAction

from runner.outputs import breakdown
from runner.run import accounting, metrics, profiling
from runner.run.device import DevicePolicy
from runner.schema import ClusterConfig, DeviceType, DistributedConfig, ProfileConfig
from runner.schema.layout import Layout

A = ProfilerAction


def test_listed_steps_warm_up_first_and_every_n_follows_torch_schedule():
    listed = ProfileConfig(steps=[3, 4], warmup=1)
    assert [profiling.action(listed, s) for s in range(1, 6)] == [A.NONE, A.WARMUP, A.RECORD_AND_SAVE, A.RECORD_AND_SAVE, A.NONE]
    every = ProfileConfig(every=5, warmup=1, active=2)  # wait 2, warm up 1, record 2: steps 4 and 5 of each 5
    assert [s for s in range(1, 11) if profiling.action(every, s) == A.RECORD_AND_SAVE] == [4, 5, 9, 10]
    assert [s for s in range(1, 11) if profiling.profiled(every, s)] == [3, 4, 5, 8, 9, 10]
    assert not profiling.profiled(ProfileConfig(), 1) and not profiling.enabled(ProfileConfig())


def test_rank_zero_and_one_rank_of_each_pipeline_stage_trace_by_default():
    assert profiling.traced_ranks(ProfileConfig(), Layout(pp=2, dp_replicate=1, dp_shard=1, cp=1, tp=2)) == [0, 2]
    assert profiling.traced_ranks(ProfileConfig(), Layout(pp=4, dp_replicate=1, dp_shard=2, cp=1, tp=1)) == [0, 2, 4, 6]
    assert profiling.traced_ranks(ProfileConfig(), Layout(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=2)) == [0]
    assert profiling.traced_ranks(ProfileConfig(ranks=[3, 1]), Layout(1, 1, 2, 1, 2)) == [1, 3]


def test_a_collective_goes_to_the_axis_its_group_spans():
    lay = Layout(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=2)  # ranks (pp, dp_shard, tp): 0=(0,0,0) 1=(0,0,1) 2=(0,1,0) 4=(1,0,0)
    assert [profiling.axis_of_ranks(lay, 0, g) for g in ([0, 1], [0, 2], [0, 4], [0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7])] == [
        "tp",
        "dp",
        "pp",
        "host",
        "host",
    ]
    assert profiling.axis_of_ranks(Layout(1, 1, 2, 2, 1), 0, [0, 1, 2, 3]) == "dp"  # FSDP's dp_shard x cp group
    cp2 = Layout(1, 1, 1, 2, 1)  # FSDP shards over dp_shard x cp: its group is the CP ranks, and may be the same group
    fsdp = "torch.distributed.fsdp._fully_shard._fsdp_collectives"
    assert profiling.axis_of("mesh_fsdp", [0, 1], fsdp, cp2, 0) == "dp"
    assert profiling.axis_of("mesh_fsdp", [0, 1], "torch.distributed.tensor.experimental._attention", cp2, 0) == "cp"
    assert profiling.axis_of("mesh_tp", [0, 1], "torch.distributed.tensor._redistribute", lay, 0) == "tp"
    assert profiling.axis_of("", [0, 4], "torch.distributed.pipelining.schedules", lay, 0) == "pp"  # no mesh name: by ranks


def _x(name, ts, dur, tid=1, dims=None):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "args": {"Input Dims": dims or []}}


def _trace():
    """Step 7 of 1000 us on thread 1, with every kind of event once; thread 2's and gloo's own spans are not the step's."""
    tp = "runner.comm tp [0, 1] reduce_scatter_single"
    return {
        "traceEvents": [
            _x("ProfilerStep#7", 0, 1000),
            _x("runner/data_wait", 0, 20),
            _x("aten::mm", 20, 100),  # compute
            _x("aten::linear", 120, 60),  # a composite: its own 10 us are dispatch (overhead)
            _x("aten::mm", 125, 50),  # compute
            _x(tp, 180, 40),
            _x("_c10d_functional::reduce_scatter_tensor", 185, 30, dims=[[2, 8]]),  # tp
            _x("aten::mul", 220, 30),  # non_matmul
            _x("_c10d_functional::wait_tensor", 250, 50, dims=[[2, 8]]),  # waits for the tp output: tp
            _x("gloo:all_reduce", 250, 400),  # gloo's own span from issue to completion: overlaps, left out
            _x("runner/pp_wait", 300, 150),  # bubble
            _x("runner.comm pp [0, 2] batch_isend_irecv", 450, 10),  # pp
            _x("FSDP::pre_forward (layers.0)", 460, 40),  # dp, with its copy-in
            _x("aten::copy_", 470, 20),
            _x("runner/recompute", 500, 200),
            _x("aten::mm", 510, 100),  # recompute
            _x("runner.comm tp [0, 1] all_gather_single", 620, 30),  # tp, inside the recomputed forward
            _x("aten::add", 650, 50),  # recompute
            _x("BlockwiseFp8Matmul", 700, 60),  # a name no table knows: unattributed
            _x("aten::view", 760, 20),  # overhead
            _x("PythonDispatchMode", 780, 20),  # a TorchDispatchMode's Python around an op (observe/waits): overhead
            _x("aten::mul", 785, 10),  # non_matmul
            # 800..1000: no event: the framework's Python between ops (overhead)
            _x("aten::mm", 100, 500, tid=2),  # another thread: not the step's
        ]
    }


def test_a_step_is_split_into_the_predictors_terms_by_its_innermost_events():
    (step,) = breakdown.steps(_trace()).items()
    assert step[0] == 7
    got = {k: round(v * 1e6, 6) for k, v in step[1]["terms_s"].items() if v}
    assert got == {
        "data_wait": 20,
        "compute": 150,
        "overhead": 10 + 40 + 200 - 20 + 10,  # the dispatch mode covers 20 us of the gap, 10 of them its own
        "tp": 40 + 50 + 30,
        "non_matmul": 30 + 10,
        "bubble": 150,
        "pp": 10,
        "dp": 40,
        "recompute": 100 + 50 + 20,
        "unattributed": 60,
    }
    assert sum(step[1]["terms_s"].values()) == pytest.approx(step[1]["step_s"]) == pytest.approx(1e-3)
    assert step[1]["unattributed_top"] == {"BlockwiseFp8Matmul": pytest.approx(60e-6)}


def test_the_busiest_rank_is_the_one_with_most_working_time():
    def rank(compute, bubble):
        return {5: {"step_s": 1.0, "terms_s": dict.fromkeys(breakdown.TERMS, 0.0) | {"compute": compute, "bubble": bubble}}}

    out = breakdown.combine({0: rank(0.5, 0.5), 2: rank(0.8, 0.2)})
    assert (out["busiest_rank"], out["largest"], out["terms_s"]["compute"], out["steps"]) == (2, "compute", 0.8, [5])


class _CudaLike(DevicePolicy):
    """The device policy of a CUDA rank for the allocator's part only (a stub on CPU): history and snapshots."""

    calls: list = []

    @property
    def allocator_snapshots(self) -> bool:
        return True

    def record_allocator_history(self, max_entries: int) -> None:
        self.calls.append(("record", max_entries))

    def allocator_snapshot(self) -> dict:
        return {"segments": [{"address": 1, "total_size": 2 << 20}], "device_traces": [[{"action": "alloc", "size": 2 << 20}]]}


def test_an_out_of_memory_error_dumps_the_allocator_snapshot_through_the_policy(tmp_path, capsys):
    policy = _CudaLike(DeviceType.cuda, "nccl", True)
    session = profiling.Session(ProfileConfig(memory=True), Layout(1, 1, 1, 1, 1), 3, tmp_path, policy, 1)
    assert policy.calls == [("record", profiling.MAX_ENTRIES)] and session.prof is None  # no step traced: the history only
    with pytest.raises(torch.OutOfMemoryError), profiling.oom_dump(session.memory, 3):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    path = tmp_path / "profile" / "memory_snapshot_rank_3.pickle"
    assert pickle.loads(path.read_bytes()) == policy.allocator_snapshot()
    assert f"rank 3: out of memory; allocator snapshot {path}" in capsys.readouterr().out


def test_on_cpu_the_console_says_allocator_snapshots_are_cuda_only(tmp_path):
    policy = DevicePolicy.of(ClusterConfig(), DistributedConfig())
    assert profiling.Session(ProfileConfig(memory=True), Layout(1, 1, 1, 1, 1), 0, tmp_path, policy, 1).memory is None
    lines = profiling.console_lines(ProfileConfig(steps=[2], memory=True), Layout(2, 1, 1, 1, 2), tmp_path, policy)
    assert lines[0].startswith(f"profile: tracing steps 2 on ranks 0, 2 into {tmp_path}/profile/rank_<r>/step_<s>.json.gz; open")
    assert "https://ui.perfetto.dev (or chrome://tracing)" in lines[0]
    assert lines[1] == "profile.memory: allocator snapshots are CUDA-only; on CPU the traces carry profile_memory's allocation events"


def test_medians_leave_out_the_profiled_steps(compose):
    cfg = compose(["parallelism=single"])
    acc = accounting.Accounting(**{f: 1.0 for f in accounting.Accounting.__dataclass_fields__})
    times = enumerate([9, 1, 5, 2], 1)
    rows = [{"step": s, "loss": 1.0, "tokens_per_s": 1 / t, "step_time_s": t, "mfu": 0.1, "mfu_6n": 0.1} for s, t in times]
    rows[2]["profiled"] = True
    s = accounting.summarize(rows, cfg, Layout(1, 1, 1, 1, 1), acc)
    assert (s["step_time_s_median"], s["steps_profiled"]) == (1.5, 1)  # steps 2 and 4; step 3 was traced


def test_the_plan_check_line_sets_each_measured_term_beside_its_prediction():
    terms = dict.fromkeys(breakdown.TERMS, 0.0) | {"compute": 0.3, "tp": 0.2, "unattributed": 0.01}
    cal = {"terms_measured_s": terms, "terms_predicted_s": {"compute": 0.25, "tp": 0.1, "dp": 0.05}, "terms_measured_step_s": 0.51}
    line = metrics.terms_line(cal, {"busiest_rank": 2, "steps": [2]})
    assert line == (
        "plan check by term, measured/predicted s (ratio); busiest traced rank 2, steps [2], 0.510 s a step: "
        "compute 0.300/0.250 (1.20), tp 0.200/0.100 (2.00), dp 0.000/0.050 (0.00), unattributed 0.010"
    )
    alone = metrics.terms_line(cal | {"terms_predicted_s": None}, {"busiest_rank": 0, "steps": [2]})
    assert alone.endswith("0.510 s a step: compute 0.300, tp 0.200, unattributed 0.010")
    assert "no prediction without a machine profile" in alone


def test_bad_profile_settings_name_their_field(compose):
    from runner.config import validate

    with pytest.raises(validate.ConfigError) as e:
        validate.check(compose(["training.steps=4", "profile.steps=[5]", "profile.every=2", "profile.warmup=2", "profile.ranks=[4]"]))
    assert [(p.field, p.value) for p in e.value.problems] == [("profile.steps", [5]), ("profile.every", 2), ("profile.ranks", [4])]
    assert json.dumps(e.value.problems[0].why) == '"steps [5] are not steps of this run (1..4)"'


def test_fp8_cast_kernels_are_their_own_term_and_torchaos_gemms_compute():
    """profile/breakdown.json's fp8_cast: torchao's tensorwise and rowwise amax (abs, amax), the scale's reciprocal and
    its blockwise and MX quantization kernels; its blockwise GEMMs (Triton) and torch._scaled_mm are compute."""
    events = [
        _x("ProfilerStep#3", 0, 100),
        _x("aten::abs", 0, 10),
        _x("aten::amax", 10, 10),
        _x("aten::reciprocal", 20, 5),
        _x("torchao::triton_fp8_blockwise_act_quant_lhs", 25, 15),
        _x("torchao::triton_to_mxfp8_dim1", 40, 10),
        _x("torchao::triton_fp8_gemm_1x128_128x128", 50, 20),
        _x("torchao::blockwise_scaled_mm", 70, 10),
        _x("aten::_scaled_mm", 80, 20),
    ]
    (step,) = breakdown.steps({"traceEvents": events}).values()
    assert {k: round(v * 1e6, 6) for k, v in step["terms_s"].items() if v} == {"fp8_cast": 50, "compute": 50}
