"""The plan's memory on V schedules' ranks beyond the first, and on the MoE recipes' last-stage ranks, against what the
dry run measured (the dry runs take minutes at recipe scale: their figures are recorded here, with the command and
date; these tests rehearse nothing). See runner/estimate/split_backward.py for what a split backward holds."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

from runner.estimate import dryrun_report, memory, pipeline_ranks, split_backward
from runner.schema import layout

DEEPSEEK = ["recipe=deepseek_v3_671b_h800x2048", "parallelism.pp_schedule=DualPipeV", "training.microbatch_size=1"]
"""The DeepSeek-V3 recipe's layout until 2026-12-05 (DualPipeV, 120 microbatches of 1), on which the figures below were
measured; the recipe now runs Interleaved1F1B, because this one does not fit (the last test)."""
HIDDEN = 2 * 7168 * 4096  # one bf16 hidden state of a 4,096-token microbatch
SMALL_V = [  # debug_moe in a DeepSeek-like V: pp 4 x 2 stages of 2 blocks, EP 2, full AC, 8 microbatches
    "model=debug_moe",
    "model.num_layers=14",
    "parallelism=ep2",
    "parallelism.name=pp4v",
    "parallelism.pp=4",
    "parallelism.pp_schedule=DualPipeV",
    "parallelism.pp_virtual_stages=2",
    "training.seq_len=256",
    "training.global_batch_size=16",
    "training.microbatch_size=1",
    "training.activation_checkpoint=full",
    "cluster=h100_node",
    "precision=bf16",
]


def _resolve(compose, overrides):
    cfg = compose(overrides)
    return cfg, layout.resolve(cfg.parallelism, cfg.cluster)


def test_dualpipev_actions_are_torchs():
    """The plan's DualPipeV action list, with each backward's kind, is torch's (ScheduleDualPipeV's own), on every rank:
    full backwards (B) first, then input halves (I) whose weight halves (W) torch runs from its queue."""
    from torch.distributed.pipelining import schedules as s

    kinds = {s.FORWARD: "F", s.FULL_BACKWARD: "B", s.BACKWARD_INPUT: "I", s.BACKWARD_WEIGHT: "W"}
    for pp, m in ((2, 4), (3, 7), (4, 8), (4, 13), (16, 120)):
        for rank in range(pp):
            ns = SimpleNamespace(pp_group_size=pp, _n_microbatches=m, num_stages=2 * pp)
            stages, got = (rank, 2 * pp - 1 - rank), []
            for a in filter(None, s.ScheduleDualPipeV._calculate_single_rank_operations(ns, rank)):
                for x in a.sub_actions if a.computation_type == s.OVERLAP_F_B else (a,):
                    got.append((stages.index(x.stage_index), kinds[x.computation_type]))
            assert list(pipeline_ranks.v_actions("DualPipeV", pp, m, rank)) == got, (pp, m, rank)
    # the V's bottom rank of the DeepSeek-V3 recipe defers 8 input halves per stage before its first W
    points = split_backward._w_points("DualPipeV", 16, 120, 15)
    assert points[0] == (1, 8, 8, 8, 7, False, True, True)


def test_deepseek_v_bottom_rank_matches_the_dry_run(compose):
    """DeepSeek-V3 on DualPipeV, rank 2047 (stages 15 and 16, two MoE blocks each). Measured 2026-12-05 on the CPU dry
    run (`python -m runner recipe=deepseek_v3_671b_h800x2048 parallelism.pp_schedule=DualPipeV
    training.microbatch_size=1 mode=dryrun 'dryrun.ranks=[2047]'`, 2 min 41 s at load ~2), GB at the peak, inside the
    first W of DualPipeV's tail: weights + gradients 10.64, activations 22.56, temporaries 89.40, peak 126.94. Before
    the runner ran each W inside one GraphExecGroup (runner.run.titan.weight_pass), W recomputed each block once per
    weight (16 per MoE block): temporaries 407.61, peak 445.94, 11 min at load ~4. The activations are 3 x 120 receive
    slots (the two from other ranks, and the first stage's outputs kept in the second's) and 24 hidden states of the 16
    microbatches whose W is pending; the temporaries the 120 input gradients kept likewise, 15 deferred I's weight-
    gradient inputs (3.29 GB each) and W's recompute of stage 16's 2 blocks; the gradients FSDP2's fp32 accumulation
    and W's bf16 ones (the plan holds the other stage's too: 7.7 % over)."""
    cfg, lay = _resolve(compose, DEEPSEEK)
    plan = dryrun_report.rehearsal_budget(cfg, lay, 15)
    assert plan["weights_grads"] == pytest.approx(10.64, rel=0.08)
    assert plan["activations"] == pytest.approx(22.56, rel=0.02)
    assert plan["temporaries"] == pytest.approx(89.40, rel=0.05)
    assert plan["total"] == pytest.approx(126.94, rel=0.05)
    assert pipeline_ranks.local_links(cfg, lay, 15) == 1 and pipeline_ranks.local_links(cfg, lay, 14) == 0
    assert plan["activations"] * 1e9 == pytest.approx((3 * 120 + 24) * HIDDEN)
    # a deferred I of one stage, 2 blocks (the CPU kernels' norms keep their weight-gradient input in fp32)
    assert 2 * split_backward.weight_grad_inputs(_cpu(cfg), lay, True, 4096) == pytest.approx(3_293_577_216, rel=0.01)
    # on the cluster's kernels the layout still outgrows an H800: the plan refuses it (docs/models.md); the CUDA
    # rehearsal of rank 2047 (the command above with dryrun.device=cuda, 12 min 36 s at load ~2, 2026-12-05) measured
    # a 98.84 GB peak (152 GB before the GraphExecGroup, in 35 min)
    assert memory.stage_gb(cfg, lay, 120, 15)["total"] == pytest.approx(98.84, rel=0.15)


def _cpu(cfg):
    from runner.schema import DeviceType

    cpu = copy.deepcopy(cfg)
    cpu.cluster.device = DeviceType.cpu
    return cpu


def test_small_v_layout_matches_its_dry_run(compose):
    """The same schedule on debug_moe (SMALL_V; `python -m runner <SMALL_V> mode=dryrun 'dryrun.ranks=[0,7]'`, 14 s,
    2026-12-05), GB at the peak: the V's bottom rank 7 activations 3,735,556 B, weights + gradients 142,141,440,
    temporaries 85,973,504, peak 381,215,716; rank 0 (the model's first and last stage) weights + gradients 60,777,984,
    peak 176,576,716. Before the GraphExecGroup (runner.run.titan.weight_pass) rank 7's W recomputed each block once per
    weight: temporaries 471,760,896, peak 776,217,060, and the step ran 592 all-to-alls where it now runs 280."""
    cfg, lay = _resolve(compose, SMALL_V)
    plan = {k: v * 1e9 for k, v in dryrun_report.rehearsal_budget(cfg, lay, 3).items() if k != "params"}
    assert plan["activations"] == pytest.approx(3_735_556, rel=0.05)
    assert plan["weights_grads"] == pytest.approx(142_141_440, rel=0.08)  # the other stage's bf16 gradients: 6.7 % over
    assert plan["temporaries"] == pytest.approx(85_973_504, rel=0.05)
    assert plan["total"] == pytest.approx(381_215_716, rel=0.05)
    first = {k: v * 1e9 for k, v in dryrun_report.rehearsal_budget(cfg, lay, 0).items() if k != "params"}
    assert first["weights_grads"] == pytest.approx(60_777_984, rel=0.02)
    assert first["total"] == pytest.approx(176_576_716, rel=0.1)


def test_qwen3_last_stage_rank_matches_the_dry_run(compose):
    """Qwen3-235B recipe, rank 1023 (pipeline rank 7: stages 7 and 15, the head's). Measured 2026-12-05 on the CPU dry run
    (`python -m runner recipe=qwen3_235b_a22b_h100x1024 mode=dryrun 'dryrun.ranks=[1023]'`, 3 min), GB at the peak:
    weights + gradients 28.41, optimizer 2.62, activations 8.87, temporaries 4.98, peak 45.34 (RoPE tables 0.46 of it,
    planned 0.23). Interleaved1F1B splits no backward: nothing to add."""
    cfg, lay = _resolve(compose, ["recipe=qwen3_235b_a22b_h100x1024"])
    plan = dryrun_report.rehearsal_budget(cfg, lay, 7)
    measured = {"weights_grads": 28.41, "optimizer": 2.62, "activations": 8.87, "temporaries": 4.98, "total": 45.34}
    for key, gb in measured.items():
        assert plan[key] == pytest.approx(gb, rel=0.02), key
    assert split_backward.w_points(cfg, lay, 32, 7) == ()


def test_microbatches_in_flight_is_what_the_memory_stage_holds(budget):
    """The plan's "microbatches in flight" is what its memory stage holds, its virtual stages' together: on DeepSeek-V3
    the V's bottom (17 of stage 15 and 16 of stage 16 at most), not 1F1B's pp (16)."""
    b = budget([*DEEPSEEK, "mode=plan"])
    assert b["memory_stage"] == 15 and b["microbatches_in_flight"] == 33
