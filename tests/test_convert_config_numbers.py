"""hf_to_maxtext on config.json numbers that Python's float()/int() would take but no model has: a number written
as text ("10000", " 32 ", "1_000", "nan"), a non-finite one (NaN, Infinity: JSON as Python writes it), a zero or
negative norm epsilon, RoPE base or head count, a true/false where a number belongs. Each is one line naming the
config.json field and its value, before anything is written (was: "10000" and "1e-6" converted as numbers, a
zero, negative or infinite rope_theta or rms_norm_eps converted, NaN reached "normalization_layer_epsilon: nan vs
nan", a zero head count named only our key base_num_query_heads)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import hf_families as H
from MaxText.convert import hf_to_maxtext
from MaxText.errors import UserError


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
  root = tmp_path_factory.mktemp("hf") / "mistral"
  H.build_hf_model("mistral").save_pretrained(str(root))
  return root


def _rope(value: Any) -> dict[str, Any]:
  return {"rope_parameters": {"rope_theta": value, "rope_type": "default"}}


CASES: dict[str, tuple[dict[str, Any], str]] = {
    "rope_theta as text": (_rope("10000"), "rope_parameters.rope_theta is the text '10000' where a number belongs"),
    "rms_norm_eps as text": ({"rms_norm_eps": "1e-6"}, "rms_norm_eps is the text '1e-6' where a number belongs"),
    "heads as padded text": ({"num_attention_heads": " 4 "}, "num_attention_heads is the text ' 4 ' where a number"),
    "underscored text": ({"intermediate_size": "1_000"}, "intermediate_size is the text '1_000' where a number"),
    "max_position_embeddings as text": ({"max_position_embeddings": "4096"},
                                        "max_position_embeddings is the text '4096' where a number belongs"),
    "sliding_window as text": ({"sliding_window": "4096"}, "sliding_window is the text '4096' where a number belongs"),
    "nan as text": ({"rms_norm_eps": "nan"}, "rms_norm_eps is the text 'nan' where a number belongs"),
    "rope_theta NaN": (_rope(float("nan")), "rope_parameters.rope_theta is nan, not a finite number"),
    "rope_theta Infinity": (_rope(float("inf")), "rope_parameters.rope_theta is inf, not a finite number"),
    "rms_norm_eps NaN": ({"rms_norm_eps": float("nan")}, "rms_norm_eps is nan, not a finite number"),
    "rope_theta zero": (_rope(0), "rope_parameters.rope_theta is 0, which must be positive"),
    "rope_theta negative": (_rope(-5.0), "rope_parameters.rope_theta is -5.0, which must be positive"),
    "rms_norm_eps negative": ({"rms_norm_eps": -1e-6}, "rms_norm_eps is -1e-06, which must be positive"),
    "rms_norm_eps zero": ({"rms_norm_eps": 0}, "rms_norm_eps is 0, which must be positive"),
    "heads zero": ({"num_attention_heads": 0}, "num_attention_heads is 0, which must be positive"),
    "heads negative": ({"num_attention_heads": -4}, "num_attention_heads is -4, which must be positive"),
    "rope_theta true": (_rope(True), "rope_parameters.rope_theta is true where a number belongs"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_number_in_config_json_is_one_line_naming_the_field(case: str, hf_dir: Path, tmp_path: Path) -> None:
  edit, message = CASES[case]
  d = tmp_path / "hf"
  shutil.copytree(hf_dir, d)
  config = json.loads((d / "config.json").read_text())
  (d / "config.json").write_text(json.dumps({**config, **edit}))
  with pytest.raises(UserError) as raised:
    hf_to_maxtext.convert(str(d), str(tmp_path / "out"), [])
  assert f"{d}/config.json: {message}" in str(raised.value) and "\n" not in str(raised.value)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_text_that_is_no_number_and_labels_are_left_alone(hf_dir: Path, tmp_path: Path) -> None:
  """Fields that are text by design (a version, a name, id2label's numbered labels) are not numbers written as text."""
  d = tmp_path / "hf"
  shutil.copytree(hf_dir, d)
  config = json.loads((d / "config.json").read_text())
  (d / "config.json").write_text(json.dumps({**config, "_name_or_path": "7", "id2label": {"0": "1", "1": "2"},
                                             "label2id": {"1": 0, "2": 1}, "transformers_version": "5"}))
  hf_to_maxtext.convert(str(d), str(tmp_path / "out"), [])
  assert (tmp_path / "out").is_dir()


def _word_tokenizer(d: Path, count: int) -> None:
  from tokenizers import Tokenizer, models

  Tokenizer(models.WordLevel({f"w{i}": i for i in range(count)}, unk_token="w0")).save(str(d / "tokenizer.json"))


@pytest.mark.parametrize("count", [200, 100])
def test_a_tokenizer_beside_the_weights_with_ids_past_vocab_size_is_named(count: int, hf_dir: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
  """Ids past vocab_size have no embedding row (transformers: an IndexError; here jnp.take's NaN rows): the converter
  says so in one line naming both numbers (was: silent). A padded vocabulary (fewer ids, as Llama's and Qwen's) is
  fine and says nothing."""
  d = tmp_path / "hf"
  shutil.copytree(hf_dir, d)
  _word_tokenizer(d, count)
  hf_to_maxtext.convert(str(d), str(tmp_path / "out"), [])
  lines = [line for line in capsys.readouterr().out.splitlines() if "tokenizer.json" in line]
  if count > 128:
    assert lines == [f"hf_to_maxtext: warning: {d}/tokenizer.json has ids up to {count - 1} but config.json's "
                     "vocab_size is 128: those tokens have no embedding row; use the checkpoint's own tokenizer"]
  else:
    assert lines == []


@pytest.mark.parametrize("params, message", [
    ({"factor": 0.0}, "rope_parameters factor=0.0 is not a YaRN scaling factor (>= 1)"),
    ({"factor": 4.0, "original_max_position_embeddings": 0}, "rope_parameters original_max_position_embeddings=0 is not "
                                                             "a positive length"),
], ids=["factor-0", "original-0"])
def test_a_zero_yarn_setting_is_refused_not_replaced_by_its_default(params: dict[str, Any], message: str,
                                                                    hf_dir: Path, tmp_path: Path) -> None:
  """transformers divides by a YaRN factor of 0 and takes the log of an original length of 0 (a model of inf and
  NaN); was: each read as unset, converting a model with factor max_position_embeddings / original instead."""
  d = tmp_path / "hf"
  shutil.copytree(hf_dir, d)
  config = json.loads((d / "config.json").read_text())
  config["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "yarn", **params}
  (d / "config.json").write_text(json.dumps(config))
  with pytest.raises(UserError) as raised:
    hf_to_maxtext.convert(str(d), str(tmp_path / "out"), [])
  assert message in str(raised.value) and "\n" not in str(raised.value), str(raised.value)


def test_a_zero_mistral_window_is_refused_not_read_as_none(hf_dir: Path, tmp_path: Path) -> None:
  """transformers' Mistral masks every key outside a window of 0 (no key at all); was: converted as full attention."""
  d = tmp_path / "hf"
  shutil.copytree(hf_dir, d)
  config = json.loads((d / "config.json").read_text())
  (d / "config.json").write_text(json.dumps({**config, "sliding_window": 0}))
  with pytest.raises(UserError) as raised:
    hf_to_maxtext.convert(str(d), str(tmp_path / "out"), [])
  assert "HF config sliding_window=0 is not a window (a positive length, or null for none)" in str(raised.value)
