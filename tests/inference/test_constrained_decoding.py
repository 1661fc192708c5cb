"""Constrained decoding's device side (sampling.apply_token_mask) and its path through the scheduler and
every engine: a masked greedy row equals the unmasked one where the mask allows the argmax, a sampled
row never leaves its mask, and jobs with token constraints get only allowed tokens, the first (sampled
after the prompt) included, with the dense cache, the paged cache with prefix caching and chunked prefill,
and speculative decoding (a constrained slot takes no draft token), while an unconstrained job beside
them gets its plain greedy tokens. A step's or round's masks reach the decode call as the host array they are."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.configuration.config import Config
from MaxText.inference import decode_state, mtp_draft, sampling, speculative_engine
from MaxText.inference import scheduler as sched
from MaxText.inference.decode_state import RowSampling
from MaxText.inference.engine import Engine
from MaxText.inference.sampling import RowParams
from decode_test_utils import one_device_mesh
from test_speculative import DRAFT, TARGET
from test_speculative_serving import CASES, PAGED, Sink, build

VOCAB = TARGET["vocab_size"]


def bits(allowed: np.ndarray) -> np.ndarray:
  """The int32 bitmask row of a bool [V] (the bits past V clear: a constrained row)."""
  row = np.zeros(sampling.mask_words(len(allowed)) * 32, np.uint8)
  row[:len(allowed)] = allowed
  return np.packbits(row, bitorder="little").view(np.int32)


def rows_of(temperature: float, n: int) -> RowSampling:
  rows = decode_state.row_sampling([RowParams(temperature, 1.0, 0, seed) for seed in range(n)])
  return decode_state.seeded(rows)


def test_a_mask_allowing_the_argmax_leaves_greedy_as_it_was_and_sampling_stays_inside():
  logits = jax.random.normal(jax.random.key(0), (4, VOCAB)) * 3
  argmax = np.asarray(jnp.argmax(logits, -1))
  rng = np.random.default_rng(0)
  allowed = rng.random((4, VOCAB)) < 0.3
  allowed[1, argmax[1]] = True  # row 1: the argmax allowed
  allowed[2, argmax[2]] = False  # row 2: not
  allowed[3] = False
  allowed[3, 7] = True  # row 3: one token
  mask = np.stack([np.full(sampling.mask_words(VOCAB), sampling.ALL_TOKENS, np.int32)] + [bits(a) for a in allowed[1:]])
  np.testing.assert_array_equal(np.asarray(sampling.allowed_tokens(jnp.asarray(mask), VOCAB))[1:], allowed[1:])
  assert list(np.asarray(sampling.constrained_rows(jnp.asarray(mask)))) == [False, True, True, True]
  greedy, _, _ = decode_state.sample(logits, rows_of(0.0, 4), jnp.asarray(mask))
  greedy = np.asarray(greedy)
  assert greedy[0] == argmax[0] and greedy[1] == argmax[1] and greedy[3] == 7
  assert allowed[2, greedy[2]] and greedy[2] == np.flatnonzero(allowed[2])[np.argmax(np.asarray(logits)[2,
                                                                                     allowed[2]])]
  for seed in range(20):
    rows = decode_state.seeded(decode_state.row_sampling([RowParams(1.0, 0.9, 0, seed + i) for i in range(4)]))
    drawn = np.asarray(decode_state.sample(logits, rows, jnp.asarray(mask))[0])
    assert all(allowed[i, drawn[i]] for i in (1, 2, 3)), drawn


class Pattern:
  """A stand-in grammar (a scheduler.TokenConstraint): token i of the job must be `allowed(i)`; it ends after `length`."""

  def __init__(self, allowed, length: int = 10**6):
    self.allowed, self.length, self.got = allowed, length, []
    self.words = sampling.mask_words(VOCAB)

  def fill(self, row: np.ndarray) -> None:
    row[:] = bits(np.asarray([self.allowed(len(self.got), t) for t in range(VOCAB)]))

  def advance(self, token: int) -> bool:
    assert self.allowed(len(self.got), token), (len(self.got), token)
    self.got.append(token)
    return len(self.got) >= self.length

  def failure(self) -> str:
    return ""


PROMPTS = [[3, 9, 27], [100, 5, 6, 7, 8, 1], [1, 2, 3, 4, 5, 6, 7, 8]]


def run(engine, params, constraints, rows=None, max_tokens: int = 7, sink: Callable[[], Sink] = Sink) -> list[Any]:
  scheduler = sched.Scheduler(engine, params, max_queue=16).start()
  sinks = [sink() for _ in constraints]
  rows = rows or [RowParams()] * len(constraints)
  try:
    scheduler.submit([sched.Job(i, PROMPTS[i % len(PROMPTS)], max_tokens, r, s, constraint=c)
                      for i, (c, r, s) in enumerate(zip(constraints, rows, sinks))])
    for sink in sinks:
      assert sink.done.wait(300), "a job did not end"
    return sinks
  finally:
    scheduler.stop(30)


def check_masks(engine, params) -> None:
  """Greedy jobs: (0) unconstrained; (1) a mask that always allows job 0's greedy token of that prompt plus
  a third of the rest: the same tokens; (2) residues mod 3 cycling with the position, greedy and (3)
  sampled: every token, the first too, in its mask; (4) a grammar that ends after 3 tokens."""
  plain = run(engine, params, [None] * len(PROMPTS))
  want = {i: sink.tokens for i, sink in enumerate(plain)}
  keep_1 = lambda i, t: t == want[1][i] or t % 3 == 0  # noqa: E731
  cycle = lambda i, t: t % 3 == i % 3  # noqa: E731
  constraints = [None, Pattern(keep_1), Pattern(cycle), Pattern(cycle), Pattern(cycle, length=3)]
  rows = [RowParams()] * 3 + [RowParams(1.0, 1.0, 0, 5), RowParams()]
  got = run(engine, params, constraints, rows)
  assert got[0].tokens == want[0] and got[1].tokens == want[1]
  for sink in got[2:4]:
    assert [t % 3 for t in sink.tokens] == [i % 3 for i in range(len(sink.tokens))] and len(sink.tokens) == 7
  assert len(got[4].tokens) == 3 and got[4].reason == "stop"


@pytest.mark.parametrize("layout", ["dense", pytest.param("paged_prefix_chunked", marks=pytest.mark.slow)])
def test_constrained_jobs_get_only_allowed_tokens(layout):
  overrides = TARGET if layout == "dense" else dict(TARGET, **PAGED, prefill_chunk_size=4, prefix_caching=True)
  engine = Engine(Config.for_testing(**overrides), num_slots=3, mesh=one_device_mesh())
  check_masks(engine, engine.load_params(seed=1))


@pytest.mark.parametrize("case", [pytest.param("llama_dense", marks=pytest.mark.slow), "llama_paged_chunked_prefix"])
def test_speculative_constrained_slots_take_no_draft_and_stay_in_their_mask(case):
  target, target_params, spec, params = build(*CASES[case])
  check_masks(spec, params)


TINY_TARGET: dict[str, Any] = dict(TARGET)  # typed for Config.for_testing
VOCAB_SIZE = int(TINY_TARGET["vocab_size"])


def test_a_constrained_step_hands_its_mask_to_the_call_as_a_host_array() -> None:
  """A step's masks change every step: the decode call copies a host array within itself, where a jnp.asarray
  before it was a device copy of its own on the calling thread (issue 58). The tokens keep to the mask."""
  engine = Engine(Config.for_testing(**TINY_TARGET), num_slots=2, mesh=one_device_mesh())
  params = engine.load_params(seed=1)
  state = engine.insert_rows(engine.prefill(params, PROMPTS[:2]), engine.init_decode_state(), [0, 1], [0, 1])
  mask = np.stack([bits(np.arange(VOCAB_SIZE) % 3 == 0), bits(np.ones(VOCAB_SIZE, bool))])
  generate, kinds = engine._generate, []

  def recording(*args: Any, **kwargs: Any) -> Any:
    kinds.append(type(args[3]).__name__)  # params, state, block table, mask
    return generate(*args, **kwargs)

  setattr(engine, "_generate", recording)
  for _ in range(3):
    state, emitted = engine.decode_step(params, state, mask=mask)
    assert int(np.asarray(emitted.tokens)[0]) % 3 == 0
  assert kinds == ["ndarray"] * 3


@pytest.mark.parametrize("drafter", ["draft_model", "mtp"])
def test_a_speculative_round_hands_its_mask_to_the_call_as_a_host_array(drafter: str) -> None:
  """The same for a speculative round, with a draft model and with the model's MTP head."""
  params: tuple[Any, Any]  # the target's and the draft's (None: the MTP head is the target's)
  if drafter == "mtp":
    target = Engine(Config.for_testing(**TINY_TARGET, mtp_num_layers=1), num_slots=2, mesh=one_device_mesh())
    spec = speculative_engine.SpeculativeEngine(mtp_draft.MtpSpeculativeDecoder(target, 2))
    params = (target.load_params(seed=1), None)
  else:
    _, _, spec, params = build(TARGET, DRAFT, k=2, num_slots=2)
  state, _ = spec.prefill_insert(params, spec.init_decode_state(), PROMPTS[:2], [0, 1])
  mask = np.stack([bits(np.arange(VOCAB_SIZE) % 3 == 0), bits(np.ones(VOCAB_SIZE, bool))])
  decoder = spec.decoder
  round_, kinds = decoder._round, []

  def recording(*args: Any, **kwargs: Any) -> Any:
    kinds.append(type(args[-1]).__name__)  # the mask is the round's last argument
    return round_(*args, **kwargs)

  setattr(decoder, "_round", recording)
  for _ in range(3):
    state, emitted = spec.decode_step(params, state, mask=mask)
    assert int(np.asarray(emitted.tokens)[0, 0]) % 3 == 0 and int(np.asarray(emitted.counts)[0]) == 1
  assert kinds == ["ndarray"] * 3


ROW = bits(np.arange(VOCAB_SIZE) % 3 == 0)  # a mask row no other argument holds


def mask_arguments(owners: list[Any], admit: Any) -> dict[str, int]:
  """How many of the jitted calls' argument leaves while `admit()` runs hold ROW as a host / a device array."""
  found = {"host": 0, "device": 0}
  for owner in owners:
    for name, call in list(vars(owner).items()):
      if hasattr(call, "lower"):  # a jitted function

        def recording(*args: Any, _call: Any = call, **kwargs: Any) -> Any:
          for leaf in jax.tree_util.tree_leaves((args, kwargs)):
            if np.ndim(leaf) == 2 and np.shape(leaf)[-1] == ROW.size and leaf.dtype == np.int32 and \
                (np.asarray(leaf) == ROW).all(-1).any():
              found["host" if isinstance(leaf, np.ndarray) else "device"] += 1
          return _call(*args, **kwargs)

        setattr(owner, name, recording)
  admit()
  return found


@pytest.mark.parametrize("path", ["prefill", "prefill_insert", "prefill_chunk", "prefill_rests", "draft_model", "mtp",
                                  "mtp_prefill"])
def test_an_admission_hands_its_masks_to_the_call_as_a_host_array(path: str) -> None:
  """The first tokens' masks of every admission path as well (one device copy less per constrained admission)."""
  masks = np.stack([ROW, bits(np.ones(VOCAB_SIZE, bool))])
  prompts = [list(p) for p in PROMPTS[:2]]
  admit: Callable[[], object]
  if path in ("draft_model", "mtp", "mtp_prefill"):
    params: tuple[Any, Any]
    if path == "draft_model":
      _, _, spec, params = build(TARGET, DRAFT, k=2, num_slots=2)
    else:
      target = Engine(Config.for_testing(**TINY_TARGET, mtp_num_layers=1), num_slots=2, mesh=one_device_mesh())
      spec = speculative_engine.SpeculativeEngine(mtp_draft.MtpSpeculativeDecoder(target, 2))
      params = (target.load_params(seed=1), None)
    owners: list[Any] = [spec.decoder, spec.target]
    if path == "mtp_prefill":
      admit = lambda: spec.prefill(params, prompts, masks=masks)  # noqa: E731
    else:
      admit = lambda: spec.prefill_insert(params, spec.init_decode_state(), prompts, [0, 1], masks=masks)  # noqa: E731
  else:
    keys = {} if path in ("prefill", "prefill_insert") else dict(
        PAGED, **({"prefill_chunk_size": 4} if path == "prefill_chunk" else {"prefix_caching": True}))
    engine = Engine(Config.for_testing(**TINY_TARGET, **keys), num_slots=2, mesh=one_device_mesh())
    plain_params = engine.load_params(seed=1)
    owners = [engine, engine.page_prefill]
    state = engine.init_decode_state()
    starts = [engine.begin_prompt(slot, prompt) for slot, prompt in enumerate(prompts)] if keys else []
    admit = {"prefill": lambda: engine.prefill(plain_params, prompts, masks=masks),
             "prefill_insert": lambda: engine.prefill_insert(plain_params, state, prompts, [0, 1], masks=masks),
             "prefill_chunk": lambda: engine.prefill_chunk(plain_params, state, 0, prompts[0], starts[0],
                                                           mask=masks[:1]),
             "prefill_rests": lambda: engine.prefill_rests(plain_params, state, [0, 1], prompts, starts,
                                                           [RowParams()] * 2, masks=masks)}[path]
  found = mask_arguments(owners, admit)
  assert found["device"] == 0 and found["host"] >= 1, found
