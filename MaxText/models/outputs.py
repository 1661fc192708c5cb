"""What the model computes besides activations: the logits (final norm, output head, soft cap), the
token loss sums (whole, or in tiles with num_vocab_tiling), and what the layers sow (auxiliary losses
and statistics) summed over layers."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from MaxText.configuration.model_config import ModelConfig
from MaxText.layers.embeddings import Embed
from MaxText.layers.linears import DenseGeneral
from MaxText.layers.moe import ROUTING_STATS
from MaxText.platform import sharding

# What layers sow as nnx.Intermediate, by name: scalar losses (e.g. MoE load balancing), summed
# over layers, and statistics (moe.ROUTING_STATS), kept per layer (stacked on a leading axis).
AuxLosses = dict[str, jax.Array]
Params = dict[str, Any]  # nested dict of arrays (or of ShapeDtypeStructs, shardings, ...)


def sum_sown_losses(sown: nnx.State[Any, Any], stats: bool = True) -> AuxLosses:
  """Adds up every value sown under the same name anywhere in a layer (e.g. several MoE blocks);
  `stats=False` leaves the statistics out (the pipelines carry losses only)."""
  totals: AuxLosses = {}
  for path, value in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(sown))[0]:
    name = next(str(key.key) for key in reversed(path) if isinstance(key, jax.tree_util.DictKey))
    if name in ROUTING_STATS and not stats:
      continue
    totals[name] = totals.get(name, 0.0) + (value if name in ROUTING_STATS else jnp.sum(value))
  return totals


def over_layers(name: str, per_layer: jax.Array) -> jax.Array:
  """A loss summed over the stacked layers; a statistic kept per layer."""
  return per_layer if name in ROUTING_STATS else jnp.sum(per_layer)


def unrolled_aux(per_layer: list[AuxLosses]) -> AuxLosses:
  """What unrolled layers sowed, one dict per layer, as a scan returns it: losses summed, statistics stacked."""
  names = per_layer[0] if per_layer else {}
  return {name: over_layers(name, jnp.stack([layer[name] for layer in per_layer])) for name in names}



def output_logits(cfg: ModelConfig, norm: nnx.Module, output: Embed | DenseGeneral, x_BLD: jax.Array) -> jax.Array:
  """Final norm, output projection (or tied embedding `attend`) and soft cap: float32 [B, L, V]."""
  x_BLD = norm(x_BLD)
  if isinstance(output, Embed):  # tied embeddings (logits_via_embedding)
    logits_dtype = jnp.float32 if cfg.logits_dot_in_fp32 else jnp.dtype(cfg.dtype)
    logits_BLV = output.attend(x_BLD, logits_dtype)
  else:
    logits_BLV = output(x_BLD)
  logits_BLV = sharding.constrain(logits_BLV, ("activation_batch", "activation_length", "activation_vocab"))
  logits_BLV = logits_BLV.astype(jnp.float32)
  if cfg.final_logits_soft_cap > 0:
    logits_BLV = cfg.final_logits_soft_cap * jnp.tanh(logits_BLV / cfg.final_logits_soft_cap)
  return logits_BLV


def token_loss_sums(logits_BLV: jax.Array, targets_BL: jax.Array, weights_BL: jax.Array,
                    z_loss_multiplier: float) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(cross-entropy sum + z_loss_multiplier · z-loss sum, {xent_sum, z_loss_sum}) over weighted targets.
  The z-loss, log(Z)², pushes log Z towards 0, keeping logits from drifting (PaLM's stabiliser)."""
  xent_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL)
  z_BL = jnp.square(jax.nn.logsumexp(logits_BLV, axis=-1))
  xent_sum, z_sum = jnp.sum(xent_BL * weights_BL), jnp.sum(z_BL * weights_BL)
  return xent_sum + z_loss_multiplier * z_sum, {"xent_sum": xent_sum, "z_loss_sum": z_sum}


def head_loss_sums(cfg: ModelConfig, norm: nnx.Module, output: Embed | DenseGeneral, x_BLD: jax.Array,
                   targets_BL: jax.Array, weights_BL: jax.Array, z_loss_multiplier: float
                   ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """`token_loss_sums` of `output_logits` of the stack's output `x_BLD`: at once, or with
  num_vocab_tiling > 1 in that many tiles of each row's positions (the same sums)."""
  if cfg.num_vocab_tiling == 1:
    return token_loss_sums(output_logits(cfg, norm, output, x_BLD), targets_BL, weights_BL, z_loss_multiplier)
  return _tiled_loss_sums(cfg, norm, output, x_BLD, targets_BL, weights_BL, z_loss_multiplier)


def _position_tiles(a_BL: jax.Array, tiles: int) -> jax.Array:
  """[B, L, ...] -> [tiles, B, L / tiles, ...], tile t holding positions t, t + tiles, ...: strided, so
  each tile keeps a share of every device's positions under sequence sharding (no data moves)."""
  b, length = a_BL.shape[:2]
  return jnp.moveaxis(a_BL.reshape((b, length // tiles, tiles) + a_BL.shape[2:]), 2, 0)


def _tiled_loss_sums(cfg: ModelConfig, norm: nnx.Module, output: Embed | DenseGeneral, x_BLD: jax.Array,
                     targets_BL: jax.Array, weights_BL: jax.Array, z_loss_multiplier: float
                     ) -> tuple[jax.Array, dict[str, jax.Array]]:
  # A scan over tiles with the head and loss of each under jax.checkpoint, not a custom_vjp: autodiff
  # derives the backward for every head (tied embedding, soft cap, norm) and the checkpoint saves only
  # each tile's inputs, so the backward recomputes one tile's logits at a time, never all of them.
  norm_graphdef, norm_state = nnx.split(norm)
  output_graphdef, output_state = nnx.split(output)
  tile_names = (None, "activation_batch", "activation_length")

  @jax.checkpoint
  def tile_sums(head_state: tuple[Any, Any], x_bLD: jax.Array, targets_bL: jax.Array, weights_bL: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
    logits_bLV = output_logits(cfg, nnx.merge(norm_graphdef, head_state[0]), nnx.merge(output_graphdef, head_state[1]),
                               x_bLD)
    _, sums = token_loss_sums(logits_bLV, targets_bL, weights_bL, z_loss_multiplier)
    return sums["xent_sum"], sums["z_loss_sum"]

  def add_tile(totals: tuple[jax.Array, jax.Array], tile: tuple[jax.Array, jax.Array, jax.Array]
               ) -> tuple[tuple[jax.Array, jax.Array], None]:
    xent, z = tile_sums((norm_state, output_state), *tile)
    return (totals[0] + xent, totals[1] + z), None

  tiles = cfg.num_vocab_tiling
  x_TBLD = sharding.constrain(_position_tiles(x_BLD, tiles), tile_names + ("activation_embed",))
  targets_TBL = sharding.constrain(_position_tiles(targets_BL, tiles), tile_names)
  weights_TBL = sharding.constrain(_position_tiles(weights_BL, tiles), tile_names)
  zero = jnp.zeros((), jnp.float32)
  (xent_sum, z_sum), _ = jax.lax.scan(add_tile, (zero, zero), (x_TBLD, targets_TBL, weights_TBL))
  return xent_sum + z_loss_multiplier * z_sum, {"xent_sum": xent_sum, "z_loss_sum": z_sum}
