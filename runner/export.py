"""`python -m runner.export`: the entry point; the code is runner/run/hf_export.py."""

from runner.run import known_warnings

known_warnings.apply(True)  # one process, on the console: before torch is imported
from runner.run.hf_export import cli  # noqa: E402

if __name__ == "__main__":
    cli()
