"""Prepared token data (torch-free: numpy, datasets, tokenizers).

`python -m runner.data prepare` turns local corpora into token files, document indexes and a manifest
(`prepare.py`, `cli.py`); the folder's format, which validation and `runner/run/token_data.py`'s `TokenData` read too,
is `runner/formats/data_manifest.py`; `order.py` holds the seeded permutation and the
mixture assignment, both pure functions of a global sample index.
"""
