"""`python -m runner.parity`: the entry point; the code is runner/run/parity.py."""

from runner.run.parity import cli

if __name__ == "__main__":
    cli()
