"""Benchmark: one SIGKILL, recovered with the shared checkpoint tier alone and with a node-local tier beside it.

python bench/ckpt_tiers.py [--reps 1] [--steps 24] [--interval 10] [--kill-at 19] [--layout dp2_tp2] [--sync]

The same job twice per rep, alternating: 4 CPU ranks on two simulated nodes (monitor.inject.node_names), shared
checkpoints every --interval steps, rank 1 SIGKILLed at the start of step --kill-at and restarted by the elastic agent
(cluster.max_restarts=1); the second run adds checkpoint.local with an interval a fifth of the shared one (each node's
own folder under the bench's temporary folder, each shard copied to the other node). Prints side by side: the tier and
step each run resumed from, the steps recomputed (goodput.json's repeated_steps), what the saves held the loop per
step (metrics.jsonl's checkpoint_s over the steps trained, and per save of each tier), the lost work and the goodput.
Both tiers write to this machine's one disk here, so the local tier's speed-up of the write itself is not shown; what
it changes is how much work a failure loses. Saves are asynchronous (checkpoint.async_save, the default) unless --sync.
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
NODES = "[n0,n0,n1,n1]"


def run(run_dir: Path, a, local: Path | None) -> dict:
    argv = [sys.executable, "-m", "runner", f"parallelism={a.layout}", f"training.steps={a.steps}", f"training.seq_len={a.seq_len}"]
    argv += ["checkpoint=local", f"checkpoint.interval={a.interval}", f"checkpoint.async_save={'false' if a.sync else 'true'}"]
    argv += [
        "checkpoint.keep=2",
        f"monitor.inject.node_names={NODES}",
        "monitor.inject.kill_rank=1",
        f"monitor.inject.kill_at_step={a.kill_at}",
    ]
    argv += ["cluster.max_restarts=1", "logging.progress=false", "distributed.shutdown_timeout_s=5", f"hydra.run.dir={run_dir}"]
    if local is not None:
        argv += [f"checkpoint.local.folder={local}/%N", f"checkpoint.local.interval={max(1, a.interval // 5)}"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{run_dir.name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    g = json.loads((run_dir / "goodput.json").read_text())
    resumed = next(ln for ln in proc.stdout.splitlines() if ln.startswith("checkpoint: resumed from"))
    saves: dict[str, list[float]] = {}
    for r in rows:
        if r.get("checkpoint_s"):
            saves.setdefault(r.get("checkpoint_tier", "shared"), []).append(r["checkpoint_s"])
    return {
        "resumed": resumed,
        "resumed_from_step": g["attempts"][-1]["resumed_from_step"],
        "recomputed": g["repeated_steps"],
        "held_per_step_s": sum(sum(v) for v in saves.values()) / len(rows),
        "held_per_save_s": {tier: statistics.median(v) for tier, v in saves.items()},
        "lost_s": g["parts_s"]["lost"],
        "goodput": g["goodput"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--interval", type=int, default=10, help="the shared tier's interval; the local one's is a fifth of it")
    p.add_argument("--kill-at", type=int, default=19)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--layout", default="dp2_tp2")
    p.add_argument("--sync", action="store_true", help="synchronous saves (both tiers)")
    a = p.parse_args()
    out: dict[str, list[dict]] = {"shared only": [], "shared + local": []}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for i in range(a.reps):
            out["shared only"].append(run(tmp / f"shared-{i}", a, None))
            out["shared + local"].append(run(tmp / f"tiers-{i}", a, tmp / f"local-{i}"))
            print(f"rep {i}: done", flush=True)
    local_every = max(1, a.interval // 5)
    print(
        f"{a.layout} on 2 simulated nodes x 2 CPU ranks, seq {a.seq_len}, {a.steps} steps, shared checkpoint every {a.interval} "
        f"(local every {local_every} in the second), {'sync' if a.sync else 'async'} saves, rank 1 SIGKILLed at step {a.kill_at}"
    )
    print(f"{'':16} {'resumed from':>12} {'recomputed':>10} {'held/step':>10} {'held/save':>26} {'lost work':>9} {'goodput':>8}")
    for name, reps in out.items():
        for r in reps:
            per_save = ", ".join(f"{tier} {s:.3f} s" for tier, s in r["held_per_save_s"].items())
            tier = "local" if "local tier" in r["resumed"] else "shared"
            print(
                f"{name:16} {tier + ' ' + str(r['resumed_from_step']):>12} {r['recomputed']:>10} {r['held_per_step_s']:>9.3f}s "
                f"{per_save:>26} {r['lost_s']:>8.2f}s {100 * r['goodput']:>7.1f}%"
            )
    med = {name: statistics.median(r["goodput"] for r in reps) for name, reps in out.items()}
    rec = {name: statistics.median(r["recomputed"] for r in reps) for name, reps in out.items()}
    print(
        f"median goodput: shared only {100 * med['shared only']:.1f} %, shared + local {100 * med['shared + local']:.1f} % "
        f"(ratio {med['shared + local'] / med['shared only']:.3f}); steps recomputed {rec['shared only']:g} vs {rec['shared + local']:g}"
    )


if __name__ == "__main__":
    main()
