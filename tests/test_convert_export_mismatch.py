"""maxtext_to_hf given model keys (model_name= and overrides, for a checkpoint without model_config.yml) that
describe a smaller model than the checkpoint holds: one line naming the parameters the keys leave out (was: an
unrolled checkpoint's extra layer, or an untied checkpoint's output layer under logits_via_embedding=True, left
out of the export without a word: a model with other logits than the one trained)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

import hf_families as H
from MaxText.convert import engine, hf_to_maxtext, maxtext_to_hf
from MaxText.errors import UserError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
  """An unrolled checkpoint of the tiny untied Mistral without its model_config.yml, and the keys it held."""
  root = tmp_path_factory.mktemp("export")
  H.build_hf_model("mistral").save_pretrained(str(root / "hf"))
  hf_to_maxtext.convert(str(root / "hf"), str(root / "ckpt"), ["scan_layers=False"])
  keys = yaml.safe_load((root / "ckpt" / "model_config.yml").read_text())
  (root / "ckpt" / "model_config.yml").unlink()
  return root / "ckpt", keys


@pytest.mark.parametrize("override, named", [
    ({"base_num_decoder_layers": 1}, "layers_1/"),
    ({"logits_via_embedding": True}, "logits_dense/kernel"),
], ids=["fewer-layers", "tied-over-untied"])
def test_keys_of_a_smaller_model_than_the_checkpoint_are_refused_naming_what_they_leave_out(
    checkpoint: tuple[Path, dict[str, object]], tmp_path: Path, override: dict[str, object], named: str) -> None:
  ckpt, keys = checkpoint
  args = ["model_name=mistral-7b", *engine.describe_keys({**keys, **override}).split()]
  with pytest.raises(UserError) as raised:
    maxtext_to_hf.export(str(ckpt), str(tmp_path / "out"), args)
  message = str(raised.value)
  assert f"{ckpt} (parameters-only checkpoint) holds" in message and named in message, message
  assert "the model config does not have" in message and "\n" not in message
  assert not (tmp_path / "out").exists()


def test_the_keys_it_was_written_with_export(checkpoint: tuple[Path, dict[str, object]], tmp_path: Path) -> None:
  ckpt, keys = checkpoint
  maxtext_to_hf.export(str(ckpt), str(tmp_path / "out"), ["model_name=mistral-7b", *engine.describe_keys(keys).split()])
  assert (tmp_path / "out" / "model.safetensors").is_file()


def test_an_output_path_that_is_a_file_is_named_as_one(checkpoint: tuple[Path, dict[str, object]],
                                                        tmp_path: Path) -> None:
  """Was "exists and is not empty", which sent the user looking inside a directory."""
  ckpt, keys = checkpoint
  (tmp_path / "out").write_text("notes")
  with pytest.raises(UserError) as raised:
    maxtext_to_hf.export(str(ckpt), str(tmp_path / "out"), ["model_name=mistral-7b", *engine.describe_keys(keys).split()])
  assert str(raised.value) == f"{tmp_path / 'out'} is a file; output_path is the directory to write the model to"
  assert (tmp_path / "out").read_text() == "notes"
