"""Shared helpers: run the CLI in a subprocess, compose configs in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str, run_dir: Path | None = None, cwd: Path = ROOT, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m runner <args>` (from the project root unless `cwd`); `run_dir` pins Hydra's output folder."""
    argv = [sys.executable, "-m", "runner", *args]
    if run_dir is not None:
        argv.append(f"hydra.run.dir={run_dir}")
    env = {**os.environ, "WANDB_SILENT": "true"}
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="session")
def compose():
    """compose(overrides) -> typed RunConfig, through the same Hydra search path as the CLI."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from runner.__main__ import _to_object

    def _compose(overrides: list[str], name: str = "config"):
        with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
            return _to_object(hydra_compose(config_name=name, overrides=overrides))

    return _compose


@pytest.fixture(scope="session")
def budget(compose):
    """budget(overrides) -> the plan's figures (runner.plan.compute) of the composed, validated config."""
    from runner import plan, validate

    def _budget(overrides: list[str]) -> dict:
        cfg = compose(overrides)
        return plan.compute(cfg, validate.check(cfg))

    return _budget
