"""A decode engine with the JetStream shape: load_params, prefill, insert, generate.

Shape legend: B prompts in one prefill, L max_prefill_predict_length (padded prompt length),
T slots of the batched decode state, S max_target_length (cache length), V vocabulary.

- `prefill` runs right-padded prompts [B, L] in one pass and returns a `Prefix`: their caches
  (length L), true lengths and first sampled tokens.
- `insert` copies one prefix row into slot i of a `DecodeState` (caches of length S for T slots).
- `generate` advances every slot by one token: one jitted, shape-stable step (it compiles once);
  `step` is the same program, also returning the tokens' log-probabilities.
- `release` returns a finished slot's cache resources (nothing to return for the dense cache).
Sampling is per slot: each prompt row brings its own temperature, top-p, top-k and seed
(`sampling.RowParams`, by default the decode_sampling_* keys), which `insert` copies into the
slot, so requests with different parameters share one compiled step.
Continuous batching is `serve`: requests wait for a free slot, are prefilled and inserted, and
leave their slot when done, all while the other slots keep generating.

The cache is a kv_layout.KVLayout (kv_layout.make picks dense or paged; nothing here asks which).
kv_cache_layout=paged keeps each layer's cache as a pool of pages instead of [T, S] per slot
(inference/paged_cache.py): the layout then owns a host-side page allocator tied to the state of
the last `init_decode_state`; `insert` takes the prompt's pages, `generate` a new page when a
slot crosses a page boundary (chosen on the host before the jitted step, which takes the block
table as an argument), `release(slot)` gives them back. One engine, one decode state at a time.

A vision-language model's prompts may bring images (image_prompts.PromptImages: `prefill`'s
`images`, `begin_prompt`/`prefill_chunk`'s, `score`'s): prefill runs them through the vision tower
with each image's tokens attending both ways; generate steps are text.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.platform import distributed
from MaxText.training import model_assembly
from MaxText.platform import sharding
from MaxText.configuration.config import Config
from MaxText.configuration.model_config import ModelConfig
from MaxText.errors import UserError
from MaxText.inference import image_prompts, kv_layout, paged_cache, sampling, state_snapshots
from MaxText.inference.engine_api import Emitted, SlotInfo, TokenLogprobs
from MaxText.layers import kv_cache


@struct.dataclass
class RowSampling:
  """Per-row sampling parameters and PRNG streams (rows are prompts in a Prefix, slots in a DecodeState)."""

  temperature_B: Any  # float32; 0 = greedy
  top_p_B: Any  # float32; 1 = no nucleus cut
  top_k_B: Any  # int32; 0 = no top-k cut
  keys_B: Any  # PRNG key data per row, split at every draw


@struct.dataclass
class Prefix:
  caches: Any  # per-layer KV caches of length L (batch B)
  next_positions_B: jax.Array  # the prompts' true lengths: where each first generated token goes
  first_tokens_B: jax.Array  # token sampled from each prompt's last position
  sampling: RowSampling  # each row's parameters, keys already advanced past the first draw
  first_logprobs: TokenLogprobs


@struct.dataclass
class DecodeState:
  """Arrays of the batched decode state (the same structure also carries their shardings)."""

  caches: Any  # per-layer KV caches of length S (batch T)
  next_positions_B: Any  # [T] int32 position the slot's pending token is written at
  tokens_B: Any  # [T] int32 each slot's latest sampled token (input of the next step)
  sampling: Any  # RowSampling of the slots (a free slot keeps its last request's values, unused)


def pad_prompts(prompts: Sequence[Sequence[int]], length: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads token lists to [B, length] (pad id 0); returns (tokens, true lengths)."""
  for i, prompt in enumerate(prompts):
    if not 1 <= len(prompt) <= length:
      raise UserError(f"prompt {i} has {len(prompt)} tokens; it must have 1 to max_prefill_predict_length="
                      f"{length} tokens (raise max_prefill_predict_length or shorten the prompt)")
  tokens = np.zeros((len(prompts), length), np.int32)
  for i, prompt in enumerate(prompts):
    tokens[i, :len(prompt)] = prompt
  return tokens, np.asarray([len(p) for p in prompts], np.int32)


# A Gated DeltaNet layer's recurrent state summarises every token so far. A draft model's rounds restore the
# states from before the round and replay the accepted tokens (speculative.roll_back_recurrent); the MTP heads'
# rounds keep no such copy. Prefix caching restarts one from snapshots at page boundaries (state_snapshots.py).
RECURRENT_REFUSAL = ("{what} is not supported for a model with Gated DeltaNet layers (Qwen3-Next, Qwen3.5): their "
                     "recurrent decode state cannot be rolled back past rejected draft tokens; {fix}")


def has_recurrent_state(cfg: ModelConfig) -> bool:
  """Whether some layer of the model keeps a recurrent decode state (Gated DeltaNet) beside or instead of a KV cache."""
  return cfg.linear_attn.full_attention_interval > 1 or cfg.attn.attention_type == "gated_deltanet"


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
    self.param_shardings = self.model.param_shardings
    self.sampling = sampling.SamplingParams(
        self.decode_cfg.decode_sampling_strategy, self.decode_cfg.decode_sampling_temperature,
        self.decode_cfg.decode_sampling_top_p, self.decode_cfg.decode_sampling_top_k)
    self.vocab_size = self.cfg.vocab_size
    # The cache layout (kv_layout.make picks it) and, with prefix caching of a model with recurrent layers,
    # snapshots of their states at page boundaries (a shared prefix's states are not in its pages).
    self.snapshots: state_snapshots.RecurrentSnapshots | None = None
    self.cache = kv_layout.make(self.cfg, self.decode_cfg, num_slots, self.decode_cfg.prefix_caching)
    snapshot_capacity = 0
    if self.cache.prefix_caching and has_recurrent_state(self.cfg):
      capacity = self.decode_cfg.prefix_state_snapshots
      snapshot_capacity = 2 * num_slots if capacity < 0 else capacity
      if not snapshot_capacity:  # prefix caching is on by default with the paged cache: turned off, said once
        self.cache = kv_layout.make(self.cfg, self.decode_cfg, num_slots, prefix_caching=False)
        if jax.process_index() == 0:
          print("engine: prefix_caching is off for this model: its Gated DeltaNet layers keep a recurrent state, and "
                "prefix_state_snapshots=0 keeps no snapshots of it for shared prefixes to start from", flush=True)
    self.prefix_caching = self.cache.prefix_caching  # the setting in effect (the config's key may say more)
    # The scheduler prefills prompts straight into pages (begin_prompt, prefill_chunk).
    self.prefills_into_pages = self.cache.prefills_into_pages
    vision, chunk = self.cfg.vision, self.decode_cfg.prefill_chunk_size
    if vision.use_multimodal and 0 < chunk < vision.mm_tokens_per_image:
      raise UserError(f"prefill_chunk_size={chunk} is less than mm_tokens_per_image={vision.mm_tokens_per_image}: "
                      "an image's tokens attend to each other both ways, so each image is prefilled within one "
                      "chunk; raise prefill_chunk_size or set it to 0")
    abstract_caches = jax.eval_shape(self.cache.empty_caches)
    self._cache_bytes = paged_cache.cache_bytes(abstract_caches)  # cache_stats is read by every /health
    names = self.cache.logical_names()
    replicated = NamedSharding(self.mesh, PartitionSpec())
    # A DecodeState-shaped tree of shardings (its fields hold NamedShardings, not arrays).
    self.state_shardings = DecodeState(sharding.named_shardings(abstract_caches, names, self.mesh, self.rules),
                                       replicated, replicated, RowSampling(replicated, replicated, replicated, replicated))
    # jit traces (= compilations) per step function
    self.traces = {"prefill": 0, "insert": 0, "generate": 0, "score": 0, "extend": 0}
    self._init_state = jax.jit(self._init_state_fn, out_shardings=self.state_shardings)
    self._prefill = jax.jit(self._prefill_fn)
    self._insert = jax.jit(self._insert_fn, donate_argnums=(1,), out_shardings=self.state_shardings)
    self._generate = jax.jit(self._generate_fn, donate_argnums=(1,),
                             out_shardings=(self.state_shardings, (replicated, TokenLogprobs(replicated, replicated,
                                                                                             replicated))))
    self._score = jax.jit(self._score_fn)
    self._extend = jax.jit(self._extend_fn, donate_argnums=(1,),
                           out_shardings=(self.state_shardings, (replicated, TokenLogprobs(replicated, replicated,
                                                                                           replicated))))
    if snapshot_capacity:
      self.snapshots = state_snapshots.RecurrentSnapshots(snapshot_capacity, self.cache.prompt_pages, abstract_caches,
                                                          self.cfg.scan_layers, self.state_shardings)
      self.cache.usable_pages = self.snapshots.usable_pages
      self.cache.reset()

  # ---------------------------------------------------------------- public API
  def load_params(self, path: str | None = None, seed: int = 0) -> Any:
    """Parameters from a checkpoint (params-only, step directory or checkpoints root), sharded for
    this mesh; with no path, freshly initialised ones (for tests and benchmarks)."""
    return self.model.params(path or "", seed)

  def init_decode_state(self, seed: int = 0) -> DecodeState:
    """Empty caches for every slot, born sharded (paged: every page free again)."""
    self.cache.reset()
    if self.snapshots is not None:
      self.snapshots.reset()
    self._busy[:] = False
    return self._init_state(jnp.uint32(seed))

  def prefill(self, params: Any, prompts: Sequence[Sequence[int]], seed: int = 0,
              row_params: Sequence[sampling.RowParams] | None = None,
              images: Sequence[image_prompts.PromptImages | None] | None = None) -> Prefix:
    """One pass over the right-padded prompts (each at most max_prefill_predict_length tokens).
    Each row samples by its `row_params` (default: the decode_sampling_* keys, row i seeded
    with seed + i). `images`: each prompt's images (None: none), one per placeholder run."""
    tokens_BL, lengths_B = pad_prompts(prompts, self.decode_cfg.max_prefill_predict_length)
    pixels = self._pixels(prompts, images)
    if row_params is None:
      row_params = [sampling.RowParams.from_strategy(self.sampling, seed + i) for i in range(len(prompts))]
    if len(row_params) != len(prompts):
      raise ValueError(f"{len(row_params)} row_params for {len(prompts)} prompts")
    rows = RowSampling(jnp.asarray([r.temperature for r in row_params], jnp.float32),
                       jnp.asarray([r.top_p for r in row_params], jnp.float32),
                       jnp.asarray([r.top_k for r in row_params], jnp.int32),
                       jnp.asarray([r.seed % 2**32 for r in row_params], jnp.uint32))  # seeds: keys made in jit
    with sharding.activation_sharding(self.mesh, self.rules):
      return self._prefill(params, jnp.asarray(tokens_BL), jnp.asarray(lengths_B), rows, pixels)

  def insert(self, prefix: Prefix, state: DecodeState, slot: int, row: int = 0) -> DecodeState:
    """`state` with prompt `row` of `prefix` in slot `slot` (slot and row are traced: no recompiles)."""
    self._check_slot(slot)
    admitted = self.cache.admit(slot, prefix.next_positions_B[row])
    state = self._insert(prefix, state, jnp.int32(slot), jnp.int32(row), admitted)
    self._busy[slot] = True
    return state

  def generate(self, params: Any, state: DecodeState) -> tuple[DecodeState, jax.Array]:
    """Every slot's next token [T]; the state moves on by one position per slot. Paged: raises
    paged_cache.OutOfPages (state unchanged) when a slot crossing a page boundary finds none free."""
    state, (tokens_B, _) = self.step(params, state)
    return state, tokens_B

  def step(self, params: Any, state: DecodeState) -> tuple[DecodeState, tuple[jax.Array, TokenLogprobs]]:
    """`generate` that also returns what each new token scored (the same compiled program)."""
    table = self.cache.step_table()
    with sharding.activation_sharding(self.mesh, self.rules):
      out = self._generate(params, state, table)
    self.cache.advance()
    return out

  def begin_prompt(self, slot: int, prompt: Sequence[int], images: image_prompts.PromptImages | None = None) -> int:
    """Paged, chunked prefill: the pages of `prompt` for `slot`, which generate steps skip until
    the last `prefill_chunk` has run (raises OutOfPages, nothing changed, when they are not free).
    Returns where prefilling starts: after the prompt's leading pages another request already
    cached (prefix_caching; with `images`, pages keyed by their content too, and never inside an
    image's run), else 0."""
    self._check_slot(slot)
    pages = self.cache.prompt_pages()
    if not 1 <= len(prompt) <= self.cfg.max_target_length - 1:
      raise UserError(f"a prompt of {len(prompt)} tokens does not fit max_target_length={self.cfg.max_target_length} "
                      "with room to generate")
    runs = image_prompts.image_runs(prompt, self.cfg.vision, images)
    salts = image_prompts.page_salts(runs, images, pages.page_size)
    start = pages.assign(slot, len(prompt), active=False, prompt=prompt, salts=salts, runs=runs)
    self._busy[slot] = True
    if self.snapshots is not None:  # assign shared pages only up to a boundary with a snapshot
      self.snapshots.begin(slot, prompt, start, salts)
    return start

  def prefill_chunk(self, params: Any, state: DecodeState, slot: int, prompt: Sequence[int], start: int,
                    row_params: sampling.RowParams | None = None, seed: int = 0,
                    images: image_prompts.PromptImages | None = None
                    ) -> tuple[DecodeState, int, tuple[jax.Array, TokenLogprobs] | None]:
    """Prefills prompt[start:start + prefill_chunk_size] of `slot` straight into its pages,
    attending over the tokens before it there. Returns (state, where the next chunk starts, and
    after the last chunk the first sampled token [1] with its log-probabilities, else None); the
    slot then generates like one `insert`ed. One compiled program for every chunk of
    prefill_chunk_size; unchunked (prefix caching alone), one per power of two of what is left.
    With `images` (those given to begin_prompt), a chunk ends before an image run it cannot hold
    whole and runs the images inside it through the vision tower."""
    chunk = self.decode_cfg.prefill_chunk_size
    if not chunk:  # the rest of the prompt in one piece, padded to a power of two: a few programs in all
      chunk = min(1 << max(len(prompt) - start - 1, 0).bit_length(), self.decode_cfg.max_prefill_predict_length)
    runs = image_prompts.image_runs(prompt, self.cfg.vision, images)
    end = image_prompts.chunk_end(start, min(start + chunk, len(prompt)), runs)
    pages = self.cache.prompt_pages()
    page_size = pages.page_size
    if self.snapshots is not None:  # the shared prefix's recurrent states, not zeros; chunks end at a boundary
      state, end = self.snapshots.before_chunk(state, slot, prompt, start, end, runs)
    tokens = list(prompt[start:end])
    pixels = image_prompts.images_within(images, runs, start, end)
    row = row_params or sampling.RowParams.from_strategy(self.sampling, seed)
    rows = RowSampling(jnp.asarray([row.temperature], jnp.float32), jnp.asarray([row.top_p], jnp.float32),
                       jnp.asarray([row.top_k], jnp.int32), jnp.asarray([row.seed % 2**32], jnp.uint32))
    tokens_1C = np.zeros((1, chunk), np.int32)
    tokens_1C[0, :len(tokens)] = tokens
    with sharding.activation_sharding(self.mesh, self.rules):
      state, first = self._extend(params, state, jnp.asarray(tokens_1C), jnp.int32(start), jnp.int32(len(tokens)),
                                  jnp.int32(slot), jnp.asarray(pages.table[slot][None]), rows,
                                  None if pixels is None else jnp.asarray(pixels))
    if self.snapshots is not None:
      self.snapshots.after_chunk(state.caches, slot, prompt, end, image_prompts.page_salts(runs, images, page_size))
    if end < len(prompt):
      return state, end, None
    pages.activate(slot, prompt, image_prompts.page_salts(runs, images, page_size))
    return state, end, first

  def release(self, slot: int) -> None:
    """The slot's request is done: paged, its pages go back to the pool (the slot keeps stepping
    in the batch with nothing cached until the next insert); dense, nothing to do."""
    self._check_slot(slot)
    if self.snapshots is not None:
      self.snapshots.forget(slot)
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

  def score(self, params: Any, prompt: Sequence[int], images: image_prompts.PromptImages | None = None
            ) -> TokenLogprobs:
    """Log-probabilities of each prompt token given the ones before it ([L], row 0 meaningless)
    and the most probable alternatives at each position, from one full forward pass."""
    tokens_BL, _ = pad_prompts([prompt], self.decode_cfg.max_prefill_predict_length)
    pixels = self._pixels([prompt], [images])
    with sharding.activation_sharding(self.mesh, self.rules):
      return self._score(params, jnp.asarray(tokens_BL), pixels)

  @property
  def prefill_chunk_size(self) -> int:
    return self.decode_cfg.prefill_chunk_size

  def decode_step(self, params: Any, state: DecodeState, active: Sequence[bool] | np.ndarray | None = None
                  ) -> tuple[DecodeState, Emitted]:
    """`step` as engine_api.Emitted (one token per slot; `active` is not needed)."""
    state, (tokens_B, logprobs) = self.step(params, state)
    return state, Emitted(tokens_B, logprobs)

  def slot(self, slot: int) -> SlotInfo:
    self._check_slot(slot)
    busy = bool(self._busy[slot])
    return SlotInfo(busy, busy and self.cache.prefilling(slot), self.cache.held(slot))

  def metrics(self) -> dict[str, float]:
    return {"step_compilations": self.traces["generate"]}

  def compile_step(self, abstract_params: Any) -> Any:
    """The decode step (one token for every slot) compiled ahead of time for parameters laid out as
    `abstract_params` (shapes with shardings): what an AOT check of a topology compiles."""
    shapes = jax.eval_shape(self._init_state_fn, np.uint32(0))
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                         self.state_shardings)
    shape = self.cache.table_shape()
    table = None if shape is None else jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding.replicated(self.mesh))
    with sharding.activation_sharding(self.mesh, self.rules):
      return self._generate.lower(abstract_params, state, table).compile()

  def generate_compilations(self) -> int:
    """How many distinct programs `generate` has compiled (1 after any number of steps)."""
    return self.traces["generate"]

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
  @staticmethod
  def _sample(logits_BV: jax.Array, rows: RowSampling) -> tuple[jax.Array, RowSampling, TokenLogprobs]:
    keys_B, draw_keys_B = sampling.split_rows(rows.keys_B)
    tokens_B = sampling.sample_rows(logits_BV, draw_keys_B, rows.temperature_B, rows.top_p_B, rows.top_k_B)
    return tokens_B, dataclasses.replace(rows, keys_B=keys_B), TokenLogprobs(*sampling.token_logprobs(logits_BV,
                                                                                                      tokens_B))

  def _init_state_fn(self, seed: jax.Array) -> DecodeState:
    zeros = jnp.zeros((self.num_slots,), jnp.int32)
    keys = jax.random.key_data(jax.random.split(jax.random.key(seed), self.num_slots))
    rows = RowSampling(jnp.zeros((self.num_slots,), jnp.float32), jnp.ones((self.num_slots,), jnp.float32), zeros,
                       keys)
    return DecodeState(self.cache.empty_caches(), zeros, zeros, rows)

  def _prefill_fn(self, params: Any, tokens_BL: jax.Array, lengths_B: jax.Array, rows: RowSampling,
                  pixels: jax.Array | None) -> Prefix:
    self.traces["prefill"] += 1
    seeds_to_keys = jax.vmap(lambda seed: jax.random.key_data(jax.random.key(seed)))
    rows = dataclasses.replace(rows, keys_B=seeds_to_keys(rows.keys_B))
    batch, length = tokens_BL.shape
    caches = kv_cache.model_caches(self.cfg, batch, length, self.decode_cfg.quantize_kvcache)
    positions_BL = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens_BL.shape)
    logits_B1V, caches = self.spec.apply_decode(params, tokens_BL, positions_BL, caches, lengths_B - 1, pixels)
    tokens_B, rows, logprobs = self._sample(logits_B1V[:, 0], rows)
    return Prefix(caches, lengths_B, tokens_B, rows, logprobs)

  def _score_fn(self, params: Any, tokens_BL: jax.Array, pixels: jax.Array | None) -> TokenLogprobs:
    self.traces["score"] += 1
    positions_BL = jnp.broadcast_to(jnp.arange(tokens_BL.shape[1], dtype=jnp.int32), tokens_BL.shape)
    logits_BLV = self.spec.apply(params, tokens_BL, positions_BL, jnp.ones_like(tokens_BL), None, pixels)
    # Position i scores token i from the logits at i - 1 (position 0 has no prediction: scored as itself).
    logits_LV = jnp.concatenate([logits_BLV[0, :1], logits_BLV[0, :-1]], axis=0)
    return TokenLogprobs(*sampling.token_logprobs(logits_LV, tokens_BL[0]))

  def _insert_fn(self, prefix: Prefix, state: DecodeState, slot: jax.Array, row: jax.Array, admitted: Any
                 ) -> DecodeState:
    self.traces["insert"] += 1
    caches = self.cache.insert(state.caches, prefix.caches, slot, row, admitted)
    return self._with_prompt(state, caches, prefix, slot, row)

  @staticmethod
  def _with_prompt(state: DecodeState, caches: Any, prefix: Prefix, slot: jax.Array, row: jax.Array) -> DecodeState:
    return dataclasses.replace(state, caches=caches,
                               next_positions_B=state.next_positions_B.at[slot].set(prefix.next_positions_B[row]),
                               tokens_B=state.tokens_B.at[slot].set(prefix.first_tokens_B[row]),
                               sampling=jax.tree.map(lambda big, small: big.at[slot].set(small[row]), state.sampling,
                                                     prefix.sampling))

  def _extend_fn(self, params: Any, state: DecodeState, tokens_1C: jax.Array, start: jax.Array, length: jax.Array,
                 slot: jax.Array, table_1M: jax.Array, rows: RowSampling, pixels: jax.Array | None
                 ) -> tuple[DecodeState, tuple[jax.Array, TokenLogprobs]]:
    """One prefill chunk of one slot through its pages: tokens [1, C] (the first `length` real) at
    positions start.. attend over what the slot's pages already hold; the slot's next position,
    token and sampling rows are set as `insert` sets them (read only after the last chunk).
    Padding past `length` writes garbage only at positions the generated tokens overwrite before
    anything attends to them, or, past the prompt's pages, nowhere."""
    self.traces["extend"] += 1
    seeds_to_keys = jax.vmap(lambda seed: jax.random.key_data(jax.random.key(seed)))
    rows = dataclasses.replace(rows, keys_B=seeds_to_keys(rows.keys_B))
    stacked = self.cfg.scan_layers
    stored_tables = jax.tree.map(lambda c: c.block_table_BM if paged_cache.is_pool(c) else c, state.caches,
                                 is_leaf=paged_cache.is_pool)
    caches = paged_cache.with_block_table(paged_cache.slot_states(state.caches, slot, stacked), table_1M)
    positions_1C = start + jnp.arange(tokens_1C.shape[1], dtype=jnp.int32)[None]
    logits_11V, caches = self.spec.apply_decode(params, tokens_1C, positions_1C, caches, (length - 1)[None], pixels)
    caches = jax.tree.map(lambda c, t: dataclasses.replace(c, block_table_BM=t) if paged_cache.is_pool(c) else c,
                          caches, stored_tables, is_leaf=paged_cache.is_pool)
    caches = paged_cache.with_slot_states(state.caches, caches, slot, stacked)
    tokens_1, rows, logprobs = self._sample(logits_11V[:, 0], rows)
    prefix = Prefix(None, (start + length)[None], tokens_1, rows, logprobs)
    return self._with_prompt(state, caches, prefix, slot, jnp.int32(0)), (tokens_1, logprobs)

  def _generate_fn(self, params: Any, state: DecodeState, table_TM: jax.Array | None
                   ) -> tuple[DecodeState, tuple[jax.Array, TokenLogprobs]]:
    self.traces["generate"] += 1  # Python side effect: runs once per trace, never per executed step
    caches = self.cache.with_table(state.caches, table_TM)
    logits_B1V, caches = self.spec.apply_decode(params, state.tokens_B[:, None], state.next_positions_B[:, None],
                                                caches)
    caches = self.cache.keep_inactive(caches, state.caches, table_TM)
    tokens_B, rows, logprobs = self._sample(logits_B1V[:, 0], state.sampling)
    return DecodeState(caches, state.next_positions_B + 1, tokens_B, rows), (tokens_B, logprobs)


@dataclasses.dataclass
class Request:
  prompt: list[int]
  max_new_tokens: int
  output: list[int] = dataclasses.field(default_factory=list)
  images: image_prompts.PromptImages | None = None


def load_engine(config: Config, num_slots: int, fresh_note: str, mesh: Mesh | None = None) -> tuple[Engine, Any]:
  """An engine and its parameters: load_parameters_path's (checked before anything is built),
  else fresh ones, announced with `fresh_note`."""
  path = model_assembly.parameters_path(config)
  engine = Engine(config, num_slots=num_slots, mesh=mesh)
  if not path:
    distributed.log(fresh_note)
  return engine, engine.load_params(path)


def serve(engine: Engine, params: Any, requests: Sequence[Request], eos_id: int | None = None,
          seed: int = 0) -> list[Request]:
  """Continuous batching: each request takes a free slot (prefill + insert), generates until
  max_new_tokens or eos_id, and frees the slot (and its pages) for the next waiting request.
  With a paged cache a request also waits, in order, until the pages its prompt and
  max_new_tokens will need are free, so generate never runs out. Returns `requests` with their
  outputs filled in (the first token comes from prefill)."""
  limit = engine.cfg.max_target_length
  for i, request in enumerate(requests):
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
