"""Gemma 3 with its vision tower through the converters: HF → ours → HF reproduces every tensor
(names included) of a checkpoint in the published layout, transformers reloads it and gives the
same logits with images; transformers 5's own save layout reads to the same parameters; the
logit checker with images passes, and fails on one corrupted vision weight."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import hf_families as H
from MaxText import families, logit_checker
from MaxText.configuration import config as config_lib
from MaxText.convert import engine, hf_to_maxtext, maxtext_to_hf, streaming
from MaxText.training import params_io

NAME = "gemma3-vision"
BASE = str(Path(__file__).resolve().parent.parent / "configs" / "base.yml")


def _published(saved: Path, out: Path) -> Path:
  """transformers 5's save_pretrained directory rewritten in the published checkpoints' layout
  (google/gemma-3-*: the vision tower's tensors under vision_tower.vision_model.)."""
  tensors = load_file(str(saved / "model.safetensors"))
  out.mkdir()
  save_file({("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.") else k): v
             for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
  shutil.copy(saved / "config.json", out / "config.json")
  return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """(HF model, its save_pretrained dir, the published-layout dir, our checkpoint of the latter)."""
  root = tmp_path_factory.mktemp("multimodal")
  model = H.build_hf_multimodal_model(NAME)
  model.save_pretrained(str(root / "saved"))
  published = _published(root / "saved", root / "published")
  hf_to_maxtext.convert(str(published), str(root / "ckpt"), [])
  return model, root / "saved", published, root / "ckpt"


def test_round_trip_reproduces_every_tensor_and_the_logits_with_images(converted, tmp_path):
  model, _, published, ckpt = converted
  maxtext_to_hf.export(str(ckpt), str(tmp_path / "hf"), [])
  original, exported = load_file(str(published / "model.safetensors")), load_file(str(tmp_path / "hf" / "model.safetensors"))
  assert sorted(exported) == sorted(original)
  assert any(name.startswith("vision_tower.vision_model.encoder.layers.1.") for name in exported)
  for name, value in original.items():
    np.testing.assert_array_equal(exported[name], value, err_msg=name)
  reloaded, info = H.transformers.AutoModelForImageTextToText.from_pretrained(
      str(tmp_path / "hf"), attn_implementation="eager", output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"]
  assert type(reloaded).__name__ == "Gemma3ForConditionalGeneration"
  token_ids, pixels = H.multimodal_prompt(model, 2)
  np.testing.assert_array_equal(H.hf_multimodal_logits(reloaded.eval(), token_ids, pixels),
                                H.hf_multimodal_logits(model, token_ids, pixels))


def test_transformers_5_save_layout_converts_to_the_same_parameters(converted, tmp_path):
  _, saved, _, ckpt = converted
  hf_to_maxtext.convert(str(saved), str(tmp_path / "ckpt"), [])
  ours, reference = streaming.ParamReader(str(tmp_path / "ckpt"), "float32"), streaming.ParamReader(str(ckpt), "float32")
  try:
    assert sorted(ours.shapes) == sorted(reference.shapes)
    assert ("vision_encoder", "layers", "fc1", "kernel") in ours.shapes
    for path in ours.shapes:
      np.testing.assert_array_equal(ours.read(path), reference.read(path), err_msg="/".join(path))
  finally:
    ours.close()
    reference.close()


def test_the_saved_model_keys_describe_the_vision_tower(converted):
  _, _, _, ckpt = converted
  keys = config_lib.read_yaml(ckpt / config_lib.MODEL_CONFIG_FILE)
  assert keys["use_multimodal"] is True and keys["vision_num_layers"] == 2 and keys["mm_tokens_per_image"] == 16
  assert keys["image_token_id"] == 122 and keys["boi_token_id"] == 120 and keys["eoi_token_id"] == 121


def _png(path: Path, seed: int, size: tuple[int, int]) -> str:
  from PIL import Image
  pixels = np.random.default_rng(seed).integers(0, 256, size=size[::-1] + (3,), dtype=np.uint8)
  Image.fromarray(pixels).save(path)
  return str(path)


def _check(hf_dir: Path, ckpt: Path, *args: str) -> int:
  return logit_checker.main(["logit_checker", BASE, f"load_parameters_path={ckpt}", f"hf_model_path={hf_dir}",
                             "dtype=float32", "atol=2e-5", "max_kl=1e-9", *args])


def test_logit_checker_with_images_passes_and_a_corrupted_vision_weight_fails(converted, tmp_path, capsys):
  _, _, published, ckpt = converted
  images = f"image_path={_png(tmp_path / 'a.png', 0, (90, 40))},{_png(tmp_path / 'b.png', 1, (30, 70))}"
  assert _check(published, ckpt, images) == 0
  out = capsys.readouterr().out
  assert "2 image(s) each" in out and "logit_checker: PASS" in out
  reader = streaming.ParamReader(str(ckpt), "float32")
  try:
    params: dict = {}
    for path in reader.shapes:
      node = params
      for key in path[:-1]:
        node = node.setdefault(key, {})
      node[path[-1]] = np.array(reader.read(path))
  finally:
    reader.close()
  params["vision_encoder"]["layers"]["fc1"]["kernel"][1, 3, 5] += 0.5  # one number in the tower's last layer
  corrupt = tmp_path / "corrupt"
  params_io.save_params(str(corrupt), params)
  shutil.copy(ckpt / config_lib.MODEL_CONFIG_FILE, corrupt / config_lib.MODEL_CONFIG_FILE)
  assert _check(published, corrupt, images) == 1
  summary = [line for line in capsys.readouterr().out.splitlines() if line.startswith("logit_checker: FAIL")]
  assert summary and float(summary[0].split("max |Δlogit| ")[1].split()[0]) > 1e-4, summary
  assert _check(published, corrupt) == 0  # without images the tower is not run: text logits still equal



# The published image-text checkpoints' config.json fields that shape the model (google/gemma-3-*-it).
_PUBLISHED_TEXT = {
    "4b": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
               num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256),
    "12b": dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256),
    "27b": dict(hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
                num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168),
}


@pytest.mark.parametrize("size", sorted(_PUBLISHED_TEXT))
def test_vision_model_yamls_describe_the_published_checkpoints(size):
  """model_name=gemma3-<size>-vision agrees with the published config.json, as hf_to_maxtext checks it."""
  hf = H.transformers.Gemma3Config(
      text_config=dict(**_PUBLISHED_TEXT[size], sliding_window=1024, vocab_size=262208,
                       rope_scaling={"factor": 8.0, "rope_type": "linear"}),
      vision_config=dict(model_type="siglip_vision_model", hidden_size=1152, image_size=896, intermediate_size=4304,
                         num_hidden_layers=27, num_attention_heads=16, patch_size=14, vision_use_head=False)).to_dict()
  schema = config_lib.read_yaml(config_lib.BASE_CONFIG_PATH)
  inferred = engine.full_model_keys(schema, families.family_for_hf_config(hf).model_keys(hf))
  named = {**schema, **config_lib.read_yaml(config_lib.MODELS_DIR / f"gemma3-{size}-vision.yml")}
  assert engine.differences(named, inferred) == []
