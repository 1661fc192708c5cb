"""Tiny random Hugging Face models, one per family, with each family's distinctive features on,
and helpers to run them and our converted copy on the same tokens.

Every parameter is randomised (HF initialises norms to 1 or 0 and biases to 0, which would hide
a swapped norm or a dropped bias).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401 (re-exported for tests)
import numpy as np

from MaxText import models
from MaxText.config import Config
from MaxText.convert import engine, registry

torch = __import__("pytest").importorskip("torch", reason="needs torch (EXTRAS=test bash setup.sh)")
transformers = __import__("pytest").importorskip("transformers", reason="needs transformers (EXTRAS=test bash setup.sh)")

BATCH, LENGTH, VOCAB = 2, 24, 128
_LLAMA_SHAPES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


def hf_config(family: str) -> Any:
  """The tiny HF config of `family`: GQA everywhere it exists, windows shorter than LENGTH,
  soft caps small enough to bend the logits, Llama 3.1 scaling that moves real frequencies."""
  if family == "llama3.1":
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    return transformers.LlamaConfig(**_LLAMA_SHAPES, rms_norm_eps=1e-5, rope_parameters=rope)
  if family == "llama2-tied":
    return transformers.LlamaConfig(**_LLAMA_SHAPES, rms_norm_eps=1e-5, tie_word_embeddings=True)
  if family == "mistral":
    return transformers.MistralConfig(**_LLAMA_SHAPES, rms_norm_eps=1e-5, sliding_window=5)
  if family == "gemma":  # multi-query, heads wider than emb_dim / num_heads (as Gemma 7B)
    return transformers.GemmaConfig(**{**_LLAMA_SHAPES, "num_key_value_heads": 1, "head_dim": 32})
  if family == "gemma2":
    return transformers.Gemma2Config(**{**_LLAMA_SHAPES, "num_hidden_layers": 3}, sliding_window=6,
                                     attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                     query_pre_attn_scalar=24)
  if family == "gpt3":
    return transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)
  raise ValueError(family)


FAMILIES = ("llama3.1", "llama2-tied", "mistral", "gemma", "gemma2", "gpt3")


def build_hf_model(family: str, seed: int = 0) -> Any:
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(hf_config(family), attn_implementation="eager").eval()
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for param in model.parameters():
      noise = torch.randn(param.shape, generator=generator)
      # Vectors (norm gains, biases) move off their 1/0 init; matrices get O(1/sqrt(64)) entries.
      param.copy_(param + 0.1 * noise if param.ndim == 1 else 0.15 * noise)
  return model


def hf_config_dict(model: Any) -> dict:
  return model.config.to_dict()


def our_config(model: Any, **overrides: Any) -> Config:
  """Our config for `model`, every architecture key inferred from its HF config."""
  family = registry.family_for_hf_config(hf_config_dict(model))
  keys = {**family.model_keys(hf_config_dict(model)), "max_target_length": LENGTH, "print_config": False}
  return Config.for_testing(**{**keys, **overrides})


def our_params(model: Any, config: Config, staging_dir: Path) -> Any:
  """HF state dict → our parameter tree through the converter's tensor table."""
  family = registry.family_for_hf_config(hf_config_dict(model))
  spec = models.build_model_spec(config.model)
  staging_dir.mkdir(parents=True, exist_ok=True)
  staged = engine.StagedParams(spec.abstract_params, str(staging_dir), config.model.weight_dtype)
  tensors = ((name, t.detach().float().numpy()) for name, t in model.state_dict().items())
  engine.stage_hf_tensors(tensors, family, config.model, staged)
  return jax.tree.map(np.array, staged.tree())


def tokens(seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, VOCAB, size=(BATCH, LENGTH))


def hf_logits(model: Any, token_ids: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(token_ids)).logits.float().numpy()


def our_logits(config: Config, params: Any, token_ids: np.ndarray) -> np.ndarray:
  spec = models.build_model_spec(config.model)
  positions = np.broadcast_to(np.arange(token_ids.shape[1]), token_ids.shape)
  apply = jax.jit(spec.apply)
  return np.asarray(apply(params, jnp.asarray(token_ids), jnp.asarray(positions), jnp.ones(token_ids.shape, jnp.int32)))


def round_to_bfloat16(model: Any) -> Any:
  """The same model with every weight rounded to bfloat16 (kept in float32)."""
  with torch.no_grad():
    for param in model.parameters():
      param.copy_(param.to(torch.bfloat16).float())
  return model
