"""A decode engine with the JetStream shape: load_params, prefill, insert, generate.

Shape legend: B prompts in one prefill, L max_prefill_predict_length (padded prompt length),
T slots of the batched decode state, S max_target_length (cache length), V vocabulary.

- `prefill` runs right-padded prompts [B, L] in one pass and returns a `Prefix`: their caches
  (length L), true lengths and first sampled tokens.
- `insert` copies one prefix row into slot i of a `DecodeState` (caches of length S for T slots);
  `insert_rows` several rows into their slots in one call; `prefill_insert` is `prefill` and
  `insert_rows` in one call that takes the decode state (the prompts' caches never returned).
- `generate` advances every slot by one token: one jitted, shape-stable step (it compiles once);
  `decode_step` is the same program, also returning the tokens' log-probabilities. With
  decode_steps_per_call > 1 or `StepLimits`, `decode_step` runs up to that many steps in one
  device-side loop (decode_block.py) that stops each slot at its end of sequence or length.
- `release` returns a finished slot's cache resources (nothing to return for the dense cache).
Sampling is per slot: each prompt row brings its own temperature, top-p, top-k and seed
(`sampling.RowParams`, by default the decode_sampling_* keys), which `insert` copies into the
slot, so requests with different parameters share one compiled step.
Continuous batching is `serve`: requests wait for a free slot, are prefilled and inserted, and
leave their slot when done, all while the other slots keep generating.

The engine composes parts, each in its own module: the cache layout (kv_layout.py; kv_layout.make
picks dense or paged, nothing here asks which), prompts prefilled straight into pages
(page_prefill.py: chunked prefill, prefix caching and its recurrent-state snapshots) and the
records it passes around (decode_state.py). kv_cache_layout=paged keeps each layer's cache as a
pool of pages (inference/paged_cache.py) with a host-side allocator tied to the state of the last
`init_decode_state`: `insert` takes the prompt's pages, `generate` a new page when a slot crosses a
page boundary (chosen on the host before the jitted step, which takes the block table as an
argument), `release(slot)` gives them back. One engine, one decode state at a time.

A vision-language model's prompts may bring images (image_prompts.PromptImages: `prefill`'s
`images`, `begin_prompt`/`prefill_chunk`'s, `score`'s): prefill runs them through the vision tower
with each image's tokens attending both ways; generate steps are text.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.platform import distributed
from MaxText.training import model_assembly
from MaxText.platform import sharding
from MaxText.configuration.config import Config
from MaxText.configuration.model_config import ModelConfig
from MaxText.errors import UserError
from MaxText.inference import image_prompts, page_prefill, paged_cache, quantized_weights, sampling
from MaxText.inference.decode_state import (DecodeState, Prefix, RowSampling, check_token_ids, pad_prompts,
                                            padded_pairs, row_sampling, sample, seeded, with_prompt)
from MaxText.inference import decode_block
from MaxText.inference.engine_api import Emitted, Prefilled, SlotInfo, StepLimits, TokenLogprobs
from MaxText.inference.state_snapshots import has_recurrent_state
from MaxText.layers import kv_cache, lora_rows
from MaxText.training.model_assembly import Params



# A Gated DeltaNet layer's recurrent state summarises every token so far. A draft model's rounds restore the
# states from before the round and replay the accepted tokens (speculative.roll_back_recurrent); the MTP heads'
# rounds keep no such copy. Prefix caching restarts one from snapshots at page boundaries (state_snapshots.py).
RECURRENT_REFUSAL = ("{what} is not supported for a model with Gated DeltaNet layers (Qwen3-Next, Qwen3.5): their "
                     "recurrent decode state cannot be rolled back past rejected draft tokens; {fix}")


def refuse_mtp_speculative(cfg: ModelConfig) -> None:
  """Speculative decoding with the target's own MTP heads rolls rejected tokens back by position only."""
  if has_recurrent_state(cfg):
    raise UserError(RECURRENT_REFUSAL.format(what="speculative decoding with the model's MTP heads",
                                             fix="name a draft model (draft_model_name=...) or set speculative_tokens=0"))


class Engine:
  """Prefill/insert/generate over one model; every step function is jitted once per shape. An
  engine_api.DecodeEngine (one token per slot and step)."""

  speculative_tokens = 0

  def __init__(self, config: Config, num_slots: int = 1, mesh: Mesh | None = None):
    self.config, self.cfg, self.decode_cfg = config, config.model, config.decode
    if self.cfg.pipeline.num_pipeline_stages > 1:  # here, not at the first prefill's trace (a traceback)
      raise UserError(f"decoding does not support pipeline parallelism ({self.cfg.pipeline.num_pipeline_stages} "
                      "stages); set ici_pipeline_parallelism=1 and dcn_pipeline_parallelism=1")
    if self.cfg.moe.num_experts > 1 and self.cfg.moe.capacity_factor > 0:
      # Expert capacity is counted per call (a prompt, then one token), so which tokens are dropped
      # would depend on how the text is split into calls: decode dropless, the exact routing.
      self.cfg = dataclasses.replace(self.cfg, moe=dataclasses.replace(self.cfg.moe, capacity_factor=-1.0))
    self.num_slots = num_slots
    self._busy = np.zeros(num_slots, bool)  # slots holding a request (SlotInfo.busy)
    prefill, target = self.decode_cfg.max_prefill_predict_length, self.cfg.max_target_length
    if prefill >= target:
      raise UserError(f"max_prefill_predict_length ({prefill}) must be less than max_target_length ({target}): "
                      "the cache needs room for generated tokens")
    self.model = model_assembly.build_model(config, mesh=mesh, model=self.cfg)
    self.mesh, self.rules, self.spec = self.model.mesh, self.model.rules, self.model.spec
    self.param_shardings = self.model.param_shardings  # of the float parameters prepare_params takes
    self.weight_quantizer = quantized_weights.for_engine(self.spec, self.decode_cfg.quantize_weights,
                                                         self.decode_cfg.quantize_weights_block)
    self.sampling = sampling.SamplingParams(
        self.decode_cfg.decode_sampling_strategy, self.decode_cfg.decode_sampling_temperature,
        self.decode_cfg.decode_sampling_top_p, self.decode_cfg.decode_sampling_top_k)
    self.vocab_size = self.cfg.vocab_size
    self.cache, snapshot_capacity = page_prefill.layout(self.cfg, self.decode_cfg, num_slots)
    self.prefix_caching = self.cache.prefix_caching  # in effect (prefix_caching=auto: where it exists)
    # The scheduler prefills prompts straight into pages (begin_prompt, prefill_chunk).
    self.prefills_into_pages = self.cache.prefills_into_pages
    abstract_caches = jax.eval_shape(self.cache.empty_caches)
    self._cache_bytes = paged_cache.cache_bytes(abstract_caches)  # cache_stats is read by every /health
    names = self.cache.logical_names()
    replicated = NamedSharding(self.mesh, PartitionSpec())
    # A DecodeState-shaped tree of shardings (its fields hold NamedShardings, not arrays).
    rows = RowSampling(replicated, replicated, replicated, replicated, replicated)
    self.state_shardings = DecodeState(sharding.named_shardings(abstract_caches, names, self.mesh, self.rules),
                                       replicated, replicated, rows)
    # jit traces (= compilations) per step function
    self.traces = {"prefill": 0, "insert": 0, "generate": 0, "score": 0, "extend": 0}
    self._init_state = jax.jit(self._init_state_fn, out_shardings=self.state_shardings)
    self._prefill = jax.jit(self._prefill_fn)
    self._insert = jax.jit(self._insert_fn, donate_argnums=(1,), out_shardings=self.state_shardings)
    self._insert_rows = jax.jit(self._insert_rows_fn, donate_argnums=(1,), out_shardings=self.state_shardings)
    self._prefill_insert = jax.jit(self._prefill_insert_fn, donate_argnums=(1,), out_shardings=(
        self.state_shardings, Prefilled(replicated, TokenLogprobs(replicated, replicated, replicated))))
    self._generate = jax.jit(self._generate_fn, donate_argnums=(1,), static_argnames=("top",),
                             out_shardings=(self.state_shardings, (replicated, TokenLogprobs(replicated, replicated,
                                                                                             replicated))))
    self._score = jax.jit(self._score_fn)
    self.steps_per_call = self.decode_cfg.decode_steps_per_call
    self._block = jax.jit(self._block_fn, donate_argnums=(1,), static_argnames=("top",),
                          out_shardings=(self.state_shardings, replicated))
    self._unlimited: tuple[jax.Array, jax.Array] | None = None  # `_steps` without limits: its ends_T, stop_E
    self.page_prefill = page_prefill.PagePrefill(self.cfg, self.decode_cfg, self.cache, self.model,
                                                 self.state_shardings, self.traces, self.sampling, snapshot_capacity)

  # ---------------------------------------------------------------- public API
  def load_params(self, path: str | None = None, seed: int = 0) -> Params:
    """Parameters from a checkpoint (params-only, step directory or checkpoints root), sharded for
    this mesh; with no path, freshly initialised ones (for tests and benchmarks)."""
    return self.prepare_params(self.model.params(path or "", seed), donate=True)

  def prepare_params(self, params: Params, donate: bool = False) -> Params:
    """Float parameters laid out as `param_shardings` as this engine decodes from them: with
    quantize_weights, the decoder kernels in 8-bit storage (quantized_weights.py); `donate`: the
    float kernels' buffers may be reused."""
    if self.weight_quantizer is None:
      return params
    return self.weight_quantizer(params, self.param_shardings, donate)

  def init_decode_state(self, seed: int = 0) -> DecodeState:
    """Empty caches for every slot, born sharded (paged: every page free again)."""
    self.cache.reset()
    self.page_prefill.reset()
    self._busy[:] = False
    try:
      return self._init_state(jnp.uint32(seed))
    except jax.errors.JaxRuntimeError as e:  # a cache the keys size far past the devices' memory
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      keys = "kv_num_pages or kv_page_size" if self.cache.name == "paged" else "serve_max_slots or max_target_length"
      raise UserError(f"the {self.cache.name} KV cache of {self.num_slots} slots needs {self._cache_bytes / 2**30:.3g} "
                      f"GiB, more than the devices could allocate: lower {keys}") from None

  def prefill(self, params: Params, prompts: Sequence[Sequence[int]], seed: int = 0,
              row_params: Sequence[sampling.RowParams] | None = None,
              images: Sequence[image_prompts.PromptImages | None] | None = None,
              masks: np.ndarray | None = None) -> Prefix:
    """One pass over the right-padded prompts (each at most max_prefill_predict_length tokens).
    Each row samples by its `row_params` (default: the decode_sampling_* keys, row i seeded
    with seed + i). `images`: each prompt's images (None: none), one per placeholder run.
    `masks`: int32 [B, W] token bitmasks of the first tokens (constrained decoding; sampling.apply_token_mask)."""
    tokens_BL, lengths_B = pad_prompts(prompts, self.decode_cfg.max_prefill_predict_length, self.cfg)
    pixels = self._pixels(prompts, images)
    with sharding.activation_sharding(self.mesh, self.rules):
      return self._prefill(params, tokens_BL, lengths_B, self.row_sampling(prompts, seed, row_params), pixels,
                           None if masks is None else np.asarray(masks))

  def prefill_insert(self, params: Params, state: DecodeState, prompts: Sequence[Sequence[int]], slots: Sequence[int],
                     seed: int = 0, row_params: Sequence[sampling.RowParams] | None = None,
                     images: Sequence[image_prompts.PromptImages | None] | None = None,
                     masks: np.ndarray | None = None) -> tuple[DecodeState, Prefilled]:
    """`prefill` of the prompts, then prompt i into slots[i] (the prompts past len(slots) are padding rows) as
    `insert_rows` does, in one jitted call that takes `state` (donated) and never returns the prompts' caches
    (engine_api.PrefillsIntoSlots)."""
    tokens_BL, lengths_B = pad_prompts(prompts, self.decode_cfg.max_prefill_predict_length, self.cfg)
    pixels = self._pixels(prompts, images)
    rows = self.row_sampling(prompts, seed, row_params)
    slots_R, rows_R, table_RM = self.admit_rows(lengths_B, slots, range(len(slots)))
    with sharding.activation_sharding(self.mesh, self.rules):
      return self._prefill_insert(params, state, tokens_BL, lengths_B, rows, pixels,
                                  None if masks is None else np.asarray(masks), slots_R, rows_R, table_RM)

  def row_sampling(self, prompts: Sequence[Sequence[int]], seed: int,
                   row_params: Sequence[sampling.RowParams] | None) -> RowSampling:
    """A prefill's rows' sampling (host arrays): `row_params`, else the decode_sampling_* keys, row i seeded
    seed + i."""
    if row_params is None:
      row_params = [sampling.RowParams.from_strategy(self.sampling, seed + i) for i in range(len(prompts))]
    if len(row_params) != len(prompts):
      raise ValueError(f"{len(row_params)} row_params for {len(prompts)} prompts")
    return row_sampling(row_params)

  def insert(self, prefix: Prefix, state: DecodeState, slot: int, row: int = 0) -> DecodeState:
    """`state` with prompt `row` of `prefix` in slot `slot` (slot and row are traced: no recompiles)."""
    self._check_slot(slot)
    admitted = self.cache.admit(slot, prefix.next_positions_B, row)
    state = self._insert(prefix, state, np.int32(slot), np.int32(row), admitted)
    self._busy[slot] = True
    return state

  def insert_rows(self, prefix: Prefix, state: DecodeState, slots: Sequence[int], rows: Sequence[int]) -> DecodeState:
    """`state` with prompt rows[i] of `prefix` in slots[i] for every i, in one call: what an `insert`
    each gives (engine_api.InsertsRowsTogether). The call always holds as many pairs as `prefix` has
    rows (the first pair repeated: writing it again changes nothing), so one program compiles per
    prefill batch size, as `insert`'s does. Paged: OutOfPages leaves every slot as it was."""
    return self._insert_rows(prefix, state, *self.admit_rows(prefix.next_positions_B, slots, rows))

  def admit_rows(self, lengths_B: jax.Array | np.ndarray, slots: Sequence[int], rows: Sequence[int]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The host side of `insert_rows` for a prefill of prompts `lengths_B` long: the slots checked and
    admitted (busy; paged: their pages taken, all or none), and the call's (slots, rows, block tables), padded to
    as many pairs as the prefill has rows by repeating the first pair (writing it again changes nothing)."""
    batch = int(np.shape(lengths_B)[0])
    if len(slots) != len(rows) or not 1 <= len(slots) <= batch or len(set(slots)) != len(slots):
      raise ValueError(f"insert_rows takes 1 to {batch} distinct slots, one row each; got slots {list(slots)}, "
                       f"rows {list(rows)}")
    for slot in slots:
      self._check_slot(slot)
    admitted: list[np.ndarray | None] = []
    try:
      for slot, row in zip(slots, rows):
        admitted.append(self.cache.admit(slot, lengths_B, row))
    except Exception:
      for slot in slots[:len(admitted)]:  # the pages of those admitted before the failure go back
        self.cache.release(slot)
      raise
    table_RM = None if admitted[0] is None else np.stack([a for a in admitted if a is not None] +
                                                         [admitted[0]] * (batch - len(slots)))
    self._busy[list(slots)] = True
    return (*padded_pairs(slots, rows, batch), table_RM)

  def generate(self, params: Params, state: DecodeState) -> tuple[DecodeState, jax.Array]:
    """Every slot's next token [T]; the state moves on by one position per slot. Paged: raises
    paged_cache.OutOfPages (state unchanged) when a slot crossing a page boundary finds none free."""
    state, (tokens_B, _) = self._step(params, state)
    return state, tokens_B

  def _step(self, params: Params, state: DecodeState, mask: np.ndarray | None = None, ends_T: np.ndarray | None = None,
            top: bool = True) -> tuple[DecodeState, tuple[jax.Array, TokenLogprobs]]:
    """`generate` that also returns what each new token scored (the same compiled program; with a
    token `mask` [T, W], a second one that samples each slot among the tokens its mask allows; `top`
    False, another without the top alternatives: StepLimits.top_logprobs).
    `ends_T` (StepLimits.ends): a slot at its end takes no new page (its token is the caller's to drop)."""
    table = self.cache.step_table(1, ends_T)
    with sharding.activation_sharding(self.mesh, self.rules):
      # The mask as a host array: jit copies it within the call, where jnp.asarray was a dispatch of its own.
      out = self._generate(params, state, table, None if mask is None else np.asarray(mask),
                           **({} if top else {"top": False}))
    self.cache.advance(1 if ends_T is None else self._steps_left(ends_T, 1))
    return out

  def _steps_left(self, ends_T: np.ndarray, k: int) -> int | np.ndarray:
    """Paged: how far each slot's host-side position moves in a call of k steps (a slot stops k steps
    on or at its end; one stopped by an end-of-sequence token never steps again: its position no
    longer matters)."""
    pages = self.cache.pages
    return k if pages is None else np.clip(ends_T - 1 - pages.positions, 0, k)

  def begin_prompt(self, slot: int, prompt: Sequence[int], images: image_prompts.PromptImages | None = None,
                   cache_key: bytes = b"") -> int:
    """Paged: the pages of `prompt` for `slot`, which generate steps skip until the last
    `prefill_chunk` has run; where prefilling starts (page_prefill.PagePrefill.begin). Prefix
    caching shares pages only between prompts of the same `cache_key` (a LoRA adapter's)."""
    self._check_slot(slot)
    start = self.page_prefill.begin(slot, prompt, images, cache_key)
    self._busy[slot] = True
    return start

  def prefill_chunk(self, params: Params, state: DecodeState, slot: int, prompt: Sequence[int], start: int,
                    row_params: sampling.RowParams | None = None, seed: int = 0,
                    images: image_prompts.PromptImages | None = None, mask: np.ndarray | None = None
                    ) -> page_prefill.ChunkResult:
    """Prefills prompt[start:start + prefill_chunk_size] of `slot` straight into its pages,
    attending over the tokens before it there. Returns (state, where the next chunk starts, and
    after the last chunk the first sampled token [1] with its log-probabilities, else None); the
    slot then generates like one `insert`ed. One compiled program for every chunk of
    prefill_chunk_size; unchunked (prefix caching alone), one per power of two of what is left.
    With `images` (those given to begin_prompt), a chunk ends before an image run it cannot hold
    whole and runs the images inside it through the vision tower. `mask`: int32 [1, W], the first
    token's bitmask (constrained decoding)."""
    return self.page_prefill.chunk(params, state, slot, prompt, start, row_params, seed, images, mask)

  def prefill_rests(self, params: Params, state: DecodeState, slots: Sequence[int], prompts: Sequence[Sequence[int]],
                    starts: Sequence[int], row_params: Sequence[sampling.RowParams],
                    images: Sequence[image_prompts.PromptImages | None] | None = None, masks: np.ndarray | None = None
                    ) -> tuple[DecodeState, list[page_prefill.FirstToken]]:
    """Paged, unchunked: the rest of each prompt begun in `slots` (from `starts`, what begin_prompt
    returned; `images`, those given to it) prefilled into its pages, as the rows of one call per
    piece (page_prefill.PagePrefill.rests); each prompt's (first tokens, their scores, its row)."""
    for slot in slots:
      self._check_slot(slot)
    return self.page_prefill.rests(params, state, slots, prompts, starts, row_params, images, masks)

  def prefill_chunks(self, params: Params, state: DecodeState, slots: Sequence[int], prompts: Sequence[Sequence[int]],
                     starts: Sequence[int], row_params: Sequence[sampling.RowParams],
                     images: Sequence[image_prompts.PromptImages | None] | None = None,
                     masks: np.ndarray | None = None
                     ) -> tuple[DecodeState, list[tuple[int, page_prefill.FirstToken | None]]]:
    """Paged, chunked: one call's prefill_chunk_size prompt tokens spent on the next chunks of the
    prompts begun in `slots`, first come first (page_prefill.PagePrefill.chunks); each prompt's
    (where its next chunk starts, after its last chunk its first token as prefill_rests gives it)."""
    for slot in slots:
      self._check_slot(slot)
    return self.page_prefill.chunks(params, state, slots, prompts, starts, row_params, images, masks)

  @property
  def continues_slots(self) -> bool:
    """Whether `hold` and `continue_prompt` can append tokens to a slot's context: the paged layout, for
    a model without recurrent layers (their states would need the snapshots prefix caching keeps)."""
    return self.cache.pages is not None and not has_recurrent_state(self.cfg)

  def hold(self, slot: int) -> None:
    """The slot keeps what it cached but stops generating (no page written or taken) until
    `continue_prompt`; a multi-turn episode's slot while its environment answers (rl/interleaved_episodes.py)."""
    self._check_slot(slot)
    pages = self.cache.pages
    if not self.continues_slots or pages is None or not pages.active[slot]:
      raise ValueError(f"slot {slot} cannot be held (continues_slots={self.continues_slots})")
    pages.active[slot] = False

  def continue_prompt(self, slot: int, context: Sequence[int]) -> int:
    """A held slot takes `context`, what it holds followed by new tokens: its pages grow to hold them and
    `prefill_chunk` (from the returned start, the position of the slot's last sampled token, until it
    returns the first new token) prefills only what it does not hold."""
    self._check_slot(slot)
    if not self.continues_slots or self.cache.pages is None:
      raise ValueError("continue_prompt needs continues_slots (the paged layout, no recurrent layers)")
    if len(context) > self.cfg.max_target_length - 1:
      raise UserError(f"a context of {len(context)} tokens does not fit max_target_length={self.cfg.max_target_length} "
                      "with room to generate")
    check_token_ids([context], self.cfg)
    return self.cache.pages.extend(slot, len(context))

  def release(self, slot: int) -> None:
    """The slot's request is done: paged, its pages go back to the pool (the slot keeps stepping
    in the batch with nothing cached until the next insert); dense, nothing to do."""
    self._check_slot(slot)
    self.page_prefill.release(slot)
    self._busy[slot] = False
    self.cache.release(slot)

  def pages_needed(self, num_tokens: int) -> int:
    """Pages a request holds once `num_tokens` tokens are cached (prompt + new tokens - 1; the
    last sampled token is never written); 0 for the dense cache. Admission control compares the
    sum over running requests with cache_stats()["pages_total"]."""
    return self.cache.pages_needed(num_tokens)

  def admission_pages(self, reserved: Mapping[int, int], prompt: Sequence[int], need: int, text_only: bool) -> int:
    """paged_cache.admission_pages for this engine's pool (0 for the dense cache)."""
    return self.cache.admission_pages(reserved, prompt, need, text_only)

  def cache_stats(self) -> dict[str, Any]:
    """layout, cache_bytes (all layers' cache arrays as allocated) and, paged, pages_total /
    pages_free / pages_used / page_size (dense: pages_* are 0, every slot owns max_target_length)."""
    return {"layout": self.cache.name, "cache_bytes": self._cache_bytes, **self.cache.stats()}

  def score(self, params: Params, prompt: Sequence[int], images: image_prompts.PromptImages | None = None
            ) -> TokenLogprobs:
    """Log-probabilities of each prompt token given the ones before it ([L], row 0 meaningless)
    and the most probable alternatives at each position, from one full forward pass."""
    tokens_BL, _ = pad_prompts([prompt], self.decode_cfg.max_prefill_predict_length, self.cfg)
    pixels = self._pixels([prompt], [images])
    with sharding.activation_sharding(self.mesh, self.rules):
      return self._score(params, jnp.asarray(tokens_BL), pixels)

  @property
  def prefill_chunk_size(self) -> int:
    return self.decode_cfg.prefill_chunk_size

  def decode_step(self, params: Params, state: DecodeState, active: Sequence[bool] | np.ndarray | None = None,
                  mask: np.ndarray | None = None, limits: StepLimits | None = None) -> tuple[DecodeState, Emitted]:
    """`step` as engine_api.Emitted (one token per slot; `active` is not needed; `mask` as `_step`'s).
    With decode_steps_per_call > 1, up to decode_steps_per_call steps in one call, each slot stopping on
    the device at its `limits` (Emitted with counts; nothing here waits for the device); a slot whose
    `mask` row constrains it (sampling.constrained_rows) takes one step, under its mask (its next mask
    depends on this token), while the others take theirs. One step per call: `limits` only keep a slot at
    its end from taking pages; every slot gets a token. Either way, `limits.top_logprobs` False gives no
    top alternatives (fields [T, 0] / [T, K, 0]; a program of its own)."""
    if self.steps_per_call == 1:
      ends_T = None if limits is None else np.asarray(limits.ends, np.int64)
      state, (tokens_B, logprobs) = self._step(params, state, mask, ends_T, limits is None or limits.top_logprobs)
      return state, Emitted(tokens_B, logprobs)
    return self._steps(params, state, limits, mask)

  def _steps(self, params: Params, state: DecodeState, limits: StepLimits | None, mask: np.ndarray | None = None
             ) -> tuple[DecodeState, Emitted]:
    k, length = self.steps_per_call, self.cfg.max_target_length
    ends_T = np.full(self.num_slots, length + 1, np.int64) if limits is None else \
        np.minimum(np.asarray(limits.ends, np.int64), length + 1)
    pages = self.cache.pages
    if mask is not None and pages is not None:  # the host's pages follow a constrained slot's one step (_block_fn)
      mask = np.asarray(mask)
      ends_T = np.where(np.any(mask != sampling.ALL_TOKENS, axis=-1), np.minimum(ends_T, pages.positions + 2), ends_T)
    table = self.cache.step_table(k, ends_T)
    if limits is None:  # the same two arrays every call (rollouts, decode.py): made on the device once
      if self._unlimited is None:  # every slot ends with its cache; no stop token
        self._unlimited = jax.jit(lambda: (jnp.full((self.num_slots,), length + 1, jnp.int32),
                                           jnp.full((1,), -1, jnp.int32)),
                                  out_shardings=(self.state_shardings.tokens_B,) * 2)()
      ends, stop = self._unlimited
    else:  # a host array argument is a copy to the device in every call
      ends, stop = ends_T.astype(np.int32), np.asarray(limits.stop_ids or (-1,), np.int32)
    with sharding.activation_sharding(self.mesh, self.rules):
      # The mask as a host array: jit copies it within the call (as `_step`'s).
      state, (tokens_TK, counts_T, logprobs) = self._block(params, state, table, ends, stop,
                                                           None if mask is None else np.asarray(mask),
                                                           **({} if limits is None or limits.top_logprobs else
                                                              {"top": False}))
    self.cache.advance(self._steps_left(ends_T, k))
    return state, Emitted(tokens_TK, logprobs, counts_T)

  def slot(self, slot: int) -> SlotInfo:
    self._check_slot(slot)
    busy = bool(self._busy[slot])
    return SlotInfo(busy, busy and self.cache.prefilling(slot), self.cache.held(slot))

  def metrics(self) -> dict[str, float]:
    return {"step_compilations": self.traces["generate"]}  # a call of several steps counts here too

  def compile_step(self, abstract_params: Params) -> jax.stages.Compiled:
    """The decode step (one token for every slot) compiled ahead of time for parameters laid out as
    `abstract_params` (shapes with shardings): what an AOT check of a topology compiles."""
    shapes = jax.eval_shape(self._init_state_fn, np.uint32(0))
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                         self.state_shardings)
    table = self.cache.abstract_table(sharding.replicated(self.mesh))
    with sharding.activation_sharding(self.mesh, self.rules):
      if self.weight_quantizer is not None:
        abstract_params = self.weight_quantizer.abstract(abstract_params)
      return self._generate.lower(abstract_params, state, table).compile()

  @property
  def pages(self) -> paged_cache.PageAllocator | None:
    """The paged layout's allocator (None: the dense cache)."""
    return self.cache.pages

  # ---------------------------------------------------------------- helpers
  def _check_slot(self, slot: int) -> None:
    if not 0 <= slot < self.num_slots:
      raise ValueError(f"slot {slot} out of range for {self.num_slots} slots")

  def _pixels(self, prompts: Sequence[Sequence[int]], images: Sequence[image_prompts.PromptImages | None] | None
              ) -> jax.Array | None:
    """The prompts' images as one padded [B, M, 3, R, R] array (None: no images), each row's
    images checked against its placeholder runs."""
    rows = list(images) if images is not None else [None] * len(prompts)
    if len(rows) != len(prompts):
      raise ValueError(f"{len(rows)} image rows for {len(prompts)} prompts")
    for prompt, row in zip(prompts, rows):
      image_prompts.image_runs(prompt, self.cfg.vision, row)
    pixels = image_prompts.pixel_batch(rows)
    return None if pixels is None else jnp.asarray(pixels)

  # ---------------------------------------------------------------- jitted bodies
  def _init_state_fn(self, seed: jax.Array) -> DecodeState:
    zeros = jnp.zeros((self.num_slots,), jnp.int32)
    keys = jax.random.key_data(jax.random.split(jax.random.key(seed), self.num_slots))
    rows = RowSampling(jnp.zeros((self.num_slots,), jnp.float32), jnp.ones((self.num_slots,), jnp.float32), zeros,
                       keys, zeros)
    return DecodeState(self.cache.empty_caches(), zeros, zeros, rows)

  def _prefill_fn(self, params: Params, tokens_BL: jax.Array, lengths_B: jax.Array, rows: RowSampling,
                  pixels: jax.Array | None, masks_BW: jax.Array | None = None) -> Prefix:
    self.traces["prefill"] += 1
    rows = seeded(rows)
    batch, length = tokens_BL.shape
    caches = kv_cache.model_caches(self.cfg, batch, length, self.decode_cfg.quantize_kvcache)
    positions_BL = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens_BL.shape)
    with lora_rows.use_rows(rows.adapter_B):  # each row's LoRA adapter, where the model holds a table of them
      logits_B1V, caches = self.spec.apply_decode(params, tokens_BL, positions_BL, caches, lengths_B - 1, pixels)
    tokens_B, rows, logprobs = sample(logits_B1V[:, 0], rows, masks_BW)
    return Prefix(caches, lengths_B, tokens_B, rows, logprobs)

  def _score_fn(self, params: Params, tokens_BL: jax.Array, pixels: jax.Array | None) -> TokenLogprobs:
    self.traces["score"] += 1
    positions_BL = jnp.broadcast_to(jnp.arange(tokens_BL.shape[1], dtype=jnp.int32), tokens_BL.shape)
    logits_BLV = self.spec.apply(params, tokens_BL, positions_BL, jnp.ones_like(tokens_BL), None, pixels)
    # Position i scores token i from the logits at i - 1 (position 0 has no prediction: scored as itself).
    logits_LV = jnp.concatenate([logits_BLV[0, :1], logits_BLV[0, :-1]], axis=0)
    return TokenLogprobs(*sampling.token_logprobs(logits_LV, tokens_BL[0]))

  def _insert_fn(self, prefix: Prefix, state: DecodeState, slot: jax.Array, row: jax.Array, admitted: jax.Array | None
                 ) -> DecodeState:
    self.traces["insert"] += 1
    caches = self.cache.insert(state.caches, prefix.caches, slot, row, admitted)
    return with_prompt(state, caches, prefix, slot, row)

  def _insert_rows_fn(self, prefix: Prefix, state: DecodeState, slots_R: jax.Array, rows_R: jax.Array,
                      admitted_RM: jax.Array | None) -> DecodeState:
    self.traces["insert"] += 1

    def one(i: jax.Array, state: DecodeState) -> DecodeState:  # the pairs in order, as inserts one by one
      table_M = None if admitted_RM is None else admitted_RM[i]
      caches = self.cache.insert(state.caches, prefix.caches, slots_R[i], rows_R[i], table_M)
      return with_prompt(state, caches, prefix, slots_R[i], rows_R[i])

    return jax.lax.fori_loop(0, slots_R.shape[0], one, state)

  def _prefill_insert_fn(self, params: Params, state: DecodeState, tokens_BL: jax.Array, lengths_B: jax.Array,
                         rows: RowSampling, pixels: jax.Array | None, masks_BW: jax.Array | None, slots_R: jax.Array,
                         rows_R: jax.Array, admitted_RM: jax.Array | None) -> tuple[DecodeState, Prefilled]:
    prefix = self._prefill_fn(params, tokens_BL, lengths_B, rows, pixels, masks_BW)
    return self._insert_rows_fn(prefix, state, slots_R, rows_R, admitted_RM), prefix.prefilled()

  def _generate_fn(self, params: Params, state: DecodeState, table_TM: jax.Array | None,
                   mask_TW: jax.Array | None = None, top: bool = True
                   ) -> tuple[DecodeState, tuple[jax.Array, TokenLogprobs]]:
    self.traces["generate"] += 1  # Python side effect: runs once per trace, never per executed step
    caches = self.cache.with_table(state.caches, table_TM)
    with lora_rows.use_rows(state.sampling.adapter_B):
      logits_B1V, caches = self.spec.apply_decode(params, state.tokens_B[:, None], state.next_positions_B[:, None],
                                                  caches)
    caches = self.cache.keep_inactive(caches, state.caches, table_TM)
    tokens_B, rows, logprobs = sample(logits_B1V[:, 0], state.sampling, mask_TW, top)
    return DecodeState(caches, state.next_positions_B + 1, tokens_B, rows), (tokens_B, logprobs)

  def _block_fn(self, params: Params, state: DecodeState, table_TM: jax.Array | None, ends_T: jax.Array,
                stop_E: jax.Array, mask_TW: jax.Array | None = None, top: bool = True
                ) -> tuple[DecodeState, tuple[jax.Array, jax.Array, TokenLogprobs]]:
    """decode_block.run of this engine's step. With `mask_TW`, a constrained row (its next mask depends on the
    token it gets now) ends after one step; the mask is applied at every step, where it only leaves the
    other rows' logits as they are (every bit set)."""
    self.traces["generate"] += 1  # once per trace
    if mask_TW is not None:
      ends_T = jnp.where(sampling.constrained_rows(mask_TW), jnp.minimum(ends_T, state.next_positions_B + 2), ends_T)

    def step(state: DecodeState, live_T: jax.Array) -> tuple[DecodeState, tuple[jax.Array, TokenLogprobs]]:
      old = self.cache.with_table(state.caches, table_TM)
      with lora_rows.use_rows(state.sampling.adapter_B):
        logits_B1V, caches = self.spec.apply_decode(params, state.tokens_B[:, None], state.next_positions_B[:, None],
                                                    old)
      caches = self.cache.keep_inactive(caches, old, table_TM)
      if has_recurrent_state(self.cfg):  # a stopped slot's recurrent state stays where it stopped
        caches = paged_cache.keep_inactive_states(caches, old, live_T, self.cfg.scan_layers)
      # A stopped slot's results are dropped (decode_block.run): only live slots decide whether any row samples.
      tokens_B, rows, logprobs = sample(logits_B1V[:, 0], state.sampling, mask_TW, top=top, live_B=live_T)
      return DecodeState(caches, state.next_positions_B + 1, tokens_B, rows), (tokens_B, logprobs)

    return decode_block.run(step, state, self.steps_per_call, ends_T, stop_E)


@dataclasses.dataclass
class Request:
  prompt: list[int]
  max_new_tokens: int
  output: list[int] = dataclasses.field(default_factory=list)
  images: image_prompts.PromptImages | None = None


def layer_layout_note(config: Config) -> str | None:
  """decode and serve on CPU with a scanned layer stack: XLA's CPU backend copies each layer's weights out of
  the stacked arrays at every step (getting_started/Decode.md), so unrolled layers decode the same checkpoint
  several times faster. Rollouts decode in the training run's layout and are not told."""
  if config.target.platform != "cpu" or not config.model.scan_layers:
    return None
  return ("note: on CPU, scanned layers (scan_layers=True) decode several times slower than unrolled ones: XLA's CPU "
          "backend copies each layer's weights out of the stacked arrays at every step; scan_layers=False decodes the "
          "same checkpoint")


def note_layer_layout(config: Config) -> None:
  note = layer_layout_note(config)
  if note:
    _log_once(note)


@functools.cache  # once a process: a speculative server loads two models
def _log_once(message: str) -> None:
  distributed.log(message)


def load_engine(config: Config, num_slots: int, fresh_note: str, mesh: Mesh | None = None) -> tuple[Engine, Params]:
  """An engine and its parameters: load_parameters_path's (checked before anything is built),
  else fresh ones, announced with `fresh_note`."""
  path = model_assembly.parameters_path(config)
  engine = Engine(config, num_slots=num_slots, mesh=mesh)
  note_layer_layout(config)
  if not path:
    distributed.log(fresh_note)
  params = engine.load_params(path)
  if engine.weight_quantizer is not None:
    distributed.log(engine.weight_quantizer.describe(engine.spec.abstract_params, params))
  return engine, params


def serve(engine: Engine, params: Params, requests: Sequence[Request], eos_id: int | None = None,
          seed: int = 0) -> list[Request]:
  """Continuous batching: each request takes a free slot (prefill + insert), generates until
  max_new_tokens or eos_id, and frees the slot (and its pages) for the next waiting request.
  With a paged cache a request also waits, in order, until the pages its prompt and
  max_new_tokens will need are free, so generate never runs out. Returns `requests` with their
  outputs filled in (the first token comes from prefill)."""
  limit = engine.cfg.max_target_length
  for i, request in enumerate(requests):
    if request.max_new_tokens < 1:  # prefill gives the first token whatever the budget
      raise UserError(f"request {i}: max_new_tokens={request.max_new_tokens}; it must be at least 1")
    if len(request.prompt) + request.max_new_tokens > limit + 1:
      raise UserError(f"request {i}: {len(request.prompt)} prompt + {request.max_new_tokens} new tokens exceed "
                      f"max_target_length={limit} (+1: the last token needs no cache entry)")
  waiting = collections.deque(enumerate(requests))
  active: dict[int, Request] = {}
  reserved: dict[int, int] = {}  # slot -> pages its request will hold at the end
  state = engine.init_decode_state(seed)
  while waiting or active:
    for slot in range(engine.num_slots):
      if slot in active or not waiting:
        continue
      index, request = waiting[0]
      need = engine.pages_needed(len(request.prompt) + request.max_new_tokens - 1)
      if need and sum(reserved.values()) + need > engine.cache_stats()["pages_total"]:
        break  # wait for running requests to give their pages back
      waiting.popleft()
      prefix = engine.prefill(params, [request.prompt], seed=seed + index, images=[request.images])
      state = engine.insert(prefix, state, slot)
      request.output.append(int(prefix.first_tokens_B[0]))
      if _finished(request, eos_id):
        engine.release(slot)
      else:
        active[slot], reserved[slot] = request, need
    if not active:
      continue
    state, tokens_T = engine.generate(params, state)
    tokens = np.asarray(tokens_T)
    for slot in list(active):
      request = active[slot]
      request.output.append(int(tokens[slot]))
      if _finished(request, eos_id):
        del active[slot], reserved[slot]
        engine.release(slot)
  return list(requests)


def _finished(request: Request, eos_id: int | None) -> bool:
  return len(request.output) >= request.max_new_tokens or (eos_id is not None and request.output[-1] == eos_id)
