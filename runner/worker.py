"""`python -m runner.worker`: the entry point; the code is runner/run/per_rank.py."""

from runner.run import known_warnings

known_warnings.apply(known_warnings.on_console())  # before torch, TorchTitan and torchao are imported

from runner.run.per_rank import cli  # noqa: E402

if __name__ == "__main__":
    cli()
