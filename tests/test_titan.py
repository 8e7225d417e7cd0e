"""The TorchTitan adapter builds the model the config describes: its architecture fields reach
TorchTitan's model config (so the parameter count and FLOPs a run reports are the config's), and
the FP8 layer table that validation reads is TorchTitan's for both model families."""

from __future__ import annotations

import json
import re

import pytest

from runner.estimate import flops, precision
from runner.run import titan
from tests.conftest import ROOT, run_cli
from tests.points import TITAN_LAUNCHES as LAUNCHES
from tests.points import TITAN_MOE_FP8 as MOE_FP8
from tests.points import TITAN_SHORT as SHORT
from tests.points import TITAN_WIDE as WIDE

MODELS = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))
# qwen3_5's module imports flash-linear-attention, absent here: the runner builds its registry flavor as it is
# (titan.model.REGISTRY_ONLY), and tests/test_families.py reads that registry with placeholders for the kernels
REBUILT = [m for m in MODELS if not m.startswith("qwen3_5")]
WIDE_PARAMS = 2048 * 512 + 6 * (4 * 512 * 512 + 3 * 512 * 1536 + 2 * 512) + 512 + 512 * 2048  # the debug model is 6,163,712
# debug_moe: per block wq, wkv_a, wkv_b, wo; block 0 a dense SwiGLU, blocks 1-5 a router gate and shared experts (w1, w2, w3).
MOE_LINEARS = 1 + 6 * 4 + 3 + 5 * 4
MOE_KEPT = {"lm_head": "lm_head"} | {f"layers.{i}.moe.router.gate": "*.router.*" for i in range(1, 6)}


def _plain(config) -> str:
    """A model config's repr without object addresses (its initializers are functools.partials)."""
    return re.sub(r" at 0x[0-9a-f]+", "", repr(config))


@pytest.mark.parametrize("option", REBUILT)
def test_model_config_equals_the_registry_flavor(compose, option):
    """Rebuilt from the schema's fields, an unchanged model is TorchTitan's registry flavor, field for field."""
    import importlib

    m = compose([f"model={option}", "parallelism=single"]).model
    registry = importlib.import_module(f"torchtitan.models.{m.name}").model_registry(m.flavor, attn_backend=titan.model.ATTN_BACKEND)
    if hasattr(registry.model, "vision_encoder"):
        registry.model.vision_encoder = None  # Kimi: the runner trains the text tower
    assert _plain(titan.model_spec(m).model) == _plain(registry.model)


@pytest.mark.parametrize(
    "overrides",
    [WIDE, ["model.num_layers=3", "model.num_kv_heads=4"], ["model=debug_moe", "model.num_experts=16", "model.q_lora_rank=128"]],
    ids=["wide", "gqa", "moe"],
)
def test_overrides_reach_the_built_model(compose, overrides):
    import torch

    m = compose([*overrides, "parallelism=single"]).model
    mcfg = titan.model_spec(m).model
    with torch.device("meta"):
        n, f = mcfg.get_nparams_and_flops(mcfg.build(), 256)
    assert (n, f) == (flops.num_params(m), flops.flops_per_token(m, 256, "titan"))
    titan.check_size(m, 256, n, f)
    titan.check_layer_table(mcfg, m)  # the torch-free FP8 table follows the overrides too


def test_size_check_names_both_counts(compose):
    m = compose(["parallelism=single"]).model
    with pytest.raises(RuntimeError, match="with 6,163,711 parameters .* runner.estimate.flops counts 6,163,712"):
        titan.check_size(m, 256, 6_163_711, flops.flops_per_token(m, 256))


def test_llama3_refuses_fields_it_has_no_place_for(compose):
    m = compose(["model.num_experts=8", "model.num_experts_per_token=2", "model.moe_hidden_dim=64", "parallelism=single"]).model
    with pytest.raises(ValueError, match="llama3 is a dense model .* no model.num_experts = 8, model.num_experts_per_token = 2"):
        titan.model_spec(m)


def test_layer_table_equals_titan_for_both_families(compose):
    for option in ("debug_moe", "debug", "llama3_405b"):
        m = compose([f"model={option}", "parallelism=single"]).model
        mcfg = titan.model_spec(m).model
        titan.check_layer_table(mcfg, m)
    cfg = compose([*MOE_FP8, "parallelism=single"])
    assert len(precision.linear_layers(cfg.model)) == MOE_LINEARS
    converted, kept = precision.conversion(cfg)
    assert (len(converted), kept) == (MOE_LINEARS - 6, MOE_KEPT)
    assert converted == titan.fp8_layers(titan.model_spec(cfg.model).model, cfg)
    wkv_a = next(la for la in precision.linear_layers(cfg.model) if la.fqn == "layers.0.attention.wkv_a")
    assert (wkv_a.in_dim, wkv_a.out_dim, precision.local_gemm_dims(wkv_a, 4)) == (256, 576, (256, 576))  # replicated over TP


@pytest.mark.e2e
def test_moe_fp8_validates_with_its_layer_count(tmp_path):
    proc = run_cli(*MOE_FP8, "parallelism=ep2", "mode=validate", run_dir=tmp_path / "v")
    assert proc.returncode == 0, proc.stderr
    assert f"precision fp8_tensorwise: {MOE_LINEARS - 6} of {MOE_LINEARS} Linear layers in FP8 tensorwise" in proc.stdout
    assert "routed experts: fp8_rowwise in 5 MoE blocks: EMULATED on CPU (float8 e4m3 casts with torchao's scales" in proc.stdout


# A widened debug model and the MoE model in FP8 on one rank each (TITAN_LAUNCHES in tests/points.py): points of the
# shared one-rank launch of runner.run.layout_parity (conftest's parity_runs), which runs the same build and step loop as
# a run and reports the same summary.
@pytest.fixture(scope="module")
def runs(parity_runs) -> dict[str, dict]:
    return {name.removeprefix("titan-"): parity_runs[name] for name in LAUNCHES[1]}


@pytest.mark.e2e
def test_widened_model_trains_at_the_config_size(runs, compose):
    m = compose([*WIDE, *SHORT]).model
    s = runs["wide"]["summary"]
    assert s["num_params"] == flops.num_params(m) == WIDE_PARAMS == 22_551_040
    assert s["flops_per_token"] == flops.flops_per_token(m, 32, "titan") == 6 * (WIDE_PARAMS - 2048 * 512) + 6 * 6 * 16 * 64 * 32
    assert s["flops_per_token_6n"] == 6 * WIDE_PARAMS


@pytest.mark.e2e
def test_moe_model_trains_in_fp8(runs, compose):
    cfg = compose([*MOE_FP8, *SHORT])
    rec = json.loads((runs["moe_fp8"]["run_dir"] / "precision.json").read_text())
    assert len(rec["converted"]) == MOE_LINEARS - 6 == 42
    assert (rec["converted"], rec["kept_high_precision"]) == (precision.conversion(cfg)[0], MOE_KEPT)
    assert rec["grouped_experts"] == precision.grouped_experts(cfg)
    moe = [f"layers.{i}.moe.routed_experts.inner_experts" for i in range(1, 6)]  # block 0 is dense
    assert rec["experts"] == {"precision": "fp8_rowwise", "path": "CPU: emulated", "converted": moe}
    s = runs["moe_fp8"]["summary"]
    assert (s["num_params"], s["steps"], s["fp8"]) == (flops.num_params(cfg.model), 1, "tensorwise")
