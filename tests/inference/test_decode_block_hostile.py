"""Several decode steps per call through the scheduler, on the shapes nobody chose: k of 2, 3 and the whole cache,
max_tokens 1 and to the cache's end, a prompt of exactly max_prefill_predict_length, end-of-sequence tokens early and
late, jobs admitted while others are mid-call, a job cancelled mid-call (its slot taken at once), sampled rows and
jobs without top alternatives beside ones with them. Each job's tokens and scores are those of one step per call, and
every slot and page comes back."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from MaxText.inference import scheduler as sched
from MaxText.inference.sampling import RowParams
from test_decode_block import PAGED, engine

PAGE_1 = dict(kv_cache_layout="paged", kv_page_size=1)
PREFIX_CHUNKED = dict(kv_cache_layout="paged", kv_page_size=3, prefix_caching=True, prefill_chunk_size=5)
FULL = [5, 9, 2, 7, 1, 3, 4, 6]  # max_prefill_predict_length tokens


def jobs() -> list[dict[str, Any]]:
  """`cancel_at`: the job is cancelled from its sink once it has that many tokens (as a stop string does);
  `after`: submitted once job `after` has ended (into a slot the calls in flight may still hold)."""
  return [
      dict(prompt=FULL, max_tokens=25),  # 8 + 25 = max_target_length + 1: to the cache's end
      dict(prompt=[7, 1, 3], max_tokens=1),
      dict(prompt=[5, 9, 2], max_tokens=5),
      dict(prompt=[7, 1, 3, 3, 8], max_tokens=11),
      dict(prompt=[11, 4], max_tokens=7, row=RowParams(temperature=0.8, seed=7)),
      dict(prompt=[5, 9, 2, 7], max_tokens=9, top=False),
      dict(prompt=[2, 2, 6, 1, 9, 9], max_tokens=12, cancel_at=3),
      dict(prompt=FULL[:7], max_tokens=6, after=3),
      dict(prompt=FULL[:5], max_tokens=3, after=1),
  ]


def serve(eng, specs: list[dict[str, Any]], stop: tuple[int, ...] = ()) -> tuple[list[dict[str, Any]], dict]:
  """Each job's tokens, scores, top ids and end through a Scheduler; then what it and the engine still hold."""
  events: dict[int, list[sched.Event]] = {i: [] for i in range(len(specs))}
  done = threading.Semaphore(0)
  scheduler = sched.Scheduler(eng, eng.load_params(), max_queue=32, eos_ids=stop)
  later = {i: spec["after"] for i, spec in enumerate(specs) if "after" in spec}

  def sink(i: int):
    def emit(event: sched.Event) -> None:  # on the scheduler's thread
      events[i].append(event)
      cancel_at = specs[i].get("cancel_at")
      if cancel_at is not None and sum(len(e.tokens) for e in events[i] if isinstance(e, sched.Tokens)) >= cancel_at:
        all_jobs[i].cancel()
      if isinstance(event, sched.Done):
        scheduler.submit([all_jobs[j] for j, first in later.items() if first == i])
        done.release()
    return emit

  all_jobs = [sched.Job(i, s["prompt"], s["max_tokens"], s.get("row", RowParams(seed=i)), sink(i),
                        top_logprobs=s.get("top", True)) for i, s in enumerate(specs)]
  scheduler.start()
  try:
    scheduler.submit([job for i, job in enumerate(all_jobs) if i not in later])
    for _ in specs:
      assert done.acquire(timeout=120), {i: [type(e).__name__ for e in ev] for i, ev in events.items()}
    time.sleep(0.05)  # the loop that delivered the last Done ends
    load = scheduler.load()
    held = dict(retiring=len(scheduler._retiring), firsts=len(scheduler._firsts), busy=int(eng._busy.sum()))
  finally:
    scheduler.stop()
  out = []
  for i, ev in events.items():
    tokens = [e for e in ev if isinstance(e, sched.Tokens)]
    assert [type(e) for e in ev[len(tokens):]] == [sched.Done], (i, ev)  # one end, last
    out.append(dict(tokens=[t for e in tokens for t in e.tokens], logprobs=[lp for e in tokens for lp in e.logprobs],
                    tops=[[t for t, _ in top] for e in tokens for top in e.tops], reason=ev[-1].reason))
  return out, dict(load, **held)


def check_same(reference: list[dict[str, Any]], got: list[dict[str, Any]], specs: list[dict[str, Any]]) -> None:
  for i, (a, b, spec) in enumerate(zip(reference, got, specs)):
    n = spec.get("cancel_at", len(a["tokens"]))  # past a cancel, how many more tokens come is timing
    assert b["tokens"][:n] == a["tokens"][:n], i
    np.testing.assert_allclose(b["logprobs"][:n], a["logprobs"][:n], rtol=1e-4, atol=1e-4)
    assert b["tops"][:n] == a["tops"][:n], i
    # A call that brings a cancelled job's last tokens ends it before the cancel is seen (a handler's stop string
    # still ends its text).
    assert b["reason"] == a["reason"] or "cancel_at" in spec and b["reason"] in ("length", "stop"), i
    if not spec.get("top", True):
      assert b["tops"] == [[]] * len(b["tokens"]), i


def check_nothing_held(load: dict) -> None:
  assert (load["active"], load["waiting"], load["pages_reserved"]) == (0, 0, 0), load
  assert (load["retiring"], load["firsts"], load["busy"]) == (0, 0, 0), load
  assert load["pages_free"] == load["pages_total"], load


def check_against_one_step(keys: dict, k: int) -> None:
  specs = jobs()
  reference, load = serve(engine(1, 3, **keys), specs)
  check_nothing_held(load)
  got, load = serve(engine(k, 3, **keys), specs)
  check_same(reference, got, specs)
  check_nothing_held(load)
  assert [len(r["tokens"]) for r in reference[:6]] == [s["max_tokens"] for s in specs[:6]]
  # End-of-sequence tokens that job 3 makes as its 2nd, 3rd and 5th token: inside and at the ends of calls.
  for stop in {reference[3]["tokens"][i] for i in (1, 2, 4)}:
    want, _ = serve(engine(1, 3, **keys), specs, stop=(stop,))
    got, load = serve(engine(k, 3, **keys), specs, stop=(stop,))
    check_same(want, got, specs)
    check_nothing_held(load)
    assert "stop" in [r["reason"] for r in got]


@pytest.mark.parametrize("k", [2, 3, 32])
def test_dense_jobs_get_one_step_per_calls_tokens(k: int) -> None:
  check_against_one_step({}, k)


@pytest.mark.slow
@pytest.mark.parametrize("keys", [PAGED, PAGE_1, PREFIX_CHUNKED], ids=["paged", "page_size_1", "prefix_chunked"])
def test_paged_jobs_get_one_step_per_calls_tokens(keys: dict) -> None:
  check_against_one_step(keys, 3)


def test_prefix_hits_ending_mid_page_give_the_dense_tokens() -> None:
  """Prompts sharing a part that ends inside a page (size 3), one whole prompt again and one shorter than a cached
  one, each after the one before it ended, with 3 steps per call: the dense cache's tokens."""
  specs = [dict(prompt=FULL, max_tokens=6), dict(prompt=FULL[:4] + [8, 8], max_tokens=7, after=0),
           dict(prompt=FULL, max_tokens=9, after=1), dict(prompt=FULL[:7], max_tokens=26, after=2),
           dict(prompt=FULL[:5], max_tokens=5, after=2), dict(prompt=FULL, max_tokens=1, after=3)]
  reference, _ = serve(engine(1, 3), specs)
  got, load = serve(engine(3, 3, **PREFIX_CHUNKED), specs)
  check_same(reference, got, specs)
  check_nothing_held(load)
  assert load["prefix_cached_tokens"] > 0


@pytest.mark.parametrize("k", [1, 3])
def test_a_job_past_the_cache_is_refused_at_submit(k: int) -> None:
  """A job asking more tokens than its slot's cache holds: with several steps per call the device stops it at the
  cache's end, short of max_tokens, and the scheduler spun forever waiting for the rest."""
  eng = engine(k, 1)
  scheduler = sched.Scheduler(eng, eng.load_params(), max_queue=4)
  room = eng.cfg.max_target_length + 1
  with pytest.raises(sched.TooLarge, match=r"8 prompt tokens \+ max_tokens=26 exceed the context of 33 tokens"):
    scheduler.submit([sched.Job(0, FULL, room - len(FULL) + 1, RowParams(), lambda e: None)])
  scheduler.submit([sched.Job(0, FULL, room - len(FULL), RowParams(), lambda e: None),  # just fits
                    sched.Job(1, FULL * 5, 0, RowParams(), lambda e: None, score_prompt=True)])  # scores only
