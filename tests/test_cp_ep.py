"""Context and expert parallelism in the config layer: validation rules, MoE accounting with
active parameters (equal to TorchTitan's own count), CP and EP traffic in the plan. The
training parity of cp2 and ep2 with one rank is in tests/test_parallel.py (runner.run.layout_parity)."""

from __future__ import annotations

import pytest

from runner.config import validate
from runner.estimate import flops, plan

MOE = ["model=debug_moe", "parallelism=single"]
LONG_405B = [
    "recipe=llama3_70b_h100x1024",
    "model=llama3_405b",
    "parallelism=tp8_pp16_cp16",
    "cluster.num_nodes=2048",  # 16,384 H100s, as Llama 3 405B's long-context stage
    "training.seq_len=131072",
    "training.global_batch_size=128",
    "mode=plan",  # planned, not validated: without activation checkpointing it needs 89 GB per 80 GB GPU, which validation refuses
]


def test_moe_model_file_matches_titan_registry(compose):
    from torchtitan.models.deepseek_v3 import model_registry

    m = compose(MOE).model
    t = model_registry(m.flavor).model
    attn, moe = t.layers[0].attention, t.layers[-1].moe
    dense = [i for i, layer in enumerate(t.layers) if layer.moe is None]
    assert (m.dim, m.num_layers, m.vocab_size, m.weight_tying, m.num_heads) == (t.dim, len(t.layers), t.vocab_size, False, attn.n_heads)
    assert (m.kv_lora_rank, m.q_lora_rank) == (attn.kv_lora_rank, attn.q_lora_rank)
    assert (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim)
    assert (m.num_experts, m.num_experts_per_token, m.moe_hidden_dim) == (
        moe.num_experts,
        moe.router.top_k,
        moe.routed_experts.inner_experts.hidden_dim,
    )
    assert m.num_shared_experts * m.moe_hidden_dim == moe.shared_experts.w1.out_features
    assert dense == list(range(m.num_dense_layers)) and m.ffn_hidden_dim == t.layers[0].feed_forward.w1.out_features


@pytest.mark.parametrize("seq_len", [64, 4096])
def test_moe_flops_use_active_parameters_like_titan(compose, seq_len):
    import torch
    from torchtitan.models.deepseek_v3 import model_registry

    m = compose(MOE).model
    cfg = model_registry(m.flavor).model
    with torch.device("meta"):
        model = cfg.build()
    nparams, titan_flops = cfg.get_nparams_and_flops(model, seq_len)
    assert flops.num_params(m) == nparams == 33_014_016
    assert flops.flops_per_token(m, seq_len, "titan") == titan_flops
    # by hand: 5 MoE blocks x 8 experts x 3 x 256 x 256 routed weights, of which a token uses 3 of 8
    routed = 5 * 8 * 3 * 256 * 256
    assert flops.num_active_params(m) == nparams - routed + routed * 3 // 8 == 28_098_816
    assert flops.flops_per_token(m, seq_len, "6N") == 6 * 28_098_816
    assert flops.flops_per_token(m, seq_len, "titan") == 6 * (28_098_816 - 2048 * 256) + 6 * 6 * 16 * (128 + 64 + 128) * seq_len


def test_dense_model_active_equals_total(compose):
    m = compose(["parallelism=single"]).model
    assert flops.num_active_params(m) == flops.num_params(m) == 6_163_712


BAD = [
    (["parallelism=ep2"], "parallelism.ep = 2: expert parallelism needs a mixture-of-experts model (it shards the experts); model llama3"),
    (
        [*MOE, "parallelism.ep=3", "parallelism.dp_shard=3"],
        "parallelism.ep = 3: model.num_experts = 8 must split evenly over the expert-parallel ranks. Fix: use ep in [1, 2, 4, 8]",
    ),
    (
        [*MOE, "parallelism.ep=4", "parallelism.dp_shard=2"],
        "parallelism.ep = 4: EP takes its ranks from dp_shard x cp x tp = 2 x 1 x 1 = 2",
    ),
    ([*MOE, "model.num_experts_per_token=9"], "model.num_experts_per_token = 9: a token goes to between 1 and model.num_experts = 8"),
    ([*MOE, "model.num_dense_layers=6"], "model.num_dense_layers = 6: must be in [0, model.num_layers = 6)"),
    (
        ["parallelism=cp2", "training.seq_len=66"],
        "training.seq_len = 66: context parallelism with load balancing splits the sequence into 2 x cp = 4",
    ),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_validation_rejects(refusal, overrides, message):
    assert message in refusal(overrides)


def test_cp_and_ep_layouts_validate_and_launch_here(compose, tmp_path):
    for overrides, degrees in (
        (["parallelism=cp2"], "cp=2"),
        (["parallelism=cp2", "parallelism.dp_shard=2"], "dp_shard=2 x cp=2"),
        (["parallelism=cp2", "parallelism.tp=2"], "cp=2 x tp=2"),
        (["model=debug_moe", "parallelism=ep2"], "dp_shard=2 x ep=2"),
    ):
        cfg = compose(overrides)
        lay = validate.check(cfg)
        validate.preflight(cfg, tmp_path, lay)  # CP is no longer rejected on local_cpu
        assert lay.describe() == degrees


def test_cp_with_latent_attention_rejected_on_cpu_only(compose):
    """Measured: cp2 with debug_moe fails in TorchTitan's CP-wrapped SDPA on CPU (runner.config.family_support);
    the same layout validates for a GPU cluster."""
    cfg = compose(["model=debug_moe", "parallelism=ep2", "parallelism.cp=2"])
    with pytest.raises(validate.ConfigError) as e:
        validate.check(cfg)
    assert "parallelism.cp = 2: on CPU, ring attention covers the fused SDPA kernel; latent attention's query/key heads" in str(e.value)
    assert "aten.add.Tensor got mixed torch.Tensor and DTensor" in str(e.value) and "(1 problem)" in str(e.value)
    gpu = compose(
        ["model=debug_moe", "parallelism=ep2", "parallelism.cp=2", "parallelism.dp_shard=4", "cluster=h100_node", "precision=bf16"]
    )
    assert validate.check(gpu).describe() == "dp_shard=4 x cp=2 x ep=2"


def test_405b_long_context_layout_world_size(compose):
    cfg = compose(LONG_405B)
    lay = validate.check(cfg)
    assert (lay.tp, lay.pp, lay.cp, lay.dp_shard, lay.world_size) == (8, 16, 16, 8, 16_384)  # 8 x 16 x 16 x 8
    bad = compose([*LONG_405B, "cluster.num_nodes=128"])  # h100x1024 as shipped: 1,024 GPUs < 2,048 = tp x pp x cp
    with pytest.raises(validate.ConfigError, match="does not divide the world size 1024"):
        validate.check(bad)


def test_plan_cp_traffic_of_the_405b_long_context_layout(compose):
    cfg = compose(LONG_405B)
    b = plan.compute(cfg, validate.check(cfg))
    # K and V of one 8,192-token chunk, 8 KV heads x 128 dims in bf16, over tp = 8: 8192 x 8 x 128 x 2 / 8 bytes;
    # passed cp-1 = 15 times, 6 transfers (K, V forward; K, V, dK, dV backward), 126/16 layers, 16 microbatches
    kv = 8192 * 8 * 128 * 2 / 8
    assert b["cp_comm_gb"] == pytest.approx(126 / 16 * 16 * 15 * 6 * kv / 1e9)
    assert b["links"]["cp"] == "scale-out"  # a CP group spans 16 nodes (TP fills each)
    assert b["cp_comm_s"] == pytest.approx(b["cp_comm_gb"] / 50.0)  # 50 GB/s each way of the 100 GB/s scale-out port
    rows = {r[0]: r for r in plan.rows(b)}
    assert rows["CP traffic"][1] == f"{b['cp_comm_s']:.3f} s" and "ring attention K/V" in rows["CP traffic"][2]
    assert "EP traffic" not in rows


def test_plan_ep_traffic_of_the_moe_model(compose):
    cfg = compose(["model=debug_moe", "parallelism=ep2", "training.seq_len=64"])
    b = plan.compute(cfg, validate.check(cfg))
    # 5 MoE blocks x 2 microbatches x 4 all-to-alls x (2 x 64 tokens x 3 experts x 256 dims x 4 B) x (ep-1)/ep
    assert b["ep_comm_gb"] == pytest.approx(5 * 2 * 4 * (2 * 64 * 3 * 256 * 4) / 2 / 1e9)
    rows = {r[0]: r for r in plan.rows(b)}
    assert rows["EP traffic"][2] == "0.01 GB token exchange (standard), intra-node; 10 host syncs a step"
    assert "CP traffic" not in rows
    assert b["flops_per_token"] == flops.flops_per_token(cfg.model, 64, cfg.plan.flops_convention)


# ---- parallelism.moe_comm_backend (issue 56 item 6) -------------------------------------------------------------------

EP2_GPU = ["model=debug_moe", "parallelism=ep2", "cluster=h100_node", "cluster.devices_per_node=2", "precision=bf16"]
BAD_BACKEND = [
    (
        ["model=debug_moe", "parallelism=ep2", "parallelism.moe_comm_backend=deepep"],
        "parallelism.moe_comm_backend = deepep: deepep runs DeepEP's CUDA kernels (the deep_ep library, built against NVSHMEM); "
        "cluster local_cpu computes on cpu with gloo, which has none of them. Fix: use parallelism.moe_comm_backend=standard here",
    ),
    (
        ["model=debug_moe", "parallelism=ep2", "parallelism.moe_comm_backend=minimal_async_ep"],
        "minimal_async_ep copies tokens to peers through CUDA symmetric memory (torch.distributed._symmetric_memory's CUDA backend)",
    ),
    (
        [*EP2_GPU, "parallelism.moe_comm_backend=minimal_async_ep"],
        "TorchTitan runs minimal_async_ep only with every block recomputed; training.activation_checkpoint = none. "
        "Fix: set training.activation_checkpoint=full",
    ),
    (
        [*EP2_GPU, "parallelism.moe_comm_backend=minimal_async_ep", "training.activation_checkpoint=full", "parallelism.ep=8"]
        + ["parallelism.dp_shard=8", "cluster.num_nodes=4"],
        "minimal_async_ep maps its peers' buffers through CUDA IPC, inside one node; EP groups of 8 do not fit nodes of 2 devices",
    ),
    ([*EP2_GPU, "parallelism.moe_comm_backend=hybridep", "cluster.compute_capability=8.0"], "hybridep's kernels need SM 9.0 or newer"),
    (
        [*EP2_GPU, "parallelism.moe_comm_backend=hybridep", "mode=dryrun", "dryrun.device=cuda"],
        "the dry run plays a rank on fake tensors, on which hybridep's kernels do not run; mode=plan counts its host reads",
    ),
    (
        [*EP2_GPU, "parallelism.moe_comm_backend=deepep", "precision.experts=fp8_rowwise"],
        "precision.experts = fp8_rowwise pads each expert's token group, which only TorchAO's all-to-all dispatcher and "
        "HybridEP do (TorchTitan's swap_token_dispatcher raises for deepep's dispatcher)",
    ),
    (
        [*EP2_GPU, "parallelism.moe_comm_backend=deepep", "parallelism.ep=1"],
        "deepep exchanges tokens between expert-parallel ranks, and parallelism.ep = 1",
    ),
]


@pytest.mark.parametrize("overrides,message", BAD_BACKEND, ids=[" ".join(o[-3:]) for o, _ in BAD_BACKEND])
def test_a_moe_comm_backend_is_refused_where_it_cannot_run(refusal, overrides, message):
    assert message in refusal(overrides)


def test_deepep_validates_for_a_cuda_cluster_and_its_library_is_checked_at_launch(compose, monkeypatch):
    """On an H100 node deepep, hybridep and minimal_async_ep (with full AC) validate; the launch's MACHINE rule then asks
    whether this node imports deep_ep (faked both ways: the test must not depend on what this machine has)."""
    import importlib.util

    from runner.config.validate import moe_comm_rules

    for backend, extra in (("deepep", []), ("hybridep", []), ("minimal_async_ep", ["training.activation_checkpoint=full"])):
        assert validate.check(compose([*EP2_GPU, f"parallelism.moe_comm_backend={backend}", *extra])).describe() == "dp_shard=2 x ep=2"
    cfg = compose([*EP2_GPU, "parallelism.moe_comm_backend=deepep"])
    out = []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    moe_comm_rules.installed(cfg, out)
    assert [str(p) for p in out] == [
        "parallelism.moe_comm_backend = deepep: deepep needs the deep_ep library, which this node's Python cannot import. "
        "Fix: install DeepEP (github.com/deepseek-ai/DeepEP, built against NVSHMEM) on every node, "
        "or use parallelism.moe_comm_backend=standard."
    ]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    out.clear()
    moe_comm_rules.installed(cfg, out)
    assert out == []


@pytest.mark.parametrize(
    "backend,ac,rows,syncs",
    [
        ("standard", "none", 3 / 2, 10),  # 3 experts, half of them on the other rank; one read per block per microbatch
        ("standard", "full", 3 / 2, 20),  # the recomputed forward reads the splits again
        ("minimal_async_ep", "full", 3 / 2, 0),
        ("deepep", "none", 1 - 4 / 56, 10),  # the other rank holds one of the 3 experts unless all 3 are local: C(4,3)/C(8,3)
        ("hybridep", "none", 1 - 4 / 56, 0),
    ],
)
def test_plan_prices_each_backends_token_exchange_and_counts_its_host_reads(compose, backend, ac, rows, syncs):
    """debug_moe ep2, seq 64: 5 MoE blocks x 2 microbatches x 4 exchanges (+2 recomputed) x 2 x 64 tokens x `rows` rows
    to the other rank x 256 dims x 2 B (bf16); host reads per step as runner.estimate.moe_comm counts them."""
    cfg = compose([*EP2_GPU, f"parallelism.moe_comm_backend={backend}", f"training.activation_checkpoint={ac}", "training.seq_len=64"])
    b = plan.compute(cfg, validate.check(cfg))
    exchanges = 4 + (2 if ac != "none" else 0)
    assert b["ep_comm_gb"] == pytest.approx(5 * 2 * exchanges * 2 * 64 * rows * 256 * 2 / 1e9)
    assert b["moe_host_syncs"] == syncs and b["moe_comm_backend"] == backend
    want = f"{syncs} host syncs a step" if syncs else "no host sync"
    assert {r[0]: r for r in plan.rows(b)}["EP traffic"][2].endswith(f"({backend}), intra-node; {want}")


def test_each_backend_reaches_titans_token_dispatchers(compose, monkeypatch):
    """The run's model config (runner.run.titan.build.model_config) holds TorchTitan's dispatcher of the backend in every
    MoE block, its buffers sized by TorchTitan's update_from_config (a DP rank's 4 samples of 256 tokens, dim 256)."""
    import importlib

    build = importlib.import_module("runner.run.titan.build")
    from runner.schema import layout

    want = {
        "standard": ("AllToAllTokenDispatcher", None),
        "minimal_async_ep": ("MinimalAsyncEPTokenDispatcher", 1024),
        "deepep": ("DeepEPTokenDispatcher", 1024),
        "hybridep": ("HybridEPTokenDispatcher", 1024),
    }
    for backend, (cls, tokens) in want.items():
        cfg = compose([*EP2_GPU, f"parallelism.moe_comm_backend={backend}", "training.activation_checkpoint=full"])
        spec, *_ = build.model_config(cfg, layout.resolve(cfg.parallelism, cfg.cluster), materialize=False)
        dispatchers = [layer.moe.routed_experts.token_dispatcher for layer in spec.model.layers if layer.moe is not None]
        assert len(dispatchers) == 5 and {type(d).__qualname__ for d in dispatchers} == {f"{cls}.Config"}, backend
        assert {getattr(d, "num_max_tokens_per_rank", None) for d in dispatchers} == {tokens}, backend
    assert dispatchers[0].non_blocking_capacity_factor == 1.0  # hybridep without a host read, as TorchTitan's configs run it
    # FP8 experts: the converter swaps the backend's dispatcher for its padding twin (TorchAO's, HybridEP's with pad 16)
    from torchtitan.components.quantization import float8

    monkeypatch.setattr(float8, "has_cuda_capability", lambda *_: True)  # an H100's SM 9.0, which this CPU machine lacks
    for backend, cls in (("standard", "TorchAOTokenDispatcher"), ("hybridep", "HybridEPTokenDispatcher")):
        cfg = compose([*EP2_GPU, f"parallelism.moe_comm_backend={backend}", "precision.experts=fp8_rowwise"])
        spec, *_ = build.model_config(cfg, layout.resolve(cfg.parallelism, cfg.cluster), materialize=False)
        dispatchers = [layer.moe.routed_experts.token_dispatcher for layer in spec.model.layers if layer.moe is not None]
        assert {type(d).__qualname__ for d in dispatchers} == {f"{cls}.Config"} and {d.pad_multiple for d in dispatchers} == {16}, backend
