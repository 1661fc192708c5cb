"""The model as the rest of the code holds it: `ModelSpec` (the graph, the abstract parameters and
their logical axis names; init, apply, decode) around the Transformer (transformer.py), and the
parameter-tree helpers (layer stacks, shardings).

Parameters live outside the module as a plain nested dict (`params`), so the
train state, optimizer, checkpoints and converters all see ordinary pytrees;
`ModelSpec.apply` merges them back into the NNX module inside the jitted step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from MaxText.configuration.model_config import ModelConfig
from MaxText.layers.moe import update_correction_biases
from MaxText.models.outputs import AuxLosses
from MaxText.models.transformer import Transformer
from MaxText.platform import sharding

Params = dict[str, Any]  # nested dict of arrays (or of ShapeDtypeStructs, shardings, ...)


def _logical_names(variable: nnx.Variable[Any]) -> tuple[str | None, ...]:
  names = variable.get_metadata().get("out_sharding")
  if names is None:
    raise ValueError(f"parameter of shape {variable.shape} has no logical axis names")
  return tuple(names)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """Everything about the model except its parameter values."""

  cfg: ModelConfig
  graphdef: nnx.GraphDef[Transformer]
  abstract_params: Params  # nested dict of ShapeDtypeStruct
  logical_names: dict[str, Any]  # nested dict (same structure) of tuples of logical axis names

  def init_params(self, rng: jax.Array) -> Params:
    """Fresh parameters as a nested dict; jit this with out_shardings to create them sharded."""
    with nnx.use_eager_sharding(False):
      model = Transformer(self.cfg, rngs=nnx.Rngs(params=rng))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))

  def module(self, params: Params) -> Transformer:
    """The model with `params` (inside a jitted function: what a loss driver takes apart)."""
    return nnx.merge(self.graphdef, params)

  def after_update(self, new_params: Params, old_params: Params, sums: Mapping[str, jax.Array], num_micro: int
                   ) -> Params:
    """The optimizer's new parameters with what the model sets itself: each MoE layer's correction
    bias follows the expert load (`moe_load` summed over `num_micro` micro-batches), not the
    optimizer; the step's non-finite check comes after, and then keeps the old bias too."""
    if not self.cfg.moe.moe_score_correction_bias:
      return new_params
    load_NE = sums["moe_load"] / num_micro if "moe_load" in sums else None
    return update_correction_biases(new_params, old_params, load_NE, self.cfg.moe.moe_bias_update_rate)

  def apply(self, params: Params, tokens_BL: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,
            dropout_rng: jax.Array | None = None, pixel_values: jax.Array | None = None) -> jax.Array:
    """Float32 logits [B, L, V]; `pixel_values` [B, M, 3, R, R]: a multimodal model's images."""
    model = nnx.merge(self.graphdef, params)
    return model(tokens_BL, positions_BL, segment_ids_BL, dropout_rng, pixel_values)

  def apply_with_aux(self, params: Params, tokens_BL: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,
                     dropout_rng: jax.Array | None = None, mtp_targets: tuple[jax.Array, jax.Array] | None = None,
                     pixel_values: jax.Array | None = None) -> tuple[jax.Array, AuxLosses]:
    """(logits, auxiliary losses): what the train step needs (e.g. the MoE load-balancing loss, the
    multi-token-prediction sums with `mtp_targets`)."""
    model = nnx.merge(self.graphdef, params)
    return model.logits_and_aux(tokens_BL, positions_BL, segment_ids_BL, dropout_rng, mtp_targets, pixel_values)

  def apply_loss_sums(self, params: Params, tokens_BL: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,
                      targets_BL: jax.Array, weights_BL: jax.Array, z_loss_multiplier: float,
                      dropout_rng: jax.Array | None = None, mtp_targets: tuple[jax.Array, jax.Array] | None = None,
                      pixel_values: jax.Array | None = None) -> tuple[dict[str, jax.Array], AuxLosses]:
    """({xent_sum, z_loss_sum} of the next-token loss, auxiliary losses): `apply_with_aux` with the
    loss taken in place of the logits, so num_vocab_tiling can keep them from existing whole."""
    model = nnx.merge(self.graphdef, params)
    return model.loss_sums_and_aux(tokens_BL, positions_BL, segment_ids_BL, targets_BL, weights_BL, z_loss_multiplier,
                                   dropout_rng, mtp_targets, pixel_values)

  def apply_decode(self, params: Params, tokens_BL: jax.Array, positions_BL: jax.Array, caches: Any,
                   logits_index_B: jax.Array | None = None, pixel_values: jax.Array | None = None
                   ) -> tuple[jax.Array, Any]:
    """(float32 logits [B, L, V] or [B, 1, V], updated caches): one prefill or generate pass
    (see Transformer.decode; `pixel_values`: a prefill's images)."""
    model = nnx.merge(self.graphdef, params)
    return model.decode(tokens_BL, positions_BL, caches, logits_index_B, pixel_values)

  def apply_decode_hidden(self, params: Params, tokens_BL: jax.Array, positions_BL: jax.Array, caches: Any
                          ) -> tuple[jax.Array, Any]:
    """(the stack's output [B, L, D] before the final norm, caches): Transformer.decode_hidden."""
    return nnx.merge(self.graphdef, params).decode_hidden(tokens_BL, positions_BL, caches)

  def apply_logits(self, params: Params, x_BLD: jax.Array) -> jax.Array:
    """Float32 logits [B, L, V] of the stack's output (final norm, output head, soft cap)."""
    return nnx.merge(self.graphdef, params)._logits(x_BLD)

  def apply_mtp_decode(self, params: Params, depth: int, h_BLD: jax.Array, next_tokens_BL: jax.Array,
                       positions_BL: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
    """Transformer.mtp_decode: (the module's output, its cache)."""
    return nnx.merge(self.graphdef, params).mtp_decode(depth, h_BLD, next_tokens_BL, positions_BL, cache)

  def apply_mtp_logits(self, params: Params, depth: int, h_BLD: jax.Array) -> jax.Array:
    return nnx.merge(self.graphdef, params).mtp_logits(depth, h_BLD)


def build_model_spec(cfg: ModelConfig) -> ModelSpec:
  """Traces the model abstractly (no parameter memory) to get its structure and axis names."""
  with nnx.use_eager_sharding(False):
    abstract_model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0)))
  graphdef, state = nnx.split(abstract_model)
  abstract_params = nnx.to_pure_dict(state)
  names_state = jax.tree.map(_logical_names, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  logical_names = nnx.to_pure_dict(names_state)
  return ModelSpec(cfg, graphdef, abstract_params, logical_names)


# The layer stacks a parameter tree may hold: `layers` and, with first_dense_layers, `dense_layers`.
LAYER_STACKS = ("dense_layers", "layers")


def unstack_layers(params: Params, num_layers: int) -> Params:
  """Scanned parameters ({'layers': leaves with a leading layer dim}) → {'layers_0': ..., ...}
  (a `dense_layers` stack likewise, its length read from its leaves)."""
  out = {k: v for k, v in params.items() if k not in LAYER_STACKS}
  for stack in LAYER_STACKS:
    if stack not in params:
      continue
    count = num_layers if stack == "layers" else jax.tree.leaves(params[stack])[0].shape[0]
    for i in range(count):
      out[f"{stack}_{i}"] = jax.tree.map(lambda x, i=i: x[i], params[stack])
  return out


def stack_layers(params: Params, num_layers: int) -> Params:
  """Inverse of `unstack_layers`."""
  out = {k: v for k, v in params.items() if stacked_layer_key(k) is None}
  for stack in LAYER_STACKS:
    count = num_layers if stack == "layers" else sum(1 for k in params if stacked_layer_key(k) == stack)
    if count:
      out[stack] = jax.tree.map(lambda *xs: jnp.stack(xs), *[params[f"{stack}_{i}"] for i in range(count)])
  return out


def stacked_layer_key(key: str) -> str | None:
  """The stack an unrolled parameter key (`layers_3`, `dense_layers_0`) belongs to, else None."""
  stack, _, index = key.rpartition("_")
  return stack if stack in LAYER_STACKS and index.isdigit() else None


def shard_params_like(spec: ModelSpec, mesh: Mesh, rules: sharding.Rules) -> Params:
  """NamedShardings for the parameter dict under `rules`."""
  return sharding.named_shardings(spec.abstract_params, spec.logical_names, mesh, rules)
