"""Speculative decoding with the model's own multi-token-prediction head as the draft (DeepSeek-V3,
layers/mtp.py): no second model, the target's hidden states feed the proposals.

Shape legend (extends engine.py / speculative.py): T slots, K = k + 1, D model width, V vocabulary.

MTP module 0 at position i reads the decoder stack's output h_i (before the final norm) and the
embedding of token t(i+1), and predicts t(i+2). Between rounds each slot carries the module's
output and logits at position p - 1 (p: its pending token t0's position), which already predict
the token after t0. One round (`step`, one jitted program):
- proposal d1 is drawn from the carried logits; d2..dk by running the module again on its own
  output (in place of the target's unknown h at the next position) and the embedding of the
  proposal just drawn, at positions p..p+k-2 (module 0 chained, as EAGLE and SGLang run V3's one
  MTP module for several tokens; with mtp_num_layers > 1 the other modules are not used yet);
- the target scores [t0, d1..dk] at p..p+k and returns its hidden states as well;
- the rejection rule of speculative.verify picks n accepted proposals and the last token, so greedy
  output equals plain greedy decoding and sampled output follows the target;
- the module runs once more over positions p..p+k, now on the target's verified h and the emitted
  tokens, rewriting its cache there; its output at p + n (the new p - 1) is carried.

The MTP layer's KV cache: one layer, dense ([T, max_target_length] per slot) beside the target's
cache of either layout. Position x holds the module's keys for (h_x, t(x+1)) of accepted tokens:
each round's last pass rewrites every position the chained proposals wrote, and a query at x reads
positions <= x only, all written this round or accepted before (the stale-entry argument of
speculative.py). Prefill runs the module over the whole prompt, so prompts are prefilled whole
(no chunked prefill; a paged target's prefix caching is not used).

With LoRA adapter tables (lora_adapters.py) the target's calls run with each slot's adapter row, so
its hidden states and verifying logits are the adapted model's; the MTP module is the base's (PEFT
adapters have no MTP weights, so its table rows stay zero and it runs outside lora_rows.use_rows) and
proposes from the adapted hidden states. Greedy output is still each slot's adapted plain greedy output.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

from MaxText.errors import UserError
from MaxText.inference import paged_cache, sampling, speculative
from MaxText.inference.decode_state import (DecodeState, Prefix, RowSampling, pad_prompts, padded_pairs, row_sampling,
                                            sample, seeded)
from MaxText.inference.engine import Engine, refuse_mtp_speculative
from MaxText.inference.engine_api import Prefilled, TokenLogprobs
from MaxText.layers import kv_cache, lora_rows
from MaxText.training.model_assembly import Params
from MaxText.platform import sharding


@struct.dataclass
class MtpDraft:
  """What the MTP draft keeps per row: its layer's cache and its output and logits at p - 1."""

  cache: Any  # one layer's KVCache (rows B of a prefill, slots T of a decode state)
  hidden_BD: Any
  logits_BV: Any


@struct.dataclass
class MtpState:
  target: DecodeState
  draft: MtpDraft  # of the slots


class MtpSpeculativeDecoder:
  """speculative.SpeculativeDecoder's interface with the target's MTP module 0 as the draft (the
  draft_params arguments are ignored: the module's weights are the target's)."""

  def __init__(self, target: Engine, speculative_tokens: int | None = None):
    k = target.decode_cfg.speculative_tokens if speculative_tokens is None else speculative_tokens
    if k < 1:
      raise UserError(f"speculative_tokens must be >= 1 for MTP drafting, got {k}")
    refuse_mtp_speculative(target.cfg)
    if target.cfg.mtp.mtp_num_layers < 1:
      raise UserError("MTP drafting needs a model with multi-token-prediction modules (mtp_num_layers > 0)")
    if target.decode_cfg.prefill_chunk_size:
      raise UserError(f"prefill_chunk_size={target.decode_cfg.prefill_chunk_size}: MTP drafting prefills prompts "
                      "whole (the MTP module runs over the prompt); set prefill_chunk_size=0 or name a draft model")
    if target.decode_cfg.prefix_caching == "true":
      raise UserError("prefix_caching=true: MTP drafting prefills prompts whole and shares no prompt pages; set "
                      "prefix_caching=auto or name a draft model")
    self.target, self.draft, self.k = target, None, k
    self.num_slots = target.num_slots
    self.acceptance = speculative.Acceptance(k)
    self.traces = {"round": 0, "prefill": 0}
    cfg, quantized = target.cfg, target.decode_cfg.quantize_kvcache
    self._empty_cache = lambda batch, length: kv_cache.layer_cache(cfg, batch, length, quantized)  # noqa: E731
    abstract = jax.eval_shape(lambda: self._empty_cache(self.num_slots, cfg.max_target_length))
    self.cache_bytes = paged_cache.cache_bytes(abstract)
    replicated = NamedSharding(target.mesh, PartitionSpec())
    cache_shardings = sharding.named_shardings(abstract, kv_cache.cache_logical_names(abstract, stacked=False),
                                               target.mesh, target.rules)
    self.state_shardings = MtpState(target.state_shardings, MtpDraft(cache_shardings, replicated, replicated))
    self._init = jax.jit(self._init_fn, out_shardings=self.state_shardings.draft)
    self._prefill = jax.jit(self._prefill_fn)
    self._insert = jax.jit(self._insert_fn, donate_argnums=(1,), out_shardings=self.state_shardings.draft)
    self._insert_rows = jax.jit(self._insert_rows_fn, donate_argnums=(1,), out_shardings=self.state_shardings.draft)
    self._prefill_insert = jax.jit(self._prefill_insert_fn, donate_argnums=(1,), out_shardings=(
        self.state_shardings, Prefilled(replicated, TokenLogprobs(replicated, replicated, replicated))))
    self._round = jax.jit(self._round_fn, donate_argnums=(1,),
                          out_shardings=(self.state_shardings, replicated, replicated,
                                         TokenLogprobs(replicated, replicated, replicated)))

  # ---------------------------------------------------------------- public API (as SpeculativeDecoder's)
  def init_decode_state(self, seed: int = 0) -> MtpState:
    return MtpState(self.target.init_decode_state(seed), self._init())

  def prefill(self, target_params: Params, draft_params: Params, prompts: Sequence[Sequence[int]], seed: int = 0,
              row_params: Sequence[sampling.RowParams] | None = None, masks: np.ndarray | None = None
              ) -> tuple[Prefix, MtpDraft]:
    """The target's prefill (its first tokens; `masks`: their token bitmasks) and the MTP module's pass over the
    prompts."""
    tokens_BL, lengths_B = pad_prompts(prompts, self.target.decode_cfg.max_prefill_predict_length, self.target.cfg)
    if row_params is None:
      row_params = [sampling.RowParams.from_strategy(self.target.sampling, seed + i) for i in range(len(prompts))]
    with sharding.activation_sharding(self.target.mesh, self.target.rules):
      return self._prefill(target_params, tokens_BL, lengths_B, row_sampling(row_params),
                           None if masks is None else np.asarray(masks))

  def insert(self, prefixes: tuple[Prefix, MtpDraft], state: MtpState, slot: int, row: int = 0) -> MtpState:
    target = self.target.insert(prefixes[0], state.target, slot, row)
    return MtpState(target, self._insert(prefixes[1], state.draft, jnp.int32(slot), jnp.int32(row)))

  def insert_rows(self, prefixes: tuple[Prefix, MtpDraft], state: MtpState, slots: Sequence[int],
                  rows: Sequence[int]) -> MtpState:
    """Rows[i] of the prefill in slots[i]: the target's Engine.insert_rows, then one call for the module's rows."""
    target = self.target.insert_rows(prefixes[0], state.target, slots, rows)
    slots_R, rows_R = padded_pairs(slots, rows, int(np.shape(prefixes[0].next_positions_B)[0]))
    return MtpState(target, self._insert_rows(prefixes[1], state.draft, slots_R, rows_R))

  def prefill_insert(self, target_params: Params, draft_params: Params, state: MtpState,
                     prompts: Sequence[Sequence[int]], slots: Sequence[int], seed: int = 0,
                     row_params: Sequence[sampling.RowParams] | None = None, masks: np.ndarray | None = None
                     ) -> tuple[MtpState, Prefilled]:
    """`prefill` and `insert_rows` (prompt i into slots[i]) in one jitted call (Engine.prefill_insert)."""
    tokens_BL, lengths_B = pad_prompts(prompts, self.target.decode_cfg.max_prefill_predict_length, self.target.cfg)
    rows = self.target.row_sampling(prompts, seed, row_params)
    pairs = self.target.admit_rows(lengths_B, slots, range(len(slots)))
    with sharding.activation_sharding(self.target.mesh, self.target.rules):
      return self._prefill_insert(target_params, state, tokens_BL, lengths_B, rows,
                                  None if masks is None else np.asarray(masks), pairs)

  def release(self, slot: int) -> None:
    self.target.release(slot)

  def scored_step(self, target_params: Params, draft_params: Params, state: MtpState,
                  active: Sequence[bool] | np.ndarray | None = None, mask: np.ndarray | None = None
                  ) -> tuple[MtpState, np.ndarray, np.ndarray, TokenLogprobs]:
    """One round: as speculative.SpeculativeDecoder.scored_step."""
    table = self.target.cache.step_table(self.k + 1)
    with sharding.activation_sharding(self.target.mesh, self.target.rules):
      state, tokens_TK, counts_T, logprobs = self._round(target_params, state, table,
                                                         None if mask is None else np.asarray(mask))  # as engine._step
    tokens, counts, logprobs = jax.device_get((tokens_TK, counts_T, logprobs))
    self.target.cache.advance(counts)
    self.acceptance.record(self.target, counts, active)
    return state, tokens, counts, logprobs

  def step(self, target_params: Params, draft_params: Params, state: MtpState,
           active: Sequence[bool] | np.ndarray | None = None) -> tuple[MtpState, np.ndarray, np.ndarray]:
    state, tokens, counts, _ = self.scored_step(target_params, draft_params, state, active)
    return state, tokens, counts

  def metrics(self) -> dict[str, float]:
    return self.acceptance.metrics()

  # ---------------------------------------------------------------- jitted bodies
  def _init_fn(self) -> MtpDraft:
    cfg = self.target.cfg
    return MtpDraft(self._empty_cache(self.num_slots, cfg.max_target_length),
                    jnp.zeros((self.num_slots, cfg.emb_dim), jnp.dtype(cfg.dtype)),
                    jnp.zeros((self.num_slots, cfg.vocab_size), jnp.float32))

  def _prefill_fn(self, params: Params, tokens_BL: jax.Array, lengths_B: jax.Array, rows: RowSampling,
                  masks_BW: jax.Array | None = None) -> tuple[Prefix, MtpDraft]:
    self.traces["prefill"] += 1
    spec, cfg = self.target.spec, self.target.cfg
    rows = seeded(rows)
    batch, length = tokens_BL.shape
    caches = kv_cache.model_caches(cfg, batch, length, self.target.decode_cfg.quantize_kvcache)
    positions_BL = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens_BL.shape)
    last_B11 = (lengths_B - 1)[:, None, None]
    with lora_rows.use_rows(rows.adapter_B):  # the target with each row's adapter; the MTP module without
      h_BLD, caches = spec.apply_decode_hidden(params, tokens_BL, positions_BL, caches)
      logits_BV = spec.apply_logits(params, jnp.take_along_axis(h_BLD, last_B11, axis=1))[:, 0]
    first_B, rows, logprobs = sample(logits_BV, rows, masks_BW)
    # The token after each position: the prompt's next one, the first sampled token after its last.
    next_BL = jnp.pad(tokens_BL[:, 1:], ((0, 0), (0, 1)))
    next_BL = jnp.where(positions_BL == lengths_B[:, None] - 1, first_B[:, None], next_BL)
    mtp_BLD, mtp_cache = spec.apply_mtp_decode(params, 0, h_BLD, next_BL, positions_BL,
                                               self._empty_cache(batch, length))
    mtp_B1D = jnp.take_along_axis(mtp_BLD, last_B11, axis=1)
    draft = MtpDraft(mtp_cache, mtp_B1D[:, 0], spec.apply_mtp_logits(params, 0, mtp_B1D)[:, 0])
    return Prefix(caches, lengths_B, first_B, rows, logprobs), draft

  def _insert_fn(self, prefix: MtpDraft, state: MtpDraft, slot: jax.Array, row: jax.Array) -> MtpDraft:
    def put(big: jax.Array, small: jax.Array) -> jax.Array:
      one_row = jax.lax.dynamic_slice_in_dim(small, row, 1, axis=0)
      return jax.lax.dynamic_update_slice(big, one_row.astype(big.dtype), (slot,) + (0,) * (big.ndim - 1))

    return jax.tree.map(put, state, prefix)

  def _insert_rows_fn(self, prefix: MtpDraft, state: MtpDraft, slots_R: jax.Array, rows_R: jax.Array) -> MtpDraft:
    def put(big: jax.Array, small: jax.Array) -> jax.Array:  # a prompt's L cache positions: the first of S
      # A repeated pair writes the same row again: the scatter's order does not matter.
      return big.at[(slots_R,) + tuple(slice(0, n) for n in small.shape[1:])].set(small[rows_R].astype(big.dtype))

    return jax.tree.map(put, state, prefix)

  def _prefill_insert_fn(self, params: Params, state: MtpState, tokens_BL: jax.Array, lengths_B: jax.Array,
                         rows: RowSampling, masks_BW: jax.Array | None,
                         pairs: tuple[jax.Array, jax.Array, jax.Array | None]) -> tuple[MtpState, Prefilled]:
    prefix, draft = self._prefill_fn(params, tokens_BL, lengths_B, rows, masks_BW)
    target = self.target._insert_rows_fn(prefix, state.target, *pairs)
    return MtpState(target, self._insert_rows_fn(draft, state.draft, pairs[0], pairs[1])), prefix.prefilled()

  def _round_fn(self, params: Params, state: MtpState, table_TM: jax.Array | None, mask_TW: jax.Array | None = None
                ) -> tuple[MtpState, jax.Array, jax.Array, TokenLogprobs]:
    self.traces["round"] += 1
    spec, k, rows = self.target.spec, self.k, state.target.sampling
    positions_T, pending_T = state.target.next_positions_B, state.target.tokens_B
    keys_T, draw_keys_TX = speculative.round_keys(rows.keys_B, k)
    probs = lambda logits_BV: sampling.row_probs(logits_BV, rows.temperature_B, rows.top_p_B,  # noqa: E731
                                                 rows.top_k_B)
    q1_TV = probs(state.draft.logits_BV)
    d1_T = speculative.draw(draw_keys_TX[:, 0], q1_TV)

    def chain(carry: tuple[jax.Array, jax.Array, Any], step: tuple[jax.Array, jax.Array]
              ) -> tuple[tuple[jax.Array, jax.Array, Any], tuple[jax.Array, jax.Array]]:
      token_T, h_TD, cache = carry
      index, keys = step  # proposal index + 1 comes from position p + index - 1
      h_T1D, cache = spec.apply_mtp_decode(params, 0, h_TD[:, None], token_T[:, None],
                                           (positions_T + index - 1)[:, None], cache)
      q_TV = probs(spec.apply_mtp_logits(params, 0, h_T1D)[:, 0])
      proposal_T = speculative.draw(keys, q_TV)
      return (proposal_T, h_T1D[:, 0], cache), (proposal_T, q_TV)

    steps = (jnp.arange(1, k, dtype=jnp.int32), jnp.moveaxis(draw_keys_TX[:, 1:k], 1, 0))
    (_, _, mtp_cache), (more_KT, more_q_KTV) = jax.lax.scan(
        chain, (d1_T, state.draft.hidden_BD, state.draft.cache), steps)
    proposals_Tk = jnp.concatenate([d1_T[:, None], more_KT.T], axis=1)
    q_TkV = jnp.concatenate([q1_TV[:, None], jnp.moveaxis(more_q_KTV, 0, 1)], axis=1)

    tokens_TK = jnp.concatenate([pending_T[:, None], proposals_Tk], axis=1)
    positions_TK = positions_T[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None]
    caches = self.target.cache.with_table(state.target.caches, table_TM)
    with lora_rows.use_rows(rows.adapter_B):  # the target verifies with each slot's adapter
      h_TKD, caches = spec.apply_decode_hidden(params, tokens_TK, positions_TK, caches)
      logits_TKV = spec.apply_logits(params, h_TKD)
    out_TK, num_accepted_T, last_T, logprobs = speculative.verify(logits_TKV, q_TkV, proposals_Tk, rows, draw_keys_TX,
                                                                  mask_TW)

    # The module over the round's positions with the verified hidden states and emitted tokens.
    mtp_TKD, mtp_cache = spec.apply_mtp_decode(params, 0, h_TKD, out_TK, positions_TK, mtp_cache)
    mtp_T1D = jnp.take_along_axis(mtp_TKD, num_accepted_T[:, None, None], axis=1)
    draft = MtpDraft(mtp_cache, mtp_T1D[:, 0], spec.apply_mtp_logits(params, 0, mtp_T1D)[:, 0])
    target = DecodeState(caches, positions_T + num_accepted_T + 1, last_T, dataclasses.replace(rows, keys_B=keys_T))
    return MtpState(target, draft), out_TK, num_accepted_T + 1, logprobs
