"""Continuous batching for a server: one thread owns the engine and its decode state.

    HTTP handlers (asyncio) ─ submit(jobs) ─► bounded waiting list ─► free slot: [score] prefill insert
                  ▲                                                         │
                  └── events (token, scores, done) through each job's sink ◄── generate step (all slots)

A job is one completion: a prompt, how many tokens, its sampling parameters. Each engine step
serves every active slot; a job leaves its slot when it reaches max_tokens or an end-of-sequence
token, or when its handler cancels it (a stop sequence found, a client gone, a timeout), and the
slot is handed back with `engine.release`. Text (detokenising, stop strings) is the handlers'
business: the scheduler deals in token ids only.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import traceback
from typing import Any, Callable, Sequence

import jax
import numpy as np

from MaxText.inference.engine import Engine, TokenLogprobs
from MaxText.inference.sampling import RowParams


class QueueFull(Exception):
  """More jobs than free slots plus serve_max_queue: the caller answers 503 with Retry-After."""


@dataclasses.dataclass
class Token:
  index: int  # the job's choice index
  token: int
  logprob: float
  top: list[tuple[int, float]]  # the most probable alternatives at this position, best first


@dataclasses.dataclass
class PromptScores:
  index: int
  logprobs: list[float]  # of prompt token i given tokens < i; entry 0 has no context (reported as None)
  top: list[list[tuple[int, float]]]


@dataclasses.dataclass
class Done:
  index: int
  reason: str  # "length" | "stop" (an end-of-sequence token) | "cancelled" | "error"
  message: str = ""


Event = Token | PromptScores | Done


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

  def cancel(self) -> None:
    self.cancelled = True


def _top(ids_k: np.ndarray, logprobs_k: np.ndarray) -> list[tuple[int, float]]:
  return [(int(i), float(lp)) for i, lp in zip(ids_k, logprobs_k)]


class Scheduler:
  """Owns `engine` and `params` on its own thread; `submit` is safe from any thread."""

  def __init__(self, engine: Engine, params: Any, max_queue: int, eos_ids: Sequence[int] = (), seed: int = 0):
    self.engine, self.params, self.max_queue = engine, params, max_queue
    self.eos_ids = frozenset(eos_ids)
    self._waiting: collections.deque[Job] = collections.deque()
    self._active: dict[int, Job] = {}
    self._wake = threading.Condition()
    self._stopping = False
    self._state = engine.init_decode_state(seed)
    self._reserved: dict[int, int] = {}  # slot -> pages its job holds at its end (paged cache)
    self.counts = collections.Counter[str]()  # jobs admitted, finished by reason, slots released, steps
    self._thread = threading.Thread(target=self._loop, name="maxtext-scheduler", daemon=True)

  def start(self) -> "Scheduler":
    self._thread.start()
    return self

  def stop(self, timeout: float = 30.0) -> None:
    with self._wake:
      self._stopping = True
      self._wake.notify_all()
    self._thread.join(timeout)

  def submit(self, jobs: Sequence[Job]) -> None:
    """Queues all of `jobs` or none (QueueFull): one request's choices are never split."""
    with self._wake:
      in_flight = len(self._waiting) + len(self._active)
      if in_flight + len(jobs) > self.engine.num_slots + self.max_queue:
        raise QueueFull(f"{in_flight} requests in flight; capacity {self.engine.num_slots} slots + "
                        f"{self.max_queue} waiting (serve_max_queue)")
      self._waiting.extend(jobs)
      self._wake.notify_all()

  def load(self) -> dict[str, int]:
    """Jobs waiting and active now, and the counters so far (for tests, /health and the benchmark)."""
    with self._wake:
      return {"waiting": len(self._waiting), "active": len(self._active), **self.counts}

  # ---------------------------------------------------------------- the scheduler thread
  def _loop(self) -> None:
    while True:
      with self._wake:
        while not self._stopping and not self._waiting and not self._active:
          self._wake.wait()
        if self._stopping:
          break
      try:
        self._admit()
        self._drop_cancelled()
        if self._active:
          self._step()
      except Exception as e:  # noqa: BLE001 - a failed step must fail its jobs, not kill the server
        traceback.print_exc()
        self._fail_all(f"{type(e).__name__}: {e}", waiting_too=False)
        self._state = self.engine.init_decode_state()  # the failed step may have consumed the donated state
    self._fail_all("the server is shutting down")

  def _next_waiting(self) -> Job | None:
    with self._wake:
      return self._waiting.popleft() if self._waiting else None

  def _admit(self) -> None:
    """Fills free slots from the waiting list: optional prompt scoring, then prefill + insert."""
    for slot in range(self.engine.num_slots):
      while slot not in self._active:
        job = self._next_waiting()
        if job is None:
          return
        if job.cancelled:
          continue
        # A paged cache admits a job only when the pages it will hold at its end are free.
        need = self.engine.pages_needed(len(job.prompt) + job.max_tokens - 1)
        if need and sum(self._reserved.values()) + need > self.engine.cache_stats()["pages_total"]:
          with self._wake:
            self._waiting.appendleft(job)
          return
        self._reserved[slot] = need
        self.counts["admitted"] += 1
        try:
          self._start(job, slot)
        except Exception as e:  # noqa: BLE001 - this job fails alone; the others go on
          traceback.print_exc()
          self._finish(job, None, "error", f"{type(e).__name__}: {e}")

  def _start(self, job: Job, slot: int) -> None:
    if job.score_prompt:
      scores = jax.device_get(self.engine.score(self.params, job.prompt))
      n = len(job.prompt)
      job.emit(PromptScores(job.index, [float(x) for x in scores.chosen_B[:n]],
                            [_top(i, lp) for i, lp in zip(scores.top_ids_Bk[:n], scores.top_logprobs_Bk[:n])]))
    if job.max_tokens == 0:
      self._finish(job, None, "length")
      return
    prefix = self.engine.prefill(self.params, [job.prompt], row_params=[job.row])
    self._state = self.engine.insert(prefix, self._state, slot)
    first, logprobs = jax.device_get((prefix.first_tokens_B, prefix.first_logprobs))
    with self._wake:
      self._active[slot] = job
    self._deliver(slot, job, int(first[0]), logprobs, 0)

  def _step(self) -> None:
    self._state, step_out = self.engine.step(self.params, self._state)
    tokens_T, logprobs = jax.device_get(step_out)
    self.counts["steps"] += 1
    for slot, job in list(self._active.items()):
      self._deliver(slot, job, int(tokens_T[slot]), logprobs, slot)

  def _deliver(self, slot: int, job: Job, token: int, logprobs: TokenLogprobs, row: int) -> None:
    job.generated += 1
    job.emit(Token(job.index, token, float(logprobs.chosen_B[row]),
                   _top(logprobs.top_ids_Bk[row], logprobs.top_logprobs_Bk[row])))
    if token in self.eos_ids:
      self._finish(job, slot, "stop")
    elif job.generated >= job.max_tokens:
      self._finish(job, slot, "length")

  def _drop_cancelled(self) -> None:
    for slot, job in list(self._active.items()):
      if job.cancelled:
        self._finish(job, slot, "cancelled")

  def _finish(self, job: Job, slot: int | None, reason: str, message: str = "") -> None:
    if slot is not None:
      with self._wake:
        del self._active[slot]
      self.engine.release(slot)
      self._reserved.pop(slot, None)
      self.counts["released"] += 1
    self.counts[reason] += 1
    job.emit(Done(job.index, reason, message))

  def _fail_all(self, message: str, waiting_too: bool = True) -> None:
    for slot, job in list(self._active.items()):
      self._finish(job, slot, "error", message)
    while waiting_too and (waiting := self._next_waiting()) is not None:
      self._finish(waiting, None, "error", message)
