"""The README's table of cluster options, rendered from conf/cluster/*.yaml: every option, each composed by Hydra
as `cluster=<option>` would be (a SLURM cluster's file inherits from another), and described by its file's
opening comment.

    python scripts/gen_clusters.py          # print the table (Markdown)
    python scripts/gen_clusters.py --check  # exit 1 if tests/data/cluster_table.md differs from it

Torch-free; tests/test_cluster.py compares the table with tests/data/cluster_table.md.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runner.config import compose  # noqa: E402
from runner.config.schema import ClusterConfig  # noqa: E402

CLUSTERS = ROOT / "conf" / "cluster"
TABLE = ROOT / "tests" / "data" / "cluster_table.md"
HEADER = (
    "| cluster | nodes x devices | device (backend) | dense peak TFLOP/s per device, fp32 / bf16 / fp8 | memory per device "
    "| started by | what it is |",
    "|---|---|---|---|---|---|---|",
)


def about(text: str) -> str:
    """The first sentence of a cluster file's opening comment (up to its first example command)."""
    words = []
    for line in text.splitlines():
        if not line.startswith("#") or line.startswith(("# @package", "#  ")):
            if words:
                break
            continue
        words.append(line.removeprefix("#").strip())
    prose = " ".join(words)
    first = re.split(r"(?<=\.)\s", prose, maxsplit=1)[0]
    return first.rstrip(":.") + "."


def _peaks(c: ClusterConfig) -> str:
    if not c.peak_tflops:
        return "measured at start-up"
    return " / ".join(f"{c.peak_tflops[d]:g}" if d in c.peak_tflops else "-" for d in ("float32", "bfloat16", "float8"))


def row(option: str, c: ClusterConfig, text: str) -> str:
    nodes = "set `cluster.num_nodes`" if c.num_nodes is None else str(c.num_nodes)
    devices = "the layout's world size" if c.devices_per_node == -1 else str(c.devices_per_node)
    memory = "the machine's RAM" if not c.device_memory_gb else f"{c.device_memory_gb:g} GB"
    if c.launcher.value == "slurm":
        launcher = "SLURM: `python -m runner -m` submits it"
    elif c.num_nodes == 1:
        launcher = "`python -m runner`"
    else:
        launcher = "each node runs the command `mode=launch_plan` prints"
    cells = [f"`{option}`", f"{nodes} x {devices}", f"{c.device.value} ({c.backend.value})", _peaks(c), memory, launcher, about(text)]
    return "| " + " | ".join(cells) + " |"


def table() -> str:
    rows = []
    for path in sorted(CLUSTERS.glob("*.yaml")):
        cfg = compose.compose([f"cluster={path.stem}"])
        rows.append(row(path.stem, cfg.cluster, path.read_text()))
    return "\n".join([*HEADER, *rows]) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help=f"compare with {TABLE.relative_to(ROOT)}; exit 1 on a difference")
    args = parser.parse_args()
    text = table()
    if args.check:
        same = TABLE.is_file() and TABLE.read_text() == text
        print(f"{TABLE.relative_to(ROOT)}: {'up to date' if same else 'out of date: run scripts/gen_clusters.py > it'}")
        return 0 if same else 1
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
