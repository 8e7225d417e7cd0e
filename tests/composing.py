"""Hydra's composition for the tests, paid once per set of config-group selections (a helper module, not a test).

A composition is ~0.1 s, most of a config test's time, and the suite composes about a thousand override lists that
differ mostly in `field=value` overrides. Hydra composes the defaults list (the group selections) first, then applies
each such override in order to the struct-mode tree with OmegaConf.update(cfg, key, value, merge=True)
(hydra/_internal/config_loader_impl.py, `_apply_overrides_to_config`). Here the first part is cached and the second
done the same way on a copy; a value the typed tree refuses is composed whole, so that the refusal is Hydra's own,
worded by the runner (runner.config.compose_errors)."""

from __future__ import annotations

import copy
import functools

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.config import compose as runner_compose
from runner.schema import RunConfig

GROUPS = {p.name for p in runner_compose.CONF.iterdir() if p.is_dir()}


@functools.cache
def _whole(overrides: tuple[str, ...], name: str) -> DictConfig:
    """runner.config.compose.compose_dict, once per list that composes (one that fails raises every time)."""
    return runner_compose.compose_dict(list(overrides), name)


def _plain(o: Override) -> bool:
    """A `field=value` override (Hydra's config override): no group selection, prefix, package, sweep or hydra key."""
    key = o.key_or_group
    return (
        o.type == OverrideType.CHANGE
        and o.package is None
        and not o.is_sweep_override()
        and not o.is_hydra_override()
        and ("/" not in key and key not in GROUPS)
    )


def compose_dict(overrides: list[str], name: str = "config") -> DictConfig:
    """What runner.config.compose.compose_dict(overrides, name) gives (or raises), as a tree of the caller's own."""
    plain = [o for o in OverridesParser.create().parse_overrides(list(overrides)) if _plain(o)]
    lines = {o.input_line for o in plain}
    cfg = copy.deepcopy(_whole(tuple(o for o in overrides if o not in lines), name))
    try:
        for o in plain:
            OmegaConf.update(cfg, o.key_or_group, o.value(), merge=True)
    except OmegaConfBaseException:
        return copy.deepcopy(_whole(tuple(overrides), name))
    return cfg


def compose(overrides: list[str], name: str = "config") -> RunConfig:
    """What runner.config.compose.compose(overrides, name) gives (or raises): the typed, schema-checked config."""
    return runner_compose.to_object(compose_dict(overrides, name))
