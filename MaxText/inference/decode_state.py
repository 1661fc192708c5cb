"""The records a decode engine and its parts pass around, and the traced helpers that fill a slot.

Shape legend (as engine.py): B prompts or rows, L padded prompt length, T slots, V vocabulary.

`Prefix` is what a prefill returns, `DecodeState` the batched state of every slot, `RowSampling`
each row's sampling parameters and PRNG stream. `sample` draws each row's next token, `with_prompt`
puts a prefilled prompt's position, first token and sampling row into a slot. The engine
(engine.py), its prefill into pages (page_prefill.py) and the speculative decoders share them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from MaxText.configuration.model_config import ModelConfig
from MaxText.errors import UserError
from MaxText.inference import sampling
from MaxText.inference.engine_api import Prefilled, TokenLogprobs

# Every layer's decode cache: a pytree of kv_cache.KVCache, paged_cache pools and recurrent-layer states (the
# same structure also carries their shardings).
Caches = Any


@struct.dataclass
class RowSampling:
  """Per-row sampling parameters and PRNG streams (rows are prompts in a Prefix, slots in a DecodeState).
  Fields are Any: the same structure carries the rows' shardings."""

  temperature_B: Any  # float32; 0 = greedy
  top_p_B: Any  # float32; 1 = no nucleus cut
  top_k_B: Any  # int32; 0 = no top-k cut
  keys_B: Any  # PRNG key data per row, split at every draw (before the jitted body: uint32 seeds)
  adapter_B: Any  # int32 the row's LoRA adapter (a row of the engine's adapter table, lora_adapters.py); 0 = none


@struct.dataclass
class Prefix:
  caches: Caches  # per-layer KV caches of length L (batch B); None from a prefill straight into pages
  next_positions_B: jax.Array  # the prompts' true lengths: where each first generated token goes
  first_tokens_B: jax.Array  # token sampled from each prompt's last position
  sampling: RowSampling  # each row's parameters, keys already advanced past the first draw
  first_logprobs: TokenLogprobs

  def prefilled(self) -> Prefilled:
    return Prefilled(self.first_tokens_B, self.first_logprobs)


@struct.dataclass
class DecodeState:
  """Arrays of the batched decode state (the same structure also carries their shardings)."""

  caches: Caches  # per-layer KV caches of length S (batch T)
  next_positions_B: Any  # [T] int32 position the slot's pending token is written at
  tokens_B: Any  # [T] int32 each slot's latest sampled token (input of the next step)
  sampling: Any  # RowSampling of the slots (a free slot keeps its last request's values, unused)


def check_token_ids(prompts: Sequence[Sequence[int]], cfg: ModelConfig) -> None:
  """UserError naming the first id of `prompts` outside the model's vocabulary (a vision model's image_token_id
  placeholders aside): an embedding gather would read past the table without a word."""
  vocab = cfg.vocab_size
  image = cfg.vision.image_token_id if cfg.vision.use_multimodal else None
  for i, prompt in enumerate(prompts):
    ids = np.asarray(prompt)
    if ids.size == 0:
      continue
    if ids.dtype.kind not in "iu":
      raise UserError(f"prompt {i} holds {ids.dtype} values; token ids are integers in [0, vocab_size={vocab})")
    bad = (ids < 0) | (ids >= vocab)
    if image is not None:
      bad &= ids != image
    if bad.any():
      at = int(np.flatnonzero(bad)[0])
      raise UserError(f"prompt {i} holds token id {int(ids[at])} (position {at}), outside the model's vocabulary "
                      f"[0, vocab_size={vocab}): ids from a tokenizer this model was not trained with?")


def pad_prompts(prompts: Sequence[Sequence[int]], length: int, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads token lists to [B, length] (pad id 0), their ids checked against `cfg`'s vocabulary; returns
  (tokens, true lengths)."""
  for i, prompt in enumerate(prompts):
    if not 1 <= len(prompt) <= length:
      raise UserError(f"prompt {i} has {len(prompt)} tokens; it must have 1 to max_prefill_predict_length="
                      f"{length} tokens (raise max_prefill_predict_length or shorten the prompt)")
  check_token_ids(prompts, cfg)
  tokens = np.zeros((len(prompts), length), np.int32)
  for i, prompt in enumerate(prompts):
    tokens[i, :len(prompt)] = prompt
  return tokens, np.asarray([len(p) for p in prompts], np.int32)


def padded_pairs(slots: Sequence[int], rows: Sequence[int], batch: int) -> tuple[np.ndarray, np.ndarray]:
  """An insert_rows call's (slots, rows), `batch` pairs: the given ones, then the first repeated (writing it
  again changes nothing), so one program compiles per prefill batch size."""
  pad = batch - len(slots)
  return (np.asarray(list(slots) + [slots[0]] * pad, np.int32), np.asarray(list(rows) + [rows[0]] * pad, np.int32))


def row_sampling(rows: Sequence[sampling.RowParams]) -> RowSampling:
  """The rows' parameters as host arrays (a jitted call takes them as they are); `keys_B` holds their
  seeds, which `seeded` turns into keys inside jit."""
  return RowSampling(np.asarray([r.temperature for r in rows], np.float32),
                     np.asarray([r.top_p for r in rows], np.float32),
                     np.asarray([r.top_k for r in rows], np.int32),
                     np.asarray([r.seed % 2**32 for r in rows], np.uint32),
                     np.asarray([r.adapter for r in rows], np.int32))


def seeded(rows: RowSampling) -> RowSampling:
  """`rows` with each row's seed made into its PRNG key data (traced)."""
  seeds_to_keys = jax.vmap(lambda seed: jax.random.key_data(jax.random.key(seed)))
  return dataclasses.replace(rows, keys_B=seeds_to_keys(rows.keys_B))


def sample(logits_BV: jax.Array, rows: RowSampling, mask_BW: jax.Array | None = None, top: bool = True,
           live_B: jax.Array | None = None) -> tuple[jax.Array, RowSampling, TokenLogprobs]:
  """Each row's next token by its own parameters (among the tokens `mask_BW` allows: constrained
  decoding, sampling.apply_token_mask), the rows with their keys advanced (when some row samples:
  sampling.next_tokens; `live_B`: the rows whose results count), the tokens' scores under the model's
  own distribution (`top` False: without the top alternatives, sampling.token_logprobs)."""
  tokens_B, keys_B = sampling.next_tokens(sampling.apply_token_mask(logits_BV, mask_BW), rows.keys_B,
                                          rows.temperature_B, rows.top_p_B, rows.top_k_B, live_B)
  return tokens_B, dataclasses.replace(rows, keys_B=keys_B), TokenLogprobs(*sampling.token_logprobs(logits_BV,
                                                                                                    tokens_B, top))


def with_prompt(state: DecodeState, caches: Caches, prefix: Prefix, slot: jax.Array, row: jax.Array) -> DecodeState:
  """`state` with `caches` and prompt `row` of `prefix` (next position, first token, sampling) in `slot` (traced)."""
  return dataclasses.replace(state, caches=caches,
                             next_positions_B=state.next_positions_B.at[slot].set(prefix.next_positions_B[row]),
                             tokens_B=state.tokens_B.at[slot].set(prefix.first_tokens_B[row]),
                             sampling=jax.tree.map(lambda big, small: big.at[slot].set(small[row]), state.sampling,
                                                   prefix.sampling))
