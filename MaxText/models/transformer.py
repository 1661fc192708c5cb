"""The decoder-only Transformer: embed → decoder stack (scanned or unrolled, rematerialised) → norm → logits.

Generic: what a family brings (its decoder layer, vision tower, per-layer inputs) comes from its
`Family` record (MaxText/families/), looked up by decoder_block; no family is named here.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
from flax import nnx

from MaxText import families
from MaxText.configuration import model_config
from MaxText.configuration.model_config import ModelConfig
from MaxText.errors import ConfigError
from MaxText.layers import kv_cache, layer_shapes, masks, mtp, paged_kv, pipeline, quantization, remat, vision_tower
from MaxText.layers.decoders import ACTIVATION_NAMES, DecoderLayer
from MaxText.layers.embeddings import Embed, sinusoidal_positions
from MaxText.layers.kv_cache import KVCache
from MaxText.layers.linears import DenseGeneral
from MaxText.layers.moe import ROUTING_STATS
from MaxText.layers.normalizations import make_norm
from MaxText.models.outputs import AuxLosses, head_loss_sums, output_logits, over_layers, sum_sown_losses, unrolled_aux
from MaxText.platform import sharding


def remat_policy(cfg: ModelConfig) -> remat.CheckpointPolicy:
  """jax.checkpoint policy for the config's `remat_policy` (custom: its placement keys); "none" means
  no rematerialisation at all."""
  return remat.checkpoint_policy(cfg.remat)


def _warn_unproduced_placements(cfg: ModelConfig, layer_class: Any) -> None:
  """A remat_policy=custom placement of a name the family's own layer never produces (its
  `unproduced_names`) places nothing: one warning line, as config validation gives for the names the
  keys turn off (the family's layer is known only here, where flax is loaded)."""
  if cfg.remat.name != "custom":
    return
  placed = cfg.remat.placements()
  for name, why in sorted(getattr(layer_class, "unproduced_names", {}).items()):
    if placed.get(name, "remat") != "remat":
      model_config.warn_unproduced(name, placed[name], cfg.decoder_block, why)


class Transformer(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    dtype, weight_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
    self.cfg = cfg
    self.token_embedder = Embed(cfg.vocab_size, cfg.emb_dim, dtype=dtype, weight_dtype=weight_dtype, rngs=rngs,
                                stddev=cfg.emb_dim**-0.5 if cfg.logits_via_embedding else 1.0, one_hot=cfg.use_iota_embed)
    family = families.family_for_decoder_block(cfg.decoder_block)
    layer_class = family.layer or DecoderLayer
    _warn_unproduced_placements(cfg, layer_class)
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
      if family.per_layer_inputs is None:
        raise ConfigError(f"per_layer_input_dim is set but decoder_block {cfg.decoder_block!r} takes no per-layer "
                          "inputs; set per_layer_input_dim=0")
      self.per_layer_inputs = family.per_layer_inputs(cfg, rngs=rngs)
    if not cfg.logits_via_embedding:
      logits_dtype = jnp.float32 if cfg.logits_dot_in_fp32 else dtype
      self.logits_dense = DenseGeneral((cfg.emb_dim,), (cfg.vocab_size,), ("embed", "vocab"),
                                       dtype=logits_dtype, weight_dtype=weight_dtype, rngs=rngs)
    for depth in range(cfg.mtp.mtp_num_layers):  # last, so the other parameters initialise as without them
      setattr(self, mtp.module_name(depth), mtp.MtpModule(cfg, layer_class, rngs=rngs))
    self.bidirectional_images = False
    if cfg.vision.use_multimodal:  # after everything, for the same reason
      tower = family.vision
      if tower is None:
        raise ConfigError(f"decoder_block {cfg.decoder_block!r} has no vision tower; set use_multimodal=False")
      self.bidirectional_images = tower.bidirectional_images
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
    own input (the family's `per_layer_inputs`)."""
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
    if cfg.scan_layers and kv_cache.holds_layer_caches(caches):
      # KV caches and page pools ride in the carry, each layer writing its own in place (KVCache.layer,
      # PagedKVCache.layer): as scanned inputs and outputs they would be sliced and restacked, copies
      # of the whole cache every step.
      graphdef, stacked_state = nnx.split(getattr(self, name))

      def carried(carry: tuple[jax.Array, Any], per_layer: tuple[Any, ...]
                  ) -> tuple[tuple[jax.Array, Any], AuxLosses]:
        x, pools = carry
        state, rng, index = per_layer
        x, layer_aux, pools = one_layer(graphdef, x, state, rng, first_index + index,
                                        kv_cache.with_layer(pools, index))
        return (x, kv_cache.with_layer(pools, None)), layer_aux

      (x_BLD, caches), aux_per_layer = jax.lax.scan(
          carried, (x_BLD, caches), (stacked_state, layer_rngs, jnp.arange(num_layers)))
      return x_BLD, {name: over_layers(name, values) for name, values in aux_per_layer.items()}, caches
    if cfg.scan_layers:
      graphdef, stacked_state = nnx.split(getattr(self, name))

      def body(x: jax.Array, per_layer: tuple[Any, ...]) -> tuple[jax.Array, tuple[AuxLosses, KVCache | None]]:
        x, layer_aux, cache = one_layer(graphdef, x, *per_layer)
        return x, (layer_aux, cache)

      x_BLD, (aux_per_layer, caches) = jax.lax.scan(
          body, x_BLD, (stacked_state, layer_rngs, first_index + jnp.arange(num_layers), caches))
      return x_BLD, {name: over_layers(name, values) for name, values in aux_per_layer.items()}, caches
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
                                          None if per_layer_BLMP is None else per_layer_BLMP[:, :, first_index + i])
      kept[first_index + i] = cache
      per_layer.append(layer_aux)
      new_caches.append(None if first_index + i in sources else cache)
    aux = unrolled_aux(per_layer)
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
      x = checkpoint_name(x, "decoder_layer_input")  # remat_policy=custom places it (device or offload)
      extra = () if cache is None else (cache,)
      blocks: dict[str, jax.Array] = {} if image_blocks_BL is None else {"image_blocks_BL": image_blocks_BL}
      if layer_input is not None:
        blocks["per_layer_input_BLP"] = layer_input
      out, sown = nnx.capture(layer, nnx.Intermediate)(x, positions_BL, segment_ids_BL, rng, layer_index, *extra,
                                                       **blocks)
      x, cache = out if cache is not None else (out, None)
      return x, sum_sown_losses(sown), cache

    policy = remat_policy(self.cfg)
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
        aux = {name: over_layers(name, values) for name, values in aux_per_layer.items()}
        if not dense_paged:
          dense_pools = jax.tree.map(lambda a: a.reshape((periods * (k - 1),) + a.shape[2:]), dense_caches)
        return x_BLD, aux, {"dense_layers": dense_pools, "layers": moe_pools}
      dense_caches = None if caches is None else by_period(caches["dense_layers"])
      x_BLD, (aux_per_layer, dense_caches, moe_caches) = jax.lax.scan(
          body, x_BLD, (by_period(dense_state), moe_state, rngs, jnp.arange(periods),
                        dense_caches, None if caches is None else caches["layers"]))
      aux = {name: over_layers(name, values) for name, values in aux_per_layer.items()}
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
    aux = unrolled_aux(per_layer)
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
                                 dropout_rng, remat_policy(self.cfg))

  def __call__(self, tokens_BL: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,
               dropout_rng: jax.Array | None = None, pixel_values: jax.Array | None = None) -> jax.Array:
    """Returns float32 logits [B, L, V]. `dropout_rng=None` means deterministic (no dropout)."""
    return self.logits_and_aux(tokens_BL, positions_BL, segment_ids_BL, dropout_rng, pixel_values=pixel_values)[0]

  def image_embeddings(self, pixels_ICRR: jax.Array) -> jax.Array:
    """Soft tokens [I, mm_tokens_per_image, D] of images' pixel values [I, 3, R, R] (each a view of the
    family's image format, e.g. a tile): the family's vision encoder, then its projector."""
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
    if not self.bidirectional_images:
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
    x_BLD, aux = self.hidden_and_aux(tokens_BL, positions_BL, segment_ids_BL, dropout_rng, mtp_targets, pixel_values)
    return self._logits(x_BLD), aux

  def loss_sums_and_aux(self, tokens_BL: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,
                        targets_BL: jax.Array, weights_BL: jax.Array, z_loss_multiplier: float,
                        dropout_rng: jax.Array | None = None, mtp_targets: tuple[jax.Array, jax.Array] | None = None,
                        pixel_values: jax.Array | None = None) -> tuple[dict[str, jax.Array], AuxLosses]:
    """`logits_and_aux` with the logits' `token_loss_sums` ({xent_sum, z_loss_sum}) in their place:
    the head and loss in num_vocab_tiling tiles (models/outputs.head_loss_sums)."""
    x_BLD, aux = self.hidden_and_aux(tokens_BL, positions_BL, segment_ids_BL, dropout_rng, mtp_targets, pixel_values)
    _, sums = head_loss_sums(self.cfg, self.decoder_norm, self._output_module(), x_BLD, targets_BL, weights_BL,
                             z_loss_multiplier)
    return sums, aux

  def hidden_and_aux(self, tokens_BL: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,
                     dropout_rng: jax.Array | None = None, mtp_targets: tuple[jax.Array, jax.Array] | None = None,
                     pixel_values: jax.Array | None = None) -> tuple[jax.Array, AuxLosses]:
    """`logits_and_aux` up to the stack's output [B, L, D] (before the final norm)."""
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
    return x_BLD, aux

  def _per_layer_inputs(self, tokens_BL: jax.Array, x_BLD: jax.Array) -> jax.Array | None:
    """Each layer's own input [B, L, M, P] (per_layer_input_dim > 0: the family's per_layer_inputs), else None."""
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
                              remat_policy(cfg))
      same_document = mtp.ahead(segment_ids_BL, k) == segment_ids_BL
      w_BL = mtp.ahead(weights_BL, k) * same_document
      _, sums = head_loss_sums(cfg, module.final_norm, self._output_module(), h_BLD, mtp.ahead(targets_BL, k), w_BL, 0.0)
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
