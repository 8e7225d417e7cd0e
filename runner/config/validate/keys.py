"""Keys the schema does not have, however they got into the composed config.

Hydra's `+key=value` (and `++key=value`) appends with `OmegaConf.update(..., force_add=True)`,
which opens the struct flag of a typed node for that one key; `OmegaConf.to_object` then sets
the stray key as an attribute of the dataclass, and nothing reads it. Composition cannot stop
it, so the composed tree is walked once against the dataclasses' own fields. Config-group
additions (`+point=a`) and `hydra.*` keys are not in the task config, so they are untouched.
"""

from __future__ import annotations

import dataclasses
import difflib

from omegaconf import DictConfig, OmegaConf

from runner.schema.problems import Problem

MOVED = {
    "training.lr": "optimizer.lr",
    "training.weight_decay": "optimizer.weight_decay",
    "training.warmup_steps": "lr_scheduler.warmup_steps",
}
"""Fields that moved to another section (where they are now), so an old override is pointed to its new place."""


def suggest(key: str, fields: list[str], prefix: str) -> str:
    moved = {name.removeprefix(prefix): new for name, new in MOVED.items() if name.startswith(prefix)}
    close = difflib.get_close_matches(key, [*fields, *moved], n=3, cutoff=0.5)
    if close:
        names = [moved.get(c, prefix + c) for c in close]
        return f"did you mean {' or '.join(names)}? (the fields here: {', '.join(fields)})"
    return f"remove it; the fields here are {', '.join(fields)}"


def unknown(cfg: DictConfig, prefix: str = "") -> list[Problem]:
    """One Problem per key of a typed (dataclass) node that its dataclass does not declare."""
    out: list[Problem] = []
    kind = OmegaConf.get_type(cfg)
    fields = [f.name for f in dataclasses.fields(kind)] if dataclasses.is_dataclass(kind) else None
    for key in cfg.keys():
        name = f"{prefix}{key}"
        if fields is not None and key not in fields:
            value = OmegaConf.to_container(cfg, resolve=False)[key]
            why = f"not a field of {kind.__name__} (a `+` override adds keys the schema does not have, and nothing reads them)"
            out.append(Problem(name, value, why, suggest(str(key), fields, prefix)))
            continue
        # private_api: omegaconf_get_node, omegaconf_is_none, omegaconf_is_missing
        child = cfg._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            out += unknown(child, f"{name}.")
    return out
