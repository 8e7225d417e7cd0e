"""Overrides in, a typed and schema-checked RunConfig out: the one way, for `python -m runner`,
`python -m runner.calibrate`, the tests and the benches, and the one place that knows where `conf/` is.

Hydra composes on top of the `base_config` schema (ConfigStore), so every group option merges into a typed
node and a wrong type or enum fails at composition (a Problem: runner.config.compose_errors). Keys added with `+`
slip past the typed nodes; `to_object` refuses them (runner.config.validate.keys), so `+training.lr_warmup=100`
fails the same way everywhere, and it refuses a nan or inf in any float (runner.config.validate.finite), which no
rule's bound can judge.
"""

from __future__ import annotations

import functools
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from runner.config import compose_errors, slurm
from runner.schema import RunConfig
from runner.schema import register as register_schema
from runner.schema.problems import ConfigError

CONF = Path(__file__).resolve().parents[2] / "conf"
"""The config groups (`conf/<group>/<option>.yaml`); `conf/recipe` and `conf/sweep` link to `recipes/` and `sweeps/`."""


@functools.cache  # once per process: a test session or a bench composes hundreds of configs
def register() -> None:
    """The schema in Hydra's ConfigStore and the resolvers the cluster files use."""
    register_schema()
    slurm.register_resolvers()


def to_object(cfg: DictConfig) -> RunConfig:
    """The typed config with every schema check applied (unknown keys, wrong types, enums, non-finite numbers).

    Re-merging the composed tree into a fresh structured RunConfig cost ~0.3 s per plan; the tree is
    already typed, so only a primary config that does not start from base_config is merged."""
    import runner.config.validate.finite as finite  # here, not above: validate's rules import this module for CONF
    import runner.config.validate.keys as keys

    if OmegaConf.get_type(cfg) is not RunConfig:
        cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {k: v for k, v in cfg.items() if k != "defaults"})
    stray = keys.unknown(cfg)
    if stray:
        raise ConfigError(stray)
    typed = OmegaConf.to_object(cfg)
    bad = finite.problems(typed)
    if bad:
        raise ConfigError(bad)
    return typed


def compose_dict(overrides: list[str], name: str = "config") -> DictConfig:
    """Hydra's composition of `name` with `overrides`, as the command line would compose it (no Hydra app running)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import ConfigCompositionException

    register()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        try:
            return hydra_compose(config_name=name, overrides=list(overrides))
        except ConfigCompositionException as e:  # worded as every other problem (runner.config.compose_errors)
            p = compose_errors.problem(e, list(overrides), compose_errors.search_dirs(list(overrides), CONF))
            if p is None:
                raise
            raise ConfigError([p]) from e


def compose(overrides: list[str], name: str = "config") -> RunConfig:
    """The typed config `python -m runner <overrides>` would run (before validation's rules)."""
    return to_object(compose_dict(overrides, name))
