"""The plan's memory figures beside the dry run's measurement, for the cluster configs issue 14 names.

    .venv/bin/python bench/dryrun_vs_plan.py [NAME ...]     # all configs by default; several minutes

Each config runs `python -m runner mode=dryrun` (its default ranks: first, middle and last stage; rank 0
alone for the 16,384-GPU long-context layout) in a
folder of its own and prints, per rank, plan GB (the rank's pipeline stage, on the rehearsal's CPU kernels),
measured GB, their ratio by category and PASS/FAIL on the rows the plan is held to (weights + gradients and
optimizer within 2 %, activations within 15 %), the wall time per simulated rank, and whether the plan's
fits_memory (on the cluster's kernels) agrees with the largest measured peak against the device's memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runner.formats import runfiles  # noqa: E402

P405 = [
    "model=llama3_405b",
    "parallelism=tp8_pp16",
    "cluster=h100x1024",
    "cluster.num_nodes=1024",
    "precision=bf16",
    "training.global_batch_size=2048",
    "training.seq_len=8192",
    "training.microbatch_size=1",
]
CONFIGS = {
    "70b_bf16": ["recipe=llama3_70b_h100x1024"],
    "70b_fp8_tensorwise": ["recipe=llama3_70b_h100x1024", "precision=fp8_tensorwise"],
    "405b_tp8_pp16_ac_full": [*P405, "training.activation_checkpoint=full"],
    "405b_tp8_pp16_ac_none": [*P405, "training.activation_checkpoint=none"],
    "8b_fsdp8": ["recipe=llama3_8b_fsdp8_h100"],
    "debug_moe_ep8": [
        "model=debug_moe",
        "parallelism=ep2",
        "parallelism.name=ep8",
        "parallelism.dp_shard=8",
        "parallelism.ep=8",
        "cluster=h100_node",
        "precision=bf16",
        "training.global_batch_size=8",
        "training.microbatch_size=1",
    ],
    # MoE recipes (issue 56): Interleaved1F1B's first and last pipeline ranks
    "deepseek_v3_671b": ["recipe=deepseek_v3_671b_h800x2048", "dryrun.ranks=[0,1920]"],
    "qwen3_235b_a22b": ["recipe=qwen3_235b_a22b_h100x1024", "dryrun.ranks=[0,896]"],
    "405b_tp8_pp16_cp16": [
        "model=llama3_405b",
        "parallelism=tp8_pp16_cp16",
        "cluster=h100x1024",
        "cluster.num_nodes=2048",
        "precision=bf16",
        "training.global_batch_size=128",
        "training.seq_len=131072",
        "training.microbatch_size=1",
        "training.activation_checkpoint=full",
        "dryrun.ranks=[0]",  # 16 microbatches of 131,072 tokens with ring attention: ~5 min per rank here
    ],
}


def run(name: str, overrides: list[str], folder: Path) -> None:
    run_dir = folder / name
    t0 = time.perf_counter()
    argv = [sys.executable, "-m", "runner", "mode=dryrun", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    print(f"== {name}: {' '.join(overrides)} ({wall:.0f} s with start-up)")
    if proc.returncode != 0:
        print(f"   FAILED (exit {proc.returncode}):\n" + "\n".join("   " + x for x in proc.stderr.strip().splitlines()[-12:]))
        return
    rep = json.loads((run_dir / runfiles.DRYRUN).read_text())
    for note in filter(None, [rep["batch_note"], *rep["substitutions"]]):
        print(f"   {note}")
    for r in rep["ranks"]:
        coords = " ".join(f"{k}={v}" for k, v in r["coords"].items())
        steps = " + ".join(f"{s:.1f}" for s in [*([r["warm_up_s"]] if "warm_up_s" in r else []), *r["step_s"]])  # warm-up first
        print(f"   rank {r['rank']} [{coords}]: wall {r['wall_s']:.1f} s (build {r['build_s']:.1f}, steps {steps})")
        for row in r["rows"]:
            plan = "-" if row["plan_gb"] is None else f"{row['plan_gb']:.2f}"
            ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
            held = "" if row["tolerance"] is None else f"  {100 * row['tolerance']:.0f} % " + ("PASS" if row["within"] else "FAIL")
            print(f"     {row['row']:30}{plan:>9}{row['measured_gb']:>10.2f}{ratio:>7}{held}")
    f = rep["fits"]
    if f["device_memory_gb"]:
        agree = "agree" if f["plan"] == f["measured"] else "DISAGREE"
        print(
            f"   fits_memory: plan {f['plan']} ({rep['plan']['total_gb_per_gpu']:.2f} GB), dry run {f['measured']} "
            f"(largest peak {f['largest_peak_gb']:.2f} GB) in {f['device_memory_gb']:g} GB: {agree}"
        )


def main() -> None:
    names = sys.argv[1:] or list(CONFIGS)
    sys.stdout.reconfigure(line_buffering=True)  # each config's table as it completes, also into a file
    with tempfile.TemporaryDirectory() as folder:
        for name in names:
            run(name, CONFIGS[name], Path(folder))


if __name__ == "__main__":
    main()
