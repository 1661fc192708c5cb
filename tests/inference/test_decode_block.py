"""Several decode steps per call (decode_steps_per_call, inference/decode_block.py): the tokens and
log-probabilities of one step per call, with each slot stopped on the device at its end of sequence
or length, also when that falls inside a call."""

from __future__ import annotations

import threading
from typing import Any

import jax
import numpy as np
import pytest

from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from MaxText.inference.engine import Engine
from MaxText.inference.engine_api import StepLimits
from MaxText.inference.sampling import RowParams
from decode_test_utils import one_device_mesh

TINY = dict(base_emb_dim=32, base_num_query_heads=2, base_num_kv_heads=2, head_dim=16, base_mlp_dim=64,
            base_num_decoder_layers=1, vocab_size=64, max_target_length=32, max_prefill_predict_length=8,
            per_device_batch_size=1, print_config=False, dtype="float32")
PAGED = dict(kv_cache_layout="paged", kv_page_size=4)
PROMPTS = [[5, 9, 2], [7, 1, 3, 3, 8], [11, 4], [2, 2, 6, 1]]

_ENGINES: dict[tuple, Engine] = {}


def engine(k: int, slots: int, **keys) -> Engine:
  key = (k, slots, tuple(sorted(keys.items())))
  if key not in _ENGINES:  # compiled programs are kept with the engine
    _ENGINES[key] = Engine(Config.for_testing(**TINY, **keys, decode_steps_per_call=k), num_slots=slots,
                           mesh=one_device_mesh())
  return _ENGINES[key]


def admit(eng: Engine, params, state, slot: int, prompt: list[int], row: RowParams):
  """(state, first token, its log-probability): prefill + insert, or into pages chunk by chunk."""
  if eng.prefills_into_pages:
    start = eng.begin_prompt(slot, prompt)
    first = None
    while first is None:
      state, start, first = eng.prefill_chunk(params, state, slot, prompt, start, row)
    tokens, logprobs = jax.device_get(first)
    return state, int(tokens[0]), float(logprobs.chosen_B[0])
  prefix = eng.prefill(params, [prompt], row_params=[row])
  return eng.insert(prefix, state, slot), int(prefix.first_tokens_B[0]), float(prefix.first_logprobs.chosen_B[0])


def one_per_call(eng: Engine, prompts, max_new, stop=(), rows=None):
  """Today's decoding: one step per call, each slot's tokens cut on the host."""
  params = eng.load_params()
  rows = rows or [RowParams(seed=i) for i in range(len(prompts))]
  state = eng.init_decode_state()
  out, logps = [], []
  for slot, prompt in enumerate(prompts):
    state, token, logp = admit(eng, params, state, slot, prompt, rows[slot])
    out.append([token])
    logps.append([logp])
  done = [len(o) >= m or o[-1] in stop for o, m in zip(out, max_new)]
  while not all(done):
    state, emitted = eng.decode_step(params, state)
    emitted = jax.device_get(emitted)
    for slot in range(len(prompts)):
      if not done[slot]:
        out[slot].append(emitted.token(slot))
        logps[slot].append(emitted.scores(slot)[0])
        done[slot] = len(out[slot]) >= max_new[slot] or out[slot][-1] in stop
  return out, logps


def per_block(eng: Engine, prompts, max_new, stop=(), rows=None):
  """The same through calls of several steps with StepLimits; also the tokens per call and the state."""
  params = eng.load_params()
  rows = rows or [RowParams(seed=i) for i in range(len(prompts))]
  state = eng.init_decode_state()
  out, logps = [], []
  ends = np.zeros(eng.num_slots, np.int64)
  for slot, prompt in enumerate(prompts):
    state, token, logp = admit(eng, params, state, slot, prompt, rows[slot])
    out.append([token])
    logps.append([logp])
    ends[slot] = 0 if token in stop else len(prompt) + max_new[slot]
  calls = []
  while True:
    state, emitted = eng.decode_step(params, state, limits=StepLimits(ends, tuple(stop)))
    emitted = jax.device_get(emitted)
    counts = [emitted.count(slot) for slot in range(len(prompts))]
    if not any(counts):
      break
    calls.append(counts)
    for slot in range(len(prompts)):
      out[slot] += [emitted.token(slot, i) for i in range(counts[slot])]
      logps[slot] += [emitted.scores(slot, i)[0] for i in range(counts[slot])]
  return out, logps, calls, state


def check_same(reference, got):
  (ref_tokens, ref_logps), (tokens, logps) = reference, got
  assert tokens == ref_tokens
  for a, b in zip(ref_logps, logps):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", [{}, PAGED], ids=["dense", "paged"])
def test_lengths_inside_a_call_give_todays_tokens(layout):
  max_new = [6, 11, 1, 9]  # 6 and 11 - 1 end inside a call of 4 steps; 1: nothing to step
  reference = one_per_call(engine(1, 4, **layout), PROMPTS, max_new)
  tokens, logps, calls, state = per_block(engine(4, 4, **layout), PROMPTS, max_new)
  check_same(reference, (tokens, logps))
  assert [len(t) for t in tokens] == max_new
  assert calls[0] == [4, 4, 0, 4] and calls[1] == [1, 4, 0, 4] and calls[2] == [0, 2, 0, 0]
  # A slot that stopped did not move on: its next position is where its last token would be written.
  positions = np.asarray(state.next_positions_B)
  assert positions[:4].tolist() == [len(p) + m - 1 for p, m in zip(PROMPTS, max_new)]


def test_one_slot_matches():
  reference = one_per_call(engine(1, 1), PROMPTS[1:2], [20])
  tokens, logps, calls, _ = per_block(engine(4, 1), PROMPTS[1:2], [20])
  check_same(reference, (tokens, logps))
  assert calls == [[4]] * 4 + [[3]]


@pytest.mark.parametrize("layout", [{}, PAGED], ids=["dense", "paged"])
def test_an_end_of_sequence_token_inside_a_call_stops_its_slot(layout):
  max_new = [14, 14, 14, 14]
  free_run, _ = one_per_call(engine(1, 4, **layout), PROMPTS, max_new)
  # A stop token that slot 0 makes as its 3rd new token (inside the first call of 4 steps).
  stop = free_run[0][2]
  reference = one_per_call(engine(1, 4, **layout), PROMPTS, max_new, stop=(stop,))
  tokens, logps, calls, state = per_block(engine(4, 4, **layout), PROMPTS, max_new, stop=(stop,))
  check_same(reference, (tokens, logps))
  cut = free_run[0].index(stop)
  assert tokens[0] == free_run[0][:cut + 1]
  assert sum(call[0] for call in calls) == cut
  assert int(np.asarray(state.next_positions_B)[0]) == len(PROMPTS[0]) + cut


def test_sampled_rows_draw_the_same_tokens():
  rows = [RowParams(temperature=0.9, top_p=0.9, seed=3), RowParams(temperature=1.3, top_k=5, seed=4)]
  reference = one_per_call(engine(1, 2), PROMPTS[:2], [9, 7], rows=rows)
  tokens, logps, _, _ = per_block(engine(4, 2), PROMPTS[:2], [9, 7], rows=rows)
  check_same(reference, (tokens, logps))


@pytest.mark.parametrize("keys", [dict(PAGED, prefix_caching=True), dict(PAGED, prefill_chunk_size=3)],
                         ids=["prefix_cached", "chunked"])
def test_pages_filled_chunk_by_chunk(keys):
  prompts = [[5, 9, 2, 7, 1, 3], [5, 9, 2, 7, 8], [5, 9, 2, 7, 1, 3, 4]]  # a shared first page
  max_new = [10, 7, 9]
  stop = one_per_call(engine(1, 3, **keys), prompts, max_new)[0][1][4]
  reference = one_per_call(engine(1, 3, **keys), prompts, max_new, stop=(stop,))
  tokens, logps, _, _ = per_block(engine(4, 3, **keys), prompts, max_new, stop=(stop,))
  check_same(reference, (tokens, logps))


def test_without_limits_every_slot_steps_k_times():
  eng = engine(3, 2)
  params = eng.load_params()
  state = eng.init_decode_state()
  for slot, prompt in enumerate(PROMPTS[:2]):
    state, _, _ = admit(eng, params, state, slot, prompt, RowParams(seed=slot))
  state, emitted = eng.decode_step(params, state)
  assert np.asarray(emitted.tokens).shape == (2, 3) and np.asarray(emitted.counts).tolist() == [3, 3]


def test_a_call_without_limits_takes_no_host_array() -> None:
  """Without limits (rollouts, decode.py) where each slot ends and what stops it never change: those arrays
  stay on the device (a host array is copied to it in every call), with the tokens of the same limits given."""
  eng = engine(3, 2)
  params = eng.load_params()
  block, kinds = eng._block, []

  def recording(*args: Any, **kwargs: Any) -> Any:
    kinds.append({type(leaf).__name__ for leaf in jax.tree_util.tree_leaves(args[2:])})  # past params, state
    return block(*args, **kwargs)

  runs = []
  setattr(eng, "_block", recording)
  try:
    for limits in (None, StepLimits(np.full(2, eng.cfg.max_target_length + 1, np.int64), ())):
      state = eng.init_decode_state()
      for slot, prompt in enumerate(PROMPTS[:2]):
        state, _, _ = admit(eng, params, state, slot, prompt, RowParams(seed=slot))
      tokens = []
      for _ in range(4):
        state, emitted = eng.decode_step(params, state, limits=limits)
        tokens.append(np.asarray(emitted.tokens).tolist())
      runs.append(tokens)
  finally:
    setattr(eng, "_block", block)
  assert runs[0] == runs[1]
  assert kinds[:4] == [{"ArrayImpl"}] * 4 and kinds[4] == {"ndarray"}, kinds


def test_steps_per_call_is_checked():
  with pytest.raises(ConfigError, match="decode_steps_per_call must be >= 1"):
    Config.for_testing(**TINY, decode_steps_per_call=0)
  with pytest.raises(ConfigError, match="decode_steps_per_call=2 does not combine with speculative_tokens=2"):
    Config.for_testing(**TINY, decode_steps_per_call=2, speculative_tokens=2)
  # A huge value sized [slots, k] token buffers before any check: the process was killed for memory.
  with pytest.raises(ConfigError, match=r"decode_steps_per_call=1000000000 is more than max_target_length=\d+"):
    Config.for_testing(**TINY, decode_steps_per_call=10**9)
  with pytest.raises(ConfigError, match=r"speculative_tokens=1000000000 is more than max_target_length=\d+"):
    Config.for_testing(**TINY, speculative_tokens=10**9)


def scheduled(eng: Engine, prompts, max_new, stop=()):
  """Each job's (tokens, log-probabilities, end) through the server's scheduler, more jobs than slots."""
  from MaxText.inference import scheduler as sched

  events: dict[int, list] = {i: [] for i in range(len(prompts))}
  done = threading.Semaphore(0)

  def sink(i):
    def emit(event):
      events[i].append(event)
      if isinstance(event, sched.Done):
        done.release()
    return emit

  s = sched.Scheduler(eng, eng.load_params(), max_queue=16, eos_ids=stop).start()
  try:
    s.submit([sched.Job(0, p, m, RowParams(seed=i), sink(i)) for i, (p, m) in enumerate(zip(prompts, max_new))])
    for _ in prompts:
      assert done.acquire(timeout=120)
  finally:
    s.stop()
  return [([t for e in ev if isinstance(e, sched.Tokens) for t in e.tokens],
           [lp for e in ev if isinstance(e, sched.Tokens) for lp in e.logprobs],
           ev[-1].reason) for ev in events.values()]


@pytest.mark.parametrize("layout", [{}, pytest.param(PAGED, marks=pytest.mark.slow)], ids=["dense", "paged"])
def test_the_scheduler_serves_todays_tokens(layout):
  prompts = PROMPTS + [[9, 9, 1], [3, 14, 15, 9, 2, 6]]
  max_new = [6, 13, 1, 9, 10, 7]
  stop = one_per_call(engine(1, 6, **layout), prompts, max_new)[0][3][3]  # made by job 3 inside its first call
  reference = one_per_call(engine(1, 6, **layout), prompts, max_new, stop=(stop,))
  got = scheduled(engine(4, 3, **layout), prompts, max_new, stop=(stop,))
  check_same(reference, ([t for t, _, _ in got], [lp for _, lp, _ in got]))
  reasons = [r for _, _, r in got]
  assert reasons == ["stop" if t[-1] == stop else "length" for t in reference[0]] and "stop" in reasons


@pytest.mark.parametrize("keys", [{}, PAGED, dict(PAGED, prefix_caching=True), dict(PAGED, prefill_chunk_size=3)],
                         ids=["dense", "paged", "prefix_cached", "chunked"])
def test_the_scheduler_dispatches_the_next_call_before_reading_a_prefills_first_tokens(keys, monkeypatch):
  """The first tokens of the prompts a loop prefills are read once that loop's decode call is dispatched (was:
  right after the prefill, the device idle while the host read them and dispatched the call), on every admission
  path (one prefill_insert, prefix-cached rests, prefill chunks); each job's tokens are still today's, with a
  one-token job and a stop inside a call."""
  from MaxText.inference import scheduler as sched

  prompts = [[5, 9, 2, 7, 1, 3], [5, 9, 2, 7, 8], [11, 4], [5, 9, 2, 7, 1, 3, 4], [2, 2, 6, 1]]
  max_new = [10, 1, 9, 7, 8]
  stop = one_per_call(engine(1, 5, **keys), prompts, max_new)[0][2][3]
  reference = one_per_call(engine(1, 5, **keys), prompts, max_new, stop=(stop,))
  eng, log = engine(4, 3, **keys), []

  def logged(what: str, fn: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
      log.append(what)
      return fn(*args, **kwargs)
    return call

  for name in ("prefill_insert", "prefill_rests", "prefill_chunks", "prefill_chunk", "prefill"):
    monkeypatch.setattr(eng, name, logged("prefill", getattr(eng, name)))
  monkeypatch.setattr(eng, "decode_step", logged("call", eng.decode_step))
  monkeypatch.setattr(sched, "_host", logged("read", sched._host))
  device_get = jax.device_get

  def read(*args: Any, **kwargs: Any) -> Any:
    import sys
    if sys._getframe(1).f_globals["__name__"] == sched.__name__:  # the scheduler's reads, not the engine's own
      log.append("read")
    return device_get(*args, **kwargs)

  monkeypatch.setattr(sched.jax, "device_get", read)
  got = scheduled(eng, prompts, max_new, stop=(stop,))
  check_same(reference, ([t for t, _, _ in got], [lp for _, lp, _ in got]))
  assert [r for _, _, r in got] == ["stop" if t[-1] == stop else "length" for t in reference[0]]
  assert "stop" in [r for _, _, r in got]
  pairs = list(zip(log, log[1:]))
  assert ("prefill", "call") in pairs and ("prefill", "read") not in pairs, log
