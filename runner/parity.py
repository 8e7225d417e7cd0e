"""`python -m runner.parity`: the entry point; the code is runner/run/layout_parity.py."""

from runner.run.layout_parity import cli

if __name__ == "__main__":
    cli()
