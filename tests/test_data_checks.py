"""Text data found wrong before any rank starts: missing files and tokenizer (already in mode=validate), a text
field the files lack, and tokenizers of every `tokenizers` model type sized against the model's vocabulary."""

from __future__ import annotations

import json

import pytest

from runner.config import validate
from runner.schema.problems import ConfigError
from tests import text_assets


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return text_assets.make(tmp_path_factory.mktemp("assets"), n_docs=20)


def _text(assets, *more: str) -> list[str]:
    return ["data=text", f"data.files=[{assets[0]}]", f"data.tokenizer={assets[1]}", *more]


def _problems(fn, cfg, *args) -> list[tuple[str, object, str]]:
    with pytest.raises(ConfigError) as e:
        fn(cfg, *args)
    return [(p.field, p.value, p.why) for p in e.value.problems]


def _json_vocab(path) -> int:
    """Token ids in a tokenizers JSON file, read by hand per model type (the test's own count)."""
    body = json.loads(path.read_text())
    vocab = body["model"]["vocab"]
    ids = set(range(len(vocab))) if isinstance(vocab, list) else set(vocab.values())  # Unigram: a list of [piece, score]
    return max(ids | {t["id"] for t in body["added_tokens"]}) + 1


@pytest.mark.parametrize("kind", ["BPE", "WordPiece", "WordLevel", "Unigram"])
def test_every_tokenizer_model_type_is_sized(compose, assets, tmp_path, kind):
    tok = text_assets.tokenizer(kind, tmp_path / f"{kind}.json")
    assert json.loads(tok.read_text())["model"]["type"] == kind
    n = _json_vocab(tok)
    assert n == (126 if kind == "Unigram" else 200)  # the trainer's vocab_size; Unigram stops at what the tiny corpus holds
    cfg = compose(["data=text", f"data.files=[{assets[0]}]", f"data.tokenizer={tok}", f"model.vocab_size={n}"])
    validate.preflight(cfg, tmp_path)  # before the fix, Unigram: AttributeError: 'list' object has no attribute 'values'
    cfg.model.vocab_size = n - 1
    assert _problems(validate.preflight, cfg, tmp_path) == [
        ("data.tokenizer", str(tok), f"its vocabulary has {n} tokens, more than model.vocab_size {n - 1}")
    ]


def test_text_field_missing_from_the_files_is_found_before_launch(compose, assets, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    cfg = compose(_text(assets, "data.text_field=content"))
    assert _problems(validate.preflight, cfg, tmp_path) == [
        ("data.text_field", "content", f"{assets[0]}: its first record has the fields ['text']")
    ]
    table = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": ["a b c"], "id": [1]}), table)
    cfg = compose(["data=text", "data.format=parquet", f"data.files=[{table}]", f"data.tokenizer={assets[1]}", "data.text_field=content"])
    assert _problems(validate.preflight, cfg, tmp_path) == [("data.text_field", "content", f"{table}: its columns are ['text', 'id']")]
    cfg.data.text_field = "text"
    validate.preflight(cfg, tmp_path)


def test_mode_validate_checks_data_files_and_tokenizer(compose, assets, tmp_path):
    """mode=validate is the check users run before training: it used to say "config OK" for files that do not exist."""
    missing = ["data=text", f"data.files=[{tmp_path / 'nope.jsonl'}]", f"data.tokenizer={tmp_path / 'tok.json'}", "mode=validate"]
    validate.check(compose(missing))  # the config alone is right: the files are the preflight's, run by mode=validate too
    assert _problems(validate.preflight, compose(missing), tmp_path) == [
        ("data.files", [str(tmp_path / "nope.jsonl")], "not found (paths are relative to where `python -m runner` starts)"),
        ("data.tokenizer", str(tmp_path / "tok.json"), "no such file"),
    ]
    validate.preflight(compose(_text(assets, "mode=validate")), tmp_path)
    validate.check(compose(missing[:3] + ["mode=plan"]))  # planning a cluster run needs no local data
