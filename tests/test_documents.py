"""Documents as TorchTitan trains them (runner.formats.documents, runner.run.loader, runner.run.titan): per rule, on
hand-made streams; the samples against TorchTitan's own text dataset; the attention against a per-document loop."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from runner.formats import documents
from runner.run.loader import TextData

BOS, EOS = 900, 901
# lengths with BOS and EOS: shorter than a sample, one that spans more than two samples, ones of one and two pairs
DOCS = [[BOS, *range(1, 4), EOS], [BOS, 4, EOS], [BOS, *range(10, 30), EOS], [BOS, EOS], [BOS, 40, 41, EOS], [BOS, *range(50, 57), EOS]]
SEQ = 8


def _text_data(docs=DOCS, seq_len=SEQ, **kw) -> TextData:
    tokens = torch.tensor([t for d in docs for t in d])
    ends = np.cumsum([len(d) for d in docs])
    shape = dict(seed=0, shuffle=False, seq_len=seq_len, global_batch=1, microbatch=1, dp_rank=0, dp=1) | kw
    return TextData(tokens, ends=ends, **shape)


def _sample(data: TextData, index: int):
    return tuple(np.asarray(x).tolist() for x in data.window(index))


def test_a_sample_spanning_three_documents_has_per_document_positions_and_labels():
    """Sample 0 holds the 4 pairs of document 0, the 2 of document 1 and the first 2 of document 2."""
    inputs, labels, positions = _sample(_text_data(), 0)
    assert inputs == [BOS, 1, 2, 3, BOS, 4, BOS, 10]
    assert labels == [1, 2, 3, EOS, 4, EOS, 10, 11]  # a document's last input predicts its EOS, never the next BOS
    assert positions == [0, 1, 2, 3, 0, 1, 0, 1]


def test_a_long_document_wraps_its_positions_at_every_sample():
    """Document 2 (22 tokens, 21 pairs) runs from sample 0 through sample 3: positions restart at each sample's start, as
    TorchTitan's _normalize_positions does, and labels stay the inputs shifted within it."""
    data = _text_data()
    assert _sample(data, 1) == (list(range(11, 19)), list(range(12, 20)), list(range(8)))
    assert _sample(data, 2) == (list(range(19, 27)), list(range(20, 28)), list(range(8)))
    inputs, labels, positions = _sample(data, 3)
    assert inputs == [27, 28, 29, BOS, BOS, 40, 41, BOS]  # document 3 (BOS EOS) is one pair: BOS -> EOS
    assert labels == [28, 29, EOS, EOS, 40, 41, EOS, 50]
    assert positions == [0, 1, 2, 0, 0, 1, 2, 0]


def test_no_label_crosses_a_document_boundary():
    """Over every sample: each (input, label) pair is two neighbours of one document; no pair is EOS -> BOS."""
    data = _text_data()
    pairs = {(a, b) for d in DOCS for a, b in zip(d, d[1:], strict=False)}
    for i in range(data.num_samples):
        inputs, labels, _ = _sample(data, i)
        assert set(zip(inputs, labels, strict=True)) <= pairs
        assert (EOS, BOS) not in set(zip(inputs, labels, strict=True))
    assert data.num_samples == sum(len(d) - 1 for d in DOCS) // SEQ  # pairs, not tokens, are cut into samples


def test_samples_equal_torchtitans_text_dataset(monkeypatch):
    """TorchTitan's HuggingFaceTextDataset on the same documents (its own loop, through `datasets`) yields the runner's
    samples in order: inputs, labels and positions."""
    from datasets import Dataset
    from torchtitan.hf_datasets import DatasetConfig, text_datasets

    texts = [" ".join(map(str, d[1:-1])) for d in DOCS]

    class Tok:  # TorchTitan's tokenizer protocol: encode(text, add_bos, add_eos)
        eos_id = EOS

        def encode(self, text, add_bos=False, add_eos=False):
            return [BOS] * add_bos + [int(t) for t in text.split()] + [EOS] * add_eos

    config = DatasetConfig(path="hand", loader=lambda _: Dataset.from_dict({"text": texts}), sample_processor=lambda s: s["text"])
    monkeypatch.setitem(text_datasets.DATASETS, "hand", config)
    titan = list(text_datasets.HuggingFaceTextDataset("hand", None, Tok(), seq_len=SEQ))
    data = _text_data()
    assert len(titan) == data.num_samples == 4  # 39 pairs
    for i, (x, y) in enumerate(titan):
        assert _sample(data, i) == (x["input"].tolist(), y.tolist(), x["positions"].tolist())


def _qkv(seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 2, seq, 16, generator=g) for _ in range(3))


def test_masked_attention_reads_only_its_own_document():
    """SDPA with the CPU's document mask (TorchTitan's mask mods, dense) equals causal attention run on each document
    alone, and TorchTitan's FlexAttention with the model's BlockMask (forward, eager: the GPU's math)."""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention
    from torchtitan.models.common.attention import get_causal_mask_mod, get_efficient_causal_mask_mod_for_packed_document

    from runner.run.titan.cpu import document_mask

    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]])  # four documents (a sample starts at 0)
    q, k, v = _qkv(16)
    got = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(positions))
    bounds = [0, 3, 5, 10, 16]
    for a, b in zip(bounds, bounds[1:], strict=False):
        alone = torch.nn.functional.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True)
        torch.testing.assert_close(got[:, :, a:b], alone, rtol=1e-6, atol=1e-6)
    mods = and_masks(get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(positions))
    flex = flex_attention(q, k, v, block_mask=create_block_mask(mods, 1, None, 16, 16, device="cpu"))
    torch.testing.assert_close(got, flex, rtol=1e-5, atol=1e-5)
    assert document_mask(positions)[0, 0].sum().item() == sum((b - a) * (b - a + 1) // 2 for a, b in zip(bounds, bounds[1:], strict=False))


def test_document_mask_in_a_batch_of_two_samples():
    """TorchTitan's packed-document mask mod has another formula for a batch > 1: each row still keeps to its documents."""
    from runner.run.titan.cpu import document_mask

    positions = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 0, 1, 2, 3, 0]])
    mask = document_mask(positions)[:, 0]
    doc = torch.cumsum((positions == 0).int(), dim=1)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    assert torch.equal(mask, (doc[:, :, None] == doc[:, None, :]) & causal)


def test_the_model_reads_each_document_as_if_alone(compose):
    """The CPU model (TorchTitan's Llama 3 with the runner's SDPA) on a packed sample with its positions and mask gives each
    document the logits it gets alone at positions 0..L-1: no attention and no RoPE offset leak across documents."""
    from runner.run import titan
    from runner.run.titan import cpu
    from runner.run.titan.initial_weights import init_weights
    from runner.run.titan.step import document_inputs

    spec = titan.model_spec(compose(["parallelism=single", "model.num_layers=2"]).model)
    cpu.use_sdpa(spec.model)
    model = spec.model.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    init_weights(model, 0)
    tokens = torch.tensor([[7, 8, 9, 1, 2, 3, 4, 5, 6, 10, 11, 12]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1, 2]])
    built = type("Built", (), {"attention_masks": False, "parts": [model]})()
    with torch.no_grad():
        packed = model(tokens, **document_inputs(built, positions))
        for a, b in ((0, 3), (3, 9), (9, 12)):
            torch.testing.assert_close(packed[:, a:b], model(tokens[:, a:b]), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(model(tokens)[:, 3:9], packed[:, 3:9], atol=1e-3)  # today's causal run reads across


def _tokenizer_folder(tmp_path, config: dict | None):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "[UNK]": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_file(str(path)), path


def test_bos_and_eos_come_from_the_tokenizer_config(tmp_path):
    """As TorchTitan's HuggingFaceTokenizer: tokenizer_config.json's bos_token and eos_token (a string or an AddedToken
    object), each added around a document; a bare tokenizer.json has no BOS and data.eos_token as its EOS."""
    tok, path = _tokenizer_folder(tmp_path, {"bos_token": {"content": "<s>"}, "eos_token": "</s>"})
    frame = documents.specials(tok, path, "ignored")
    assert (frame.bos_id, frame.eos_id, frame.frame([2, 3])) == (0, 1, [0, 2, 3, 1])
    (tmp_path / "tokenizer_config.json").unlink()
    bare = documents.specials(tok, path, "</s>")
    assert (bare.bos_id, bare.eos_id, bare.frame([2]), bare.source) == (None, 1, [2, 1], None)


@pytest.mark.parametrize(
    ("config", "why"),
    [
        ({"bos_token": "<s>"}, "names no eos_token: documents would run together with no end"),
        ({"bos_token": "<s>", "eos_token": "<|eot|>"}, "{cfg} names the eos_token '<|eot|>', not a token of {tok}"),
    ],
)
def test_validation_names_a_tokenizer_without_an_end_of_document_token(tmp_path, compose, config, why):
    from runner.config.validate import data_rules

    _, path = _tokenizer_folder(tmp_path, config)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a b"}\n')
    cfg = compose(["data=text", f"data.files=[{corpus}]", f"data.tokenizer={path}", "model.vocab_size=512"])
    out = []
    data_rules.files(cfg, out)
    assert [(p.field, p.value) for p in out] == [("data.tokenizer", str(path))]
    assert why.format(cfg=tmp_path / "tokenizer_config.json", tok=path) in out[0].why
    assert "put the tokenizer_config.json of the tokenizer's Hugging Face folder beside it" in out[0].fix
    off = []
    data_rules.files(compose(["data=text", f"data.files=[{corpus}]", f"data.tokenizer={path}", "data.document_mask=false"]), off)
    assert off == []  # today's packing appends data.eos_token when the tokenizer has it, nothing otherwise


def test_document_mask_off_is_todays_packing():
    """data.document_mask=false: samples of seq_len + 1 tokens cut from one stream, no positions (0..seq_len-1 and a causal
    mask in the model): the sample crosses documents as before."""
    tokens = torch.tensor([t for d in DOCS for t in d])
    data = TextData(tokens, seed=0, shuffle=False, seq_len=SEQ, global_batch=1, microbatch=1, dp_rank=0, dp=1)
    (mb,) = data.microbatches(0)
    assert mb.positions is None
    assert mb.inputs.tolist() == [tokens[:SEQ].tolist()] and mb.labels.tolist() == [tokens[1 : SEQ + 1].tolist()]
    assert data.num_samples == (len(tokens) - 1) // SEQ


def _prepare(tmp_path, inputs, tok_path):
    from runner.data import cli

    out = tmp_path / "prepared"
    argv = ["prepare", "--input", *map(str, inputs), "--tokenizer", str(tok_path), "--out", str(out), "--eval-fraction", "0"]
    assert cli.main([*argv, "--num-proc", "1"]) == 0
    return out


def test_prepared_documents_are_framed_and_read_across_parts_as_text_data_reads_them(tmp_path, capsys):
    """prepare frames each document with the tokenizer_config.json's BOS and EOS and records it (format 2); TokenData's
    document windows over two parts equal TextData's over the same documents, positions included."""
    from runner.formats import data_manifest as manifest
    from runner.run.token_data import TokenData

    _, tok_path = _tokenizer_folder(tmp_path, {"bos_token": "<s>", "eos_token": "</s>"})
    texts = [["a b a", "b", "a a a a a a a a b"], ["b b", "a b a b a b a b a b a b", "a"]]
    inputs = []
    for i, part in enumerate(texts):
        inputs.append(tmp_path / f"c{i}.jsonl")
        inputs[-1].write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    out = _prepare(tmp_path, inputs, tok_path)
    assert "each document: BOS '<s>' + its tokens + EOS '</s>', as TorchTitan's tokenizer frames it" in capsys.readouterr().out
    m = manifest.load(out)
    assert (m["version"], m["bos_id"], m["eos_id"]) == (2, 0, 1)
    ids = {"a": 2, "b": 3}
    docs = [[0, *(ids[w] for w in t.split()), 1] for part in texts for t in part]
    first = np.fromfile(manifest.tokens_file(out, "part-00000", "train"), dtype=np.uint16).tolist()
    assert first == [t for d in docs[:3] for t in d]
    shape = dict(seed=0, shuffle=False, seq_len=6, global_batch=1, microbatch=1, dp_rank=0, dp=1)
    got = TokenData([(str(out), 1.0)], documents=True, **shape)
    want = _text_data(docs, seq_len=6)
    assert got.num_samples == [want.num_samples] == [sum(len(d) - 1 for d in docs) // 6]
    for i in range(want.num_samples):  # sample 2 spans the two parts
        assert _sample(got, i) == _sample(want, i)


def test_a_format_1_folder_is_refused_with_the_command_that_rewrites_it(tmp_path):
    from runner.formats import data_manifest as manifest

    _, tok_path = _tokenizer_folder(tmp_path, {"bos_token": "<s>", "eos_token": "</s>"})
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a b"}\n')
    out = _prepare(tmp_path, [corpus], tok_path)
    body = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps(body | {"version": 1}))
    with pytest.raises(manifest.ManifestError) as e:
        manifest.load(out)
    assert str(e.value) == (
        f"{out / 'manifest.json'} has format version 1, this runner reads 2; prepare it again (every part is rewritten, its "
        f"documents framed by the tokenizer's BOS and EOS): python -m runner.data prepare --input {corpus.resolve()} "
        f"--tokenizer {tok_path.resolve()} --out {out}"
    )
    assert _prepare(tmp_path, [corpus], tok_path) == out and manifest.load(out)["version"] == 2  # the command named fixes it


@pytest.mark.parametrize(
    "case",
    ["strings", "added_tokens_decoder", "post_processor_adds_bos", "no_bos (Qwen)"],
)
def test_documents_are_framed_as_torchtitans_tokenizer_frames_them(tmp_path, case):
    """runner.formats.documents frames a document as TorchTitan's HuggingFaceTokenizer.encode(add_bos=True, add_eos=True)
    does: the config's tokens (a string, an AddedToken object or an added_tokens_decoder entry), none added twice when
    the tokenizer's own post-processor adds it, no BOS when the config names none."""
    from tokenizers import processors
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    config = {"bos_token": "<s>", "eos_token": "</s>"}
    if case == "added_tokens_decoder":
        config = {"bos_token": {"content": "<s>", "__type": "AddedToken"}, "eos_token": "</s>"}
        config["added_tokens_decoder"] = {"0": {"content": "<s>", "special": True}, "1": {"content": "</s>", "special": True}}
    if case == "no_bos (Qwen)":
        config = {"bos_token": None, "eos_token": "</s>"}
    tok, path = _tokenizer_folder(tmp_path, config)
    if case == "post_processor_adds_bos":
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
        tok.save(str(path))
    titan = HuggingFaceTokenizer(tokenizer_path=str(tmp_path))
    frame = documents.specials(tok, path, "ignored")
    for text in ("a b a", "b", "a a b b"):
        assert frame.frame(tok.encode(text).ids) == titan.encode(text, add_bos=True, add_eos=True), text


def test_flexattention_models_get_their_own_mask_per_batch_from_its_positions():
    """The CUDA path (FlexAttention): each microbatch's positions go to the model's get_attention_masks, and a pipeline
    step's whole local batch is masked at once from the microbatches' positions, to be split by the schedule."""
    from types import SimpleNamespace

    from runner.run.loader import Microbatch
    from runner.run.titan import step

    calls = []
    model = SimpleNamespace(get_attention_masks=lambda positions: calls.append(positions) or f"mask of {positions.tolist()}")
    built = SimpleNamespace(attention_masks=True, parts=[model], cp_load_balancer=None, extra_inputs={"positions": "arange"})
    x, p = torch.zeros(1, 4, dtype=torch.long), torch.tensor([[0, 1, 0, 1]])
    _, _, extra = step.model_inputs(built, x, x, positions=p)
    assert extra == {"positions": p, "attention_masks": "mask of [[0, 1, 0, 1]]"}
    assert step.model_inputs(built, x, x)[2] == {"positions": "arange"}  # no positions: one document per sample, as built
    mbs = [Microbatch(x, x, p), Microbatch(x, x, torch.tensor([[0, 0, 1, 2]]))]
    batch = torch.cat([mb.positions for mb in mbs])
    assert step.batch_masks(built, torch.cat([mb.inputs for mb in mbs]), batch)["attention_masks"] == f"mask of {batch.tolist()}"


def test_a_pipeline_batchs_block_mask_splits_into_each_microbatchs_own_documents():
    """The pipeline step masks the whole local batch at once (titan.step.batch_masks) and the schedule splits the BlockMask
    along the batch (torch.distributed.pipelining.microbatch): each microbatch's part still reads its own rows' documents."""
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
    from torch.nn.attention.flex_attention import and_masks, create_block_mask, create_mask
    from torchtitan.models.common.attention import get_causal_mask_mod, get_efficient_causal_mask_mod_for_packed_document

    from runner.run.titan.cpu import document_mask

    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3], [0, 0, 1, 2, 3, 4, 5, 6], [0, 1, 0, 1, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]])
    mods = and_masks(get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(positions))
    whole = create_block_mask(mods, 4, None, 8, 8, device="cpu")
    _, chunks = split_args_kwargs_into_chunks((), {"attention_masks": whole}, 2)
    for i, chunk in enumerate(chunks):
        got = create_mask(chunk["attention_masks"].mask_mod, 2, 1, 8, 8, device="cpu")
        assert torch.equal(got, document_mask(positions[2 * i : 2 * i + 2])), i


@pytest.mark.parametrize(("parallelism", "seq_len", "microbatch_size", "micro"), [("single", 1000, 2, 3), ("tp2_pp2", 512, 1, 4)])
def test_the_plans_block_mask_is_the_one_torchtitan_builds(compose, monkeypatch, parallelism, seq_len, microbatch_size, micro):
    """The plan's FlexAttention term (runner.estimate.block_mask) against the BlockMask TorchTitan's own model builds for
    the same batch (get_attention_masks: create_block_mask over its causal and packed-document mask mods, here eager):
    its bytes to the byte, the masks the step builds, and none on a CPU cluster (SDPA) or for synthetic data without
    a pipeline (the mask built with the model serves every step)."""
    from torchtitan.models.common import attention

    from runner.estimate import block_mask, memory
    from runner.run import titan
    from runner.schema import layout

    overrides = [f"parallelism={parallelism}", "cluster=h100_node", f"training.seq_len={seq_len}"]
    overrides += [f"training.microbatch_size={microbatch_size}", "data=text"]
    cfg = compose(overrides)
    lay = layout.resolve(cfg.parallelism, cfg.cluster)
    cfg.training.global_batch_size = micro * microbatch_size * lay.dp
    batch = micro * microbatch_size if lay.pp > 1 else microbatch_size
    doc = torch.cat([torch.arange(n) for n in (5, 130, 1, 400, 77, 1000)])
    positions = torch.stack([torch.cat([torch.arange(37 * i + 3), doc])[:seq_len] for i in range(batch)])  # each starts at 0
    monkeypatch.setattr(attention, "_compiled_create_block_mask", attention.create_block_mask)  # eager: no compile on CPU
    with torch.device("meta"):
        model = titan.model_spec(cfg.model).model.build()
    mask = model.get_attention_masks(positions=positions)
    tensors = [t for t in mask.as_tuple() if isinstance(t, torch.Tensor)]
    built = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    assert len(tensors) == 8 and built == block_mask.mask_bytes(batch, seq_len)
    for st in range(lay.pp):
        assert memory.stage(cfg, lay, micro, st)["block_masks"] == built
    got = block_mask.plan(cfg, lay, micro)
    assert got["block_mask_builds_per_step"] == (1 if lay.pp > 1 else micro)
    assert got["block_mask_evaluations_per_step"] == micro * microbatch_size * seq_len**2
    assert got["block_mask_gb_per_gpu"] == built / 1e9
    synthetic = compose([*overrides[:-1], "data=synthetic"])
    assert block_mask.builds_per_step(synthetic, lay, micro) == (1 if lay.pp > 1 else 0)
    cpu = compose([*overrides[:-1], "cluster=local_cpu", "data=text"])
    assert block_mask.held_bytes(cpu, lay, micro) == 0 and block_mask.builds_per_step(cpu, lay, micro) == 0


def test_the_dry_run_builds_the_steps_block_mask_with_torchtitans_mask_function(compose):
    """mode=dryrun's block-mask line: TorchTitan's packed-document BlockMask built for real on this CPU for one sample of
    the run's seq_len, its bytes times the step's batch equal to the plan's, its build timed; none on a CPU cluster."""
    from runner.estimate import dryrun_report
    from runner.run.dryrun import batches
    from runner.schema import layout

    cfg = compose(["parallelism=tp2_pp2", "cluster=h100_node", "training.seq_len=700", "data=text"])
    lay = layout.resolve(cfg.parallelism, cfg.cluster)
    got = batches.block_mask_probe(cfg, lay)
    micro = cfg.training.global_batch_size // (lay.dp * cfg.training.microbatch_size)
    assert got["batch"] == micro * cfg.training.microbatch_size and got["builds_per_step"] == 1
    assert got["sample_bytes"] == 16 * 6 * 7 and got["sample_bytes"] * got["batch"] == got["plan_bytes"] and got["sample_build_s"] > 0
    line = dryrun_report.block_mask_line(got)
    assert line.startswith("block masks (FlexAttention, 8 x 700 tokens, 1 built per step): plan 5.38 kB, ")
    assert "TorchTitan's mask function builds 5.38 kB (672 B per sample); one sample's build took " in line
    assert batches.block_mask_probe(compose(["parallelism=tp2_pp2", "data=text"]), lay) is None  # CPU: SDPA, no BlockMask
