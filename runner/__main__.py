"""`python -m runner`: see runner/cli.py."""

from runner.cli import cli

if __name__ == "__main__":
    cli()
