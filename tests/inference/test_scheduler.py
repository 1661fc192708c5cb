"""The server's scheduler over a stand-in engine (the real page allocator, no model): however a job
ends its KV page reservation comes back, a scoring-only job reserves nothing, a job larger than
the pool is refused up front, a blocked or idle scheduler thread sleeps instead of spinning, and
cancelling a waiting job wakes it."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from MaxText.inference import paged_cache, scheduler as sched
from MaxText.inference.engine_api import Emitted, TokenLogprobs
from MaxText.inference.paged_cache import PageAllocator
from MaxText.inference.sampling import RowParams

PAGE, MAX_LENGTH, EOS = 4, 48, 63
ENDLESS = 10**6  # max_tokens of a job that runs until cancelled (its pages are capped at MAX_LENGTH)


class FakeEngine:
  """What the scheduler calls on an Engine: token t is followed by t + 1 (so a prompt ending in
  EOS - 2 meets EOS at the first step; one ending at 100 or more never does)."""

  def __init__(self, num_slots: int = 3, num_pages: int = 12, max_length: int = MAX_LENGTH):
    self.num_slots, self.num_pages, self.max_length = num_slots, num_pages, max_length
    self.prefills_into_pages = False
    self.fail_prefill = self.fail_step = False
    self.init_decode_state()

  def init_decode_state(self, seed: int = 0) -> np.ndarray:
    self.pages = PageAllocator(self.num_pages, PAGE, self.num_slots, self.max_length)
    self.last = np.zeros(self.num_slots, np.int64)
    return self.last

  def pages_needed(self, num_tokens: int) -> int:
    return self.pages.pages_for(num_tokens)

  def cache_stats(self) -> dict[str, int]:
    return self.pages.stats()

  def admission_pages(self, reserved, prompt, need: int, text_only: bool) -> int:
    return paged_cache.admission_pages(self.pages, reserved, prompt, need, text_only)

  @staticmethod
  def _logprobs(n: int) -> TokenLogprobs:
    return TokenLogprobs(np.full(n, -1.0, np.float32), np.zeros((n, 2), np.int32), np.zeros((n, 2), np.float32))

  def prefill(self, params, prompts, row_params=None):
    if self.fail_prefill:
      raise RuntimeError("prefill failed on purpose")
    return SimpleNamespace(first_tokens_B=np.asarray([p[-1] + 1 for p in prompts]),
                           first_logprobs=self._logprobs(len(prompts)), lengths=[len(p) for p in prompts])

  def insert(self, prefix, state, slot, row=0):
    self.pages.assign(slot, prefix.lengths[row])
    self.last[slot] = prefix.first_tokens_B[row]
    return state

  speculative_tokens = prefill_chunk_size = 0

  def decode_step(self, params, state, active=None, limits=None):
    if limits is None:
      state, (tokens, logprobs) = self.step(params, state)
      return state, Emitted(tokens, logprobs)
    # As the engine does: a slot past its end (or after an end-of-sequence token) neither steps nor takes a page.
    live = (self.pages.positions + 1 < limits.ends) & ~np.isin(self.last, limits.stop_ids)
    state, (tokens, logprobs) = self.step(params, state, np.where(live, limits.ends, 0))
    logprobs = TokenLogprobs(logprobs.chosen_B[:, None], logprobs.top_ids_Bk[:, None], logprobs.top_logprobs_Bk[:, None])
    return state, Emitted(tokens[:, None], logprobs, live.astype(np.int32))

  def step(self, params, state, ends=None):
    if self.fail_step:
      raise RuntimeError("step failed on purpose")
    self.pages.grow(1, ends)
    self.pages.advance(1 if ends is None else (ends > 0).astype(np.int64))
    self.last = self.last + (1 if ends is None else (ends > 0))
    return state, (self.last.copy(), self._logprobs(self.num_slots))

  def release(self, slot: int) -> None:
    self.pages.release(slot)

  def score(self, params, prompt):
    return self._logprobs(len(prompt))


class Sink:
  """A job's events, and a way to wait for its end."""

  def __init__(self):
    self.events: list[sched.Event] = []
    self.done = threading.Event()

  def __call__(self, event: sched.Event) -> None:
    self.events.append(event)
    if isinstance(event, sched.Done):
      self.done.set()

  def tokens(self) -> list[int]:
    return [t for e in self.events if isinstance(e, sched.Tokens) for t in e.tokens]

  def tops(self) -> list[list[tuple[int, float]]]:
    return [top for e in self.events if isinstance(e, sched.Tokens) for top in e.tops]

  def reason(self, timeout: float = 10.0) -> str:
    assert self.done.wait(timeout), f"the job did not end within {timeout} s: {self.events[-3:]}"
    return self.events[-1].reason


def job(prompt_len: int, max_tokens: int, score: bool = False, first: int = 1) -> tuple[sched.Job, Sink]:
  sink = Sink()
  return sched.Job(0, [first] * prompt_len, max_tokens, RowParams(), sink, score_prompt=score), sink


@pytest.fixture
def engine():
  return FakeEngine()


@pytest.fixture
def scheduler(engine):
  s = sched.Scheduler(engine, None, max_queue=16, eos_ids=[EOS]).start()
  yield s
  s.stop(5)


def _settled(scheduler: sched.Scheduler, timeout: float = 5.0) -> dict:
  deadline = time.monotonic() + timeout
  while (load := scheduler.load())["active"] or load["waiting"]:
    assert time.monotonic() < deadline, load
    time.sleep(0.01)
  return load


def _assert_nothing_held(scheduler: sched.Scheduler, engine: FakeEngine) -> None:
  load = _settled(scheduler)
  assert load["pages_reserved"] == 0, load
  assert load["pages_free"] == engine.num_pages, load


def _thread_cpu_seconds(scheduler: sched.Scheduler) -> float:
  return time.clock_gettime(time.pthread_getcpuclockid(scheduler._thread.ident))


def test_a_scoring_job_beside_a_generating_one_leaves_room_for_a_job_the_size_of_the_pool(scheduler, engine):
  """The leak: a scoring-only job admitted into a free slot kept that slot's reservation for ever,
  so a later job needing most of the pool never fitted (and the thread spun)."""
  generating, generating_sink = job(4, 6)
  scoring, scoring_sink = job(30, 0, score=True)  # its pages would be 30 tokens' worth
  scheduler.submit([generating, scoring])  # one submit: both admitted in the same pass, into slots 0 and 1
  assert scoring_sink.reason() == "length" and isinstance(scoring_sink.events[0], sched.PromptScores)
  assert generating_sink.reason() == "length"
  _assert_nothing_held(scheduler, engine)
  whole_pool, sink = job(8, MAX_LENGTH - 8 + 1)  # 48 cached tokens: all 12 pages
  scheduler.submit([whole_pool])
  assert sink.reason() == "length"
  _assert_nothing_held(scheduler, engine)


@pytest.mark.parametrize("ending", ["length", "eos", "cancel-active", "cancel-waiting", "prefill-error",
                                    "step-error", "scoring"])
def test_every_ending_gives_back_exactly_what_was_reserved(scheduler, engine, ending):
  blocker, blocker_sink = job(8, ENDLESS, first=100)  # holds the whole pool until cancelled
  scheduler.submit([blocker])
  deadline = time.monotonic() + 5
  while scheduler.load()["pages_reserved"] != engine.num_pages:
    assert time.monotonic() < deadline, scheduler.load()
    time.sleep(0.01)
  if ending == "cancel-waiting":
    waiting, sink = job(4, 4)
    scheduler.submit([waiting])
    assert scheduler.load()["waiting"] == 1
    waiting.cancel()
    assert sink.reason(2.0) == "cancelled"  # dropped while the first job still holds the pool
    assert scheduler.load()["waiting"] == 0 and not blocker_sink.done.is_set()
    blocker.cancel()
  elif ending == "step-error":
    engine.fail_step = True
    assert blocker_sink.reason() == "error"
  else:
    blocker.cancel()
    assert blocker_sink.reason() == "cancelled"
    if ending != "cancel-active":
      _assert_nothing_held(scheduler, engine)
      engine.fail_prefill = ending == "prefill-error"
      follower, sink = job(4, 0 if ending == "scoring" else 10, score=ending == "scoring",
                           first=EOS - 2 if ending == "eos" else 1)
      scheduler.submit([follower])
      expected = {"length": "length", "eos": "stop", "prefill-error": "error", "scoring": "length"}[ending]
      assert sink.reason() == expected, sink.events[-1]
  _assert_nothing_held(scheduler, engine)
  engine.fail_prefill = engine.fail_step = False
  after, sink = job(8, 41)  # 48 tokens: the whole pool is admissible again
  scheduler.submit([after])
  assert sink.reason() == "length"
  _assert_nothing_held(scheduler, engine)


def test_a_job_larger_than_the_pool_is_refused_up_front():
  engine = FakeEngine(num_pages=8)  # 32 tokens' worth; a request may reach MAX_LENGTH = 48
  s = sched.Scheduler(engine, None, max_queue=4).start()
  try:
    big, _ = job(10, 30)
    with pytest.raises(sched.TooLarge, match="need 10 KV pages .* kv_num_pages=8; lower max_tokens"):
      s.submit([big])
    assert s.load()["waiting"] == 0
    fits, sink = job(10, 23)
    s.submit([fits])
    assert sink.reason() == "length"
  finally:
    s.stop(5)


def test_a_blocked_scheduler_sleeps_and_a_cancel_wakes_it(scheduler, engine):
  """Nothing to step and a head job that does not fit: the thread waits on its condition (no CPU)
  and a cancel of that job wakes it to drop the job at once."""
  with scheduler._wake:
    scheduler._reserved[0] = engine.num_pages  # pages held by a job that never gives them back
  stuck, sink = job(4, 4)
  scheduler.submit([stuck])
  time.sleep(0.2)
  loops, cpu = scheduler.counts["loops"], _thread_cpu_seconds(scheduler)
  time.sleep(1.0)
  assert scheduler.counts["loops"] == loops and _thread_cpu_seconds(scheduler) - cpu < 0.05
  assert scheduler.load()["waiting"] == 1 and scheduler.load()["oldest_age_s"] >= 1.0
  stuck.cancel()
  assert sink.reason(1.0) == "cancelled"
  assert scheduler.load()["waiting"] == 0 and scheduler.load()["oldest_age_s"] == 0


def test_an_idle_scheduler_sleeps(scheduler):
  one, sink = job(4, 3)
  scheduler.submit([one])
  assert sink.reason() == "length"
  loops, cpu = scheduler.counts["loops"], _thread_cpu_seconds(scheduler)
  time.sleep(0.5)
  assert scheduler.counts["loops"] == loops and _thread_cpu_seconds(scheduler) - cpu < 0.05


def test_a_slot_whose_job_the_calls_in_flight_end_takes_the_next_job_in_the_next_call():
  """Driven a call ahead, a job's max_tokens is reached in a call dispatched before the previous call is read: its
  slot goes to the next waiting job at once instead of stepping for nothing in one more call. Each job still gets
  its tokens and its end (an end-of-sequence token, a cancel on a token of the last calls) as before."""
  engine = FakeEngine(num_slots=1)
  s = sched.Scheduler(engine, None, max_queue=8, eos_ids=[EOS])
  plain, plain_sink = job(4, 4)
  eos, eos_sink = job(4, 3, first=EOS - 2)  # EOS at its second token, inside the calls that end it
  cancelled, cancelled_sink = job(4, 3, first=10)

  def cancel_on_second_token(event: sched.Event) -> None:
    cancelled_sink(event)
    if len(cancelled_sink.tokens()) == 2:
      cancelled.cancel()  # as a handler does on a stop string

  cancelled.emit = cancel_on_second_token
  last, last_sink = job(4, 4, first=20)
  s.submit([plain, eos, cancelled, last])
  s.start()
  try:
    assert [plain_sink.reason(), eos_sink.reason(), cancelled_sink.reason(), last_sink.reason()] == [
        "length", "stop", "cancelled", "length"]
    tokens = [sink.tokens() for sink in (plain_sink, eos_sink, cancelled_sink, last_sink)]
    assert tokens == [[2, 3, 4, 5], [EOS - 1, EOS], [11, 12], [21, 22, 23, 24]]
    # One token per call: a job of n tokens takes n - 1 calls after its prefill (before: one more each, but for a
    # job ended by a token read after its last call was dispatched).
    assert s.load()["steps"] == 3 + 2 + 2 + 3
    _assert_nothing_held(s, engine)
    assert s.load()["released"] == 4
  finally:
    s.stop(5)



class _BlockEngine(FakeEngine):
  """FakeEngine whose call with StepLimits takes K steps, each slot stopping at its end or an end-of-sequence
  token as the engine's device loop does (engine_api.Emitted with counts)."""

  K = 4

  def decode_step(self, params, state, active=None, limits=None):
    if limits is None:
      return super().decode_step(params, state, active, limits)
    calls = [super(_BlockEngine, self).decode_step(params, state, active, limits)[1] for _ in range(self.K)]
    lps = [c.logprobs for c in calls]
    return self.last, Emitted(np.concatenate([c.tokens for c in calls], axis=1),
                              TokenLogprobs(*(np.concatenate([getattr(lp, name) for lp in lps], axis=1)
                                              for name in ("chosen_B", "top_ids_Bk", "top_logprobs_Bk"))),
                              sum(c.counts for c in calls))


def test_a_call_of_several_steps_gives_each_job_one_event_of_its_tokens():
  """A call of K steps gives each job its tokens as one Tokens event (was: an event per token), cut after an
  end-of-sequence token inside the call; the first token (the prefill's) is an event of its own."""
  engine = _BlockEngine(num_slots=2)
  s = sched.Scheduler(engine, None, max_queue=8, eos_ids=[EOS]).start()
  try:
    long, long_sink = job(4, 9, first=10)
    eos, eos_sink = job(4, 5, first=EOS - 3)
    s.submit([long, eos])
    assert [long_sink.reason(), eos_sink.reason()] == ["length", "stop"]
    runs = [[e.tokens for e in sink.events if isinstance(e, sched.Tokens)] for sink in (long_sink, eos_sink)]
    assert runs == [[[11], [12, 13, 14, 15], [16, 17, 18, 19]], [[EOS - 2], [EOS - 1, EOS]]]
    assert [len(e.logprobs) for e in long_sink.events[:-1]] == [1, 4, 4]
    assert [e.tops for e in long_sink.events[:-1]] == [[[(0, 0.0)] * 2], [[(0, 0.0)] * 2] * 4, [[(0, 0.0)] * 2] * 4]
    _assert_nothing_held(s, engine)
  finally:
    s.stop(5)


def test_a_calls_tokens_and_a_prefills_first_tokens_are_read_without_jax_device_get(monkeypatch: pytest.MonkeyPatch):
  """The reads of every loop (a call's tokens, a prefill's first tokens) copy their arrays themselves (was:
  jax.device_get, whose per-leaf tree and context handling cost about as much as the copies on the CPU backend);
  the tokens are the same."""
  def refuse(*args, **kwargs):
    raise AssertionError("jax.device_get on the scheduler's hot path")

  monkeypatch.setattr(sched.jax, "device_get", refuse)
  engine = _BlockEngine(num_slots=2)
  s = sched.Scheduler(engine, None, max_queue=8, eos_ids=[EOS]).start()
  try:
    jobs = [job(4, 6, first=10), job(3, 5, first=30)]
    s.submit([j for j, _ in jobs])
    assert [sink.reason() for _, sink in jobs] == ["length", "length"]
    assert [sink.tokens() for _, sink in jobs] == [[11, 12, 13, 14, 15, 16], [31, 32, 33, 34, 35]]
  finally:
    s.stop(5)


@pytest.mark.parametrize("engine_type", [FakeEngine, _BlockEngine], ids=["one-step", "four-steps"])
def test_a_job_ended_by_its_first_token_read_after_the_next_call_frees_its_slot(engine_type):
  """A prefill's first tokens are read after the next call is dispatched: a job whose first token is an
  end-of-sequence token, or whose max_tokens is 1, still gets exactly that token and its end, and the job after it
  in the same slot its own tokens (the call that held the ended job's slot gives it nothing)."""
  engine = engine_type(num_slots=1)
  s = sched.Scheduler(engine, None, max_queue=8, eos_ids=[EOS]).start()
  try:
    jobs = [job(4, 5, first=EOS - 1), job(3, 1, first=40), job(4, 4, first=20), job(2, 6, first=EOS - 3)]
    s.submit([j for j, _ in jobs])
    assert [sink.reason() for _, sink in jobs] == ["stop", "length", "length", "stop"]
    assert [sink.tokens() for _, sink in jobs] == [[EOS], [41], [21, 22, 23, 24], [EOS - 2, EOS - 1, EOS]]
    _assert_nothing_held(s, engine)
  finally:
    s.stop(5)


class _MaskedEngine(FakeEngine):
  """FakeEngine taking constrained jobs' token masks (it ignores them: the constraint below allows every token)."""

  def prefill(self, params, prompts, row_params=None, masks=None):
    return super().prefill(params, prompts, row_params)

  def decode_step(self, params, state, active=None, limits=None, mask=None):
    return super().decode_step(params, state, active, limits)


class _DeadEnd:
  """A grammar (scheduler.TokenConstraint) with no way on after the job's `at`-th token; complete there when `ok`."""

  words = 1

  def __init__(self, at: int, ok: bool):
    self.at, self.ok, self.got = at, ok, 0

  def fill(self, row: np.ndarray) -> None:
    row[:] = -1

  def advance(self, token: int) -> bool:
    self.got += 1
    return self.got >= self.at

  def failure(self) -> str:
    return "" if self.ok or self.got < self.at else "no way on"


def test_a_constrained_job_at_a_dead_end_ends_with_an_error_not_stop():
  """A reply its grammar cannot continue nor complete is an error with the grammar's reason (was: "stop", as if it were
  a complete reply); a complete one still ends with "stop"; the scheduler thread goes on."""
  engine = _MaskedEngine()
  s = sched.Scheduler(engine, None, max_queue=16, eos_ids=[EOS]).start()
  try:
    sinks = [Sink(), Sink()]
    s.submit([sched.Job(0, [1, 2], 8, RowParams(), sinks[0], constraint=_DeadEnd(3, ok=False)),
              sched.Job(1, [1, 2], 8, RowParams(), sinks[1], constraint=_DeadEnd(3, ok=True))])
    assert [sink.reason() for sink in sinks] == ["error", "stop"]
    assert sinks[0].events[-1].message == "no way on"
    assert len(sinks[0].tokens()) == 3
    _assert_nothing_held(s, engine)
    assert s._thread.is_alive()
  finally:
    s.stop(5)


class _Counted:
  """A device array stand-in that counts how often it is read to the host (jax.device_get calls __array__)."""

  reads = 0

  def __init__(self, value: np.ndarray):
    self.value = value

  def __array__(self, dtype=None, copy=None) -> np.ndarray:
    _Counted.reads += 1
    return self.value


class _CountingTopEngine(FakeEngine):
  def prefill(self, params, prompts, row_params=None):
    prefix = super().prefill(params, prompts, row_params)
    lp = prefix.first_logprobs
    prefix.first_logprobs = TokenLogprobs(lp.chosen_B, _Counted(lp.top_ids_Bk), _Counted(lp.top_logprobs_Bk))
    return prefix

  def decode_step(self, params, state, active=None, limits=None):
    state, out = super().decode_step(params, state, active, limits)
    lp = out.logprobs
    return state, Emitted(out.tokens, TokenLogprobs(lp.chosen_B, _Counted(lp.top_ids_Bk), _Counted(lp.top_logprobs_Bk)),
                          out.counts)


def test_the_top_alternatives_are_read_and_listed_only_for_jobs_that_ask():
  """A job with top_logprobs=False gets tokens with an empty `top`, and a call or a prefill whose jobs all say so
  reads no alternatives from the device; a job that asks gets them beside such a job, the same tokens either way."""
  engine = _CountingTopEngine(num_slots=2)
  s = sched.Scheduler(engine, None, max_queue=8, eos_ids=[EOS]).start()
  try:
    _Counted.reads = 0
    plain = [job(4, 5, first=10 * (i + 1)) for i in range(2)]
    for j, _ in plain:
      j.top_logprobs = False
    s.submit([j for j, _ in plain])
    assert [sink.reason() for _, sink in plain] == ["length", "length"]
    assert _Counted.reads == 0
    tokens = [sink.tokens() for _, sink in plain]
    assert tokens == [[11, 12, 13, 14, 15], [21, 22, 23, 24, 25]]
    assert all(top == [] for _, sink in plain for top in sink.tops())
    asks, asks_sink = job(4, 5, first=30)
    quiet, quiet_sink = job(4, 5, first=40)
    quiet.top_logprobs = False
    s.submit([asks, quiet])
    assert [asks_sink.reason(), quiet_sink.reason()] == ["length", "length"]
    assert _Counted.reads > 0
    assert asks_sink.tokens() == [31, 32, 33, 34, 35] and asks_sink.tops() == [[(0, 0.0), (0, 0.0)]] * 5
    assert quiet_sink.tops() == [[]] * 5
  finally:
    s.stop(5)
