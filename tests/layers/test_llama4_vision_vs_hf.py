"""Llama 4's image side beyond the shared checks of tests/layers/test_multimodal_vs_hf.py (which
compares its logits with one and two images, text-only prompts and its soft tokens with HF's
Llama4ForConditionalGeneration): the text stack stays causal over image tokens as HF's does (a
bidirectional image mask switched on breaks the match), the pieces (2-D RoPE angles, pixel
shuffle) equal HF's, the parameters carry logical names, and the vision keys' one-line errors."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import hf_families as H
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from MaxText import families, models
from MaxText.families import llama4_vision

FP32_ATOL = 2e-5
NAME = "llama4-vision"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  model = H.build_hf_multimodal_model(NAME)
  config = H.our_config(model, dtype="float32", max_target_length=128)
  return model, config, H.our_params(model, config, tmp_path_factory.mktemp("staging"))


def test_image_tokens_stay_causal_as_in_hf(reference, monkeypatch):
  model, config, params = reference
  token_ids, pixels = H.multimodal_prompt(model, 1, seed=4)
  expected = H.hf_multimodal_logits(model, token_ids, pixels)
  np.testing.assert_allclose(H.our_multimodal_logits(config, params, token_ids, pixels), expected, atol=FP32_ATOL,
                             rtol=0)
  family = families.family_for_decoder_block("llama4")
  assert family.vision is not None
  monkeypatch.setitem(families._FAMILIES, family.name,  # the same tower, its image tokens seeing each other both ways
                      dataclasses.replace(family, vision=dataclasses.replace(family.vision, bidirectional_images=True)))
  assert np.abs(H.our_multimodal_logits(config, params, token_ids, pixels) - expected).max() > 0.01


def test_rope_angles_equal_hf_frequencies():
  rotary = H.transformers.models.llama4.modeling_llama4.Llama4VisionRotaryEmbedding
  config = H.transformers.Llama4VisionConfig(hidden_size=64, num_attention_heads=2, image_size=20, patch_size=4,
                                             rope_parameters={"rope_type": "default", "rope_theta": 50.0})
  expected = rotary._compute_freqs_ci(config)  # complex [Q, 1, Y / 2]
  ours = llama4_vision.rope_angles(5, 32, 50.0)
  np.testing.assert_allclose(np.cos(ours), expected.real.numpy()[:, 0], atol=1e-6)
  np.testing.assert_allclose(np.sin(ours), expected.imag.numpy()[:, 0], atol=1e-6)


def test_pixel_shuffle_equals_hf():
  x = np.random.default_rng(0).normal(size=(3, 36, 8)).astype(np.float32)
  expected = H.transformers.models.llama4.modeling_llama4.pixel_shuffle(H.torch.tensor(x), 0.5).numpy()
  np.testing.assert_array_equal(np.asarray(llama4_vision.pixel_shuffle(jnp.asarray(x), 2)), expected)


def test_vision_parameters_carry_logical_names(reference):
  _, config, _ = reference
  names = models.build_model_spec(config.model).logical_names
  encoder = names["vision_encoder"]
  assert encoder["layers"]["fc1"]["kernel"] == ("layers", "embed", "mlp")
  assert encoder["layers"]["attention"]["query"]["kernel"] == ("layers", "embed", "heads", "kv")
  assert encoder["class_embedding"] == ("embed",)
  assert encoder["adapter"]["fc1"]["kernel"] == ("mlp", "embed")
  assert names["multimodal_projector"]["projection"]["kernel"] == (None, "embed")


MULTIMODAL = dict(decoder_block="llama4", use_multimodal=True, vision_emb_dim=32, vision_mlp_dim=128,
                  vision_num_layers=2, vision_num_heads=4, vision_patch_size=4, vision_image_size=32,
                  mm_tokens_per_image=16, vision_pixel_shuffle_ratio=0.5, vision_adapter_dim=48, image_token_id=122,
                  boi_token_id=120, eoi_token_id=121, vocab_size=128, attention_layer_pattern=["global"])


def test_a_consistent_record_builds_and_flash_is_allowed():
  assert Config.for_testing(**MULTIMODAL).model.vision.pixel_shuffle_factor == 2
  Config.for_testing(**MULTIMODAL, attention="flash")  # no bidirectional image block to build


@pytest.mark.parametrize("overrides, message", [
    ({"mm_tokens_per_image": 64}, "mm_tokens_per_image (64) must be 16 for decoder_block llama4"),
    ({"vision_pixel_shuffle_ratio": 0.3}, "vision_pixel_shuffle_ratio must be 1 / an integer"),
    ({"vision_num_heads": 16}, "the vision head width vision_emb_dim / vision_num_heads (2) must be a multiple of 4"),
    ({"vision_adapter_dim": 0}, "vision_adapter_dim must be > 0, got 0"),
    ({"vision_rope_max_timescale": 0.0}, "vision_rope_max_timescale must be > 0"),
    ({"vision_pixel_shuffle_ratio": 1 / 3, "mm_tokens_per_image": 9},
     "the 8 patches per tile side must be a multiple of 1 / vision_pixel_shuffle_ratio (3)"),
])
def test_inconsistent_llama4_vision_keys_are_one_line_errors(overrides, message):
  with pytest.raises(ConfigError) as raised:
    Config.for_testing(**{**MULTIMODAL, **overrides})
  assert message in str(raised.value) and "\n" not in str(raised.value)

