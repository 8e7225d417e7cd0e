"""Benchmark: data=tokens start-up does not grow with the corpus, preparation throughput, and prefetch.

python bench/data_startup.py [--sizes-mb 20,400] [--reps 3] [--num-proc N] [--steps 12] [--no-step] [--formats] [--dir DIR]

1. Generates jsonl corpora of about the given sizes (generated text: documents of tests/text_assets.py made
   distinct by a serial number) and a 2,048-token BPE tokenizer, and prepares each with
   `python -m runner.data prepare` (printing MB/s of text).
2. Time to the first batch and resident memory at start-up, measured in a fresh process per size and
   repetition, alternating sizes: imports first, then the clock runs over building the rank's TokenData
   (seq_len 2048, global batch 8, shuffled) and reading its first batch. Prints the medians and the
   ratio large / small (the target is within 1.2x).
3. Unless --no-step: a default-layout run of --steps steps on the small folder; prints the median data_s
   (time a step waited for its batch) against the median step time (target under 1 %).

--formats (issue 55): instead of 2 and 3, on the first size only, the cost of reading documents: the same prepared
folder (format 2) read as packed documents (data.document_mask: pairs within documents and their positions, through
the document index), as tokens (data.document_mask=false: what a format 1 folder was read as, no index), and synthetic
data; each in a fresh process, alternating, --reps times: the start-up (building the reader and its first batch) and
the per-step cost (the median over --steps steps of reading one step's batch of 8 samples of 2,048), medians printed.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests import text_assets  # noqa: E402

PROBE = """
import json, resource, sys, time
import torch
from runner.run.token_data import TokenData
def rss_mb():
    with open("/proc/self/status") as fh:
        return next(int(ln.split()[1]) for ln in fh if ln.startswith("VmRSS")) / 1024
before = rss_mb()
t0 = time.perf_counter()
d = TokenData([(sys.argv[1], 1.0)], seed=0, shuffle=True, seq_len=2048, global_batch=8, microbatch=1, dp_rank=0, dp=1)
mbs = d.microbatches(0)
dt = time.perf_counter() - t0
print(json.dumps({"first_batch_s": dt, "rss_mb": rss_mb(), "rss_added_mb": rss_mb() - before, "samples": d.num_samples[0]}))
"""

FORMATS_PROBE = """
import json, statistics, sys, time
from runner.run.loader import SyntheticData
from runner.run.token_data import TokenData
folder, variant, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
shape = dict(seed=0, seq_len=2048, global_batch=8, microbatch=1, dp_rank=0, dp=1)
t0 = time.perf_counter()
if variant == "synthetic":
    d = SyntheticData(vocab=2048, **shape)
else:
    d = TokenData([(folder, 1.0)], shuffle=True, documents=variant == "documents", **shape)
d.microbatches(0)
start = time.perf_counter() - t0
per = []
for s in range(1, steps + 1):
    t = time.perf_counter()
    d.microbatches(s)
    per.append(time.perf_counter() - t)
print(json.dumps({"startup_s": start, "step_s": statistics.median(per)}))
"""
VARIANTS = ("documents", "tokens", "synthetic")


def formats(folder: Path, reps: int, steps: int) -> None:
    """Start-up and per-step cost of reading packed documents, tokens and synthetic data (--formats), alternating."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    got = {v: [] for v in VARIANTS}
    for _ in range(reps):
        for v in VARIANTS:
            argv = [sys.executable, "-c", FORMATS_PROBE, str(folder), v, str(steps)]
            out = subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, text=True, env=env)
            got[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {v: {k: statistics.median(r[k] for r in rs) for k in ("startup_s", "step_s")} for v, rs in got.items()}
    for v, m in med.items():
        print(f"{v:10}: start-up {m['startup_s'] * 1e3:8.2f} ms, one step's batch {m['step_s'] * 1e3:7.3f} ms (medians of {reps})")
    for k, label in (("startup_s", "start-up"), ("step_s", "per step")):
        ratios = ", ".join(f"{med['documents'][k] / med[v][k]:.2f}x {v}" for v in VARIANTS[1:])
        print(f"documents / others, {label}: {ratios}")


def tokenizer(folder: Path, docs: list[str]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048, special_tokens=[text_assets.EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(docs, trainer=trainer)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def corpus(path: Path, docs: list[str], mb: float) -> float:
    """Write documents (cycled, each with a serial number) until the file holds `mb` MB; returns its size in MB."""
    target, n = mb * 1e6, 0
    with open(path, "w") as fh:
        while fh.tell() < target:
            fh.write("".join(json.dumps({"text": f"{d} No. {n + i}."}) + "\n" for i, d in enumerate(docs)))
            n += len(docs)
    return path.stat().st_size / 1e6


def prepare(src: Path, tok: Path, out: Path, num_proc: int) -> float:
    t0 = time.perf_counter()
    argv = [sys.executable, "-m", "runner.data", "prepare", "--input", str(src), "--tokenizer", str(tok), "--out", str(out)]
    subprocess.run([*argv, "--num-proc", str(num_proc)], cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - t0


def probe(folder: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", PROBE, str(folder)], cwd=ROOT, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def step_share(folder: Path, tmp: Path, steps: int) -> None:
    run_dir = tmp / "run"
    argv = [sys.executable, "-m", "runner", "data=tokens", f"data.path={folder}", f"training.steps={steps}", "logging.progress=false"]
    subprocess.run([*argv, f"hydra.run.dir={run_dir}"], cwd=ROOT, check=True, capture_output=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]  # first step: warm-up
    data_s, step_s = statistics.median(r["data_s"] for r in rows), statistics.median(r["step_time_s"] for r in rows)
    print(f"default layout, {len(rows)} steps after the first: median data_s {data_s * 1e3:.3f} ms, median step {step_s:.3f} s, "
          f"data_s / step {100 * data_s / step_s:.3f} %")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", default="20,400")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--num-proc", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--no-step", action="store_true")
    ap.add_argument("--formats", action="store_true", help="packed documents vs tokens vs synthetic, on the first size only")
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed at the end)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        tmp = Path(tmp)
        docs = text_assets.documents(2000)
        tok = tokenizer(tmp, docs)
        folders = {}
        sizes = [float(s) for s in a.sizes_mb.split(",")]
        for mb in sizes[:1] if a.formats else sizes:
            src = tmp / f"corpus_{mb:g}mb.jsonl"
            size = corpus(src, docs, mb)
            folders[mb] = tmp / f"prepared_{mb:g}mb"
            dt = prepare(src, tok, folders[mb], a.num_proc)
            m = json.loads((folders[mb] / "manifest.json").read_text())
            print(f"prepare {size:.1f} MB ({m['splits']['train']['tokens']:,} train tokens, {m['dtype']}) with --num-proc {a.num_proc}: "
                  f"{dt:.1f} s, {size / dt:.2f} MB/s")  # fmt: skip
            src.unlink()
        if a.formats:
            formats(folders[sizes[0]], a.reps, a.steps)
            return
        got = {mb: [] for mb in folders}
        for _ in range(a.reps):
            for mb, folder in folders.items():
                got[mb].append(probe(folder))
        med = {mb: {k: statistics.median(r[k] for r in rs) for k in ("first_batch_s", "rss_mb", "rss_added_mb")} for mb, rs in got.items()}
        for mb, m in med.items():
            print(f"{mb:g} MB: time to first batch {m['first_batch_s'] * 1e3:.2f} ms, rank RSS {m['rss_mb']:.1f} MB "
                  f"(+{m['rss_added_mb']:.2f} MB over the imports), {got[mb][0]['samples']:,} samples (medians of {a.reps})")  # fmt: skip
        small, large = min(med), max(med)
        for k, label in (("first_batch_s", "time to first batch"), ("rss_mb", "rank RSS")):
            print(f"ratio {large:g} MB / {small:g} MB, {label}: {med[large][k] / med[small][k]:.3f}x (target <= 1.2x)")
        if not a.no_step:
            step_share(folders[small], tmp, a.steps)


if __name__ == "__main__":
    main()
