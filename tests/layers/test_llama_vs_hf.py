"""The decoder equals Hugging Face transformers' Llama (CPU torch) on a tiny random config."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import models
from MaxText.config import Config

torch = pytest.importorskip("torch", reason="needs torch (EXTRAS=test bash setup.sh)")
transformers = pytest.importorskip("transformers", reason="needs transformers (EXTRAS=test bash setup.sh)")

D, N, K, H, F, V, LAYERS = 64, 4, 2, 16, 128, 128, 2


def hf_to_params(hf_state: dict, num_layers: int) -> dict:
  """HF Llama state dict → our unscanned parameter dict (torch Linear weights are [out, in])."""
  w = {k: v.detach().float().numpy() for k, v in hf_state.items()}
  params = {
      "token_embedder": {"embedding": w["model.embed_tokens.weight"]},
      "decoder_norm": {"scale": w["model.norm.weight"]},
      "logits_dense": {"kernel": w["lm_head.weight"].T},
  }
  for i in range(num_layers):
    p = f"model.layers.{i}."
    params[f"layers_{i}"] = {
        "pre_self_attention_layer_norm": {"scale": w[p + "input_layernorm.weight"]},
        "post_self_attention_layer_norm": {"scale": w[p + "post_attention_layernorm.weight"]},
        "self_attention": {
            "query": {"kernel": w[p + "self_attn.q_proj.weight"].T.reshape(D, N, H)},
            "key": {"kernel": w[p + "self_attn.k_proj.weight"].T.reshape(D, K, H)},
            "value": {"kernel": w[p + "self_attn.v_proj.weight"].T.reshape(D, K, H)},
            "out": {"kernel": w[p + "self_attn.o_proj.weight"].T.reshape(N, H, D)},
        },
        "mlp": {
            "wi_0": {"kernel": w[p + "mlp.gate_proj.weight"].T},
            "wi_1": {"kernel": w[p + "mlp.up_proj.weight"].T},
            "wo": {"kernel": w[p + "mlp.down_proj.weight"].T},
        },
    }
  return params


@pytest.mark.parametrize("scan_layers", [False, True])
def test_logits_match_hf_llama(scan_layers):
  torch.manual_seed(0)
  hf_config = transformers.LlamaConfig(
      vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=LAYERS, num_attention_heads=N,
      num_key_value_heads=K, head_dim=H, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
      tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
  hf_model = transformers.LlamaForCausalLM(hf_config).eval()
  config = Config.for_testing(base_emb_dim=D, base_num_query_heads=N, base_num_kv_heads=K, head_dim=H, base_mlp_dim=F,
                              base_num_decoder_layers=LAYERS, vocab_size=V, rope_max_timescale=10000,
                              normalization_layer_epsilon=1e-5, dtype="float32", scan_layers=scan_layers,
                              print_config=False)
  params = hf_to_params(hf_model.state_dict(), LAYERS)
  if scan_layers:
    params = models.stack_layers(params, LAYERS)
  spec = models.build_model_spec(config.model)
  assert jax.tree.structure(spec.abstract_params) == jax.tree.structure(params)

  tokens = np.random.default_rng(0).integers(0, V, size=(2, 24))
  with torch.no_grad():
    expected = hf_model(torch.tensor(tokens)).logits.float().numpy()
  positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
  ours = spec.apply(params, jnp.asarray(tokens), jnp.asarray(positions), jnp.ones(tokens.shape, jnp.int32))
  np.testing.assert_allclose(np.asarray(ours), expected, atol=2e-4, rtol=2e-4)
