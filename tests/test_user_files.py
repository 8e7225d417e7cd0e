"""Every file a user hands over is read without a traceback (issue 45 item 14).

For each reader (a Hugging Face folder's shard header, config.json and index; a prepared folder's manifest; a frozen
run file; a checkpoint's COMPLETE.json; a tokenizer), the same bad files: empty, cut in half, cut at its end, random
bytes, and JSON (or YAML) of the wrong type. Each must end in the reader's refusal (ConfigError, ManifestError or
UnreadableFile) naming the file, never another exception; a valid file of each kind passes, so the refusal is the bad
file's. The command lines (`python -m runner` with model.init_from and a replay, `python -m runner.launch`,
`python -m runner.data prepare`, `python -m runner.export`) exit 2 with one message, no traceback and no run folder.
"""

from __future__ import annotations

import json
import random
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from runner.config import freeze, validate
from runner.formats import checkpoint, hf_folder, runfiles
from runner.formats import data_manifest as manifest
from runner.formats.user_files import UnreadableFile
from runner.schema.problems import ConfigError
from tests.conftest import run_cli

RANDOM = random.Random(14).randbytes(64)
"""Random bytes (not UTF-8: the 0x80-0xff bytes at random make that certain for this seed)."""
HF = ["model=llama3_debugmodel", "parallelism=single", "model.init_from=/set/by/the/test"]


def _safetensors(header: object, data: bytes) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


SHARD = _safetensors({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8))
INDEX = json.dumps({"metadata": {}, "weight_map": {"w": hf_folder.SINGLE}})
MANIFEST = {
    "version": manifest.VERSION,
    "tokenizer": {"sha256": "0" * 64, "vocab_size": 3},
    "dtype": "uint16",
    "splits": {s: {"tokens": 0, "documents": 0, "parts": []} for s in manifest.SPLITS},
}
MARKER = {"step": 3, "files": {".metadata": {"bytes": 5}}}


def _tokenizer() -> str:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({"<unk>": 0, "hello": 1, "<|end_of_text|>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    return tok.to_str()


@dataclass(frozen=True)
class Reader:
    file: str
    """The file's path inside the test's folder."""
    valid: Callable[[], bytes]
    wrong: tuple[bytes, ...]
    """JSON (YAML) of the wrong type: an array where an object is, a string where a number is, ..."""


READERS = {
    "shard header": Reader(
        f"hf/{hf_folder.SINGLE}",
        lambda: SHARD,
        (
            _safetensors([], b""),
            _safetensors({"w": {"dtype": 3, "shape": [2], "data_offsets": [0, 8]}}, bytes(8)),
            _safetensors({"w": {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}}, bytes(8)),
            _safetensors({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(80)),
        ),
    ),
    "config.json": Reader(
        f"hf/{hf_folder.CONFIG}",
        lambda: b'{"model_type": "llama", "hidden_size": 256}',
        (b"[]", b'{"model_type": "llama", "hidden_size": "256"}', b'{"text_config": "llama"}', b'{"rope_parameters": [1]}'),
    ),
    "index": Reader(
        f"hf/{hf_folder.INDEX}",
        INDEX.encode,
        (b"[]", b'{"weight_map": ["w"]}', b'{"weight_map": {"w": 3}}'),
    ),
    "manifest": Reader(
        f"prepared/{manifest.MANIFEST}",
        lambda: json.dumps(MANIFEST).encode(),
        (b"[]", b'"manifest"', json.dumps({**MANIFEST, "tokenizer": {"sha256": "0" * 64, "vocab_size": "3"}}).encode()),
    ),
    "frozen.yaml": Reader(
        f"run/{runfiles.FROZEN}",
        lambda: b"",  # written by the test from the default config (freeze.write)
        tuple(f"{body}\n{freeze.END}\n".encode() for body in ("- 1\n- 2", "training: 5", "training:\n  steps: many", "7")),
    ),
    "COMPLETE.json": Reader(
        f"ckpt/step-3/{runfiles.CHECKPOINT_MARKER}",
        lambda: json.dumps(MARKER).encode(),
        (
            b"[]",
            json.dumps({**MARKER, "step": "3"}).encode(),
            json.dumps({**MARKER, "files": [".metadata"]}).encode(),
            json.dumps({**MARKER, "files": {".metadata": {"bytes": "5"}}}).encode(),
            json.dumps({**MARKER, "model": ["llama3"]}).encode(),
        ),
    ),
    "tokenizer": Reader(
        "tokenizer.json",
        lambda: _tokenizer().encode(),
        (b"[]", b'{"model": 3}', b'{"version": "1.0", "model": {"type": "WordLevel", "vocab": {}, "unk_token": "x"}}'),
    ),
}


def _cases(reader: Reader, valid: bytes) -> dict[str, bytes]:
    out = {"empty": b"", "cut in half": valid[: len(valid) // 2], "cut at its end": valid[:-3], "random bytes": RANDOM}
    return out | {f"wrong type {i}": w for i, w in enumerate(reader.wrong)}


CASES = [(name, case) for name, r in READERS.items() for case in _cases(r, b"x" * 10)]


@pytest.fixture
def folder(compose, tmp_path) -> Path:
    """Every reader's files, valid: a Hugging Face folder (config.json, index, shard), a prepared folder, a run folder
    with its frozen file, a checkpoint with its .metadata, a tokenizer and a data file."""
    for name, r in READERS.items():
        path = tmp_path / r.file
        path.parent.mkdir(parents=True, exist_ok=True)
        if name == "frozen.yaml":
            cfg = compose([])
            freeze.write(cfg, validate.check(cfg), path.parent)
        else:
            path.write_bytes(r.valid())
    (tmp_path / "ckpt" / "step-3" / ".metadata").write_bytes(b"m" * 5)
    (tmp_path / "data.jsonl").write_text('{"text": "hello"}\n')
    return tmp_path


def _refusal(compose, folder: Path, name: str) -> str:
    """The reader's refusal of its file in `folder`, through its guarded entry; fails on any other exception and on
    no refusal at all."""
    if name in ("shard header", "config.json", "index"):
        cfg = compose(HF)
        cfg.model.init_from = str(folder / "hf")
        with pytest.raises(ConfigError) as e:
            validate.preflight(cfg, folder / "launch")  # the launch's preflight reads all three
        return str(e.value)
    if name == "manifest":
        with pytest.raises(manifest.ManifestError) as e:
            manifest.load(folder / "prepared")
        return str(e.value)
    if name == "frozen.yaml":
        path = folder / READERS[name].file
        with pytest.raises(UnreadableFile) as e:
            freeze.load(path)  # the ranks and `python -m runner.launch`
        assert freeze.refusal(path) == str(e.value)  # `python -m runner --config-dir <run> --config-name frozen`, before Hydra
        return str(e.value)
    if name == "COMPLETE.json":
        ckpt = folder / "ckpt" / "step-3"
        with pytest.raises(UnreadableFile) as e:
            checkpoint.marker(ckpt)
        assert checkpoint.verify(ckpt) == f"{e.value.path} {e.value.why}"  # what resume and export say of the checkpoint
        return str(e.value)
    assert name == "tokenizer"
    with pytest.raises(ConfigError) as e:
        validate.preflight(_text(compose, folder), folder / "launch")  # mode=validate's preflight reads the tokenizer
    return str(e.value)


def test_each_readers_valid_file_passes(compose, folder):
    """The baseline: with every file whole, no reader refuses (so each refusal below is its bad file's)."""
    cfg = compose(HF)
    cfg.model.init_from = str(folder / "hf")
    validate.preflight(cfg, folder / "launch")
    assert manifest.load(folder / "prepared")["version"] == manifest.VERSION
    frozen = folder / READERS["frozen.yaml"].file
    assert freeze.load(frozen).training == compose([]).training and freeze.refusal(frozen) is None
    assert checkpoint.verify(folder / "ckpt" / "step-3") is None
    assert manifest.vocab_size(manifest.tokenizer(folder / "tokenizer.json")) == 3
    validate.preflight(_text(compose, folder), folder / "launch")


def _text(compose, folder: Path):
    """mode=validate of data=text with the folder's data file and tokenizer (validation reads the tokenizer)."""
    cfg = compose(["mode=validate", "data=text", "data.files=[/set/by/the/test]", "data.tokenizer=/set/by/the/test"])
    cfg.data.files, cfg.data.tokenizer = [str(folder / "data.jsonl")], str(folder / "tokenizer.json")
    return cfg


@pytest.mark.parametrize("name, case", CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_a_bad_file_is_refused_naming_it(compose, folder, name, case):
    reader = READERS[name]
    path = folder / reader.file
    path.write_bytes(_cases(reader, path.read_bytes())[case])
    message = _refusal(compose, folder, name)
    assert str(path) in message, message
    assert "Fix: " in message or name == "manifest", message  # a ManifestError is worded into a Problem with its fix
    assert "Traceback" not in message


HF_FIXES = {
    "empty": "has 0 bytes, fewer than the 8 that give a safetensors header's length",
    "random bytes": "more than safetensors allows (100000000): not a safetensors file",
    "cut in half": "starts with a header length of 61 bytes, but holds 38: cut short, or not a safetensors file",
    "cut at its end": "has tensors that end at byte 8 of its data, which holds 5 bytes: cut short",
}


@pytest.mark.parametrize("case", list(HF_FIXES))
def test_a_shard_says_what_is_wrong_with_it(compose, folder, case):
    path = folder / READERS["shard header"].file
    path.write_bytes(_cases(READERS["shard header"], SHARD)[case])
    assert f"model.init_from = {folder / 'hf'}: {path} " in _refusal(compose, folder, "shard header")
    assert HF_FIXES[case] in _refusal(compose, folder, "shard header")


def test_a_json_file_says_what_is_wrong_with_it(tmp_path):
    """The words of the one JSON reader every JSON file above goes through."""
    from runner.formats.user_files import read_json

    path = tmp_path / "f.json"
    for body, why in (
        (b"", "is empty"),
        (b" \n", "is empty"),
        (b'{"a": [1, 2', "is not JSON (Expecting ',' delimiter: line 1 column 12 (char 11)): it was cut short"),
        (b'{"a": "b', "is not JSON (Unterminated string starting at: line 1 column 7 (char 6)): it was cut short"),
        (b"{a}", "is not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
        (b"\xff\xfe{}", "is not UTF-8 text (byte 0xff at offset 0): random bytes, or another format"),
        (b"[1]", "holds an array where an object is expected"),
        (b'"x"', "holds a string where an object is expected"),
        (b"null", "holds null where an object is expected"),
        (b"[" * 100_000, "is not JSON (nested too deeply)"),
    ):
        path.write_bytes(body)
        with pytest.raises(UnreadableFile) as e:
            read_json(path, "fix it")
        assert str(e.value) == f"{path} {why}. Fix: fix it.", body[:20]
    with pytest.raises(UnreadableFile, match=r"cannot be read \(No such file or directory\)"):
        read_json(tmp_path / "nowhere.json", "fix it")


# ---- the command lines -----------------------------------------------------------------------------------


def _no_traceback(code: int, err: str, path: Path, run: Path | None = None) -> None:
    assert code == 2 and "Traceback" not in err and "HYDRA_FULL_ERROR" not in err, err
    assert str(path) in err, err
    assert run is None or not run.exists(), "a refused launch leaves no run folder"


@pytest.mark.e2e
def test_init_from_a_garbage_shard_exits_2_naming_it(folder):
    """The issue's case: 64 bytes of 0xff as model.safetensors ended the preflight in OverflowError (exit 1)."""
    shard = folder / READERS["shard header"].file
    shard.write_bytes(b"\xff" * 64)
    run = folder / "out"
    proc = run_cli(*HF[:2], f"model.init_from={folder / 'hf'}", run_dir=run)
    _no_traceback(proc.returncode, proc.stderr, shard, run)
    assert f"model.init_from = {folder / 'hf'}: {shard} starts with a header length of 18446744073709551615 bytes" in proc.stderr


@pytest.mark.e2e
@pytest.mark.parametrize("case", ["cut in half", "random bytes", "wrong type 2"])
def test_a_replay_of_a_bad_frozen_file_exits_2_naming_it(folder, case):
    frozen = folder / READERS["frozen.yaml"].file
    frozen.write_bytes(_cases(READERS["frozen.yaml"], frozen.read_bytes())[case])
    run = folder / "replay"
    proc = run_cli("--config-dir", str(frozen.parent), "--config-name", "frozen", run_dir=run)
    _no_traceback(proc.returncode, proc.stderr, frozen, run)
    assert len(proc.stderr.strip().splitlines()) <= 2, proc.stderr  # one message (a cut one: where, then the fix)


def test_runner_launch_refuses_a_bad_frozen_file(monkeypatch, capsys, folder):
    """`python -m runner.launch <frozen.yaml>` (on each node) reads the file before the preflight and torchrun."""
    from runner.run import node_launch

    frozen = folder / READERS["frozen.yaml"].file
    monkeypatch.setattr(node_launch.procs, "exit_now", sys.exit)  # not os._exit, which would end pytest
    for body in (b"", RANDOM, READERS["frozen.yaml"].wrong[0]):
        frozen.write_bytes(body)
        monkeypatch.setattr(sys, "argv", ["runner.launch", "--nproc-per-node=1", str(frozen)])
        with pytest.raises(SystemExit) as e:
            node_launch.cli()
        _no_traceback(e.value.code, capsys.readouterr().err, frozen)


def test_data_prepare_refuses_a_bad_tokenizer(capsys, folder):
    from runner.data import cli

    tok = folder / "tokenizer.json"
    for body in (b"", RANDOM, b"[]", READERS["tokenizer"].wrong[2]):
        tok.write_bytes(body)
        code = cli.main(["prepare", "--input", str(folder / "data.jsonl"), "--tokenizer", str(tok), "--out", str(folder / "new")])
        _no_traceback(code, capsys.readouterr().err, tok, folder / "new")


def test_export_refuses_a_bad_marker_frozen_file_or_tokenizer(capsys, compose, folder):
    """`python -m runner.export <run folder>`: the run's frozen file, its checkpoint's COMPLETE.json, its tokenizer."""
    from runner.run import hf_export

    cfg = compose(["checkpoint=local", "data=text", "data.files=[x.jsonl]", "data.tokenizer=/set/by/the/test"])
    cfg.checkpoint.folder, cfg.data.tokenizer = str(folder / "ckpt"), str(folder / "tokenizer.json")
    freeze.write(cfg, validate.check(cfg), folder / "run")
    marker = folder / READERS["COMPLETE.json"].file
    marker.write_text(json.dumps({**MARKER, "model": checkpoint.model_identity(cfg.model)}))
    out = folder / "export"
    for path, body in (
        (marker, RANDOM),
        (marker, READERS["COMPLETE.json"].wrong[1]),
        (folder / "tokenizer.json", b"[]"),
        (folder / "run" / runfiles.FROZEN, b"\x00" * 10),
    ):
        before = path.read_bytes()
        path.write_bytes(body)
        code = hf_export.main([str(folder / "run"), "--format", "hf", "--out", str(out)])
        _no_traceback(code, capsys.readouterr().err, path, out)
        path.write_bytes(before)
