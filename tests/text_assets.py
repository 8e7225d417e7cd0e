"""A tiny corpus and tokenizers (BPE, WordPiece, WordLevel, Unigram) built on the spot (nothing downloaded), for data=text
runs, and the corpus prepared into token folders for data=tokens runs."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

EOS = "<|end_of_text|>"
SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "ve", "dan", "tor", "ix", "um", "ber", "sol"]


def documents(n: int, seed: int = 0) -> list[str]:
    """Sentences over a made-up vocabulary with bigram structure, so there is something to learn."""
    rng = random.Random(seed)
    words = sorted({"".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(300)})
    docs = []
    for _ in range(n):
        sentences = []
        for _ in range(rng.randint(2, 6)):
            w = [rng.choice(words)]
            for _ in range(rng.randint(3, 10)):
                w.append(words[(words.index(w[-1]) * 7 + rng.randint(0, 5)) % len(words)])
            sentences.append(" ".join(w).capitalize() + ".")
        docs.append(" ".join(sentences))
    return docs


def make(folder: Path, n_docs: int = 300, vocab_size: int = 512) -> tuple[Path, Path]:
    """Write corpus.jsonl and tokenizer.json into `folder`; return their paths."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    docs = documents(n_docs)
    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return corpus, path


def tokenizer(kind: str, path: Path, vocab_size: int = 200, n_docs: int = 50) -> Path:
    """Train a `tokenizers` model of type `kind` (BPE, WordPiece, WordLevel or Unigram) on the corpus and save it to `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    model, trainer = {
        "BPE": (models.BPE(unk_token="[UNK]"), trainers.BpeTrainer),
        "WordPiece": (models.WordPiece(unk_token="[UNK]"), trainers.WordPieceTrainer),
        "WordLevel": (models.WordLevel(unk_token="[UNK]"), trainers.WordLevelTrainer),
        "Unigram": (models.Unigram(), trainers.UnigramTrainer),
    }[kind]
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    extra = {"show_progress": False, **({"unk_token": "[UNK]"} if kind == "Unigram" else {})}
    tok.train_from_iterator(documents(n_docs), trainer=trainer(vocab_size=vocab_size, special_tokens=["[UNK]", EOS], **extra))
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def prepared(folder: Path, eval_fraction: float = 0.05) -> Path:
    """The corpus of `make`, prepared for data=tokens (`python -m runner.data prepare`) into folder/prepared."""
    from runner.data.prepare import Request, prepare

    corpus, tok = make(folder)
    out = folder / "prepared"
    prepare(Request(inputs=[corpus], tokenizer=tok, out=out, eval_fraction=eval_fraction), say=lambda _: None)
    return out


FRACTION = 0.05
"""The held-out share of what `prepare_cli` prepares (--eval-fraction)."""


def prepare_cli(inputs: list[Path], tok: Path, out: Path, *extra: str) -> int:
    """`python -m runner.data prepare` in this process (one worker unless `extra` says otherwise); its exit code."""
    from runner.data import cli

    argv = ["prepare", "--input", *map(str, inputs), "--tokenizer", str(tok), "--out", str(out), "--eval-fraction", str(FRACTION)]
    return cli.main([*argv, "--num-proc", "1", *extra])


def token_folders(root: Path) -> SimpleNamespace:
    """Two corpora (300 and 200 documents) with one tokenizer, each prepared into its own folder (a with 2 workers, b with
    one): tests/test_tokens.py's and its shared runs' (conftest's token_folders)."""
    corpus, tok = make(root / "assets")
    other = root / "assets" / "other.jsonl"
    other.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(200, seed=1)))
    assert prepare_cli([corpus], tok, root / "a", "--num-proc", "2") == 0
    assert prepare_cli([other], tok, root / "b") == 0
    return SimpleNamespace(corpus=corpus, other=other, tok=tok, a=root / "a", b=root / "b", root=root)
