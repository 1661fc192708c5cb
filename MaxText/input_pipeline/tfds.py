"""TensorFlow Datasets prepared under `dataset_path`, read through TFDS's random-access data source.

The data source needs the ArrayRecord file format and no TensorFlow. A dataset stored as
TFRecord (TFDS's default, e.g. a downloaded C4) is converted once with TFDS's own tool, which
does need TensorFlow: `tfds convert_format --dataset_dir=DIR/NAME/VERSION --out_file_format=array_record`.
"""

from __future__ import annotations

import re
from typing import Any

from MaxText.errors import ConfigError


def _builder(dataset_name: str, dataset_path: str) -> Any:
  import tensorflow_datasets as tfds

  where = f"under dataset_path {dataset_path}" if dataset_path else "in the default TFDS data_dir"
  try:
    return tfds.builder(dataset_name, data_dir=dataset_path or None)
  except tfds.core.registered.DatasetNotFoundError:
    raise ConfigError(f"tfds dataset {dataset_name!r} not found {where}") from None
  except (ValueError, FileNotFoundError) as e:  # e.g. an unknown config or version of a known dataset
    reason = re.split(r"\. Here are|\n", str(e), maxsplit=1)[0]
    raise ConfigError(f"tfds dataset {dataset_name!r} not found {where}: {reason}") from None


def open_split(dataset_name: str, dataset_path: str, split: str) -> tuple[Any, str]:
  """(random-access source of {feature: value} dicts, description) of one split; `split` may
  slice (`train[:90%]`)."""
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
  try:
    return builder.as_data_source(split=split), f"tfds {dataset_name}[{split}]"
  except ValueError as e:
    raise ConfigError(f"tfds dataset {dataset_name!r} split {split!r}: {str(e).splitlines()[0]}") from None
