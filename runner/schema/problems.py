"""What validation reports: one problem per bad field, all of them raised together."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    field: str
    value: object
    why: str
    fix: str

    def __str__(self) -> str:
        return f"{self.field} = {self.value}: {self.why}. Fix: {self.fix}."


class ConfigError(Exception):
    """A config that must not start; the message lists every problem."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        n = len(problems)
        lines = [f"Invalid config ({n} problem{'s' if n > 1 else ''}):"]
        lines += [f"  - {p}" for p in problems]
        super().__init__("\n".join(lines))
