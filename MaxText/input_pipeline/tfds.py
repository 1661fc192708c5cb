"""TensorFlow Datasets prepared under `dataset_path`, read through TFDS's random-access data source.

The data source needs the ArrayRecord file format and no TensorFlow. A dataset stored as
TFRecord (TFDS's default, e.g. a downloaded C4) is converted once with TFDS's own tool, which
does need TensorFlow: `tfds convert_format --dataset_dir=DIR/NAME/VERSION --out_file_format=array_record`.
"""

from __future__ import annotations

import re
from typing import Any, NoReturn

from MaxText.errors import ConfigError
from MaxText.input_pipeline.files import check_prepared
from MaxText.input_pipeline.grain import first_unreadable
from MaxText.paths import storage


def _builder(dataset_name: str, dataset_path: str) -> Any:
  import tensorflow_datasets as tfds
  from google.protobuf import json_format

  where = f"under dataset_path {dataset_path}" if dataset_path else "in the default TFDS data_dir"
  try:
    return tfds.builder(dataset_name, data_dir=dataset_path or None)
  except tfds.core.registered.DatasetNotFoundError:
    raise ConfigError(f"tfds dataset {dataset_name!r} not found {where}") from None
  except UnicodeDecodeError as e:  # a ValueError too, but the dataset is there: its metadata is not text
    raise ConfigError(_bad_metadata(dataset_name, dataset_path, f"not UTF-8 text: {e.reason}")) from None
  except (ValueError, FileNotFoundError) as e:  # e.g. an unknown config or version of a known dataset
    reason = re.split(r"\. Here are|\n", str(e), maxsplit=1)[0]
    raise ConfigError(f"tfds dataset {dataset_name!r} not found {where}: {reason}") from None
  except json_format.Error as e:  # dataset_info.json is not valid JSON (cut short, overwritten)
    raise ConfigError(_bad_metadata(dataset_name, dataset_path, str(e).splitlines()[0].rstrip("."))) from None


def _bad_metadata(dataset_name: str, dataset_path: str, reason: str) -> str:
  name = dataset_name.split(":")[0]
  found = storage.glob(storage.join(dataset_path, name, "*", "dataset_info.json")) if dataset_path else []
  what = ", ".join(found) or f"the dataset_info.json of tfds dataset {dataset_name!r}"
  return f"{what} cannot be read ({reason}); prepare the dataset again"


def open_split(dataset_name: str, dataset_path: str, split: str) -> tuple[Any, str]:
  """(random-access source of {feature: value} dicts, description) of one split; `split` may
  slice (`train[:90%]`)."""
  if dataset_path and storage.name(dataset_path) == "tfds":  # prepare_data's output_path/tfds
    check_prepared("dataset_path", storage.parent(dataset_path))
  builder = _builder(dataset_name, dataset_path)
  base = re.split(r"[\[+]", split, maxsplit=1)[0]
  splits = list(builder.info.splits)
  if base not in splits:
    raise ConfigError(f"split {split!r} does not exist in tfds dataset {dataset_name!r}; it has {', '.join(splits)}")
  file_format = str(getattr(builder.info.file_format, "value", builder.info.file_format))
  if file_format != "array_record":
    raise ConfigError(f"tfds dataset {dataset_name!r} is stored as {file_format}; convert it once to array_record "
                      f"(`tfds convert_format --dataset_dir={builder.data_dir} --out_file_format=array_record`, "
                      "needs tensorflow) for random access and exact resumption")
  shards = _DamagedShardNamed(builder, base)
  try:
    shards.source = builder.as_data_source(split=split)
  except ValueError as e:
    raise ConfigError(f"tfds dataset {dataset_name!r} split {split!r}: {str(e).splitlines()[0]}") from None
  except RuntimeError:
    shards.raise_named()
  return shards, f"tfds {dataset_name}[{split}]"


class _DamagedShardNamed:
  """The split's data source, with the ArrayRecord reader's error on a damaged shard (raised when
  TFDS opens its files, or on a first read) turned into one line naming that shard."""

  def __init__(self, builder: Any, split: str):
    self.source: Any = None
    self._builder, self._split = builder, split

  def __len__(self) -> int:
    return len(self.source)

  def __getitem__(self, index: int) -> Any:
    try:
      return self.source[index]
    except RuntimeError:
      self.raise_named()

  def raise_named(self) -> NoReturn:
    files = storage.glob(storage.join(str(self._builder.data_dir), f"*-{self._split}.array_record*"))
    bad = first_unreadable(files)
    if bad is None:
      raise  # a damaged chunk inside a shard that opens: the pipeline names the record
    raise ConfigError(f"{bad[0]} is not a readable ArrayRecord file ({bad[1]}); prepare the dataset again") from None
