"""`python -m runner.compare`: the entry point; the code is runner/config/compare.py."""

from runner.config.compare import cli

if __name__ == "__main__":
    cli()
