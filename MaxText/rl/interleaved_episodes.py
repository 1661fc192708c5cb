"""Multi-turn episodes interleaved in the engine (rl_interleave_episodes): each episode holds one slot
for its whole life; when its model turn ends, its environment's `step` runs on a thread of its own
while the other slots keep decoding, and when the answer comes the appended tokens (the tool's
message, the next generation prompt) go into that slot and it decodes again.

    all episodes' prompts ─► one prefill_insert of every slot ┐
      ┌─► decode steps of every slot still in its turn ◄──────┘◄── the slot continues: only the new tokens
      │     a slot's turn ends (its end token or budget) ─► hold the slot; step() on a thread   prefilled
      └── an environment answered ─► advance the episode (episodes.advance) ─► ended: release the slot

- **Only the new tokens are prefilled** where the engine `continues_slots` (the paged layout): the slot
  keeps its pages while held and `continue_prompt` + `prefill_chunk` write the appended tokens after
  the ones it holds. Elsewhere (the dense cache) the slot's whole context is prefilled again, with
  those of every other slot answered at the same time, in the program the first turn runs.
- **Timing does not change the result.** A slot's tokens depend on its own context and seeds only:
  each turn's first token is drawn with the row's seed for that turn (`row_params(turn)`, as the
  turn-batched path draws it), the decode step treats every slot apart, and every prefill is a
  program of fixed shape (a continuation alone; whole contexts padded to every slot), whose rows
  do not change each other's numbers. So a resumed run samples as the uninterrupted one, and greedy episodes equal the
  turn-batched path's (episodes.run) token for token. With several processes (each runs every
  episode), a slot takes its answer once it came on every process, so all make the same calls.
- The episode records, limits and token layout are episodes.py's: the rows weigh only sampled tokens.
"""

from __future__ import annotations

import queue
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from MaxText.inference import engine_api, sampling
from MaxText.inference.engine_api import DecodeEngine, StepLimits
from MaxText.platform import sharding
from MaxText.input_pipeline import chat
from MaxText.rl import environments
from MaxText.rl.episodes import Episode, Limits, Renderer, Timing, advance, open_episodes, record_turn, turn_budget


class _Slots:
  """The host side of one rollout: which slot decodes which episode's turn, and what it sampled."""

  def __init__(self, engine: DecodeEngine, params: Any, eos_id: int | None, timing: Timing):
    self.engine, self.params, self.eos_id, self.timing = engine, params, eos_id, timing
    self.tokens: dict[int, list[int]] = {}  # slot -> the current turn's sampled tokens
    self.logps: dict[int, list[float]] = {}
    self.ends = np.zeros(engine.num_slots, np.int64)  # StepLimits.ends: 0 for a slot not in a turn
    self.budgets: dict[int, int] = {}

  def start_turn(self, slot: int, context_length: int, budget: int, token: int, logp: float) -> None:
    self.tokens[slot], self.logps[slot], self.budgets[slot] = [token], [logp], budget
    self.ends[slot] = context_length + budget

  def turn_over(self, slot: int) -> bool:
    out = self.tokens[slot]
    return len(out) >= self.budgets[slot] or out[-1] == self.eos_id

  def end_turn(self, slot: int) -> tuple[list[int], list[float]]:
    self.ends[slot] = 0
    del self.budgets[slot]
    return self.tokens.pop(slot), self.logps.pop(slot)

  def step(self, state: Any) -> tuple[Any, list[int]]:
    """One decode call for every slot in its turn; the slots whose turn it ended."""
    state, emitted = self.engine.decode_step(self.params, state, limits=StepLimits(self.ends.copy(),
                                                                                    _stops(self.eos_id)))
    tokens, chosen = sharding.on_host(emitted.tokens), sharding.on_host(emitted.logprobs.chosen_B)
    counts = None if emitted.counts is None else sharding.on_host(emitted.counts)
    ended = []
    for slot in sorted(self.tokens):
      for i in range(1 if counts is None else int(counts[slot])):
        if self.turn_over(slot):
          break
        self.tokens[slot].append(int(tokens[slot] if counts is None else tokens[slot, i]))
        self.logps[slot].append(float(chosen[slot] if counts is None else chosen[slot, i]))
      if self.turn_over(slot):
        ended.append(slot)
    return state, ended


GRACE_S = 2e-3  # how long the calls a decode step started get to answer in the same pass


def _grace(started: list[environments.PendingStep]) -> None:
  """Waits up to GRACE_S for the calls just started: environments that answer at once (a calculator)
  then continue together, one prefill for them all on the dense cache. Only timing: no result moves."""
  until = time.monotonic() + GRACE_S
  for call in started:
    call.call.thread.join(max(0.0, until - time.monotonic()))


def _agreed(num_slots: int, ready: list[int]) -> list[int]:
  """The slots whose environment answered (or ran past its time: result() raises), in order; with
  several processes, those that answered on every one, so all issue the same engine calls in the
  same order whatever their threads' timing."""
  if jax.process_count() == 1:
    return sorted(ready)
  mask = np.zeros(num_slots, bool)
  mask[ready] = True
  return [int(s) for s in np.flatnonzero(np.asarray(multihost_utils.process_allgather(mask)).reshape(-1, num_slots)
                                        .all(axis=0))]


def _stops(eos_id: int | None) -> tuple[int, ...]:
  return () if eos_id is None else (eos_id,)


def run(env: environments.Guarded, tokenizer: chat.ChatTokenizer, eos_id: int | None,
        records: Sequence[tuple[int, Any, Mapping[str, Any]]], engine: DecodeEngine, params: Any,
        row_params: Callable[[int], list[sampling.RowParams]], limits: Limits,
        timing: Timing | None = None) -> list[Episode]:
  """episodes.run's episodes (one per record, `row_params(turn)` every record's sampler for that turn),
  each in slot i of `engine` (which has a slot for every record), interleaved."""
  timing = timing or Timing()
  renderer = Renderer(tokenizer, eos_id)
  objects, episodes = open_episodes(env, renderer, records, limits, timing)
  if len(episodes) > engine.num_slots:
    raise ValueError(f"{len(episodes)} episodes for {engine.num_slots} slots")
  seeds: dict[int, list[sampling.RowParams]] = {}

  def params_of(turn: int) -> list[sampling.RowParams]:
    if turn not in seeds:
      seeds[turn] = row_params(turn)
    return seeds[turn]

  started, opened = time.perf_counter(), timing.environment_s
  slots = _Slots(engine, params, eos_id, timing)
  finished: queue.SimpleQueue[int] = queue.SimpleQueue()  # told when an environment call returns
  waiting: dict[int, environments.PendingStep] = {}
  turns: dict[int, environments.ModelTurn] = {}

  def end_turn(slot: int) -> None:
    out, logps = slots.end_turn(slot)
    turns[slot] = record_turn(episodes[slot], out, logps, tokenizer, eos_id)
    if engine.continues_slots:
      engine.hold(slot)
    waiting[slot] = env.step_later(objects[slot], turns[slot], episodes[slot].index, finished, slot)

  # The first turn: every prompt in one prefill (the turn-batched path's program).
  first = params_of(0)
  state = engine.init_decode_state(first[0].seed if first else 0)
  state = _prefill_slots(engine, params, state, slots, episodes, list(range(len(episodes))), first, limits)
  for slot in range(len(episodes)):
    if slots.turn_over(slot):
      end_turn(slot)
  while slots.tokens or waiting:
    if slots.tokens:
      running = any(not w.ready() for w in waiting.values())
      state, ended = slots.step(state)
      timing.decode_steps += 1
      timing.overlapped_steps += int(running)
      for slot in ended:
        end_turn(slot)
      _grace([waiting[slot] for slot in ended])
    else:  # nothing to decode: sleep until an environment call returns (or the first one's time runs out)
      blocked = time.perf_counter()
      if any(w.ready() for w in waiting.values()):  # answered here, not yet on another process
        time.sleep(1e-3)
      else:
        try:
          finished.get(timeout=max(0.0, min(w.deadline for w in waiting.values()) - time.monotonic()))
        except queue.Empty:
          pass
      timing.environment_s += time.perf_counter() - blocked
    # The queue only wakes the loop: which calls are done is read from the calls themselves.
    answered = _agreed(engine.num_slots, [slot for slot, w in waiting.items() if w.ready()])
    again = []  # the dense cache: slots whose grown context is prefilled whole, together
    for slot in answered:
      episode = episodes[slot]
      advance(episode, turns.pop(slot), waiting.pop(slot).result(), renderer, limits, env.name)
      if episode.end:
        engine.release(slot)
      elif engine.continues_slots:
        state = _continue(engine, params, state, slots, episode, slot, params_of(episode.turns)[slot], limits)
      else:
        again.append(slot)
    if again:
      turn_params = [params_of(episodes[slot].turns)[slot] for slot in again]
      state = _prefill_slots(engine, params, state, slots, episodes, again, turn_params, limits)
    for slot in answered:
      if slot in slots.tokens and slots.turn_over(slot):
        end_turn(slot)
  timing.generate_s += time.perf_counter() - started - (timing.environment_s - opened)
  return episodes


def _prefill_slots(engine: DecodeEngine, params: Any, state: Any, slots: _Slots, episodes: list[Episode],
                   chosen_slots: list[int], row_params: list[sampling.RowParams], limits: Limits) -> Any:
  """The episodes of `chosen_slots` (each with its row's sampler for its turn) prefilled whole, in one
  program of every slot's rows whichever they are (copies of the first pad it): a row's numbers do
  not depend on which others share the call. Put into their slots in the same call where the engine
  can (engine_api.prefill_into_slots), each starting its turn."""
  contexts = [episodes[slot].prompt_ids + episodes[slot].tokens for slot in chosen_slots]
  pad = engine.num_slots - len(contexts)
  state, prefix = engine_api.prefill_into_slots(engine, params, state, contexts + [contexts[0]] * pad, chosen_slots,
                                                row_params + [row_params[0]] * pad)
  tokens, chosen = sharding.on_host(prefix.first_tokens_B), sharding.on_host(prefix.first_logprobs.chosen_B)
  for row, (slot, context) in enumerate(zip(chosen_slots, contexts)):
    slots.start_turn(slot, len(context), turn_budget(episodes[slot], limits), int(tokens[row]), float(chosen[row]))
  return state


def _continue(engine: DecodeEngine, params: Any, state: Any, slots: _Slots, episode: Episode, slot: int,
              row: sampling.RowParams, limits: Limits) -> Any:
  """The held slot grown by what the episode appended after its tokens: only those prefilled, after
  the pages it holds; it starts its next turn."""
  context = episode.prompt_ids + episode.tokens
  start = engine.continue_prompt(slot, context)
  first = None
  while first is None:
    state, start, first = engine.prefill_chunk(params, state, slot, context, start, row_params=row)
  token, logprobs = first
  slots.start_turn(slot, len(context), turn_budget(episode, limits), int(sharding.on_host(token)[0]),
                   float(sharding.on_host(logprobs.chosen_B)[0]))
  return state


__all__ = ["run"]
