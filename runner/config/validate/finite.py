"""Numbers that are not finite, wherever the config holds a float.

`nan` passes every bound a rule can write (each comparison with it is false: "more than the nan GB") and `inf`
passes every lower bound ("fits in inf GB"), so no rule can judge either: they are refused with the schema's
own checks, before any rule reads the config (runner.config.compose.to_object).
"""

from __future__ import annotations

import dataclasses
import math

from runner.schema.problems import Problem

ALLOWED = {"monitor.inject.corrupt_scale": "nan is how a test injects a non-finite loss (runner.observe.monitor catches it)"}
"""The float fields that may hold nan or inf, and why."""


def problems(cfg: object, prefix: str = "") -> list[Problem]:
    """One Problem per float of the typed config (fields, mapping values, list items) that is nan or +-inf."""
    out: list[Problem] = []
    for f in dataclasses.fields(cfg):
        name, value = f"{prefix}{f.name}", getattr(cfg, f.name)
        if name == "provenance" or name in ALLOWED:
            continue
        default = getattr(type(cfg)(), f.name)
        out += _non_finite(name, value, default if isinstance(default, float) else None)
    return out


def _non_finite(name: str, value: object, default: float | None) -> list[Problem]:
    if dataclasses.is_dataclass(value):
        return problems(value, f"{name}.")
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _non_finite(f"{name}.{k}", v, None)]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _non_finite(f"{name}[{i}]", v, None)]
    if isinstance(value, float) and not math.isfinite(value):
        example = f", e.g. {name}={default:g}" if default is not None else ""
        return [Problem(name, value, "not a finite number (no bound can judge nan or inf)", f"use a finite number{example}")]
    return []
