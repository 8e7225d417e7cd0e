"""Start from Hugging Face weights (model.init_from, issue 29 section 1), checked against transformers without a download.

The tiny random models of tests/hf_models.py are saved with save_pretrained and trained from, for one step, inside the
launches of runner.run.layout_parity that tests/test_parallel.py and tests/test_family_train.py already make (conftest's
parity_runs, one per rank count): `single` (1 rank) for every model, `ep2` for the MoE models (2 ranks), and the
4-rank `dp2_tp2`, `tp2_pp2` and `hsdp2x2` on the models HF_ONLY names (the points: tests/points.py). The first step's
loss must equal transformers' loss on the same tokens within 1e-5 relative (fp32; measured <= 1.1e-7, the float32
rounding of the logged loss).

Refusals run in this process through the CLI's main (tests/in_process.py's `cli`): exit 2, every problem named with
both values and the fix, no traceback, no run folder left.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

import runner.config.validate.hf_rules as hf_rules
from runner.config import freeze, validate
from runner.formats import hf_folder
from runner.schema.problems import ConfigError
from tests import hf_models
from tests.in_process import cli as _here
from tests.points import HF_LAYOUTS as LAYOUTS
from tests.points import HF_RESUMED as RESUMED
from tests.points import hf_layouts as _layouts

LOSS_RTOL = 1e-5
POINTS = [(n, p) for n in hf_models.TINY for k in LAYOUTS for p in _layouts(n, k)]


@pytest.fixture(scope="module")
def reference(parity_runs, hf_folders) -> dict[str, float]:
    """transformers' loss of each saved model (read back with from_pretrained) on the first step's tokens: the 4
    synthetic samples of seed 0 (runner.run.loader.sample), inputs and labels shifted by one."""
    import torch
    import transformers

    from runner.run import loader

    tokens = torch.stack([loader.sample(0, i, 64, 2048) for i in range(4)])
    out = {}
    for name in hf_models.TINY:
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_folders[name], dtype=torch.float32, attn_implementation="eager")
        out[name] = hf_models.hf_loss(model.eval(), tokens[:, :-1], tokens[:, 1:])
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("name, par", POINTS, ids=[f"{n}-{p}" for n, p in POINTS])
def test_first_step_loss_is_transformers_loss(parity_runs, reference, name, par):
    got = parity_runs[f"hf-{name}-{par}"]
    assert got["rows"][0]["step"] == 1
    assert got["rows"][0]["loss"] == pytest.approx(reference[name], rel=LOSS_RTOL)
    assert all(r is not None and r["tensors"] > 0 for r in got["hf_init"])  # every rank read its share


@pytest.mark.e2e
def test_each_pipeline_stage_reads_only_its_blocks(parity_runs):
    """tp2_pp2: ranks 0-1 hold stage 0 (embedding + blocks 0-2 of Llama 3's 6), ranks 2-3 stage 1 (blocks 3-5, norm, head)."""
    reads = parity_runs["hf-llama3_gqa-tp2_pp2"]["hf_init"]
    assert [r["blocks"] for r in reads] == [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]
    assert "model.embed_tokens.weight" in reads[0]["keys"] and "lm_head.weight" not in reads[0]["keys"]
    assert "lm_head.weight" in reads[2]["keys"] and "model.embed_tokens.weight" not in reads[2]["keys"]
    dsv3 = parity_runs["hf-deepseek_v3-tp2_pp2"]["hf_init"]
    assert [r["blocks"] for r in dsv3] == [[0], [0], [1], [1]]


MAX_SHARE = 0.6
"""The largest part of the model one rank of a 2- or 4-rank layout may read (measured <= 0.58)."""
SHARDED = ["hf-llama3_gqa-dp2_tp2", "hf-qwen3-dp2_tp2", "hf-qwen3_moe-ep2", "hf-deepseek_v3-ep2", "hf-llama3_gqa-hsdp2x2"]


@pytest.mark.e2e
@pytest.mark.parametrize("point", SHARDED)
def test_no_rank_reads_the_whole_model(parity_runs, point):
    """Under FSDP x TP, EP and HSDP each rank reads a part of the checkpoint. Not exactly 1/ranks (measured: 0.26-0.44 of
    the one-rank read under dp2_tp2, 0.5-0.58 under ep2 and hsdp2x2): tensors the layout replicates (norms, routers)
    and the ones TorchTitan's to_hf re-lays to rename or permute are read whole; MAX_SHARE bounds it."""
    one = parity_runs[f"hf-{point.split('-')[1]}-single"]["hf_init"][0]["local_elements"]
    ranks = [r["local_elements"] for r in parity_runs[point]["hf_init"]]
    assert all(n <= MAX_SHARE * one for n in ranks), (ranks, one)


@pytest.mark.e2e
def test_a_resume_takes_precedence_over_init_from(parity_runs):
    """The resumed point starts at step 2 from the checkpoint of step 1 (weights and AdamW moments): its step-2 loss is
    the uninterrupted run's. Had it loaded the HF weights instead it would read them for step 2 (no hf_init is recorded)."""
    resumed, whole = parity_runs[RESUMED], parity_runs["hf-llama3-two-steps"]
    assert [r["step"] for r in resumed["rows"]] == [2] and resumed["hf_init"] == [None]
    assert resumed["rows"][0]["loss"] == pytest.approx(whole["rows"][1]["loss"], rel=1e-7)
    assert whole["rows"][1]["loss"] != pytest.approx(whole["rows"][0]["loss"], rel=1e-4)


@pytest.mark.e2e
def test_step_zero_says_it_started_from_hf(parity_runs, parity_consoles, hf_folders):
    console, folder = parity_consoles[1], hf_folders["llama3"]
    sha = hashlib.sha256((folder / hf_folder.CONFIG).read_bytes()).hexdigest()
    assert f"step 0: started from Hugging Face weights in {folder} (config.json sha256 {sha};" in console
    started = [n for n in parity_runs if n.startswith("hf-") and (n.endswith("-single") or n == "hf-llama3-two-steps")]
    assert console.count("step 0: started from Hugging Face weights") == len(started) == 6  # 5 singles and the two-step run


# --- refusals: mode=validate reads config.json and the index, the launch also the shards' headers ---------------


def _config_only(tmp_path: Path, name: str, index: bool = True, **changes) -> Path:
    """A folder with TINY[name]'s config.json (with `changes`) and an index naming one shard that is not there."""
    folder = tmp_path / f"hf-{name}"
    folder.mkdir()
    config = hf_models.hf_config(name).to_dict() | changes
    (folder / hf_folder.CONFIG).write_text(json.dumps(config))
    if index:
        (folder / hf_folder.INDEX).write_text(
            json.dumps({"metadata": {}, "weight_map": {"lm_head.weight": "model-00001-of-00001.safetensors"}})
        )
    return folder


def _refused(monkeypatch, capsys, tmp_path, *argv: str) -> str:
    run = tmp_path / "run"
    code, err = _here(monkeypatch, capsys, *argv, f"hydra.run.dir={run}")
    assert code == 2 and "Traceback" not in err and not run.exists(), err
    return err


@pytest.mark.parametrize(
    "change, field, run_value, hf_text",
    [
        ({"hidden_size": 512}, "model.dim", 256, "hidden_size = 512"),
        ({"num_hidden_layers": 4}, "model.num_layers", 6, "num_hidden_layers = 4"),
        ({"num_attention_heads": 8}, "model.num_heads", 16, "num_attention_heads = 8"),
        ({"num_key_value_heads": 8}, "model.num_kv_heads", 16, "num_key_value_heads = 8"),
        ({"vocab_size": 4096}, "model.vocab_size", 2048, "vocab_size = 4096"),
        ({"intermediate_size": 1024}, "model.ffn_hidden_dim", 768, "intermediate_size = 1024"),
        ({"tie_word_embeddings": True}, "model.weight_tying", "False", "tie_word_embeddings = True"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0}}, "model.rope_theta", 500000.0, "rope_theta = 10000.0"),
    ],
)
def test_an_architecture_mismatch_is_refused(monkeypatch, capsys, tmp_path, change, field, run_value, hf_text):
    folder = _config_only(tmp_path, "llama3", **change)
    err = _refused(monkeypatch, capsys, tmp_path, *hf_models.overrides("llama3", folder), "mode=validate")
    assert f"{field} = {run_value}: {folder}/config.json has {hf_text}: the run's model is not the checkpoint's" in err
    assert f"Fix: set {field}=" in err


def test_moe_and_latent_numbers_are_compared(monkeypatch, capsys, tmp_path):
    folder = _config_only(tmp_path, "deepseek_v3", n_routed_experts=32, kv_lora_rank=256, n_shared_experts=1)
    err = _refused(monkeypatch, capsys, tmp_path, *hf_models.overrides("deepseek_v3", folder), "mode=validate")
    for line in ("model.num_experts = 16:", "n_routed_experts = 32", "model.kv_lora_rank = 512:", "model.num_shared_experts = 2:"):
        assert line in err


def test_mtp_depths_the_folder_lacks_are_refused(monkeypatch, capsys, tmp_path, compose):
    """The MTP blocks are read from model.layers.{num_layers + k} where config.json's num_nextn_predict_layers says the
    checkpoint has them (DeepSeek-V3's has 1); a run may leave them out (model.num_mtp_layers=0), not ask for more."""
    folder = _config_only(tmp_path, "deepseek_v3")  # num_nextn_predict_layers = 0
    err = _refused(monkeypatch, capsys, tmp_path, *hf_models.overrides("deepseek_v3", folder), "model.num_mtp_layers=1", "mode=validate")
    assert f"model.num_mtp_layers = 1: {folder}/config.json has num_nextn_predict_layers = 0" in err
    assert "Fix: set model.num_mtp_layers=0" in err
    (tmp_path / "mtp").mkdir()
    with_mtp = _config_only(tmp_path / "mtp", "deepseek_v3", num_nextn_predict_layers=1)
    for depth in (0, 1):
        problems = []
        hf_rules.folder(compose([*hf_models.overrides("deepseek_v3", with_mtp), f"model.num_mtp_layers={depth}"]).model, problems)
        assert [p.field for p in problems if p.field == "model.num_mtp_layers"] == []


def test_deepseek_v3_needs_the_sigmoid_router(monkeypatch, capsys, tmp_path):
    folder = _config_only(tmp_path, "deepseek_v3", topk_group=2)
    err = _refused(monkeypatch, capsys, tmp_path, *hf_models.overrides("deepseek_v3", folder), "mode=validate")
    assert f"model.flavor = 671B: {folder}/config.json has topk_group = 2, the flavor's router 4" in err
    err = _refused(monkeypatch, capsys, tmp_path, *hf_models.overrides("deepseek_v3", folder), "model.flavor=debugmodel", "mode=validate")
    assert "model.flavor = debugmodel: TorchTitan's deepseek_v3 debugmodel routes with softmax scores" in err
    assert "Fix: set model.flavor to 671B (the router; model.* keep the numbers)" in err


def test_the_router_table_is_the_registrys(compose):
    """runner.formats.hf_folder.ROUTERS against TorchTitan: the flavors listed route with sigmoid scores over those groups, every
    other flavor of the family with softmax."""
    from runner.run.titan.model import model_spec

    for family, flavors in hf_folder.ROUTERS.items():
        for option in sorted(Path(__file__).resolve().parent.parent.glob(f"conf/model/{family}_*.yaml")):
            m = compose([f"model={option.stem}"]).model
            router = next(la.moe for la in model_spec(m).model.layers if la.moe is not None).router
            got = {"n_group": router.num_expert_groups, "topk_group": router.num_limited_groups}
            got |= {"routed_scaling_factor": router.route_scale, "norm_topk_prob": router.route_norm}
            assert (router.score_func == "sigmoid") == (m.flavor in flavors), option.stem
            assert m.flavor not in flavors or got == flavors[m.flavor], option.stem


def test_the_tiny_models_match_their_overrides(compose, tmp_path):
    """Each tiny model's config.json describes the runner model of its overrides: validation (which reads it) passes."""
    for name in hf_models.TINY:
        folder = _config_only(tmp_path, name)
        validate.check(compose([*hf_models.overrides(name, folder), "mode=validate"]))


def test_another_family_is_refused(monkeypatch, capsys, tmp_path):
    folder = _config_only(tmp_path, "qwen3")
    err = _refused(monkeypatch, capsys, tmp_path, *hf_models.overrides("llama3", folder), "mode=validate")
    assert f"model.name = llama3: {folder}/config.json is a qwen3 checkpoint (model_type). Fix: use model=<a qwen3 option>" in err


def test_a_folder_without_weights_is_refused(monkeypatch, capsys, tmp_path):
    folder = _config_only(tmp_path, "llama3", index=False)
    err = _refused(monkeypatch, capsys, tmp_path, *hf_models.overrides("llama3", folder), "mode=validate")
    assert f"model.init_from = {folder}: holds no weights: neither model.safetensors.index.json nor model.safetensors" in err
    err = _refused(monkeypatch, capsys, tmp_path, *hf_models.overrides("llama3", tmp_path / "nowhere"), "mode=validate")
    assert f"model.init_from = {tmp_path / 'nowhere'}: no such local folder (nothing is downloaded)" in err


@pytest.mark.parametrize(
    "change, words",
    [
        ({"dtype": "float64"}, "has dtype float64: the run holds float32, bfloat16, float16 weights exactly"),
        ({"quantization_config": {"quant_method": "fp8"}}, "declares fp8 quantized weights"),
    ],
)
def test_a_dtype_the_run_cannot_hold_is_refused(monkeypatch, capsys, tmp_path, change, words):
    folder = _config_only(tmp_path, "llama3", **change)
    err = _refused(monkeypatch, capsys, tmp_path, *hf_models.overrides("llama3", folder), "mode=validate")
    assert words in err and "Fix: convert it first: model.to(torch.bfloat16).save_pretrained(<folder>)" in err


def test_a_family_without_a_usable_adapter_is_refused(monkeypatch, capsys, tmp_path):
    """gpt-oss: TorchTitan 0.3.0's adapter loses the experts (test_gpt_oss_adapter_loses_the_experts); refused before any
    file is read, in any mode."""
    err = _refused(monkeypatch, capsys, tmp_path, "model=gpt_oss_debugmodel", f"model.init_from={tmp_path}", "cluster=h100_node")
    assert "model.name = gpt_oss: TorchTitan 0.3.0's gpt_oss state_dict_adapter maps the experts as mlp1_weight" in err
    assert "so model.init_from cannot be read into it. Fix: start llama3, qwen3, deepseek_v3, qwen3_5, kimi_k2_7 from" in err


@pytest.mark.parametrize("model", ["llama3_debugmodel", "qwen3_debugmodel", "deepseek_v3_debugmodel"])
def test_rope_theta_reaches_the_built_model(compose, model):
    """model.rope_theta (compared with config.json) is the theta every block's RoPE is built with."""
    from runner.run.titan.model import model_spec

    layers = model_spec(compose([f"model={model}", "model.rope_theta=12345.0"]).model).model.layers
    assert {la.attention.rope.theta for la in layers} == {12345.0}


def test_tied_embedding_under_pp_is_refused(compose):
    with pytest.raises(ConfigError) as e:
        validate.check(compose([*hf_models.QWEN3, "parallelism=tp2_pp2"]))
    assert [p.field for p in e.value.problems] == ["parallelism.pp"]
    assert "ties its embedding to the output head, which TorchTitan does not support with pipeline" in str(e.value)


def _shard(folder: Path, name: str, dtype) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"lm_head.weight": torch.zeros(2, 3, dtype=dtype)}, str(folder / name))


def test_the_launch_reads_each_shards_header(monkeypatch, capsys, tmp_path):
    """mode=train's preflight (before any rank starts): a shard the index names must be there, in a dtype the run holds."""
    import torch

    folder = _config_only(tmp_path, "llama3")
    argv = [*hf_models.overrides("llama3", folder), "parallelism=single", "training.steps=1", "lr_scheduler.warmup_steps=1"]
    assert "the index names shards that are not there: model-00001-of-00001.safetensors" in _refused(monkeypatch, capsys, tmp_path, *argv)
    _shard(folder, "model-00001-of-00001.safetensors", torch.float64)
    err = _refused(monkeypatch, capsys, tmp_path, *argv)
    assert "model-00001-of-00001.safetensors holds F64 tensors: the run holds BF16, F16, F32 weights exactly" in err


def test_freezing_records_the_folder_and_a_replay_refuses_a_changed_one(monkeypatch, capsys, compose, tmp_path):
    import torch

    folder = _config_only(tmp_path, "llama3")
    _shard(folder, "model-00001-of-00001.safetensors", torch.float32)
    cfg = compose([*hf_models.overrides("llama3", folder), "parallelism=single"])
    run = tmp_path / "frozen"
    run.mkdir()
    freeze.pin(cfg, run)
    frozen = freeze.write(cfg, validate.check(cfg), run)
    rec = freeze.load(frozen).model.init_record
    shard = folder / "model-00001-of-00001.safetensors"
    head = shard.read_bytes()[: 8 + int.from_bytes(shard.read_bytes()[:8], "little")]
    assert rec == {
        "config_sha256": hashlib.sha256((folder / hf_folder.CONFIG).read_bytes()).hexdigest(),
        "index_sha256": hashlib.sha256((folder / hf_folder.INDEX).read_bytes()).hexdigest(),
        "shards": {shard.name: {"size": shard.stat().st_size, "header_sha256": hashlib.sha256(head).hexdigest()}},
    }
    validate.preflight(freeze.load(frozen), run)  # unchanged: the replay may start
    _shard(folder, shard.name, torch.bfloat16)  # other weights under the same names
    err = _refused(monkeypatch, capsys, tmp_path, "--config-dir", str(run), "--config-name", "frozen")
    size = rec["shards"][shard.name]["size"]
    assert f"model.init_from = {folder}: changed since this run was frozen ({shard.name}: size {size} ->" in err
    assert "header_sha256" in err and "Fix: restore the folder the run started from" in err


def test_the_model_identity_of_a_checkpoint_ignores_where_weights_started(compose, tmp_path):
    """A run resumes its own checkpoint whatever model.init_from says (the checkpoint takes precedence)."""
    from runner.formats import checkpoint

    a, b = compose([]).model, compose([f"model.init_from={tmp_path}"]).model
    assert checkpoint.model_identity(a) == checkpoint.model_identity(b) and "init_from" not in checkpoint.model_identity(a)


def test_a_sharded_bfloat16_checkpoint_loads_exactly(compose, tmp_path):
    """Published checkpoints are bf16 and sharded with an index: read in this process (DCP without a process group)
    into the fp32 model, every tensor is the checkpoint's, widened exactly (Llama 3's q/k permuted back, qkv fused)."""
    import torch
    from safetensors.torch import load_file
    from torchtitan.components.checkpointer.base import ModelWrapper

    import runner.run.titan.cpu as cpu
    from runner.run.titan import hf_adapter as titan_hf
    from runner.run.titan.model import model_spec

    hf_models.build("llama3_gqa").to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="5MB")
    assert len(hf_folder.shards(tmp_path)) == 3
    spec = model_spec(compose(hf_models.overrides("llama3_gqa")).model)
    cpu.use_sdpa(spec.model)
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    got = titan_hf.load([model], spec, tmp_path)
    published = {k: v for name in hf_folder.shards(tmp_path) for k, v in load_file(tmp_path / name).items()}
    want = titan_hf.adapter(spec, tmp_path).from_hf({k: v.float() for k, v in published.items()})
    state = ModelWrapper(model).state_dict()
    assert len(got["keys"]) == len(published) == 57 and set(want) == set(state)
    assert all(state[k].dtype == torch.float32 and torch.equal(state[k], want[k]) for k in state)


# --- the recipe: Llama 3.1 8B's published config.json, written by transformers, no weights -----------------------

RECIPE = "recipe=llama3_8b_continue_h100x64"


def test_the_continue_recipe_validates_against_llama_8b_and_refuses_70b(monkeypatch, capsys, tmp_path):
    from tests import text_assets

    data = f"data.path={text_assets.prepared(tmp_path / 'tokens')}"
    eight = hf_models.published_llama(tmp_path / "Llama-3.1-8B", "8B")
    # the recipe keeps 2 checkpoints of 96 GB: room this machine may lack, which mode=validate's preflight refuses
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=1e15))
    code, err = _here(monkeypatch, capsys, RECIPE, f"model.init_from={eight}", data, "mode=validate", f"hydra.run.dir={tmp_path / 'r'}")
    assert code == 0, err
    seventy = hf_models.published_llama(tmp_path / "Llama-3.1-70B", "70B")
    err = _refused(monkeypatch, capsys, tmp_path, RECIPE, f"model.init_from={seventy}", data, "mode=validate")
    differ = {"model.dim": (4096, "hidden_size = 8192"), "model.num_layers": (32, "num_hidden_layers = 80")}
    differ |= {"model.num_heads": (32, "num_attention_heads = 64"), "model.ffn_hidden_dim": (14336, "intermediate_size = 28672")}
    for field, (ours, theirs) in differ.items():
        assert f"{field} = {ours}: {seventy}/config.json has {theirs}" in err
    assert "(4 problems)" in err and "model.num_kv_heads" not in err and "model.vocab_size" not in err


# --- key mapping on meta tensors for the families without a CPU run or a transformers class -------------------


def _round_trip(compose, model: str) -> tuple[dict, dict, dict]:
    """(the model's state dict on meta tensors, its adapter's to_hf, from_hf of that)."""
    import torch
    from torchtitan.components.checkpointer.base import ModelWrapper

    from runner.run.titan import hf_adapter as titan_hf
    from runner.run.titan.model import model_spec
    from tests.gen_models import gen

    m = compose([f"model={model}"]).model
    with gen().kernel_placeholders(m.name):  # Qwen3.5's module imports flash-linear-attention's GPU kernels
        spec = model_spec(m)
        with torch.device("meta"):
            state = ModelWrapper(spec.model.build()).state_dict()
        hf_state = titan_hf.adapter(spec, None).to_hf(dict(state))
        return state, hf_state, titan_hf.adapter(spec, None).from_hf(dict(hf_state))


@pytest.mark.parametrize("model", ["kimi_k2_7_debugmodel", "qwen3_5_debugmodel", "qwen3_5_debugmodel_moe"])
def test_key_mapping_round_trips_on_meta(compose, model):
    """to_hf then from_hf of the family's adapter gives back every key of the model's state dict, each with its shape
    (kimi_k2_7 has no transformers class without remote code; Qwen3.5 does not train on CPU)."""
    from runner.run.titan import hf_adapter as titan_hf

    state, hf_state, back = _round_trip(compose, model)
    kept = set(state) - titan_hf._not_in_hf(state)
    assert set(back) >= kept and len(hf_state) > 0
    assert {k: tuple(back[k].shape) for k in kept} == {k: tuple(state[k].shape) for k in kept}


def test_gpt_oss_adapter_loses_the_experts(compose):
    """Why gpt_oss is refused (runner.formats.hf_folder.NO_ADAPTER): the round trip drops exactly the 4 expert tensors of each
    block. When TorchTitan's mapping is fixed this fails: move gpt_oss to hf_folder.ADAPTERS."""
    from runner.run.titan import hf_adapter as titan_hf

    state, _, back = _round_trip(compose, "gpt_oss_debugmodel")
    lost = {k.split(".", 2)[2] for k in set(state) - set(back) - titan_hf._not_in_hf(state)}
    assert lost == {f"moe.routed_experts.inner_experts.{w}" for w in ("mlp1_weight_EGD", "mlp1_bias_EG", "mlp2_weight_EDF", "mlp2_bias_ED")}


def test_every_family_in_the_table_has_an_adapter(compose):
    """runner.formats.hf_folder.ADAPTERS and NO_ADAPTER (torch-free) name the families whose TorchTitan spec has a
    state_dict_adapter: all six the runner offers."""
    from runner.config import families
    from runner.run.titan.model import model_spec
    from tests.gen_models import gen

    have = set()
    for f in families.FAMILIES:
        with gen().kernel_placeholders(f):
            have |= {f} if model_spec(compose([f"model={f}_debugmodel"]).model).state_dict_adapter is not None else set()
    assert have == set(hf_folder.ADAPTERS) | set(hf_folder.NO_ADAPTER) == set(families.FAMILIES)
