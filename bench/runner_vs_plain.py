"""Benchmark: the runner vs a minimal plain loop over the same TorchTitan building blocks.

python bench/runner_vs_plain.py [--reps 5] [--steps 10] [--seq-len 256]
Runs the debug model at dp_shard=2 x tp=2 (4 CPU ranks), alternating runner and plain loop,
and prints each run's median tokens/s and the ratio of the medians (target >= 0.98).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tokens_per_s(module_argv: list[str], result: Path) -> float:
    """Run `python -m <module_argv>` and read the median tokens/s it wrote to `result`."""
    subprocess.run([sys.executable, "-m", *module_argv], cwd=ROOT, check=True, capture_output=True)
    return json.loads(result.read_text())["tokens_per_s_median"]


def runner_run(tmp: Path, i: int, a) -> float:
    run_dir = tmp / f"runner{i}"
    overrides = ["parallelism=dp2_tp2", f"training.steps={a.steps}", f"training.seq_len={a.seq_len}", "training.global_batch_size=8"]
    overrides += ["training.microbatch_size=2", "logging.progress=false", f"hydra.run.dir={run_dir}"]
    return _tokens_per_s(["runner", *overrides], run_dir / "summary.json")


def plain_run(tmp: Path, i: int, a) -> float:
    out = tmp / f"plain{i}.json"
    script = str(ROOT / "bench" / "plain_loop.py")
    launch = ["torch.distributed.run", "--standalone", "--nproc-per-node", "4", script]
    return _tokens_per_s([*launch, str(out), str(a.steps), str(a.seq_len), "8", "2"], out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=256)
    a = p.parse_args()
    runner, plain = [], []
    with tempfile.TemporaryDirectory() as d:
        for i in range(a.reps):
            runner.append(runner_run(Path(d), i, a))
            plain.append(plain_run(Path(d), i, a))
            print(f"rep {i}: runner {runner[-1]:.1f} tokens/s, plain {plain[-1]:.1f} tokens/s", flush=True)
    r, q = statistics.median(runner), statistics.median(plain)
    print(f"median tokens/s: runner {r:.1f}, plain loop {q:.1f}; ratio runner/plain = {r / q:.3f} (target >= 0.98)")


if __name__ == "__main__":
    main()
