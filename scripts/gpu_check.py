"""Check the GPU path on one NVIDIA GPU: the debug model through `python -m runner`, beside TorchTitan's own trainer.

Runs bf16 (FlexAttention) eager and compiled, and FP8 tensorwise, rowwise and blockwise (compiled), each for
STEPS steps of GLOBAL_BATCH x SEQ_LEN tokens on data it generates (nothing is downloaded). For every case it
prints the runner's median tokens/s and MFU (summary.json) and, where TorchTitan's trainer has the recipe,
that trainer's figures on the equivalent config (scripts/gpu_check_titan.py) with the tokens/s ratio.
Exit status: 0 all runs finished, 1 a run failed or the time budget ran out, 2 no GPU or a config problem.

    scripts/gpu_check.sh [--quick]      # on the GPU machine, under 8 minutes
    scripts/gpu_check.sh --device cpu   # the runner side only, a few steps on CPU: proves the plumbing
    scripts/gpu_check.sh --node         # an 8-GPU node, under 15 minutes (scripts/gpu_check_node.py)
    scripts/gpu_check.sh --node --list  # the node cases' exact commands, without a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's runner, whatever the environment has installed
sys.path.insert(0, str(ROOT / "scripts"))  # gpu_check_node imports this module as gpu_check

from runner.estimate.precision import RECIPES  # noqa: E402
from runner.formats import runfiles  # noqa: E402  (torch-free)
from runner.schema import Fp8Recipe  # noqa: E402

STEPS = 30
SEQ_LEN = 2048
GLOBAL_BATCH = 8
BUDGET_S = 450.0
"""Wall-clock budget of the whole check (the issue asks for under 8 minutes)."""
RUN_CAP_S = 150.0
"""Most seconds one training run may take (start-up and compilation included)."""
MIN_RUN_S = 30.0
"""A run is not started with less of the budget left than this."""
EOS, BOS, UNK = "<|end_of_text|>", "<|begin_of_text|>", "[UNK]"
SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "ve", "dan", "tor", "ix", "um", "ber", "sol"]


@dataclass(frozen=True)
class Case:
    name: str
    precision: str
    """conf/precision option."""
    compile: bool
    fp8: Fp8Recipe = Fp8Recipe.none
    no_titan: str = ""
    """Why TorchTitan's trainer does not run this case ('' when it does)."""


GPU_CASES = (
    Case("bf16 eager", "bf16", False),
    Case("bf16 compiled", "bf16", True),
    Case("fp8_tensorwise", "fp8_tensorwise", True, Fp8Recipe.tensorwise),
    Case("fp8_rowwise", "fp8_rowwise", True, Fp8Recipe.rowwise),
    Case("fp8_blockwise", "fp8_blockwise", True, Fp8Recipe.blockwise, no_titan="TorchTitan has no blockwise FP8 recipe"),
)
CPU_CASES = (Case("fp32 eager (cpu)", "fp32", False, no_titan="not run on CPU"),)

CLUSTERS = (
    ("B200", "b200_node", ""),
    ("H200", "h100_node", "H200: MFU against the H100 SXM's dense peaks, which NVIDIA gives for H200 too"),
    ("H100", "h100_node", ""),
)
"""(name pattern, conf/cluster option, note): the first pattern in the GPU's name picks the cluster whose peaks MFU uses."""


@dataclass(frozen=True)
class Gpu:
    name: str
    capability: tuple[int, int]
    memory_gb: float


@dataclass
class Result:
    case: Case
    runner: dict | None = None
    """The runner's summary.json."""
    titan: dict | None = None
    """scripts/gpu_check_titan.py's output."""
    errors: list[str] = field(default_factory=list)
    skipped: str = ""


class NoGpu(Exception):
    pass


# ---- the machine ------------------------------------------------------------------------------------------

PROBE = """import json, torch
ok = torch.cuda.is_available()
out = {"torch": torch.__version__, "cuda": torch.version.cuda, "available": ok}
if ok:
    p = torch.cuda.get_device_properties(0)
    out |= {"name": p.name, "capability": [p.major, p.minor], "memory_gb": p.total_memory / 1e9}
print(json.dumps(out))"""


def probe_gpu(python: str = sys.executable) -> Gpu:
    """GPU 0 as torch sees it, asked in a child process so this one never holds a CUDA context."""
    proc = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise NoGpu(f"could not import torch to look for a GPU:\n{proc.stderr[-2000:]}")
    return gpu_from_probe(json.loads(proc.stdout.strip().splitlines()[-1]))


def gpu_from_probe(p: dict) -> Gpu:
    if p["cuda"] is None:
        raise NoGpu(
            f"no GPU: torch {p['torch']} is the CPU build. This check needs an NVIDIA GPU and the CUDA build of torch, "
            "which scripts/setup.sh installs on a machine where nvidia-smi works."
        )
    if not p["available"]:
        raise NoGpu(
            f"no GPU: torch {p['torch']} (CUDA {p['cuda']}) sees no CUDA device (torch.cuda.is_available() is False). "
            "Check nvidia-smi and CUDA_VISIBLE_DEVICES."
        )
    return Gpu(p["name"], tuple(p["capability"]), p["memory_gb"])


def cluster_for(gpu_name: str) -> tuple[str, str]:
    """(conf/cluster option whose peaks MFU uses, a note when it is not the GPU's own)."""
    for pattern, cluster, note in CLUSTERS:
        if pattern in gpu_name:
            return cluster, note
    return "h100_node", f"unknown GPU {gpu_name!r}: MFU against the H100 SXM's dense peaks (conf/gpu/h100_sxm_80gb.yaml)"


def unsupported(case: Case, gpu: Gpu) -> str:
    """Why this GPU cannot run the case's FP8 recipe ('' when it can)."""
    if case.fp8 == Fp8Recipe.none or gpu.capability >= RECIPES[case.fp8].min_sm:
        return ""
    need = RECIPES[case.fp8]
    return f"needs SM {need.min_sm[0]}.{need.min_sm[1]} ({need.hardware}); this GPU is SM {gpu.capability[0]}.{gpu.capability[1]}"


# ---- data -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Assets:
    corpus_dir: Path
    """Folder of corpus.jsonl (TorchTitan's c4_test loader reads a folder)."""
    corpus: Path
    tokenizer_dir: Path
    """tokenizer.json and tokenizer_config.json (TorchTitan's hf_assets_path)."""

    @property
    def tokenizer(self) -> Path:
        return self.tokenizer_dir / "tokenizer.json"


def make_assets(folder: Path, seq_len: int, num_docs: int = 64, seed: int = 0) -> Assets:
    """A word-level tokenizer and documents of seq_len - 1 words each. TorchTitan's loader adds BOS and EOS and
    masks attention per document, so each of its samples is then exactly one document: the same causal
    attention over the whole sample that the runner computes."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    words = sorted({"".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(400)})
    docs = []
    for _ in range(num_docs):
        w = [rng.choice(words)]
        while len(w) < seq_len - 1:  # bigram structure, so there is something to learn
            w.append(words[(words.index(w[-1]) * 7 + rng.randint(0, 5)) % len(words)])
        docs.append(" ".join(w))
    corpus_dir, tokenizer_dir = folder / "corpus", folder / "tokenizer"
    corpus_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    corpus = corpus_dir / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(docs, trainer=trainers.WordLevelTrainer(special_tokens=[UNK, BOS, EOS], show_progress=False))
    tok.save(str(tokenizer_dir / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "add_bos_token": True, "add_eos_token": True}
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return Assets(corpus_dir, corpus, tokenizer_dir)


# ---- the runs ---------------------------------------------------------------------------------------------


def runner_command(
    case: Case, assets: Assets, run_dir: Path, *, gpu: Gpu | None, steps: int, seq_len: int, mode: str = "train"
) -> list[str]:
    """`python -m runner` for one case: one GPU of the GPU's cluster (gpu=None: local CPU, one rank)."""
    if gpu is None:
        cluster = ["cluster=local_cpu"]
    else:
        cluster = [
            f"cluster={cluster_for(gpu.name)[0]}",
            "cluster.devices_per_node=1",
            f"cluster.compute_capability='{gpu.capability[0]}.{gpu.capability[1]}'",
            f"cluster.device_memory_gb={gpu.memory_gb:.1f}",
        ]
    return [
        sys.executable,
        "-m",
        "runner",
        f"mode={mode}",
        "model=debug",
        "parallelism=single",
        *cluster,
        f"precision={case.precision}",
        f"training.compile={str(case.compile).lower()}",
        f"training.steps={steps}",
        f"training.seq_len={seq_len}",
        f"training.global_batch_size={GLOBAL_BATCH}",
        f"training.microbatch_size={GLOBAL_BATCH}",
        "data=text",
        f"data.files=['{assets.corpus}']",
        f"data.tokenizer='{assets.tokenizer}'",
        "logging.progress=false",
        f"hydra.run.dir={run_dir}",
    ]


def titan_spec(case: Case, assets: Assets, dump_folder: Path, *, steps: int, seq_len: int) -> dict:
    """What scripts/gpu_check_titan.py builds TorchTitan's Trainer.Config from (the runner's schema defaults
    for lr, warm-up, clipping; the batch in one microbatch, as runner_command sets it)."""
    return {
        "steps": steps,
        "seq_len": seq_len,
        "local_batch_size": GLOBAL_BATCH,
        "compile": case.compile,
        "fp8_recipe": None if case.fp8 == Fp8Recipe.none else case.fp8.value,
        "hf_assets_path": str(assets.tokenizer_dir),
        "dataset_path": str(assets.corpus_dir),
        "dump_folder": str(dump_folder),
    }


def titan_command(spec_file: Path, out_file: Path) -> list[str]:
    script = ROOT / "scripts" / "gpu_check_titan.py"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    return [*torchrun, str(script), "--spec", str(spec_file), "--out", str(out_file)]


def run_logged(argv: list[str], log: Path, timeout_s: float, env: dict | None = None) -> str:
    """Run argv in its own process group with its output in `log`; '' on success, else why it failed.
    A run past its time is ended with its whole group (the runner's agent and ranks, torchrun's worker)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _end_group(proc)
            return f"timed out after {timeout_s:.0f} s (log: {log})"
    if rc == 0:
        return ""
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
    return f"exit status {rc} (log: {log}):\n{tail}"


def _end_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def titan_medians(rows: list[dict]) -> dict:
    """Medians over the same steps as the runner's summary.json: all but the first (warm-up) when there are more."""
    steady = rows[1:] or rows
    mfus = [r["mfu"] for r in steady if r["mfu"] is not None]
    return {
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in steady),
        "mfu_median": statistics.median(mfus) if mfus else None,
        "steps": len(rows),
    }


def slug(case: Case) -> str:
    return case.name.split(" (")[0].replace(" ", "_")


def validate(cases: list[Case], assets: Assets, work: Path, *, gpu: Gpu | None, steps: int, seq_len: int) -> list[str]:
    """`python -m runner ... mode=validate` for every case first, so a config problem is reported before any training."""
    problems = []
    for case in cases:
        argv = runner_command(case, assets, work / "validate" / slug(case), gpu=gpu, steps=steps, seq_len=seq_len, mode="validate")
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            problems.append(f"{case.name}: `{' '.join(argv[1:])}` failed validation:\n{proc.stderr.strip() or proc.stdout.strip()}")
    return problems


def run_case(r: Result, assets: Assets, work: Path, deadline: float, *, gpu: Gpu | None, steps: int, seq_len: int) -> None:
    """The runner's run, then (on a GPU, where TorchTitan has the recipe) TorchTitan's trainer; errors go into r."""
    name = slug(r.case)
    (work / "logs").mkdir(exist_ok=True)
    run_dir = work / "runs" / f"{name}-runner"
    if not _budget_left(r, deadline):
        return
    argv = runner_command(r.case, assets, run_dir, gpu=gpu, steps=steps, seq_len=seq_len)
    err = run_logged(argv, work / "logs" / f"{name}-runner.log", min(RUN_CAP_S, deadline - time.monotonic()))
    if err:
        r.errors.append(f"runner: {err}")
    else:
        r.runner = json.loads((run_dir / runfiles.SUMMARY).read_text())
    if gpu is None or r.case.no_titan or not _budget_left(r, deadline):
        return
    titan_dir = work / "runs" / f"{name}-titan"
    titan_dir.mkdir(parents=True, exist_ok=True)
    spec, out = titan_dir / "spec.json", titan_dir / "out.json"
    spec.write_text(json.dumps(titan_spec(r.case, assets, titan_dir, steps=steps, seq_len=seq_len), indent=2) + "\n")
    env = {**os.environ, "HF_HOME": str(work / "hf_home"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    err = run_logged(titan_command(spec, out), work / "logs" / f"{name}-titan.log", min(RUN_CAP_S, deadline - time.monotonic()), env)
    if err:
        r.errors.append(f"TorchTitan: {err}")
    else:
        r.titan = json.loads(out.read_text())


def _budget_left(r: Result, deadline: float) -> bool:
    if deadline - time.monotonic() >= MIN_RUN_S:
        return True
    r.errors.append(f"not run: less than {MIN_RUN_S:.0f} s of the {BUDGET_S:.0f} s budget left")
    return False


# ---- the report -------------------------------------------------------------------------------------------

HEADER = ("case", "runner tokens/s", "runner MFU", "TorchTitan tokens/s", "TorchTitan MFU", "runner / TorchTitan", "status")


def table_rows(results: list[Result]) -> list[tuple[str, ...]]:
    """One row per case; the ratio is of tokens/s (the same model and tokens per step, so also of achieved FLOP/s)."""
    rows = []
    for r in results:
        run, tt = r.runner, r.titan
        cells = [r.case.name]
        cells.append(f"{run['tokens_per_s_median']:,.0f}" if run else "-")
        cells.append(f"{100 * run['mfu_median']:.2f}% of {run['peak_tflops']:.4g} TFLOP/s {run['peak_dtype']}" if run else "-")
        if r.case.no_titan or r.skipped:
            cells += ["n/a", "n/a", f"n/a ({r.case.no_titan})" if r.case.no_titan else "n/a"]
        else:
            cells.append(f"{tt['tokens_per_s_median']:,.0f}" if tt else "-")
            if tt:
                cells.append(
                    "n/a (none with FP8)"
                    if tt["mfu_median"] is None
                    else f"{100 * tt['mfu_median']:.2f}% of {tt['peak_tflops']:.4g} TFLOP/s"
                )
            else:
                cells.append("-")
            cells.append(f"{run['tokens_per_s_median'] / tt['tokens_per_s_median']:.2f}" if run and tt else "-")
        cells.append(f"skipped: {r.skipped}" if r.skipped else "FAILED" if r.errors else "ok")
        rows.append(tuple(cells))
    return rows


def verdict(results: list[Result]) -> tuple[bool, str]:
    failed = [r.case.name for r in results if r.errors]
    ran = [r for r in results if not r.skipped]
    skipped = len(results) - len(ran)
    note = f"; {skipped} skipped (this GPU lacks the recipe's hardware)" if skipped else ""
    if failed:
        return False, f"FAIL: {len(failed)} of {len(ran)} cases failed ({', '.join(failed)}){note}"
    return True, f"PASS: {len(ran)} cases trained{note}"


def report(results: list[Result], title: str) -> bool:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 180)
    table = Table(title=title)
    for h in HEADER:
        table.add_column(h, justify="left" if h in ("case", "status", "runner MFU", "TorchTitan MFU") else "right")
    for row in table_rows(results):
        table.add_row(*row)
    console.print(table)
    for r in results:
        for e in r.errors:
            console.print(f"[bold red]{r.case.name}[/]: {e}", markup=True, soft_wrap=True)
    ok, text = verdict(results)
    console.print(f"[bold {'green' if ok else 'red'}]{text}[/]")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the runner side only, 3 short steps (plumbing)")
    parser.add_argument("--work-dir", type=Path, help="where assets, run folders and logs go (default: a new temp folder)")
    parser.add_argument("--quick", action="store_true", help="the one-GPU cases (the default)")
    parser.add_argument("--node", action="store_true", help="the 8-GPU node cases (scripts/gpu_check_node.py), under 15 minutes")
    parser.add_argument("--list", action="store_true", help="with --node: print each case's exact commands, run nothing")
    args = parser.parse_args(argv)
    if args.node or args.list:
        if not args.node or args.quick:
            parser.error("--list goes with --node, and --node not with --quick")
        import gpu_check_node

        return gpu_check_node.main(args)
    deadline = time.monotonic() + BUDGET_S
    gpu = None
    if args.device == "cuda":
        try:
            gpu = probe_gpu()
        except NoGpu as e:
            print(f"gpu_check: {e}", file=sys.stderr)
            return 2
    cases, steps, seq_len = (GPU_CASES, STEPS, SEQ_LEN) if gpu else (CPU_CASES, 3, 256)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    if gpu:
        cluster, note = cluster_for(gpu.name)
        print(f"GPU: {gpu.name}, SM {gpu.capability[0]}.{gpu.capability[1]}, {gpu.memory_gb:.0f} GB; runner cluster={cluster}")
        if note:
            print(note)
    print(f"{steps} steps x {GLOBAL_BATCH} x {seq_len} tokens per case; medians skip step 1; work folder {work}", flush=True)
    assets = make_assets(work / "assets", seq_len)
    results = [Result(c) for c in cases]
    for r in results:
        r.skipped = unsupported(r.case, gpu) if gpu else ""
    todo = [r for r in results if not r.skipped]
    problems = validate([r.case for r in todo], assets, work, gpu=gpu, steps=steps, seq_len=seq_len)
    if problems:
        print("gpu_check: the runner rejects a config; nothing was trained:\n" + "\n".join(problems), file=sys.stderr)
        return 2
    for r in todo:
        print(f"{r.case.name} ...", flush=True)
        run_case(r, assets, work, deadline, gpu=gpu, steps=steps, seq_len=seq_len)
    title = f"debug model, {steps} steps of {GLOBAL_BATCH} x {seq_len} tokens on {gpu.name if gpu else 'CPU (runner only)'}"
    return 0 if report(results, title) else 1


if __name__ == "__main__":
    sys.exit(main())
