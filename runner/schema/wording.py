"""Counted nouns and device words for what the runner prints: "1 rank", "2 ranks", "per CPU rank"."""

from __future__ import annotations


def count(n: int, noun: str) -> str:
    """`n` and the noun in the number it takes: count(1, "rank") = "1 rank", count(4, "microbatch") = "4 microbatches"."""
    if n == 1:
        return f"1 {noun}"
    return f"{n} {noun}{'es' if noun.endswith(('ch', 'sh', 's', 'x')) else 's'}"


def device_unit(device: str) -> str:
    """What one rank runs on, for per-rank figures: a GPU on CUDA, a share of the machine ("CPU rank") on CPU."""
    return "GPU" if device == "cuda" else "CPU rank"
