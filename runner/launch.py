"""`python -m runner.launch`: the entry point; the code is runner/run/node_launch.py."""

from runner.run.node_launch import cli

if __name__ == "__main__":
    cli()
