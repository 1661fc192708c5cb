"""Llama 4 with its vision encoder through the converters: HF → ours → HF reproduces every tensor
(names included) of a save_pretrained checkpoint (the published layout), transformers reloads it
with no missing or unexpected keys and the same logits with images; the logit checker with
images passes and fails on one corrupted vision weight; the vision YAMLs agree with the
published config."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import hf_families as H
from MaxText import families, logit_checker
from MaxText.configuration import config as config_lib
from MaxText.convert import engine, hf_to_maxtext, maxtext_to_hf, streaming
from MaxText.training import params_io

NAME = "llama4-vision"
BASE = str(Path(__file__).resolve().parent.parent / "configs" / "base.yml")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """(HF model, its save_pretrained dir, our checkpoint of it)."""
  root = tmp_path_factory.mktemp("llama4_vision")
  model = H.build_hf_multimodal_model(NAME)
  model.save_pretrained(str(root / "saved"))
  hf_to_maxtext.convert(str(root / "saved"), str(root / "ckpt"), [])
  return model, root / "saved", root / "ckpt"


def test_round_trip_reproduces_every_tensor_and_the_logits_with_images(converted, tmp_path):
  model, saved, ckpt = converted
  maxtext_to_hf.export(str(ckpt), str(tmp_path / "hf"), [])
  original, exported = load_file(str(saved / "model.safetensors")), load_file(str(tmp_path / "hf" / "model.safetensors"))
  assert sorted(exported) == sorted(original)
  assert "vision_model.model.layers.1.self_attn.o_proj.weight" in exported
  for name, value in original.items():
    np.testing.assert_array_equal(exported[name], value, err_msg=name)
  reloaded, info = H.transformers.AutoModelForImageTextToText.from_pretrained(
      str(tmp_path / "hf"), attn_implementation="eager", output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"]
  assert type(reloaded).__name__ == "Llama4ForConditionalGeneration"
  token_ids, pixels = H.multimodal_prompt(model, 2)
  np.testing.assert_array_equal(H.hf_multimodal_logits(reloaded.eval(), token_ids, pixels),
                                H.hf_multimodal_logits(model, token_ids, pixels))


def test_the_saved_model_keys_describe_the_vision_tower(converted):
  _, _, ckpt = converted
  keys = config_lib.read_yaml(ckpt / config_lib.MODEL_CONFIG_FILE)
  assert keys["use_multimodal"] is True and keys["decoder_block"] == "llama4" and keys["vision_num_layers"] == 2
  assert keys["mm_tokens_per_image"] == 16 and keys["vision_adapter_dim"] == 48 and keys["vision_rope_max_timescale"] == 100.0
  assert keys["image_token_id"] == 122 and keys["boi_token_id"] == 120 and keys["eoi_token_id"] == 121


def _png(path: Path, seed: int, size: tuple[int, int]) -> str:
  from PIL import Image
  pixels = np.random.default_rng(seed).integers(0, 256, size=size[::-1] + (3,), dtype=np.uint8)
  Image.fromarray(pixels).save(path)
  return str(path)


def _check(hf_dir: Path, ckpt: Path, *args: str) -> int:
  return logit_checker.main(["logit_checker", BASE, f"load_parameters_path={ckpt}", f"hf_model_path={hf_dir}",
                             "dtype=float32", "atol=2e-5", "max_kl=1e-9", "max_target_length=256", *args])


def test_logit_checker_with_images_passes_and_a_corrupted_vision_weight_fails(converted, tmp_path, capsys):
  _, saved, ckpt = converted
  # A wide image (a 1 x 2 grid and the thumbnail) and a small one (one tile).
  images = f"image_path={_png(tmp_path / 'a.png', 0, (70, 30))},{_png(tmp_path / 'b.png', 1, (20, 24))}"
  assert _check(saved, ckpt, images) == 0
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
  assert _check(saved, corrupt, images) == 1
  summary = [line for line in capsys.readouterr().out.splitlines() if line.startswith("logit_checker: FAIL")]
  assert summary and float(summary[0].split("max |Δlogit| ")[1].split()[0]) > 1e-4, summary
  assert _check(saved, corrupt) == 0  # without images the tower is not run: text logits still equal


# The published meta-llama/Llama-4-{Scout-17B-16E,Maverick-17B-128E}-Instruct vision_config and
# image token ids (the text_config as in llama4-*.yml's own test).
_PUBLISHED_VISION = dict(hidden_size=1408, image_size=336, intermediate_size=5632, num_attention_heads=16,
                         num_hidden_layers=34, patch_size=14, pixel_shuffle_ratio=0.5, projector_input_dim=4096,
                         projector_output_dim=4096, vision_output_dim=4096, norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


@pytest.mark.parametrize("name", ["llama4-scout-17b-16e", "llama4-maverick-17b-128e"])
def test_vision_model_yamls_describe_the_published_checkpoints(name):
  """model_name=<name>-vision equals what hf_to_maxtext infers from the published config: the text
  model's own keys (from its YAML, as the text test checks them) and the vision_config."""
  schema = config_lib.read_yaml(config_lib.BASE_CONFIG_PATH)
  text_yaml = {**schema, **config_lib.read_yaml(config_lib.MODELS_DIR / f"{name}.yml")}
  family = families.family_for_hf_config({"model_type": "llama4_text"})
  text_hf = {k: v for k, v in family.hf_config(config_lib.Config.for_testing(model_name=name).model).items()}
  hf = H.transformers.Llama4Config(text_config=text_hf, vision_config=_PUBLISHED_VISION, boi_token_index=200080,
                                   eoi_token_index=200081, image_token_index=200092).to_dict()
  inferred = engine.full_model_keys(schema, family.model_keys(hf))
  named = {**text_yaml, **config_lib.read_yaml(config_lib.MODELS_DIR / f"{name}-vision.yml")}
  assert engine.differences(named, inferred) == []
