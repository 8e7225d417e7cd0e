"""Files a user hands over, read through one guarded entry each: a refusal, never a traceback.

A Hugging Face folder (runner.formats.hf_folder), a tokenizer and a prepared folder's manifest (runner.formats.data_manifest),
a frozen run file (runner.config.freeze), a checkpoint's COMPLETE.json (runner.formats.checkpoint) and a machine
profile (runner.estimate.predict.machine) may be empty, cut short, random bytes or JSON of another shape. Their readers
raise UnreadableFile, which names the file, what is wrong and the fix; each caller words it as its own refusal (a
Problem, ManifestError, ExportRefused). Torch-free.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class UnreadableFile(ValueError):
    """A file that is not what it should be: `path`, `why` (a phrase that follows the path: "is empty") and `fix`."""

    def __init__(self, path: str | Path, why: str, fix: str, message: str | None = None):
        self.path, self.why, self.fix = Path(path), why, fix
        super().__init__(message or f"{path} {why}. Fix: {fix}.")


def read_bytes(path: str | Path, fix: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise UnreadableFile(path, f"cannot be read ({e.strerror or e})", fix) from e


def decode(data: bytes, path: str | Path, fix: str) -> str:
    """UTF-8 text, or the refusal of the first byte that is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        why = f"is not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}): random bytes, or another format"
        raise UnreadableFile(path, why, fix) from e


def read_text(path: str | Path, fix: str) -> str:
    return decode(read_bytes(path, fix), path, fix)


def kind(value: object) -> str:
    """A JSON value's kind in JSON's words."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    names = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number"}
    return next((n for t, n in names.items() if isinstance(value, t)), type(value).__name__)


def parse_json(data: bytes | str, path: str | Path, fix: str, expect: type = dict) -> Any:
    """The JSON document `data` (read from `path`), refused when it is empty, not UTF-8, not JSON or not an `expect`."""
    text = decode(data, path, fix) if isinstance(data, bytes) else data
    if not text.strip():
        raise UnreadableFile(path, "is empty", fix)
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        cut = e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated")
        raise UnreadableFile(path, f"is not JSON ({e}){': it was cut short' if cut else ''}", fix) from e
    except RecursionError as e:
        raise UnreadableFile(path, "is not JSON (nested too deeply)", fix) from e
    if not isinstance(body, expect):
        raise UnreadableFile(path, f"holds {kind(body)} where {kind(expect())} is expected", fix)
    return body


def read_json(path: str | Path, fix: str, expect: type = dict) -> Any:
    """The JSON file at `path`: an `expect` (an object unless told), or UnreadableFile."""
    return parse_json(read_bytes(path, fix), path, fix, expect)


def schema_problem(body: object, spec: object, at: str = "") -> str | None:
    """Why `body` does not have the shape of `spec` (nested dicts of types, a list of one spec for a list), naming
    the first key that is missing or of another type; None when it has it."""
    if isinstance(spec, dict):
        if not isinstance(body, dict):
            return f"{at or 'its content'} is {type(body).__name__}, not an object"
        for key, sub in spec.items():
            path = f"{at}.{key}" if at else key
            if key not in body:
                return f"lacks the key '{path}'"
            if why := schema_problem(body[key], sub, path):
                return why
        return None
    if isinstance(spec, list):
        if not isinstance(body, list):
            return f"'{at}' is {type(body).__name__}, not a list"
        return next((why for i, b in enumerate(body) if (why := schema_problem(b, spec[0], f"{at}[{i}]"))), None)
    return None if isinstance(body, spec) else f"'{at}' is {json.dumps(body)[:40]}, not {spec.__name__}"


def wrong(key: str, value: object, want: str) -> str:
    """The `why` of a key whose value is of another kind."""
    shown = json.dumps(value)
    return f"has {key} = {shown if len(shown) <= 40 else shown[:37] + '...'}: {kind(value)} where {want} is expected"
