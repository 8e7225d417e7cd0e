"""Composition failures worded for the user: a value of the wrong type as a Problem (field, value, the type the
schema expects and an example), a YAML syntax error as `file:line:column: what` on its first line.

Hydra prints the first as OmegaConf's own text ("Value '[1, 2]' of type 'list' could not be converted to Float")
and the second as its traceback; `python -m runner` and runner.config.compose both word them here.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import types
import typing

import yaml
from omegaconf.errors import ValidationError

from runner.config.problems import Problem
from runner.config.schema import RunConfig

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


def problem(e: BaseException) -> Problem | None:
    """The Problem of a value OmegaConf refused for its schema type (a wrong type or enum name), anywhere in `e`'s chain."""
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
