"""The routed experts in FP8 (precision.experts): the CPU emulation against torchao's own references, the conversion on
each path (TorchTitan's converters on GPU, the emulation on CPU), the validation rules, the planner's pricing, and the
proof that an MoE model with float8 rowwise experts tracks its float32 loss."""

from __future__ import annotations

import pytest
import torch

from runner.config import validate
from runner.estimate import precision
from runner.run import titan
from runner.run.titan import fp8_emulation as fe
from tests import in_process

E4M3 = torch.float8_e4m3fn
MOE = ["model=debug_moe", "parallelism=single"]
FP8_EXPERTS = "precision.experts=fp8_rowwise"
H100 = ["cluster=h100_node", "parallelism=fsdp", "training.global_batch_size=16"]


def test_rowwise_scales_are_torchaos_own():
    """Every operand of the emulated expert GEMM equals what torchao's PyTorch references of its Triton kernels give
    (dequantized): W scaled per input column for grad_x (torch_to_3d_rowwise_float8_transpose_rhs), x and dy per column
    over the group's tokens for grad_W (torch_to_float8_per_group_colwise); scales are powers of two."""
    from torchao.prototype.moe_training import utils

    torch.manual_seed(0)
    x, w = torch.randn(48, 64) * 3, torch.randn(32, 64)
    q, s = utils.torch_to_3d_rowwise_float8_transpose_rhs(w.t().unsqueeze(0), E4M3, round_scales_to_power_of_2=True)
    assert torch.equal(fe.fake_rowwise(w, 0), (q[0].float() / s[0]))  # (N, K) / (1, K)
    q, s = utils.torch_to_float8_per_group_colwise(x, torch.tensor([48], dtype=torch.int32), E4M3, round_scales_to_power_of_2=True)
    assert torch.equal(fe.fake_rowwise(x, 0), q.float() / s[None, :])
    assert torch.equal(torch.log2(s), torch.log2(s).round())  # power-of-two scales, as the GPU kernels are called


def test_expert_matmul_quantizes_every_operand():
    torch.manual_seed(0)
    x = torch.randn(40, 64, requires_grad=True)
    w = torch.randn(96, 64, requires_grad=True)
    dy = torch.randn(40, 96)
    out = fe.RowwiseFp8ExpertMatmul.apply(x, w)
    out.backward(dy)
    xd, wd = x.detach(), w.detach()
    assert torch.equal(out, fe.fake_rowwise(xd, -1) @ fe.fake_rowwise(wd, -1).t())
    assert torch.equal(x.grad, fe.fake_rowwise(dy, -1) @ fe.fake_rowwise(wd, 0))
    assert torch.equal(w.grad, fe.fake_rowwise(dy, 0).t() @ fe.fake_rowwise(xd, 0))
    exact = xd @ wd.t()
    err = ((out - exact).norm() / exact.norm()).item()
    assert 1e-3 < err < 0.06  # e4m3 keeps 3 mantissa bits: a few percent, never exact
    empty = fe.RowwiseFp8ExpertMatmul.apply(torch.zeros(0, 64, requires_grad=True), w)  # an expert no token reached
    assert empty.shape == (0, 96)


def _moe_config(cfg):
    return titan.model_spec(cfg.model).model


def test_cpu_converts_every_moe_blocks_experts_to_the_emulation(compose):
    from torchtitan.models.common.moe import GroupedExperts

    cfg = compose([*MOE, FP8_EXPERTS])
    mcfg = _moe_config(cfg)
    converted = titan.convert_experts(mcfg, cfg)
    assert converted == precision.converted_experts(cfg) == [f"layers.{i}.moe.routed_experts.inner_experts" for i in range(1, 6)]
    kinds = {type(c).__qualname__ for _, c, _, _ in mcfg.traverse(GroupedExperts.Config)}
    assert kinds == {"_cpu_fp8_grouped_experts.<locals>.EmulatedFp8RowwiseGroupedExperts.Config"}
    assert titan.convert_experts(mcfg, cfg, materialize=False) == []  # the dry run's fake tensors: not converted
    high = compose(MOE)
    assert titan.convert_experts(_moe_config(high), high) == [] and precision.grouped_experts(high) is None


@pytest.mark.parametrize("experts,module,pad", [("fp8_rowwise", "Float8GroupedExperts", 16), ("mxfp8", "MXFP8GroupedExperts", 128)])
def test_gpu_path_is_titans_grouped_experts_converter(compose, monkeypatch, experts, module, pad):
    """On a CUDA cluster TorchTitan's own converter swaps the experts and the token dispatcher (TorchAOTokenDispatcher,
    groups padded to the table's token_pad); on this CPU machine its capability check refuses, in upstream's words."""
    from torchtitan.components.quantization import float8, mx
    from torchtitan.models.common.token_dispatcher import TorchAOTokenDispatcher

    cluster = H100 if experts == "fp8_rowwise" else ["cluster=b200_node", "parallelism=fsdp", "training.global_batch_size=16"]
    cfg = compose([*cluster, "model=debug_moe", f"precision.experts={experts}"])
    words = "Float8 MoE training only supported on NVIDIA SM89" if experts == "fp8_rowwise" else "MXFP8 is only supported on SM100"
    with pytest.raises(ValueError, match=words):
        titan.convert_experts(_moe_config(cfg), cfg)
    monkeypatch.setattr(float8 if experts == "fp8_rowwise" else mx, "has_cuda_capability", lambda *_: True)
    mcfg = _moe_config(cfg)
    assert titan.convert_experts(mcfg, cfg) == precision.converted_experts(cfg)
    routed = mcfg.layers[1].moe.routed_experts
    assert type(routed.inner_experts)._owner.__name__ == module
    assert isinstance(routed.token_dispatcher, TorchAOTokenDispatcher.Config) and routed.token_dispatcher.pad_multiple == pad
    if experts == "fp8_rowwise":
        assert float8.Float8GroupedExpertsConverter.PAD_MULTIPLE == precision.EXPERT_RECIPES[cfg.precision.experts].token_pad


BAD = [
    (["precision.experts=fp8_rowwise"], "precision.experts = fp8_rowwise: model llama3 debugmodel is dense: it has no routed experts. "
     "Fix: set precision.experts=high, or train an MoE model"),
    ([*MOE, "precision.experts=mxfp8"], "precision.experts = mxfp8: needs NVIDIA SM 10.0+ (Blackwell B200/GB200): its E8M0-scaled "
     "grouped GEMMs exist only there, and the runner has no CPU emulation of them. Fix: use precision.experts=fp8_rowwise"),
    ([*H100, "model=debug_moe", "precision.experts=mxfp8"], "precision.experts = mxfp8: needs NVIDIA SM 10.0+ (Blackwell B200/GB200); "
     "cluster h100_node has SM 9.0. Fix: use precision.experts in ['high', 'fp8_rowwise'] or a newer cluster"),
    ([*H100, "model=debug_moe", FP8_EXPERTS, "cluster.compute_capability='8.0'"], "precision.experts = fp8_rowwise: needs NVIDIA SM 8.9+"),
    ([*MOE, FP8_EXPERTS, "model.moe_hidden_dim=200"], "precision.experts = fp8_rowwise: the experts' grouped GEMMs multiply model.dim "
     "256 by model.moe_hidden_dim 200; fp8_rowwise needs every dim divisible by 16, not [200]"),
]  # fmt: skip


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_validation_rejects_experts_precision(refusal, overrides, message):
    assert message in refusal(overrides)


def test_tp_shards_the_experts_hidden_dim_only_without_ep(compose):
    tp = ["model=debug_moe", FP8_EXPERTS, "model.moe_hidden_dim=160", "parallelism.dp_shard=1", "parallelism.tp=4"]
    with pytest.raises(
        validate.ConfigError, match=r"model.moe_hidden_dim 160 / tp 4; fp8_rowwise needs every dim divisible by 16, not \[40\]"
    ):
        validate.check(compose(tp))
    assert validate.check(compose([*MOE, FP8_EXPERTS, "model.moe_hidden_dim=160"])).tp == 1


def test_cli_refuses_experts_on_a_dense_model_with_exit_2(monkeypatch, capsys, tmp_path):
    code, err = in_process.cli(monkeypatch, capsys, FP8_EXPERTS, f"hydra.run.dir={tmp_path / 'r'}")
    assert code == 2 and "Traceback" not in err
    assert "precision.experts = fp8_rowwise: model llama3 debugmodel is dense" in err and "Fix: set precision.experts=high" in err
    assert not (tmp_path / "r").exists()


def test_plan_prices_the_experts_gemms_and_casts(compose):
    """DeepSeek-V3's recipe with its experts in float8 rowwise against the same in bf16: the routed GEMMs' time moves
    to the float8 rate (compute falls), their casts appear in fp8_cast (8 B per element of x, W and dy of every grouped
    GEMM, a recomputed forward's x and W again), the plan and mode=validate say it."""
    from runner.estimate import plan
    from runner.estimate.predict import steptime, work
    from runner.estimate.predict.machine import datasheet

    fp8 = compose(["recipe=deepseek_v3_671b_h800x2048"])
    high = compose(["recipe=deepseek_v3_671b_h800x2048", "precision.experts=high"])
    assert fp8.precision.experts.value == "fp8_rowwise"
    lay = validate.check(fp8)
    a, b = steptime.predict(fp8, lay), steptime.predict(high, lay)
    m, n = fp8.model, work.tokens(fp8, lay)
    gemms = work.routed_gemms(fp8, lay, n)
    assert gemms[0] == (n * 8 * 64 // 256, 7168, 2048) and len(gemms) == 3 * 4  # 4 local experts (256 / ep 64)
    share = (m.num_layers - m.num_dense_layers) / m.num_layers
    elements = sum(x * k + k * nn + x * nn + (x * k + k * nn) / 2 for x, k, nn in gemms)  # full recomputation: share 1
    mach = datasheet(fp8, None, None, None)
    one = steptime._fp8_experts(fp8, lay, mach, 1.0)  # one mean block, one microbatch
    assert one.fp8_cast == pytest.approx(share * 8.0 * elements / (mach.memory_gbs * 1e9), rel=1e-9)
    assert one.compute < 0 and one.recompute == pytest.approx(one.compute / 3)  # faster GEMMs: forward once more under full AC
    assert a.terms["fp8_cast"] > b.terms["fp8_cast"] and a.terms["compute"] < b.terms["compute"]
    assert mach.expert_fp8_tflops == pytest.approx(mach.fp8_tflops / 0.60 * 0.75)  # rowwise's efficiency, not blockwise's
    p = plan.compute(fp8, lay)
    assert p["experts_precision"] == "fp8_rowwise"
    assert (
        p["routed_experts"]
        == precision.grouped_experts(fp8)
        == (
            "fp8_rowwise in 58 MoE blocks: TorchTitan Float8GroupedExpertsConverter (torchao float8 rowwise scaled grouped GEMMs), "
            "token groups padded to 16"
        )
    )
    assert precision.without_fp8(fp8).precision.experts.value == "high"  # the FP8 speed-up's twin


def test_moe_with_fp8_experts_tracks_the_fp32_loss(compose):
    """The proof on CPU: debug_moe (2 blocks, the second MoE, 4 experts) trained 10 AdamW steps with its experts in emulated float8
    rowwise stays within 5 % of the float32 run's loss at every step, and is not the float32 run."""
    from runner.run.titan import cpu

    def losses(extra: list[str]) -> list[float]:
        cfg = compose([*MOE, "model.num_layers=2", "model.vocab_size=256", "model.num_experts=4", "model.num_experts_per_token=2", *extra])
        mcfg = _moe_config(cfg)
        assert titan.convert_experts(mcfg, cfg) == precision.converted_experts(cfg)
        cpu.use_sdpa(mcfg)
        cpu.use_float32_experts(mcfg)
        torch.manual_seed(0)
        model = mcfg.build()
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
        out = []
        for _ in range(10):
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    ref, fp8 = losses([]), losses([FP8_EXPERTS])
    rel = [abs(a - b) / a for a, b in zip(ref, fp8, strict=True)]
    assert max(rel) < 0.05, (ref, fp8)
    assert max(rel) > 0 and ref[-1] < ref[0] - 0.5  # the emulation ran, and the model learned


def test_precision_json_lists_the_experts_of_a_run_without_a_linear_recipe(compose, tmp_path):
    """fp32 Linear layers, float8 rowwise experts: precision.json is written (precision.any_fp8), with no Linear recipe
    path and the converted experts; the start-up line names them."""
    import json
    from types import SimpleNamespace

    from runner.run import per_rank
    from runner.run.device import DevicePolicy

    cfg = compose([*MOE, FP8_EXPERTS])
    assert precision.any_fp8(cfg) and not precision.any_fp8(compose(MOE))
    built = SimpleNamespace(fp8_converted=[], experts_converted=precision.converted_experts(cfg))
    line = per_rank.record_fp8(cfg, built, {"emulated": False}, tmp_path, DevicePolicy.of(cfg.cluster, cfg.distributed))
    rec = json.loads((tmp_path / "precision.json").read_text())
    assert (rec["fp8"], rec["path"], rec["converted"], rec["kept_high_precision"]) == ("none", None, [], {})
    assert rec["experts"] == {"precision": "fp8_rowwise", "path": "CPU: emulated", "converted": built.experts_converted}
    assert line == f"routed experts fp8_rowwise: 5 MoE blocks ({precision.grouped_experts(cfg)})"
