"""Every TorchTitan flavor is a model option: conf/model/ and the table in docs/models.md are what scripts/gen_models.py
writes from the registries, and runner.estimate.flops counts what TorchTitan counts (total and active parameters,
FLOPs per token) for every one of them, built on the meta device."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import re

import pytest

from runner.config import families, validate
from runner.estimate import flops, memory
from runner.schema import ModelConfig
from runner.schema.problems import ConfigError
from tests.conftest import ROOT
from tests.gen_models import gen


@functools.cache
@functools.cache
def registry_fields() -> dict[str, dict]:
    return gen().all_fields()


OPTIONS = [
    (name, flavor) for name, fam in families.FAMILIES.items() for flavor in fam.flavors
]  # the flavors runner.config.families lists; test_flavor_lists_are_titans checks them against the registries
SEQ_LENS = (2048, 8192)


def test_flavor_lists_are_titans():
    for name, fam in families.FAMILIES.items():
        if fam.kernel_package and importlib.util.find_spec(fam.kernel_package) is None:
            with pytest.raises(ImportError):  # the reason for the placeholders, and proof that none stayed behind
                importlib.import_module(f"torchtitan.models.{name}")
        assert tuple(gen().registry(name)[1]) == fam.flavors, name


def test_model_files_are_the_registry():
    """No hand-kept copy: every file under conf/model/ is the generator's output for the registry, and nothing else is there."""
    wanted = gen().model_files(registry_fields())
    on_disk = {p: p.read_text() for p in (ROOT / "conf" / "model").glob("*.yaml")}
    assert sorted(on_disk) == sorted(wanted)
    stale = [p.name for p in wanted if on_disk[p] != wanted[p]]
    assert stale == [], "run .venv/bin/python scripts/gen_models.py"


def test_model_table_is_generated():
    g = gen()
    assert g.models_doc_text(g.model_table(registry_fields())) == g.MODELS_DOC.read_text(), "run .venv/bin/python scripts/gen_models.py"


@contextlib.contextmanager
def no_rope_tables():
    """RoPE tables are buffers, not parameters, and computing them is most of a meta build's time: skip them."""
    import torch
    from torchtitan.models.common import rope

    kinds = [k for k in vars(rope).values() if isinstance(k, type) and "_precompute_cache" in vars(k)]
    originals = {k: k._precompute_cache for k in kinds}
    for k in kinds:
        k._precompute_cache = lambda self: torch.empty(0)
    try:
        yield
    finally:
        for k, f in originals.items():
            k._precompute_cache = f


@functools.cache
def titan_counts(family: str, flavor: str) -> tuple[int, int, tuple[int, ...]]:
    """(total, active, FLOPs per token at SEQ_LENS) as TorchTitan's model computes them, text tower only: the
    active count is the one get_moe_model_nparams_and_flops logs (dense models: the total)."""
    import torch
    from torchtitan.models import utils

    with gen().kernel_placeholders(family), torch.device("meta"), no_rope_tables():
        cfg = gen().registry(family)[0].model_registry(flavor).model
        model = cfg.build()
    vision = sum(p.numel() for n, p in model.named_parameters() if "vision_encoder" in n)
    logged: list[str] = []
    original = utils.logger
    utils.logger = type("Recorder", (), {"info": lambda self, msg: logged.append(msg)})()
    try:
        results = [cfg.get_nparams_and_flops(model, s) for s in SEQ_LENS]
    finally:
        utils.logger = original
    total = results[0][0] - vision
    active = int(re.search(r"active ([\d,]+)", logged[0]).group(1).replace(",", "")) if logged else total
    return total, active, tuple(f for _, f in results)


@pytest.mark.parametrize("family,flavor", OPTIONS, ids=[f"{a}-{b}" for a, b in OPTIONS])
def test_counts_equal_titans(family, flavor):
    m = ModelConfig(**registry_fields()[gen().option_name(family, flavor)])
    total, active, per_token = titan_counts(family, flavor)
    assert flops.num_params(m) == total
    assert flops.num_active_params(m) == active
    assert tuple(flops.flops_per_token(m, s, "titan") for s in SEQ_LENS) == per_token


ROPE_FLAVORS = [(f, "debugmodel") for f in families.FAMILIES] + [("qwen3_5", "35B-A3B"), ("gpt_oss", "120b")]


@pytest.mark.parametrize("family,flavor", ROPE_FLAVORS, ids=[f"{a}-{b}" for a, b in ROPE_FLAVORS])
def test_rope_tables_are_titans_buffers(family, flavor):
    """The plan's RoPE tables of a whole model (runner.estimate.memory: a table per softmax block, complex64 or fp32
    cos and sin, model.rope_dim wide) are the bytes of the `cache` buffers TorchTitan's model builds on the meta device.
    The generator once wrote rope_cos_sin false for every flavor (it read the name of the registry's nested Config
    class): gpt-oss's and Qwen3's tables were planned at half their size, Qwen3.5's at 8 times (all 40 blocks of the
    35B-A3B, its whole 256-wide heads; TorchTitan: 10 softmax blocks rotating 64 dims)."""
    import torch

    with gen().kernel_placeholders(family), torch.device("meta"):
        model = gen().registry(family)[0].model_registry(flavor).model.build()
    built = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith("rope.cache"))
    m = ModelConfig(**registry_fields()[gen().option_name(family, flavor)])
    assert memory.rope_tables(m, m.num_layers) * m.rope_max_seq_len * memory.rope_bytes_per_position(m) == built


def test_published_totals(compose):
    """The model cards' figures come out of the torch-free counts."""

    def counts(option):
        m = compose([f"model={option}", "parallelism=single"]).model
        return flops.num_params(m) / 1e9, flops.num_active_params(m) / 1e9, m

    total, active, _ = counts("deepseek_v3_671b")
    assert (round(total), round(active)) == (671, 38)  # report: 671B total, 37B activated (without the 0.9B embedding: 36.7B)
    total, active, _ = counts("qwen3_235b_a22b")
    assert (round(total), round(active)) == (235, 22)
    total, active, m = counts("gpt_oss_120b")
    assert round(total, 1) == 116.8
    # the model card's 5.1B active counts the unembedding but not the embedding table (0.58B)
    assert round(active - flops.embedding_params(m) / 1e9, 2) == 5.13


# recipe, (world size, tokens per step, microbatches per pipeline, bubble as p-1 over v*m+p-1, devices in one EP group)
RECIPES = {
    "deepseek_v3_671b_h800x2048": (2048, 15360 * 4096, 60, (15, 2 * 60 + 15), "scale-out"),  # EP 64 spans 8 nodes
    "qwen3_235b_a22b_h100x1024": (1024, 4096 * 4096, 32, (7, 2 * 32 + 7), "intra-node"),
    "gpt_oss_120b_h100x64": (64, 1024 * 4096, 64, (3, 64 + 3), "intra-node"),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recipe_plans(compose, budget, recipe):
    """Each large-MoE recipe validates and plans: tokens, bubble, memory within the GPU with the routed experts
    split over EP, the EP all-to-all volume and the step time at the cluster's MFU on active parameters, by hand."""
    world, tokens, micro, (bubble_num, bubble_den), ep_link = RECIPES[recipe]
    cfg = compose([f"recipe={recipe}"])
    m, p, t, c = cfg.model, cfg.parallelism, cfg.training, cfg.cluster
    b = budget([f"recipe={recipe}"])
    assert (b["world_size"], b["tokens_per_step"], b["microbatches"]) == (world, tokens, micro)
    assert b["bubble_fraction"] == pytest.approx(bubble_num / bubble_den)
    assert b["fits_memory"] and b["total_gb_per_gpu"] < c.device_memory_gb
    # every MoE block of a pipeline rank sends each token's top-k copies out and back, forward, backward and in
    # the recomputed forward: 6 all-to-alls of k x dim bf16 values per token, (ep - 1) / ep of them off the rank
    per_token = m.num_experts_per_token * m.dim * 2 * 6 * (p.ep - 1) / p.ep
    assert b["ep_comm_gb"] * 1e9 == pytest.approx(flops.num_moe_layers(m) / p.pp * micro * t.microbatch_size * t.seq_len * per_token)
    assert b["ep_link"] == ep_link
    # FSDP: with PP each stage's weights are gathered (bf16) once and its gradients reduce-scattered (fp32) once a
    # step, over dp_shard; an EP rank holds 1/ep of the routed experts, so only those travel
    stage_params = flops.params_per_ep_rank(m, p.ep) / p.pp
    f = validate.check(cfg).dp_shard
    assert b["dp_comm_gb"] * 1e9 == pytest.approx(stage_params * (2 + 4) * (f - 1) / f)
    step_flops = tokens * 6 * flops.num_active_params(m)
    peak = c.peak_tflops["bfloat16"]  # MFU is against the bf16 dense peak for every precision (FP8 recipes included)
    assert b["step_time_s"] == pytest.approx(step_flops / (world * peak * 1e12 * c.achievable_mfu))


def test_deepseek_v3_recipe_is_the_reports_layout(compose, budget):
    """PP 16 (Interleaved1F1B: 2 stages per rank, as TorchTitan's deepseek_v3_671b() schedules it; the report's DualPipe
    does not fit with torch's split backward, tests/test_v_schedule_memory.py), EP 64, 128-way data parallelism on
    2,048 H800s, FP8; experts split 64 ways: each GPU holds 4 of the 256 routed experts of its blocks, and their
    weights do not fill its memory."""
    cfg = compose(["recipe=deepseek_v3_671b_h800x2048"])
    p = cfg.parallelism
    assert (p.pp, p.ep, p.dp_shard, p.tp, p.pp_schedule, p.pp_virtual_stages) == (16, 64, 128, 1, "Interleaved1F1B", 2)
    assert (cfg.cluster.intra_node_bandwidth_gbs, cfg.cluster.peak_tflops["bfloat16"]) == (400.0, 989.0)
    b = budget(["recipe=deepseek_v3_671b_h800x2048"])
    assert b["layers_per_stage"] == [1, *[2] * 30, 0]
    lay = validate.check(cfg)
    m = cfg.model
    # a middle rank holds stages i and 16 + i: 4 MoE blocks, their routed experts / 64, gathered in bf16 with fp32 gradients
    block = flops.attention_params(m) + flops.moe_ffn_params(m) + 2 * m.dim - flops.routed_expert_params(m) * 63 / 64
    assert memory.stage(cfg, lay, 60, 8)["weights_grads"] == pytest.approx(4 * block * (2 + 4))
    # rank 0 holds the embedding and dense block 0 (stage 0) and MoE blocks 31-32 (stage 16); pipeline rank 15 MoE blocks
    # 29-30 (stage 15) and the norm, the head and the loss (stage 31)
    head = m.dim + m.vocab_size * m.dim
    dense_block = flops.attention_params(m) + 3 * m.dim * m.ffn_hidden_dim + 2 * m.dim
    assert memory.stage(cfg, lay, 60, 0)["params"] == pytest.approx(flops.embedding_params(m) + dense_block + 2 * block)
    assert memory.stage(cfg, lay, 60, 15)["params"] == pytest.approx(2 * block + head)
    # the report's MTP depth 1 cannot join this PP 16 layout: TorchTitan 0.3.0 refuses MTP under PP (the file says so)
    with pytest.raises(ConfigError) as refused:
        validate.check(compose(["recipe=deepseek_v3_671b_h800x2048", "model.num_mtp_layers=1"]))
    pp = [p for p in refused.value.problems if p.field == "parallelism.pp"]
    assert len(pp) == 1 and "multi-token prediction with pipeline parallelism" in pp[0].why
    assert "TorchTitan 0.3.0 refuses MTP under pipeline parallelism" in (ROOT / "recipes/deepseek_v3_671b_h800x2048.yaml").read_text()


@pytest.mark.parametrize(
    "overrides,field,words",
    [
        # Qwen3-30B-A3B: 32 query heads over 4 KV heads, so TP splits at most 4 ways
        (["model=qwen3_30b_a3b", "parallelism=single", "parallelism.tp=8"], "parallelism.tp", "use tp in [1, 2, 4]"),
        # gpt-oss-120b: 128 routed experts do not split 3 ways
        (["model=gpt_oss_120b", "parallelism=single", "parallelism.ep=3"], "parallelism.ep", "model.num_experts = 128"),
        # Qwen3's head_dim is its own: 16 heads of 128 on a 1,024 width is valid, but not 15 heads over 8 KV heads
        (["model=qwen3_0_6b", "parallelism=single", "model.num_heads=15"], "model.num_kv_heads", "must divide model.num_heads = 15"),
        (["model=gpt_oss_debugmodel", "parallelism=single", "model.full_attention_interval=0"], "model.full_attention_interval", ">= 1"),
        (["model=qwen3_5_debugmodel", "parallelism=single"], "model.name", "Triton kernels, which need a GPU"),
        (["model=debug", "parallelism=single", "model.flavor=2B"], "model.flavor", "use one of debugmodel, 1B, 3B, 8B, 70B, 405B"),
        # an MoE model whose blocks are all MoE needs no dense hidden size; a dense one does
        (["model=qwen3_8b", "parallelism=single", "model.ffn_hidden_dim=0"], "model.ffn_hidden_dim", "every block of a dense model"),
    ],
)
def test_family_rules(compose, overrides, field, words):
    from runner.schema.problems import ConfigError

    with pytest.raises(ConfigError) as err:
        validate.check(compose(overrides))
    problems = [p for p in err.value.problems if p.field == field]
    assert problems and words in f"{problems[0].why} {problems[0].fix}", err.value


def test_head_dim_apart_from_width_validates(compose):
    """Qwen3 0.6B: 16 heads of 128 on a width of 1,024 (not 1,024 / 16 = 64), and the MoE flavors without dense blocks."""
    for option in ("qwen3_0_6b", "qwen3_30b_a3b"):
        validate.check(compose([f"model={option}", "parallelism=single"]))
    # gpt-oss and Qwen3.5 are rejected on CPU ranks only (runner.config.family_support)
    gpu = ["cluster=h100_node", "parallelism=fsdp", "precision=bf16", "training.global_batch_size=16"]
    validate.check(compose(["model=gpt_oss_20b", *gpu]))
    validate.check(compose(["model=qwen3_5_9b", *gpu]))


DEBUG_FLAVORS = [(name, f) for name, fam in families.FAMILIES.items() for f in fam.flavors if f.startswith("debugmodel")]


@pytest.mark.parametrize("family,flavor", DEBUG_FLAVORS, ids=[f"{a}-{b}" for a, b in DEBUG_FLAVORS])
def test_no_decay_switch_takes_every_1d_parameter_and_the_embeddings(family, flavor):
    """optimizer.no_decay_1d_and_embeddings' group (runner.run.titan.optim.NO_DECAY) takes exactly the token embeddings
    and the parameters that are 1-D per unit (a grouped expert weight counts per expert): gpt-oss's attention sinks and
    expert biases included, which it once decayed. Every family's debug flavors, built on the meta device."""
    import torch

    from runner.run.titan.optim import NO_DECAY

    with gen().kernel_placeholders(family), torch.device("meta"), no_rope_tables():
        model = gen().registry(family)[0].model_registry(flavor).model.build()
    wanted, taken = set(), set()
    for name, p in model.named_parameters():
        per_unit = p.ndim - ("inner_experts" in name)  # (experts, ...) holds one tensor per expert
        if per_unit == 1 or name.startswith("tok_embeddings."):
            wanted.add(name)
        if re.search(NO_DECAY, name):
            taken.add(name)
    assert taken == wanted, (sorted(taken - wanted)[:5], sorted(wanted - taken)[:5])
    if family == "gpt_oss":
        assert {"layers.0.attention.sinks", "layers.0.moe.routed_experts.inner_experts.mlp1_bias_EG"} <= taken
