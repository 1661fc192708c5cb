"""The decoder-only Transformer: embed → decoder stack (scanned or unrolled, rematerialised) → norm → logits.

Parameters live outside the module as a plain nested dict (`params`), so the
train state, optimizer, checkpoints and converters all see ordinary pytrees;
`ModelSpec.apply` merges them back into the NNX module inside the jitted step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from MaxText.platform import sharding
from MaxText.configuration.model_config import ModelConfig
from MaxText.layers.decoders import ACTIVATION_NAMES, decoder_layer_class
from MaxText.layers.embeddings import Embed, sinusoidal_positions
from MaxText.layers.kv_cache import KVCache
from MaxText.layers.linears import DenseGeneral
from MaxText.layers.moe import ROUTING_STATS, update_correction_biases
from MaxText.layers import gemma4, layer_shapes, masks, mtp, paged_kv, pipeline, quantization, remat, vision_llama4, vision_tower
from MaxText.layers.normalizations import make_norm

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


def _over_layers(name: str, per_layer: jax.Array) -> jax.Array:
  """A loss summed over the stacked layers; a statistic kept per layer."""
  return per_layer if name in ROUTING_STATS else jnp.sum(per_layer)


def _unrolled_aux(per_layer: list[AuxLosses]) -> AuxLosses:
  """What unrolled layers sowed, one dict per layer, as a scan returns it: losses summed, statistics stacked."""
  names = per_layer[0] if per_layer else {}
  return {name: _over_layers(name, jnp.stack([layer[name] for layer in per_layer])) for name in names}


@dataclasses.dataclass(frozen=True)
class VisionTower:
  """A decoder block's image side: its encoder and projector modules (each built from the config),
  and whether each image's tokens see each other both ways in the text stack."""
  encoder: Callable[..., nnx.Module]
  projector: Callable[..., nnx.Module]
  bidirectional_images: bool


# By decoder block (configuration/vision_config.py's MULTIMODAL_DECODER_BLOCKS).
VISION_TOWERS = {
    "gemma3": VisionTower(vision_tower.VisionEncoder, vision_tower.MultimodalProjector, bidirectional_images=True),
    "llama4": VisionTower(vision_llama4.Llama4VisionEncoder, vision_llama4.Llama4Projector, bidirectional_images=False),
}


def remat_policy(name: str) -> remat.CheckpointPolicy:
  """jax.checkpoint policy for `remat_policy`; "none" means no rematerialisation at all."""
  return remat.checkpoint_policy(name)


class Transformer(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    dtype, weight_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
    self.cfg = cfg
    self.token_embedder = Embed(cfg.vocab_size, cfg.emb_dim, dtype=dtype, weight_dtype=weight_dtype, rngs=rngs,
                                stddev=cfg.emb_dim**-0.5 if cfg.logits_via_embedding else 1.0)
    layer_class = decoder_layer_class(cfg.decoder_block)
    # DeepSeek's dense-MLP prefix, Llama 4 Maverick's dense layers between the MoE ones, or
    # Qwen3-Next's Gated DeltaNet layers between the full-attention ones: a second stack.
    if cfg.num_dense_layers > 0:
      self._build_stack("dense_layers", layer_class, cfg.dense_stack_config(), cfg.num_dense_layers, rngs)
    self._build_stack("layers", layer_class, cfg, cfg.num_moe_stack_layers, rngs)
    if cfg.position_embedding == "learned":
      self.position_embedder = Embed(cfg.max_position_embeddings, cfg.emb_dim, dtype=dtype,
                                     weight_dtype=weight_dtype, rngs=rngs, names=(None, "embed"))
    self.decoder_norm = make_norm(cfg)
    if cfg.layer_shapes.per_layer_input_dim:
      self.per_layer_inputs = gemma4.PerLayerInputs(cfg, rngs=rngs)
    if not cfg.logits_via_embedding:
      logits_dtype = jnp.float32 if cfg.logits_dot_in_fp32 else dtype
      self.logits_dense = DenseGeneral((cfg.emb_dim,), (cfg.vocab_size,), ("embed", "vocab"),
                                       dtype=logits_dtype, weight_dtype=weight_dtype, rngs=rngs)
    for depth in range(cfg.mtp.mtp_num_layers):  # last, so the other parameters initialise as without them
      setattr(self, mtp.module_name(depth), mtp.MtpModule(cfg, layer_class, rngs=rngs))
    if cfg.vision.use_multimodal:  # after everything, for the same reason
      tower = VISION_TOWERS[cfg.decoder_block]
      self.vision_encoder = tower.encoder(cfg, rngs=rngs)
      self.multimodal_projector = tower.projector(cfg, rngs=rngs)

  def _build_stack(self, name: str, layer_class: Callable[..., nnx.Module], cfg: ModelConfig, count: int,
                   rngs: nnx.Rngs) -> None:
    """`count` layers as one scanned module `name` or unrolled attributes `name_0`, `name_1`, ...
    (string keys only, for checkpoints)."""
    if cfg.scan_layers:
      @nnx.split_rngs(splits=count)
      @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
      def stacked(rngs: nnx.Rngs) -> nnx.Module:
        return layer_class(cfg, rngs=rngs)
      setattr(self, name, stacked(rngs))
    else:
      for i in range(count):  # a stack of differing layers builds each from its index (layers/layer_shapes.py)
        own = {"layer_index": i} if getattr(layer_class, "per_layer_shapes", False) else {}
        setattr(self, f"{name}_{i}", layer_class(cfg, rngs=rngs, **own))

  def _embed(self, tokens_BL: jax.Array, positions_BL: jax.Array) -> jax.Array:
    """Token embeddings, scaled (Gemma) and with absolute positions added (GPT-3) as configured."""
    cfg = self.cfg
    if cfg.vision.use_multimodal and cfg.vision.image_token_id >= cfg.vocab_size:  # a placeholder outside the table
      tokens_BL = jnp.where(tokens_BL == cfg.vision.image_token_id, 0, tokens_BL)
    x_BLD = self.token_embedder(tokens_BL)
    if cfg.scale_embedding:  # the factor is rounded to the activation dtype, as the reference does
      x_BLD = x_BLD * jnp.asarray(cfg.emb_dim**0.5, x_BLD.dtype)
    if cfg.position_embedding == "learned":
      x_BLD = x_BLD + self.position_embedder(positions_BL)
    elif cfg.position_embedding == "sinusoidal":
      x_BLD = x_BLD + sinusoidal_positions(positions_BL, cfg.emb_dim).astype(x_BLD.dtype)
    return x_BLD

  def _run_layers(self, x_BLD: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,
                  dropout_rng: jax.Array | None, caches: Any = None, image_blocks_BL: jax.Array | None = None,
                  per_layer_BLMP: jax.Array | None = None) -> tuple[jax.Array, AuxLosses, Any]:
    """The decoder stack; also returns each auxiliary loss the layers sow, summed over layers (and
    each statistic, stacked per layer; not under pipeline parallelism), and,
    when decoding, the updated KV caches (`caches`: one KVCache stacked over layers when
    scan_layers, else a list with one per layer; with first_dense_layers, a dict of those for
    `dense_layers` and `layers`, see kv_cache.model_caches). `image_blocks_BL`: a multimodal model's
    image blocks (masks.image_blocks) for every layer's attention mask. `per_layer_BLMP`: each layer's
    own input (gemma4.PerLayerInputs)."""
    cfg = self.cfg
    if cfg.pipeline.num_pipeline_stages > 1:  # the stage-sharded scanned stack runs as a pipeline
      return (*self._run_pipeline(x_BLD, positions_BL, segment_ids_BL, dropout_rng), None)
    if cfg.layer_period > 1:
      return self._run_interleaved(x_BLD, positions_BL, segment_ids_BL, dropout_rng, caches, image_blocks_BL)
    dense = cfg.moe.first_dense_layers
    if dense == 0:
      return self._run_stack("layers", cfg.num_decoder_layers, 0, x_BLD, positions_BL, segment_ids_BL, dropout_rng,
                             caches, image_blocks_BL, per_layer_BLMP)
    dense_rng, rng = jax.random.split(dropout_rng) if dropout_rng is not None else (None, None)
    x_BLD, _, dense_caches = self._run_stack("dense_layers", dense, 0, x_BLD, positions_BL, segment_ids_BL,
                                             dense_rng, None if caches is None else caches["dense_layers"],
                                             image_blocks_BL)
    x_BLD, aux, main_caches = self._run_stack("layers", cfg.num_moe_stack_layers, dense, x_BLD, positions_BL,
                                              segment_ids_BL, rng, None if caches is None else caches["layers"],
                                              image_blocks_BL)
    return x_BLD, aux, None if caches is None else {"dense_layers": dense_caches, "layers": main_caches}

  def _run_stack(self, name: str, num_layers: int, first_index: int, x_BLD: jax.Array, positions_BL: jax.Array,
                 segment_ids_BL: jax.Array, dropout_rng: jax.Array | None, caches: Any,
                 image_blocks_BL: jax.Array | None = None, per_layer_BLMP: jax.Array | None = None
                 ) -> tuple[jax.Array, AuxLosses, Any]:
    """One stack of `_run_layers` (`first_index`: its first layer's index in the whole decoder)."""
    cfg = self.cfg
    layer_rngs = jax.random.split(dropout_rng, num_layers) if dropout_rng is not None else None
    one_layer = self._layer_fn(positions_BL, segment_ids_BL, decoding=caches is not None,
                               image_blocks_BL=image_blocks_BL)
    if cfg.scan_layers and paged_kv.holds_pages(caches):
      # Page pools ride in the carry, each layer writing its own in place (paged_kv.PagedKVCache.layer):
      # as scanned inputs and outputs they would be sliced and restacked, a copy of the pool per step.
      graphdef, stacked_state = nnx.split(getattr(self, name))

      def carried(carry: tuple[jax.Array, Any], per_layer: tuple[Any, ...]
                  ) -> tuple[tuple[jax.Array, Any], AuxLosses]:
        x, pools = carry
        state, rng, index = per_layer
        x, layer_aux, pools = one_layer(graphdef, x, state, rng, first_index + index,
                                        paged_kv.with_layer(pools, index))
        return (x, paged_kv.with_layer(pools, None)), layer_aux

      (x_BLD, caches), aux_per_layer = jax.lax.scan(
          carried, (x_BLD, caches), (stacked_state, layer_rngs, jnp.arange(num_layers)))
      return x_BLD, {name: _over_layers(name, values) for name, values in aux_per_layer.items()}, caches
    if cfg.scan_layers:
      graphdef, stacked_state = nnx.split(getattr(self, name))

      def body(x: jax.Array, per_layer: tuple[Any, ...]) -> tuple[jax.Array, tuple[AuxLosses, KVCache | None]]:
        x, layer_aux, cache = one_layer(graphdef, x, *per_layer)
        return x, (layer_aux, cache)

      x_BLD, (aux_per_layer, caches) = jax.lax.scan(
          body, x_BLD, (stacked_state, layer_rngs, first_index + jnp.arange(num_layers), caches))
      return x_BLD, {name: _over_layers(name, values) for name, values in aux_per_layer.items()}, caches
    per_layer: list[AuxLosses] = []
    new_caches = []
    # KV sharing (layers/layer_shapes.py): a source's keys and values (training) or cache (decoding), by layer.
    sources, producers = layer_shapes.kv_sources(cfg), layer_shapes.kv_producers(cfg)
    kept: dict[int, Any] = {}
    for i in range(num_layers):
      graphdef, state = nnx.split(getattr(self, f"{name}_{i}"))
      cache = None if caches is None else caches[i]
      if first_index + i in sources:
        cache = kept[sources[first_index + i]]
      elif cache is None and first_index + i in producers:
        cache = layer_shapes.SharedKV()
      x_BLD, layer_aux, cache = one_layer(graphdef, x_BLD, state, None if layer_rngs is None else layer_rngs[i],
                                          jnp.asarray(first_index + i, jnp.int32), cache,
                                          gemma4.layer_inputs(per_layer_BLMP, first_index + i))
      kept[first_index + i] = cache
      per_layer.append(layer_aux)
      new_caches.append(None if first_index + i in sources else cache)
    aux = _unrolled_aux(per_layer)
    return x_BLD, aux, None if caches is None else new_caches

  def _layer_fn(self, positions_BL: jax.Array, segment_ids_BL: jax.Array, decoding: bool,
                image_blocks_BL: jax.Array | None = None) -> Callable[..., Any]:
    """one_layer(graphdef, x, layer_state, rng, layer_index, cache) -> (x, sown losses, cache),
    rematerialised by remat_policy when training."""
    # layer_index lets a layer pick its per-layer behaviour (e.g. local vs global attention)
    # inside a scan, where every layer shares one traced body.
    def one_layer(graphdef: nnx.GraphDef[nnx.Module], x: jax.Array, layer_state: nnx.State[Any, Any], rng: jax.Array | None,
                  layer_index: jax.Array, cache: Any, layer_input: jax.Array | None = None
                  ) -> tuple[jax.Array, AuxLosses, Any]:
      layer = nnx.merge(graphdef, layer_state)
      extra = () if cache is None else (cache,)
      blocks: dict[str, jax.Array] = {} if image_blocks_BL is None else {"image_blocks_BL": image_blocks_BL}
      if layer_input is not None:
        blocks["per_layer_input_BLP"] = layer_input
      out, sown = nnx.capture(layer, nnx.Intermediate)(x, positions_BL, segment_ids_BL, rng, layer_index, *extra,
                                                       **blocks)
      x, cache = out if cache is not None else (out, None)
      return x, sum_sown_losses(sown), cache

    policy = remat_policy(self.cfg.remat_policy)
    # "none": no rematerialisation; decoding takes no gradients: nothing to rematerialise.
    if not isinstance(policy, str) and not decoding:
      return jax.checkpoint(one_layer, policy=policy, static_argnums=(0,))
    return one_layer

  def _run_interleaved(self, x_BLD: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,
                       dropout_rng: jax.Array | None, caches: Any, image_blocks_BL: jax.Array | None = None
                       ) -> tuple[jax.Array, AuxLosses, Any]:
    """An interleaved stack (layer_period): periods of k layers, the last of each from `layers`, the
    others from `dense_layers`, run in order; scanned over the periods. Llama 4 Maverick: the last an
    MoE layer, the others dense (the aux losses and statistics are the MoE layers'); Qwen3-Next: the
    last full attention, the others Gated DeltaNet."""
    cfg = self.cfg
    k, num_layers = cfg.layer_period, cfg.num_decoder_layers
    periods = num_layers // k
    one_layer = self._layer_fn(positions_BL, segment_ids_BL, decoding=caches is not None, image_blocks_BL=image_blocks_BL)
    rngs = None if dropout_rng is None else jax.random.split(dropout_rng, num_layers).reshape(periods, k)
    if cfg.scan_layers:
      dense_graph, dense_state = nnx.split(getattr(self, "dense_layers"))
      moe_graph, moe_state = nnx.split(getattr(self, "layers"))
      by_period = lambda tree: jax.tree.map(lambda a: a.reshape((periods, k - 1) + a.shape[1:]), tree)  # noqa: E731

      def body(x: jax.Array, xs: tuple[Any, ...]) -> tuple[jax.Array, tuple[AuxLosses, Any, Any]]:
        dense_s, moe_s, rng_k, period, dense_c, moe_c = xs
        new_dense = []
        for j in range(k - 1):
          pick = lambda tree, j=j: jax.tree.map(lambda a: a[j], tree)  # noqa: E731
          x, _, cache = one_layer(dense_graph, x, pick(dense_s), None if rng_k is None else rng_k[j], period * k + j,
                                  None if dense_c is None else pick(dense_c))
          new_dense.append(cache)
        x, aux, moe_c = one_layer(moe_graph, x, moe_s, None if rng_k is None else rng_k[k - 1], period * k + k - 1,
                                  moe_c)
        dense_c = None if dense_c is None else jax.tree.map(lambda *cs: jnp.stack(cs), *new_dense)
        return x, (aux, dense_c, moe_c)

      if paged_kv.holds_pages(caches):  # in the carry, as in _run_stack
        # Gated DeltaNet layers' states are per slot, not paged: scanned per period as unpaged caches are.
        dense_paged = paged_kv.holds_pages(caches["dense_layers"])

        def carried(carry: tuple[jax.Array, Any, Any], xs: tuple[Any, ...]
                    ) -> tuple[tuple[jax.Array, Any, Any], tuple[AuxLosses, Any]]:
          x, dense_pools, moe_pools = carry
          dense_s, moe_s, rng_k, period, dense_c = xs
          new_dense = []
          for j in range(k - 1):
            layer_cache = (paged_kv.with_layer(dense_pools, period * (k - 1) + j) if dense_paged
                           else jax.tree.map(lambda a, j=j: a[j], dense_c))
            x, _, layer_cache = one_layer(dense_graph, x, jax.tree.map(lambda a, j=j: a[j], dense_s),
                                          None if rng_k is None else rng_k[j], period * k + j, layer_cache)
            if dense_paged:
              dense_pools = layer_cache
            else:
              new_dense.append(layer_cache)
          x, aux, moe_pools = one_layer(moe_graph, x, moe_s, None if rng_k is None else rng_k[k - 1],
                                        period * k + k - 1, paged_kv.with_layer(moe_pools, period))
          dense_c = jax.tree.map(lambda *cs: jnp.stack(cs), *new_dense) if new_dense else None
          return ((x, paged_kv.with_layer(dense_pools, None) if dense_paged else None,
                   paged_kv.with_layer(moe_pools, None)), (aux, dense_c))

        (x_BLD, dense_pools, moe_pools), (aux_per_layer, dense_caches) = jax.lax.scan(
            carried, (x_BLD, caches["dense_layers"] if dense_paged else None, caches["layers"]),
            (by_period(dense_state), moe_state, rngs, jnp.arange(periods),
             None if dense_paged else by_period(caches["dense_layers"])))
        aux = {name: _over_layers(name, values) for name, values in aux_per_layer.items()}
        if not dense_paged:
          dense_pools = jax.tree.map(lambda a: a.reshape((periods * (k - 1),) + a.shape[2:]), dense_caches)
        return x_BLD, aux, {"dense_layers": dense_pools, "layers": moe_pools}
      dense_caches = None if caches is None else by_period(caches["dense_layers"])
      x_BLD, (aux_per_layer, dense_caches, moe_caches) = jax.lax.scan(
          body, x_BLD, (by_period(dense_state), moe_state, rngs, jnp.arange(periods),
                        dense_caches, None if caches is None else caches["layers"]))
      aux = {name: _over_layers(name, values) for name, values in aux_per_layer.items()}
      if caches is None:
        return x_BLD, aux, None
      flat = jax.tree.map(lambda a: a.reshape((periods * (k - 1),) + a.shape[2:]), dense_caches)
      return x_BLD, aux, {"dense_layers": flat, "layers": moe_caches}
    per_layer: list[AuxLosses] = []
    new_caches: dict[str, list[KVCache | None]] = {"dense_layers": [], "layers": []}
    for i in range(num_layers):
      stack, index = cfg.stack_position(i)
      graphdef, state = nnx.split(getattr(self, f"{stack}_{index}"))
      x_BLD, layer_aux, cache = one_layer(graphdef, x_BLD, state, None if rngs is None else rngs[i // k, i % k],
                                          jnp.asarray(i, jnp.int32), None if caches is None else caches[stack][index])
      if stack == "layers":
        per_layer.append(layer_aux)
      new_caches[stack].append(cache)
    aux = _unrolled_aux(per_layer)
    return x_BLD, aux, None if caches is None else new_caches

  # What a pipeline schedule needs (the 1F1B loss drivers in objectives/pipelined.py): the
  # embedding, the stage-sharded stack and the modules after it.

  def embed(self, tokens_BL: jax.Array, positions_BL: jax.Array) -> jax.Array:
    """The stack's input activations [B, L, D]."""
    return sharding.constrain(self._embed(tokens_BL, positions_BL), ACTIVATION_NAMES)

  def final_modules(self) -> tuple[nnx.Module, Embed | DenseGeneral]:
    """(final norm, output projection or tied embedding): what `output_logits` applies after the stack."""
    return self.decoder_norm, self._output_module()

  def stage_layers(self) -> tuple[nnx.State[Any, Any], pipeline.LayerFn]:
    """The stacked layer state and a function applying one layer of it, for the pipelines
    (microbatches bring their own positions and segment ids)."""
    graphdef, stacked_state = nnx.split(getattr(self, "layers"))  # set by _build_stack

    def apply_layer(x: jax.Array, layer_state: nnx.State[Any, Any], rng: jax.Array | None, layer_index: jax.Array,
                    positions: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, AuxLosses]:
      layer = nnx.merge(graphdef, layer_state)
      x, sown = nnx.capture(layer, nnx.Intermediate)(x, positions, segment_ids, rng, layer_index)
      return x, sum_sown_losses(sown, stats=False)

    return stacked_state, apply_layer

  def _run_pipeline(self, x_BLD: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,
                    dropout_rng: jax.Array | None) -> tuple[jax.Array, AuxLosses]:
    """`_run_layers` over pipeline stages (layers/pipeline.py). The 1F1B schedule runs forward-only
    passes (evaluation) this way too: without gradients its order is GPipe's."""
    stacked_state, apply_layer = self.stage_layers()
    return pipeline.run_pipeline(self.cfg.pipeline, apply_layer, stacked_state, x_BLD, positions_BL, segment_ids_BL,
                                 dropout_rng, remat_policy(self.cfg.remat_policy))

  def __call__(self, tokens_BL: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,
               dropout_rng: jax.Array | None = None, pixel_values: jax.Array | None = None) -> jax.Array:
    """Returns float32 logits [B, L, V]. `dropout_rng=None` means deterministic (no dropout)."""
    return self.logits_and_aux(tokens_BL, positions_BL, segment_ids_BL, dropout_rng, pixel_values=pixel_values)[0]

  def image_embeddings(self, pixels_ICRR: jax.Array) -> jax.Array:
    """Soft tokens [I, mm_tokens_per_image, D] of images' pixel values [I, 3, R, R] (Llama 4: of
    tiles; input_pipeline/images.py, llama4_images.py); layers/vision_tower.py, vision_llama4.py."""
    return self.multimodal_projector(self.vision_encoder(pixels_ICRR.astype(jnp.dtype(self.cfg.dtype))))

  def _multimodal_input(self, x_BLD: jax.Array, tokens_BL: jax.Array, pixel_values: jax.Array | None
                        ) -> tuple[jax.Array, jax.Array | None]:
    """(embeddings with the images' soft tokens placed, image blocks for the mask) of a multimodal
    model; `pixel_values` [B, M, 3, R, R]: each row's images in order (more than its placeholders
    need is padding). A text-only model, or no images, leaves the embeddings as they are."""
    vision = self.cfg.vision
    if not vision.use_multimodal:
      if pixel_values is not None:
        raise ValueError("pixel_values given to a text-only model (use_multimodal=False)")
      return x_BLD, None
    if pixel_values is not None:
      rows, per_row = pixel_values.shape[:2]
      soft_ITD = self.image_embeddings(pixel_values.reshape((rows * per_row,) + pixel_values.shape[2:]))
      soft_BTD = soft_ITD.reshape(rows, per_row * soft_ITD.shape[1], soft_ITD.shape[2])
      x_BLD = vision_tower.place_image_tokens(x_BLD, soft_BTD, tokens_BL, vision.image_token_id)
    if not VISION_TOWERS[self.cfg.decoder_block].bidirectional_images:
      return x_BLD, None
    return x_BLD, masks.image_blocks(tokens_BL, vision.image_token_id)

  def logits_and_aux(self, tokens_BL: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,
                     dropout_rng: jax.Array | None = None, mtp_targets: tuple[jax.Array, jax.Array] | None = None,
                     pixel_values: jax.Array | None = None) -> tuple[jax.Array, AuxLosses]:
    """Float32 logits [B, L, V] and what the layers sow: auxiliary losses (e.g. `moe_lb_loss`), each a
    mean over layers, and routing statistics, each stacked per layer [num_layers, ...]. With
    `mtp_targets` (targets, their weights) and mtp_num_layers > 0, also the multi-token-prediction
    sums `mtp_xent_sum` and `mtp_weight_sum` over every depth (layers/mtp.py). `pixel_values`
    [B, M, 3, R, R]: a multimodal model's images (`_multimodal_input`)."""
    x_BLD, image_blocks_BL = self._multimodal_input(self._embed(tokens_BL, positions_BL), tokens_BL, pixel_values)
    x_BLD = sharding.constrain(x_BLD, ACTIVATION_NAMES)
    per_layer_BLMP = self._per_layer_inputs(tokens_BL, x_BLD)
    mtp_rng = None
    if dropout_rng is not None and mtp_targets is not None:
      dropout_rng, mtp_rng = jax.random.split(dropout_rng)
    with quantization.use_quantization(self.cfg.quantization):  # the stack only: logits stay in float
      x_BLD, aux, _ = self._run_layers(x_BLD, positions_BL, segment_ids_BL, dropout_rng, image_blocks_BL=image_blocks_BL,
                                       per_layer_BLMP=per_layer_BLMP)
    aux = {name: value if name in ROUTING_STATS else value / self.cfg.num_moe_stack_layers
           for name, value in aux.items()}
    if mtp_targets is not None and self.cfg.mtp.mtp_num_layers > 0:
      aux.update(self._mtp_sums(x_BLD, tokens_BL, positions_BL, segment_ids_BL, *mtp_targets,
                                mtp_rng))
    return self._logits(x_BLD), aux

  def _per_layer_inputs(self, tokens_BL: jax.Array, x_BLD: jax.Array) -> jax.Array | None:
    """Each layer's own input [B, L, M, P] (per_layer_input_dim > 0, Gemma 4), else None."""
    return self.per_layer_inputs(tokens_BL, x_BLD) if self.cfg.layer_shapes.per_layer_input_dim else None

  def _mtp_sums(self, h_BLD: jax.Array, tokens_BL: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,
                targets_BL: jax.Array, weights_BL: jax.Array, rng: jax.Array | None) -> AuxLosses:
    cfg = self.cfg
    xent_sum = weight_sum = jnp.zeros((), jnp.float32)
    for depth in range(cfg.mtp.mtp_num_layers):
      k = depth + 1
      module = getattr(self, mtp.module_name(depth))
      embedded_BLD = self._embed(mtp.ahead(tokens_BL, k), mtp.ahead(positions_BL, k))
      h_BLD = sharding.constrain(module.combine(embedded_BLD, h_BLD), ACTIVATION_NAMES)
      layer_rng = None if rng is None else jax.random.fold_in(rng, depth)
      with quantization.use_quantization(cfg.quantization):
        h_BLD = mtp.run_layer(module, h_BLD, positions_BL, segment_ids_BL, layer_rng, cfg.num_decoder_layers + depth,
                              remat_policy(cfg.remat_policy))
      logits_BLV = output_logits(cfg, module.final_norm, self._output_module(), h_BLD)
      same_document = mtp.ahead(segment_ids_BL, k) == segment_ids_BL
      w_BL = mtp.ahead(weights_BL, k) * same_document
      _, sums = token_loss_sums(logits_BLV, mtp.ahead(targets_BL, k), w_BL, 0.0)
      xent_sum, weight_sum = xent_sum + sums["xent_sum"], weight_sum + jnp.sum(w_BL)
    return {"mtp_xent_sum": xent_sum, "mtp_weight_sum": weight_sum}

  def decode(self, tokens_BL: jax.Array, positions_BL: jax.Array, caches: Any,
             logits_index_B: jax.Array | None = None, pixel_values: jax.Array | None = None
             ) -> tuple[jax.Array, Any]:
    """Decoding forward pass: float32 logits [B, L, V] of new tokens at absolute `positions_BL`,
    attending over (and written into) `caches`; returns the updated caches too. With
    `logits_index_B`, only the logits of that one token per row ([B, 1, V]): prefill needs just
    the last prompt token's, and a [B, L, V] float32 block would dwarf the cache for long prompts.
    `pixel_values` [B, M, 3, R, R] (a prefill): the images whose placeholder runs all lie in this
    call's tokens, placed as `_multimodal_input` places them; their tokens attend both ways.
    Tokens after `logits_index_B` are a right-padded prompt's padding: segment id 0, which a
    recurrent layer (gated_deltanet.py) keeps out of its state; attention masks by position."""
    segment_ids_BL = None
    if logits_index_B is not None:
      segment_ids_BL = (jnp.arange(tokens_BL.shape[1])[None] <= logits_index_B[:, None]).astype(jnp.int32)
    x_BLD, caches = self.decode_hidden(tokens_BL, positions_BL, caches, pixel_values, segment_ids_BL)
    if logits_index_B is not None:
      x_BLD = jnp.take_along_axis(x_BLD, logits_index_B[:, None, None], axis=1)
    return self._logits(x_BLD), caches

  def decode_hidden(self, tokens_BL: jax.Array, positions_BL: jax.Array, caches: Any,
                    pixel_values: jax.Array | None = None, segment_ids_BL: jax.Array | None = None
                    ) -> tuple[jax.Array, Any]:
    """`decode` up to the decoder stack's output (before the final norm: what the first MTP
    module reads), with the updated caches (`segment_ids_BL`: 0 at padding; None: none)."""
    if self.cfg.pipeline.num_pipeline_stages > 1:
      raise ValueError("decoding does not support pipeline parallelism; set ici_pipeline_parallelism=1")
    x_BLD = self._embed(tokens_BL, positions_BL)
    image_blocks_BL = None
    if pixel_values is not None:
      x_BLD, image_blocks_BL = self._multimodal_input(x_BLD, tokens_BL, pixel_values)
    x_BLD = sharding.constrain(x_BLD, ACTIVATION_NAMES)
    per_layer_BLMP = self._per_layer_inputs(tokens_BL, x_BLD)
    if segment_ids_BL is None:
      segment_ids_BL = jnp.ones(tokens_BL.shape, jnp.int32)
    with quantization.use_quantization(self.cfg.quantization):  # as in training: same matmuls as the full pass
      x_BLD, _, caches = self._run_layers(x_BLD, positions_BL, segment_ids_BL, None, caches,
                                          image_blocks_BL=image_blocks_BL, per_layer_BLMP=per_layer_BLMP)
    return x_BLD, caches

  def mtp_decode(self, depth: int, h_BLD: jax.Array, next_tokens_BL: jax.Array, positions_BL: jax.Array,
                 cache: Any) -> tuple[jax.Array, Any]:
    """MTP module `depth` at `positions_BL`, decoding: its input is `h_BLD` (the stack's output,
    or the previous depth's) combined with the embedding of the token one place ahead
    (`next_tokens_BL`, at positions + 1), its layer attends over (and writes) its own one-layer
    `cache`. Returns (the module's output [B, L, D], the cache); `mtp_logits` of that output
    scores the token two places ahead."""
    cfg = self.cfg
    module = getattr(self, mtp.module_name(depth))
    embedded_BLD = self._embed(next_tokens_BL, positions_BL + 1)
    x_BLD = sharding.constrain(module.combine(embedded_BLD, h_BLD), ACTIVATION_NAMES)
    one_layer = self._layer_fn(positions_BL, jnp.ones(next_tokens_BL.shape, jnp.int32), decoding=True)
    graphdef, state = nnx.split(module.layer)
    with quantization.use_quantization(cfg.quantization):
      x_BLD, _, cache = one_layer(graphdef, x_BLD, state, None, jnp.asarray(cfg.num_decoder_layers + depth, jnp.int32),
                                  cache)
    return x_BLD, cache

  def mtp_logits(self, depth: int, h_BLD: jax.Array) -> jax.Array:
    """Float32 logits [B, L, V] of MTP module `depth`'s output (its own final norm, the shared head)."""
    return output_logits(self.cfg, getattr(self, mtp.module_name(depth)).final_norm, self._output_module(), h_BLD)

  def _output_module(self) -> Embed | DenseGeneral:
    """What turns final activations into logits: the tied embedding or the output projection."""
    return self.token_embedder if self.cfg.logits_via_embedding else self.logits_dense

  def _logits(self, x_BLD: jax.Array) -> jax.Array:
    return output_logits(self.cfg, self.decoder_norm, self._output_module(), x_BLD)


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
