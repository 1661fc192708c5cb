"""Where a JSON / JSONL record lives in the user's files, and what a value is, for error messages only: the first line
`datasets` could not parse, the first record whose text column is not a string, and the file and line of the n-th
record. Never on the happy path:
the files are read again here only after something failed (but for the look at each file's first
record that first_record_is_null and first_line_record take).

A file whose first character is `[` holds one JSON array of records (as `datasets` reads a .json
file); any other holds one record per non-blank line (blank lines are skipped, as `datasets` does).
"""

from __future__ import annotations

import json
import re
from typing import Iterator

from MaxText import json_text
from MaxText.input_pipeline.files import open_plain, read_plain


def starts_with_array(path: str) -> bool:
  with open_plain(path) as f:
    for line in f:
      stripped = line.removeprefix(b"\xef\xbb\xbf").strip()
      if stripped:
        return stripped.startswith(b"[")
  return False


_LEADING_NULL = re.compile(rb"\[?\s*null(?![A-Za-z0-9_])")


def first_record_is_null(path: str) -> bool:
  """Whether the first record of `path` (its first value, or its array's first element) is a JSON null;
  reads only the whitespace before it and a few bytes more."""
  head = b""
  with open_plain(path) as f:
    while chunk := f.read(1 << 12):
      head = (head + chunk).removeprefix(b"\xef\xbb\xbf").lstrip()
      if head.startswith(b"["):
        head = b"[" + head[1:].lstrip()
      if len(head) >= 6:  # "[null," decides it
        break
  return _LEADING_NULL.match(head) is not None


def _lines(path: str) -> Iterator[tuple[int, bytes]]:
  """(1-based line number, line) of every non-blank line."""
  with open_plain(path) as f:
    for number, line in enumerate(f, 1):
      if line.strip():
        yield number, line


def json_kind(value: object) -> str:
  """'null', 'a JSON number', ...: what a value that should have been text is, for error messages."""
  if value is None:
    return "null"
  kinds = {bool: "boolean", int: "number", float: "number", list: "array", tuple: "array", dict: "object"}
  return "a JSON " + next((name for kind, name in kinds.items() if isinstance(value, kind)), type(value).__name__)


def first_line_record(path: str) -> tuple[int, object] | None:
  """(line number, value) of the first record of a JSON-lines file; None for a file of one array, one with no
  records, or a first line that is not JSON (named where datasets fails on it)."""
  if starts_with_array(path):
    return None
  for number, line in _lines(path):
    try:
      return number, json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
      return None
  return None


def first_not_text(path: str, column: str) -> str | None:
  """'line N: column 'c' is a JSON number, not text' (or 'record N of its array: ...') for the first record of `path`
  whose `column` holds a value that is neither a string nor null (null is named where it is read, with a missing
  column), or None. Reads a JSON-lines file a line at a time; for error messages only."""
  if starts_with_array(path):
    try:
      records = json.loads(read_plain(path))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
      return None  # named by first_problem
    numbered: Iterator[tuple[str, object]] = ((f"record {i} of its array", r) for i, r in enumerate(records, 1))
  else:
    numbered = ((f"line {n}", _loaded(line)) for n, line in _lines(path))
  for where, record in numbered:
    if isinstance(record, dict) and record.get(column) is not None and not isinstance(record[column], str):
      return f"{where}: column {column!r} is {json_kind(record[column])}, not text"
  return None


def _loaded(line: bytes) -> object:
  try:
    return json.loads(line)
  except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
    return None  # not a record: named by first_problem


def first_problem(path: str) -> str | None:
  """'line N: what is wrong' for the first line of `path` that is not a JSON object, or None."""
  if starts_with_array(path):
    data = read_plain(path)
    try:
      records = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
      return "is " + _describe(e)
    bad = next((i for i, r in enumerate(records) if not isinstance(r, dict)), None)
    if bad is None and b"\\u" in data:
      bad = next((i for i, r in enumerate(records) if json_text.has_unpaired_surrogate(r)), None)
      return None if bad is None else f"record {bad + 1} of its array {json_text.UNPAIRED_SURROGATE}"
    return None if bad is None else f"record {bad + 1} of its array is a JSON {_kind(records[bad])}, not an object"
  for number, line in _lines(path):
    try:
      record = json.loads(line.rstrip())  # the newline would move the error to line 2
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
      return f"line {number}: {_describe(e, on_line=True)}"
    if not isinstance(record, dict):
      return f"line {number}: a JSON {_kind(record)}, not an object (one record per line)"
    # pyarrow refuses an unpaired surrogate escape that Python's json takes
    if b"\\u" in line and json_text.has_unpaired_surrogate(record):
      return f"line {number}: {json_text.UNPAIRED_SURROGATE}"
  return None


def locate(paths: list[str], index: int) -> str | None:
  """'<file> line N' (or 'record N of <file>') of the record at 0-based `index` of the files read
  in order, or None when the files do not hold that many records."""
  for path in paths:
    if starts_with_array(path):
      count = len(json.loads(read_plain(path)))
      if index < count:
        return f"record {index + 1} of {path}"
      index -= count
      continue
    for number, _ in _lines(path):
      if index == 0:
        return f"{path} line {number}"
      index -= 1
  return None


def _describe(error: Exception, on_line: bool = False) -> str:
  if isinstance(error, UnicodeDecodeError):
    return f"not UTF-8 text (byte {error.start + 1})"
  if isinstance(error, RecursionError):
    return "not readable JSON (nested deeper than JSON can be read)"
  assert isinstance(error, json.JSONDecodeError)
  where = f"column {error.colno}" if on_line else f"line {error.lineno}, column {error.colno}"
  # some of json's messages end in "at" themselves ("Invalid control character at")
  return f"not valid JSON ({error.msg.removesuffix(' at')} at {where})"


def _kind(value: object) -> str:
  return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")
