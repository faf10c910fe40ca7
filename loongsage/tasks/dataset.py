"""Reading and writing data sets: jsonl and parquet with a declared prompt/answer schema.

A malformed row is reported with its file and line (jsonl) or row number (parquet): an error,
or (`bad_rows="skip"`) skipped with a warning that lists every such row, so one bad line in a large
data set costs that line, not the run. A file with no good row is an error either way.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from loongsage.tasks.base import TaskRow


@dataclass(frozen=True)
class DataSchema:
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    tag_key: str | None = "tag"
    tools_key: str | None = "tools"
    default_tag: str = "default"


log = logging.getLogger("loongsage.data")


class DataError(ValueError):
    pass


def write_jsonl(rows: Iterable[TaskRow], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row.to_json()) + "\n")
    tmp.replace(path)
    return path


def load_rows(path: str | Path, schema: DataSchema | None = None,
              bad_rows: Literal["error", "skip"] = "error") -> list[TaskRow]:
    schema = schema or DataSchema()
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if path.suffix == ".jsonl":
        records = ((f"{path}:{line}", rec) for line, rec in _read_jsonl(path))
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        records = ((f"{path}: row {i + 1}", rec) for i, rec in enumerate(pq.read_table(path).to_pylist()))
    else:
        raise DataError(f"{path}: unsupported format {path.suffix!r} (expected .jsonl or .parquet)")
    rows, skipped = [], []
    for where, rec in records:
        try:
            if isinstance(rec, DataError):
                raise rec
            rows.append(_to_row(rec, schema, where))
        except DataError as exc:
            if bad_rows != "skip":
                raise
            skipped.append(str(exc))
    if skipped:
        log.warning("%s: skipped %d malformed rows (task.bad_rows=skip):\n  %s", path, len(skipped),
                    "\n  ".join(skipped[:20]) + (f"\n  ... and {len(skipped) - 20} more" if len(skipped) > 20 else ""))
        if not rows:
            raise DataError(f"{path}: every row is malformed; the first: {skipped[0]}")
    return rows


def _read_jsonl(path: Path):
    """(line number, record or the DataError that line is) for every non-blank line."""
    with open(path, errors="replace") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                rec = DataError(f"{path}:{line_no}: invalid JSON ({exc.msg} at column {exc.colno})")
            if not isinstance(rec, (dict, DataError)):
                rec = DataError(f"{path}:{line_no}: expected a JSON object, got {type(rec).__name__}")
            yield line_no, rec


def field_of(rec: dict[str, Any], key: str, where: str) -> Any:
    """`rec[key]`, where a dotted key reaches into nested records (DAPO-Math: `reward_model.ground_truth`)."""
    value: Any = rec
    for i, part in enumerate(key.split(".")):
        if not isinstance(value, dict) or part not in value:
            seen = sorted(value) if isinstance(value, dict) else type(value).__name__
            at = ".".join(key.split(".")[:i]) or "row"
            raise DataError(f"{where}: missing key {key!r} ({at} has {seen})")
        value = value[part]
    return value


def _to_row(rec: dict[str, Any], schema: DataSchema, where: str) -> TaskRow:
    prompt, answer = field_of(rec, schema.prompt_key, where), field_of(rec, schema.answer_key, where)
    if isinstance(prompt, list):
        if not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
            raise DataError(f"{where}: {schema.prompt_key!r} as a list must hold messages with 'role' and 'content'")
    elif not isinstance(prompt, str) or not prompt:
        raise DataError(f"{where}: {schema.prompt_key!r} must be a non-empty string or a list of messages")
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
        raise DataError(f"{where}: {schema.answer_key!r} must be a string or a number, got {type(answer).__name__}")
    tag = rec.get(schema.tag_key, schema.default_tag) if schema.tag_key else schema.default_tag
    tools = rec.get(schema.tools_key) if schema.tools_key else None
    if tools is not None and not isinstance(tools, list):
        raise DataError(f"{where}: {schema.tools_key!r} must be a list of tool specs")
    skip = {schema.prompt_key.split(".")[0], schema.answer_key.split(".")[0], schema.tag_key, schema.tools_key, "meta"}
    meta = {k: v for k, v in rec.items() if k not in skip}
    if isinstance(rec.get("meta"), dict):
        meta.update(rec["meta"])
    return TaskRow(prompt=prompt, answer=str(answer), tag=str(tag), tools=tools, meta=meta)
