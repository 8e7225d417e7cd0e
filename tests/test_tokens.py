"""data=tokens: `python -m runner.data prepare`, the memory-mapped reader, the on-the-fly permutation, mixtures,
prefetch, and their checks before launch.

The session's one Hydra multirun (conftest's shared_runs: torch and TorchTitan imported once) trains: a 4-rank
dp_shard=2 x tp=2 reference on one prepared folder with a checkpoint every step, the same run with rank 1 SIGKILLed
and restarted by the elastic agent, a 2-rank reference and a killed run on a two-folder mixture, and a pp=2 run
that resumes the reference's step-1 checkpoint. Everything else runs without ranks on a tiny generated corpus.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from runner.config import validate
from runner.config.validate import data_rules as validate_tokens
from runner.data import cli
from runner.formats import data_manifest as manifest
from runner.formats import data_order as order
from runner.run.loader import Prefetch
from runner.run.token_data import TokenData
from runner.schema.problems import ConfigError
from tests import text_assets
from tests.conftest import metrics, run_cli
from tests.multiruns import Lazy
from tests.points import TOKENS_POINTS as POINTS
from tests.points import TOKENS_SEQ as SEQ
from tests.points import TOKENS_STEPS as STEPS
from tests.text_assets import FRACTION
from tests.text_assets import prepare_cli as _prepare


@pytest.fixture(scope="module")
def assets(token_folders):
    return token_folders  # the folders the shared runs read


def _expected(corpus: Path, tok: Path) -> dict[str, tuple[list[int], list[int]]]:
    """Hand computation of a part: every document's ids + EOS, document j held out when floor((j+1) f) > floor(j f)."""
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(tok))
    eos = t.token_to_id(text_assets.EOS)
    docs = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    out: dict[str, tuple[list[int], list[int]]] = {"train": ([], []), "eval": ([], [])}
    for j, enc in enumerate(t.encode_batch(docs)):
        tokens, ends = out["eval" if int((j + 1) * FRACTION) > int(j * FRACTION) else "train"]
        tokens.extend([*enc.ids, eos])
        ends.append(len(tokens))
    return out


# ---- prepare -------------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_prepare_writes_tokens_index_and_manifest(assets):
    m = manifest.load(assets.a)
    want = _expected(assets.corpus, assets.tok)
    for split in manifest.SPLITS:
        tokens = np.fromfile(manifest.tokens_file(assets.a, "part-00000", split), dtype=np.uint16)
        ends = np.fromfile(manifest.index_file(assets.a, "part-00000", split), dtype=np.uint64)
        assert tokens.tolist() == want[split][0] and ends.tolist() == want[split][1]
        assert (m["splits"][split]["tokens"], m["splits"][split]["documents"]) == (len(want[split][0]), len(want[split][1]))
    assert m["splits"]["eval"]["documents"] == 15  # 5 % of 300 documents, held out whole
    assert m["dtype"] == "uint16" and m["tokenizer"]["vocab_size"] == 512 and m["eos_id"] == 0
    src = m["sources"][0]
    assert (src["path"], src["bytes"], src["sha256"]) == (
        str(assets.corpus),
        assets.corpus.stat().st_size,
        hashlib.sha256(assets.corpus.read_bytes()).hexdigest(),
    )
    assert not (assets.a / ".cache").exists() and not list(assets.a.glob("*.tmp"))


@pytest.mark.e2e
def test_data_package_is_torch_free():
    code = (
        "import sys, runner.data.cli, runner.data.prepare, runner.formats.data_order; assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_dtype_is_uint16_while_the_vocabulary_fits():
    assert [manifest.dtype_for(v) for v in (512, 65_536, 65_537, 128_256)] == ["uint16", "uint16", "uint32", "uint32"]


@pytest.mark.e2e
def test_prepare_is_idempotent_and_resumes_after_an_interruption(assets, tmp_path, capsys):
    out = tmp_path / "ab"
    assert _prepare([assets.corpus, assets.other], assets.tok, out) == 0
    files = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    assert _prepare([assets.corpus, assets.other], assets.tok, out) == 0  # nothing to do: nothing rewritten
    assert "already up to date:" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    # interrupted while writing part 1: its record and the manifest never got written, a temporary file is left
    (out / "part-00001.json").unlink()
    (out / manifest.MANIFEST).unlink()
    (out / "part-00001.train.bin").rename(out / "part-00001.train.bin.tmp")
    assert _prepare([assets.corpus, assets.other], assets.tok, out) == 0
    said = capsys.readouterr().out
    assert "part-00000: corpus.jsonl already prepared" in said and "part-00001: other.jsonl -> " in said
    assert {p.name: p.read_bytes() for p in sorted(out.iterdir())} == files
    assert (out / "part-00000.train.bin").stat().st_mtime_ns == stamps["part-00000.train.bin"]  # part 0 was not redone


@pytest.mark.e2e
@pytest.mark.parametrize(
    "change,option",
    [
        ({"input": "missing.jsonl"}, "--input"),
        ({"input": "corpus.csv"}, "--input"),
        ({"tokenizer": "missing.json"}, "--tokenizer"),
        ({"eval": "1.5"}, "--eval-fraction"),
        ({"proc": "0"}, "--num-proc"),
        ({"field": "body"}, "--text-field"),
        ({"out": "a_file"}, "--out"),
    ],
)
def test_prepare_refuses_bad_arguments_before_writing(assets, tmp_path, capsys, change, option):
    (tmp_path / "corpus.csv").write_text("text\nhello\n")
    (tmp_path / "a_file").write_text("")
    inp = str(tmp_path / change["input"]) if "input" in change else str(assets.corpus)
    tok = str(tmp_path / change["tokenizer"]) if "tokenizer" in change else str(assets.tok)
    out = tmp_path / change.get("out", "prepared")
    argv = ["prepare", "--input", inp, "--tokenizer", tok, "--out", str(out), "--eval-fraction", change.get("eval", "0.01")]
    argv += ["--num-proc", change.get("proc", "1"), "--text-field", change.get("field", "text")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("Invalid config (1 problem):") and f"  - {option} = " in err and "Fix: " in err, err
    assert not (tmp_path / "prepared").exists()


# ---- bad input: in-process (--num-proc 1), no launch ------------------------------------------------------


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 40-document corpus, its tokenizer, and the corpus prepared into `prepared`."""
    root = tmp_path_factory.mktemp("small")
    corpus, tok = text_assets.make(root, n_docs=40, vocab_size=300)
    assert _prepare([corpus], tok, root / "prepared") == 0
    return SimpleNamespace(corpus=corpus, tok=tok, lines=corpus.read_text().splitlines(), root=root, prepared=root / "prepared")


def _files(folder: Path) -> dict[str, bytes] | None:
    return {p.name: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()} if folder.exists() else None


def _jsonl(path: Path, lines: list[str], end: str = "\n") -> Path:
    path.write_text("\n".join(lines) + end)
    return path


@pytest.mark.parametrize(
    "case,where,message",
    [
        ("corrupt", "bad.jsonl:6", "not JSON (Unterminated string starting at column 10)"),
        (
            "truncated",
            "bad.jsonl:41",
            "not JSON (Unterminated string starting at column 10); the file ends inside this line: it was cut short",
        ),
        ("number", "bad.jsonl:4", "its 'text' is 42, not a string"),
        ("list", "bad.jsonl:2", """its 'text' is ["a", "b"], not a string"""),
    ],
)
def test_prepare_refuses_a_bad_record_naming_its_line_and_leaves_the_folder_as_it_was(small, tmp_path, capsys, case, where, message):
    lines = small.lines
    bad = tmp_path / "bad.jsonl"
    if case == "truncated":
        _jsonl(bad, [*lines, '{"text": "Ka lo'], end="")
    else:
        row = {"corrupt": (5, '{"text": "Ka lo}'), "number": (3, '{"text": 42}'), "list": (1, '{"text": ["a", "b"]}')}[case]
        _jsonl(bad, [*lines[: row[0]], row[1], *lines[row[0] :]])
    out = tmp_path / "out"
    shutil.copytree(small.prepared, out)
    before = _files(out)
    assert _prepare([bad], small.tok, out) == 2
    err = capsys.readouterr().err
    assert f"  - --input = {tmp_path / where}: {message}. Fix: repair or delete that line" in err, err
    assert _files(out) == before  # the previous preparation is intact: no .cache, no temporary file
    assert _prepare([bad], small.tok, tmp_path / "new") == 2 and not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    "case,message",
    [
        ("empty", "--input = {tmp}/empty.jsonl: the file holds no records. Fix: leave it out of --input"),
        ("foreign", "--out = {tmp}/out: part-00000.json is not JSON (Expecting value: line 1 column 1 (char 0)). "
                    "Fix: move {tmp}/out/part-00000.json away"),
        ("eos", "--eos-token = <nope>: not a token of {tok}: documents would run together with no separator. "
                "Fix: give the tokenizer's end-of-document token, one of its special tokens ['<|end_of_text|>']"),
    ],
)  # fmt: skip
def test_prepare_refuses_an_empty_input_a_foreign_out_and_an_unknown_eos_token(small, tmp_path, capsys, case, message):
    inp, extra, out = small.corpus, [], tmp_path / "out"
    if case == "empty":
        inp = tmp_path / "empty.jsonl"
        inp.write_text("\n \n")
    if case == "foreign":
        out.mkdir()
        (out / "part-00000.json").write_text("not a record\n")
    if case == "eos":
        extra = ["--eos-token", "<nope>"]
    before = _files(out)
    assert _prepare([inp], small.tok, out, *extra) == 2
    err = capsys.readouterr().err
    assert message.format(tmp=tmp_path, tok=small.tok) in err, err
    assert _files(out) == before


def test_prepare_skips_and_counts_records_without_text(small, tmp_path, capsys):
    """The choice for a null, missing or empty text: skip the record, count it (manifest and console)."""
    mixed = _jsonl(tmp_path / "mixed.jsonl", [*small.lines[:3], '{"text": null}', '{"id": 7}', '{"text": ""}', *small.lines[3:]])
    assert _prepare([mixed], small.tok, tmp_path / "out") == 0
    assert "skipped 3 records whose text was null, missing or empty (skipped_records in manifest.json)" in capsys.readouterr().out
    m, clean = manifest.load(tmp_path / "out"), manifest.load(small.prepared)
    assert m["skipped_records"] == m["sources"][0]["skipped_records"] == 3 and clean["skipped_records"] == 0
    assert sum(m["splits"][s]["documents"] for s in manifest.SPLITS) == 40  # every document with text, once
    assert sum(m["splits"][s]["tokens"] for s in manifest.SPLITS) == sum(clean["splits"][s]["tokens"] for s in manifest.SPLITS)


def test_prepare_with_fewer_inputs_removes_the_stale_parts(small, tmp_path, capsys):
    other = _jsonl(tmp_path / "other.jsonl", [json.dumps({"text": d}) for d in text_assets.documents(10, seed=2)])
    out = tmp_path / "out"
    assert _prepare([small.corpus, other], small.tok, out) == 0 and (out / "part-00001.train.bin").is_file()
    capsys.readouterr()
    assert _prepare([small.corpus], small.tok, out) == 0
    assert "removed part-00001: parts of inputs no longer given" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in small.prepared.iterdir())
    assert [p["name"] for p in manifest.load(out)["splits"]["train"]["parts"]] == ["part-00000"]


def test_ctrl_c_exits_130_and_leaves_the_folder_as_it_was(small, tmp_path, capsys, monkeypatch):
    from runner.data import prepare

    def interrupted(self, batch, indices):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare._Encode, "__call__", interrupted)
    other = _jsonl(tmp_path / "other.jsonl", [json.dumps({"text": d}) for d in text_assets.documents(10, seed=2)])
    out = tmp_path / "out"
    shutil.copytree(small.prepared, out)
    before = _files(out)
    for folder in (out, tmp_path / "new"):
        try:
            rc = _prepare([other], small.tok, folder)
        except KeyboardInterrupt:
            rc = "KeyboardInterrupt escaped"
        assert rc == 130
        err = capsys.readouterr().err
        assert f"interrupted: {folder} holds no half-written file and no .cache" in err and "Fix: rerun the same command to resume" in err
    assert _files(out) == before and not (tmp_path / "new").exists()


MANIFEST_EDITS = [
    (lambda m: m.pop("splits"), "lacks the key 'splits'"),
    (lambda m: m["tokenizer"].pop("vocab_size"), "lacks the key 'tokenizer.vocab_size'"),
    (lambda m: m["splits"]["eval"]["parts"][0].pop("tokens"), "lacks the key 'splits.eval.parts[0].tokens'"),
    (lambda m: m["splits"]["train"].update(tokens="many"), """'splits.train.tokens' is "many", not int"""),
    (lambda m: m.update(dtype="float7"), "has dtype 'float7', not one of uint16, uint32"),
]


def test_validate_names_the_key_a_manifest_lacks(compose, small, tmp_path):
    folder = tmp_path / "edited"
    shutil.copytree(small.prepared, folder)
    good = json.loads((folder / manifest.MANIFEST).read_text())
    cfg = compose(["mode=validate", "data=tokens", f"data.path={folder}", f"training.seq_len={SEQ}"])
    for edit, why in MANIFEST_EDITS:
        m = json.loads(json.dumps(good))
        edit(m)
        (folder / manifest.MANIFEST).write_text(json.dumps(m))
        with pytest.raises(ConfigError) as e:
            validate.preflight(cfg, tmp_path)
        got = [p for p in e.value.problems if p.field.startswith("data.")]
        assert [(p.field, p.value) for p in got] == [("data.path", str(folder))], [str(p) for p in got]
        assert got[0].why.startswith(f"{folder / manifest.MANIFEST} {why}") and "python -m runner.data prepare" in got[0].fix, got[0]


def test_a_held_out_split_too_small_for_evaluation_is_refused_before_launch(compose, small, tmp_path, capsys):
    """eval.steps global batches of the held-out split must fit in it (every rank once failed at start-up): refused by
    mode=validate and the preflight from the manifests' counts, for data.path and each folder of a data.mix, with a fix
    that fits prepared folders (eval.steps that fits, or --eval-fraction; not data=text's data.eval_files); and
    `runner.data prepare` warns when the split it writes is empty or shorter than one pass of the defaults."""
    split = manifest.load(small.prepared)["splits"]["eval"]
    held = (split["tokens"] - split["documents"]) // 16  # samples of seq_len (input, label) pairs, within documents
    assert held == 10
    base = ["data=tokens", "training.seq_len=16", "eval.interval=3"]
    cfg = compose(["mode=validate", *base, f"data.path={small.prepared}", "eval.steps=2"])
    with pytest.raises(ConfigError) as e:  # mode=validate runs the preflight too (runner/cli.py)
        validate.preflight(cfg, tmp_path / "run", validate.check(cfg))
    assert [str(p) for p in e.value.problems] == [
        f"data.path = {small.prepared}: its held-out split holds 10 samples of training.seq_len = 16 (input, label) pairs (168 tokens), "
        "fewer than the 16 an evaluation pass reads (eval.steps 2 x global batch 8). Fix: use eval.steps=1, or prepare "
        f"{small.prepared} again with a larger --eval-fraction (it was {text_assets.FRACTION})."
    ]
    fixed = compose([*base, f"data.path={small.prepared}", "eval.steps=1"])
    validate.preflight(fixed, tmp_path / "run")  # the fix passes
    with pytest.raises(ConfigError, match="its held-out split holds 10 samples"):
        validate.preflight(compose([*base, f"data.path={small.prepared}", "eval.steps=2"]), tmp_path / "run")
    assert _prepare([small.corpus], small.tok, tmp_path / "none", "--eval-fraction", "0.001") == 0  # 40 documents: none held out
    assert capsys.readouterr().err.splitlines()[-1] == (
        "WARNING: the held-out split is empty: a run with eval.interval > 0 on this folder is refused. "
        "Fix: prepare again with a larger --eval-fraction (now 0.001)."
    )
    mix = f"data.mix=[{{path:{small.prepared},weight:1}},{{path:{tmp_path / 'none'},weight:1}}]"
    with pytest.raises(ConfigError) as e:
        validate.preflight(compose([*base, mix, "eval.steps=1"]), tmp_path / "run")
    assert [str(p) for p in e.value.problems] == [
        f"data.mix[1].path = {tmp_path / 'none'}: its held-out split holds 0 samples of training.seq_len = 16 (input, label) "
        "pairs (0 tokens), fewer than the 4 an evaluation pass reads (its share of eval.steps 1 x global batch 8). "
        f"Fix: prepare {tmp_path / 'none'} again with a larger --eval-fraction (it was 0.001), or set eval.interval=0 to "
        "evaluate nothing."
    ]
    assert cli.held_out_warning({"tokens": 168, "documents": 2}, 0.05).startswith(
        "WARNING: the held-out split holds 168 tokens, fewer than one evaluation pass of the defaults reads (eval.steps 4 x "
        "training.global_batch_size 8 x training.seq_len 256 + 1 = 8,193)"
    )
    assert cli.held_out_warning({"tokens": 0, "documents": 0}, 0.0) is None  # none asked for


# ---- order ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 10, 1000, 4097])
def test_permutation_is_a_seeded_bijection(n):
    p = order.Permutation(n, seed=7)
    got = [p(i) for i in range(n)]
    assert sorted(got) == list(range(n))
    assert got == [order.Permutation(n, seed=7)(i) for i in range(n)]  # deterministic: a new object, the same order
    if n >= 10:
        assert got != list(range(n)) and got != [order.Permutation(n, seed=8)(i) for i in range(n)]


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.3, 0.2], [1, 1, 1, 5]])
def test_mixture_proportions_hold_and_indices_are_dense(weights):
    mix, n = order.Mixture(weights), 10_000
    picks = [mix(g) for g in range(n)]
    for s, w in enumerate(weights):
        ks = [k for src, k in picks if src == s]
        assert abs(len(ks) / n - w / sum(weights)) < 0.01
        assert ks == list(range(len(ks)))  # within-source index: every sample of the source once, in order
    assert picks == [order.Mixture(weights)(g) for g in range(n)]
    for m in (0, 1, 7, 999, n):  # counts(m): how many of the first m samples each source feeds, without walking them
        assert mix.counts(m) == [sum(1 for src, _ in picks[:m] if src == s) for s in range(len(weights))]


# ---- reader ---------------------------------------------------------------------------------------------


def _data(assets, dp_rank=0, dp=1, gb=8, sources=None, **kw) -> TokenData:
    sources = sources or [(str(assets.a), 1.0)]
    return TokenData(
        sources, seed=3, shuffle=kw.pop("shuffle", True), seq_len=SEQ, global_batch=gb, microbatch=2, dp_rank=dp_rank, dp=dp, **kw
    )


@pytest.mark.e2e
def test_token_data_reads_the_prepared_stream_and_keeps_the_stream_guarantees(assets):
    want = _expected(assets.corpus, assets.tok)
    whole = _data(assets)
    assert whole.splits[0]._maps == {}  # start-up opens no token file: nothing grows with the corpus
    stream = want["train"][0]
    for g in range(20):
        s = whole.token_start(g)
        assert whole.sample(g).tolist() == stream[s : s + SEQ + 1]
    assert sorted(whole.token_start(g) // SEQ for g in range(whole.num_samples[0])) == list(range(whole.num_samples[0]))
    rows = torch.cat([mb.inputs for mb in whole.microbatches(5)])
    shards = [torch.cat([mb.inputs for mb in _data(assets, r, 4).microbatches(5)]) for r in range(4)]
    assert torch.equal(torch.cat(shards), rows)
    # the position is a global sample index: a batch-size change on resume continues at the same sample
    small = _data(assets, gb=4)
    small.load_state_dict(whole.state_dict(steps_done=3), steps_done=3)
    assert small.indices(3) == list(range(24, 28)) and torch.equal(small.sample(24), whole.sample(24))
    ev = _data(assets, split="eval", shuffle=False)
    assert ev.sample(0).tolist() == want["eval"][0][: SEQ + 1] and ev.num_samples == [(len(want["eval"][0]) - 1) // SEQ]


@pytest.mark.e2e
def test_mixture_reads_each_source_in_its_share(assets):
    mixed = _data(assets, sources=[(str(assets.a), 0.7), (str(assets.b), 0.3)])
    b = np.fromfile(manifest.tokens_file(assets.b, "part-00000", "train"), dtype=np.uint16).tolist()
    picks = [mixed.mixture(g) for g in range(100)]
    assert [k for src, k in picks if src == 1] == list(range(30))
    for g, (src, _) in enumerate(picks):
        start = mixed.token_start(g)
        assert start >> 48 == src
        if src == 1:  # source 1 reads folder b
            s = start & ((1 << 48) - 1)
            assert mixed.sample(g).tolist() == b[s : s + SEQ + 1]
    # a data verdict's record of a step: every global sample, the folder it is read from and its token range there
    samples = mixed.step_samples(2)
    assert [e["index"] for e in samples] == list(range(16, 24))
    for e in samples:
        src = mixed.mixture(e["index"])[0]
        assert e["source"] == str([assets.a, assets.b][src]) and e["split"] == "train" and e["num_tokens"] == SEQ + 1
        assert e["token_start"] == mixed.token_start(e["index"]) & ((1 << 48) - 1)


@pytest.mark.e2e
def test_runner_data_show_decodes_a_recorded_steps_samples_from_their_folders(assets, tmp_path, capsys):
    """A run folder whose spikes.jsonl records step 3 of a two-folder mixture (tokens) and whose left_out.jsonl records step
    4 of one folder read as documents (pairs): `python -m runner.data show` prints each sample's origin and its seq_len
    inputs and last label decoded with the run's tokenizer, as the loader reads them."""
    from tokenizers import Tokenizer

    from runner.data import cli
    from runner.formats import runfiles

    decode = Tokenizer.from_file(str(assets.tok)).decode
    mixed = _data(assets, sources=[(str(assets.a), 0.7), (str(assets.b), 0.3)])
    docs = _data(assets, documents=True)
    (tmp_path / runfiles.FROZEN).write_text(f"data:\n  name: tokens\n  tokenizer: {assets.tok}\ntraining:\n  seq_len: {SEQ}\n")
    (tmp_path / runfiles.SPIKES).write_text(json.dumps({"step": 3, "verdict": "data", "samples": mixed.step_samples(2)}) + "\n")
    (tmp_path / runfiles.LEFT_OUT).write_text(json.dumps({"step": 4, "samples": docs.step_samples(3)}) + "\n")
    for step, data in ((3, mixed), (4, docs)):
        assert cli.main(["show", str(tmp_path), "--step", str(step)]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0] == f"step {step}: 8 samples (tokens data)" and len(out) == 17
        for k, g in enumerate(data.indices(step - 1)):
            if data.documents:
                inputs, labels, _ = data.window(g)
                ids = [*inputs.tolist(), int(labels[-1])]
            else:
                ids = data.sample(g).tolist()
            assert out[1 + 2 * k].startswith(f"sample {g}: {data.origin(g)['source']} (train split) ")
            assert out[2 + 2 * k] == "  " + repr(decode(ids, skip_special_tokens=False))


@pytest.mark.e2e
def test_prefetch_uses_a_read_ahead_only_for_the_same_position(assets):
    d = _data(assets)
    feed = Prefetch(d)
    for step in (0, 1):
        got = feed.get(step)
        assert all(torch.equal(a, b) for (a, *_), (b, *_) in zip(got, d.microbatches(step), strict=True))
    d.load_state_dict({"next_sample": 800}, steps_done=0)  # a restore moves the position: the read-ahead of step 2 is stale
    got = feed.get(0)
    assert torch.equal(got[0][0], torch.stack([d.sample(800), d.sample(801)])[:, :-1])
    feed.close()


# ---- checks before launch ---------------------------------------------------------------------------------


def _problems(compose, tmp_path, overrides: list[str]) -> list:
    cfg = compose(["data=tokens", f"training.seq_len={SEQ}", *overrides])
    with pytest.raises(ConfigError) as e:
        validate.check(cfg)
        validate.preflight(cfg, tmp_path / "run")
    return e.value.problems


def test_config_needs_one_prepared_source_with_positive_weights(compose, tmp_path):
    assert [p.field for p in _problems(compose, tmp_path, [])] == ["data.path"]
    got = _problems(compose, tmp_path, ["data.path=x", "data.mix=[{path:a,weight:0},{path:'',weight:1}]"])
    assert sorted(p.field for p in got) == ["data.mix", "data.mix[0].weight", "data.mix[1].path"]


@pytest.mark.e2e
def test_prepared_folders_are_checked_before_launch(compose, assets, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(assets.a, broken)
    with open(broken / "part-00000.train.bin", "r+b") as fh:
        fh.truncate(100)
    other_tok = text_assets.tokenizer("WordLevel", tmp_path / "wl.json")
    cases = [
        ([f"data.path={tmp_path}"], "data.path", "manifest.json does not exist"),
        ([f"data.path={broken}"], "data.path", "part-00000.train.bin has 100 bytes, the manifest says"),
        (
            [f"data.path={assets.a}", f"data.tokenizer={other_tok}"],
            "data.tokenizer",
            "differs from the tokenizer data.path was prepared with",
        ),
        (
            [f"data.path={assets.a}", "model.vocab_size=256"],
            "data.path",
            "prepared with a 512-token vocabulary, more than model.vocab_size 256",
        ),
        (
            [f"data.path={assets.a}", "training.seq_len=16384"],
            "data.path",
            "its train split holds 11876 (input, label) pairs (tokens less one per document), fewer than training.seq_len = 16384",
        ),
    ]
    for overrides, field, why in cases:
        got = [p for p in _problems(compose, tmp_path, overrides) if p.field.startswith("data.")]
        assert [p.field for p in got] == [field] and why in got[0].why, (overrides, [str(p) for p in got])
    cfg = compose(["data=tokens", f"data.path={assets.a}", f"data.tokenizer={assets.tok}"])
    validate.preflight(cfg, tmp_path / "run")  # the tokenizer it was prepared with passes
    short = validate_tokens.split_problem("data.path", str(assets.a), "eval", 1024)  # for readers of the held-out split
    assert short.field == "data.path" and "its eval split holds 688 tokens, fewer than training.seq_len + 1 = 1025" in short.why
    assert validate_tokens.split_problem("data.path", str(assets.a), "eval", 64) is None


@pytest.mark.e2e
def test_mixture_of_different_tokenizers_is_refused(compose, assets, tmp_path):
    other = tmp_path / "other"
    assert _prepare([assets.other], text_assets.tokenizer("BPE", tmp_path / "bpe.json"), other) == 0
    got = _problems(compose, tmp_path, [f"data.mix=[{{path:{assets.a},weight:1}},{{path:{other},weight:1}}]"])
    assert [p.field for p in got] == ["data.mix"] and "prepared with different tokenizers" in got[0].why


@pytest.mark.e2e
def test_cli_exits_2_before_writing_the_run_folder(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli("data=tokens", f"data.path={tmp_path / 'nowhere'}", run_dir=run_dir)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "data.path = " in proc.stderr and "manifest.json does not exist" in proc.stderr and "Traceback" not in proc.stderr
    assert not (run_dir / "frozen.yaml").exists()


# ---- with ranks ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(shared_runs):
    """POINTS (tests/points.py): {name: (run folder, its console)}; reading a point that failed fails the test that reads it."""
    return Lazy(POINTS, lambda name: shared_runs[name])


def _by_step(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in metrics(run_dir)}


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["tok", "mix"])
def test_sigkilled_rank_resumes_bitwise_exactly(trained, name):
    ref, got = _by_step(trained[f"{name}_ref"][0]), _by_step(trained[f"{name}_killed"][0])
    assert sum(ln.startswith("checkpoint: resumed from") for ln in trained[f"{name}_killed"][1].splitlines()) == 1
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for s in ref:
        assert (got[s]["loss"], got[s]["grad_norm"], got[s]["data_hash"]) == (ref[s]["loss"], ref[s]["grad_norm"], ref[s]["data_hash"]), s
    assert len({r["data_hash"] for r in ref.values()}) == STEPS
    assert all(0 <= r["data_s"] < r["step_time_s"] for r in ref.values())


@pytest.mark.e2e
def test_layout_change_on_resume_continues_at_the_same_global_sample(trained):
    ref, got = _by_step(trained["tok_ref"][0]), _by_step(trained["tok_pp"][0])
    assert sorted(got) == [2, 3]
    assert [got[s]["data_hash"] for s in (2, 3)] == [ref[s]["data_hash"] for s in (2, 3)]
    assert got[2]["loss"] == pytest.approx(ref[2]["loss"], abs=1e-4)
    line = "disjoint samples across 1 DP replica(s) (global samples 8-15)"  # step 2 of a global batch of 8
    assert line in trained["tok_pp"][1]
