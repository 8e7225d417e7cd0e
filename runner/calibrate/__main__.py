"""`python -m runner.calibrate`: the entry point; the code is runner/calibrate/measure.py."""

from runner.calibrate.measure import main

if __name__ == "__main__":
    raise SystemExit(main())
