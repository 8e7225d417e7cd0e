"""Rules for data=tokens (torch-free): the config alone (`check`), and the prepared folders on disk (`folders`,
run by `mode=validate` and by the preflight before any rank starts). A folder must have an intact manifest,
the tokenizer it was prepared with must be data.tokenizer's (when set) and the same across a mixture, its
vocabulary must fit the model, and its train split must hold at least one sample (seq_len + 1 tokens)."""

from __future__ import annotations

from pathlib import Path

from runner.config.problems import Problem
from runner.config.schema import Mode, RunConfig
from runner.data import manifest as mf

PREPARE = "prepare it with `python -m runner.data prepare --input <files> --tokenizer <tokenizer.json> --out <folder>`"


def sources(cfg: RunConfig) -> list[tuple[str, str, float]]:
    """(field, folder, weight) of every prepared folder the run reads."""
    d = cfg.data
    if d.path:
        return [("data.path", d.path, 1.0)]
    return [(f"data.mix[{i}].path", m.path, m.weight) for i, m in enumerate(d.mix)]


def check(cfg: RunConfig, out: list[Problem]) -> None:
    d = cfg.data
    if not d.path and not d.mix:
        out.append(Problem("data.path", "''", "data=tokens reads no prepared folder", f"set data.path (or data.mix); {PREPARE}"))
    if d.path and d.mix:
        out.append(
            Problem(
                "data.mix",
                f"{len(d.mix)} sources",
                "data.path and data.mix are both set",
                "use data.path for one folder, data.mix for several",
            )
        )
    for i, m in enumerate(d.mix):
        if not m.path:
            out.append(Problem(f"data.mix[{i}].path", "''", "a mixture source needs a folder", f"give each source a path; {PREPARE}"))
        if not m.weight > 0:
            out.append(
                Problem(f"data.mix[{i}].weight", m.weight, "must be > 0", "give each source a positive share (weights are normalized)")
            )
    if cfg.mode == Mode.validate and not any(p.field.startswith("data.") for p in out):
        folders(cfg, out)


def folders(cfg: RunConfig, out: list[Problem]) -> None:
    """Every problem of the prepared folders against this config."""
    hashes: dict[str, str] = {}
    for name, folder, _ in sources(cfg):
        try:
            m = mf.load(folder)
        except mf.ManifestError as e:
            out.append(Problem(name, folder, str(e), PREPARE))
            continue
        hashes[name] = m["tokenizer"]["sha256"]
        _fits(cfg, name, folder, m, out)
    _same_tokenizer(cfg, hashes, out)


def _fits(cfg: RunConfig, name: str, folder: str, m: dict, out: list[Problem]) -> None:
    vocab, need = m["tokenizer"]["vocab_size"], cfg.training.seq_len + 1
    if vocab > cfg.model.vocab_size:
        out.append(
            Problem(
                name,
                folder,
                f"it was prepared with a {vocab}-token vocabulary, more than model.vocab_size {cfg.model.vocab_size}",
                "use a model with a larger vocabulary, or prepare the data with a smaller tokenizer",
            )  # fmt: skip
        )
    tokens = m["splits"]["train"]["tokens"]
    if tokens < need:
        out.append(
            Problem(
                name,
                folder,
                f"its train split holds {tokens} tokens, fewer than training.seq_len + 1 = {need}",
                "prepare more text (or a smaller --eval-fraction), or lower training.seq_len",
            )  # fmt: skip
        )


def split_problem(name: str, folder: str, split: str, seq_len: int) -> Problem | None:
    """A split with fewer than seq_len + 1 tokens (for callers that read another split, e.g. evaluation)."""
    m = mf.load(folder)
    tokens = m["splits"][split]["tokens"]
    if tokens >= seq_len + 1:
        return None
    return Problem(name, folder, f"its {split} split holds {tokens} tokens, fewer than training.seq_len + 1 = {seq_len + 1}",
                   "prepare more text or hold out a larger share (--eval-fraction)")  # fmt: skip


def _same_tokenizer(cfg: RunConfig, hashes: dict[str, str], out: list[Problem]) -> None:
    d = cfg.data
    if d.tokenizer and hashes:
        if not Path(d.tokenizer).is_file():
            out.append(
                Problem(
                    "data.tokenizer",
                    d.tokenizer,
                    "no such file",
                    "point data.tokenizer at the tokenizer the data was prepared with, or leave it empty",
                )
            )
            return
        mine = mf.tokenizer_info(Path(d.tokenizer))["sha256"]
        for name, h in hashes.items():
            if h != mine:
                out.append(
                    Problem(
                        "data.tokenizer",
                        d.tokenizer,
                        f"differs from the tokenizer {name} was prepared with (sha256 {h[:12]} vs {mine[:12]})",
                        "use the tokenizer the folder was prepared with, or prepare the data again with this one",
                    )  # fmt: skip
                )
    elif len(set(hashes.values())) > 1:
        seen = ", ".join(f"{n}: {h[:12]}" for n, h in hashes.items())
        out.append(
            Problem("data.mix", seen, "the sources were prepared with different tokenizers", "prepare every source with the same tokenizer")
        )
