"""Gemma 3 with its vision tower equals HF's Gemma3ForConditionalGeneration (CPU torch), and Llama 4
with its own HF's Llama4ForConditionalGeneration, on tiny random models (tests/hf_families.py): prompts with one and with two images per row, and text-only
prompts, in float32; the parameters go through the converter's tensor table. Also the soft
tokens alone, the bidirectional image mask (switched off, the match breaks) and the vision
record's one-line config errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_families as H
import train_utils
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from MaxText import models
from MaxText.layers import masks
from MaxText.platform import sharding

# As tests/layers/test_families_vs_hf.py: float32 implementations that sum in different orders.
FP32_ATOL = 2e-5


@pytest.fixture(scope="module", params=H.MULTIMODAL)
def reference(request, tmp_path_factory):
  """(HF model, our config, our parameters) for each family's tiny image-text model."""
  model = H.build_hf_multimodal_model(request.param)
  config = H.our_config(model, dtype="float32", max_target_length=128)
  return model, config, H.our_params(model, config, tmp_path_factory.mktemp("staging"))


@pytest.mark.parametrize("num_images", [1, 2])
def test_logits_with_images_match_hf(reference, num_images):
  model, config, params = reference
  token_ids, pixels = H.multimodal_prompt(model, num_images, seed=num_images)
  expected = H.hf_multimodal_logits(model, token_ids, pixels)
  np.testing.assert_allclose(H.our_multimodal_logits(config, params, token_ids, pixels), expected, atol=FP32_ATOL,
                             rtol=0, err_msg=f"{num_images} image(s)")


def test_text_only_prompts_on_the_multimodal_model_match_hf(reference):
  model, config, params = reference
  token_ids, _ = H.multimodal_prompt(model, 0, seed=5, length=H.LENGTH)
  np.testing.assert_allclose(H.our_multimodal_logits(config, params, token_ids, None),
                             H.hf_multimodal_logits(model, token_ids, None), atol=FP32_ATOL, rtol=0)


def test_unrolled_text_stack_matches_too(reference, tmp_path):
  model, _, _ = reference
  config = H.our_config(model, dtype="float32", max_target_length=128, scan_layers=False)
  params = H.our_params(model, config, tmp_path)
  token_ids, pixels = H.multimodal_prompt(model, 2, seed=7)
  np.testing.assert_allclose(H.our_multimodal_logits(config, params, token_ids, pixels),
                             H.hf_multimodal_logits(model, token_ids, pixels), atol=FP32_ATOL, rtol=0)


def test_soft_tokens_match_hf_image_features(reference):
  model, config, params = reference
  _, pixels = H.multimodal_prompt(model, 2, seed=3)
  flat = pixels.reshape((-1,) + pixels.shape[2:])
  expected = H.hf_soft_tokens(model, flat)
  spec = models.build_model_spec(config.model)
  ours = jax.jit(sharding.unsharded()(lambda p, x: spec.module(p).image_embeddings(x)))(params, jnp.asarray(flat))
  assert ours.shape == expected.shape == (len(flat), config.model.vision.mm_tokens_per_image, config.model.emb_dim)
  np.testing.assert_allclose(np.asarray(ours), expected, atol=FP32_ATOL, rtol=0)


def test_without_the_bidirectional_image_mask_the_logits_differ(reference, monkeypatch):
  model, config, params = reference
  if config.model.decoder_block != "gemma3":
    pytest.skip("Gemma 3's image mask (Llama 4's text stays causal: tests/layers/test_llama4_vision_vs_hf.py)")
  token_ids, pixels = H.multimodal_prompt(model, 1, seed=1)
  expected = H.hf_multimodal_logits(model, token_ids, pixels)
  monkeypatch.setattr(masks, "image_blocks", lambda tokens_BL, image_token_id: jnp.zeros_like(tokens_BL))
  assert np.abs(H.our_multimodal_logits(config, params, token_ids, pixels) - expected).max() > 0.01


def test_image_blocks_number_each_run_of_placeholders():
  tokens = jnp.asarray([[5, 9, 9, 7, 9, 9, 9, 1], [9, 2, 3, 9, 4, 4, 4, 4]])
  np.testing.assert_array_equal(masks.image_blocks(tokens, 9), [[0, 1, 1, 0, 2, 2, 2, 0], [1, 0, 0, 2, 0, 0, 0, 0]])


def test_image_tokens_see_their_whole_image_within_segment_and_window():
  blocks = jnp.asarray([[0, 1, 1, 1, 0, 2, 2]])
  segments = jnp.asarray([[1, 1, 1, 1, 1, 1, 2]])
  mask = np.asarray(masks.self_mask(segments, window=None, image_blocks_BL=blocks))[0]
  assert mask[1, 3] and mask[2, 3] and not mask[0, 1]  # later tokens of the same image only
  assert not mask[3, 5] and not mask[5, 6]  # another image; another segment
  windowed = np.asarray(masks.self_mask(jnp.ones_like(blocks), window=2, image_blocks_BL=blocks))[0]
  assert windowed[1, 3] and not windowed[3, 1]  # later keys of the image pass the window; earlier ones do not


MULTIMODAL = dict(decoder_block="gemma3", use_multimodal=True, attention="dot_product", vision_emb_dim=32,
                  vision_mlp_dim=48, vision_num_layers=2, vision_num_heads=4, vision_patch_size=8,
                  vision_image_size=64, mm_tokens_per_image=16, image_token_id=122, boi_token_id=120,
                  eoi_token_id=121, vocab_size=128)


@pytest.mark.parametrize("overrides, message", [
    ({"vision_num_heads": 5}, "vision_emb_dim (32) must be a multiple of vision_num_heads (5)"),
    ({"vision_image_size": 60}, "vision_image_size (60) must be a multiple of vision_patch_size (8)"),
    ({"mm_tokens_per_image": 12}, "mm_tokens_per_image (12) must be a square whose side divides the 8 patches"),
    ({"mm_tokens_per_image": 9}, "mm_tokens_per_image (9) must be a square whose side divides the 8 patches"),
    ({"boi_token_id": 122}, "image_token_id, boi_token_id and eoi_token_id must be three different token ids"),
    ({"eoi_token_id": 500}, "eoi_token_id (500) must be below vocab_size (128)"),
    ({"attention": "flash"}, "use_multimodal=True needs attention=dot_product or autoselected"),
    ({"decoder_block": "llama2"}, "use_multimodal=True is supported for decoder_block gemma3, llama4; got 'llama2'"),
    ({"vision_num_layers": 0}, "vision_num_layers must be > 0, got 0"),
    ({"use_multimodal": False, "freeze_vision_encoder": True}, "freeze_vision_encoder=True needs use_multimodal=True"),
    ({"ici_sequence_parallelism": 2, "ici_fsdp_parallelism": 4}, "use_multimodal=True does not support pipeline or "
     "sequence (context) parallelism"),
])
def test_inconsistent_vision_keys_are_one_line_errors(overrides, message):
  with pytest.raises(ConfigError) as raised:
    Config.for_testing(**{**MULTIMODAL, **overrides})
  assert message in str(raised.value) and "\n" not in str(raised.value)


def test_a_text_only_model_refuses_pixel_values():
  config = Config.for_testing(base_num_decoder_layers=1, base_emb_dim=32, base_num_query_heads=2, base_num_kv_heads=2,
                              head_dim=16, base_mlp_dim=64, vocab_size=64, max_target_length=8)
  spec = models.build_model_spec(config.model)
  params = spec.init_params(jax.random.key(0))
  tokens = jnp.zeros((1, 8), jnp.int32)
  with sharding.unsharded(), pytest.raises(ValueError, match="pixel_values given to a text-only model"):
    spec.apply(params, tokens, tokens, tokens + 1, None, jnp.zeros((1, 1, 3, 8, 8)))


def test_vision_parameters_carry_logical_names(reference):
  _, config, _ = reference
  if config.model.decoder_block != "gemma3":
    pytest.skip("Gemma 3's parameter names (Llama 4's: tests/layers/test_llama4_vision_vs_hf.py)")
  names = models.build_model_spec(config.model).logical_names
  assert names["vision_encoder"]["layers"]["fc1"]["kernel"] == ("layers", "embed", "mlp")
  assert names["vision_encoder"]["layers"]["attention"]["query"]["kernel"] == ("layers", "embed", "heads", "kv")
  assert names["multimodal_projector"]["input_projection"]["kernel"] == (None, "embed")


@pytest.mark.parametrize("frozen", [(), pytest.param(("vision_encoder", "multimodal_projector"), marks=pytest.mark.slow)],
                         ids=["trains", "frozen"])
def test_a_multimodal_model_trains_sharded_on_text(tmp_path, frozen):
  """build_run on the 8-device mesh: the tower's parameters shard by their logical names (the
  replication check passes) and text-only batches train. Frozen (freeze_vision_encoder,
  freeze_multimodal_projector), the tower keeps its weights bitwise and has no optimizer state;
  otherwise weight decay moves them even without images."""
  config = Config.for_testing(**MULTIMODAL, base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16,
                              base_mlp_dim=96, base_num_decoder_layers=2, max_target_length=32, per_device_batch_size=1,
                              ici_fsdp_parallelism=8, base_output_directory=str(tmp_path), adam_weight_decay=0.1,
                              freeze_vision_encoder=bool(frozen), freeze_multimodal_projector=bool(frozen))
  run = train_utils.Run(config)
  shardings = run.setup.state_shardings.params
  assert shardings["vision_encoder"]["layers"]["fc1"]["kernel"].spec[1] == "fsdp"
  start = run.init()
  before = jax.device_get(start.params)
  state, history = run.train(start, 2)
  assert all(np.isfinite(h["loss"]) for h in history)
  assert state.params["multimodal_projector"]["input_projection"]["kernel"].shape == (32, 64)
  after = jax.device_get(state.params)
  for part in ("vision_encoder", "multimodal_projector"):
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before[part]), jax.tree.leaves(after[part])))
    assert same == (part in frozen), part
  assert not np.array_equal(before["decoder_norm"]["scale"], after["decoder_norm"]["scale"])
  moments = sum(x.size for x in jax.tree.leaves(state.opt_state))
  tower = sum(x.size for part in ("vision_encoder", "multimodal_projector") for x in jax.tree.leaves(before[part]))
  everything = sum(x.size for x in jax.tree.leaves(before))
  assert moments < 2 * (everything - tower) + 100 if frozen else moments >= 2 * everything
