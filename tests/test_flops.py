"""FLOPs and parameter counts by hand; MFU by hand. (tests/test_families.py checks the counts equal TorchTitan's own
for every registered flavor.)"""

from __future__ import annotations

import pytest

from runner.estimate import flops


def test_debug_flops_by_hand(compose):
    m = compose(["parallelism=single"]).model
    # embedding 2048*256; per layer qkv 256*768 + wo 256*256 + ffn 3*256*768 + 2 norms; final norm; head 256*2048
    n = 2048 * 256 + 6 * (256 * 768 + 256 * 256 + 3 * 256 * 768 + 2 * 256) + 256 + 256 * 2048
    assert flops.num_params(m) == n == 6_163_712
    assert flops.flops_per_token(m, 256, "titan") == 6 * (n - 2048 * 256) + 6 * 6 * 16 * 32 * 256


def test_mfu_and_hfu():
    from runner.schema import ActivationCheckpoint, ModelConfig

    # 2,000 tokens in 2 s x 35,016,192 FLOPs/token on a 0.1 TFLOP/s machine = 35.0 %
    assert flops.utilisation(2000, 2.0, 35_016_192, 0.1e12).mfu == pytest.approx(0.35016192)
    # 8 H100s at 40% of 989 TFLOP/s training 8B at seq 8192: tokens/s = 0.4 * 8 * 989e12 / FLOPs per token
    assert flops.utilisation(0.4 * 8 * 989e12 / 57_914_449_920, 1.0, 57_914_449_920, 8 * 989e12).mfu == pytest.approx(0.4)
    # an FP8 step: MFU of the bf16 peak (989), of the float8 GEMM peak (1979), HFU with full recomputation (x 4/3)
    u = flops.utilisation(0.4 * 8 * 989e12 / 57_914_449_920, 1.0, 57_914_449_920, 8 * 989e12, 8 * 1979e12, 4 / 3)
    assert (u.mfu, u.mfu_of_gemm_peak, u.hfu) == pytest.approx((0.4, 0.4 * 989 / 1979, 0.4 * 4 / 3))
    # no time or no peak: no figure (a plan without a prediction, a cluster without a peak for that dtype)
    assert flops.utilisation(1000, None, 1e9, 1e12) == flops.Utilisation(None, None, None)
    assert flops.utilisation(1000, 1.0, 1e9, None, 1e12, 2.0) == flops.Utilisation(None, 1.0, None)
    m = ModelConfig()  # debug: dim 256, 16 heads of 16, ffn 768, 6 layers
    assert flops.hfu_factor(m, ActivationCheckpoint.full, 2) == pytest.approx(4 / 3)
    assert flops.hfu_factor(m, ActivationCheckpoint.full, 2, recomputes=2.0) == pytest.approx(5 / 3)  # a split backward: input and weight pass
    assert flops.hfu_factor(m, ActivationCheckpoint.none, 2) == 1.0
    assert flops.hfu_factor(m, ActivationCheckpoint.selective_layer, 2) == pytest.approx(1 + 3 / 6 / 3)  # blocks 1, 3, 5 of 6
    assert flops.hfu_factor(m, ActivationCheckpoint.selective_layer, 4) == pytest.approx(1 + 1 / 6 / 3)  # block 3 only
    # selective_op recomputes wk, wo, w3: (256*256 + 256*256 + 256*768) of (4*256*256 + 3*256*768) matmul weights
    assert flops.hfu_factor(m, ActivationCheckpoint.selective_op, 2) == pytest.approx(1 + (5 / 13) / 3)


def test_the_step_row_takes_its_utilisation_from_flops(compose):
    """A run's step row (runner.run.accounting.row): MFU of the param_dtype peak, MFU of the GEMM peak, the 6N MFU and
    HFU, each the figure flops.utilisation gives for the step's tokens and time."""
    from runner.run import accounting

    cfg = compose(["training.activation_checkpoint=full"])
    tokens = cfg.training.global_batch_size * cfg.training.seq_len
    acc = accounting.Accounting(2.0, 2e12, "test", 10**6, 9 * 10**5, "float8", False, 1, None, 1.0, 1e12, "bfloat16")
    r = accounting.row(3, 2.5, 1.0, 0.5, 1e-3, cfg, acc, 1.0)
    assert r["tokens_per_s"] == tokens / 0.5
    assert r["mfu"] == pytest.approx(tokens * 1e6 / (0.5 * 1e12))
    assert r["mfu_of_gemm_peak"] == pytest.approx(tokens * 1e6 / (0.5 * 2e12))
    assert r["mfu_6n"] == pytest.approx(tokens * 9e5 / (0.5 * 1e12))
    assert r["hfu"] == pytest.approx(r["mfu"] * 4 / 3)  # full recomputation: one more forward of the 6 units


MTP = ["model=deepseek_v3_debugmodel", "model.num_mtp_layers=1", "parallelism=single", "training.seq_len=16"]


def test_mtp_counts_are_titans_and_the_built_modules(compose):
    """model.num_mtp_layers=1 on the debug DeepSeek-V3: the parameters and FLOPs per token are TorchTitan's own count of
    its model_registry("debugmodel", num_mtp_layers=1) (what check_size holds the built model to), the MTP block is the
    built one, and its GEMMs are measured: torch's FLOP counter over a forward of the runner's built model, x 3, is that
    count less the norms' weights (no GEMM) plus what TorchTitan's formula leaves out of MTP (the second pass through the
    head, the MTP block's attention scores: flops.mtp_uncounted_flops_per_token)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from torchtitan.models import deepseek_v3

    from runner.run import titan
    from runner.run.titan.initial_weights import init_weights
    from runner.schema import layout

    cfg = compose(MTP)
    m, seq = cfg.model, cfg.training.seq_len
    with torch.device("meta"):
        reference = deepseek_v3.model_registry("debugmodel", num_mtp_layers=1).model
        ref_model = reference.build()
    assert (flops.num_params(m), flops.flops_per_token(m, seq, "titan")) == reference.get_nparams_and_flops(ref_model, seq)
    # MLA 3,555,840 (q 786,432, kv_a 147,456 + its norm 512, kv_b 2,097,152, wo 524,288) + MoE 1,968,128 (8 experts
    # 1,572,864, router 2,048, 2 shared 393,216) + 2 norms 512; eh_proj 2 x 256 x 256 = 131,072; enorm, hnorm, mtp_norm 768
    assert sum(p.numel() for p in ref_model.mtp_layers.parameters()) == flops.mtp_block_params(m) == 5_656_320

    spec, *_ = titan.model_config(cfg, layout.resolve(cfg.parallelism, cfg.cluster))  # the CPU's SDPA and fp32 experts
    model = spec.model.build()
    init_weights(model, 0)
    tokens = torch.randint(0, m.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        out = model(tokens)
    assert len(out) == 2 and out[1].shape == (1, seq, m.vocab_size)  # the main head's logits and depth 1's
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    expected = flops.flops_per_token(m, seq, "titan") + flops.mtp_uncounted_flops_per_token(m, seq) - 6 * norms
    assert 3 * counter.get_total_flops() / seq == expected
