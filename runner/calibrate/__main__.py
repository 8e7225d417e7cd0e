"""`python -m runner.calibrate`: the entry point; the code is runner/calibrate/machine.py."""

from runner.calibrate.machine import main

if __name__ == "__main__":
    raise SystemExit(main())
