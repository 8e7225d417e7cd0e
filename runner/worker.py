"""`python -m runner.worker`: the entry point; the code is runner/run/worker.py."""

from runner.run.worker import cli

if __name__ == "__main__":
    cli()
