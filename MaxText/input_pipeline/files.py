"""Comma-separated file lists with globs, as the data keys take them."""

from __future__ import annotations

from MaxText.paths import storage
from MaxText.errors import ConfigError

# Keys whose reader opens files by local path only: ArrayRecord's C++ reader cannot open gs://
# (it stalls there instead of failing), so such values are refused before anything is opened.
_LOCAL_ONLY_KEYS = ("grain_train_files", "grain_eval_files")


def expand_files(key: str, value: str) -> list[str]:
  """Every file named by `value` (comma-separated paths or globs, local or gs://), sorted within
  each pattern; a pattern that matches no file is an error."""
  patterns = [p.strip() for p in value.split(",") if p.strip()]
  if not patterns:
    raise ConfigError(f"{key} is empty")
  files: list[str] = []
  for pattern in patterns:
    if storage.is_remote(pattern) and key in _LOCAL_ONLY_KEYS:
      raise ConfigError(f"{key}={pattern}: ArrayRecord files cannot be read from a bucket directly (the reader opens "
                        "local files only); mount the bucket with gcsfuse or copy the files to local disk "
                        "(gcloud storage cp) and point the key at the local path")
    matched = storage.glob(pattern)
    if not matched:
      raise ConfigError(f"{key}: no file matches {pattern!r}")
    files.extend(matched)
  return files
