"""`python -m runner.export --format hf`, in-process (no ranks): a checkpoint of each family that exports is read
by `transformers` with the logits of the TorchTitan model it was saved from; every refusal exits 2 and writes nothing.

Each checkpoint is a tiny TorchTitan model (2 blocks) built and saved here through DCP in one process, with its
norms, and the MoE models' expert biases, moved off their initial values so that a swapped or dropped key shows.
Logit tolerance: 1e-5 of the largest logit (measured: Llama 3 1.8e-7, Qwen3 0, Qwen3 MoE 4e-7, DeepSeek-V3 3e-6).
The multi-rank layouts' checkpoints are exported in tests/test_checkpoint.py, from the runs it already makes.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from runner.config import freeze, validate
from runner.formats import checkpoint
from runner.schema import layout
from runner.schema.problems import ConfigError
from tests import text_assets
from tests.hf_compare import LOGITS_RTOL, assert_round_trip, exported, load_hf, logits_gap
from tests.hf_compare import titan_model as _titan_model
from tests.points import HF_ROUND_TRIP as ROUND_TRIP

torch = pytest.importorskip("torch")

TINY_MLA = [  # DeepSeek-V3 671B's router (sigmoid scores, expert groups, route scale) with tiny numbers
    "model=deepseek_v3_671b",
    *("model.dim=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=4", "model.vocab_size=512"),
    *("model.ffn_hidden_dim=128", "model.num_experts=16", "model.num_experts_per_token=2", "model.moe_hidden_dim=32"),
    *("model.num_dense_layers=1", "model.kv_lora_rank=32", "model.q_lora_rank=48", "model.qk_nope_head_dim=16"),
    *("model.qk_rope_head_dim=8", "model.v_head_dim=16", "model.rope_max_seq_len=4096"),
]
SMALL = ["model.num_layers=2", "model.dim=64", "model.num_heads=4", "model.num_kv_heads=2", "model.vocab_size=256"]
QWEN3 = ["model=qwen3_debugmodel", *SMALL, "model.head_dim=16", "model.ffn_hidden_dim=128"]
FAMILIES = {  # overrides, the architecture config.json names
    "llama3_gqa_tied": (["model=debug", *SMALL, "model.ffn_hidden_dim=128", "model.weight_tying=true"], "LlamaForCausalLM"),
    "qwen3": (QWEN3, "Qwen3ForCausalLM"),
    "qwen3_moe": (
        [
            "model=qwen3_debugmodel_moe",
            *SMALL,
            "model.head_dim=16",
            *("model.num_experts=4", "model.num_experts_per_token=2", "model.moe_hidden_dim=32"),
        ],
        "Qwen3MoeForCausalLM",
    ),
    "deepseek_v3": (TINY_MLA, "DeepseekV3ForCausalLM"),
}


def _save(model, cfg, folder: Path, step: int = 1) -> Path:
    """A published checkpoint of the model's weights, as the runner's checkpointer writes one (DCP + COMPLETE.json)."""
    import torch.distributed.checkpoint as dcp

    part = checkpoint.partial_path(folder, step)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(part), no_dist=True)
    info = {"step": step, "model": checkpoint.model_identity(cfg.model)}
    return checkpoint.publish(part, checkpoint.final_path(folder, step), info, checkpoint.file_records(part))


def _export(capsys, *argv) -> tuple[int, str, str]:
    from runner.run import hf_export

    code = hf_export.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def saved(compose, tmp_path_factory):
    """name -> (TorchTitan model, config, its checkpoint folder)."""
    out = {}
    for name, (overrides, _) in FAMILIES.items():
        cfg = compose(overrides)
        model = _titan_model(cfg, expert_bias=name == "deepseek_v3")  # transformers' DeepseekV3 has the bias; Qwen3 MoE's has none
        out[name] = (model, cfg, _save(model, cfg, tmp_path_factory.mktemp(name)))
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_export_loads_in_transformers_with_the_same_logits(saved, name, tmp_path, capsys):
    model, cfg, ckpt = saved[name]
    code, out, err = _export(capsys, ckpt, "--format", "hf", "--out", tmp_path / "hf", "--max-shard-gb", "0.00005")
    assert code == 0, err
    folder = tmp_path / "hf"
    conf = json.loads((folder / "config.json").read_text())
    m = cfg.model
    assert conf["architectures"] == [FAMILIES[name][1]]
    assert (conf["hidden_size"], conf["num_hidden_layers"], conf["num_attention_heads"], conf["vocab_size"]) == (
        m.dim,
        m.num_layers,
        m.num_heads,
        m.vocab_size,
    )
    assert conf["tie_word_embeddings"] is m.weight_tying
    assert ("lm_head.weight" in exported(folder)) is not m.weight_tying  # a tied head is the embedding's: not written
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards == sorted(p.name for p in folder.glob("model-*.safetensors"))  # 50 kB shards
    assert (folder / "generation_config.json").is_file() and not (folder / "tokenizer.json").exists()  # no run around it: no tokenizer
    assert f"export: the export has no tokenizer: {ckpt} is not in a run folder (frozen.yaml two levels up). Add one: export" in out
    hf = load_hf(folder)
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in model.parameters())  # a tied head counted once in both
    assert_round_trip(model, cfg, folder)
    gap, top = logits_gap(model, hf, torch.randint(0, m.vocab_size, (1, 512), generator=torch.Generator().manual_seed(1)))
    assert gap <= LOGITS_RTOL * top
    assert "WARNING" not in err


def test_mtp_blocks_export_and_import_as_hf_layers_after_the_last(compose, tmp_path, capsys):
    """model.num_mtp_layers=1: the MTP block is exported where DeepSeek-V3's checkpoints keep it, as block num_layers
    (model.layers.2.*: its attention and experts named as a block's, eh_proj, enorm, hnorm, shared_head.norm), with
    num_nextn_predict_layers = 1; transformers' DeepseekV3 leaves it out (it has no MTP) and gives the main head's
    logits; the runner's import (hf_adapter.load, TorchTitan's adapter over DCP) reads every weight back bitwise."""
    from runner.run.titan import hf_adapter
    from runner.run.titan.model import model_spec

    cfg = compose([*TINY_MLA, "model.num_mtp_layers=1"])
    model = _titan_model(cfg, expert_bias=True)
    ckpt = _save(model, cfg, tmp_path / "ckpt")
    code, _, err = _export(capsys, ckpt, "--format", "hf", "--out", tmp_path / "hf")
    assert code == 0, err
    folder = tmp_path / "hf"
    assert json.loads((folder / "config.json").read_text())["num_nextn_predict_layers"] == 1
    mtp = {k for k in exported(folder) if k.startswith("model.layers.2.")}
    assert {f"model.layers.2.{n}.weight" for n in ("eh_proj", "enorm", "hnorm", "shared_head.norm", "mlp.gate")} < mtp
    assert "model.layers.2.self_attn.kv_b_proj.weight" in mtp and "model.layers.2.mlp.experts.15.down_proj.weight" in mtp
    assert_round_trip(model, cfg, folder)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 256), generator=torch.Generator().manual_seed(1))
    main, _ = model(tokens)
    hf = load_hf(folder)
    with torch.no_grad():
        assert (hf(tokens).logits - main).abs().max().item() <= LOGITS_RTOL * main.abs().max().item()
    fresh = _titan_model(cfg, expert_bias=False)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    hf_adapter.load([fresh], model_spec(cfg.model), folder)
    want, got = model.state_dict(), fresh.state_dict()
    assert [k for k in want if not k.endswith("tokens_per_expert_E") and not torch.equal(got[k], want[k])] == []


def test_qwen3_moe_expert_bias_is_named_when_left_out(compose, tmp_path, capsys):
    """transformers' Qwen3 MoE routes without TorchTitan's load-balancing bias: a trained (nonzero) one is reported."""
    cfg = compose(FAMILIES["qwen3_moe"][0])
    ckpt = _save(_titan_model(cfg, expert_bias=True), cfg, tmp_path / "ckpt")
    code, _, err = _export(capsys, ckpt, "--format", "hf", "--out", tmp_path / "hf")
    assert code == 0
    for layer in (0, 1):
        assert f"WARNING: export: layers.{layer}.moe.expert_bias_E has no place in transformers' model and is left out" in err


def test_run_folder_exports_its_newest_checkpoint_with_the_tokenizer(saved, compose, tmp_path, capsys):
    import transformers
    from tokenizers import Tokenizer

    model, _, ckpt = saved["llama3_gqa_tied"]
    corpus, tok = text_assets.make(tmp_path / "assets")
    cfg = compose([*FAMILIES["llama3_gqa_tied"][0], "data=text", f"data.files=[{corpus}]", f"data.tokenizer={tok}", "checkpoint=local"])
    run = tmp_path / "run"
    run.mkdir()
    freeze.write(cfg, layout.resolve(cfg.parallelism, cfg.cluster), run)
    _save(model, cfg, run / "checkpoints", step=1)
    (run / "checkpoints" / "step-1" / "__0_0.distcp").write_bytes(b"older")  # damaged: must not be the one read
    _save(model, cfg, run / "checkpoints", step=2)
    code, out, err = _export(capsys, run, "--format", "hf", "--out", tmp_path / "hf")
    assert code == 0, err
    assert f"export: {run / 'checkpoints' / 'step-2'} -> {tmp_path / 'hf'}" in out
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = text_assets.documents(1, seed=7)[0]
    assert hf_tok(text)["input_ids"] == Tokenizer.from_file(str(tok)).encode(text).ids
    eos = Tokenizer.from_file(str(tok)).token_to_id(text_assets.EOS)
    assert hf_tok.eos_token == text_assets.EOS
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == eos
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == eos
    tok.unlink()  # the run's tokenizer gone: refused rather than exported without one
    code, _, err = _export(capsys, run, "--format", "hf", "--out", tmp_path / "hf2")
    assert code == 2 and f"export refused: data.tokenizer {tok} (the run's, in its frozen.yaml) is not there" in err
    assert not (tmp_path / "hf2").exists()


def test_bos_and_eos_are_the_tokenizer_configs(saved, tmp_path, capsys):
    """The exported BOS and EOS are the ones the run framed its documents with: the tokenizer_config.json beside the
    tokenizer.json (runner.formats.documents.specials, TorchTitan's reading), not data.eos_token, which this tokenizer
    lacks; without that file, no BOS and data.eos_token as the EOS."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    _, _, ckpt = saved["llama3_gqa_tied"]
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4, "<|end_of_text|>": 5}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    code, _, err = _export(capsys, ckpt, "--format", "hf", "--out", tmp_path / "hf", "--tokenizer", tmp_path / "tokenizer.json")
    assert code == 0, err
    for name in ("generation_config.json", "config.json"):
        got = json.loads((tmp_path / "hf" / name).read_text())
        assert (got["bos_token_id"], got["eos_token_id"]) == (1, 2), name
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert (hf_tok.bos_token, hf_tok.eos_token) == ("<s>", "</s>")
    (tmp_path / "tokenizer_config.json").unlink()  # a bare tokenizer.json: no BOS, data.eos_token (the default) as EOS
    code, _, err = _export(capsys, ckpt, "--format", "hf", "--out", tmp_path / "bare", "--tokenizer", tmp_path / "tokenizer.json")
    got = json.loads((tmp_path / "bare" / "generation_config.json").read_text())
    assert code == 0 and (got.get("bos_token_id"), got["eos_token_id"]) == (None, 5), err


# ---- HF -> runner -> HF in each layout (points of the HF launches, shared through conftest's parity_runs) ---------


@pytest.mark.e2e
@pytest.mark.parametrize("point", ROUND_TRIP)
def test_hf_through_the_runner_exports_the_same_tensors(parity_runs, hf_folders, hf_round_trip, point, tmp_path, capsys):
    """A transformers folder read into the layout (model.init_from), checkpointed by its ranks and exported gives back
    every tensor bitwise. Only DeepSeek-V3's router bias moves: TorchTitan's load balancing adds its coefficient (1e-3)
    times the sign of each expert's load less the mean of that, at most 2e-3, before the first update whatever the
    learning rate."""
    assert parity_runs[point]["rows"][0]["step"] == 1
    code, _, err = _export(capsys, hf_round_trip[point] / "step-1", "--format", "hf", "--out", tmp_path / "hf")
    assert code == 0, err
    want, got = exported(hf_folders[point.split("-")[1]]), exported(tmp_path / "hf")
    assert len(want) > 10 and sorted(got) == sorted(want)
    balanced = [k for k in want if k.endswith("e_score_correction_bias")]
    assert [k for k in want if k not in balanced and not torch.equal(got[k], want[k])] == []
    for k in balanced:
        assert 0 < (got[k] - want[k]).abs().max() <= 2e-3 * (1 + 1e-6)


# ---- refusals: exit 2, one line naming the path, the value and the fix, nothing written ----------------------


def _refused(capsys, tmp_path, *argv) -> str:
    code, out, err = _export(capsys, *argv, "--format", "hf", "--out", tmp_path / "hf")
    assert code == 2 and "Traceback" not in err and out == ""
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()
    return err


def test_refuses_a_checkpoint_that_fails_its_checksum(saved, tmp_path, capsys):
    _, cfg, ckpt = saved["llama3_gqa_tied"]
    copy = tmp_path / "ckpt"
    import shutil

    shutil.copytree(ckpt, copy)
    shard = copy / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    err = _refused(capsys, tmp_path, copy)
    want = f"{zlib.crc32(bytes(data)):08x}"
    assert f"export refused: checkpoint {copy} fails its check: __0_0.distcp has crc32 {want}" in err
    assert "Fix: export another checkpoint" in err


def _fake(compose, folder: Path, overrides: list[str]) -> Path:
    """A published checkpoint folder of the model that holds no real weights (refused before any is read)."""
    part = checkpoint.partial_path(folder, 1)
    part.mkdir(parents=True)
    (part / ".metadata").write_bytes(b"m")
    info = {"step": 1, "model": checkpoint.model_identity(compose(overrides).model)}
    return checkpoint.publish(part, checkpoint.final_path(folder, 1), info, checkpoint.file_records(part))


def test_refuses_a_family_without_a_transformers_export(compose, tmp_path, capsys):
    err = _refused(capsys, tmp_path, _fake(compose, tmp_path / "kimi", ["model=kimi_k2_7_debugmodel"]))
    assert "export refused: model.name kimi_k2_7 has no Hugging Face export: transformers has no Kimi K2 class without remote code" in err
    assert "families that export: deepseek_v3, llama3, qwen3, qwen3_moe" in err


def test_refuses_a_router_transformers_computes_otherwise(compose, tmp_path, capsys):
    err = _refused(capsys, tmp_path, _fake(compose, tmp_path / "dsv3", ["model=deepseek_v3_debugmodel"]))
    want = "model.name deepseek_v3 (flavor debugmodel) cannot be exported: transformers' DeepseekV3ForCausalLM scores experts with a"
    assert f"export refused: {want} sigmoid, TorchTitan's debugmodel with a softmax; flavors that export: 671B" in err


def test_refuses_an_out_folder_holding_other_files(saved, tmp_path, capsys):
    _, _, ckpt = saved["llama3_gqa_tied"]
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, _, err = _export(capsys, ckpt, "--format", "hf", "--out", out)
    assert code == 2 and "Traceback" not in err
    want = f"export refused: --out {out} holds notes.txt and is not an earlier export (config.json and model.safetensors.index.json)."
    assert want in err and "Fix: name a new or empty folder" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and not (tmp_path / "hf.partial").exists()


def _run(compose, model, folder: Path, overrides: list[str]) -> Path:
    """A run folder (frozen.yaml of `overrides`) holding one published checkpoint of `model`."""
    cfg = compose([*FAMILIES["llama3_gqa_tied"][0], *overrides, "checkpoint=local"])
    folder.mkdir()
    freeze.write(cfg, layout.resolve(cfg.parallelism, cfg.cluster), folder)
    _save(model, cfg, folder / "checkpoints")
    return folder


def test_never_writes_over_a_file_the_run_reads(saved, compose, tmp_path, capsys):
    """Issue 54: an --out holding only the run's own tokenizer.json (data.tokenizer) was taken for an earlier export and
    replaced. A folder holding what the run reads, or anything but an earlier export, is refused; nothing changes."""
    model, _, _ = saved["llama3_gqa_tied"]
    corpus, tok = text_assets.make(tmp_path / "assets")
    (tmp_path / "tok").mkdir()
    before = tok.read_bytes()
    tok = tok.rename(tmp_path / "tok" / "tokenizer.json")  # a folder holding it alone
    run = _run(compose, model, tmp_path / "run", ["data=text", f"data.files=[{corpus}]", f"data.tokenizer={tok}"])
    for out, why in (
        (tok.parent, f"holds data.tokenizer {tok}, which the run reads. Fix: name a new or empty folder outside it"),
        (tmp_path, f"holds the checkpoint {run / 'checkpoints' / 'step-1'}, which the run reads"),
    ):
        code, _, err = _export(capsys, run, "--format", "hf", "--out", out)
        assert code == 2 and f"export refused: --out {out} {why}" in err and "Traceback" not in err
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "tokenizer.json").write_bytes(before)  # a copy: not the run's, but no earlier export either
    code, _, err = _export(capsys, run, "--format", "hf", "--out", lone)
    assert code == 2 and f"export refused: --out {lone} holds tokenizer.json and is not an earlier export" in err
    assert tok.read_bytes() == before and (lone / "tokenizer.json").read_bytes() == before
    assert sorted(p.name for p in lone.iterdir()) == ["tokenizer.json"] and not (tmp_path / "lone.partial").exists()
    assert [p.name for p in tok.parent.iterdir()] == ["tokenizer.json"] and not (tmp_path / "tok.partial").exists()


def test_tokens_run_exports_the_tokenizer_its_data_was_prepared_with(saved, compose, tmp_path, capsys):
    """data=tokens without data.tokenizer (the documented form): the manifest's tokenizer, checked by sha256; where it is
    gone, one line says the export has none and how to add one; a --tokenizer the data was not prepared with is refused."""
    import transformers
    from tokenizers import Tokenizer

    model, _, _ = saved["llama3_gqa_tied"]
    prepared = text_assets.prepared(tmp_path / "assets")
    tok = tmp_path / "assets" / "tokenizer.json"
    run = _run(compose, model, tmp_path / "run", ["data=tokens", f"data.path={prepared}"])
    capsys.readouterr()  # prepare's progress bars
    code, _, err = _export(capsys, run, "--format", "hf", "--out", tmp_path / "hf")
    assert code == 0 and err == ""
    eos = Tokenizer.from_file(str(tok)).token_to_id(text_assets.EOS)
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf")).eos_token == text_assets.EOS
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == eos
    moved = tok.rename(tmp_path / "tokenizer.json")
    code, _, err = _export(capsys, run, "--format", "hf", "--out", tmp_path / "hf2")
    want = f"{tok}, the tokenizer {prepared} was prepared with (manifest.json), is not there. Fix: export again with --tokenizer"
    assert code == 0 and err == f"WARNING: export: the export has no tokenizer: {want} <the tokenizer.json the data was prepared with>\n"
    assert not (tmp_path / "hf2" / "tokenizer.json").exists()
    code, _, err = _export(capsys, run, "--format", "hf", "--out", tmp_path / "hf3", "--tokenizer", moved)
    assert code == 0 and err == "" and json.loads((tmp_path / "hf3" / "config.json").read_text())["eos_token_id"] == eos
    other = text_assets.tokenizer("WordLevel", tmp_path / "wl.json")
    code, _, err = _export(capsys, run, "--format", "hf", "--out", tmp_path / "hf4", "--tokenizer", other)
    assert code == 2 and f"export refused: --tokenizer {other} differs from the tokenizer {prepared} was prepared with" in err
    assert not (tmp_path / "hf4").exists()


def test_exported_files_share_one_mode(saved, tmp_path, capsys):
    """safetensors creates its files 0600: the weights get the mode the umask gives every other file of the export."""
    import os

    _, _, ckpt = saved["llama3_gqa_tied"]
    for umask, want in ((0o022, 0o644), (0o027, 0o640)):
        old = os.umask(umask)
        try:
            out = tmp_path / f"hf{umask:o}"
            assert _export(capsys, ckpt, "--format", "hf", "--out", out, "--max-shard-gb", "0.00005")[0] == 0
        finally:
            os.umask(old)
        modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
        assert len(modes) > 4 and set(modes.values()) == {want}, modes


def test_replaces_an_earlier_export(saved, tmp_path, capsys):
    _, _, ckpt = saved["llama3_gqa_tied"]
    assert _export(capsys, ckpt, "--format", "hf", "--out", tmp_path / "hf", "--max-shard-gb", "0.00005")[0] == 0
    assert _export(capsys, ckpt, "--format", "hf", "--out", tmp_path / "hf")[0] == 0  # one 5 GB shard now
    assert sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors")) == ["model-00001-of-00001.safetensors"]


def test_refuses_a_folder_that_is_neither_run_nor_checkpoint(tmp_path, capsys):
    (tmp_path / "other").mkdir()
    err = _refused(capsys, tmp_path, tmp_path / "other")
    assert f"export refused: {tmp_path / 'other'} is neither a run folder (frozen.yaml) nor a checkpoint folder (COMPLETE.json)" in err


def test_refuses_a_run_folder_whose_newest_checkpoint_is_damaged(saved, compose, tmp_path, capsys):
    model, cfg, _ = saved["llama3_gqa_tied"]
    run = tmp_path / "run"
    run.mkdir()
    freeze.write(cfg, layout.resolve(cfg.parallelism, cfg.cluster), run)
    _save(model, cfg, run / "checkpoints", step=1)
    _save(model, cfg, run / "checkpoints", step=2)
    (run / "checkpoints" / "step-2" / "__0_0.distcp").write_bytes(b"cut")
    err = _refused(capsys, tmp_path, run)
    assert f"export refused: checkpoint {run / 'checkpoints' / 'step-2'} fails its check: __0_0.distcp has 3 bytes" in err


def test_export_hf_needs_checkpoints_and_an_exported_family(compose):
    with pytest.raises(ConfigError) as e:
        validate.check(compose(["checkpoint.export_hf=true"]))
    assert "checkpoint.export_hf" in str(e.value) and "exports the last checkpoint, and none is written" in str(e.value)
    with pytest.raises(ConfigError) as e:
        validate.check(compose(["model=kimi_k2_7_debugmodel", "checkpoint=local", "checkpoint.export_hf=true"]))
    assert "model.name kimi_k2_7 has no Hugging Face export" in str(e.value)
    with pytest.raises(ConfigError) as e:
        validate.check(compose(["model=deepseek_v3_debugmodel", "checkpoint=local", "checkpoint.export_hf=true"]))
    assert "scores experts with a sigmoid, TorchTitan's debugmodel with a softmax" in str(e.value)
    validate.check(compose(["checkpoint=local", "checkpoint.export_hf=true"]))


def test_sigmoid_router_flavors_are_the_registry_ones():
    """runner.formats.hf_folder.SIGMOID_ROUTER (validation's torch-free list) is what TorchTitan's registry builds."""
    import importlib

    from runner.formats import hf_folder

    for family, flavors in hf_folder.SIGMOID_ROUTER.items():
        module = importlib.import_module(f"torchtitan.models.{family}")
        scores = {
            name: next(x.moe for x in module.model_registry(name).model.layers if x.moe).router.score_func
            for name in ("debugmodel", "16B", "671B")
        }
        assert sorted(f for f, s in scores.items() if s == "sigmoid") == sorted(flavors), scores


def test_the_export_keeps_dcps_single_process_notice_off_the_console(saved, tmp_path, monkeypatch):
    """`python -m runner.export` reads a checkpoint in one process (DCP's no_dist): torch's "torch.distributed is
    disabled ... assuming the intent is to load in a single process", registered with runner.run.known_warnings, is
    not shown (every export printed it)."""
    import runpy
    import sys
    import warnings

    from runner.run import known_warnings

    _, _, ckpt = saved["llama3_gqa_tied"]  # the module's checkpoints: nothing saved for this test alone
    monkeypatch.setattr(sys, "argv", ["runner.export", str(ckpt), "--format", "hf", "--out", str(tmp_path / "hf")])
    try:
        with warnings.catch_warnings(record=True) as got, pytest.raises(SystemExit) as e:
            warnings.simplefilter("always")
            runpy.run_module("runner.export", run_name="__main__")
    finally:
        known_warnings.apply(False)
    assert e.value.code == 0 and (tmp_path / "hf" / "config.json").is_file()
    assert [str(w.message) for w in got if "torch.distributed is disabled" in str(w.message)] == []
