"""`python -m runner.data prepare ...`: see runner/data/cli.py."""

from runner.data.cli import main

raise SystemExit(main())
