"""Published GPU runs the datasheet predictor is checked against (runner/calibrate/reference_runs.csv).

Each row is composed from its Hydra overrides like a command line, priced by the predictor and set
beside its measured step time: tokens/s per GPU give it directly; the Llama 3 paper's TFLOP/s per GPU
are converted with the usual model-FLOP convention of Megatron-LM and TorchTitan ("titan" in
runner/estimate/flops.py: the attention scores counted without causal sparsity), the paper stating none.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from runner.config import compose
from runner.estimate import flops
from runner.estimate.predict import steptime
from runner.schema import RunConfig, layout

DATA = Path(__file__).resolve().parent / "reference_runs.csv"


@dataclass(frozen=True)
class Reference:
    id: str
    role: str
    """fit, heldout or not_modelled."""
    measured_step_s: float
    predicted: steptime.StepPrediction

    @property
    def error(self) -> float:
        """Predicted over measured, minus one."""
        return self.predicted.step_s / self.measured_step_s - 1


def rows(path: Path = DATA) -> list[dict[str, str]]:
    lines = [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]
    return list(csv.DictReader(lines))


def _flops_per_token(cfg: RunConfig, unit: str) -> float:
    return flops.flops_per_token(cfg.model, cfg.training.seq_len, "titan") if unit == "tflops_per_gpu" else 1.0


def measured_step_s(cfg: RunConfig, world: int, row: dict[str, str]) -> float:
    tokens = cfg.training.global_batch_size * cfg.training.seq_len
    per_gpu = float(row["measured"]) * (1e12 if row["unit"] == "tflops_per_gpu" else 1.0)
    return tokens * _flops_per_token(cfg, row["unit"]) / (per_gpu * world)


def check(row: dict[str, str]) -> Reference:
    overrides = row["overrides"].split()
    bf16 = [] if any(o.startswith("precision=") for o in overrides) else ["precision=bf16"]  # FP8 rows name their recipe
    cfg = compose.compose([f"model={row['model']}", *bf16, *overrides])
    lay = layout.resolve(cfg.parallelism, cfg.cluster)
    return Reference(row["id"], row["role"], measured_step_s(cfg, lay.world_size, row), steptime.predict(cfg, lay, ac=row["ac"]))


def checked(role: str | None = None) -> list[Reference]:
    """Every modelled row (or those of one role), predicted."""
    return [check(r) for r in rows() if r["role"] != "not_modelled" and (role is None or r["role"] == role)]
