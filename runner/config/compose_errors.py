"""Composition failures worded for the user: a value of the wrong type as a Problem (field, value, the type the
schema expects and an example), a YAML syntax error as `file:line:column: what` on its first line.

Hydra prints the first as OmegaConf's own text ("Value '[1, 2]' of type 'list' could not be converted to Float")
and the second as its traceback; `python -m runner` and runner.config.compose both word them here.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
import re
import types
import typing
from pathlib import Path

import yaml
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from runner.schema import RunConfig
from runner.schema.problems import Problem

_YAML_FIXES = (
    ("'\\t'", "indent with spaces: YAML does not allow a tab there"),
    ("duplicate key", "keep one of the two keys (the mapping starts at the line named in the parentheses)"),
    ("end of stream", "the file ends inside a value, as a file cut short does: restore the whole file"),
)


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def yaml_message(e: BaseException) -> str | None:
    """`file:line:column: problem (context)` and a fix, for a YAML syntax error anywhere in `e`'s chain."""
    err = next((x for x in _chain(e) if isinstance(x, yaml.MarkedYAMLError) and x.problem_mark is not None), None)
    if err is None:
        return None
    m, c = err.problem_mark, err.context_mark
    context = f" ({err.context}{f' at line {c.line + 1}' if c is not None and c.name == m.name else ''})" if err.context else ""
    fix = next((f for key, f in _YAML_FIXES if key in str(err.problem)), "correct the YAML at that line and column")
    return f"{m.name}:{m.line + 1}:{m.column + 1}: {err.problem}{context}\nFix: {fix}."


def problem(e: BaseException, overrides: list[str] = (), dirs: list[Path] = ()) -> Problem | None:
    """The Problem of what Hydra refused while composing, anywhere in `e`'s chain: a value of the wrong type or enum
    name, a key the schema lacks (given without `+`, on the command line or in a config file), a config group option
    that does not exist. `overrides` (the command line's) and `dirs` (the config search path's folders) name the
    override or the file that asked for it."""
    from hydra.errors import MissingConfigException

    missing = next((x for x in _chain(e) if isinstance(x, MissingConfigException)), None)
    if missing is not None:
        return _missing_option(missing, list(overrides), list(dirs))
    if isinstance(_key_error(e), ConfigKeyError | ConfigAttributeError):
        return _unknown_key(e, list(overrides), list(dirs))
    return _wrong_type(e)


def _key_error(e: BaseException):
    return next((x for x in _chain(e) if isinstance(x, ConfigKeyError | ConfigAttributeError) and x.full_key), None)


def _wrong_type(e: BaseException) -> Problem | None:
    err = next((x for x in _chain(e) if isinstance(x, ValidationError) and x.full_key), None)
    if err is None:
        return None
    key = _schema_key(str(err.full_key), str(e))
    hint = _hint(key)
    if hint is None:
        return None
    where = re.match(r"Error merging override (\S+)|In '([^']+)'", str(e))
    source = f" (override {where[1]})" if where and where[1] else f" (in config '{where[2]}')" if where else ""
    item = _list_item(key, str(e), err.value)
    if item is not None:
        return Problem(item[0], err.value, f"not {_phrase(hint)}{source}", f"use {_phrase(hint)}, e.g. {item[1]}")
    return Problem(key, err.value, f"not {_phrase(hint)}{source}", f"use {_phrase(hint)}, e.g. {_example(key.split('[')[0])}")


def _list_item(key: str, message: str, value) -> tuple[str, str] | None:
    """(`optimizer.param_groups[1].weight_decay`, the whole override with that value replaced by an example) for a
    field of a list item given on the command line (`optimizer.param_groups=[{...},{...}]`), whose item OmegaConf's
    error does not name; None for anything else."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    override = re.match(r"Error merging override (([^=\s]+)=.*)", message)
    parent, _, name = key.rpartition(".")
    if override is None or override[2] != parent or typing.get_origin(_hint(parent)) is not list:
        return None
    items = OverridesParser.create().parse_override(override[1]).value()
    index = next((i for i, x in enumerate(items) if isinstance(x, dict) and name in x and str(x[name]) == str(value)), None)
    if index is None:
        return None
    example = _example(key).rpartition("=")[2]
    fixed = [dict(x, **{name: example}) if i == index else x for i, x in enumerate(items)]
    body = ",".join("{" + ",".join(f"{k}:{_quoted(v)}" for k, v in x.items()) + "}" for x in fixed)
    return f"{parent}[{index}].{name}", f"{parent}=[{body}]"


def _quoted(v) -> str:
    return f"'{v}'" if isinstance(v, str) and not re.fullmatch(r"[\w.\-]+", v) else _render(v)


def _schema_key(full_key: str, message: str) -> str:
    """The field's path from the top of the config: OmegaConf names a field inside a list of mappings by its own key
    alone (`weight` for `data.mix=[{weight: x}]`), so such a key is put under the override's."""
    override = re.match(r"Error merging override ([^=\s]+)=", message)
    if _hint(full_key) is None and override:
        return f"{override[1]}.{full_key}"
    return full_key


def _parts(key: str) -> list[str]:
    return [p for p in re.split(r"\.|\[\d+\]", key) if p]


def _args(hint) -> tuple:
    """(X,) for `X | None`; the arguments of list[X] and dict[K, V]; () for anything else."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return tuple(a for a in typing.get_args(hint) if a is not type(None))
    return typing.get_args(hint)


def _hint(key: str):
    """The schema's type of `key`, or None when the schema has no such field: a list's index or its items' field
    steps into the item type, a mapping's key into the value type."""
    hint = RunConfig
    for part in _parts(key):
        hint = _args(hint)[0] if _optional(hint) else hint
        if typing.get_origin(hint) is dict:
            hint = _args(hint)[1]
            continue
        hint = _args(hint)[0] if typing.get_origin(hint) is list else hint
        if not dataclasses.is_dataclass(hint) or part not in typing.get_type_hints(hint):
            return None
        hint = typing.get_type_hints(hint)[part]
    return _args(hint)[0] if key.endswith("]") else hint


def _optional(hint) -> bool:
    return (isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union) and type(None) in typing.get_args(hint)


_NOUNS = {int: ("an integer", "integers"), float: ("a number", "numbers"), bool: ("true or false", "true/false values")}


def _phrase(hint, plural: bool = False) -> str:
    """What the schema's type asks for, in words: "an integer", "a list of strings", "one of float32, bfloat16"."""
    if _optional(hint):
        return f"{_phrase(_args(hint)[0], plural)} or null"
    if typing.get_origin(hint) is list:
        return f"a list of {_phrase(_args(hint)[0], True)}"
    if typing.get_origin(hint) is dict:
        return f"a mapping of names to {_phrase(_args(hint)[1], True)}"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return f"{'names' if plural else 'one'} of {', '.join(m.name for m in hint)}"
    if dataclasses.is_dataclass(hint):
        return f"{hint.__name__} mappings" if plural else f"a mapping of the fields of {hint.__name__}"
    return _NOUNS.get(hint, ("a string", "strings"))[plural]


_SAMPLES = {int: "1", float: "1.0", bool: "true", str: "name"}


def _example(key: str) -> str:
    """`key=value` with the schema default of `key`, or a sample of its type where the default is empty; for a
    group of fields, its first field."""
    parent, _, name = key.rpartition(".")
    kind, hint = _hint(parent) if parent else RunConfig, _hint(key)
    kind = _args(kind)[0] if typing.get_origin(kind) is list else kind  # a field of a list's items
    if dataclasses.is_dataclass(hint):
        return _example(f"{key}.{dataclasses.fields(hint)[0].name}")
    return f"{key}={_value(kind, name, hint)}"


def _value(kind, name: str, hint) -> str:
    default = getattr(kind(), name) if dataclasses.is_dataclass(kind) else None
    return _render(default) if default not in (None, "", [], {}) else _sample(hint)


def _sample(hint) -> str:
    if _optional(hint):
        return _sample(_args(hint)[0])
    if typing.get_origin(hint) is list:
        return f"[{_sample(_args(hint)[0])}]"
    if typing.get_origin(hint) is dict:
        return f"{{name: {_sample(_args(hint)[1])}}}"
    if dataclasses.is_dataclass(hint):
        first = dataclasses.fields(hint)[0].name
        return f"{{{first}: {_value(hint, first, typing.get_type_hints(hint)[first])}}}"
    return _SAMPLES.get(hint, "name")


def _render(value) -> str:
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return f"[{','.join(_render(v) for v in value)}]"
    return str(value)


# ---- a key the schema lacks; a group option that does not exist (Hydra's own errors, with its traceback hint) ----


def search_dirs(overrides: list[str], conf: Path, config_dir: str | None = None) -> list[Path]:
    """The folders of the config search path, first match first: `--config-dir`, then conf/, then `hydra.searchpath`'s
    `file://` entries (Hydra's own order: the command line's folder ahead of the app's)."""
    dirs = [Path(config_dir)] if config_dir else []
    asked = _override(overrides, "hydra.searchpath")
    extra = [Path(str(v).removeprefix("file://")) for v in asked[1]] if asked and isinstance(asked[1], list) else []
    return [*dirs, conf, *(d for d in extra if d.is_dir())]


def _override(overrides: list[str], key: str) -> tuple[str, object] | None:
    """(text, parsed value) of the command-line override of `key` (with or without `+`, `++`, `~`), or None."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for text in overrides:
        try:
            o = parser.parse_override(text)
        except Exception:  # noqa: BLE001 - an override Hydra itself rejects is not the one that asked
            continue
        if o.key_or_group == key or o.get_key_element().endswith(f"/{key}"):
            return text, o.value()
    return None


def _config_file(name: str, dirs: list[Path]) -> Path | None:
    """The file of config `name` (`recipe/mine`) in the first folder of the search path that has it."""
    return next((d / f"{name}.yaml" for d in dirs if (d / f"{name}.yaml").is_file()), None)


def _asking_files(group: str, option: str, dirs: list[Path]) -> list[Path]:
    """Config files whose defaults list picks `option` of `group` (`- override /model: x`, `- /model: x`, `- model: x`)."""
    line = re.compile(rf"^\s*-\s*(override\s+)?/?{re.escape(group)}\s*:\s*['\"]?{re.escape(option)}['\"]?\s*(#.*)?$", re.M)
    files = [Path(root) / f for d in dirs for root, _, names in os.walk(d, followlinks=True) for f in names if f.endswith(".yaml")]
    return [p for p in sorted(files) if line.search(p.read_text(errors="replace"))]  # followlinks: conf/recipe -> recipes/


def _missing_option(err, overrides: list[str], dirs: list[Path]) -> Problem | None:
    group, _, option = (err.missing_cfg_file or "").rpartition("/")
    if not group:
        return None  # the primary config itself (--config-name): Hydra's message names it
    asked = _override(overrides, group)
    options = list(err.options or [])
    close = difflib.get_close_matches(option, options, n=3, cutoff=0.5)
    if asked is not None and str(asked[1]) == option:
        source, use = f"override {asked[0]}", f"{group}={{}}"
    else:
        files = _asking_files(group, option, dirs)
        source = f"asked by {', '.join(map(str, files))}" if files else "asked by a config file's defaults list"
        use = f"`- override /{group}: {{}}` in {'that file' if len(files) == 1 else 'the file'}"
    listed = f"the options: {', '.join(options)}" if len(options) <= 12 else f"`python -m runner --help` lists the {len(options)} options"
    if close:
        fix = f"use {use.format(close[0])} (the closest{'; also ' + ', '.join(close[1:]) if close[1:] else ''}); {listed}"
    else:
        fix = f"use {use.format('<option>')}; {listed}"
    return Problem(group, option, f"not an option of the {group} group ({source})", fix)


def _unknown_key(e: BaseException, overrides: list[str], dirs: list[Path]) -> Problem | None:
    """A key a schema dataclass lacks, set without `+` on the command line or by a config file (`training.stepz`, a
    param group's `weight_decy`): named from the top of the config, the override or file, the closest fields."""
    import runner.config.validate.keys as keys

    err = _key_error(e)
    kind, key = err.object_type, str(err.key)
    if not dataclasses.is_dataclass(kind):
        return None
    fields = [f.name for f in dataclasses.fields(kind)]
    cli = re.match(r"Could not override '([^']+)'", str(e))
    in_file = re.match(r"In '([^']+)'", str(e))
    full = str(err.full_key)
    prefix = full[: -len(key)] if full.endswith(key) else ""
    why = f"not a field of {kind.__name__}"
    if cli:
        asked = _override(overrides, cli[1])
        text, value = asked if asked else (cli[1], "?")
        if isinstance(value, list) and typing.get_origin(_hint(cli[1])) is list:  # a field of a list's item
            return _unknown_item_key(cli[1], text, value, key, fields, why)
        return Problem(full, _leaf(value, full, cli[1]), f"{why} (override {text})", keys.suggest(key, fields, prefix))
    path = _config_file(in_file[1], dirs) if in_file else None
    where = f" (in {in_file[1]}{f': {path}' if path else ''})" if in_file else ""
    return Problem(full, _file_value(path, full), f"{why}{where}", keys.suggest(key, fields, prefix))


def _leaf(value, full: str, key: str):
    """The value of `full` inside the override of `key` (the whole override's value when it set `full` itself)."""
    for part in full.removeprefix(key).strip(".").split(".") if full != key else []:
        value = value.get(part, "?") if isinstance(value, dict) else "?"
    return value


def _unknown_item_key(parent: str, text: str, items: list, key: str, fields: list[str], why: str) -> Problem:
    index = next((i for i, x in enumerate(items) if isinstance(x, dict) and key in x), 0)
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.5)
    fix = f"the fields of an item are {', '.join(fields)}"
    if close:
        renamed = [{(close[0] if k == key and i == index else k): v for k, v in x.items()} for i, x in enumerate(items)]
        body = ",".join("{" + ",".join(f"{k}:{_quoted(v)}" for k, v in x.items()) + "}" for x in renamed)
        fix = f"did you mean {close[0]}? {parent}=[{body}] ({fix})"
    return Problem(f"{parent}[{index}].{key}", items[index][key], f"{why} (override {text})", fix)


def _file_value(path: Path | None, full: str):
    """The value a config file gives `full` (a `# @package _global_` file's keys are the config's), or "?"."""
    try:
        value = yaml.safe_load(path.read_text()) if path else None
    except yaml.YAMLError:
        return "?"
    for part in full.split("."):
        value = value.get(part, "?") if isinstance(value, dict) else "?"
    return value
