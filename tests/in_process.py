"""`python -m runner` in the test's own process, for the cases that end before a run starts (no subprocess: a
refusal is checked in milliseconds). A helper module: test modules import it, never each other."""

from __future__ import annotations

import sys

import pytest


def cli(monkeypatch, capsys, *argv: str) -> tuple[int, str]:
    """`python -m runner <argv>` in this process, for cases that end before a run starts: its exit code and stderr.
    What cli() patches in Hydra is put back afterwards."""
    from hydra._internal import utils
    from hydra._internal.hydra import Hydra

    from runner import cli, sweep

    monkeypatch.setattr(utils, "run_and_report", utils.run_and_report)
    monkeypatch.setattr(Hydra, "get_mode", Hydra.get_mode)
    monkeypatch.setattr(sweep, "STATE", sweep.State())
    monkeypatch.setattr(sys, "argv", ["runner", *argv])
    monkeypatch.setattr(cli, "_fast_exit", sys.exit)  # not os._exit, which would end pytest where torch is imported
    with pytest.raises(SystemExit) as e:
        cli.cli()
    return e.value.code, capsys.readouterr().err
