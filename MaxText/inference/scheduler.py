"""Continuous batching for a server: one thread owns the engine and its decode state.

    HTTP handlers (asyncio) ─ submit(jobs) ─► bounded waiting list ─► free slot: [score] prefill insert
                  ▲                                                         │
                  └── events (tokens, scores, done) through each job's sink ◄── generate step (all slots)

A job is one completion: a prompt, how many tokens, its sampling parameters. Each engine step
serves every active slot; a job leaves its slot when it reaches max_tokens or an end-of-sequence
token, or when its handler cancels it (a stop sequence found, a client gone, a timeout), and the
slot is handed back with `engine.release`. Text (detokenising, stop strings) is the handlers'
business: the scheduler deals in token ids only.

The jobs admitted in one loop are prefilled in one engine call: their prompts as the rows of one
`prefill_insert` that also puts them into their slots (engine_api.PrefillsIntoSlots; padded to a power
of two rows, so a few programs compile), where the engine has none a `prefill` then one `insert_rows` for
them all (engine_api.InsertsRowsTogether; an insert each where the engine has no such call); into
pages without chunks, their prompts' rests as the rows of one `prefill_rests` call per piece
(engine_api.PrefillsRestsTogether).

With prefill_chunk_size > 0 (paged), the prompts being prefilled share a budget of one chunk
(prefill_chunk_size tokens) per loop, between the running jobs' generate steps, longest-waiting
first and in one `prefill_chunks` call (engine_api.PrefillsChunksTogether), so a long prompt delays
each of their tokens by one chunk's time instead of its whole prefill; a job joins the generate
steps after its last chunk.

With a speculative engine (speculative_engine.SpeculativeEngine, speculative_tokens > 0) a step is
a round that gives each slot 1 to k + 1 tokens, delivered in order until its job ends; the rest of
the round is dropped, and the engine's pages_needed includes the round's k-token look-ahead.

Constrained decoding (a job with a `constraint`: response_format, a forced tool call): before each
prefill or step the host writes each constrained slot's allowed tokens as a bitmask row
(inference/grammar.py), the engine applies it on the device, and every token the job gets advances
its constraint; the job ends ("stop") when its grammar is complete. Jobs without one pay nothing:
with no constrained job the engine is called as before, and otherwise their rows allow every token.

An engine that emits one token per call otherwise is driven a call ahead: each `decode_step`
(decode_steps_per_call steps on the device, each slot stopped there at its job's end-of-sequence
token or max_tokens: engine_api.StepLimits) is dispatched before the previous call's tokens are
read, so the device computes the next tokens while the host delivers the last ones. A call's
tokens go to the job that held the slot when it was dispatched, and only while it still does. A
job whose max_tokens the calls in flight reach (each gives every running slot its steps' tokens)
is known to end there: its slot is released as that call is dispatched, so a waiting job can take
it in the next call, and the job itself gets those calls' tokens and its end when they are read.
A speculative engine and a constrained job (its mask depends on the token before) take one call at
a time; in a call of several steps a constrained job's slot takes one step while the others take
theirs (a speculative round gives it one token).

Paged cache: a job is admitted only when the pages it will hold at its end fit beside what the
active jobs have reserved, so a step never runs out. The reservation belongs to the slot while its
job is active and is given back whichever way the job ends; a scoring-only job (max_tokens 0)
never holds a slot or a page. With nothing to step and nothing admissible the thread sleeps on
its condition, woken by a submit, a cancel or stop.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
import traceback
from typing import Any, Callable, Protocol, Sequence

import jax
import numpy as np

from MaxText.inference.engine_api import (Admitted, DecodeEngine, Emitted, EngineParams, EngineState,
                                          InsertsRowsTogether, PrefillsChunksTogether, PrefillsIntoSlots,
                                          PrefillsRestsTogether,
                                          StepLimits, TokenLogprobs)
from MaxText.inference.image_prompts import PromptImages
# The events and refusals, kept where the HTTP front ends read them without JAX, and named here as before.
from MaxText.inference.job_events import (Done as Done, Event as Event, PromptScores as PromptScores,
                                          QueueFull as QueueFull, Tokens as Tokens, TooLarge as TooLarge)
from MaxText.inference.sampling import ALL_TOKENS, RowParams


class TokenConstraint(Protocol):
  """The tokens a job may get next (grammar.Constraint): a bitmask row of `words` int32 words before
  each token, then the token it got."""

  words: int

  def fill(self, row: np.ndarray) -> None:
    """Writes the allowed tokens' bits into `row` (int32 [words])."""

  def advance(self, token: int) -> bool:
    """Takes the job's next token; True when the job must end there (its grammar is complete)."""

  def failure(self) -> str:
    """Why no token can continue the job's text, which its grammar does not complete ("" while one can)."""


@dataclasses.dataclass(eq=False)
class Job:
  index: int
  prompt: list[int]
  max_tokens: int  # new tokens, >= 0 (0 with score_prompt: only the prompt's log-likelihoods)
  row: RowParams
  emit: Callable[[Event], None]  # thread-safe: called from the scheduler thread
  score_prompt: bool = False
  generated: int = 0
  cancelled: bool = False  # set by the handler; read by the scheduler at the next step
  submitted: float = 0.0  # time.monotonic() at submit
  on_cancel: Callable[[], None] | None = None  # set by submit: wakes the scheduler
  images: PromptImages | None = None  # a vision-language prompt's images, one per placeholder run
  constraint: TokenConstraint | None = None  # constrained decoding: the tokens it may get
  cache_key: bytes = b""  # what its prompt's cached pages depend on beyond the tokens (its LoRA adapter)
  # Whether its tokens carry their top alternatives (a completions request with logprobs >= 1);
  # False: each Token's `top` is [], and a call whose jobs all say so reads none from the device.
  top_logprobs: bool = True

  def cancel(self) -> None:
    if not self.cancelled:
      self.cancelled = True
      if self.on_cancel is not None:
        self.on_cancel()


_COUNTS = ("admitted", "prefills", "released", "steps", "loops", "length", "stop", "cancelled", "error",
           "prefix_cached_tokens", "speculative_proposed", "speculative_accepted")


def _images(job: Job) -> dict[str, Any]:
  """A text job calls the engine as before images existed (engines that take none stay usable)."""
  return {} if job.images is None else {"images": job.images}


def _cache_key(job: Job) -> dict[str, Any]:
  return {"cache_key": job.cache_key} if job.cache_key else {}


def _masks(jobs: dict[int, Job], rows: int, name: str) -> dict[str, Any]:
  """{name: the jobs' token bitmasks by row (slot), every token for rows without a constrained job}, or
  {} when none is constrained: the engine is then called as without constrained decoding."""
  constrained = {row: job.constraint for row, job in jobs.items() if job.constraint is not None}
  if not constrained:
    return {}
  mask = np.full((rows, next(iter(constrained.values())).words), ALL_TOKENS, np.int32)
  for row, constraint in constrained.items():
    constraint.fill(mask[row])
  return {name: mask}


def _bucket(rows: int, slots: int) -> int:
  """Rows a prefill of `rows` prompts is padded to: the next power of two, at most the slots' number."""
  return max(rows, min(1 << (rows - 1).bit_length(), slots))


def _host(*arrays: Any) -> list[Any]:
  """The arrays' values as numpy arrays (None stays None), every device copy started before the first is
  waited for: what jax.device_get gives a tuple of them, without its per-leaf tree and context handling (about
  half the cost of a call's read on the CPU backend)."""
  for array in arrays:
    if isinstance(array, jax.Array):
      array.copy_to_host_async()
  return [None if array is None else np.asarray(array) for array in arrays]


def _top(ids_k: np.ndarray, logprobs_k: np.ndarray) -> list[tuple[int, float]]:
  return [(int(i), float(lp)) for i, lp in zip(ids_k, logprobs_k)]


def _scores(logprobs: TokenLogprobs, *index: int) -> tuple[float, list[tuple[int, float]]]:
  """The chosen token's log-probability and the top alternatives at `index` ([slot] or [slot, i])."""
  return float(logprobs.chosen_B[index]), _top(logprobs.top_ids_Bk[index], logprobs.top_logprobs_Bk[index])


class Scheduler:
  """Owns `engine` and `params` on its own thread; `submit` is safe from any thread."""

  def __init__(self, engine: DecodeEngine, params: EngineParams, max_queue: int, eos_ids: Sequence[int] = (),
               seed: int = 0):
    self.engine, self.params, self.max_queue = engine, params, max_queue
    self.eos_ids = frozenset(eos_ids)
    self._waiting: collections.deque[Job] = collections.deque()
    self._active: dict[int, Job] = {}
    self._prefilling: dict[int, tuple[Job, int]] = {}  # slot -> (job, prompt tokens cached so far), in admission order
    self._into_pages = engine.prefills_into_pages
    # A Protocol's isinstance is slow: asked once.
    self._row_inserter = engine if isinstance(engine, InsertsRowsTogether) else None
    self._slot_prefiller = engine if isinstance(engine, PrefillsIntoSlots) else None
    # k > 0: a speculative engine, whose steps (rounds) emit 1..k + 1 tokens per slot.
    self.speculative_tokens = engine.speculative_tokens
    self._wake = threading.Condition()  # guards _waiting, _active, _reserved
    self._stopping = False
    self._state: EngineState = engine.init_decode_state(seed)  # the engine's own decode state, opaque here
    self._pages_total = int(engine.cache_stats()["pages_total"])  # 0: the dense cache
    # Tokens a job's prompt and max_tokens may reach (the last token needs no cache entry); 0: no limit known.
    cfg = getattr(engine, "cfg", None)
    self._room = 0 if cfg is None else cfg.max_target_length + 1
    self._reserved: dict[int, int] = {}  # slot -> pages its active job holds at its end (paged cache)
    # Jobs admitted, finished by reason, slots released, steps, loops. Every key exists from the
    # start: load() copies the counter from another thread, which a new key would break.
    self.counts = collections.Counter[str]({k: 0 for k in _COUNTS})
    self._stop_ids = tuple(sorted(self.eos_ids))
    # The call dispatched and not yet read: its Emitted and the jobs that held its slots.
    self._ahead: tuple[Emitted, dict[int, Job]] | None = None
    # Prefills dispatched whose first tokens are not read yet, as (read and deliver them, their jobs):
    # read once the next call is dispatched, so the device runs that call while the host hands the
    # tokens on instead of idling between the prefill and the call.
    self._firsts: list[tuple[Callable[[], None], list[Job]]] = []
    self._retiring: set[Job] = set()  # jobs whose slot was released before the call that ends them is read
    # Called on this thread after every loop (and after the jobs failed at stop): what gathers the
    # loop's events sends them on together (serve_processes: one message per front end).
    self.after_loop: list[Callable[[], None]] = []
    self._thread = threading.Thread(target=self._loop, name="maxtext-scheduler", daemon=True)

  def start(self) -> "Scheduler":
    self._thread.start()
    return self

  def stop(self, timeout: float = 30.0) -> None:
    with self._wake:
      self._stopping = True
      self._wake.notify_all()
    self._thread.join(timeout)

  def pages_needed(self, job: Job) -> int:
    """KV pages `job` holds at its end: none for the dense cache or a scoring-only job."""
    if job.max_tokens == 0:
      return 0
    return self.engine.pages_needed(len(job.prompt) + job.max_tokens - 1)

  def submit(self, jobs: Sequence[Job]) -> None:
    """Queues all of `jobs` or none (QueueFull; TooLarge for a job no pool or cache could ever hold): one
    request's choices are never split."""
    room = self._room
    for job in jobs:
      # Past the cache a call of several steps emits nothing more while the job waits for max_tokens: it spun
      # forever (one step per call made tokens past the cache instead).
      if room and job.max_tokens and len(job.prompt) + job.max_tokens > room:
        raise TooLarge(f"{len(job.prompt)} prompt tokens + max_tokens={job.max_tokens} exceed the context of {room} "
                       "tokens (max_target_length + 1)")
      need = self.pages_needed(job)
      if self._pages_total and need > self._pages_total:
        raise TooLarge(f"{len(job.prompt)} prompt tokens + max_tokens={job.max_tokens} need {need} KV pages but "
                       f"the whole pool has kv_num_pages={self._pages_total}; lower max_tokens or shorten the prompt")
    now = time.monotonic()
    with self._wake:
      in_flight = len(self._waiting) + len(self._active) + len(self._prefilling)
      if in_flight + len(jobs) > self.engine.num_slots + self.max_queue:
        raise QueueFull(f"{in_flight} requests in flight; capacity {self.engine.num_slots} slots + "
                        f"{self.max_queue} waiting (serve_max_queue)")
      for job in jobs:
        job.submitted, job.on_cancel = now, self._notify
      self._waiting.extend(jobs)
      self._wake.notify_all()

  def load(self) -> dict[str, Any]:
    """What is in flight now and the counters so far (for tests, /health, /metrics, the benchmark):
    jobs waiting and active, slots, pages free and reserved, the oldest job's age in seconds."""
    with self._wake:
      jobs = [*self._waiting, *self._active.values(), *(job for job, _ in self._prefilling.values())]
      oldest = time.monotonic() - min(j.submitted for j in jobs) if jobs else 0.0
      # "active": slots holding a job, decoding or still prefilling its prompt.
      return {"waiting": len(self._waiting), "active": len(self._active) + len(self._prefilling),
              "prefilling": len(self._prefilling),
              "slots": self.engine.num_slots,
              "pages_total": self._pages_total, "pages_free": int(self.engine.cache_stats()["pages_free"]),
              "pages_cached": int(self.engine.cache_stats().get("pages_cached", 0)),
              "pages_reserved": sum(self._reserved.values()), "oldest_age_s": oldest,
              "speculative_tokens": self.speculative_tokens, **self.counts}

  def _notify(self) -> None:
    with self._wake:
      self._wake.notify_all()

  # ---------------------------------------------------------------- the scheduler thread
  def _runnable(self) -> bool:
    """Under the lock: a step to take, a cancelled waiting job to drop or a job to admit."""
    if self._active or self._prefilling or self._ahead is not None or any(j.cancelled for j in self._waiting):
      return True
    return bool(self._waiting) and self._fits(self._waiting[0])

  def _fits(self, job: Job) -> bool:
    need = self.pages_needed(job)
    # Pages a keyed or image prompt will share are not predicted: it counts whole.
    text_only = job.images is None and not job.cache_key
    return not need or self.engine.admission_pages(self._reserved, job.prompt, need, text_only) <= self._pages_total

  def _loop(self) -> None:
    while True:
      with self._wake:
        while not self._stopping and not self._runnable():
          self._wake.wait()
        if self._stopping:
          break
      self.counts["loops"] += 1
      try:
        self._drop_cancelled()
        self._admit()
        if self._prefilling:
          self._prefill_chunk()
        if self._active or self._ahead is not None:
          self._step()
      except Exception as e:  # noqa: BLE001 - a failed step must fail its jobs, not kill the server
        traceback.print_exc()
        self._ahead, self._firsts = None, []
        self._fail_all(f"{type(e).__name__}: {e}", waiting_too=False)
        self._state = self.engine.init_decode_state()  # the failed step may have consumed the donated state
        with self._wake:
          self._reserved.clear()  # every page is free again in the new state
      for hook in self.after_loop:
        hook()
    self._fail_all("the server is shutting down")
    for hook in self.after_loop:
      hook()

  def _admit(self) -> None:
    """Fills free slots from the head of the waiting list (in order: a job that does not fit yet
    keeps its place): optional prompt scoring, then, for every job admitted in this loop, one
    prefill of all their prompts and an insert each (or, into pages, begin_prompt)."""
    batch: list[tuple[Job, int]] = []  # (job, slot) waiting for this loop's prefill
    for slot in range(self.engine.num_slots):
      while slot not in self._active and slot not in self._prefilling and all(s != slot for _, s in batch):
        with self._wake:
          if not self._waiting or not self._fits(self._waiting[0]):
            break
          job = self._waiting.popleft()
          need = self.pages_needed(job)
          if need:
            self._reserved[slot] = need
        self.counts["admitted"] += 1
        try:
          if self._start(job, slot):
            batch.append((job, slot))
        except Exception as e:  # noqa: BLE001 - this job fails alone; the others go on
          self._fail_start([(job, slot)], e)
        finally:
          if slot not in self._active and slot not in self._prefilling and all(s != slot for _, s in batch):
            with self._wake:  # scoring-only, or failed: holds nothing
              self._reserved.pop(slot, None)
      else:
        continue
      break  # the head of the waiting list does not fit (or there is none)
    if batch:
      try:
        self._prefill_together(batch)
      except Exception as e:  # noqa: BLE001 - these jobs fail; the running ones go on
        self._fail_start(batch, e)

  def _fail_start(self, batch: Sequence[tuple[Job, int]], e: Exception) -> None:
    traceback.print_exc()
    for job, slot in batch:
      with self._wake:
        self._active.pop(slot, None)
        self._prefilling.pop(slot, None)
        self._reserved.pop(slot, None)
      self.engine.release(slot)  # pages an insert may have handed out before the failure
      self._finish(job, None, "error", f"{type(e).__name__}: {e}")

  def _start(self, job: Job, slot: int) -> bool:
    """Scores the prompt if asked and begins the job; True when it waits for this loop's prefill."""
    if job.score_prompt:
      scores = jax.device_get(self.engine.score(self.params, job.prompt, **_images(job)))
      n = len(job.prompt)
      job.emit(PromptScores(job.index, [float(x) for x in scores.chosen_B[:n]],
                            [_top(i, lp) for i, lp in zip(scores.top_ids_Bk[:n], scores.top_logprobs_Bk[:n])]))
    if job.max_tokens == 0:
      self._finish(job, None, "length")
      return False
    if self._into_pages:
      cached = self.engine.begin_prompt(slot, job.prompt, **_images(job), **_cache_key(job))
      self.counts["prefix_cached_tokens"] += cached
      with self._wake:
        self._prefilling[slot] = (job, cached)
      return False
    return True

  def _prefill_together(self, batch: Sequence[tuple[Job, int]]) -> None:
    """One call that prefills the prompts of `batch`, padded to a power of two rows (repeating the
    first; a few compiled programs in all), and puts them into their slots (where the engine cannot: a
    prefill, then one insert of them all, or an insert each), and one read of their first tokens."""
    jobs = [job for job, _ in batch] + [batch[0][0]] * (_bucket(len(batch), self.engine.num_slots) - len(batch))
    rows: dict[str, Any] = {}
    if any(job.images is not None for job in jobs):
      rows["images"] = [job.images for job in jobs]
    rows.update(_masks(dict(enumerate(jobs)), len(jobs), "masks"))
    prompts, row_params = [job.prompt for job in jobs], [job.row for job in jobs]
    self.counts["prefills"] += 1
    prefix: Admitted
    if self._slot_prefiller is not None:  # one device call, the prompts' caches never returned
      self._state, prefix = self._slot_prefiller.prefill_insert(self.params, self._state, prompts,
                                                                [slot for _, slot in batch], row_params=row_params,
                                                                **rows)
    else:
      prefix = self.engine.prefill(self.params, prompts, row_params=row_params, **rows)
      if self._row_inserter is not None:
        self._state = self._row_inserter.insert_rows(prefix, self._state, [slot for _, slot in batch],
                                                     list(range(len(batch))))
      else:
        for row, (job, slot) in enumerate(batch):
          self._state = self.engine.insert(prefix, self._state, slot, row)
    with self._wake:
      self._active.update({slot: job for job, slot in batch})
    self._read_firsts_later([job for job, _ in batch], lambda: self._deliver_firsts(prefix, batch))

  def _read_firsts_later(self, jobs: list[Job], read: Callable[[], None]) -> None:
    """`read` (the first tokens of `jobs`, now active) runs after the next call is dispatched, or now
    when that call needs them: a constrained job's token mask, a speculative round's draft."""
    if self._one_call_at_a_time():
      read()
    else:
      self._firsts.append((read, jobs))

  def _read_firsts(self) -> None:
    firsts, self._firsts = self._firsts, []
    for read, _ in firsts:
      read()

  def _deliver_firsts(self, prefix: Admitted, batch: Sequence[tuple[Job, int]]) -> None:
    """One read of a prefill's first tokens, each handed to its job."""
    lp = prefix.first_logprobs
    # The top alternatives are read only when a job wants them (a host copy each), as for a call's tokens.
    tops = any(job.top_logprobs for job, _ in batch)
    out = _host(prefix.first_tokens_B, lp.chosen_B, *((lp.top_ids_Bk, lp.top_logprobs_Bk) if tops else ()))
    first, chosen = np.asarray(out[0]).tolist(), np.asarray(out[1]).tolist()
    for row, (job, slot) in enumerate(batch):
      if self._takes(slot, job):
        self._deliver(slot, job, [first[row]], [chosen[row]],
                      [_top(out[2][row], out[3][row])] if tops and job.top_logprobs else None)

  def _prefill_chunk(self) -> None:
    """With prefill_chunk_size, one chunk budget of the prompts being prefilled, longest-waiting first
    (the per-loop prefill budget: in one call where the engine shares it, PrefillsChunksTogether, else
    one chunk of the first); without it (prefix caching alone), every admitted prompt whole, as the
    unchunked path prefills them all before the next step: in one call per piece where the engine can."""
    chunked = bool(self.engine.prefill_chunk_size)
    if chunked and isinstance(self.engine, PrefillsChunksTogether):
      self._prefill_chunks(self.engine)
      return
    if not chunked and isinstance(self.engine, PrefillsRestsTogether):
      self._prefill_rests(self.engine)
      return
    for slot, (job, start) in list(self._prefilling.items()):
      self._state, end, first = self.engine.prefill_chunk(self.params, self._state, slot, job.prompt, start, job.row,
                                                          **_images(job), **_masks({0: job}, 1, "mask"))
      if first is None:
        with self._wake:
          self._prefilling[slot] = (job, end)
        return  # the chunk budget of this loop is spent
      self._activate([(slot, job, (*first, 0))])
      if chunked:
        return

  def _together(self) -> tuple[list[tuple[int, Job, int]], dict[int, Job], dict[str, Any]]:
    """The prompts being prefilled in admission order as (slot, job, start), the jobs by row, and the
    keyword arguments of a call with them as rows (their images, masks)."""
    batch = [(slot, job, start) for slot, (job, start) in self._prefilling.items()]
    jobs = {row: job for row, (_, job, _) in enumerate(batch)}
    rows: dict[str, Any] = _masks(jobs, len(batch), "masks")
    if any(job.images is not None for job in jobs.values()):
      rows["images"] = [job.images for job in jobs.values()]
    return batch, jobs, rows

  def _prefill_rests(self, engine: PrefillsRestsTogether) -> None:
    """Every prompt being prefilled, whole, in one engine call per piece."""
    batch, jobs, rows = self._together()
    if not batch:
      return
    self._state, firsts = engine.prefill_rests(self.params, self._state, [slot for slot, _, _ in batch],
                                               [job.prompt for job in jobs.values()],
                                               [start for _, _, start in batch], [job.row for job in jobs.values()],
                                               **rows)
    self.counts["prefills"] += 1
    self._activate([(slot, job, first) for (slot, job, _), first in zip(batch, firsts)])

  def _prefill_chunks(self, engine: PrefillsChunksTogether) -> None:
    """One chunk budget spent on the prompts being prefilled, longest-waiting first, in one engine call."""
    batch, jobs, rows = self._together()
    if not batch:
      return
    self._state, results = engine.prefill_chunks(self.params, self._state, [slot for slot, _, _ in batch],
                                                 [job.prompt for job in jobs.values()],
                                                 [start for _, _, start in batch], [job.row for job in jobs.values()],
                                                 **rows)
    self.counts["prefills"] += 1
    with self._wake:
      for (slot, job, _), (end, _) in zip(batch, results):
        self._prefilling[slot] = (job, end)
    finished = [(slot, job, first) for (slot, job, _), (_, first) in zip(batch, results) if first is not None]
    if finished:
      self._activate(finished)

  def _activate(self, finished: Sequence[tuple[int, Job, tuple[Any, TokenLogprobs, int]]]) -> None:
    """Jobs whose prompts are prefilled join the generate steps with their first tokens ((first tokens
    [B], their scores, the job's row), on the device: read in one copy, after the next call's dispatch)."""
    with self._wake:
      for slot, job, _ in finished:
        del self._prefilling[slot]
        self._active[slot] = job

    def read() -> None:
      for (slot, job, _), (tokens_B, logprobs, row) in zip(finished, jax.device_get([f for _, _, f in finished])):
        if self._takes(slot, job):
          logprob, top = _scores(logprobs, row)
          self._deliver(slot, job, [int(tokens_B[row])], [logprob], [top])

    self._read_firsts_later([job for _, job, _ in finished], read)

  def _one_call_at_a_time(self) -> bool:
    return bool(self.speculative_tokens) or any(getattr(job, "constraint", None) is not None
                                                for job in self._active.values())

  def _limits(self) -> StepLimits:
    """Where each active job's slot stops on the device: its end of sequence, its max_tokens; without a job
    that reads them, the engine need not compute the tokens' top alternatives."""
    ends = np.zeros(self.engine.num_slots, np.int64)
    for slot, job in self._active.items():
      ends[slot] = len(job.prompt) + job.max_tokens
    return StepLimits(ends, self._stop_ids, any(job.top_logprobs for job in self._active.values()))

  def _step_ahead(self) -> None:
    """Dispatches the next call of decode steps for the active jobs, then delivers the previous
    call's tokens while the device runs it."""
    previous, self._ahead = self._ahead, None
    if self._active:
      limits = self._limits()
      self._state, emitted = self.engine.decode_step(self.params, self._state, limits.ends > 0, limits=limits)
      self._ahead = (emitted, dict(self._active))
      self.counts["steps"] += 1
      self._retire_ending(emitted, previous)
    self._read_firsts()  # before the previous call's tokens, as when they were read at their prefill
    if previous is not None:
      self._deliver_call(*previous)

  def _retire_ending(self, emitted: Emitted, previous: tuple[Emitted, dict[int, Job]] | None) -> None:
    """Releases the slot of each job the calls in flight take to its max_tokens: a job not ended by
    an end-of-sequence token gets each call's steps' tokens, so the count is known before any is read."""
    per_call = 1 if emitted.counts is None else int(np.shape(emitted.tokens)[1])
    unread = {id(job) for _, jobs in self._firsts for job in jobs}  # a first token each, not read yet
    for slot, job in list(self._active.items()):
      calls = 1 + (previous is not None and previous[1].get(slot) is job)
      if job.generated + (id(job) in unread) + per_call * calls >= job.max_tokens:
        with self._wake:
          del self._active[slot]
          self._reserved.pop(slot, None)
          self._retiring.add(job)
        self.engine.release(slot)
        self.counts["released"] += 1

  def _takes(self, slot: int, job: Job) -> bool:
    """Whether `job` still takes the tokens of `slot`; a retiring job cancelled (a stop string, a client
    gone) ends here."""
    if job not in self._retiring:
      return self._active.get(slot) is job
    if job.cancelled:
      self._finish(job, None, "cancelled")
      return False
    return True

  def _deliver_call(self, emitted: Emitted, jobs: dict[int, Job]) -> None:
    lp = emitted.logprobs
    # The top alternatives are read (a host copy each) and listed only when a job of the call wants them.
    tops = (lp.top_ids_Bk, lp.top_logprobs_Bk) if any(job.top_logprobs for job in jobs.values()) else ()
    out = _host(emitted.tokens, lp.chosen_B, emitted.counts, *tops)
    # Python values in one conversion each (indexing numpy per token costs more than the rest of a delivery).
    tokens, chosen = np.asarray(out[0]).tolist(), np.asarray(out[1]).tolist()
    counts = None if out[2] is None else np.asarray(out[2]).tolist()
    ids, top = (np.asarray(out[3]).tolist(), np.asarray(out[4]).tolist()) if tops else ([], [])
    for slot, job in jobs.items():
      n = 1 if counts is None else counts[slot]
      if not n or not self._takes(slot, job):  # it ended (a stop string, a cancel) or the slot has a new job
        continue
      wants = bool(tops) and job.top_logprobs
      if counts is None:
        self._deliver(slot, job, [tokens[slot]], [chosen[slot]], [list(zip(ids[slot], top[slot]))] if wants else None)
      else:
        self._deliver(slot, job, tokens[slot][:n], chosen[slot][:n],
                      [list(zip(a, b)) for a, b in zip(ids[slot][:n], top[slot][:n])] if wants else None)

  def _step(self) -> None:
    """One step: each active slot's tokens in order (1, or 1..k + 1 for a speculative round) until
    its job ends (the rest of a round is dropped: max_tokens or an end-of-sequence token cut it)."""
    if not self._one_call_at_a_time():
      self._step_ahead()
      return
    if self._ahead is not None:  # a constrained job arrived: the call in flight is read first
      self._deliver_call(*self._ahead)
      self._ahead = None
    self._read_firsts()
    if not self._active:
      return
    active = np.zeros(self.engine.num_slots, bool)
    active[list(self._active)] = True
    self._state, emitted = self.engine.decode_step(self.params, self._state, active,
                                                   **_masks(self._active, self.engine.num_slots, "mask"),
                                                   limits=self._limits())
    out: Emitted = jax.device_get(emitted)
    self.counts["steps"] += 1
    if self.speculative_tokens:
      self.counts["speculative_proposed"] += self.speculative_tokens * int(active.sum())
      self.counts["speculative_accepted"] += sum([out.count(int(slot)) - 1 for slot in np.flatnonzero(active)])
    for slot, job in list(self._active.items()):
      n = out.count(slot)
      scores = [out.scores(slot, i) for i in range(n)]
      if n:
        self._deliver(slot, job, [out.token(slot, i) for i in range(n)], [lp for lp, _ in scores],
                      [top for _, top in scores])

  def _deliver(self, slot: int, job: Job, tokens: list[int], logprobs: list[float],
               tops: list[list[tuple[int, float]]] | None) -> None:
    """Gives `job` a run of its new tokens (with their log-probabilities and, `tops` not None, top
    alternatives) as one event, cut after the token that ends it: an end-of-sequence token, its
    grammar complete (or at a dead end), its max_tokens."""
    n, reason, failure = min(len(tokens), job.max_tokens - job.generated), "", ""
    if job.constraint is not None:  # its grammar takes every token up to its end
      for i in range(n):
        if tokens[i] in self.eos_ids or job.constraint.advance(tokens[i]):
          n, failure = i + 1, job.constraint.failure()  # a dead end is no complete reply
          reason = "error" if failure else "stop"
          break
    elif self.eos_ids and not self.eos_ids.isdisjoint(tokens[:n]):
      n, reason = next(i for i in range(n) if tokens[i] in self.eos_ids) + 1, "stop"
    if n <= 0:
      return
    job.generated += n
    job.emit(Tokens(job.index, tokens[:n], logprobs[:n], tops[:n] if tops is not None and job.top_logprobs
                    else [[] for _ in range(n)]))
    if reason:
      self._finish(job, slot, reason, failure)
    elif job.generated >= job.max_tokens:
      self._finish(job, slot, "length")

  def _drop_cancelled(self) -> None:
    """Cancelled jobs leave at once: active ones free their slot, waiting ones their place."""
    for slot, job in list(self._active.items()):
      if job.cancelled:
        self._finish(job, slot, "cancelled")
    for slot, (job, _) in list(self._prefilling.items()):
      if job.cancelled:
        self._finish(job, slot, "cancelled")
    with self._wake:
      dropped = [j for j in self._waiting if j.cancelled]
      if dropped:
        self._waiting = collections.deque(j for j in self._waiting if not j.cancelled)
    for job in dropped:
      self._finish(job, None, "cancelled")

  def _finish(self, job: Job, slot: int | None, reason: str, message: str = "") -> None:
    if job in self._retiring:  # its slot was released when its last call was dispatched
      self._retiring.discard(job)
      slot = None
    if slot is not None:
      with self._wake:
        self._active.pop(slot, None)
        self._prefilling.pop(slot, None)
        self._reserved.pop(slot, None)
      self.engine.release(slot)
      self.counts["released"] += 1
    self.counts[reason] += 1
    job.emit(Done(job.index, reason, message))

  def _fail_all(self, message: str, waiting_too: bool = True) -> None:
    for job in list(self._retiring):
      self._finish(job, None, "error", message)
    for slot, job in [*self._active.items(), *((slot, job) for slot, (job, _) in self._prefilling.items())]:
      self._finish(job, slot, "error", message)
    while waiting_too:
      with self._wake:
        waiting = self._waiting.popleft() if self._waiting else None
      if waiting is None:
        break
      self._finish(waiting, None, "error", message)
