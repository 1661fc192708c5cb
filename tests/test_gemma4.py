"""Gemma 4 beyond the shared family tests: KV sharing changes the model, the logit checker fails on a
corrupted weight of the converted checkpoint, an unsupported checkpoint is one `error:` line with nothing
written, a multimodal checkpoint converts its text decoder, each layer picks its kernel, and the server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import hf_families as H
from MaxText import logit_checker
from MaxText.configuration import config as config_lib
from MaxText.convert import hf_to_maxtext
from MaxText import models
from MaxText.layers import attention, layer_shapes
from MaxText.training import params_io

REPO = Path(__file__).resolve().parent.parent
BASE = str(REPO / "configs" / "base.yml")


def test_kv_sharing_changes_the_model(tmp_path):
  """An HF model whose every layer has its own keys and values, read as if its last 3 layers shared
  (their own projections skipped): the logits move, so sharing is not a no-op on our side."""
  fields = {**H.REFERENCE_CONFIGS["gemma4"], "num_kv_shared_layers": 0, "use_double_wide_mlp": False}
  config = H.transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
  H.torch.manual_seed(0)
  model = H.randomize(H.transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval(), 0)
  token_ids = H.tokens()
  expected = H.hf_logits(model, token_ids)
  same = H.our_config(model, dtype="float32")
  # The unshared model matches (its parity proper is test_families_vs_hf's; this one, 6 layers of own keys, sums
  # a little more rounding); the shared reading then moves the logits by orders of magnitude more.
  np.testing.assert_allclose(H.our_logits(same, H.our_params(model, same, tmp_path / "own"), token_ids), expected,
                             atol=1e-4, rtol=0)
  shared = H.our_config(model, dtype="float32", num_kv_shared_layers=3)
  params = H.our_params(model, shared, tmp_path / "shared")
  assert "key" not in params["layers_5"]["self_attention"]
  assert np.abs(H.our_logits(shared, params, token_ids) - expected).max() > 1e-2


def test_kv_shared_layers_with_single_width_mlps_match_hf(tmp_path):
  """E4B's layout: KV-shared layers whose MLPs keep their width (use_double_wide_mlp off), against HF."""
  fields = {**H.REFERENCE_CONFIGS["gemma4"], "use_double_wide_mlp": False}
  config = H.transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
  H.torch.manual_seed(0)
  model = H.randomize(H.transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval(), 0)
  token_ids = H.tokens()
  ours = H.our_config(model, dtype="float32")
  assert ours.model.layer_shapes.num_kv_shared_layers == 3 and not ours.model.layer_shapes.kv_shared_double_mlp
  params = H.our_params(model, ours, tmp_path / "ckpt")
  assert params["layers_5"]["mlp"]["wo"]["kernel"].shape[0] == fields["intermediate_size"]
  np.testing.assert_allclose(H.our_logits(ours, params, token_ids), H.hf_logits(model, token_ids),
                             atol=H.CHECKER_FP32_ATOL["gemma4"], rtol=0)


@pytest.mark.slow  # ~25 s: a conversion and two checker runs
def test_corrupting_one_weight_makes_the_checker_fail(tmp_path):
  hf_dir = tmp_path / "hf"
  H.build_hf_model("gemma4").save_pretrained(str(hf_dir))
  ckpt = tmp_path / "ckpt"
  hf_to_maxtext.convert(str(hf_dir), str(ckpt), [])
  args = [f"hf_model_path={hf_dir}", "dtype=float32", H.checker_atol("gemma4"), "max_kl=1e-9"]
  assert logit_checker.main(["logit_checker", BASE, f"load_parameters_path={ckpt}", *args]) == 0
  config = config_lib.Config.for_testing(load_parameters_path=str(ckpt), print_config=False)
  spec = models.build_model_spec(config.model)
  one_device = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",)),
                                          jax.sharding.PartitionSpec())
  params = jax.tree.map(np.array, params_io.load_params(str(ckpt), spec.abstract_params,
                                                        jax.tree.map(lambda _: one_device, spec.abstract_params)))
  params["layers_4"]["mlp"]["wo"]["kernel"][3, 5] += 0.5  # one number in a KV-shared layer's MLP
  corrupt = tmp_path / "corrupt"
  params_io.save_params(str(corrupt), params)
  (corrupt / config_lib.MODEL_CONFIG_FILE).write_text((ckpt / config_lib.MODEL_CONFIG_FILE).read_text())
  assert logit_checker.main(["logit_checker", BASE, f"load_parameters_path={corrupt}", *args]) == 1


def test_unsupported_checkpoint_is_one_error_line_and_nothing_written(tmp_path):
  """Bidirectional attention over all tokens (use_bidirectional_attention="all") is not built here."""
  hf_dir = tmp_path / "hf"
  hf_dir.mkdir()
  fields = {**H.REFERENCE_CONFIGS["gemma4"], "use_bidirectional_attention": "all"}
  (hf_dir / "config.json").write_text(json.dumps(fields))
  out = tmp_path / "out"
  proc = subprocess.run([sys.executable, "-m", "MaxText.convert.hf_to_maxtext", f"hf_model_path={hf_dir}",
                         f"output_path={out}"], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "use_bidirectional_attention" in errors[0], proc.stderr[-2000:]
  assert not out.exists()


def test_multimodal_config_reads_its_text_decoder():
  text = dict(H.REFERENCE_CONFIGS["gemma4"])
  family = H.families.family_for_hf_config({"model_type": "gemma4", "text_config": text})
  assert family.name == "gemma4"
  assert family.model_keys({"model_type": "gemma4", "text_config": text}) == family.model_keys(text)


def test_each_layer_picks_its_kernel_from_the_table_with_its_own_head_shape():
  """The kernel table sees each layer's own configuration: on GPU, cuDNN's head-width limit keeps the
  sliding layers (head_dim 128) on cuDNN and sends the global ones (256) to the chunked flash kernel."""
  keys = H.families.families()["gemma4"].model_keys(dict(H.REFERENCE_CONFIGS["gemma4"]))
  cfg = config_lib.Config.for_testing(**{**keys, "head_dim": 128, "global_head_dim": 256, "dtype": "bfloat16",
                              "print_config": False}).model
  chosen = [attention.select_kernel("autoselected", "gpu", layer_shapes.layer_config(cfg, i)) for i in range(3)]
  assert chosen == ["cudnn_flash", "cudnn_flash", "flash"]


@pytest.mark.parametrize("overrides, message", [
    ({"ici_pipeline_parallelism": 2, "ici_fsdp_parallelism": 4},
     "per-layer shapes (global_head_dim, global_num_kv_heads, attention_k_eq_v, use_v_norm, num_kv_shared_layers, "
     "kv_shared_double_mlp, per_layer_input_dim) do not support pipeline parallelism"),
    ({"num_experts": 4}, "num_experts=4 with per-layer shapes (global_head_dim, "),
])
def test_per_layer_shape_errors_name_the_keys_that_make_the_layers_differ(overrides, message):
  """The errors name the keys set (the feature), not a decoder block."""
  keys = H.families.families()["gemma4"].model_keys(dict(H.REFERENCE_CONFIGS["gemma4"]))
  with pytest.raises(config_lib.ConfigError) as raised:
    config_lib.Config.for_testing(**{**keys, **overrides, "print_config": False})
  assert message in str(raised.value) and "\n" not in str(raised.value) and "gemma4" not in str(raised.value)


@pytest.mark.slow  # ~25 s: an image-text model built, saved and converted
def test_multimodal_checkpoint_converts_its_text_decoder(tmp_path):
  """A Gemma4ForConditionalGeneration checkpoint: its text decoder (under model.language_model) converts, the
  vision tower and its embedder are skipped, and our logits are the HF model's on text."""
  text = dict(H.REFERENCE_CONFIGS["gemma4"])
  text.pop("model_type")
  config = H.transformers.Gemma4Config(
      text_config=text, audio_config=None,
      vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=16))
  H.torch.manual_seed(0)
  model = H.randomize(H.transformers.Gemma4ForConditionalGeneration(config).eval(), 0)
  model.save_pretrained(str(tmp_path / "hf"))
  hf_to_maxtext.convert(str(tmp_path / "hf"), str(tmp_path / "ckpt"), [])
  ours, params = H.converted_checkpoint(tmp_path / "ckpt")
  token_ids = H.tokens()
  # Other random weights than the reference model's: Gemma 4's unscaled scores carry summation-order
  # differences a little further (a few 1e-5 seen at single positions); a wrong tensor moves logits by >= 0.1.
  np.testing.assert_allclose(H.our_logits(ours, params, token_ids), H.hf_logits(model, token_ids), atol=1e-4, rtol=0)


@pytest.mark.slow  # ~30 s: a server, its compiles and an uncached reference
def test_served_greedy_completion_equals_uncached_decoding(tmp_path):
  """MaxText.serve on a Gemma 4 model (paged cache, KV-shared layers reading their sources' pages): an OpenAI
  completion request's greedy tokens are the full forward pass's."""
  httpx = pytest.importorskip("httpx")
  pytest.importorskip("uvicorn")
  sys.path.insert(0, str(REPO / "tests" / "inference"))
  sys.path.insert(0, str(REPO / "tests" / "input_pipeline"))
  from decode_test_utils import one_device_mesh, uncached_greedy
  from sft_fixtures import CHATML, write_tokenizer, without_markers
  from tests.uvicorn_thread import UvicornThread
  from MaxText.serve import build_app, build_server
  keys = H.families.families()["gemma4"].model_keys(dict(H.REFERENCE_CONFIGS["gemma4"]))
  config = config_lib.Config.for_testing(
      **{**keys, "vocab_size": 272, "per_layer_input_vocab_size": 272}, max_target_length=32,
      max_prefill_predict_length=16, dtype="float32", print_config=False, tokenizer_type="huggingface",
      add_bos=False, kv_cache_layout="paged", kv_page_size=4, kv_num_pages=16, serve_max_slots=2,
      serve_model_name="tiny", tokenizer_path=str(write_tokenizer(tmp_path / "tok", without_markers(CHATML))))
  server = build_server(config, mesh=one_device_mesh())
  http = UvicornThread(build_app(server, api_key="k", max_body_bytes=4096))
  try:
    prompt = [5, 17, 42, 7, 99, 3, 64, 20, 11]
    reply = httpx.post(f"{http.url}/v1/completions", headers={"Authorization": "Bearer k"}, timeout=120,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}).json()
    expected = uncached_greedy(server.scheduler.engine.spec, server.scheduler.params, prompt, 12, 32)
    assert reply["choices"][0]["text"] == server.codec.decode(expected[:reply["usage"]["completion_tokens"]])
    assert reply["usage"]["completion_tokens"] >= 1
  finally:
    http.close()
    server.scheduler.stop()
