"""Qwen3.5 (MaxText/families/qwen3_5.py) beyond the generic family tests: its multimodal RoPE reduces to plain
partial RoPE on text, and an image-text checkpoint's text decoder converts with its vision tower left out."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hf_families as H
from MaxText.configuration import config as config_lib
from MaxText.convert import hf_to_maxtext
from MaxText.families import tensor_maps
from MaxText.families import qwen3_5
from MaxText import models
from MaxText.layers.gated_deltanet import GatedDeltaNet
from MaxText.platform import sharding

# The published configs' rotary layout: head_dim 256, a quarter rotated (32 frequencies in sections of 11, 11, 10).
_PUBLISHED_ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                   "mrope_section": [11, 11, 10], "mrope_interleaved": True}
_VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, temporal_patch_size=2,
               spatial_merge_size=2, num_position_embeddings=16)


def _rotary_tables(positions_3BL):
  modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
  config = H.transformers.Qwen3_5TextConfig(hidden_size=64, num_attention_heads=4, head_dim=256,
                                            rope_parameters=_PUBLISHED_ROPE)
  rotary = modeling.Qwen3_5TextRotaryEmbedding(config)
  with H.torch.no_grad():
    cos, sin = rotary(H.torch.zeros(1, dtype=H.torch.float32), H.torch.tensor(positions_3BL))
  return cos.numpy(), sin.numpy()


def test_text_positions_make_the_multimodal_rope_plain_partial_rope():
  """HF's interleaved M-RoPE (frequencies taken in turn from the temporal, height and width positions) with a
  text token's three equal positions is the halves-layout partial RoPE we run: cos/sin of position x theta^(-2j/64)
  over 64 of 256 features. Distinct image positions would give other tables, which is why images are unsupported."""
  positions = np.arange(40)[None, :]
  cos, sin = _rotary_tables(np.stack([positions] * 3))
  rotated = int(256 * _PUBLISHED_ROPE["partial_rotary_factor"])
  inverse_frequency = _PUBLISHED_ROPE["rope_theta"] ** (-np.arange(0, rotated, 2) / rotated)
  angles = positions[..., None] * inverse_frequency[None, None, :]
  np.testing.assert_allclose(cos, np.cos(np.concatenate([angles, angles], -1)), atol=2e-6)
  np.testing.assert_allclose(sin, np.sin(np.concatenate([angles, angles], -1)), atol=2e-6)
  image = np.stack([positions, positions // 4, positions % 4])  # an image's own height and width positions
  assert np.abs(_rotary_tables(image)[0] - cos).max() > 0.1


def test_a_deltanet_layer_through_the_tensor_table_equals_hf():
  """One Gated DeltaNet layer with HF's Qwen3.5 weights (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a laid out as
  Qwen3.5 lays them out) put in place by the family's tensor table computes HF's Qwen3_5GatedDeltaNet, over two
  DeltaNet chunk boundaries of ours."""
  modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
  shape = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
               linear_conv_kernel_dim=4)
  hf_config = H.transformers.Qwen3_5TextConfig(hidden_size=32, rms_norm_eps=1e-2, **shape)
  H.torch.manual_seed(0)
  hf_layer = H.randomize(modeling.Qwen3_5GatedDeltaNet(hf_config, layer_idx=0).eval(), 0)
  config = config_lib.Config.for_testing(decoder_block="qwen3_5", attention_type="gated_deltanet", base_emb_dim=32,
                                         normalization_layer_epsilon=1e-2, linear_attention_chunk_size=8,
                                         dtype="float32", max_target_length=21, print_config=False, **shape)
  with nnx.use_eager_sharding(False):
    layer = GatedDeltaNet(config.model, rngs=nnx.Rngs(params=0))
  prefix = "model.layers.{i}.linear_attn."
  weights = {name: w.detach().numpy() for name, w in hf_layer.state_dict().items()}
  entries = [m for m in qwen3_5.qwen3_5_tensors(config.model) if m.write and m.hf.startswith(prefix)]
  assert sorted(m.hf[len(prefix):] for m in entries) == sorted(weights)
  for m in entries:
    for path, value in zip(m.ours, m.to_ours(weights[m.hf[len(prefix):]], config.model)):
      node = layer
      for part in path.split("/")[1:]:  # past "self_attention"
        node = getattr(node, part)
      assert node.shape == value.shape, path
      node[...] = jnp.asarray(value)
  x = np.random.default_rng(0).normal(size=(2, 21, 32)).astype(np.float32)
  positions = np.broadcast_to(np.arange(21), (2, 21))
  with sharding.unsharded():
    ours = nnx.jit(lambda layer, *args: layer(*args))(layer, x, positions, np.ones((2, 21), np.int32))
  with H.torch.no_grad():
    expected = hf_layer(H.torch.tensor(x)).numpy()
  np.testing.assert_allclose(np.asarray(ours), expected, atol=2e-5, rtol=0)


def _multimodal_model(family: str):
  """A tiny image-text Qwen3.5 (Qwen3_5ForConditionalGeneration or its MoE) whose text decoder is the family's
  reference model."""
  text = dict(H.REFERENCE_CONFIGS[family])
  model_type = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}[text.pop("model_type")]
  config = H.transformers.AutoConfig.for_model(model_type, text_config=text,
                                               vision_config=dict(_VISION, out_hidden_size=text["hidden_size"]))
  H.torch.manual_seed(0)
  model = H.transformers.AutoModelForImageTextToText.from_config(config, attn_implementation="eager").eval()
  return H.randomize(model, 0)


def _text_model(multimodal):
  """The same weights as a text-only causal LM (its text decoder's tensors renamed from model.language_model.)."""
  config = multimodal.config.text_config
  config.tie_word_embeddings = multimodal.config.tie_word_embeddings
  text = H.transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
  prefix = tensor_maps.TEXT_DECODER_PREFIX
  weights = {("model." + k[len(prefix):] if k.startswith(prefix) else k): v
             for k, v in multimodal.state_dict().items() if not k.startswith(qwen3_5.LEFT_OUT)}
  text.load_state_dict(weights, strict=True)
  return text


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_a_multimodal_checkpoint_gives_its_text_decoders_parameters(family, tmp_path):
  """Read through the tensor table, an image-text model's tensors (text decoder under model.language_model.,
  vision tower under model.visual.) give exactly the parameters of the same text decoder saved alone; its
  config.json's text_config gives the same model keys."""
  multimodal = _multimodal_model(family)
  text = _text_model(multimodal)
  keys = H.families.family_for_hf_config(multimodal.config.to_dict()).model_keys(multimodal.config.to_dict())
  assert keys == H.families.family_for_hf_config(text.config.to_dict()).model_keys(text.config.to_dict())
  config = config_lib.Config.for_testing(**keys, max_target_length=H.LENGTH, print_config=False)
  from_multimodal = H.our_params(multimodal, config, tmp_path / "multimodal")
  from_text = H.our_params(text, config, tmp_path / "text")
  jax.tree.map(np.testing.assert_array_equal, from_multimodal, from_text)


@pytest.mark.slow  # ~30 s: an image-text model saved, converted and run
def test_a_multimodal_checkpoint_converts_with_its_vision_tower_left_out(tmp_path, capsys):
  """The saved image-text checkpoint converts (saying in one line that its vision tower was left out) to a model
  whose logits on text are the HF text decoder's."""
  multimodal = _multimodal_model("qwen3_5")
  multimodal.save_pretrained(str(tmp_path / "hf"))
  hf_to_maxtext.convert(str(tmp_path / "hf"), str(tmp_path / "ckpt"), [])
  out = capsys.readouterr().out
  assert "is a multimodal checkpoint (qwen3_5): its text decoder was converted and its vision tower was left out" in out
  config, params = H.converted_checkpoint(tmp_path / "ckpt")
  token_ids = H.tokens()
  # Other random weights than the reference model's (the vision tower draws from the same generator): a DeltaNet
  # chunk's inverted triangular system carries summation-order differences a little further here (2.8e-5 seen at
  # single logits); a wrong or missing tensor moves logits by >= 0.1.
  np.testing.assert_allclose(H.our_logits(config, params, token_ids), H.hf_logits(_text_model(multimodal), token_ids),
                             atol=1e-4, rtol=0)
