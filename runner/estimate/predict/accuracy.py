"""A prediction scored against a measurement: the signed error of one run and the rank correlation of many
(`runner.outputs.comparison`, `search.verify` and the benches count them the same way)."""

from __future__ import annotations

import statistics


def error(predicted: float | None, measured: float | None) -> float | None:
    """The prediction's error as bench/predictor_grid.py counts it: predicted / measured - 1 (negative: too fast)."""
    return predicted / measured - 1 if predicted and measured else None


def _ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=xs.__getitem__)
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Pearson correlation of the ranks (ties get their mean rank)."""
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")
