"""Hugging Face `datasets`: local parquet/json/text/csv files, a saved dataset directory, or a hub
dataset already in the local cache. Never downloads: the library is forced offline."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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


def _builder_for(hf_path: str, files: list[str]) -> str:
  if hf_path:
    return hf_path
  suffixes = {Path(f).suffix.lower() for f in files}
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
      dataset = datasets.load_dataset(builder, data_files={split: files}, split=split)
      return dataset, f"hf {builder} files {data_files}"
    if not hf_path:
      raise ConfigError(f"dataset_type=hf needs hf_path or {files_key}")
    if Path(hf_path).is_dir() and (Path(hf_path) / "dataset_dict.json").is_file():
      saved = datasets.load_from_disk(hf_path)  # a DatasetDict written by save_to_disk
      if split not in saved:
        raise ConfigError(f"split {split!r} does not exist in {hf_path}; it has {', '.join(saved)}")
      return saved[split], f"hf {hf_path}[{split}]"
    return datasets.load_dataset(hf_path, split=split), f"hf {hf_path}[{split}]"
  except ConfigError:
    raise
  except ValueError as e:  # datasets' way of saying "unknown split" (and other bad arguments)
    raise ConfigError(f"hf dataset {hf_path or data_files}: {str(e).splitlines()[0]}") from None
  except (FileNotFoundError, ConnectionError, OSError) as e:
    raise ConfigError(f"hf dataset {hf_path!r} is not available offline ({str(e).splitlines()[0]}); "
                      "point hf_path at local files or a saved dataset directory") from None
