"""One input file's documents as an Arrow file of one string column, `text`, the shape prepare tokenizes (torch-free).

JSON Lines are parsed by pyarrow against a schema that names only the text field: other fields may hold
anything, and a record whose text is null or missing reads as null (prepare skips and counts it). A line that
is not JSON, or whose text is not a string, is refused with its file and line number, found by a Python pass
over the file that runs only after pyarrow failed. A .json file holding one JSON array is read whole (as
datasets does), its records checked the same way. Parquet is read by column; plain text by `datasets`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from runner.schema.problems import ConfigError, Problem

COLUMN = "text"
BLOCK = 16 << 20  # pyarrow's JSON block: a line longer than this is retried with larger blocks
FIX_LINE = "repair or delete that line (each line one JSON object, its text a string or null), or leave the file out of --input"


def _refuse(where: str, why: str, fix: str = FIX_LINE) -> ConfigError:
    return ConfigError([Problem("--input", where, why, fix)])


def _record_problem(rec: object, field: str) -> str | None:
    if not isinstance(rec, dict):
        return f"it is {json.dumps(rec)[:40]}, not a JSON object"
    text = rec.get(field)
    if text is not None and not isinstance(text, str):
        return f"its {field!r} is {json.dumps(text)[:40]}, not a string"
    return None


def _json_error(e: json.JSONDecodeError) -> str:
    return f"not JSON ({e.msg.removesuffix(' at')} at column {e.colno})"


def _bad_line(src: Path, field: str) -> tuple[int, str] | None:
    """The first line of a JSON Lines file that is not a JSON object whose text is a string or null, and why."""
    with open(src, "rb") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line.rstrip(b"\r\n"))
            except UnicodeDecodeError as e:
                return n, f"not UTF-8 ({e.reason} at byte {e.start})"
            except json.JSONDecodeError as e:
                cut = "; the file ends inside this line: it was cut short" if not line.endswith(b"\n") else ""
                return n, _json_error(e) + cut
            if why := _record_problem(rec, field):
                return n, why
    return None


def _json_lines(src: Path, field: str, block: int = BLOCK) -> Iterator:
    import pyarrow as pa
    import pyarrow.json as paj

    schema = pa.schema([(field, pa.string())])
    opts = paj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    try:
        for batch in paj.open_json(src, read_options=paj.ReadOptions(block_size=block), parse_options=opts):
            batch.validate(full=True)  # pyarrow's JSON parser lets invalid UTF-8 through; full validation does not
            yield batch
    except pa.ArrowInvalid as e:
        if "straddl" in str(e) and block < src.stat().st_size:
            raise _Straddle from e
        if bad := _bad_line(src, field):
            raise _refuse(f"{src}:{bad[0]}", bad[1]) from None
        raise _refuse(str(src), f"pyarrow cannot read it as JSON Lines ({e})", "give one JSON object per line") from None


class _Straddle(Exception):
    """A line longer than pyarrow's block: read again with larger blocks."""


def _json_array(src: Path, field: str) -> Iterator:
    import pyarrow as pa

    try:
        records = json.loads(src.read_bytes())
    except UnicodeDecodeError as e:
        raise _refuse(str(src), f"not UTF-8 ({e.reason} at byte {e.start})", "re-encode the file as UTF-8") from None
    except json.JSONDecodeError as e:
        raise _refuse(f"{src}:{e.lineno}", _json_error(e), "repair the file, or write it as JSON Lines (one object per line)") from None
    for i, rec in enumerate(records):
        if why := _record_problem(rec, field):
            raise _refuse(f"{src}, record {i + 1}", why, "make it an object whose text is a string or null")
    yield pa.record_batch([pa.array([r.get(field) for r in records], type=pa.string())], names=[field])


def _parquet(src: Path, field: str) -> Iterator:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(src)
    kind = pf.schema_arrow.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise _refuse(str(src), f"its column {field!r} holds {kind}, not strings", "point --text-field at the column holding the documents")
    start = 0
    for batch in pf.iter_batches(columns=[field]):
        try:
            batch.validate(full=True)
        except pa.ArrowInvalid:
            raise _refuse(f"{src}, records {start + 1}-{start + len(batch)}", f"its column {field!r} holds text that is not UTF-8",
                          "re-encode that text as UTF-8, or leave the file out of --input") from None  # fmt: skip
        start += len(batch)
        yield batch


def _text(src: Path, cache: Path):
    from datasets import load_dataset

    try:
        return load_dataset("text", data_files=[str(src.resolve())], split="train", cache_dir=str(cache))
    except Exception:  # datasets wraps the reader's error (DatasetGenerationError)
        with open(src, "rb") as fh:
            for n, line in enumerate(fh, 1):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise _refuse(f"{src}:{n}", f"not UTF-8 ({e.reason} at byte {e.start})", "re-encode the file as UTF-8") from None
        raise


def _write(batches: Iterator, path: Path) -> None:
    import pyarrow as pa
    from datasets import Features, Value
    from datasets.arrow_writer import ArrowWriter

    with ArrowWriter(features=Features({COLUMN: Value("string")}), path=str(path)) as w:
        for b in batches:
            w.write_table(pa.Table.from_batches([b]).rename_columns([COLUMN]))
        w.finalize()


def _starts_an_array(src: Path) -> bool:
    with open(src, "rb") as fh:
        while chunk := fh.read(1 << 16):
            if head := chunk.lstrip():
                return head.startswith(b"[")
    return False


def texts(src: Path, fmt: str, field: str, cache: Path):
    """The file's documents (a `datasets.Dataset` of one column, COLUMN; null where a record has no text)."""
    from datasets import Dataset

    cache.mkdir(parents=True, exist_ok=True)
    if fmt == "text":
        return _text(src, cache)
    path = cache / "texts.arrow"
    if fmt == "parquet":
        _write(_parquet(src, field), path)
    elif _starts_an_array(src):
        _write(_json_array(src, field), path)
    else:
        block = BLOCK
        while True:
            try:
                _write(_json_lines(src, field, block), path)
                break
            except _Straddle:
                block *= 8
    return Dataset.from_file(str(path))
