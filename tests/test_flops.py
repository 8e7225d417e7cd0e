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

    # 1,000 tokens/s x 35,016,192 FLOPs/token on a 0.1 TFLOP/s machine = 35.0 %
    assert flops.mfu(1000, 35_016_192, 0.1e12) == pytest.approx(0.35016192)
    # 8 H100s at 40% of 989 TFLOP/s training 8B at seq 8192: tokens/s = 0.4 * 8 * 989e12 / FLOPs per token
    assert flops.mfu(0.4 * 8 * 989e12 / 57_914_449_920, 57_914_449_920, 8 * 989e12) == pytest.approx(0.4)
    m = ModelConfig()  # debug: dim 256, 16 heads of 16, ffn 768, 6 layers
    assert flops.hfu_factor(m, ActivationCheckpoint.full, 2) == pytest.approx(4 / 3)
    assert flops.hfu_factor(m, ActivationCheckpoint.none, 2) == 1.0
    assert flops.hfu_factor(m, ActivationCheckpoint.selective_layer, 2) == pytest.approx(1 + 3 / 6 / 3)  # blocks 1, 3, 5 of 6
    assert flops.hfu_factor(m, ActivationCheckpoint.selective_layer, 4) == pytest.approx(1 + 1 / 6 / 3)  # block 3 only
    # selective_op recomputes wk, wo, w3: (256*256 + 256*256 + 256*768) of (4*256*256 + 3*256*768) matmul weights
    assert flops.hfu_factor(m, ActivationCheckpoint.selective_op, 2) == pytest.approx(1 + (5 / 13) / 3)
