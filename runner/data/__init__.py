"""Prepared token data (torch-free: numpy, datasets, tokenizers).

`python -m runner.data prepare` turns local corpora into token files, document indexes and a manifest
(`prepare.py`, `cli.py`); `manifest.py` reads and checks a prepared folder, for the config layer's
validation and for `runner/run/loader.py`'s `TokenData`; `order.py` holds the seeded permutation and the
mixture assignment, both pure functions of a global sample index.
"""
