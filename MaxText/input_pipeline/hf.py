"""Hugging Face `datasets`: parquet/json/text/csv files (local or gs://), a saved dataset directory
(local or gs://), or a hub dataset already in the local cache. Never downloads from the hub: the
library is forced offline, and lifted only while it reads the user's own gs:// data files."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
from typing import Any, Callable, Iterator

from MaxText.paths import storage
from MaxText.errors import ConfigError, quiet_logger
from MaxText.input_pipeline import files as data_files_lib
from MaxText.input_pipeline import json_records
from MaxText.input_pipeline.files import expand_files

_BUILDER_BY_SUFFIX = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv",
                      ".arrow": "arrow"}


def _offline_datasets() -> Any:
  # Set before the first import of `datasets` (it reads them then); assigned again after, in case
  # something imported it earlier.
  os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  import datasets

  datasets.config.HF_DATASETS_OFFLINE = True
  datasets.config.HF_HUB_OFFLINE = True
  datasets.disable_progress_bars()
  return datasets


@contextlib.contextmanager
def _remote_files_allowed(datasets: Any, builder: str, files: list[str]) -> Iterator[None]:
  """Offline mode also blocks fsspec URLs; lift it while a packaged builder (which never looks at
  the hub) reads gs:// files. datasets keys its cache by their etags, so later runs reuse it."""
  if builder not in _BUILDER_BY_SUFFIX.values() or not any(storage.is_remote(f) for f in files):
    yield
    return
  saved = datasets.config.HF_DATASETS_OFFLINE, datasets.config.HF_HUB_OFFLINE
  datasets.config.HF_DATASETS_OFFLINE = datasets.config.HF_HUB_OFFLINE = False
  try:
    yield
  finally:
    datasets.config.HF_DATASETS_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


@contextlib.contextmanager
def _quiet_loaders() -> Iterator[None]:
  """datasets' file builders log a parse failure (twice, through their own handler and the root's)
  before raising it; the raised error becomes the one line that names the file."""
  with contextlib.ExitStack() as stack:
    for builder in ("json", "parquet", "csv"):
      stack.enter_context(quiet_logger(f"datasets.packaged_modules.{builder}.{builder}", logging.CRITICAL))
    yield


def _blank(path: str) -> bool:
  """Whether a file holds nothing but whitespace (and a byte order mark)."""
  with data_files_lib.open_plain(path) as f:
    first = True
    while chunk := f.read(1 << 16):
      if (chunk.removeprefix(b"\xef\xbb\xbf") if first else chunk).strip():
        return False
      first = False
  return True


def _no_records(path: str, builder: str) -> bool:
  """Whether a file holds no records: nothing but whitespace, a JSON file's empty array `[]`, or a
  parquet file of no rows (datasets fails on each in its own way)."""
  if builder == "parquet":
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
      with storage.open_file(path, "rb") as f:
        return pq.read_metadata(f).num_rows == 0
    except (pa.ArrowException, OSError):
      return False  # not readable: _bad_parquet names it
  if _blank(path):
    return True
  if builder != "json":
    return False
  with data_files_lib.open_plain(path) as f:
    head = f.read(1 << 16)
  return re.fullmatch(rb"(\xef\xbb\xbf)?\s*\[\s*\]\s*", head) is not None


def _cache_dir(datasets: Any, files: list[str]) -> str | None:
  """datasets keys its cache of local files by path and mtime only: a file rewritten with its mtime kept (rsync -a,
  cp -p, tar, os.utime), whatever its new size, was read from the old table. The cache of local files goes under a
  key of their content (size, first and last 64 KiB; files.content_key) too. gs:// files are keyed by their etag."""
  local = [f for f in files if not storage.is_remote(f)]
  if not local:
    return None
  key = hashlib.sha256("\n".join(f"{storage.resolve(f)} {data_files_lib.content_key(f)}" for f in local).encode())
  return storage.join(str(datasets.config.HF_DATASETS_CACHE), "maxtext-local", key.hexdigest()[:24])


def _refuse_a_leading_null(files_key: str, files: list[str]) -> None:
  """pyarrow's JSON reader (under datasets) ends the process with a segmentation fault when the first
  value it reads is null: a file whose first record is `null` is refused before datasets opens it."""
  for path in files:
    if json_records.first_record_is_null(path):
      problem = json_records.first_problem(path) or "starts with a JSON null, not an object"
      raise ConfigError(f"{files_key}: {path} {problem}; fix or remove that record")


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_lone_surrogates_in_arrays(files_key: str, files: list[str]) -> None:
  """datasets reads a file of one JSON array with a parser that drops an unpaired surrogate escape
  ("a \\ud800 b" becomes "a  b") where the JSON-lines reader refuses it: such a record is named
  first. Called only when datasets is about to parse the files (whole, as it does these); only those
  holding a surrogate escape are parsed here."""
  for path in files:
    if not json_records.starts_with_array(path):
      continue
    if _SURROGATE_ESCAPE.search(data_files_lib.read_plain(path)) is None:
      continue
    problem = json_records.first_problem(path)
    if problem is not None:
      raise ConfigError(f"{files_key}: {path} {problem}; fix or remove that record")


def _refuse_a_text_column_not_text(files_key: str, files: list[str], builder: str, column: str) -> None:
  """datasets types the table by the first file's first chunk and casts the rest to it: a text column of numbers
  (booleans, objects) in a file read after string ones trained as their spelling ("1"); read before them it was a
  cast error. A parquet file's type is read from its footer, a JSON-lines file's from its first record (a later
  record's is refused when it is read, unless datasets cast it: in a 10 MB chunk after the first)."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  for path in files:
    if builder == "parquet":
      try:
        with storage.open_file(path, "rb") as f:
          schema = pq.read_schema(f)
      except (pa.ArrowException, OSError):
        continue  # not readable: named when datasets fails on it
      kind = schema.field(column).type if column in schema.names else None
      if kind is not None and not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)
                                   or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):
        raise ConfigError(f"{files_key}: {path}: column {column!r} is {kind} in this parquet file, not text (string); "
                          f"store it as strings, or name the text column in train_data_columns")
    elif builder == "json":
      first = json_records.first_line_record(path)
      if first is not None and isinstance(first[1], dict) and first[1].get(column) is not None \
          and not isinstance(first[1][column], str):
        kind = json_records.json_kind(first[1][column])
        raise ConfigError(f"{files_key}: {path} line {first[0]}: column {column!r} is {kind}, not text; fix or remove "
                          "that record")


class _NotText(Exception):
  """Raised inside datasets' JSON builder when a chunk's text column is not strings; named by file and line after."""


def _text_type(kind: Any) -> bool:
  import pyarrow as pa

  return any(test(kind) for test in (pa.types.is_string, pa.types.is_large_string, pa.types.is_null,
                                     pa.types.is_binary, pa.types.is_large_binary))


def _watch_the_text_column(loader: Any, column: str) -> None:
  """datasets types a JSON column by the first 10 MB chunk and casts every later chunk to it: a number (array,
  object) further on trained as its spelling, and a chunk mixing them had every string of it JSON-quoted ('"a"').
  Each chunk's table is looked at before that cast (on this builder only): a text column of another type, or one
  datasets JSON-encoded for mixing types, stops the load, and the record is found afterwards."""
  cast = getattr(loader, "_cast_table", None)
  if cast is None:  # another datasets: the features are still checked after loading
    return

  def checked(table: Any, json_field_paths: Any = (), *args: Any, **kwargs: Any) -> Any:
    features = loader.info.features
    declared = features.arrow_schema.field(column).type if features is not None and column in features else None
    if (column in table.column_names and not _text_type(table.schema.field(column).type)) \
        or any(list(path)[:1] == [column] for path in json_field_paths or ()) \
        or (declared is not None and not _text_type(declared)):
      raise _NotText(column)
    return cast(table, json_field_paths, *args, **kwargs)

  loader._cast_table = checked


def _not_text_line(files_key: str, data_files: str, files: list[str], column: str) -> str:
  """The one line for a JSON text column found holding something else than strings: its first such record."""
  for path in files:
    problem = json_records.first_not_text(path, column)
    if problem is not None:
      return f"{files_key}: {path} {problem}; fix or remove that record"
  return (f"{files_key} {data_files}: column {column!r} holds values that are not text (strings); give it strings in "
          "every record")


def _caused_by(error: BaseException, kind: type) -> bool:
  cause: BaseException | None = error
  while cause is not None:
    if isinstance(cause, kind):
      return True
    cause = cause.__cause__ or cause.__context__
  return False


def _check_the_text_column(files_key: str, data_files: str, builder: str, files: list[str], dataset: Any,
                           column: str) -> None:
  """The loaded table's text column (also one from datasets' cache): present, and typed as text."""
  if len(dataset) == 0:
    return
  if column not in dataset.column_names:
    raise ConfigError(f"{files_key} {data_files}: records have no column {column!r} (they have "
                      f"{', '.join(dataset.column_names)}); set train_data_columns")
  if builder == "json" and not _text_type(dataset.features.arrow_schema.field(column).type):
    raise ConfigError(_not_text_line(files_key, data_files, files, column))


def _merged_type(a: Any, b: Any) -> Any:
  """One arrow type that holds the values of both, where the difference is harmless (string vs large_string, list vs
  large_list, a struct field one lacks, a column of nulls, integers and floats of other widths), else None."""
  import pyarrow as pa

  if a == b:
    return a
  if pa.types.is_null(a) or pa.types.is_null(b):
    return b if pa.types.is_null(a) else a
  for small, large in ((pa.types.is_string, pa.types.is_large_string), (pa.types.is_binary, pa.types.is_large_binary)):
    if (small(a) or large(a)) and (small(b) or large(b)):
      return a if large(a) else b
  if pa.types.is_integer(a) and pa.types.is_integer(b):
    return pa.int64()
  if all(pa.types.is_integer(t) or pa.types.is_floating(t) for t in (a, b)):
    return pa.float64()
  lists = (pa.types.is_list, pa.types.is_large_list)
  if any(t(a) for t in lists) and any(t(b) for t in lists):
    value = _merged_type(a.value_type, b.value_type)
    if value is None:
      return None
    return pa.large_list(value) if pa.types.is_large_list(a) or pa.types.is_large_list(b) else pa.list_(value)
  if pa.types.is_struct(a) and pa.types.is_struct(b):
    fields = {f.name: f.type for f in a}
    for f in b:
      if f.name in fields:
        merged = _merged_type(fields[f.name], f.type)
        if merged is None:
          return None
        fields[f.name] = merged
      else:
        fields[f.name] = f.type  # a field the other lacks: null there
    return pa.struct(list(fields.items()))
  return None


def _parquet_features(files_key: str, files: list[str]) -> Any:
  """The features to read parquet files whose schemas differ as one table (None when they agree): datasets types the
  table by the first file and fails to cast a later one that has a struct field more, or a column the first lacks.
  A column a file lacks is null in its records (as a JSON record's missing field); a type that cannot hold both is
  one line naming the two files."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  if len(files) < 2:
    return None
  schemas = []
  for path in files:
    try:
      with storage.open_file(path, "rb") as f:
        schemas.append((path, pq.read_schema(f).remove_metadata()))
    except (pa.ArrowException, OSError):
      return None  # not readable: named when datasets fails on it
  if all(schema.equals(schemas[0][1]) for _, schema in schemas):
    return None
  merged: dict[str, tuple[str, Any]] = {}
  for path, schema in schemas:
    for field in schema:
      if field.name not in merged:
        merged[field.name] = (path, field.type)
        continue
      first, kind = merged[field.name]
      both = _merged_type(kind, field.type)
      if both is None:
        raise ConfigError(f"{files_key}: column {field.name!r} is {kind} in {first} but {field.type} in {path}; "
                          "give it one type in every file")
      merged[field.name] = (first, both)
  datasets = _offline_datasets()
  return datasets.Features.from_arrow_schema(pa.schema([(name, kind) for name, (_, kind) in merged.items()]))


def _fill_missing_columns(loader: Any) -> None:
  """datasets' parquet builder casts each file's table to the features, which fails on a column the file lacks: it
  is added as nulls first (on this builder only)."""
  cast = getattr(loader, "_cast_table", None)
  if cast is None:
    return

  def filled(table: Any, *args: Any, **kwargs: Any) -> Any:
    import pyarrow as pa

    schema = loader.info.features.arrow_schema
    for field in schema:
      if field.name not in table.column_names:
        table = table.append_column(field.name, pa.nulls(len(table), field.type))
    return cast(table.select(schema.names), *args, **kwargs)

  loader._cast_table = filled


def _bad_parquet(files: list[str]) -> str | None:
  """'<file> is not a readable parquet file (why)' for the first file whose footer cannot be read."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  for path in files:
    try:
      with storage.open_file(path, "rb") as f:
        pq.read_metadata(f)
    except (pa.ArrowException, OSError) as e:
      return f"{path} is not a readable parquet file ({(str(e).splitlines() or [type(e).__name__])[0]})"
  return None


def _unreadable(files_key: str, data_files: str, builder: str, files: list[str], error: Exception) -> str:
  """The one line for files datasets could not turn into a table: for JSON, the first bad line
  (found by reading the files again, only now that the fast reader failed)."""
  if builder == "parquet":
    problem = _bad_parquet(files)
    if problem is not None:
      return f"{files_key}: {problem}; replace or remove it"
  if builder in ("json", "text", "csv"):
    for path in files:
      problem = data_files_lib.utf16_problem(path)
      if problem is not None:
        return f"{files_key}: {problem}"
  if builder == "json":
    for path in files:
      problem = json_records.first_problem(path)
      if problem is not None:
        return f"{files_key}: {path} {problem}; fix or remove that record"
  if builder in ("text", "csv"):
    for path in files:
      problem = data_files_lib.first_non_utf8(path)
      if problem is not None:
        return f"{files_key}: {problem}"
  cause: BaseException = error
  while cause.__cause__ is not None:
    cause = cause.__cause__
  line = (f"{files_key} {data_files}: datasets cannot read them as {builder} "
          f"({type(cause).__name__}: {(str(cause).splitlines() or [''])[0]})")
  if "Couldn't cast" in str(cause):  # the files are read as one table, one type per column (the first file's)
    line += ("; a field has values of different types across the files (e.g. a string in one, a list of messages in "
             "another): give each field one type in every file")
  return line


def record_locator(hf_path: str, files_key: str, data_files: str) -> Callable[[int], str]:
  """index of a record of the loaded split -> where it is: file and line for JSON/JSONL files,
  else its number in the split. Reads the files again: for error messages only."""
  def locate(index: int) -> str:
    files = expand_files(files_key, data_files)
    if _builder_for(hf_path, files) == "json":
      found = json_records.locate(files, index)
      if found is not None:
        return found
    return f"record {index + 1} of {files_key} {data_files}"
  return locate


def _builder_for(hf_path: str, files: list[str]) -> str:
  for path in files:
    if storage.name(path).lower().endswith(data_files_lib.UNSUPPORTED_COMPRESSIONS):
      raise ConfigError(f"{path} is compressed with a codec datasets cannot read here; decompress it, or compress it "
                        f"with gzip, bz2 or xz ({', '.join(data_files_lib.COMPRESSIONS)})")
  if hf_path:
    return hf_path
  suffixes = {data_files_lib.format_suffix(f) for f in files}
  builders = {_BUILDER_BY_SUFFIX.get(s) for s in suffixes}
  if len(builders) > 1 and None not in builders:  # one table is read from every file: one format
    builder_of = {f: _BUILDER_BY_SUFFIX.get(data_files_lib.format_suffix(f)) for f in files}
    examples = ", ".join(f"{next(f for f in files if builder_of[f] == b)} is {b}" for b in sorted(b for b in builders if b))
    raise ConfigError(f"the hf data files mix formats ({examples}); datasets reads one format per key: convert them "
                      "to one format, or make each format a source of data_mixture")
  if len(builders) != 1 or None in builders:
    raise ConfigError(f"cannot tell the format of hf data files with suffixes {sorted(suffixes)}; "
                      "set hf_path to json, parquet, text or csv")
  builder = builders.pop()
  assert builder is not None  # excluded above
  return builder


def open_split(hf_path: str, data_files: str, split: str, files_key: str, text_column: str | None = None
               ) -> tuple[Any, str]:
  """(random-access datasets.Dataset, description) of one split; `text_column`: the column read as the text, which
  must be text in every file."""
  datasets = _offline_datasets()
  try:
    if data_files:
      files = expand_files(files_key, data_files)
      builder = _builder_for(hf_path, files)
      describe = f"hf {builder} files {data_files}"
      # utf-8-sig: a text file's byte order mark is not part of its first line
      options: dict[str, Any] = {"encoding": "utf-8-sig"} if builder == "text" else {}
      if builder == "json":
        _refuse_a_leading_null(files_key, files)
      if text_column is not None:
        _refuse_a_text_column_not_text(files_key, files, builder, text_column)
      with _remote_files_allowed(datasets, builder, files), _quiet_loaders():
        try:
          # load_dataset's own three steps: a JSON array file is read whole for its check only when datasets is about
          # to parse it, not at every start once datasets' cache holds it (its info then has the splits).
          features = _parquet_features(files_key, files) if builder == "parquet" else None
          if features is not None:
            options["features"] = features
          loader = datasets.load_dataset_builder(builder, data_files={split: files},
                                                 cache_dir=_cache_dir(datasets, files), **options)
          if features is not None:
            _fill_missing_columns(loader)
          if builder == "json" and loader.info.splits is None:
            _refuse_lone_surrogates_in_arrays(files_key, files)
          if builder == "json" and text_column is not None:
            _watch_the_text_column(loader, text_column)
          try:
            loader.download_and_prepare()
          except Exception as e:
            if text_column is not None and _caused_by(e, _NotText):
              raise ConfigError(_not_text_line(files_key, data_files, files, text_column)) from None
            raise
          dataset = loader.as_dataset(split=split)
        except (datasets.exceptions.DatasetGenerationError, StopIteration, ValueError) as e:
          # datasets fails on files with no records in its own ways (StopIteration from the JSON
          # builder, "corresponds to no data", a parquet reader's batch size of 0): they are an empty
          # split, which the callers name.
          if builder in ("json", "text", "csv", "parquet") and all(_no_records(f, builder) for f in files):
            return datasets.Dataset.from_dict({}), describe
          if builder == "json" and "corresponds to no data" in str(e):  # records, none with a field
            raise ConfigError(f"{files_key} {data_files}: every record is an empty JSON object ({{}}): there is no "
                              "field to read; give each record its fields") from None
          if isinstance(e, ValueError) and builder != "parquet":
            raise  # an argument datasets refuses: worded below
          raise ConfigError(_unreadable(files_key, data_files, builder, files, e)) from None
      if text_column is not None:
        _check_the_text_column(files_key, data_files, builder, files, dataset, text_column)
      return dataset, describe
    if not hf_path:
      raise ConfigError(f"dataset_type=hf needs hf_path or {files_key}")
    if storage.is_file(storage.join(hf_path, "dataset_dict.json")):
      saved = datasets.load_from_disk(hf_path)  # a DatasetDict written by save_to_disk (fsspec reads gs://)
      if split not in saved:
        raise ConfigError(f"split {split!r} does not exist in {hf_path}; it has {', '.join(saved)}")
      return saved[split], f"hf {hf_path}[{split}]"
    return datasets.load_dataset(hf_path, split=split), f"hf {hf_path}[{split}]"
  except ConfigError:
    raise
  except ValueError as e:  # datasets' way of saying "unknown split" (and other bad arguments)
    raise ConfigError(f"hf dataset {hf_path or data_files}: {str(e).splitlines()[0]}") from None
  except (FileNotFoundError, ConnectionError, OSError) as e:
    if data_files:
      raise ConfigError(f"{files_key} {data_files}: cannot read ({str(e).splitlines()[0]})") from None
    raise ConfigError(f"hf dataset {hf_path!r} is not available offline ({str(e).splitlines()[0]}); "
                      "point hf_path at local files or a saved dataset directory") from None
