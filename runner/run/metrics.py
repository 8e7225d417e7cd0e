"""Metric sinks on rank 0: console with a rich progress bar, metrics.jsonl, W&B."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from runner.formats import runfiles
from runner.observe import layer_stats, moe_load
from runner.schema import RunConfig, layout


class Sink(Protocol):
    def log(self, row: dict[str, Any]) -> None: ...

    def log_breakdown(self, found: dict[str, Any]) -> None:
        """A traced step's time by term, once its trace is read (runner.run.profiling.Session): the step, the busiest
        traced rank and its terms (runner.outputs.breakdown.steps)."""

    def close(self, summary: dict[str, Any]) -> None: ...


def _fmt(row: dict[str, Any]) -> str:
    s = (
        f"step {row['step']:>4}  loss {row['loss']:.4f}  grad_norm {row['grad_norm']:.3f}  "
        f"tokens/s {row['tokens_per_s']:,.0f}  mfu {100 * row['mfu']:.2f}%"
    )
    if "mfu_of_gemm_peak" in row and row["mfu_of_gemm_peak"] != row["mfu"]:  # FP8: the GEMMs' own (float8) peak beside bf16's
        s += f"  mfu_of_gemm_peak {100 * row['mfu_of_gemm_peak']:.2f}%"
    if "hfu" in row:
        s += f"  hfu {100 * row['hfu']:.2f}%"
    s += f"  step {row['step_time_s']:.2f}s  mem {row['memory_gb']:.2f}GB"
    if "eval_loss" in row:  # an evaluation pass on held-out data ran after this step (runner.run.evaluate)
        s += f"  eval_loss {row['eval_loss']:.4f}  eval_ppl {row['eval_ppl']:.2f}  eval {row['eval_s']:.2f}s"
    return s


def _events(row: dict[str, Any]) -> list[str]:
    """Monitor findings carried by a row: loss-guard verdicts and stragglers."""
    from runner.observe.monitor import describe

    out = []
    if "spike" in row:
        out.append(f"loss guard: step {row['step']} {row['spike']}: {row['action']} (skipped so far: {row['skipped_steps']})")
    if "rewound_to" in row and "bad_steps" in row:
        out.append(f"loss guard: rewound to the checkpoint of step {row['rewound_to']}; batches of steps {row['bad_steps']} left out")
    elif "rewound_to" in row:  # the replicas disagreed (monitor.integrity.on_mismatch=rewind; the mismatch was printed)
        out.append(f"integrity: rewound to the checkpoint of step {row['rewound_to']}")
    out += [describe(f) for f in row.get("stragglers", [])]
    return out


class ConsoleSink:
    def __init__(self, steps: int, progress: bool, header: str):
        self.console = Console(highlight=False, soft_wrap=True)  # one line per step in SLURM and CI logs too (80 columns off a terminal)
        self.console.print(header, markup=False)
        self.progress = None
        if progress:
            self.progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), console=self.console)
            self.task = self.progress.add_task("train", total=steps)
            self.progress.start()

    def log(self, row: dict[str, Any]) -> None:
        self.console.print(_fmt(row), markup=False)
        for line in _events(row):
            self.console.print(line, markup=False)
        if self.progress:
            self.progress.update(self.task, completed=row["step"])

    def log_breakdown(self, found: dict[str, Any]) -> None:
        pass  # the run's end prints the breakdown (terms_line); profile/breakdown.json holds every step

    def close(self, summary: dict[str, Any]) -> None:
        if self.progress:
            self.progress.stop()
        self.console.print(
            f"done: final loss {summary['final_loss']:.4f}, median {summary['tokens_per_s_median']:,.0f} tokens/s, "
            f"median MFU {100 * summary['mfu_median']:.2f}% of {_mfu_peak(summary)} ({summary['peak_source']}"
            + ("" if summary["peak_spread"] is None else f", spread {100 * summary['peak_spread']:.1f} %")
            + ")"
            + _gemm_mfu(summary)
        )
        if summary.get("eval_loss_final") is not None:
            self.console.print(
                f"eval: held-out loss {summary['eval_loss_final']:.4f}, perplexity {summary['eval_ppl_final']:.2f} "
                f"(after step {summary['eval_step_final']})"
            )
        cal = summary.get("plan_check")
        if cal:
            self.console.print(plan_check_line(cal))
            if cal.get("terms_measured_s"):
                self.console.print(terms_line(cal, summary.get("profile", {})), markup=False)
            if cal["bubble_measured"] is not None:
                self.console.print(
                    f"plan check: pipeline bubble predicted {100 * cal['bubble_predicted']:.1f} %, "
                    f"measured idle {100 * cal['bubble_measured']:.1f} %"
                )


def plan_check_line(cal: dict[str, Any]) -> str:
    """The predicted step time beside the measured one, or, on a CPU without a machine profile, how to make one."""
    if cal["profile_from"] == "none":
        return (
            f"plan check: step time measured {cal['step_time_measured_s']:.3f} s; no prediction without a machine profile of "
            "this CPU: make one with `python -m runner.calibrate` (later runs here use it; or set cluster.profile)"
        )
    cached = " (the newest cached profile of this machine)" if cal["profile_from"] == "cache" else ""
    return (
        f"plan check: step time predicted {_s(cal['step_time_predicted_s'])}, measured {cal['step_time_measured_s']:.3f} s "
        f"(measured/predicted {_s(cal['step_time_ratio'], '.2f', '')}), {cal['prediction_source']}{cached}; measured peak "
        f"{cal['peak_tflops_per_rank']:.3g} TFLOP/s per rank and all-reduce {cal['allreduce_gbs_per_direction']:.2f} GB/s"
    )


def terms_line(cal: dict[str, Any], prof: dict[str, Any]) -> str:
    """The traced steps' time by the predictor's terms (profile/breakdown.json), beside the prediction when there is one."""
    from runner.outputs.breakdown import TERMS

    measured, predicted = cal["terms_measured_s"], cal.get("terms_predicted_s")
    where = f"busiest traced rank {prof.get('busiest_rank')}, steps {prof.get('steps')}, {cal['terms_measured_step_s']:.3f} s a step"
    parts = []
    for k in TERMS:
        m, p = measured.get(k, 0.0), (predicted or {}).get(k)
        if m < 5e-4 and not p:
            continue
        if predicted is None or k in ("data_wait", "unattributed"):
            parts.append(f"{k} {m:.3f}")
        else:
            parts.append(f"{k} {m:.3f}/{p:.3f}" + (f" ({m / p:.2f})" if p else ""))
    head = "measured/predicted s (ratio)" if predicted else "measured s (no prediction without a machine profile)"
    return f"plan check by term, {head}; {where}: " + ", ".join(parts)


def _s(x: float | None, fmt: str = ".3f", unit: str = " s") -> str:
    return "n/a" if x is None else format(x, fmt) + unit


class JsonlSink:
    """metrics.jsonl: one JSON object per logged step; summary.json at the end.

    Every row carries `attempt` (the elastic agent's restart count, TORCHELASTIC_RESTART_COUNT); a step
    logged before (by an earlier attempt, or before a loss-guard rewind) is logged again with
    `"repeat": true`, so a reader that wants one row per step keeps the last."""

    KEYS = {"attempt": "every row", "repeat": "a step logged again"}
    """The keys this sink adds to a step's row (runner.formats.metrics_row.StepRow), and when."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        path = run_dir / runfiles.METRICS
        self.seen = {json.loads(line)["step"] for line in path.read_text().splitlines()} if path.is_file() else set()
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # unset outside torch's agent: the first attempt
        self.file = open(path, "a")

    def log(self, row: dict[str, Any]) -> None:
        row = row | {"attempt": self.attempt} | ({"repeat": True} if row["step"] in self.seen else {})
        self.seen.add(row["step"])
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def log_breakdown(self, found: dict[str, Any]) -> None:
        pass  # profile/breakdown.json holds it

    def close(self, summary: dict[str, Any]) -> None:
        self.file.close()
        (self.run_dir / runfiles.SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")


def run_label(cfg: RunConfig) -> str:
    """The layout that ran (not the preset it started from), as summary.json and plan.json name it."""
    return layout.label(layout.resolve(cfg.parallelism, cfg.cluster), cfg.parallelism)


class WandbSink:
    def __init__(self, cfg: RunConfig, run_dir: Path, frozen: dict[str, Any]):
        import wandb

        w = cfg.logging.wandb
        self.run = wandb.init(
            project=w.project,
            entity=w.entity,
            mode=w.mode,
            dir=str(run_dir),
            group=w.group,
            name=f"{run_label(cfg)}-{run_dir.name}",
            config=frozen,
        )

    def log(self, row: dict[str, Any]) -> None:
        scalars = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float, str))}
        for f in row.get("stragglers", []):  # one series per rank and phase: the slowdown when flagged
            scalars[f"straggler/rank{f['rank']}_{f['phase']}"] = f["slowdown"]
        if "moe" in row:  # the experts' load (runner.observe.moe_load): flat keys, not the per-expert table
            scalars |= moe_load.wandb_keys(row["moe"])
        if "layers" in row:  # per-block statistics (runner.observe.layer_stats): layers/block<b>_<field>
            scalars |= layer_stats.wandb_keys(row["layers"])
        self.run.log(scalars, step=row["step"])

    def log_breakdown(self, found: dict[str, Any]) -> None:
        """One series per term (breakdown/<term>_s) at the traced step, beside its step time."""
        scalars = {f"breakdown/{k}_s": v for k, v in found["terms_s"].items()}
        self.run.log(scalars | {"breakdown/busiest_rank": found["busiest_rank"], "breakdown/step_s": found["step_s"]}, step=found["step"])

    def close(self, summary: dict[str, Any]) -> None:
        self.run.summary.update(flatten(summary) | predicted(summary))
        self.run.finish()


def _mfu_peak(summary: dict[str, Any]) -> str:
    """The peak `mfu` is measured against: param_dtype's (bf16) for every precision."""
    return f"{summary.get('mfu_peak_tflops', summary['peak_tflops']):.3g} TFLOP/s {summary.get('mfu_dtype', summary['peak_dtype'])}"


def _gemm_mfu(summary: dict[str, Any]) -> str:
    """FP8 runs: the MFU against the GEMMs' own dense peak as well (the two differ)."""
    gemm = summary.get("mfu_of_gemm_peak_median")
    if gemm is None or summary.get("mfu_dtype", summary["peak_dtype"]) == summary["peak_dtype"]:
        return ""
    return f"; mfu_of_gemm_peak {100 * gemm:.2f}% of {summary['peak_tflops']:.3g} TFLOP/s {summary['peak_dtype']}"


def predicted(summary: dict[str, Any]) -> dict[str, Any]:
    """Flat W&B keys beside the measured medians, so that a sweep's group compares prediction with measurement:
    the predictor's step time for this run (the calibration block's, on the peak and bandwidth the run measured)
    and the MFU that step time would give, in each FLOP convention the run logs (MFU scales as 1 / step time)."""
    pred = (summary.get("plan_check") or {}).get("step_time_predicted_s")
    measured = summary.get("step_time_s_median")
    if not pred or not measured:
        return {}
    out = {"step_time_s_predicted": pred}
    for key in ("mfu", "mfu_6n", "mfu_of_gemm_peak"):
        if summary.get(f"{key}_median") is not None:
            out[f"{key}_predicted"] = summary[f"{key}_median"] * measured / pred
    return out


def flatten(summary: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """W&B summary keys for nested values: {"plan_check": {"step_time_ratio": r}} -> {"plan_check/step_time_ratio": r}.
    Scalars, None and lists of scalars are kept; W&B would store a nested dict as one opaque value."""
    out: dict[str, Any] = {}
    for key, value in summary.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= flatten(value, f"{name}/")
        elif value is None or isinstance(value, (int, float, str)):
            out[name] = value
        elif isinstance(value, list) and all(isinstance(v, (int, float, str)) for v in value):
            out[name] = value
    return out


def sinks(cfg: RunConfig, run_dir: Path, header: str, frozen: dict[str, Any]) -> list[Sink]:
    out: list[Sink] = [ConsoleSink(cfg.training.steps, cfg.logging.progress, header), JsonlSink(run_dir)]
    if cfg.logging.wandb.enable:
        out.append(WandbSink(cfg, run_dir, frozen))
    return out
