"""Next-token selection from logits: greedy, weighted (temperature), nucleus (top-p) and top-k.

Shape legend: B batch (decode slots), V vocabulary.

Every strategy is a pure function of (logits, key), so a fixed seed gives the same tokens, and
`sample` is jit-friendly with the strategy static and the knobs traced or static alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The parameters, kept where the HTTP front ends read them without JAX, and named here as before.
from MaxText.inference.row_params import (ALL_TOKENS as ALL_TOKENS, NUM_TOP_LOGPROBS as NUM_TOP_LOGPROBS,
                                          STRATEGIES as STRATEGIES, RowParams as RowParams,
                                          SamplingParams as SamplingParams, mask_words as mask_words)


def greedy(logits_BV: jax.Array) -> jax.Array:
  """int32 argmax over the last axis, the first of equal maxima, a NaN counting as the largest (jnp.argmax's
  tokens). Written as a max and a min: XLA's CPU backend runs argmax's (value, index) reduction one
  element at a time, a large part of a small model's decode step."""
  top = jnp.max(logits_BV, axis=-1, keepdims=True)  # NaN when the row has one
  hit = (logits_BV == top) | jnp.isnan(logits_BV)
  index = jax.lax.broadcasted_iota(jnp.int32, logits_BV.shape, logits_BV.ndim - 1)
  return jnp.min(jnp.where(hit, index, logits_BV.shape[-1]), axis=-1)


def weighted(logits_BV: jax.Array, key: jax.Array, temperature: float) -> jax.Array:
  return jax.random.categorical(key, logits_BV.astype(jnp.float32) / temperature, axis=-1).astype(jnp.int32)


def nucleus(logits_BV: jax.Array, key: jax.Array, top_p: float, temperature: float) -> jax.Array:
  """Samples among the most probable tokens whose cumulative probability first reaches `top_p`
  (the token that crosses the threshold is kept, so at least one token always survives)."""
  scaled_BV = logits_BV.astype(jnp.float32) / temperature
  sorted_BV = jnp.sort(scaled_BV, axis=-1)[:, ::-1]
  cumulative_BV = jnp.cumsum(jax.nn.softmax(sorted_BV, axis=-1), axis=-1)
  # Mass strictly before each sorted token; a token is kept while that mass is below p.
  before_BV = cumulative_BV - jax.nn.softmax(sorted_BV, axis=-1)
  num_kept_B = jnp.sum(before_BV < top_p, axis=-1)
  threshold_B1 = jnp.take_along_axis(sorted_BV, (num_kept_B - 1)[:, None], axis=-1)
  masked_BV = jnp.where(scaled_BV >= threshold_B1, scaled_BV, -jnp.inf)
  return jax.random.categorical(key, masked_BV, axis=-1).astype(jnp.int32)


def top_k(logits_BV: jax.Array, key: jax.Array, k: int, temperature: float) -> jax.Array:
  """Samples among the k highest logits (k static)."""
  values_Bk, indices_Bk = jax.lax.top_k(logits_BV.astype(jnp.float32) / temperature, k)
  choice_B = jax.random.categorical(key, values_Bk, axis=-1)
  return jnp.take_along_axis(indices_Bk, choice_B[:, None], axis=-1)[:, 0].astype(jnp.int32)


def sample(logits_BV: jax.Array, key: jax.Array, params: SamplingParams) -> jax.Array:
  """Next token ids [B] int32 under `params` (a hashable dataclass: pass it as a static argument)."""
  if params.strategy == "greedy":
    return greedy(logits_BV)
  if params.strategy == "weighted":
    return weighted(logits_BV, key, params.temperature)
  if params.strategy == "nucleus":
    return nucleus(logits_BV, key, params.top_p, params.temperature)
  if params.strategy == "topk":
    return top_k(logits_BV, key, params.top_k, params.temperature)
  raise ValueError(f"unknown sampling strategy {params.strategy!r}; expected one of {', '.join(STRATEGIES)}")


# ---------------------------------------------------------------- per-row parameters (serving): row_params.RowParams


def masked_logits(logits_BV: jax.Array, temperature_B: jax.Array, top_p_B: jax.Array, top_k_B: jax.Array
                  ) -> jax.Array:
  """Each row's logits divided by its temperature, -inf outside its top-k and then its top-p
  (over the top-k survivors, renormalised; the crossing token kept, so at least one survives):
  the distribution a sampled row draws from is softmax of this. A greedy row's (temperature 0) is
  never read. When no sampled row cuts (top_p >= 1 and top_k 0 or at least the vocabulary), nothing
  is sorted: every token is kept (with the sort, a top_p of 1 also cut the tokens whose mass before
  them, summed in float32, rounded up to 1)."""
  vocab = logits_BV.shape[-1]
  scaled_BV = logits_BV.astype(jnp.float32) / jnp.maximum(temperature_B, 1e-6)[:, None]
  cuts_B = (top_p_B < 1) | ((top_k_B > 0) & (top_k_B < vocab))

  def cut() -> jax.Array:  # a row that does not cut keeps every token, whoever shares its batch
    return jnp.where(cuts_B[:, None], _cut(scaled_BV, top_p_B, top_k_B), scaled_BV)

  return jax.lax.cond(jnp.any((temperature_B > 0) & cuts_B), cut, lambda: scaled_BV)


def _cut(scaled_BV: jax.Array, top_p_B: jax.Array, top_k_B: jax.Array) -> jax.Array:
  """masked_logits' top-k and top-p over the sorted scaled logits."""
  vocab = scaled_BV.shape[-1]
  sorted_BV = jnp.sort(scaled_BV, axis=-1)[:, ::-1]
  rank_V = jnp.arange(vocab)
  k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, vocab), vocab)
  in_top_k_BV = rank_V[None, :] < k_B[:, None]
  # Top-p over the top-k survivors (renormalised), the crossing token kept: a prefix of the sort.
  probs_BV = jax.nn.softmax(jnp.where(in_top_k_BV, sorted_BV, -jnp.inf), axis=-1)
  before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
  num_kept_B = jnp.maximum(jnp.sum(in_top_k_BV & (before_BV < top_p_B[:, None]), axis=-1), 1)
  threshold_B1 = jnp.take_along_axis(sorted_BV, (num_kept_B - 1)[:, None], axis=-1)
  return jnp.where(scaled_BV >= threshold_B1, scaled_BV, -jnp.inf)


def sample_rows(logits_BV: jax.Array, keys_B: jax.Array, temperature_B: jax.Array, top_p_B: jax.Array,
                top_k_B: jax.Array) -> jax.Array:
  """Next token ids [B] int32, row b drawn with its own key and parameters (keys_B: key data
  [B, ...]). Greedy rows take the argmax; when every row is greedy nothing is sorted."""
  def sampled() -> jax.Array:
    masked_BV = masked_logits(logits_BV, temperature_B, top_p_B, top_k_B)
    draw = jax.vmap(lambda key, row: jax.random.categorical(jax.random.wrap_key_data(key), row))
    return jnp.where(temperature_B > 0, draw(keys_B, masked_BV), greedy(logits_BV)).astype(jnp.int32)

  return jax.lax.cond(jnp.all(temperature_B <= 0), lambda: greedy(logits_BV), sampled)


def draws(temperature_B: jax.Array, live_B: jax.Array | None = None) -> jax.Array:
  """bool []: whether any row (of the `live_B` ones) samples rather than takes the argmax."""
  sampled_B = temperature_B > 0
  return jnp.any(sampled_B if live_B is None else sampled_B & live_B)


def next_tokens(logits_BV: jax.Array, keys_B: jax.Array, temperature_B: jax.Array, top_p_B: jax.Array,
                top_k_B: jax.Array, live_B: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """(next token ids [B] int32 as `sample_rows` draws them, the rows' next keys). The keys are split
  (split_rows) only when some row samples: when none does (rows outside `live_B`, whose results the
  caller drops, do not count), the argmax alone runs and the keys stay as they are, which no greedy
  row ever draws with (a row keeps its temperature for its request's life)."""
  def sampled(keys_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    next_B, draw_B = split_rows(keys_B)
    return sample_rows(logits_BV, draw_B, temperature_B, top_p_B, top_k_B), next_B

  return jax.lax.cond(draws(temperature_B, live_B), sampled, lambda keys_B: (greedy(logits_BV), keys_B), keys_B)


def row_probs(logits_BV: jax.Array, temperature_B: jax.Array, top_p_B: jax.Array, top_k_B: jax.Array) -> jax.Array:
  """float32 [B, V]: the distribution `sample_rows` draws each row's token from (a greedy row's
  is one-hot on its argmax). When every row is greedy nothing is sorted."""
  def one_hot() -> jax.Array:
    return jax.nn.one_hot(greedy(logits_BV), logits_BV.shape[-1], dtype=jnp.float32)

  def sampled() -> jax.Array:
    probs_BV = jax.nn.softmax(masked_logits(logits_BV, temperature_B, top_p_B, top_k_B), axis=-1)
    return jnp.where((temperature_B > 0)[:, None], probs_BV, one_hot())

  return jax.lax.cond(jnp.all(temperature_B <= 0), one_hot, sampled)


# ---------------------------------------------------------------- token masks (constrained decoding)
# (row_params.py: the bitmask layout, ALL_TOKENS and mask_words)


def allowed_tokens(mask_BW: jax.Array, vocab_size: int) -> jax.Array:
  """bool [B, V]: the tokens each row's bitmask allows."""
  bits_BW32 = (mask_BW[:, :, None] >> jnp.arange(32, dtype=jnp.int32)[None, None]) & 1
  return bits_BW32.reshape(mask_BW.shape[0], -1)[:, :vocab_size].astype(bool)


def constrained_rows(mask_BW: jax.Array) -> jax.Array:
  """bool [B]: the rows whose mask constrains them (not every bit set)."""
  return jnp.any(mask_BW != ALL_TOKENS, axis=-1)


def apply_token_mask(logits_BV: jax.Array, mask_BW: jax.Array | None) -> jax.Array:
  """Logits with each row's disallowed tokens at -inf (None: unchanged). A row allowing no token at
  all (a grammar in error) keeps its logits: the host ends that request."""
  if mask_BW is None:
    return logits_BV
  allowed_BV = allowed_tokens(mask_BW, logits_BV.shape[-1])
  allowed_BV |= ~jnp.any(allowed_BV, axis=-1, keepdims=True)
  return jnp.where(allowed_BV, logits_BV, -jnp.inf)


def split_rows(keys_B: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(next keys, keys to draw with now) from per-row key data: each row's stream is its own, so a
  request's draws do not depend on which slot it holds or who shares the batch."""
  pairs = jax.vmap(lambda key: jax.random.key_data(jax.random.split(jax.random.wrap_key_data(key))))(keys_B)
  return pairs[:, 0], pairs[:, 1]


def token_logprobs(logits_BV: jax.Array, tokens_B: jax.Array, top: bool = True
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(log-probability of each chosen token [B], the NUM_TOP_LOGPROBS most probable ids [B, k] and
  their log-probabilities [B, k]) under the model's own distribution (temperature 1). `top` False
  (static): no top-k runs (on CPU it sorts) and the alternatives are empty, [B, 0], so a call of
  several steps writes and returns no buffer for them."""
  logprobs_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
  k = min(NUM_TOP_LOGPROBS, logits_BV.shape[-1])
  if top:
    top_logprobs_Bk, top_ids_Bk = jax.lax.top_k(logprobs_BV, k)
  else:
    top_logprobs_Bk, top_ids_Bk = jnp.zeros((logits_BV.shape[0], 0), jnp.float32), jnp.zeros((logits_BV.shape[0], 0),
                                                                                              jnp.int32)
  chosen_B = jnp.take_along_axis(logprobs_BV, tokens_B[:, None], axis=-1)[:, 0]
  return chosen_B, top_ids_Bk.astype(jnp.int32), top_logprobs_Bk
