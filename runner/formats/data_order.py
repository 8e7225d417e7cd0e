"""Sample order as pure functions of an index: nothing is materialized, so start-up time and memory do not
grow with the corpus, and any position (a resume, another layout) is reached in O(1).

`Permutation(n, seed)` is a bijection of [0, n): a balanced Feistel network over the smallest even power
of two >= n, cycle-walked until the value falls inside [0, n) (Black and Rogaway's construction for
format-preserving encryption; at most 4 walks are expected since the domain is < 4n).
`Mixture(weights)` sends global sample g to a source and an index within that source: a binary tree of
quota splits, each an exact integer rounding of k x (weight share), so after k samples every source has
had its share to within one sample per tree level.
"""

from __future__ import annotations

from fractions import Fraction

ROUNDS = 4
MASK64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """SplitMix64's finalizer: a well-spread 64-bit hash of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


class Permutation:
    """A seeded bijection of [0, n), evaluated one index at a time."""

    def __init__(self, n: int, seed: int):
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)
        self.mask = (1 << self.half) - 1
        self.keys = [mix64((seed & MASK64) ^ mix64(r + 1)) for r in range(ROUNDS)]

    def _feistel(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (mix64(right ^ k) & self.mask)
        return (left << self.half) | right

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} outside [0, {self.n})")
        x = self._feistel(i)
        while x >= self.n:  # cycle walking: stays a bijection of [0, n)
            x = self._feistel(x)
        return x


class Mixture:
    """Which source feeds global sample g, and g's index within that source."""

    def __init__(self, weights: list[float]):
        if not weights or any(w <= 0 for w in weights):
            raise ValueError(f"mixture weights must be > 0, got {weights}")
        self.tree = self._split([(i, Fraction(w).limit_denominator(10**9)) for i, w in enumerate(weights)])

    @classmethod
    def _split(cls, items: list[tuple[int, Fraction]]):
        if len(items) == 1:
            return items[0][0]
        mid = len(items) // 2
        left, right = items[:mid], items[mid:]
        share = sum(w for _, w in left) / sum(w for _, w in items)
        return (share.numerator, share.denominator, cls._split(left), cls._split(right))

    def __call__(self, g: int) -> tuple[int, int]:
        node, k = self.tree, g
        while not isinstance(node, int):
            p, q, left, right = node
            before = (k * p + q // 2) // q  # samples among 0..k-1 that went left: exact, monotone, steps of 0 or 1
            if ((k + 1) * p + q // 2) // q > before:
                node, k = left, before
            else:
                node, k = right, k - before
        return node, k

    def counts(self, n: int) -> list[int]:
        """How many of the global samples 0..n-1 each source feeds (source s's indices 0..counts[s]-1), in O(sources):
        the same quota of each split as `__call__` applies sample by sample."""
        out: dict[int, int] = {}

        def walk(node, k: int) -> None:
            if isinstance(node, int):
                out[node] = k
                return
            p, q, left, right = node
            before = (k * p + q // 2) // q
            walk(left, before)
            walk(right, k - before)

        walk(self.tree, n)
        return [out[s] for s in sorted(out)]
