"""`python -m runner`: compose (Hydra), validate, then train or just report.

Torch-free until the ranks are launched: `--cfg job`, `--help`, `--info` and
validation never import torch.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner import flops, freeze, precision, validate
from runner.schema import Fp8Recipe, Mode, RunConfig, register

register()
_entered = False  # set once Hydra hands over a composed config


def _to_object(cfg: DictConfig) -> RunConfig:
    """Typed config with every schema check applied (unknown keys, wrong types, enums)."""
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {k: v for k, v in cfg.items() if k != "defaults"})
    return OmegaConf.to_object(cfg)


def _discard(run_dir: Path) -> None:
    """Remove the run folder Hydra just made, so a rejected config leaves nothing behind."""
    ours = {".hydra", "runner.log", "__main__.log"}
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= ours:
        shutil.rmtree(run_dir)
        parent = run_dir.parent  # outputs/<date> left empty
        if parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()


def _fail(msg: str, run_dir: Path) -> None:
    print(msg, file=sys.stderr)
    _discard(run_dir)
    sys.exit(2)


def _precision_lines(cfg: RunConfig) -> list[str]:
    pr = cfg.precision
    dtype, emulated = precision.matmul_peak(cfg)
    peak = cfg.cluster.peak_tflops.get(dtype)
    mfu = f"  MFU against the {dtype} dense peak" + (f", {peak:g} TFLOP/s per device" if peak else " (measured at start-up)")
    if pr.fp8 == Fp8Recipe.none:
        return [f"  precision {pr.name}: {pr.param_dtype.value} compute, {pr.reduce_dtype.value} reduce", mfu]
    converted, kept = precision.conversion(cfg)
    return [
        f"  precision {pr.name}: {len(converted)} of {len(converted) + len(kept)} Linear layers in FP8 {pr.fp8.value} "
        f"(kept in {pr.param_dtype.value}: {', '.join(kept) or 'none'})",
        mfu + (" (FP8 emulated on CPU)" if emulated else ""),
    ]


def _report(cfg: RunConfig, lay) -> str:
    t = cfg.training
    return "\n".join(
        [
            f"config OK: model {cfg.model.name} {cfg.model.flavor} ({flops.num_params(cfg.model) / 1e9:.3g}B params)",
            f"  cluster {cfg.cluster.name}: {lay.world_size} ranks, layout {cfg.parallelism.name} [{lay.describe()}]",
            f"  global batch {t.global_batch_size} x seq {t.seq_len} = {t.global_batch_size * t.seq_len:,} tokens/step, "
            f"{t.global_batch_size // (lay.dp * t.microbatch_size)} microbatches of {t.microbatch_size} per DP rank",
            f"  FLOPs/token {flops.flops_per_token(cfg.model, t.seq_len, 'titan'):,} (titan) / "
            f"{flops.flops_per_token(cfg.model, t.seq_len, '6N'):,} (6N)",
            *_precision_lines(cfg),
        ]
    )


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(dcfg: DictConfig) -> None:
    global _entered
    _entered = True
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        cfg = _to_object(dcfg)
        lay = validate.check(cfg)
        if cfg.mode == Mode.validate:
            print(_report(cfg, lay))
            _discard(run_dir)  # a check, not a run: leave no folder behind
            return
        validate.check_launch(cfg, lay)
    except validate.ConfigError as e:
        _fail(str(e), run_dir)
    except OmegaConfBaseException as e:
        _fail(f"Invalid config: {e}", run_dir)
    if (run_dir / freeze.FROZEN_NAME).exists():
        _fail(f"Run folder {run_dir} already holds a run. Fix: set hydra.run.dir to a new folder.", run_dir)
    frozen = freeze.write(cfg, lay, run_dir)
    from runner import launch

    try:
        launch.run(cfg, lay, frozen)
    except Exception as e:  # a rank failed: the agent printed which one and where its log is
        print(f"training failed: {type(e).__name__}; rank logs in {run_dir / 'logs'}", file=sys.stderr)
        sys.exit(1)


def cli() -> None:
    try:
        main()
    except SystemExit as e:
        if e.code == 1 and not _entered:  # Hydra rejected the command line or a config file
            print("Fix the override or config file named above; `python -m runner --help` lists the groups.", file=sys.stderr)
            sys.exit(2)
        raise


if __name__ == "__main__":
    cli()
