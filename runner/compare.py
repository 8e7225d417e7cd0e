"""`python -m runner.compare`: the entry point; the code is runner/outputs/comparison.py."""

from runner.outputs.comparison import cli

if __name__ == "__main__":
    cli()
