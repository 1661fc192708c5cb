"""Comma-separated file lists with globs, as the data keys take them."""

from __future__ import annotations

import glob
import os

from MaxText.errors import ConfigError


def expand_files(key: str, value: str) -> list[str]:
  """Every file named by `value` (comma-separated paths or globs), sorted within each pattern.

  Remote paths (gs://...) are passed through unchecked: only the reader can see them."""
  patterns = [p.strip() for p in value.split(",") if p.strip()]
  if not patterns:
    raise ConfigError(f"{key} is empty")
  files: list[str] = []
  for pattern in patterns:
    if "://" in pattern:
      files.append(pattern)
      continue
    matched = sorted(p for p in glob.glob(os.path.expanduser(pattern)) if os.path.isfile(p))
    if not matched:
      raise ConfigError(f"{key}: no file matches {pattern!r}")
    files.extend(matched)
  return files
