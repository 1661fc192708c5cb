"""Hugging Face `datasets`: parquet/json/text/csv files (local or gs://), a saved dataset directory
(local or gs://), or a hub dataset already in the local cache. Never downloads from the hub: the
library is forced offline, and lifted only while it reads the user's own gs:// data files."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

from MaxText import storage
from MaxText.errors import ConfigError
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


def _suffix(path: str) -> str:
  base = storage.name(path)
  return "." + base.rsplit(".", 1)[1].lower() if "." in base.lstrip(".") else ""


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


def _builder_for(hf_path: str, files: list[str]) -> str:
  if hf_path:
    return hf_path
  suffixes = {_suffix(f) for f in files}
  builders = {_BUILDER_BY_SUFFIX.get(s) for s in suffixes}
  if len(builders) != 1 or None in builders:
    raise ConfigError(f"cannot tell the format of hf data files with suffixes {sorted(suffixes)}; "
                      "set hf_path to json, parquet, text or csv")
  builder = builders.pop()
  assert builder is not None  # excluded above
  return builder


def open_split(hf_path: str, data_files: str, split: str, files_key: str) -> tuple[Any, str]:
  """(random-access datasets.Dataset, description) of one split."""
  datasets = _offline_datasets()
  try:
    if data_files:
      files = expand_files(files_key, data_files)
      builder = _builder_for(hf_path, files)
      with _remote_files_allowed(datasets, builder, files):
        dataset = datasets.load_dataset(builder, data_files={split: files}, split=split)
      return dataset, f"hf {builder} files {data_files}"
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
