"""ArrayRecord files read with Grain's ArrayRecordDataSource (random access, no TensorFlow).

Each record is one document: a JSON object (its `train_data_columns` field is the text), a JSON
string, or raw UTF-8 text. `python3 -m MaxText.input_pipeline.prepare_data` writes such files.
The files must be on a local (or gcsfuse-mounted) file system: gs:// values are refused with
how to stage them (files.expand_files), since the ArrayRecord reader cannot open them.
"""

from __future__ import annotations

from typing import Any

from MaxText.errors import ConfigError
from MaxText.input_pipeline.files import expand_files


def open_files(key: str, value: str) -> tuple[Any, str]:
  """(random-access source of record bytes, description)."""
  import grain

  files = expand_files(key, value)
  try:
    source = grain.sources.ArrayRecordDataSource(files)
  except (RuntimeError, ValueError, OSError) as e:
    bad = first_unreadable(files)
    if bad is not None:
      raise ConfigError(f"{key}: {bad[0]} is not a readable ArrayRecord file ({bad[1]}); "
                        "replace or remove it") from None
    raise ConfigError(f"{key}: cannot read {value} as ArrayRecord files ({_reason(e)})") from None
  return source, f"grain {len(files)} ArrayRecord file(s) {value}"


def first_unreadable(files: list[str]) -> tuple[str, str] | None:
  """(file, why) for the first of `files` the ArrayRecord reader cannot open (its error names none)."""
  import grain

  for path in files:
    try:
      grain.sources.ArrayRecordDataSource([path])
    except (RuntimeError, ValueError, OSError) as e:
      return path, _reason(e)
  return None


def _reason(error: Exception) -> str:
  return (str(error).splitlines() or [""])[0] or f"{type(error).__name__}, no detail"
