"""A multirun over points that differ in more than one field at a time (single, FSDP on 4 ranks, a
pipeline, TP 2 ...): Hydra sweeps the cartesian product of its overrides, so each point's overrides
become one option of a `point` config group (Hydra's experiment pattern), and one multirun trains them
all, torch imported once: `python -m runner -m --config-dir <folder> +point=<name>,<name>,...`."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from runner.config.compose import CONF


def write(points: dict[str, list[str]], folder: Path, common: list[str] = ()) -> list[str]:
    """Each point's overrides, after `common`, as folder/point/<name>.yaml (a config-group choice such as
    parallelism=tp2 as a defaults-list override, the rest as values); the names, in order. Overrides every
    point shares belong in `common` unless no point sets them: on the command line they would win over a
    point's own value."""
    groups = {p.name for p in CONF.iterdir() if p.is_dir()}
    (folder / "point").mkdir(parents=True, exist_ok=True)
    for name, overrides in points.items():
        both = [*common, *overrides]
        chosen = dict(o.split("=", 1) for o in both if o.split("=", 1)[0] in groups)
        values = [o for o in both if o.split("=", 1)[0] not in groups]
        body = {"defaults": [{f"override /{g}": v} for g, v in chosen.items()], **OmegaConf.to_container(OmegaConf.from_dotlist(values))}
        (folder / "point" / f"{name}.yaml").write_text("# @package _global_\n" + OmegaConf.to_yaml(body))
    return list(points)


def argv(names: list[str], folder: Path) -> list[str]:
    """The arguments after `python -m runner -m`, before any other override (argparse reads --config-dir only
    there), that train the points `names` in that order."""
    return ["--config-dir", str(folder), f"+point={','.join(names)}"]
