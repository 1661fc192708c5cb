"""Speculative decoding with a draft model: a small model proposes k tokens per slot, the target
model scores them all in one pass, and each slot keeps the longest prefix the target agrees with
plus one token of the target's own, so a round emits 1 to k + 1 tokens for one target pass.

Shape legend (extends engine.py): T slots, K = k + 1 tokens the target scores per slot and round,
V vocabulary.

One round (`SpeculativeDecoder.step`, one jitted program for every slot):
- the draft runs k + 1 single-token steps from each slot's pending token t0 at position p: steps
  0..k-1 propose d1..dk, each drawn from the draft's distribution q_i under the slot's sampling
  parameters; step k only writes dk into the draft's cache (so that when every proposal is
  accepted the draft's cache holds them all before the next round);
- the target runs [t0, d1..dk] at positions p..p+k in one call: its distributions p_0..p_k;
- per slot, proposal d_{i+1} is accepted with probability min(1, p_i(d)/q_i(d)) until the first
  rejection at n; the slot then takes one token from normalize(max(0, p_n - q_n)), or, all k
  accepted, a bonus token from p_k. The emitted tokens are d1..dn and that token, distributed
  exactly as the target's own sampling (Leviathan et al. 2023, Chen et al. 2023). Both p and q
  are the distributions `sampling.sample_rows` draws from (the row's temperature, top-k, top-p);
  a greedy row's are one-hot on the argmax, so the same rule accepts exactly the proposals equal
  to the target's argmax and takes the argmax at the first mismatch (or as the bonus): greedy
  output equals the target's plain greedy decoding;
- both caches' positions advance by n + 1; the new token is both models' pending token.

Stale entries: a round writes positions p..p+k of both caches, and only p..p+n hold accepted
tokens. The next round starts at p' = p + n + 1 <= p + k + 1 and writes p'..p'+k, which covers
every stale position p+n+1..p+k; within a call each layer writes its new entries before it
attends, and a query at position x attends only to positions <= x (masks.cache_mask), all written
this round or accepted earlier. So no stale key is ever read. Writes past max_target_length are
dropped (both cache layouts); the tokens they would condition are past the stop condition.

Recurrent states (Gated DeltaNet layers, in the target, the draft or both): a layer's state after
the round's k + 1 tokens has taken in the rejected ones too, and unlike a KV cache it cannot be cut back
by position. Such a model keeps its states from before the round, and where some slot rejected a
proposal, runs its k + 1 tokens once more from those states with each slot's tokens after its n + 1
accepted marked as padding, which a recurrent layer keeps out of its state (models.Transformer.decode's
`logits_index_B`). Its KV-cache layers take the replay's writes, the same values at the same positions
for the accepted tokens. So a round over a recurrent model costs one more pass of that model over
k + 1 tokens, skipped when every slot accepted everything.

Paged caches: before a round each engine's allocator gives every active slot pages for its next
k + 1 positions (capped at max_target_length) and afterwards advances each slot by its own count.
The random draws of a round come from the target state's per-slot key streams.
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
from MaxText.inference import sampling
from MaxText.inference.decode_state import Caches, DecodeState, Prefix, pad_prompts
from MaxText.inference.engine import Engine
from MaxText.inference.engine_api import Prefilled, TokenLogprobs
from MaxText.inference.state_snapshots import has_recurrent_state
from MaxText.layers import lora_rows
from MaxText.layers.gated_deltanet import LinearState
from MaxText.platform import sharding
from MaxText.training.model_assembly import Params


@struct.dataclass
class SpeculativeState:
  """The target's and the draft's decode states; between rounds each slot's next position and
  pending token are the same in both."""

  target: DecodeState
  draft: DecodeState


class Acceptance:
  """A speculative decoder's running counts: rounds, draft tokens proposed to active slots and, of those, the ones
  the target accepted."""

  def __init__(self, k: int):
    self.k = k
    self.reset()

  def reset(self) -> None:
    self.proposed = self.accepted = self.rounds = 0

  def record(self, target: Engine, counts: np.ndarray, active: Sequence[bool] | np.ndarray | None) -> None:
    """One round's tokens per slot (`counts`: accepted + 1); `active` defaults to the slots holding a request."""
    if active is None:
      active = target.cache.active_slots()
    mask = np.asarray(active, bool)
    self.rounds += 1
    self.proposed += self.k * int(mask.sum())
    self.accepted += int((counts[mask] - 1).sum())

  def metrics(self) -> dict[str, float]:
    """proposed / accepted draft tokens, acceptance_rate (accepted / proposed; 0 before any) and rounds."""
    rate = self.accepted / self.proposed if self.proposed else 0.0
    return {"proposed": self.proposed, "accepted": self.accepted, "acceptance_rate": rate, "rounds": self.rounds}


class SpeculativeDecoder:
  """Draft-and-verify decoding over a target Engine and a draft Engine with the same vocabulary
  and number of slots; k = speculative_tokens (the target config's key unless given)."""

  def __init__(self, target: Engine, draft: Engine, speculative_tokens: int | None = None):
    k = target.decode_cfg.speculative_tokens if speculative_tokens is None else speculative_tokens
    if k < 0:
      raise UserError(f"speculative_tokens must be >= 0 (0: no speculative decoding), got {k}")
    if draft.vocab_size != target.vocab_size:
      raise UserError(f"the draft model's vocab_size ({draft.vocab_size}) differs from the target's "
                      f"({target.vocab_size}): speculative decoding needs the same tokenizer")
    if draft.num_slots != target.num_slots:
      raise UserError(f"the draft engine has {draft.num_slots} slots, the target {target.num_slots}: they must match")
    if draft.cfg.max_target_length < target.cfg.max_target_length:
      raise UserError(f"the draft's max_target_length ({draft.cfg.max_target_length}) is below the target's "
                      f"({target.cfg.max_target_length}): the draft must cache every position the target does")
    self.target, self.draft, self.k = target, draft, k
    self.replays = (has_recurrent_state(target.cfg), has_recurrent_state(draft.cfg))  # (target, draft)
    self.num_slots = target.num_slots
    self.acceptance = Acceptance(k)
    self.traces = {"round": 0}
    replicated = NamedSharding(target.mesh, PartitionSpec())
    self.state_shardings = SpeculativeState(target.state_shardings, draft.state_shardings)
    self._prefill_insert = jax.jit(self._prefill_insert_fn, donate_argnums=(2,), out_shardings=(
        self.state_shardings, Prefilled(replicated, TokenLogprobs(replicated, replicated, replicated))))
    self._round = jax.jit(self._round_fn, donate_argnums=(2,),
                          out_shardings=(self.state_shardings, replicated, replicated,
                                         TokenLogprobs(replicated, replicated, replicated)))

  # ---------------------------------------------------------------- public API
  def init_decode_state(self, seed: int = 0) -> SpeculativeState:
    return SpeculativeState(self.target.init_decode_state(seed), self.draft.init_decode_state(seed))

  def prefill(self, target_params: Params, draft_params: Params, prompts: Sequence[Sequence[int]], seed: int = 0,
              row_params: Sequence[sampling.RowParams] | None = None, masks: np.ndarray | None = None
              ) -> tuple[Prefix, Prefix]:
    """Both models' prefills of the prompts; the first tokens are the target's (`masks`: their token bitmasks)."""
    target = self.target.prefill(target_params, prompts, seed, row_params, masks=masks)
    draft = self.draft.prefill(draft_params, prompts, seed, row_params)
    return target, dataclasses.replace(draft, first_tokens_B=target.first_tokens_B)

  def insert(self, prefixes: tuple[Prefix, Prefix], state: SpeculativeState, slot: int,
             row: int = 0) -> SpeculativeState:
    target = self.target.insert(prefixes[0], state.target, slot, row)
    return SpeculativeState(target, self.draft.insert(prefixes[1], state.draft, slot, row))

  def insert_rows(self, prefixes: tuple[Prefix, Prefix], state: SpeculativeState, slots: Sequence[int],
                  rows: Sequence[int]) -> SpeculativeState:
    """Rows[i] of both prefills in slots[i], one Engine.insert_rows call per model."""
    target = self.target.insert_rows(prefixes[0], state.target, slots, rows)
    return SpeculativeState(target, self.draft.insert_rows(prefixes[1], state.draft, slots, rows))

  def prefill_insert(self, target_params: Params, draft_params: Params, state: SpeculativeState,
                     prompts: Sequence[Sequence[int]], slots: Sequence[int], seed: int = 0,
                     row_params: Sequence[sampling.RowParams] | None = None, masks: np.ndarray | None = None
                     ) -> tuple[SpeculativeState, Prefilled]:
    """`prefill` and `insert_rows` (prompt i into slots[i]) of both models in one jitted call (Engine.prefill_insert)."""
    tokens_BL, lengths_B = pad_prompts(prompts, self.target.decode_cfg.max_prefill_predict_length, self.target.cfg)
    rows = self.target.row_sampling(prompts, seed, row_params)
    target_pairs = self.target.admit_rows(lengths_B, slots, range(len(slots)))
    try:
      draft_pairs = self.draft.admit_rows(lengths_B, slots, range(len(slots)))
    except Exception:
      for slot in slots:
        self.target.release(slot)
      raise
    with sharding.activation_sharding(self.target.mesh, self.target.rules):
      return self._prefill_insert(target_params, draft_params, state, tokens_BL, lengths_B, rows,
                                  None if masks is None else np.asarray(masks), target_pairs, draft_pairs[2])

  def release(self, slot: int) -> None:
    self.target.release(slot)
    self.draft.release(slot)

  def step(self, target_params: Params, draft_params: Params, state: SpeculativeState,
           active: Sequence[bool] | np.ndarray | None = None
           ) -> tuple[SpeculativeState, np.ndarray, np.ndarray]:
    """One round over every slot: (state, tokens [T, k + 1], counts [T]); slot t emitted
    tokens[t, :counts[t]] (1 to k + 1 tokens). `active` (default: every slot, or the paged
    allocator's active slots) only selects the slots the acceptance counters count. Paged:
    raises paged_cache.OutOfPages (state unchanged) when the pages of the next k + 1 positions
    are not free."""
    state, tokens, counts, _ = self.scored_step(target_params, draft_params, state, active)
    return state, tokens, counts

  def scored_step(self, target_params: Params, draft_params: Params, state: SpeculativeState,
                  active: Sequence[bool] | np.ndarray | None = None, mask: np.ndarray | None = None
                  ) -> tuple[SpeculativeState, np.ndarray, np.ndarray, TokenLogprobs]:
    """`step` that also returns what each emitted token scored under the target (fields [T, k + 1]
    and [T, k + 1, top]): sampling.token_logprobs of the target's logits at the token's position,
    what plain decoding reports for the same token. `mask`: token bitmasks [T, W] (see `verify`)."""
    tables = [engine.cache.step_table(self.k + 1) for engine in (self.target, self.draft)]
    with sharding.activation_sharding(self.target.mesh, self.target.rules):
      state, tokens_TK, counts_T, logprobs = self._round(target_params, draft_params, state, tables[0], tables[1],
                                                         None if mask is None else np.asarray(mask))  # as engine._step
    tokens, counts, logprobs = jax.device_get((tokens_TK, counts_T, logprobs))
    for engine in (self.target, self.draft):
      engine.cache.advance(counts)
    self.acceptance.record(self.target, counts, active)
    return state, tokens, counts, logprobs

  def metrics(self) -> dict[str, float]:
    return self.acceptance.metrics()

  # ---------------------------------------------------------------- the jitted calls
  def _prefill_insert_fn(self, target_params: Params, draft_params: Params, state: SpeculativeState,
                         tokens_BL: jax.Array, lengths_B: jax.Array, rows: Any, masks_BW: jax.Array | None,
                         target_pairs: tuple[jax.Array, jax.Array, jax.Array | None], draft_table_RM: jax.Array | None
                         ) -> tuple[SpeculativeState, Prefilled]:
    target = self.target._prefill_fn(target_params, tokens_BL, lengths_B, rows, None, masks_BW)
    draft = self.draft._prefill_fn(draft_params, tokens_BL, lengths_B, rows, None)
    draft = dataclasses.replace(draft, first_tokens_B=target.first_tokens_B)  # the slot's pending token: the target's
    slots_R, rows_R, target_table_RM = target_pairs
    return SpeculativeState(self.target._insert_rows_fn(target, state.target, slots_R, rows_R, target_table_RM),
                            self.draft._insert_rows_fn(draft, state.draft, slots_R, rows_R, draft_table_RM)
                            ), target.prefilled()

  def _round_fn(self, target_params: Params, draft_params: Params, state: SpeculativeState,
                target_table_TM: jax.Array | None, draft_table_TM: jax.Array | None, mask_TW: jax.Array | None = None
                ) -> tuple[SpeculativeState, jax.Array, jax.Array, TokenLogprobs]:
    self.traces["round"] += 1  # once per trace
    k, rows = self.k, state.target.sampling
    positions_T, pending_T = state.target.next_positions_B, state.target.tokens_B
    keys_T, draw_keys_TX = round_keys(rows.keys_B, k)
    probs = lambda logits_BV: sampling.row_probs(logits_BV, rows.temperature_B, rows.top_p_B,  # noqa: E731
                                                 rows.top_k_B)

    draft_caches = self.draft.cache.with_table(state.draft.caches, draft_table_TM)

    def draft_step(carry: tuple[jax.Array, Any], step: tuple[jax.Array, jax.Array]
                   ) -> tuple[tuple[jax.Array, Any], tuple[jax.Array, jax.Array]]:
      token_T, caches = carry
      index, keys = step
      logits_T1V, caches = self.draft.spec.apply_decode(draft_params, token_T[:, None],
                                                        (positions_T + index)[:, None], caches)
      q_TV = probs(logits_T1V[:, 0])
      proposal_T = draw(keys, q_TV)
      return (proposal_T, caches), (proposal_T, q_TV)

    steps = (jnp.arange(k + 1, dtype=jnp.int32), jnp.moveaxis(draw_keys_TX[:, :k + 1], 1, 0))
    draft_before = draft_caches
    (_, draft_caches), (proposals_KT, q_KTV) = jax.lax.scan(draft_step, (pending_T, draft_caches), steps)
    proposals_Tk = proposals_KT[:k].T  # the last step only wrote dk; its draw is unused
    q_TkV = jnp.moveaxis(q_KTV[:k], 0, 1)

    tokens_TK = jnp.concatenate([pending_T[:, None], proposals_Tk], axis=1)
    positions_TK = positions_T[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None]
    target_caches = self.target.cache.with_table(state.target.caches, target_table_TM)
    target_before = target_caches
    # The target verifies with each slot's LoRA adapter (its table row, lora_adapters.py); the draft has none.
    with lora_rows.use_rows(rows.adapter_B):
      logits_TKV, target_caches = self.target.spec.apply_decode(target_params, tokens_TK, positions_TK, target_caches)
    out_TK, num_accepted_T, last_T, logprobs = verify(logits_TKV, q_TkV, proposals_Tk, rows, draw_keys_TX, mask_TW)
    if self.replays[0]:
      with lora_rows.use_rows(rows.adapter_B):
        target_caches = roll_back_recurrent(self.target, target_params, tokens_TK, positions_TK, target_before,
                                            target_caches, num_accepted_T, k)
    if self.replays[1]:
      draft_caches = roll_back_recurrent(self.draft, draft_params, tokens_TK, positions_TK, draft_before, draft_caches,
                                         num_accepted_T, k)
    # A round steps every slot; paged, a slot without pages (free, or its prompt still being prefilled in chunks)
    # keeps its recurrent states as they were, as a plain generate step does.
    target_caches = self.target.cache.keep_inactive(target_caches, state.target.caches, target_table_TM)
    draft_caches = self.draft.cache.keep_inactive(draft_caches, state.draft.caches, draft_table_TM)
    next_positions_T = positions_T + num_accepted_T + 1
    target = DecodeState(target_caches, next_positions_T, last_T, dataclasses.replace(rows, keys_B=keys_T))
    draft = DecodeState(draft_caches, next_positions_T, last_T, state.draft.sampling)
    return SpeculativeState(target, draft), out_TK, num_accepted_T + 1, logprobs


def roll_back_recurrent(engine: Engine, params: Params, tokens_TK: jax.Array, positions_TK: jax.Array, before: Caches,
                        after: Caches, num_accepted_T: jax.Array, k: int) -> Caches:
  """`after` (the caches once the round's k + 1 tokens went in) with every recurrent state as if only each slot's
  first num_accepted + 1 tokens had: a replay of the tokens from the states in `before`, the rest padding.
  Only the recurrent states are taken from `before` (small); the KV caches replayed over are `after`'s."""
  is_state = lambda x: isinstance(x, LinearState)  # noqa: E731
  restored = jax.tree.map(lambda old, new: old if is_state(new) else new, before, after, is_leaf=is_state)

  def replay(caches: Caches) -> Caches:
    return engine.spec.apply_decode(params, tokens_TK, positions_TK, caches, logits_index_B=num_accepted_T)[1]

  return jax.lax.cond(jnp.all(num_accepted_T == k), lambda _: after, replay, restored)


def round_keys(keys_T: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """(the rows' next keys, key data [T, k + 3] for a round's draws): k + 1 draft draws (the last
  unused by a draft model), the acceptance uniforms and the final draw."""
  keys_T, round_keys_T = sampling.split_rows(keys_T)
  return keys_T, jax.vmap(lambda key: jax.random.key_data(
      jax.random.split(jax.random.wrap_key_data(key), k + 3)))(round_keys_T)


def verify(logits_TKV: jax.Array, q_TkV: jax.Array, proposals_Tk: jax.Array, rows: Any, draw_keys_TX: jax.Array,
           mask_TW: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array, TokenLogprobs]:
  """The rejection rule over the target's logits of [t0, d1..dk] and the draft's distributions
  q_1..q_k of its proposals d1..dk (each row by its own sampling parameters): (tokens [T, K]
  of which each row emits its first count = accepted + 1, the accepted counts [T], the last
  emitted token [T], their target log-probabilities).

  `mask_TW` (constrained decoding, sampling.apply_token_mask): the host's grammar state gives the
  allowed tokens of the round's first position only. A constrained row accepts no proposal and draws
  its one token from the masked p_0 itself (not the residual: no proposal was judged), so every
  token it emits is one its grammar allows; the drafts of a constrained row are never emitted.
  Unconstrained rows go on as without a mask."""
  num_slots, k, vocab = proposals_Tk.shape[0], proposals_Tk.shape[1], logits_TKV.shape[-1]
  scores_TKV = logits_TKV
  if mask_TW is not None:
    logits_TKV = logits_TKV.at[:, 0].set(sampling.apply_token_mask(logits_TKV[:, 0], mask_TW))
  repeat = lambda x: jnp.repeat(x, k + 1, axis=0)  # noqa: E731
  p_TKV = sampling.row_probs(logits_TKV.reshape(num_slots * (k + 1), vocab), repeat(rows.temperature_B),
                             repeat(rows.top_p_B), repeat(rows.top_k_B)).reshape(logits_TKV.shape)
  # Accept d_{i+1} when u < p_i(d) / q_i(d) (u * q < p: q(d) > 0, d was drawn from q).
  p_draft_Tk = jnp.take_along_axis(p_TKV[:, :k], proposals_Tk[..., None], axis=-1)[..., 0]
  q_draft_Tk = jnp.take_along_axis(q_TkV, proposals_Tk[..., None], axis=-1)[..., 0]
  uniform_Tk = jax.vmap(lambda key: jax.random.uniform(jax.random.wrap_key_data(key), (k,)))(
      draw_keys_TX[:, k + 1])
  accepted_Tk = uniform_Tk * q_draft_Tk < p_draft_Tk
  constrained_T = jnp.zeros((num_slots,), bool) if mask_TW is None else sampling.constrained_rows(mask_TW)
  accepted_Tk &= ~constrained_T[:, None]
  num_accepted_T = jnp.sum(jnp.cumprod(accepted_Tk.astype(jnp.int32), axis=1), axis=1)
  # The last token: from max(0, p_n - q_n), where q_k = 0 makes it the bonus draw from p_k.
  q_TKV = jnp.concatenate([q_TkV, jnp.zeros_like(p_TKV[:, :1])], axis=1)
  pick = lambda x_TKV: jnp.take_along_axis(x_TKV, num_accepted_T[:, None, None], axis=1)[:, 0]  # noqa: E731
  p_TV = pick(p_TKV)
  residual_TV = jnp.maximum(p_TV - pick(q_TKV), 0.0)
  # Rounding can leave no mass where p == q (a rejection then has probability 0): fall back to p.
  residual_TV = jnp.where(jnp.sum(residual_TV, axis=-1, keepdims=True) > 0, residual_TV, p_TV)
  residual_TV = jnp.where(constrained_T[:, None], p_TV, residual_TV)
  last_T = draw(draw_keys_TX[:, k + 2], residual_TV)
  slots_K = jnp.arange(k + 1)[None]
  out_TK = jnp.where(slots_K < num_accepted_T[:, None], jnp.pad(proposals_Tk, ((0, 0), (0, 1))), last_T[:, None])
  chosen, top_ids, top_logprobs = sampling.token_logprobs(scores_TKV.reshape(num_slots * (k + 1), vocab),
                                                          out_TK.reshape(-1))
  logprobs = TokenLogprobs(chosen.reshape(num_slots, k + 1), top_ids.reshape(num_slots, k + 1, -1),
                           top_logprobs.reshape(num_slots, k + 1, -1))
  return out_TK, num_accepted_T, last_T, logprobs


def draw(keys_T: jax.Array, probs_TV: jax.Array) -> jax.Array:
  """One token per row from its distribution (key data per row); a one-hot row gives its token."""
  each = jax.vmap(lambda key, logits: jax.random.categorical(jax.random.wrap_key_data(key), logits))
  return each(keys_T, jnp.log(probs_TV)).astype(jnp.int32)


def generate(decoder: SpeculativeDecoder, target_params: Params, draft_params: Params, prompts: Sequence[Sequence[int]],
             max_new_tokens: int, seed: int = 0, row_params: Sequence[sampling.RowParams] | None = None,
             eos_id: int | None = None) -> list[list[int]]:
  """Prompt i in slot i (at most num_slots prompts), decoded by speculative rounds until
  max_new_tokens, eos_id or max_target_length (prompt + output <= max_target_length + 1, as
  plain generation: the last token needs no cache entry). Returns each prompt's new tokens, the
  first from prefill."""
  if not 1 <= len(prompts) <= decoder.num_slots:
    raise UserError(f"{len(prompts)} prompts for {decoder.num_slots} slots: give 1 to {decoder.num_slots}")
  limit = decoder.target.cfg.max_target_length + 1
  budgets = [min(max_new_tokens, limit - len(prompt)) for prompt in prompts]
  state = decoder.init_decode_state(seed)
  prefixes = decoder.prefill(target_params, draft_params, prompts, seed, row_params)
  for row in range(len(prompts)):
    state = decoder.insert(prefixes, state, slot=row, row=row)
  outputs = [[int(token)] for token in np.asarray(prefixes[0].first_tokens_B)]
  active = np.zeros(decoder.num_slots, bool)
  for slot, output in enumerate(outputs):
    active[slot] = not _done(output, budgets[slot], eos_id)
    if not active[slot]:
      decoder.release(slot)
  while active.any():
    state, tokens, counts = decoder.step(target_params, draft_params, state, active)
    for slot in (int(s) for s in np.flatnonzero(active)):
      for token in tokens[slot, :counts[slot]]:
        outputs[slot].append(int(token))
        if _done(outputs[slot], budgets[slot], eos_id):
          active[slot] = False
          decoder.release(slot)
          break
  return outputs


def _done(output: list[int], budget: int, eos_id: int | None) -> bool:
  return len(output) >= budget or (eos_id is not None and output[-1] == eos_id)
