"""Prompts prefilled straight into a slot's pages: chunked prefill (prefill_chunk_size tokens a call)
and prefix caching's prefill of what follows the pages a cached prefix already holds.

A part the engine composes with its cache layout (kv_layout.py): it takes a prompt's pages from
the layout's `prompt_pages`, which only the paged layout has; with the dense layout every call
refuses in one line. For a model with recurrent layers (Gated DeltaNet) and prefix caching it
restarts their states from state_snapshots.RecurrentSnapshots at a shared prefix's end.

`layout` resolves the prefix_caching key (auto | true | false) against the layout and the model:
auto turns it on where it exists (the paged layout; a recurrent model only with snapshots),
true refuses where it does not, false keeps it off.

Shape legend (as engine.py): C prefill_chunk_size (or the power of two a one-piece prefill is
padded to), M pages per slot.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from MaxText.configuration.config_groups import DecodeConfig
from MaxText.configuration.model_config import ModelConfig
from MaxText.errors import UserError
from MaxText.inference import image_prompts, kv_layout, paged_cache, sampling, state_snapshots
from MaxText.inference.decode_state import DecodeState, Prefix, RowSampling, row_sampling, sample, seeded, \
    with_prompt
from MaxText.inference.engine_api import TokenLogprobs
from MaxText.layers import lora_rows
from MaxText.platform import sharding
from MaxText.training.model_assembly import ModelOnMesh, Params

# A chunk's result: (state, where the next chunk starts, after the last chunk (first token [1], its scores) else None).
ChunkResult = tuple[DecodeState, int, tuple[jax.Array, TokenLogprobs] | None]
# A prompt's first token among a prefill's rows: (first tokens [B], their scores, the prompt's row).
FirstToken = tuple[jax.Array, TokenLogprobs, int]


def layout(cfg: ModelConfig, decode: DecodeConfig, num_slots: int) -> tuple[kv_layout.KVLayout, int]:
  """The cache layout kv_cache_layout names, sharing prompt pages as prefix_caching says, and how many
  recurrent-state snapshots prefix caching keeps (0: none, or not a recurrent model)."""
  cache = kv_layout.make(cfg, decode, num_slots, prefix_caching=decode.prefix_caching != "false")
  if not (cache.prefix_caching and state_snapshots.has_recurrent_state(cfg)):
    return cache, 0
  capacity = 2 * num_slots if decode.prefix_state_snapshots < 0 else decode.prefix_state_snapshots
  if capacity:
    return cache, capacity
  if decode.prefix_caching == "true":
    raise UserError("prefix_caching=true needs snapshots of this model's recurrent states (Gated DeltaNet layers) "
                    "but prefix_state_snapshots=0 keeps none; set prefix_state_snapshots=-1 (2 per slot) or "
                    "prefix_caching=auto")
  if jax.process_index() == 0:
    print("engine: prefix_caching is off for this model: its Gated DeltaNet layers keep a recurrent state, and "
          "prefix_state_snapshots=0 keeps no snapshots of it for shared prefixes to start from", flush=True)
  return kv_layout.make(cfg, decode, num_slots, prefix_caching=False), 0


class PagePrefill:
  """begin_prompt / prefill_chunk of an engine: one compiled program per chunk length (`traces["extend"]`)."""

  def __init__(self, cfg: ModelConfig, decode: DecodeConfig, cache: kv_layout.KVLayout, model: ModelOnMesh,
               state_shardings: DecodeState, traces: dict[str, int], default_sampling: sampling.SamplingParams,
               snapshot_capacity: int):
    vision, chunk = cfg.vision, decode.prefill_chunk_size
    if vision.use_multimodal and 0 < chunk < vision.mm_tokens_per_image:
      raise UserError(f"prefill_chunk_size={chunk} is less than mm_tokens_per_image={vision.mm_tokens_per_image}: "
                      "an image's tokens attend to each other both ways, so each image is prefilled within one "
                      "chunk; raise prefill_chunk_size or set it to 0")
    self.cfg, self.decode, self.cache, self.model = cfg, decode, cache, model
    self.traces, self.default_sampling = traces, default_sampling
    self.snapshots: state_snapshots.RecurrentSnapshots | None = None
    self._keys: dict[int, bytes] = {}  # slot -> its prompt's cache_key (begin)
    if snapshot_capacity:
      self.snapshots = state_snapshots.RecurrentSnapshots(
          snapshot_capacity, cache.prompt_pages, jax.eval_shape(cache.empty_caches), cfg.scan_layers, state_shardings)
      cache.usable_pages = self.snapshots.usable_pages
      cache.reset()
    replicated = NamedSharding(model.mesh, PartitionSpec())
    self._extend = jax.jit(self._extend_fn, donate_argnums=(1,),
                           out_shardings=(state_shardings, (replicated, TokenLogprobs(replicated, replicated,
                                                                                       replicated))))
    self._extend_rows = jax.jit(self._extend_rows_fn, donate_argnums=(1,),
                                out_shardings=(state_shardings, (replicated, TokenLogprobs(replicated, replicated,
                                                                                            replicated))))

  def reset(self) -> None:
    """A new decode state."""
    self._keys.clear()
    if self.snapshots is not None:
      self.snapshots.reset()

  def release(self, slot: int) -> None:
    self._keys.pop(slot, None)
    if self.snapshots is not None:
      self.snapshots.forget(slot)

  def begin(self, slot: int, prompt: Sequence[int], images: image_prompts.PromptImages | None = None,
            cache_key: bytes = b"") -> int:
    """The pages of `prompt` for `slot`, which generate steps skip until the last chunk has run
    (raises OutOfPages, nothing changed, when they are not free). Returns where prefilling starts:
    after the prompt's leading pages another request already cached (prefix caching; with
    `images`, pages keyed by their content too, and never inside an image's run; with a
    `cache_key`, only pages cached under the same key), else 0."""
    pages = self.cache.prompt_pages()
    limit = self.cfg.max_target_length
    if not 1 <= len(prompt) <= limit - 1:
      raise UserError(f"a prompt of {len(prompt)} tokens does not fit max_target_length={limit} with room to generate")
    runs = image_prompts.image_runs(prompt, self.cfg.vision, images)
    self._keys[slot] = cache_key
    salts = self._salts(slot, runs, images, pages.page_size)
    start = pages.assign(slot, len(prompt), active=False, prompt=prompt, salts=salts, runs=runs)
    if self.snapshots is not None:  # assign shared pages only up to a boundary with a snapshot
      self.snapshots.begin(slot, prompt, start, salts)
    return start

  def _salts(self, slot: int, runs: Sequence[image_prompts.Run], images: image_prompts.PromptImages | None,
             page_size: int) -> dict[int, bytes]:
    """The pages' salts (image_prompts.page_salts) with the slot's cache_key folded into page 0's: the
    chain hash carries it into every later page, so prompts under different keys share none."""
    salts = image_prompts.page_salts(runs, images, page_size)
    key = self._keys.get(slot, b"")
    if key:
      salts[0] = key + salts.get(0, b"")
    return salts

  def chunk(self, params: Params, state: DecodeState, slot: int, prompt: Sequence[int], start: int,
            row_params: sampling.RowParams | None = None, seed: int = 0,
            images: image_prompts.PromptImages | None = None, mask: np.ndarray | None = None) -> ChunkResult:
    """Prefills prompt[start:start + prefill_chunk_size] of `slot` straight into its pages, attending
    over the tokens before it there; see Engine.prefill_chunk."""
    pages = self.cache.prompt_pages()
    chunk = self.decode.prefill_chunk_size
    if not chunk:  # the rest of the prompt in one piece, padded to a power of two: a few programs in all
      chunk = min(1 << max(len(prompt) - start - 1, 0).bit_length(), self.decode.max_prefill_predict_length)
    runs = image_prompts.image_runs(prompt, self.cfg.vision, images)
    end = image_prompts.chunk_end(start, min(start + chunk, len(prompt)), runs)
    if self.snapshots is not None:  # the shared prefix's recurrent states, not zeros; chunks end at a boundary
      state, end = self.snapshots.before_chunk(state, slot, prompt, start, end, runs)
    tokens = list(prompt[start:end])
    pixels = image_prompts.images_within(images, runs, start, end)
    rows = row_sampling([row_params or sampling.RowParams.from_strategy(self.default_sampling, seed)])
    tokens_1C = np.zeros((1, chunk), np.int32)
    tokens_1C[0, :len(tokens)] = tokens
    with sharding.activation_sharding(self.model.mesh, self.model.rules):
      # Host arrays of their own (the allocator's table changes after the call): no dispatch each.
      state, first = self._extend(params, state, tokens_1C, np.int32(start), np.int32(len(tokens)), np.int32(slot),
                                  pages.table[slot][None].copy(), rows, None if pixels is None else jnp.asarray(pixels),
                                  None if mask is None else jnp.asarray(mask))
    salts = self._salts(slot, runs, images, pages.page_size)
    if self.snapshots is not None:
      self.snapshots.after_chunk(state.caches, slot, prompt, end, salts)
    if end < len(prompt):
      return state, end, None
    pages.activate(slot, prompt, salts)
    return state, end, first

  def _extend_fn(self, params: Params, state: DecodeState, tokens_1C: jax.Array, start: jax.Array, length: jax.Array,
                 slot: jax.Array, table_1M: jax.Array, rows: RowSampling, pixels: jax.Array | None,
                 mask_1W: jax.Array | None = None) -> tuple[DecodeState, tuple[jax.Array, TokenLogprobs]]:
    """One prefill chunk of one slot through its pages: tokens [1, C] (the first `length` real) at
    positions start.. attend over what the slot's pages already hold; the slot's next position,
    token and sampling rows are set as `insert` sets them (read only after the last chunk).
    Padding past `length` writes garbage only at positions the generated tokens overwrite before
    anything attends to them, or, past the prompt's pages, nowhere."""
    self.traces["extend"] += 1
    rows = seeded(rows)
    stacked = self.cfg.scan_layers
    stored_tables = jax.tree.map(lambda c: c.block_table_BM if paged_cache.is_pool(c) else c, state.caches,
                                 is_leaf=paged_cache.is_pool)
    caches = paged_cache.with_block_table(paged_cache.slot_states(state.caches, slot, stacked), table_1M)
    positions_1C = start + jnp.arange(tokens_1C.shape[1], dtype=jnp.int32)[None]
    with lora_rows.use_rows(rows.adapter_B):  # the slot's LoRA adapter (lora_adapters.py)
      logits_11V, caches = self.model.spec.apply_decode(params, tokens_1C, positions_1C, caches, (length - 1)[None],
                                                        pixels)
    caches = jax.tree.map(lambda c, t: dataclasses.replace(c, block_table_BM=t) if paged_cache.is_pool(c) else c,
                          caches, stored_tables, is_leaf=paged_cache.is_pool)
    caches = paged_cache.with_slot_states(state.caches, caches, slot, stacked)
    tokens_1, rows, logprobs = sample(logits_11V[:, 0], rows, mask_1W)
    prefix = Prefix(None, (start + length)[None], tokens_1, rows, logprobs)
    return with_prompt(state, caches, prefix, slot, jnp.int32(0)), (tokens_1, logprobs)

  def rests(self, params: Params, state: DecodeState, slots: Sequence[int], prompts: Sequence[Sequence[int]],
            starts: Sequence[int], row_params: Sequence[sampling.RowParams],
            masks: np.ndarray | None = None) -> tuple[DecodeState, list[FirstToken]]:
    """The rest of each text prompt of `slots` (from its start: after the pages a cached prefix holds)
    prefilled into its pages, each slot then generating; `masks` [B, W]: the first tokens' bitmasks.
    Two or more rests that fit max_prefill_predict_length go in one call, padded to it and to a power
    of two rows (at most the slots' number); the others, and a recurrent model's (their snapshots
    are taken per slot), `chunk` by `chunk` as one prompt alone."""
    pages = self.cache.prompt_pages()
    longest = self.decode.max_prefill_predict_length
    together = [i for i, (prompt, start) in enumerate(zip(prompts, starts))
                if self.snapshots is None and not state_snapshots.has_recurrent_state(self.cfg)
                and len(prompt) - start <= longest]
    if len(together) < 2:  # one prompt alone: its own program, as before
      together = []
    firsts: dict[int, FirstToken] = {}
    for i in sorted(set(range(len(prompts))) - set(together)):
      start, first = starts[i], None
      mask = None if masks is None else masks[i:i + 1]
      while first is None:
        state, start, first = self.chunk(params, state, slots[i], prompts[i], start, row_params[i], mask=mask)
      firsts[i] = (*first, 0)
    if together:
      rows = min(1 << (len(together) - 1).bit_length(), max(self.cache.num_slots, len(together)))
      tokens_BC = np.zeros((rows, longest), np.int32)  # padded as a prefill's rows: one program per row count
      starts_B, lengths_B = np.zeros(rows, np.int32), np.ones(rows, np.int32)
      slots_B = np.full(rows, self.cache.num_slots, np.int32)  # a padding row's updates are dropped
      table_BM = np.full((rows, pages.table.shape[1]), -1, np.int32)  # and its tokens written nowhere
      for row, i in enumerate(together):
        rest = prompts[i][starts[i]:]
        tokens_BC[row, :len(rest)] = rest
        starts_B[row], lengths_B[row], slots_B[row] = starts[i], len(rest), slots[i]
        table_BM[row] = pages.table[slots[i]]
      padded = [row_params[i] for i in together] + [sampling.RowParams()] * (rows - len(together))
      masks_BW = None
      if masks is not None:
        masks_BW = np.concatenate([masks[together], np.repeat(masks[together[:1]], rows - len(together), 0)])
      with sharding.activation_sharding(self.model.mesh, self.model.rules):
        state, (tokens_B, logprobs) = self._extend_rows(params, state, tokens_BC, starts_B, lengths_B, slots_B,
                                                        table_BM, row_sampling(padded),
                                                        None if masks_BW is None else jnp.asarray(masks_BW))
      for row, i in enumerate(together):
        runs = image_prompts.image_runs(prompts[i], self.cfg.vision, None)
        pages.activate(slots[i], prompts[i], self._salts(slots[i], runs, None, pages.page_size))
        firsts[i] = (tokens_B, logprobs, row)
    return state, [firsts[i] for i in range(len(prompts))]

  def _extend_rows_fn(self, params: Params, state: DecodeState, tokens_BC: jax.Array, starts_B: jax.Array,
                      lengths_B: jax.Array, slots_B: jax.Array, table_BM: jax.Array, rows: RowSampling,
                      masks_BW: jax.Array | None) -> tuple[DecodeState, tuple[jax.Array, TokenLogprobs]]:
    """`_extend_fn` for B slots at once (a model without slot states): row b's tokens at positions
    starts[b].. through its pages; a row whose slot is out of range changes nothing."""
    self.traces["extend"] += 1
    rows = seeded(rows)
    stored_tables = jax.tree.map(lambda c: c.block_table_BM if paged_cache.is_pool(c) else c, state.caches,
                                 is_leaf=paged_cache.is_pool)
    caches = paged_cache.with_block_table(state.caches, table_BM)
    positions_BC = starts_B[:, None] + jnp.arange(tokens_BC.shape[1], dtype=jnp.int32)[None]
    with lora_rows.use_rows(rows.adapter_B):
      logits_B1V, caches = self.model.spec.apply_decode(params, tokens_BC, positions_BC, caches, lengths_B - 1, None)
    caches = jax.tree.map(lambda c, t: dataclasses.replace(c, block_table_BM=t) if paged_cache.is_pool(c) else c,
                          caches, stored_tables, is_leaf=paged_cache.is_pool)
    tokens_B, rows, logprobs = sample(logits_B1V[:, 0], rows, masks_BW)
    prefix = Prefix(None, starts_B + lengths_B, tokens_B, rows, logprobs)
    return with_prompt(state, caches, prefix, slots_B, jnp.arange(tokens_BC.shape[0])), (tokens_B, logprobs)
