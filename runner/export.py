"""`python -m runner.export`: the entry point; the code is runner/run/export.py."""

from runner.run.export import cli

if __name__ == "__main__":
    cli()
