"""`python -m runner.launch`: the entry point; the code is runner/run/launch.py."""

from runner.run.launch import cli

if __name__ == "__main__":
    cli()
