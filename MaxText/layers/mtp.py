"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 §2.2): a training objective in which
module k (1..mtp_num_layers) predicts the token k+1 places past the next one.

Module k takes the previous module's output h (the decoder stack's final activations for k = 1,
before the final norm) and the embedding of the token k places ahead, and computes

    h' = eh_proj([enorm(embedding); hnorm(h)]),   h_k = layer(h'),   logits = head(final_norm(h_k))

where `layer` is one more decoder layer of the model's own kind and the embedding table and output
head are the model's (shared, as in the paper). At position i the target is t(i+k+1), i.e. the
ordinary target of position i+k; positions whose look-ahead leaves their packed document carry no
weight. The modules' losses are averaged over the depths and added to the training loss times
mtp_loss_scaling_factor. Speculative decoding may use module 0 as its draft (inference/mtp_draft.py).

The router correction bias of an MTP layer's MoE (DeepSeek-V3) keeps its initial or converted
value: the load-driven update reads the main stack's expert load only.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.layers.linears import DenseGeneral
from MaxText.layers.remat import CheckpointPolicy
from MaxText.layers.normalizations import make_norm
from MaxText.configuration.model_config import ModelConfig


def module_name(depth: int) -> str:
  """The parameter key of MTP module `depth` (0-based), beside `layers` in the parameter tree."""
  return f"mtp_{depth}"


def ahead(x_BL: jax.Array, k: int) -> jax.Array:
  """x shifted k positions to the left along the sequence, zero-filled at the end."""
  return jnp.pad(x_BL[:, k:], ((0, 0), (0, k)) + ((0, 0),) * (x_BL.ndim - 2))


class MtpModule(nnx.Module):
  def __init__(self, cfg: ModelConfig, layer_class: Callable[..., nnx.Module], *, rngs: nnx.Rngs):
    dtype, weight_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
    self.enorm = make_norm(cfg)
    self.hnorm = make_norm(cfg)
    # The concatenation's axis is not an activation axis the rules shard; the output is the model width.
    self.eh_proj = DenseGeneral((2 * cfg.emb_dim,), (cfg.emb_dim,), (None, "embed"), dtype=dtype,
                                weight_dtype=weight_dtype, rngs=rngs)
    self.layer = layer_class(cfg, rngs=rngs)
    self.final_norm = make_norm(cfg)

  def combine(self, embedded_BLD: jax.Array, h_BLD: jax.Array) -> jax.Array:
    return self.eh_proj(jnp.concatenate([self.enorm(embedded_BLD), self.hnorm(h_BLD)], axis=-1))


def run_layer(module: MtpModule, x_BLD: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,
              rng: jax.Array | None, layer_index: int, policy: CheckpointPolicy) -> jax.Array:
  """The module's decoder layer, rematerialised like the stack's (what it sows, e.g. the MoE
  load-balancing loss, is left out: the objective is the prediction loss)."""
  graphdef, state = nnx.split(module.layer)

  def apply(state: nnx.State[str | int, Any], x: jax.Array) -> jax.Array:
    layer = nnx.merge(graphdef, state)
    out, _ = nnx.capture(layer, nnx.Intermediate)(x, positions_BL, segment_ids_BL, rng,
                                                   jnp.asarray(layer_index, jnp.int32))
    return out

  if not isinstance(policy, str):
    apply = jax.checkpoint(apply, policy=policy)
  return apply(state, x_BLD)
