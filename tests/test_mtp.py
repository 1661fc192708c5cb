"""Multi-token prediction (layers/mtp.py): an objective that leaves the next-token model alone when
its weight is 0, sees nothing across packed documents, learns, and converts with DeepSeek-V3's
published layout (the module stored as layer num_hidden_layers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import models
from MaxText.platform import sharding
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from train_utils import Run


def _mtp(tiny_overrides, **overrides) -> Config:
  return Config.for_testing(**{**tiny_overrides, "dataset_type": "synthetic", "enable_checkpointing": False,
                               "ici_data_parallelism": 2, "ici_fsdp_parallelism": 4, **overrides})


@pytest.mark.slow  # the weighting's edge case; test_mtp_learns_to_predict_further_ahead trains MTP by default
def test_with_zero_weight_the_next_token_model_trains_exactly_as_without_mtp(tiny_overrides):
  plain = Run(_mtp(tiny_overrides))
  with_mtp = Run(_mtp(tiny_overrides, mtp_num_layers=2, mtp_loss_scaling_factor=0.0))
  plain_state, plain_history = plain.train(plain.init(), 3)
  mtp_state, mtp_history = with_mtp.train(with_mtp.init(), 3)
  assert set(mtp_state.params) == set(plain_state.params) | {"mtp_0", "mtp_1"}
  shared = {k: v for k, v in mtp_state.params.items() if not k.startswith("mtp_")}
  jax.tree.map(np.testing.assert_array_equal, shared, plain_state.params)
  assert [h["loss"] for h in mtp_history] == [h["loss"] for h in plain_history]
  assert all(4.0 < h["mtp_loss"] < 6.0 for h in mtp_history) and "mtp_loss" not in plain_history[0]


def _mtp_sums(spec, params, tokens, segments, positions):
  """The MTP sums for rows of packed documents, targets being each document's next token."""
  targets = jnp.roll(tokens, -1, axis=1)
  weights = ((jnp.roll(segments, -1, axis=1) == segments) & (segments != 0)).astype(jnp.float32)
  _, aux = sharding.unsharded()(spec.apply_with_aux)(params, tokens, positions, segments, None, (targets, weights))
  return float(aux["mtp_xent_sum"]), float(aux["mtp_weight_sum"])


def test_packed_documents_give_the_sums_of_each_document_alone(tiny_overrides):
  """Neither the look-ahead embedding nor the MTP layer's attention may cross a document boundary:
  two documents packed in one row give the MTP sums of the two run on their own."""
  config = _mtp(tiny_overrides, mtp_num_layers=2)
  spec = models.build_model_spec(config.model)
  params = jax.jit(spec.init_params)(jax.random.key(0))
  rng = np.random.default_rng(0)
  a, b = rng.integers(1, 100, 11), rng.integers(1, 100, 9)

  def row(*docs):
    pad = 20 - sum(map(len, docs))
    tokens = np.concatenate([*docs, np.zeros(pad, np.int64)])
    segments = np.concatenate([np.full(len(d), i + 1) for i, d in enumerate(docs)] + [np.zeros(pad, np.int64)])
    positions = np.concatenate([np.arange(len(d)) for d in docs] + [np.zeros(pad, np.int64)])
    return [jnp.asarray(x, jnp.int32)[None] for x in (tokens, segments, positions)]

  packed = _mtp_sums(spec, params, *row(a, b))
  first, second = _mtp_sums(spec, params, *row(a)), _mtp_sums(spec, params, *row(b))
  np.testing.assert_allclose(packed[0], first[0] + second[0], rtol=1e-5)
  # Depth k scores n - 1 - k positions of an n-token document.
  assert packed[1] == first[1] + second[1] == (11 - 2 + 11 - 3) + (9 - 2 + 9 - 3)


def test_mtp_learns_to_predict_further_ahead(tiny_overrides):
  run = Run(_mtp(tiny_overrides, mtp_num_layers=1, mtp_loss_scaling_factor=1.0, vocab_size=64, learning_rate=3e-3,
                 steps=40))
  _, history = run.train(run.init(), 40)
  assert np.mean([h["mtp_loss"] for h in history[-5:]]) < np.mean([h["mtp_loss"] for h in history[:3]]) - 0.5


def test_an_mtp_weight_that_is_not_finite_is_one_line():
  """inf passed `>= 0`: the gradients were NaN from the first step."""
  with pytest.raises(ConfigError, match=r"^mtp_num_layers must be >= 0 and mtp_loss_scaling_factor a finite float32 "
                                        r"number >= 0, got 1 and inf$"):
    Config.for_testing(mtp_num_layers=1, mtp_loss_scaling_factor=float("inf"))


def test_mtp_with_pipeline_stages_is_refused():
  with pytest.raises(ConfigError, match="mtp_num_layers > 0 is not supported with pipeline parallelism"):
    Config.for_testing(mtp_num_layers=1, ici_pipeline_parallelism=2, ici_fsdp_parallelism=-1,
                       base_num_decoder_layers=2)


def _with_published_mtp_layer(hf_dir, layers: int):
  """`hf_dir`'s safetensors plus a layer `layers` laid out as DeepSeek-V3's published MTP module:
  a decoder layer (layer layers-1's tensors, perturbed) and enorm/hnorm/eh_proj/shared_head."""
  from safetensors.numpy import load_file, save_file

  path = hf_dir / "model.safetensors"
  tensors = load_file(str(path))
  rng = np.random.default_rng(1)
  extra = {name.replace(f"model.layers.{layers - 1}.", f"model.layers.{layers}."):
           (value + rng.normal(size=value.shape).astype(value.dtype) * 0.01)
           for name, value in tensors.items() if name.startswith(f"model.layers.{layers - 1}.")}
  width = tensors["model.embed_tokens.weight"].shape[1]
  prefix = f"model.layers.{layers}."
  extra.update({prefix + "enorm.weight": rng.normal(size=width).astype(np.float32),
                prefix + "hnorm.weight": rng.normal(size=width).astype(np.float32),
                prefix + "eh_proj.weight": rng.normal(size=(width, 2 * width)).astype(np.float32),
                prefix + "shared_head.norm.weight": rng.normal(size=width).astype(np.float32),
                prefix + "embed_tokens.weight": tensors["model.embed_tokens.weight"],
                prefix + "shared_head.head.weight": tensors["lm_head.weight"]})
  save_file({**tensors, **extra}, str(path), metadata={"format": "pt"})
  return {**tensors, **extra}


def test_deepseek3_mtp_layer_converts_both_ways(tmp_path):
  import hf_families as H
  from safetensors.numpy import load_file
  from MaxText.convert import hf_to_maxtext, maxtext_to_hf
  from tests.test_convert import _load

  model = H.build_hf_model("deepseek3")
  layers = model.config.num_hidden_layers
  model.save_pretrained(str(tmp_path / "hf"))
  published = _with_published_mtp_layer(tmp_path / "hf", layers)
  hf_to_maxtext.convert(str(tmp_path / "hf"), str(tmp_path / "without"), [])  # the layer is skipped
  assert not any(k.startswith("mtp_") for k in _load(tmp_path / "without", True))
  hf_to_maxtext.convert(str(tmp_path / "hf"), str(tmp_path / "ckpt"), ["mtp_num_layers=1"])
  params = _load(tmp_path / "ckpt", True)
  prefix = f"model.layers.{layers}."
  np.testing.assert_array_equal(params["mtp_0"]["eh_proj"]["kernel"], published[prefix + "eh_proj.weight"].T)
  np.testing.assert_array_equal(params["mtp_0"]["final_norm"]["scale"], published[prefix + "shared_head.norm.weight"])
  np.testing.assert_array_equal(params["mtp_0"]["layer"]["mlp"]["gate"]["kernel"],
                                published[prefix + "mlp.gate.weight"].T)
  maxtext_to_hf.export(str(tmp_path / "ckpt"), str(tmp_path / "back"), [])
  written = load_file(str(tmp_path / "back" / "model.safetensors"))
  copies = (prefix + "embed_tokens.weight", prefix + "shared_head.head.weight")  # shared tensors: not written twice
  assert set(written) == set(published) - set(copies)
  for name, value in written.items():
    np.testing.assert_array_equal(value, published[name], err_msg=name)


def test_a_family_without_an_mtp_layout_refuses_to_convert_one(tmp_path):
  import hf_families as H
  from MaxText.convert import hf_to_maxtext

  H.build_hf_model("llama3.1").save_pretrained(str(tmp_path / "hf"))
  with pytest.raises(ConfigError, match="the llama converter has no multi-token-prediction layout"):
    hf_to_maxtext.convert(str(tmp_path / "hf"), str(tmp_path / "ckpt"), ["mtp_num_layers=1"])


def test_the_flops_formula_counts_the_mtp_modules():
  """XLA's count of one forward loss pass with an MTP module, minus without, against the formula's
  difference (float32, unrolled: XLA counts a scan body once)."""
  from MaxText.training import metrics
  from MaxText.training.objectives.language_model import LanguageModel

  shape = dict(base_emb_dim=256, base_num_query_heads=4, base_num_kv_heads=2, head_dim=64, base_mlp_dim=1024,
               base_num_decoder_layers=2, vocab_size=512, max_target_length=128, scan_layers=False,
               ici_data_parallelism=8, ici_fsdp_parallelism=1, print_config=False)
  counted = {}
  for depth in (0, 1):
    config = Config.for_testing(**shape, mtp_num_layers=depth)
    spec = models.build_model_spec(config.model)
    tokens = jax.ShapeDtypeStruct((2, 128), jnp.int32)
    batch = {name: tokens for name in ("inputs", "inputs_position", "inputs_segmentation", "targets",
                                       "targets_segmentation")}
    lowered = jax.jit(sharding.unsharded()(lambda p, b: LanguageModel(spec, 0.0).loss_sums(p, None, b, None)[0]))
    cost = lowered.lower(spec.abstract_params, batch).compile().cost_analysis()
    counted[depth] = ((cost[0] if isinstance(cost, list) else cost)["flops"],
                      2 * sum(metrics.forward_flops_per_sequence(config.model, 128)))
  xla = counted[1][0] - counted[0][0]
  ours = counted[1][1] - counted[0][1]
  # XLA also counts the softmaxes, norms and the loss (a few elementwise ops per activation).
  assert ours <= xla <= 1.08 * ours, (ours, xla)
