"""Gated MLP: out = W_o · (act_0(W_0 x) * act_1(W_1 x) * ...); one activation is a plain MLP (GPT-3).

GPT-OSS's clamped SwiGLU is such a product too: clamped_swish on the gate projection,
min(x, limit) · sigmoid(alpha · min(x, limit)), times clamped_plus_one on the up projection,
clip(x, -limit, limit) + 1 (limit = swiglu_limit, alpha = swiglu_alpha).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.platform import sharding
from MaxText.configuration.model_config import ModelConfig
from MaxText.layers.linears import DenseGeneral, fused_outputs

ACTIVATION_FNS = {
    "silu": jax.nn.silu,
    "gelu": jax.nn.gelu,
    "relu": jax.nn.relu,
    "tanh": jnp.tanh,
    "linear": lambda x: x,
}

Activation = Callable[[jax.Array], jax.Array]


def clamped_swish(x: jax.Array, limit: float, alpha: float) -> jax.Array:
  x = jnp.minimum(x, limit) if limit > 0 else x
  return x * jax.nn.sigmoid(alpha * x)


def clamped_plus_one(x: jax.Array, limit: float) -> jax.Array:
  return (jnp.clip(x, -limit, limit) if limit > 0 else x) + 1


def activation_fns(cfg: ModelConfig) -> tuple[Activation, ...]:
  """The functions of cfg.mlp_activations, one per input projection, with their config parameters bound."""
  bound = {"clamped_swish": functools.partial(clamped_swish, limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha),
           "clamped_plus_one": functools.partial(clamped_plus_one, limit=cfg.swiglu_limit)}
  return tuple(bound[name] if name in bound else ACTIVATION_FNS[name] for name in cfg.mlp_activations)


def mlp_lora_targets(num_inputs: int) -> tuple[str, ...]:
  """PEFT's names of wi_0, wi_1, ...: gate and up projections; a one-activation MLP's wi_0 is the up projection.
  A third input projection has no PEFT name and gets no adapter."""
  names = ("gate_proj", "up_proj") if num_inputs > 1 else ("up_proj",)
  return tuple(names[i] if i < len(names) else "" for i in range(num_inputs))


class MlpBlock(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, mlp_dim: int | None = None):
    mlp_dim = mlp_dim or cfg.mlp_dim  # MoE shared experts are wider than one expert
    dense: dict[str, Any] = dict(dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype), rngs=rngs,
                 use_bias=cfg.use_bias)
    # Named wi_0, wi_1, ... (not a list) so checkpoints have string keys only.
    gated = len(cfg.mlp_activations) > 1  # remat names (remat_policies.TENSORS): mlpwi_0, mlpwi_1, or mlpwi
    for i, target in enumerate(mlp_lora_targets(len(cfg.mlp_activations))):
      setattr(self, f"wi_{i}", DenseGeneral((cfg.emb_dim,), (mlp_dim,), ("embed", "mlp"),
                                            tag=f"mlpwi_{i}" if gated else "mlpwi", **dense,
                                            **cfg.lora.adapter(target)))
    self.wo = DenseGeneral((mlp_dim,), (cfg.emb_dim,), ("mlp", "embed"), tag="mlpwo", **dense, **cfg.lora.adapter("down_proj"))
    self.activations = activation_fns(cfg)
    self.fused = cfg.fused_mlp and len(self.activations) > 1

  def __call__(self, x_BLD: jax.Array) -> jax.Array:
    inputs = [getattr(self, f"wi_{i}") for i in range(len(self.activations))]
    projected = fused_outputs(inputs, x_BLD, "mlpwi", part_tags=False) if self.fused else [wi(x_BLD) for wi in inputs]
    hidden_BLF: jax.Array | None = None
    for activation, y in zip(self.activations, projected):
      h = activation(y)
      hidden_BLF = h if hidden_BLF is None else hidden_BLF * h
    assert hidden_BLF is not None  # config validation requires at least one activation
    hidden_BLF = sharding.constrain(hidden_BLF, ("activation_batch", "activation_length", "activation_mlp"))
    return self.wo(hidden_BLF)
