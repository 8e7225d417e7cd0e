"""Benchmark: the runner against TorchTitan's own Trainer, same model, weights, batches, optimizer and schedule.

python bench/runner_vs_titan.py [--reps 5] [--steps 10] [--layouts dp2_tp2 tp2_pp2] [--runner-start fork|exec]
                                [--titan-start exec|fork] [--data synthetic|text] [--out bench_out]

Per layout (4 CPU ranks each), alternating: the runner (`python -m runner parallelism=<layout> ...`) and TorchTitan's
Trainer.train() under torchrun (bench/titan_trainer.py: its config built from the same runner overrides), both from one
tiny Hugging Face Llama 3 debug model (tests/hf_models.py) and the runner's synthetic data (--data text: a local jsonl of
documents of varied length, some shorter than a sample and some longer than two, and a word-level tokenizer with BOS
and EOS in the Hugging Face folder; TorchTitan reads them with its own HuggingFaceTextDataset and tokenizer, the runner
with data=text in file order, data.shuffle=false; one DP replica only, default layout tp2_pp2: docs/training.md). Prints
both loss curves side by side with their largest relative difference (target <= 1e-5), then each rep's tokens/s and the medians' ratio
(target >= 0.98). tokens/s: the global batch's tokens over the wall time from one step's end to the next (what
TorchTitan's MetricsProcessor counts; the runner's step ends are in its timeline.jsonl), steps 2 on; the runner's own
figure (its step_time_s, which leaves out the row and the monitors' bookkeeping) is shown beside it.

How the ranks start moves the step time on a CPU with fewer cores than ranks: ranks forked from a process that has the
imports (the runner's default on cluster=local_cpu) train ~10 % faster here than ranks that are each a fresh
interpreter (torchrun of a script; the runner's cluster.worker_start=exec), whichever loop they run. By default each side
starts as it does out of the box (runner forked, TorchTitan under torchrun); --runner-start exec (or --titan-start fork)
starts both alike, which compares the loops alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import titan_trainer  # noqa: E402

LOSS_RTOL, SPEED_TARGET = 1e-5, 0.98


MOE_LAYOUTS = {
    "ep2": ["parallelism=ep2"],
    "dp2_ep2": ["parallelism=ep2", "parallelism.name=dp2_ep2", "parallelism.dp_shard=4"],  # EP 2 inside FSDP 4
}
"""--model debug_moe's layouts: expert parallelism on 2 ranks, and on 4 (two EP groups, the experts sharded over both)."""


def overrides(layout: str, hf: Path | None, a, corpus: Path | None = None) -> list[str]:
    """The runner's overrides of one point: the layout, the shape (the runner's defaults unless given), the weights (the
    Hugging Face folder; debug_moe: the runner's initial weights on both sides); with a corpus, data=text in file order
    with the tokenizer of the Hugging Face folder."""
    from tests import hf_models

    shape = [f"training.steps={a.steps}", f"training.seq_len={a.seq_len}", f"training.global_batch_size={a.global_batch}"]
    shape.append(f"training.microbatch_size={a.microbatch}")
    if hf is None:
        return ["model=debug_moe", *MOE_LAYOUTS[layout], *shape]
    tok = hf / "tokenizer.json"
    text = [] if corpus is None else ["data=text", f"data.files=[{corpus}]", f"data.tokenizer={tok}", "data.shuffle=false"]
    return [f"parallelism={layout}", *shape, *hf_models.overrides("llama3", hf), *text]


def ranks(point: list[str]) -> int:
    """The world size of the point's layout."""
    from runner.config.compose import compose
    from runner.schema import layout

    cfg = compose(point)
    return layout.resolve(cfg.parallelism, cfg.cluster).world_size


def last_checkpoint_biases(run_dir: Path) -> dict[str, list[float]]:
    """The expert biases (model.layers.<i>.moe.expert_bias_E) in the run's last checkpoint, read with DCP on the host."""
    from torch.distributed.checkpoint import FileSystemReader

    # torch's helper for a read without a process group (private; the bench only, not the runner)
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    folder = max((run_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    keys = {k for k in FileSystemReader(str(folder)).read_metadata().state_dict_metadata if k.endswith(".moe.expert_bias_E")}
    found = _load_state_dict_from_keys(keys, checkpoint_id=str(folder))  # nested by the keys' dots

    def leaves(d, prefix=""):
        for k, v in d.items():
            yield from leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]

    return {k.split(".")[2]: v.tolist() for k, v in leaves(found)}


def text_assets(folder: Path, hf: Path, num_docs: int = 400, seed: int = 0) -> Path:
    """corpus/corpus.jsonl under `folder` (documents of 5 to 700 words), and a word-level tokenizer with BOS and EOS named by
    its tokenizer_config.json, saved into the Hugging Face folder `hf` (TorchTitan's hf_assets_path); returns the corpus."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from tests import text_assets as ta

    rng = random.Random(seed)
    words = sorted({"".join(rng.choice(ta.SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(400)})
    docs = []
    for _ in range(num_docs):
        w = [rng.choice(words)]
        for _ in range(rng.choice([rng.randint(5, 100), rng.randint(100, 700)]) - 1):  # bigrams: something to learn
            w.append(words[(words.index(w[-1]) * 7 + rng.randint(0, 5)) % len(words)])
        docs.append(" ".join(w))
    corpus = folder / "corpus" / "corpus.jsonl"
    corpus.parent.mkdir(parents=True, exist_ok=True)
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(docs, trainer=trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}) + "\n")
    return corpus


def _run(argv: list[str], env=None) -> None:
    proc = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def runner_run(run_dir: Path, point: list[str], moe: bool = False) -> dict:
    """Train `point` with `python -m runner`: its losses, grad norms, step ends (rank 0's timeline) and own tokens/s; an
    MoE point also saves its last step (synchronously, after the last step's end) for its expert biases."""
    from runner.formats import runfiles

    save = ["checkpoint.enable=true", "checkpoint.interval=1000000", "checkpoint.async_save=false"] if moe else []
    _run(["runner", *point, *save, "logging.progress=false", f"hydra.run.dir={run_dir}"])
    rows = [json.loads(line) for line in (run_dir / runfiles.METRICS).read_text().splitlines()]
    events = [json.loads(line) for line in (run_dir / runfiles.TIMELINE).read_text().splitlines()]
    ends = [e["end"] for e in events if e["event"] == "step"]
    own = json.loads((run_dir / runfiles.SUMMARY).read_text())["tokens_per_s_median"]
    out = {"loss": [r["loss"] for r in rows], "grad_norm": [r["grad_norm"] for r in rows], "ends": ends, "own_tokens_per_s": own}
    return out | ({"expert_bias": last_checkpoint_biases(run_dir)} if moe else {})


def titan_run(folder: Path, point: list[str], fork: bool) -> dict:
    """Train `point` with TorchTitan's Trainer on its ranks (torchrun of the script, or forked: titan_trainer.fork_launch):
    its losses, grad norms, step ends and expert biases."""
    spec = titan_trainer.write_spec(folder, point)
    n = ranks(point)
    _run(titan_trainer.launch_args(spec, n, fork=fork), env=titan_trainer.launch_env(n))
    result = titan_trainer.output(spec)
    rows = result["rows"]
    own = statistics.median(r["tokens_per_s"] for r in rows[1:])
    return {
        "loss": [r["loss"] for r in rows],
        "grad_norm": [r["grad_norm"] for r in rows],
        "ends": [r["end"] for r in rows],
        "own_tokens_per_s": own,
        "expert_bias": result["expert_bias"],
    }


def tokens_per_s(ends: list[float], tokens: int) -> float:
    """Median over steps 2 on of the step's tokens over the time since the previous step ended."""
    return statistics.median(tokens / (b - a) for a, b in zip(ends, ends[1:], strict=False))


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def report_losses(layout: str, runner: list[dict], titan: list[dict]) -> list[str]:
    """Both loss curves of the first rep side by side, the largest difference, and how much either moved across reps."""
    r, t = runner[0]["loss"], titan[0]["loss"]
    lines = [f"{layout}: losses (rep 0)", "  step  runner          TorchTitan      rel. diff"]
    lines += [f"  {i:4d}  {a:.10f}  {b:.10f}  {rel(a, b):.1e}" for i, (a, b) in enumerate(zip(r, t, strict=True), start=1)]
    worst = max(rel(a, b) for x, y in zip(runner, titan, strict=True) for a, b in zip(x["loss"], y["loss"], strict=True))
    first = next((i for i, (a, b) in enumerate(zip(r, t, strict=True), start=1) if rel(a, b) > LOSS_RTOL), None)
    drift = max(rel(a, b) for runs in (runner, titan) for x in runs for a, b in zip(x["loss"], runs[0]["loss"], strict=True))
    norms = max(rel(a, b) for x, y in zip(runner, titan, strict=True) for a, b in zip(x["grad_norm"], y["grad_norm"], strict=True))
    verdict = "met" if first is None else f"MISSED, first at step {first}"
    lines.append(f"  largest relative loss difference over all reps {worst:.1e} (target <= {LOSS_RTOL:.0e}): {verdict}")
    lines.append(f"  largest relative grad-norm difference {norms:.1e}; reps of one side differ by up to {drift:.1e}")
    if runner[0].get("expert_bias"):
        bias = max(
            abs(a - b)
            for x, y in zip(runner, titan, strict=True)
            for k in x["expert_bias"]
            for a, b in zip(x["expert_bias"][k], y["expert_bias"][k], strict=True)
        )
        same = all(x["expert_bias"] == y["expert_bias"] for x, y in zip(runner, titan, strict=True))
        blocks = len(runner[0]["expert_bias"])
        lines.append(f"  expert biases after the last step ({blocks} MoE blocks): largest difference {bias:.1e}{', equal' if same else ''}")
    return lines


def report_speed(layout: str, runner: list[dict], titan: list[dict], tokens: int) -> list[str]:
    lines = [f"{layout}: tokens/s (step end to step end, steps 2 on)"]
    r_all, t_all = [], []
    for i, (x, y) in enumerate(zip(runner, titan, strict=True)):
        r_all.append(tokens_per_s(x["ends"], tokens))
        t_all.append(tokens_per_s(y["ends"], tokens))
        lines.append(f"  rep {i}: runner {r_all[-1]:.1f} (its own step clock {x['own_tokens_per_s']:.1f}), TorchTitan {t_all[-1]:.1f}")
    r, t = statistics.median(r_all), statistics.median(t_all)
    lines.append(f"  median tokens/s: runner {r:.1f}, TorchTitan {t:.1f}; ratio runner/TorchTitan = {r / t:.3f} (target >= {SPEED_TARGET})")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--layouts", nargs="+", default=None, help="default dp2_tp2 tp2_pp2 (synthetic), tp2_pp2 (text), ep2 dp2_ep2 (debug_moe)"
    )
    p.add_argument("--model", choices=["llama3", "debug_moe"], default="llama3", help="debug_moe: MoE under expert parallelism")
    p.add_argument("--data", choices=["synthetic", "text"], default="synthetic")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--microbatch", type=int, default=2)
    p.add_argument("--runner-start", choices=["fork", "exec"], default="fork", help="the runner's cluster.worker_start")
    p.add_argument("--titan-start", choices=["exec", "fork"], default="exec", help="TorchTitan's: torchrun of the script, or forked")
    p.add_argument("--out", type=Path, default=None, help="keep the runs in <out>/runs and every figure in <out>/runner_vs_titan.json")
    a = p.parse_args()
    moe = a.model == "debug_moe"
    a.layouts = a.layouts or (list(MOE_LAYOUTS) if moe else ["dp2_tp2", "tp2_pp2"] if a.data == "synthetic" else ["tp2_pp2"])
    from tests import hf_models

    runs: dict[str, dict[str, list[dict]]] = {layout: {"runner": [], "titan": []} for layout in a.layouts}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d) if a.out is None else a.out / "runs"
        hf = None if moe else hf_models.save("llama3", tmp / "hf_llama3")
        corpus = text_assets(tmp, hf) if a.data == "text" else None
        for i in range(a.reps):
            for layout in a.layouts:
                point = overrides(layout, hf, a, corpus)
                runner_point = [*point, f"cluster.worker_start={a.runner_start}"]
                runs[layout]["runner"].append(runner_run(tmp / f"runner-{layout}-{i}", runner_point, moe))
                runs[layout]["titan"].append(titan_run(tmp / f"titan-{layout}-{i}", point, a.titan_start == "fork"))
                print(f"rep {i} {layout}: done", flush=True)
    tokens = a.global_batch * a.seq_len
    shape = f"seq {a.seq_len}, batch {a.global_batch} in microbatches of {a.microbatch}, {a.steps} steps, {a.reps} alternating reps"
    starts = f"CPU ranks (started: runner {a.runner_start}, TorchTitan {a.titan_start})"
    what = "debug_moe (DeepSeek-V3 debugmodel) from the runner's initial weights" if moe else "debug Llama 3 from one Hugging Face folder"
    print(f"{what}, {a.data} data, {shape}, {starts}")
    for layout in a.layouts:
        print("\n".join(report_losses(layout, runs[layout]["runner"], runs[layout]["titan"])))
        print("\n".join(report_speed(layout, runs[layout]["runner"], runs[layout]["titan"], tokens)))
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "runner_vs_titan.json").write_text(json.dumps(runs, indent=2) + "\n")


if __name__ == "__main__":
    main()
