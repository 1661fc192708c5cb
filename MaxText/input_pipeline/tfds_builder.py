"""A TFDS dataset builder over local JSONL files (`{"text": ...}` per line), written in the
ArrayRecord format so the tfds pipeline reads it without TensorFlow.

Once prepared, the dataset is read back from its directory alone (`tfds.builder` finds it under
the data_dir), so training never imports this module.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import tensorflow_datasets as tfds

from MaxText.paths import storage
from MaxText.errors import UserError

SPLIT_FILES = {"train": "train.jsonl", "validation": "validation.jsonl", "test": "test.jsonl"}


class LocalText(tfds.core.GeneratorBasedBuilder):
  """Documents from manual_dir/{train,validation,test}.jsonl; the config name names the corpus."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Documents from local JSONL files."}
  MANUAL_DOWNLOAD_INSTRUCTIONS = "Put train.jsonl (and validation.jsonl, test.jsonl) in the manual_dir."

  # Nothing is downloaded (the splits are local files) and prepare_data prints its own summary:
  # TFDS's "Downloading and preparing dataset ..." banners would only mislead.
  def _log_download_bytes(self) -> None:
    pass

  def _log_download_done(self) -> None:
    pass

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
                                 description="Local text documents, one JSON object per line.")

  def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Any]:
    directory = str(dl_manager.manual_dir)
    present = {split: storage.join(directory, file) for split, file in SPLIT_FILES.items()
               if storage.is_file(storage.join(directory, file))}
    if "train" not in present:
      raise UserError(f"{directory} holds no train.jsonl")
    return {split: self._generate_examples(path) for split, path in present.items()}

  def _generate_examples(self, path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    with storage.open_file(path, "rb") as f:
      for number, line in enumerate(f):  # bytes: json.loads decodes UTF-8 itself
        if line.strip():
          yield number, {"text": json.loads(line)["text"]}


def prepare(data_dir: str, name: str, jsonl_dir: str) -> str:
  """Writes `local_text/<name>` under data_dir from jsonl_dir's split files; returns the dataset_name."""
  builder = LocalText(data_dir=data_dir, config=tfds.core.BuilderConfig(name=name), file_format="array_record")
  builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=jsonl_dir))
  return f"local_text/{name}"
