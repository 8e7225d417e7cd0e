"""`python -m runner.data show <run folder> --step N`: the samples of a step the loss guard blamed on the data, decoded.

A data verdict (spikes.jsonl) and a rewind that left a batch out (left_out.jsonl) record the step's global samples and
where each is read from (runner.run.loader's `origin`). This reads them back from the same place, through the run's
frozen.yaml: data=tokens from the prepared folder's split (by memory map), data=text by building the run's token stream
again from its files (runner.data.corpus, as the loader built it), and decodes each with the run's tokenizer (data.tokenizer,
or --tokenizer). Synthetic samples are generated, not read: their indices and stream offsets are printed, no text.
Torch-free; relative data paths are read from the directory the command runs in, as a replay of frozen.yaml reads them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from runner.formats import runfiles
from runner.schema.problems import ConfigError, Problem


def recorded(run_dir: Path, step: int) -> list[dict[str, Any]]:
    """The samples of `step` as the run recorded them (a data verdict's, else the rewind's left-out batch)."""
    out: list[dict[str, Any]] = []
    steps: set[int] = set()
    for name in (runfiles.SPIKES, runfiles.LEFT_OUT):
        path = run_dir / name
        for line in path.read_text().splitlines() if path.is_file() else []:
            e = json.loads(line)
            if "samples" in e:
                steps.add(e["step"])
                if e["step"] == step and not out:
                    out = e["samples"]
    if not out:
        have = ", ".join(map(str, sorted(steps))) or "none (no data verdict and no rewind left a batch out)"
        raise ConfigError([Problem("--step", step, f"no samples recorded for this step in {run_dir}", f"pick a recorded step: {have}")])
    return out


def frozen(run_dir: Path) -> dict[str, Any]:
    """The run's data and training sections from frozen.yaml (ConfigError: not a run folder)."""
    from omegaconf import OmegaConf

    path = run_dir / runfiles.FROZEN
    if not run_dir.is_dir():
        raise ConfigError([Problem("run folder", str(run_dir), "no such folder", "give the folder a run wrote (hydra.run.dir)")])
    if not path.is_file():
        why = f"holds no {runfiles.FROZEN}: not a run folder"
        raise ConfigError([Problem("run folder", str(run_dir), why, "give the folder a run wrote (hydra.run.dir)")])
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


class Reader:
    """The tokens of a recorded sample, read from where its origin says."""

    def __init__(self, cfg: dict[str, Any], run_dir: Path):
        self.data, self.seq_len, self.run_dir = cfg["data"], cfg["training"]["seq_len"], run_dir
        self._splits: dict[tuple[str, str], Any] = {}
        self._corpus = None

    def tokens(self, s: dict[str, Any]) -> list[int] | None:
        """seq_len + 1 tokens: the sample's inputs and its last label (None: synthetic)."""
        if self.data["name"] == "tokens":
            from runner.formats import data_manifest as mf
            from runner.formats.documents import PairStream

            key = (s["source"], s["split"])
            if key not in self._splits:
                self._splits[key] = mf.Split(s["source"], s["split"])
            split = self._splits[key]
            if "pair_start" in s:
                return _pairs(PairStream(split.pieces()), s["pair_start"], s["num_pairs"])
            return split.read(s["token_start"], s["num_tokens"]).tolist()
        if self.data["name"] == "text":
            c = self.corpus()
            if "pair_start" in s:
                from runner.formats.documents import PairStream, Piece

                return _pairs(PairStream([Piece(lambda start, n: c.tokens[start : start + n], c.ends)]), s["pair_start"], s["num_pairs"])
            return c.tokens[s["token_start"] : s["token_start"] + s["num_tokens"]].tolist()
        return None

    def corpus(self):
        if self._corpus is None:
            from runner.data import corpus

            d = self.data
            args = (d["files"], d["format"], d["text_field"], d["tokenizer"], d["eos_token"], self.run_dir / runfiles.DATA_CACHE)
            self._corpus = corpus.build(*args, "train", d["eval_fraction"], d["document_mask"])
        return self._corpus


def _pairs(stream, first: int, n: int) -> list[int]:
    inputs, labels, _ = stream.window(first, n)
    return np.concatenate([inputs, labels[-1:]]).tolist()


def where(s: dict[str, Any]) -> str:
    """One line of where a sample comes from."""
    if "file" in s:
        return f"{s['file']} record {s['record']} at offset {s['offset']}"
    if "source" in s:
        span = f"pairs {s['pair_start']}+{s['num_pairs']}" if "pair_start" in s else f"tokens {s['token_start']}+{s['num_tokens']}"
        return f"{s['source']} ({s['split']} split) {span}"
    return f"synthetic, stream offset {s['token_start']}"


def show(run_dir: Path, step: int, tokenizer: str = "") -> list[str]:
    """The lines to print (ConfigError on bad input)."""
    cfg = frozen(run_dir)
    samples = recorded(run_dir, step)
    reader, tok = Reader(cfg, run_dir), tokenizer or cfg["data"]["tokenizer"]
    decode = None
    if tok and cfg["data"]["name"] != "synthetic":
        from runner.formats import data_manifest as mf
        from runner.formats.user_files import UnreadableFile

        try:
            decode = mf.tokenizer(tok).decode
        except UnreadableFile as e:
            raise ConfigError([Problem("--tokenizer", tok, f"{e.path} {e.why}", e.fix)]) from None
    lines = [f"step {step}: {len(samples)} samples ({cfg['data']['name']} data)"]
    for s in samples:
        lines.append(f"sample {s['index']}: {where(s)}")
        ids = reader.tokens(s)
        if ids is None:
            continue
        text = decode(ids, skip_special_tokens=False) if decode else f"token ids {ids} (no tokenizer: give --tokenizer)"
        lines.append("  " + repr(text))
    return lines
