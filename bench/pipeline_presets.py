"""Benchmark: tokens/s and measured pipeline idle beside the bubble formula, for every preset that fits here.

python bench/pipeline_presets.py [--steps 6] [--seq-len 256] [--global-batch 16] [--out bench_out]

Runs the presets in two launches of runner.parity (2 and 4 CPU ranks; each preset builds its own mesh
inside the launch's process group) with the runner's step loop, then prints one Markdown table and
writes it as JSON. Tokens/s is the median over steps after the first; the measured idle fraction is the
runner's calibration (1 - time inside the stages' forward/backward chunks / schedule wall time, median
over steps, mean over ranks); the formula is (p-1)/(m+p-1), or (p-1)/(v*m+p-1) with v stages per rank.
On a shared 2-core machine ranks time-share the cores, so idle here also contains waiting for a core.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from runner.formats import runfiles

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PP2 = ["parallelism=single", "parallelism.name=pp2", "parallelism.pp=2"]
PRESETS = {
    2: {
        "dp2": ["parallelism=dp2"],
        "tp2": ["parallelism=tp2"],
        "pp2 1F1B": PP2,
        "pp2 GPipe": [*PP2, "parallelism.pp_schedule=GPipe"],
        "pp2_interleaved (Interleaved1F1B v=2)": ["parallelism=pp2_interleaved"],
        "pp2 LoopedBFS v=2": ["parallelism=pp2_interleaved", "parallelism.pp_schedule=LoopedBFS"],
        "pp2 InterleavedZeroBubble v=2": ["parallelism=pp2_interleaved", "parallelism.pp_schedule=InterleavedZeroBubble"],
        "pp2 ZBVZeroBubble v=2": ["parallelism=pp2_interleaved", "parallelism.pp_schedule=ZBVZeroBubble"],
        "pp2 DualPipeV v=2": ["parallelism=pp2_interleaved", "parallelism.pp_schedule=DualPipeV"],
    },
    4: {
        "dp2_tp2": ["parallelism=dp2_tp2"],
        "hsdp2x2": ["parallelism=hsdp2x2"],
        "tp2_pp2": ["parallelism=tp2_pp2"],
        "dp2_pp2": ["parallelism=dp2_pp2"],
    },
}


def compose_all(a) -> dict:
    from runner.config import compose, validate

    common = [f"training.steps={a.steps}", f"training.seq_len={a.seq_len}", f"training.global_batch_size={a.global_batch}"]
    common += ["training.microbatch_size=1", "logging.progress=false"]
    out = {}
    for nproc, presets in PRESETS.items():
        out[nproc] = {}
        for name, overrides in presets.items():
            cfg = compose.compose([*common, *overrides])
            validate.check(cfg)
            out[nproc][name] = cfg
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    from runner.run import layout_parity

    folder = a.out or Path(tempfile.mkdtemp(prefix="bench_pp_"))
    table = []
    for nproc, cfgs in compose_all(a).items():
        slug = {name: name.split()[0] + "_" + str(i) for i, name in enumerate(cfgs)}
        paths = layout_parity.prepare({slug[n]: c for n, c in cfgs.items()}, folder / f"ranks{nproc}")
        subprocess.run([sys.executable, "-m", "runner.parity", str(nproc), *map(str, paths)], cwd=ROOT, check=True)
        for name, path in zip(cfgs, paths, strict=True):
            res = json.loads((path.parent / runfiles.PARITY).read_text())
            s, cal = res["summary"], res["summary"]["plan_check"]
            table.append(
                {
                    "preset": name,
                    "ranks": nproc,
                    "degrees": res["degrees"],
                    "tokens_per_s": s["tokens_per_s_median"],
                    "step_time_s": s["step_time_s_median"],
                    "idle_measured": cal["bubble_measured"],
                    "bubble_formula": cal["bubble_predicted"] if res["schedule"] else None,
                    "final_loss": s["final_loss"],
                }
            )
    (folder / "pipeline_presets.json").write_text(json.dumps(table, indent=2) + "\n")
    pct = lambda x: "-" if x is None else f"{100 * x:.1f} %"  # noqa: E731
    print(f"\nseq {a.seq_len}, global batch {a.global_batch}, microbatch 1, {a.steps} steps (median after step 1); {folder}")
    print("| preset | ranks | tokens/s | step s | measured idle | formula |")
    print("|---|---|---|---|---|---|")
    for r in table:
        print(
            f"| {r['preset']} | {r['ranks']} | {r['tokens_per_s']:,.0f} | {r['step_time_s']:.2f} | "
            f"{pct(r['idle_measured'])} | {pct(r['bubble_formula'])} |"
        )


if __name__ == "__main__":
    main()
