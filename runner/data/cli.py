"""`python -m runner.data prepare`: the command line of data preparation (argparse; no Hydra config to compose); and
`python -m runner.data show <run folder> --step N`, the samples of a step the loss guard blamed on the data (show.py).

    python -m runner.data prepare --input a.jsonl b.parquet c.txt --tokenizer tokenizer.json --out prepared/web
        [--text-field text] [--eos-token '<|end_of_text|>'] [--eval-fraction 0.01] [--num-proc N]

Every document is framed by the tokenizer's BOS and EOS as TorchTitan frames it: those the tokenizer_config.json beside
the tokenizer names; a bare tokenizer.json has no BOS and --eos-token as its EOS (runner.formats.documents).

The format of each input comes from its extension (.jsonl/.json, .txt, .parquet). Bad arguments are
reported all at once, naming the option, the value and the fix, with exit code 2 before anything is written;
so is an --out holding files of the prepared layout that prepare did not write. A bad record (a line that is
not JSON, a text that is not a string) exits 2 naming the file and line; Ctrl-C exits 130. Either way nothing
half-written and no .cache is left (prepare.py). Records whose text is null, missing or empty are skipped and
counted.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from runner.data.prepare import FORMATS, Request, prepare
from runner.formats import data_manifest as mf
from runner.formats.user_files import UnreadableFile
from runner.schema.problems import ConfigError, Problem


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runner.data", description="Prepare local corpora as token files for data=tokens.")
    sub = p.add_subparsers(dest="command", required=True)
    q = sub.add_parser("prepare", help="tokenize local jsonl/parquet/txt files into a prepared folder")
    q.add_argument("--input", nargs="+", required=True, help="local data files (.jsonl/.json, .txt, .parquet), one part each")
    q.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizers JSON file (tokenizer.json)")
    q.add_argument("--out", required=True, help="the prepared folder (created; a rerun reuses what is already done)")
    q.add_argument("--text-field", default="text", help="jsonl/parquet: the column holding each document")
    q.add_argument("--eos-token", default="<|end_of_text|>",
                   help="a bare tokenizer.json's end-of-document token (a tokenizer_config.json beside it names its own)")  # fmt: skip
    q.add_argument("--eval-fraction", type=float, default=0.01, help="share of each file's documents held out as the eval split")
    q.add_argument("--num-proc", type=int, default=os.cpu_count() or 1, help="tokenizing processes (datasets.map num_proc)")
    v = sub.add_parser("show", help="print the samples of a step a data verdict or a rewind left out, decoded (runner.data.show)")
    v.add_argument("run", help="the run folder (holds frozen.yaml and spikes.jsonl)")
    v.add_argument("--step", type=int, required=True, help="the step (1-based) whose samples to print")
    v.add_argument("--tokenizer", default="", help="a tokenizer.json to decode with (default: the run's data.tokenizer)")
    return p


def _show(a: argparse.Namespace) -> int:
    from runner.data.show import show

    try:
        lines = show(Path(a.run), a.step, a.tokenizer)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


def _inputs(files: list[str], text_field: str) -> list[Problem]:
    from runner.config.validate.data_rules import first_record_lacks, holds_no_records
    from runner.schema import DataConfig, TextFormat

    out = []
    for f in files:
        path = Path(f)
        d = DataConfig(format=TextFormat(FORMATS[path.suffix.lower()]), text_field=text_field) if path.suffix.lower() in FORMATS else None
        if not path.is_file():
            out.append(Problem("--input", f, "no such file", "give existing local data files"))
        elif d is None:
            out.append(Problem("--input", f, f"unknown extension {path.suffix!r}", f"use one of {', '.join(FORMATS)}"))
        elif holds_no_records(path, d):
            out.append(Problem("--input", f, "the file holds no records", "leave it out of --input, or give it its documents"))
        elif why := first_record_lacks(path, d):
            out.append(Problem("--text-field", text_field, f"{f}: {why}", "set --text-field to the column holding the documents"))
    return out


def _tokenizer(path: str, eos: str, out: list[Problem]) -> None:
    from runner.formats import documents

    try:
        mf.tokenizer_info(Path(path))
        tok = mf.tokenizer(path)
        frame = documents.specials(tok, path, eos)
    except UnreadableFile as e:
        out.append(Problem("--tokenizer", path, f"{e.path} {e.why}", e.fix))
        return
    if why := documents.special_problem(frame, path):
        if frame.source is not None:
            out.append(Problem("--tokenizer", path, f"{why}: documents could not be told apart", documents.FIX))
            return
        special = sorted(t.content for t in tok.get_added_tokens_decoder().values() if t.special)
        out.append(Problem("--eos-token", eos, f"{why}: documents would run together with no separator",
                           f"give the tokenizer's end-of-document token, one of its special tokens {special}" if special
                           else "give the token that ends a document in this tokenizer's vocabulary"))  # fmt: skip


def check(a: argparse.Namespace) -> None:
    """Raise ConfigError listing every bad argument."""
    out = _inputs(a.input, a.text_field)
    if not Path(a.tokenizer).is_file():
        out.append(Problem("--tokenizer", a.tokenizer, "no such file", "point --tokenizer at a local tokenizer.json"))
    else:
        _tokenizer(a.tokenizer, a.eos_token, out)
    if Path(a.out).exists() and not Path(a.out).is_dir():
        out.append(Problem("--out", a.out, "is a file", "name a folder (it is created)"))
    elif Path(a.out).is_dir():
        for path, why in mf.foreign(Path(a.out)):
            out.append(Problem("--out", a.out, f"{path.name} is {why}", f"move {path} away, or name another folder"))
    if not 0 <= a.eval_fraction < 1:
        out.append(Problem("--eval-fraction", a.eval_fraction, "must be in [0, 1)", "hold out a small share, e.g. 0.01, or 0 for none"))
    if a.num_proc < 1:
        out.append(Problem("--num-proc", a.num_proc, "must be >= 1", "use the number of CPU cores to give to tokenizing"))
    if out:
        raise ConfigError(out)


def _interrupted(e: BaseException | None) -> bool:
    while e is not None and not isinstance(e, KeyboardInterrupt):
        e = e.__context__
    return e is not None


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.command == "show":
        return _show(a)
    try:
        check(a)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    req = Request(
        inputs=[Path(f) for f in a.input], tokenizer=Path(a.tokenizer), out=Path(a.out), text_field=a.text_field,
        eos_token=a.eos_token, eval_fraction=a.eval_fraction, num_proc=a.num_proc,
    )  # fmt: skip
    try:
        m, wrote = prepare(req)
    except ConfigError as e:  # a bad record: the file and line
        print(e, file=sys.stderr)
        return 2
    except BaseException as e:  # Ctrl-C; datasets' multiprocess map re-raises it as a TimeoutError whose context it is
        if not _interrupted(e):
            raise
        print(f"interrupted: {a.out} holds no half-written file and no .cache (parts finished before are kept, with the previous "
              "manifest). Fix: rerun the same command to resume.", file=sys.stderr)  # fmt: skip
        return 130
    s = m["splits"]
    verb = "prepared" if wrote else "already up to date:"
    print(f"{verb} {a.out}: {s['train']['tokens']:,} train tokens in {s['train']['documents']:,} documents, "
          f"{s['eval']['tokens']:,} held-out tokens in {s['eval']['documents']:,} documents ({m['dtype']})")  # fmt: skip
    bos = f"BOS {m['bos_token']!r} + " if m["bos_token"] is not None else ""
    print(f"each document: {bos}its tokens + EOS {m['eos_token']!r}, as TorchTitan's tokenizer frames it (runner.formats.documents)")
    if n := m["skipped_records"]:
        print(f"skipped {n:,} record{'s' * (n > 1)} whose text was null, missing or empty (skipped_records in manifest.json)")
    if warning := held_out_warning(m["splits"]["eval"], a.eval_fraction):
        print(warning, file=sys.stderr)
    return 0


def held_out_warning(split: dict, fraction: float) -> str | None:
    """One line when the held-out split is empty, or shorter than one evaluation pass of the default config reads
    (validation refuses a run that evaluates on it: runner.config.validate.data_rules); None with --eval-fraction 0."""
    from runner.schema import EvalConfig, TrainingConfig

    t, steps = TrainingConfig(), EvalConfig().steps
    need = steps * t.global_batch_size * t.seq_len + 1
    if fraction == 0 or split["tokens"] >= need:
        return None
    fix = f"Fix: prepare again with a larger --eval-fraction (now {fraction})"
    if not split["documents"]:
        return f"WARNING: the held-out split is empty: a run with eval.interval > 0 on this folder is refused. {fix}."
    return (
        f"WARNING: the held-out split holds {split['tokens']:,} tokens, fewer than one evaluation pass of the defaults reads "
        f"(eval.steps {steps} x training.global_batch_size {t.global_batch_size} x training.seq_len {t.seq_len} + 1 = "
        f"{need:,}): a run that evaluates on it must read less. {fix}, or evaluate with fewer eval.steps or a shorter seq_len."
    )
