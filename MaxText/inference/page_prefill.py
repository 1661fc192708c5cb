"""Prompts prefilled straight into a slot's pages: chunked prefill (prefill_chunk_size tokens a call)
and prefix caching's prefill of what follows the pages a cached prefix already holds; one prompt a
call (`chunk`) or several as the rows of one call (`rests`, `chunks`: one chunk budget shared).

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

from MaxText.configuration.decode_config import DecodeConfig
from MaxText.configuration.model_config import ModelConfig
from MaxText.configuration.vision_config import VisionConfig
from MaxText.errors import UserError
from MaxText.inference import image_prompts, kv_layout, paged_cache, sampling, state_snapshots
from MaxText.inference.decode_state import DecodeState, Prefix, RowSampling, check_token_ids, row_sampling, sample, \
    seeded, with_prompt
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
    check_token_ids([prompt], self.cfg)
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
                                  None if mask is None else np.asarray(mask))
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
            images: Sequence[image_prompts.PromptImages | None] | None = None,
            masks: np.ndarray | None = None) -> tuple[DecodeState, list[FirstToken]]:
    """The rest of each prompt of `slots` (from its start: after the pages a cached prefix holds)
    prefilled into its pages, each slot then generating; `masks` [B, W]: the first tokens' bitmasks.
    Two or more prompts go in as the rows of one call per piece (`_rows`: each piece at most
    max_prefill_predict_length tokens, ending before an image run it would split and, for a
    recurrent model, at a page boundary its states are kept at), so N rests take as many calls as
    the one of them that needs most; a prompt alone, `chunk` by `chunk` as before."""
    if len(prompts) == 1:
      start, first = starts[0], None
      while first is None:
        state, start, first = self.chunk(params, state, slots[0], prompts[0], start, row_params[0],
                                          images=None if images is None else images[0], mask=masks)
      return state, [(*first, 0)]
    plans = _Plans(slots, prompts, starts, row_params, images, masks, self.cfg.vision)
    longest = self.decode.max_prefill_predict_length
    firsts: dict[int, FirstToken] = {}
    while len(firsts) < len(prompts):
      pieces = [(i, self._piece_end(plans, i, min(plans.starts[i] + longest, len(prompts[i]))))
                for i in range(len(prompts)) if i not in firsts]
      pieces = [(i, end) for i, end in pieces if end > plans.starts[i]]
      if not pieces:
        raise UserError(f"an image run does not fit max_prefill_predict_length={longest}; raise it")
      state, done = self._rows(params, state, plans, pieces, longest)
      firsts.update(done)
    return state, [firsts[i] for i in range(len(prompts))]

  def chunks(self, params: Params, state: DecodeState, slots: Sequence[int], prompts: Sequence[Sequence[int]],
             starts: Sequence[int], row_params: Sequence[sampling.RowParams],
             images: Sequence[image_prompts.PromptImages | None] | None = None,
             masks: np.ndarray | None = None) -> tuple[DecodeState, list[tuple[int, FirstToken | None]]]:
    """One call's budget of prefill_chunk_size (C) prompt tokens spent on the next chunks of the prompts
    of `slots`, in the order given, as the rows of one call of R rows of C // R tokens (R a power of two,
    at most the slots' number): the padded tokens of a call stay one chunk's, one program per R. Each of
    the first R prompts that can go on takes up to C // R tokens (less where its chunk must end before
    an image run or at a recurrent model's snapshot boundary; nothing when an image run that starts
    there does not fit), and the R that prefills the most tokens is taken (the fewest rows of a tie;
    R = 1: `chunk`, as without batching). Returns each prompt's (where its next chunk starts, after its
    last chunk (first tokens [B], their scores, its row) else None)."""
    plans = _Plans(slots, prompts, starts, row_params, images, masks, self.cfg.vision)
    budget = self.decode.prefill_chunk_size
    rows, pieces, most = 1, [], 0
    candidate = 1
    while candidate <= min(self.cache.num_slots, budget) and (candidate == 1 or candidate // 2 < len(prompts)):
      chosen: list[tuple[int, int]] = []
      for i, prompt in enumerate(prompts):
        end = self._piece_end(plans, i, min(starts[i] + budget // candidate, len(prompt)))
        if end > starts[i]:
          chosen.append((i, end))
        if len(chosen) == candidate:
          break
      tokens = sum(end - starts[i] for i, end in chosen)
      if tokens > most:
        rows, pieces, most = candidate, chosen, tokens
      candidate *= 2
    if not pieces:
      return state, [(start, None) for start in starts]
    if rows == 1:  # one chunk: the program of one slot, as without batching
      i = pieces[0][0]
      state, end, first = self.chunk(params, state, slots[i], prompts[i], starts[i], row_params[i],
                                     images=plans.images[i], mask=plans.mask(i))
      return state, [(end, None if first is None else (*first, 0)) if j == i else (starts[j], None)
                     for j in range(len(prompts))]
    state, firsts = self._rows(params, state, plans, pieces, budget // rows, rows)
    ends = dict(pieces)
    return state, [(ends.get(i, starts[i]), firsts.get(i)) for i in range(len(prompts))]

  def _piece_end(self, plans: "_Plans", i: int, limit: int) -> int:
    """Where a call over prompt i from its start, up to `limit`, ends (as `chunk` ends its chunks; its
    start when an image run starting there would be split)."""
    start, runs = plans.starts[i], plans.runs[i]
    end = image_prompts.chunk_end(start, limit, runs)
    if any(run_start == start and end < run_end for run_start, run_end in runs):
      return start
    if self.snapshots is not None:
      end = self.snapshots.chunk_end(plans.prompts[i], start, end, runs)
    return end

  def _rows(self, params: Params, state: DecodeState, plans: "_Plans", pieces: Sequence[tuple[int, int]], width: int,
            rows: int = 0) -> tuple[DecodeState, dict[int, FirstToken]]:
    """prompt i[start:end] for each (i, end) of `pieces` as the rows of one call, padded to `width` tokens
    and `rows` rows (0: a power of two, at most the slots' number: one program per row count); each
    slot's recurrent states are restored from a snapshot before and kept at a page boundary after, as
    `chunk` does. Returns the first token of each prompt the call finishes; the others' starts move on."""
    pages = self.cache.prompt_pages()
    rows = rows or min(1 << (len(pieces) - 1).bit_length(), max(self.cache.num_slots, len(pieces)))
    tokens_BC = np.zeros((rows, width), np.int32)
    starts_B, lengths_B = np.zeros(rows, np.int32), np.ones(rows, np.int32)
    slots_B = np.full(rows, self.cache.num_slots, np.int32)  # a padding row's updates are dropped
    table_BM = np.full((rows, pages.table.shape[1]), -1, np.int32)  # and its tokens written nowhere
    pixels: list[np.ndarray | None] = [None] * rows
    for row, (i, end) in enumerate(pieces):
      slot, prompt, start = plans.slots[i], plans.prompts[i], plans.starts[i]
      if self.snapshots is not None:  # the shared prefix's recurrent states, not zeros
        state, _ = self.snapshots.before_chunk(state, slot, prompt, start, end, plans.runs[i])
      tokens_BC[row, :end - start] = prompt[start:end]
      starts_B[row], lengths_B[row], slots_B[row] = start, end - start, slot
      table_BM[row] = pages.table[slot]
      pixels[row] = image_prompts.images_within(plans.images[i], plans.runs[i], start, end)
    padded = [plans.row_params[i] for i, _ in pieces] + [sampling.RowParams()] * (rows - len(pieces))
    masks_BW = None
    if plans.masks is not None:
      chosen = [i for i, _ in pieces]
      masks_BW = np.concatenate([plans.masks[chosen], np.repeat(plans.masks[chosen[:1]], rows - len(pieces), 0)])
    with sharding.activation_sharding(self.model.mesh, self.model.rules):
      state, (tokens_B, logprobs) = self._extend_rows(params, state, tokens_BC, starts_B, lengths_B, slots_B, table_BM,
                                                      row_sampling(padded), _pixel_rows(pixels),
                                                      None if masks_BW is None else np.asarray(masks_BW))
    firsts: dict[int, FirstToken] = {}
    for row, (i, end) in enumerate(pieces):
      slot, prompt = plans.slots[i], plans.prompts[i]
      salts = self._salts(slot, plans.runs[i], plans.images[i], pages.page_size)
      if self.snapshots is not None:
        self.snapshots.after_chunk(state.caches, slot, prompt, end, salts)
      plans.starts[i] = end
      if end == len(prompt):
        pages.activate(slot, prompt, salts)
        firsts[i] = (tokens_B, logprobs, row)
    return state, firsts

  def _extend_rows_fn(self, params: Params, state: DecodeState, tokens_BC: jax.Array, starts_B: jax.Array,
                      lengths_B: jax.Array, slots_B: jax.Array, table_BM: jax.Array, rows: RowSampling,
                      pixels: jax.Array | None, masks_BW: jax.Array | None
                      ) -> tuple[DecodeState, tuple[jax.Array, TokenLogprobs]]:
    """`_extend_fn` for B slots at once: row b's tokens at positions starts[b].. through its pages and
    from its slot's recurrent states; a row whose slot is out of range changes nothing."""
    self.traces["extend"] += 1
    rows = seeded(rows)
    stacked = self.cfg.scan_layers
    stored_tables = jax.tree.map(lambda c: c.block_table_BM if paged_cache.is_pool(c) else c, state.caches,
                                 is_leaf=paged_cache.is_pool)
    caches = paged_cache.with_block_table(paged_cache.rows_states(state.caches, slots_B, stacked), table_BM)
    positions_BC = starts_B[:, None] + jnp.arange(tokens_BC.shape[1], dtype=jnp.int32)[None]
    with lora_rows.use_rows(rows.adapter_B):
      logits_B1V, caches = self.model.spec.apply_decode(params, tokens_BC, positions_BC, caches, lengths_B - 1, pixels)
    caches = jax.tree.map(lambda c, t: dataclasses.replace(c, block_table_BM=t) if paged_cache.is_pool(c) else c,
                          caches, stored_tables, is_leaf=paged_cache.is_pool)
    caches = paged_cache.with_rows_states(state.caches, caches, slots_B, stacked)
    tokens_B, rows, logprobs = sample(logits_B1V[:, 0], rows, masks_BW)
    prefix = Prefix(None, starts_B + lengths_B, tokens_B, rows, logprobs)
    return with_prompt(state, caches, prefix, slots_B, jnp.arange(tokens_BC.shape[0])), (tokens_B, logprobs)


class _Plans:
  """The prompts of one `rests` / `chunks` call, their image runs, and where each goes on from."""

  def __init__(self, slots: Sequence[int], prompts: Sequence[Sequence[int]], starts: Sequence[int],
               row_params: Sequence[sampling.RowParams], images: Sequence[image_prompts.PromptImages | None] | None,
               masks: np.ndarray | None, vision: VisionConfig):
    count = len(prompts)
    if not len(slots) == len(starts) == len(row_params) == count or (images is not None and len(images) != count):
      raise ValueError(f"{count} prompts need as many slots, starts, row_params and image rows")
    self.slots, self.prompts, self.starts, self.row_params = slots, prompts, list(starts), row_params
    self.images = list(images) if images is not None else [None] * count
    self.masks = masks
    self.runs = [image_prompts.image_runs(p, vision, i) for p, i in zip(prompts, self.images)]

  def mask(self, i: int) -> np.ndarray | None:
    return None if self.masks is None else self.masks[i:i + 1]


def _pixel_rows(rows: Sequence[np.ndarray | None]) -> jax.Array | None:
  """Each row's images ([1, M_b, 3, R, R] or None) as one [B, M, 3, R, R] array, zero-padded to the most."""
  given = [r for r in rows if r is not None]
  if not given:
    return None
  out = np.zeros((len(rows), max(r.shape[1] for r in given)) + given[0].shape[2:], np.float32)
  for b, r in enumerate(rows):
    if r is not None:
      out[b, :r.shape[1]] = r[0]
  return jnp.asarray(out)
