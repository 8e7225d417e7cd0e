"""`python -m runner.calibrate`: the entry point; the code is runner/run/calibrate.py."""

from runner.run.calibrate import main

if __name__ == "__main__":
    raise SystemExit(main())
