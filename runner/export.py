"""`python -m runner.export`: the entry point; the code is runner/run/hf_export.py."""

from runner.run.hf_export import cli

if __name__ == "__main__":
    cli()
