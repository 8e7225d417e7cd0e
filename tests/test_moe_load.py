"""The experts' load (runner.observe.moe_load, runner.run.expert_load), in-process with hand-made token counts; and
TorchTitan's expert-bias update evening the load it measures, on debug_moe's MoE block (issue 56 item 3)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from runner.observe import moe_load
from runner.run import expert_load, titan
from runner.schema import MoeLoadConfig
from runner.schema.layout import Layout

BALANCED = [100, 96, 104, 100, 98, 102, 100, 100]  # 8 experts, 800 tokens: max/mean 1.04


def _judge(ep: int = 2, **cfg) -> moe_load.HotExpertJudge:
    return moe_load.HotExpertJudge(MoeLoadConfig(**cfg), ep)


def test_summary_of_a_window():
    """Tokens per expert as ints, max/mean, the busiest EP rank's share (experts 0-3 on rank 0, 4-7 on rank 1), the dead."""
    hot = [300, 100, 100, 100, 0, 100, 50, 50]
    got = moe_load.summarize([1, 2], [BALANCED, hot], ep=2, steps=3)
    assert got == {
        "steps": 3,
        "layers": [1, 2],
        "tokens": [BALANCED, hot],
        "max_mean": [1.04, 3.0],
        "ep_share": [0.5, 0.75],
        "dead": [[2, 4]],
    }
    assert "ep_share" not in moe_load.summarize([1], [BALANCED], ep=1, steps=1)
    keys = moe_load.wandb_keys(got)
    assert keys == {
        "moe/max_mean": 3.0,
        "moe/dead_experts": 1,
        "moe/layer1_max_mean": 1.04,
        "moe/layer2_max_mean": 3.0,
        "moe/layer1_ep_share": 0.5,
        "moe/layer2_ep_share": 0.75,
    }


def test_a_clean_run_flags_nothing():
    judge = _judge()
    assert all(judge.update(s, s, [1, 2], [BALANCED, BALANCED[::-1]]) == [] for s in range(1, 20))


def test_a_hot_expert_is_named_once_after_three_windows_with_its_start():
    """Expert 5 of layer 3 takes 2.4 x the mean from step 11 on: named at the third window (steps 11-20, 21-30, 31-40),
    once; it recovers at 41-50, and a new streak starts over."""
    judge = _judge(ep=4)
    hot = [70, 70, 70, 70, 100, 240, 70, 110]  # mean 100; rank 2 (experts 4, 5) holds 42.5 %
    assert judge.update(1, 10, [3], [BALANCED]) == []
    assert judge.update(11, 20, [3], [hot]) == []
    assert judge.update(21, 30, [3], [hot]) == []
    found = judge.update(31, 40, [3], [hot])
    assert [(f["kind"], f["layer"], f["expert"], f["ep_rank"], f["since_step"], f["windows"]) for f in found] == [
        ("hot_expert", 3, 5, 2, 11, 3),
        ("hot_ep_rank", 3, None, 2, 11, 3),  # 42.5 % > 1.25 x 25 %
    ]
    assert found[0]["share"] == pytest.approx(0.3) and found[0]["load"] == pytest.approx(2.4)
    assert moe_load.describe(found[0]) == (
        "moe load: layer 3 expert 5 (EP rank 2) hot: 30.0 % of the layer's tokens, 2.40 x the mean expert's, since step 11 (3 windows)"
    )
    assert moe_load.describe(found[1]) == (
        "moe load: layer 3 EP rank 2 hot: 42.5 % of the layer's tokens (fair 25.0 %), since step 11 (3 windows)"
    )
    assert judge.update(41, 50, [3], [hot]) == []  # named already
    assert judge.update(51, 60, [3], [BALANCED]) == []  # recovered
    assert judge.update(61, 70, [3], [hot]) == judge.update(71, 80, [3], [hot]) == []
    assert [f["since_step"] for f in judge.update(81, 90, [3], [hot])] == [61, 61]


def test_a_dead_expert_and_a_window_too_small_to_judge():
    """Expert 0 of layer 1 receives no token for three windows: named dead. A window of under min_tokens tokens per
    expert is not judged and breaks no streak."""
    judge = _judge(ep=1)
    dead = [0, 114, 114, 114, 114, 114, 115, 115]
    few = [0, 2, 2, 2, 2, 2, 2, 4]
    assert judge.update(1, 1, [1], [dead]) == []
    assert judge.update(2, 2, [1], [few]) == []
    assert judge.update(3, 3, [1], [dead]) == []
    found = judge.update(4, 4, [1], [dead])
    assert [(f["kind"], f["expert"], f["since_step"], f["windows"]) for f in found] == [("dead_expert", 0, 1, 3)]
    assert moe_load.describe(found[0]) == "moe load: layer 1 expert 0 (EP rank 0) dead: no token since step 1 (3 windows)"


class _Moe(torch.nn.Module):
    """TorchTitan's MoE bookkeeping only: the counts buffer and the balancing coefficient."""

    def __init__(self, experts: int, coeff: float | None):
        super().__init__()
        self.load_balance_coeff = coeff
        self.register_buffer("tokens_per_expert_E", torch.zeros(experts))


class _Block(torch.nn.Module):
    def __init__(self, experts: int, coeff: float | None):
        super().__init__()
        self.moe_enabled, self.moe = True, _Moe(experts, coeff)


def _stage(ids: list[int], experts: int = 4, coeff: float | None = 1e-3) -> torch.nn.Module:
    part = torch.nn.Module()
    part.layers = torch.nn.ModuleDict({str(i): _Block(experts, coeff) for i in ids})
    return part


def test_a_stage_adds_its_windows_counts_at_its_layers_rows(tmp_path):
    """Pipeline stage 1 holds MoE layers 3 and 4 of 2, 3, 4: its summands put its window (two steps) at rows 2 and 3 of
    the 3 x 4 table; without balancing the counts are zeroed each step (nothing else does), with it they stay for the
    optimizer's pre-hook."""
    part = _stage([3, 4], coeff=None)
    cfg = SimpleNamespace(
        model=SimpleNamespace(num_experts=4),
        logging=SimpleNamespace(log_every=2),
        training=SimpleNamespace(steps=10),
        monitor=SimpleNamespace(moe_load=MoeLoadConfig()),
    )
    policy = SimpleNamespace(all_gather_object=lambda ids: [[2], ids])
    load = expert_load.ExpertLoad(cfg, Layout(pp=2, dp_replicate=1, dp_shard=1, cp=1, tp=1), 1, policy, [part], tmp_path)
    assert load.layers == [2, 3, 4]
    for step in (1, 2):
        for k, (_, block) in enumerate(titan.moe_blocks([part])):
            block.moe.tokens_per_expert_E += torch.tensor([1.0, 2.0, 3.0, 4.0]) * (k + 1)
        window = load.collect(step)
    assert [b.moe.tokens_per_expert_E.sum().item() for _, b in titan.moe_blocks([part])] == [0.0, 0.0]
    values = torch.cat([w.reshape(-1) for w in window]).tolist()
    assert load.summands(2, values) == [0.0] * 4 + [2.0, 4.0, 6.0, 8.0] + [4.0, 8.0, 12.0, 16.0]
    assert load.summands(3, []) == []  # not a logged step: nothing added to the exchange
    tp_peer = expert_load.ExpertLoad(cfg, Layout(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=2), 1, policy, [part], tmp_path)
    assert tp_peer.summands(2, values) == [0.0] * 12  # TP rank 1 counts the tokens TP rank 0 adds (no EP)
    got = load.row(2, load.summands(2, values))
    assert got["moe"]["steps"] == 2 and got["moe"]["tokens"][1] == [2, 4, 6, 8]
    balanced = _stage([1], coeff=1e-3)
    counts = titan.take_counts(titan.moe_blocks([balanced]))
    assert balanced.layers["1"].moe.tokens_per_expert_E is not counts  # a copy: the pre-hook's own stay


def test_the_judges_findings_reach_moe_load_jsonl(tmp_path, capsys):
    path = tmp_path / "moe_load.jsonl"
    f = {"kind": "dead_expert", "layer": 1, "expert": 0, "ep_rank": 0, "share": 0.0, "load": 0.0, "step": 4}
    moe_load.record(path, [f | {"since_step": 1, "windows": 3}])
    assert json.loads(path.read_text())["since_step"] == 1
    assert capsys.readouterr().out == "moe load: layer 1 expert 0 (EP rank 0) dead: no token since step 1 (3 windows)\n"


def _debug_moe_block(compose, coeff: float):
    """(this rank's model part holding debug_moe's first MoE block, alone, and its optimizer): the block as the runner
    configures it (runner.run.titan.build.model_config: model.load_balance_coeff, the CPU's float32 experts), TorchTitan's
    initialization, and the optimizer pre-hook the runner registers from TorchTitan's spec (the expert-bias update).
    The optimizer's rate is 0: only the bias moves, so what changes the routing is the update under test."""
    import importlib

    from runner.schema import layout

    build = importlib.import_module("runner.run.titan.build")
    cfg = compose(["model=debug_moe", "parallelism=single", f"model.load_balance_coeff={coeff}"])
    spec, *_ = build.model_config(cfg, layout.resolve(cfg.parallelism, cfg.cluster))
    torch.manual_seed(0)
    block = torch.nn.Module()
    block.moe_enabled, block.moe = True, spec.model.layers[cfg.model.num_dense_layers].moe.build()
    with torch.no_grad():
        block.moe.init_states(buffer_device=None)
    part = torch.nn.Module()
    part.layers = torch.nn.ModuleDict({str(cfg.model.num_dense_layers): block})
    opt = torch.optim.SGD(block.moe.parameters(), lr=0.0)
    one_rank = SimpleNamespace(ep_enabled=False, tp=1, get_optional_mesh=lambda name: None)
    built = SimpleNamespace(post_optimizer_build_fn=spec.post_optimizer_build_fn, parts=[part], parallel_dims=one_rank)
    titan.register_optimizer_hooks(built, opt)
    return part, opt


def _measured_max_mean(part, opt, windows: list[int]) -> list[float]:
    """Route a batch of 2 x 128 hidden states a step (random, around a common direction, as a trained model's are),
    read the counts as the step loop does (titan.take_counts) before the optimizer step, and summarize each window of
    `windows` steps as metrics.jsonl's `moe` does: its max/mean."""
    blocks = titan.moe_blocks([part])
    g = torch.Generator().manual_seed(1)
    shared = torch.randn(256, generator=g)
    out = []
    for size in windows:
        window = torch.zeros(1, 8)
        for _ in range(size):
            with torch.no_grad():
                blocks[0][1].moe(torch.randn(2, 128, 256, generator=g) + 3 * shared / shared.norm())
            window += titan.take_counts(blocks)
            opt.step()
        out.append(moe_load.summarize([1], window.tolist(), ep=1, steps=size)["max_mean"][0])
    return out


def test_the_bias_update_evens_the_measured_expert_load(compose):
    """debug_moe's MoE block (8 experts, top 3) routes the same batches twice from the same seed. Step 1 (no bias yet)
    loads its busiest expert at ~1.4 x the mean either way. With TorchTitan's expert-bias update on
    (model.load_balance_coeff, its 0.001) the measured max/mean falls window by window; off (0) it stays."""
    windows = [1, 5, 5, 5, 5]
    on = _measured_max_mean(*_debug_moe_block(compose, 0.001), windows)
    off = _measured_max_mean(*_debug_moe_block(compose, 0.0), windows)
    assert on[0] == off[0] > 1.25, (on, off)  # step 1: the same routing, no bias yet
    assert on[-1] < on[0] - 0.2 and on[-1] < 1.15, on  # the bias pushes tokens off the busiest experts
    assert min(off) > 1.25, off  # no update: the imbalance stays
