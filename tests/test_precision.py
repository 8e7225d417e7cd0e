"""Precision recipes without launching ranks: the blockwise FP8 emulation against hand-computed
values and torchao's own reference, the model-config conversion on each path, and the
validation rules (device capability, GEMM shapes per TP shard, MFU peak)."""

from __future__ import annotations

import pytest
import torch

from runner.config import validate
from runner.config.validate import model_rules
from runner.estimate import precision
from runner.run import titan
from runner.run.titan import fp8_emulation as fe
from tests.conftest import run_cli

E4M3 = torch.float8_e4m3fn
H100 = ["cluster=h100_node", "parallelism=fsdp", "training.global_batch_size=16"]


def test_tile_quantization_by_hand():
    x = torch.zeros(1, 256)
    # Tile 0: amax 1.75 gives scale 448 / 1.75 = 256 exactly, so scaled values are exact in fp32.
    x[0, :6] = torch.tensor([1.75, -1.75, 68 / 256, 76 / 256, 0.3, 1e-6])
    # Tile 1: its own amax 0.001 (a per-tile scale, not per row).
    x[0, 128:130] = torch.tensor([0.001, -0.0005])
    q, inv = fe.quantize_tiles(x)
    assert q.dtype == E4M3 and inv.shape == (1, 2)
    assert inv[0, 0].item() == 1 / 256
    assert inv[0, 1].item() == pytest.approx(0.001 / 448, rel=1e-6)
    # 1.75 -> 448 (the format's max); 68 and 76 are ties between e4m3 neighbours (spacing 8 in
    # [64, 128)) and round to the even mantissa: 68 -> 64, 76 -> 80; 0.3 * 256 = 76.8 -> 80;
    # 1e-6 * 256 is below half the smallest subnormal (2^-9) and flushes to 0.
    assert q[0, :6].float().tolist() == [448.0, -448.0, 64.0, 80.0, 80.0, 0.0]
    assert q[0, 128:130].float().tolist() == [448.0, -224.0]
    deq = fe.dequantize_tiles(q, inv)
    assert deq[0, :6].tolist() == [1.75, -1.75, 0.25, 0.3125, 0.3125, 0.0]
    assert deq[0, 128].item() == pytest.approx(0.001, rel=1e-6)


def test_weight_blocks_by_hand():
    w = torch.zeros(256, 256)
    for i, amax in enumerate([1.0, 2.0, 4.0, 0.5]):  # one amax per 128 x 128 block
        r, c = divmod(i, 2)
        w[128 * r + 5, 128 * c + 7] = amax
        w[128 * r + 100, 128 * c + 1] = amax / 3
    q, inv = fe.quantize_blocks(w)
    assert inv.flatten().tolist() == pytest.approx([1 / 448, 2 / 448, 4 / 448, 0.5 / 448], rel=1e-6)
    assert q[5, 7].float().item() == q[133, 7].float().item() == 448.0
    # amax / 3 -> 149.33 -> nearest e4m3 in [128, 256) (spacing 16): 144
    assert q[100, 1].float().item() == q[228, 129].float().item() == 144.0
    assert fe.dequantize_blocks(q, inv)[228, 129].item() == pytest.approx(144 * 0.5 / 448)


def test_saturation_at_format_max():
    y = torch.tensor([447.0, 460.0, 500.0, -1e6, float("inf")])
    assert fe.cast_saturating(y).float().tolist() == [448.0, 448.0, 448.0, -448.0, 448.0]


def test_bit_exact_with_torchao_reference():
    """torchao ships PyTorch references of its Triton quantizers; the emulation must equal them. The module
    imports on a CPU machine (Triton is installed; only launching its kernels needs a GPU)."""
    from torchao.prototype.blockwise_fp8_training import kernels

    torch.manual_seed(0)
    x, w = torch.randn(256, 384) * 3, torch.randn(256, 384)
    for ours, ref in (
        (fe.quantize_tiles(x), kernels.torch_blockwise_scale_act_quant_lhs(x)),
        (fe.quantize_blocks(w), kernels.torch_blockwise_scale_weight_quant(w)),
    ):
        assert torch.equal(ours[0].view(torch.uint8), ref[0].view(torch.uint8))
        assert torch.equal(ours[1], ref[1])
    q, inv = fe.quantize_tiles(x.t().contiguous())  # 128 x 1 groups along M, as for grad_W
    ref_q, ref_inv = kernels.torch_blockwise_scale_act_quant_rhs(x)
    assert torch.equal(q.t().contiguous().view(torch.uint8), ref_q.contiguous().view(torch.uint8))
    assert torch.equal(inv.t(), ref_inv)


def test_forward_and_backward_quantize_every_operand():
    torch.manual_seed(0)
    x = torch.randn(2, 64, 256, requires_grad=True)
    w = torch.randn(384, 256, requires_grad=True)
    dy = torch.randn(2, 64, 384)
    out = fe.BlockwiseFp8Matmul.apply(x, w)
    out.backward(dy)
    x2, dy2 = x.detach().reshape(128, 256), dy.reshape(128, 384)
    assert torch.equal(out.reshape(128, 384), fe.fake_tiles(x2) @ fe.fake_blocks(w.detach()).t())
    assert torch.equal(x.grad.reshape(128, 256), fe.fake_tiles(dy2) @ fe.fake_blocks(w.detach()))
    assert torch.equal(w.grad, fe.fake_tiles(dy2.t().contiguous()) @ fe.fake_tiles(x2.t().contiguous()).t())
    exact = x2 @ w.detach().t()
    err = ((out.reshape(128, 384) - exact).norm() / exact.norm()).item()
    assert 1e-3 < err < 0.06  # e4m3 keeps 3 mantissa bits: a few percent, never exact


DEBUG_FLAVORS = ["llama3_debugmodel", "qwen3_debugmodel", "qwen3_debugmodel_non_fused_qkv", "qwen3_debugmodel_moe"]
DEBUG_FLAVORS += ["deepseek_v3_debugmodel", "gpt_oss_debugmodel", "kimi_k2_7_debugmodel"]


@pytest.mark.parametrize("option", [*DEBUG_FLAVORS, "llama3_8b", "llama3_405b", "deepseek_v3_671b", "qwen3_235b_a22b", "gpt_oss_120b"])
def test_layer_rule_equals_titans_traverse(compose, option):
    """The torch-free per-family rule lists TorchTitan's Linear layers (name, dims, plain Linear or not) in its
    traverse order, for the registry's own config (Kimi: its text tower) of every family's debug flavor."""
    import importlib

    from torchtitan.models.common.linear import Linear

    m = compose([f"model={option}", "parallelism=single"]).model
    registry = importlib.import_module(f"torchtitan.models.{m.name}").model_registry(m.flavor).model
    if hasattr(registry, "vision_encoder"):
        registry.vision_encoder = None
    traversed = [(f, c.in_features, c.out_features, type(c) is Linear.Config) for f, c, _, _ in registry.traverse(Linear.Config)]
    assert traversed == [(la.fqn, la.in_dim, la.out_dim, la.fp8_twin) for la in precision.linear_layers(m)]


def test_layer_rule_lists_the_mtp_blocks_linears(compose):
    """model.num_mtp_layers=2: the rule lists the MTP blocks' Linear layers (each the last block's, then eh_proj) as
    TorchTitan's model_registry(..., num_mtp_layers=2) traverses them, so an FP8 recipe converts what was validated."""
    from torchtitan.models import deepseek_v3
    from torchtitan.models.common.linear import Linear

    m = compose(["model=deepseek_v3_debugmodel", "model.num_mtp_layers=2", "parallelism=single"]).model
    registry = deepseek_v3.model_registry("debugmodel", num_mtp_layers=2).model
    traversed = [(f, c.in_features, c.out_features, type(c) is Linear.Config) for f, c, _, _ in registry.traverse(Linear.Config)]
    assert traversed == [(la.fqn, la.in_dim, la.out_dim, la.fp8_twin) for la in precision.linear_layers(m)]
    assert traversed[-1] == ("mtp_layers.1.eh_proj", 512, 256, True)


# converted Linear layers of each debug flavor cut to 2 blocks under fp8_tensorwise with the preset's patterns
CONVERTED_2_BLOCKS = {
    "qwen3_debugmodel": ["attention.qkv_linear.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"] * 2,
    "qwen3_debugmodel_moe": ["attention.qkv_linear.wqkv", "attention.wo"] * 2,  # routers kept, experts grouped
    "gpt_oss_debugmodel": ["attention.qkv_linear.wqkv"] * 2,  # wo: ScaledBiasRowwiseLinear
    "kimi_k2_7_debugmodel": [
        *["attention.wq", "attention.wkv_a", "attention.wkv_b", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"],
        *["attention.wq", "attention.wkv_a", "attention.wkv_b", "attention.wo"],
        *["moe.shared_experts.w1", "moe.shared_experts.w2", "moe.shared_experts.w3"],
    ],
}


@pytest.mark.parametrize("option", CONVERTED_2_BLOCKS)
def test_every_family_converts_by_traversal_and_trains_in_fp8(compose, monkeypatch, option):
    """TorchTitan's traverse converts what the torch-free rule says (precision.json's list); each converted layer
    runs its forward and two backward GEMMs in FP8; gpt-oss's output projection and every router stay."""
    few_experts = ["model.num_experts=8", "model.num_experts_per_token=2"] if option == "qwen3_debugmodel_moe" else []
    cfg = compose([f"model={option}", "precision=fp8_tensorwise", "model.num_layers=2", "parallelism=single", *few_experts])
    model, converted = _fp8_model(cfg)
    assert [f.split(".", 2)[2] for f in converted] == CONVERTED_2_BLOCKS[option]
    assert converted == precision.conversion(cfg)[0]
    kept = precision.conversion(cfg)[1]
    if option == "gpt_oss_debugmodel":
        assert kept["layers.0.attention.wo"] == precision.SCALED_BIAS and kept["layers.1.moe.router.gate"] == "*.router.*"
    assert (precision.grouped_experts(cfg) is None) == (option == "qwen3_debugmodel")
    if option == "gpt_oss_debugmodel":
        return
    calls = _count_scaled_mm(monkeypatch)
    _train_step(model)
    assert len(calls) == 3 * len(converted)


def _model_config(cfg):
    from torchtitan.models.llama3 import model_registry

    return model_registry(cfg.model.flavor).model


def test_cpu_conversion_keeps_head_and_converts_blocks(compose):
    from torchtitan.components.quantization import Float8Linear

    for name in ("fp8_tensorwise", "fp8_rowwise", "fp8_blockwise"):
        cfg = compose([f"precision={name}"])
        mcfg = _model_config(cfg)
        converted = titan.convert_precision(mcfg, cfg)
        assert len(converted) == 30 and not any(k in f for f in converted for k in ("lm_head", "embed", "norm", "router"))
        assert type(mcfg.lm_head).__name__ == "Config" and type(mcfg.lm_head).__qualname__ == "Linear.Config"
        ffn = mcfg.layers[0].feed_forward.w2
        if name == "fp8_blockwise":
            assert type(ffn).__qualname__.endswith("EmulatedBlockwiseFp8Linear.Config")
        else:
            assert isinstance(ffn, Float8Linear.Config) and ffn._torchao_config.round_scales_to_power_of_2 == (name == "fp8_rowwise")
    keep = compose(["precision=fp8_rowwise", "precision.keep_high_precision=[lm_head,'layers.0.*','*.w2']"])
    converted = titan.convert_precision(_model_config(keep), keep)
    assert len(converted) == 30 - 5 - 5 and "layers.0.feed_forward.w1" not in converted and "layers.1.feed_forward.w1" in converted


def _small_fp8_model(compose, name: str):
    """The debug model cut to 2 blocks (10 Linear layers beside the head), converted as a CPU run converts it."""
    return _fp8_model(compose([f"precision={name}", "model.num_layers=2", "parallelism=single"]))


def _fp8_model(cfg):
    from runner.run.titan import cpu

    mcfg = titan.model_spec(cfg.model).model
    converted = titan.convert_precision(mcfg, cfg)
    if cfg.model.name != "gpt_oss":  # its sinks have no CPU attention (family_support): converted, not trained here
        cpu.use_sdpa(mcfg)
    cpu.use_float32_experts(mcfg)
    torch.manual_seed(0)
    model = mcfg.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model, converted


def _train_step(model, shape: tuple[int, int] = (1, 16)) -> None:
    """One forward and backward on random tokens: 16 by default (the smallest M, and K of grad_W, _scaled_mm takes: CPU
    FP8 GEMMs run at 1/250 of fp32 on some machines), (2, 64) for the blockwise emulation (128 tokens: one tile row)."""
    tokens = torch.randint(0, 2048, shape)
    model(tokens).float().square().mean().backward()


def _count_scaled_mm(monkeypatch) -> list[tuple[torch.dtype, torch.dtype]]:
    """Record the operand dtypes of every torch._scaled_mm call (torchao's float8 matmul calls it by that name)."""
    calls, real = [], torch._scaled_mm

    def counting(a, b, *args, **kwargs):
        calls.append((a.dtype, b.dtype))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    return calls


@pytest.mark.parametrize("name", ["fp8_tensorwise", "fp8_rowwise", "fp32"])
def test_every_converted_layer_runs_its_three_gemms_in_fp8(compose, monkeypatch, name):
    """Forward (x @ W.T), backward grad_x (dy @ W) and grad_W (dy.T @ x): three torch._scaled_mm per layer and step."""
    model, converted = _small_fp8_model(compose, name)
    calls = _count_scaled_mm(monkeypatch)
    _train_step(model)
    assert len(converted) == (0 if name == "fp32" else 10)
    assert len(calls) == 3 * len(converted)
    assert calls[: len(converted)] == [(E4M3, E4M3)] * len(converted)  # forward: activations and weights in e4m3
    grads_e5m2 = {"fp8_tensorwise": 2 * len(converted), "fp8_rowwise": 0, "fp32": 0}[name]  # torchao's recipes
    assert sum(torch.float8_e5m2 in c for c in calls) == grads_e5m2 and all({a, b} <= {E4M3, torch.float8_e5m2} for a, b in calls)


def test_emulated_blockwise_quantizes_every_gemm_operand(compose, monkeypatch):
    """Per layer and step: 1x128 tiles of x, dy, dy.T and x.T, 128x128 blocks of W in forward and backward."""
    model, converted = _small_fp8_model(compose, "fp8_blockwise")
    calls = {"tiles": 0, "blocks": 0}

    def counting(kind, fn):
        def wrapped(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(fe, "quantize_tiles", counting("tiles", fe.quantize_tiles))
    monkeypatch.setattr(fe, "quantize_blocks", counting("blocks", fe.quantize_blocks))
    scaled_mm = _count_scaled_mm(monkeypatch)
    _train_step(model, (2, 64))
    assert len(converted) == 10 and scaled_mm == []  # emulated: no FP8 GEMM kernel, dequantized float32 matmuls
    assert calls == {"tiles": 4 * len(converted), "blocks": 2 * len(converted)}


def test_gpu_paths_are_torchao_and_titan(compose):
    """On a CUDA cluster the runner hands FP8 to TorchTitan's converters and torchao's blockwise
    Linear; on this CPU machine their own capability checks refuse, with upstream's words."""
    from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear

    cfg = compose([*H100, "precision=fp8_blockwise"])
    mcfg = _model_config(cfg)
    titan.convert_precision(mcfg, cfg)
    assert issubclass(type(mcfg.layers[0].attention.wo)._owner, Float8BlockwiseLinear)
    cfg = compose([*H100, "precision=fp8_rowwise"])
    with pytest.raises(ValueError, match="float8 is only supported on NVIDIA SM89 or later"):
        titan.convert_precision(_model_config(cfg), cfg)
    cfg = compose(["cluster=b200_node", "parallelism=fsdp", "training.global_batch_size=16", "precision=mxfp8"])
    with pytest.raises(ValueError, match="MXFP8 is only supported on SM100 or later architectures"):
        titan.convert_precision(_model_config(cfg), cfg)


def test_mfu_peak_follows_matmul_dtype(compose):
    cases = {
        ("precision=bf16",): ("bfloat16", False),
        ("precision=fp8_rowwise",): ("float8", False),  # CPU: torch._scaled_mm, measured
        ("precision=fp8_blockwise",): ("float32", True),  # CPU emulation: fp32 matmuls of dequantized values
        (*H100, "precision=fp8_blockwise"): ("float8", False),
    }
    for overrides, want in cases.items():
        assert precision.matmul_peak(compose(list(overrides))) == want, overrides
    cfg = compose([*H100, "precision=fp8_tensorwise"])
    assert (cfg.cluster.peak_tflops["float8"], cfg.precision.param_dtype.value) == (1979.0, "bfloat16")  # 2x the bf16 989


BAD = [
    (["precision=mxfp8"], "precision.fp8 = mxfp8: mxfp8 needs NVIDIA SM 10.0+ (Blackwell B200/GB200)"),
    (
        ["precision=mxfp8", *H100],
        "precision.fp8 = mxfp8: needs NVIDIA SM 10.0+ (Blackwell B200/GB200); cluster h100_node has SM 9.0. "
        "Fix: use a precision this GPU runs (fp8 tensorwise, fp8 rowwise, fp8 blockwise)",
    ),
    (
        ["precision=fp8_blockwise", *H100, "cluster.compute_capability='8.9'"],
        "precision.fp8 = blockwise: needs NVIDIA SM 9.0+ (Hopper H100/H200); cluster h100_node has SM 8.9",
    ),
    (
        ["precision=fp8_tensorwise", *H100, "cluster.compute_capability='8.0'"],
        "needs NVIDIA SM 8.9+ (Ada L4/L40S, Hopper H100/H200); cluster h100_node has SM 8.0. Fix: use a precision this GPU runs (bf16)",
    ),
    (
        ["precision=fp8_rowwise", *H100, "cluster.compute_capability=''"],
        "cluster.compute_capability = '': fp8_rowwise needs NVIDIA SM 8.9+",
    ),
    (
        ["precision=fp8_blockwise", "parallelism.tp=4", "parallelism.dp_shard=1"],
        "precision.fp8 = blockwise: layer layers.0.feed_forward.w2 (768 -> 256, rowwise over tp=4) multiplies a 192 x 256 weight; "
        "blockwise FP8 GEMMs need every dimension divisible by 128. Fix: keep it in high precision with "
        "precision.keep_high_precision=[..., 'layers.*.feed_forward.w2'], or use parallelism.tp in [1, 2]",
    ),
    (
        ["precision=fp8_blockwise", "training.seq_len=32"],
        "training.seq_len = 32: training.microbatch_size 2 x seq_len 32 / cp 1 = 64 tokens per GEMM; blockwise FP8 needs a multiple of 128",
    ),
    (
        ["precision=fp8_tensorwise", "model.ffn_hidden_dim=770", "parallelism=single"],
        "layer layers.0.feed_forward.w1 (256 -> 770) multiplies a 256 x 770 weight; "
        "tensorwise FP8 GEMMs need every dimension divisible by 16",
    ),
    (
        ["precision=fp8_blockwise", *H100, "~cluster.peak_tflops.float8"],
        "cluster.peak_tflops = {'float32': 67.0, 'bfloat16': 989.0}: has no dense peak for float8",
    ),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_validation_rejects_precision(refusal, overrides, message):
    assert message in refusal(overrides)


def test_excluded_layer_is_not_shape_checked(compose):
    """At tp=4 every debug-model Linear shards below blockwise FP8's 128 tiles: each converted one is
    reported, each kept one is not checked at all."""
    tp4 = ["precision=fp8_blockwise", "parallelism.tp=4", "parallelism.dp_shard=1"]
    only_w2 = compose([*tp4, "precision.keep_high_precision=[lm_head,'*.wqkv','*.wo','*.w1','*.w3']"])
    assert precision.conversion(only_w2)[0] == [f"layers.{i}.feed_forward.w2" for i in range(6)]
    with pytest.raises(validate.ConfigError) as e:
        validate.check(only_w2)
    assert "(1 problem" in str(e.value) and "layer layers.0.feed_forward.w2 (768 -> 256, rowwise over tp=4)" in str(e.value)
    keep_all = compose([*tp4, "precision.keep_high_precision=['*']"])
    assert validate.check(keep_all).tp == 4
    assert precision.conversion(keep_all) == ([], {la.fqn: "*" for la in precision.linear_layers(keep_all.model)})


@pytest.mark.e2e
def test_cli_headline_validates_and_rejects_with_exit_2(tmp_path):
    seed = ["model=llama3_70b", "training.seq_len=4096", "training.global_batch_size=1024", "training.microbatch_size=1"]
    proc = run_cli("parallelism=tp8_pp4", "precision=fp8_blockwise", "cluster=h100x1024", *seed, "mode=validate", run_dir=tmp_path / "a")
    assert proc.returncode == 0, proc.stderr
    assert "precision fp8_blockwise: 400 of 401 Linear layers in FP8 blockwise (kept in bfloat16: lm_head)" in proc.stdout
    mfu = "MFU against the bfloat16 dense peak, 989 TFLOP/s per device; mfu_of_gemm_peak against the float8 one, 1979 TFLOP/s"
    assert mfu in proc.stdout
    assert "FP8 costs mode=plan prices as their own terms: fp8_cast (the cast and scale kernels), fp8_amax" in proc.stdout
    proc = run_cli("precision=mxfp8", run_dir=tmp_path / "b")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout
    assert "mxfp8 needs NVIDIA SM 10.0+ (Blackwell B200/GB200)" in proc.stderr
    assert not (tmp_path / "b").exists()


def test_gpu_blockwise_linear_adds_its_bias(monkeypatch):
    """torchao's Float8BlockwiseLinear forward returns x @ W.T and drops the bias. The layer the GPU path builds
    adds it. torchao's capability check and FP8 GEMM are replaced (no SM 9.0 here) by a plain matmul, so the
    test is about the layer's forward, not the emulation's (which adds the bias itself)."""
    from torchao.prototype.blockwise_fp8_training import linear

    monkeypatch.setattr(linear, "is_sm_at_least_90", lambda: True)
    monkeypatch.setattr(linear.fp8_blockwise_mm, "apply", lambda x, w, block, dtype, triton: x @ w.T)
    layer = titan.blockwise_linear_config()(in_features=128, out_features=256, bias=True).build()
    with torch.no_grad():
        layer.bias.copy_(torch.arange(256, dtype=torch.float32))
    x = torch.randn(2, 3, 128)
    assert isinstance(layer, linear.Float8BlockwiseLinear)
    assert torch.equal(layer(x), x @ layer.weight.T + layer.bias)


def test_the_kept_layers_are_summarised_by_pattern(compose):
    """mode=validate's precision line of DeepSeek-V3 671B listed all 120 kept layers (~3,300 characters); it summarises
    them by pattern with counts, as the FP8 start-up line does."""
    from runner import modes

    line = modes._precision_lines(compose(["recipe=deepseek_v3_671b_h800x2048"]))[0]
    assert line == (
        "  precision fp8_blockwise: 427 of 547 Linear layers in FP8 blockwise "
        "(kept in bfloat16: lm_head, layers.*.attention.wkv_a x61, layers.*.moe.router.gate x58)"
    )


def test_fp8_shape_rule_walks_a_model_once_and_answers_as_a_fresh_walk(compose):
    """The FP8 shape rule's walk of the Linear layers is kept by what it reads (the model's and the precision group's
    fields; mode=search applies the rule to every layout of one model): interleaved configs that differ in
    keep_high_precision or TP get what a fresh walk gives each."""
    tp4 = ["precision=fp8_blockwise", "parallelism.tp=4", "parallelism.dp_shard=1"]  # composed for the tests above too
    configs = []
    for tp in (1, 2, 4):
        for keep in ([], ["precision.keep_high_precision=[lm_head,'*.wqkv','*.wo','*.w1','*.w3']"]):
            configs.append(compose([*tp4, *keep]))
            configs[-1].parallelism.tp = tp

    def problems(cfg):
        out = []
        model_rules.fp8_shapes(cfg, out)
        return out

    kept = [problems(c) for c in configs]
    fresh = []
    for c in configs:
        model_rules._FP8_LAYERS.clear()
        fresh.append(problems(c))
    assert kept == fresh
    assert not kept[0] and len(kept[4]) > len(kept[5]) == 1  # tp=4: every kind of layer misfits; only w2 is converted
