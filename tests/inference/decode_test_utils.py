"""Shared helpers of the decode tests: engine greedy tokens and the no-cache reference."""

from __future__ import annotations

import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import Mesh

from MaxText.platform import sharding
from MaxText.configuration.config_groups import MESH_AXES
from MaxText.inference import scheduler as sched
from MaxText.inference.engine import Engine
from MaxText.inference.sampling import RowParams

_APPLY: dict[int, tuple] = {}


def _jitted_apply(spec):
  """One jitted forward per model spec (a new jax.jit object would compile again)."""
  if id(spec) not in _APPLY:
    _APPLY[id(spec)] = (spec, jax.jit(sharding.unsharded()(spec.apply)))  # one device: no constraints
  return _APPLY[id(spec)][1]


def one_device_mesh() -> Mesh:
  """Tests that are not about sharding decode on one device: 8 simulated devices only add collectives."""
  return Mesh(np.asarray(jax.devices()[:1]).reshape((1,) * len(MESH_AXES)), MESH_AXES)


def engine_tokens(engine: Engine, params, prompts, num_new: int) -> list[list[int]]:
  """Greedy tokens through prefill (batched) + insert + generate."""
  prefix = engine.prefill(params, prompts)
  state = engine.init_decode_state()
  for row in range(len(prompts)):
    state = engine.insert(prefix, state, slot=row, row=row)
  out = [[int(t)] for t in np.asarray(prefix.first_tokens_B)]
  for _ in range(num_new - 1):
    state, tokens = engine.generate(params, state)
    for row, token in enumerate(np.asarray(tokens)[:len(prompts)]):
      out[row].append(int(token))
  return out


def uncached_greedy(spec, params, prompt: list[int], num_new: int, length: int) -> list[int]:
  """The full forward pass over a fixed [1, length] buffer each step (causal: padding after the
  last real token cannot change its logits), so it compiles once."""
  apply = _jitted_apply(spec)
  buffer = np.zeros((1, length), np.int32)
  buffer[0, :len(prompt)] = prompt
  positions = jnp.arange(length)[None]
  out = []
  for step in range(num_new):
    last = len(prompt) + step - 1
    logits = apply(params, jnp.asarray(buffer), positions, jnp.ones((1, length), jnp.int32))
    token = int(jnp.argmax(logits[0, last]))
    out.append(token)
    if last + 1 < length:
      buffer[0, last + 1] = token
  return out


def count_calls(owner: Any, names: list[str]) -> dict[str, int]:
  """Wraps each named method of `owner` to count its calls; returns the live counts."""
  calls = {name: 0 for name in names}
  for name in names:
    def counted(*args, _method=getattr(owner, name), _name=name, **kwargs):
      calls[_name] += 1
      return _method(*args, **kwargs)
    setattr(owner, name, counted)
  return calls


class Hiding:
  """`engine` without the named attributes: an engine that lacks an optional engine_api protocol."""

  def __init__(self, engine: Any, *names: str):
    self._engine, self._names = engine, names

  def __getattr__(self, name: str) -> Any:
    if name in self._names:
      raise AttributeError(name)
    return getattr(self._engine, name)


def served(engine: Engine, params, prompts: list[list[int]], rows: list, indices: list[int],
           max_new: int) -> dict[int, list[int]]:
  """Each job's tokens through a scheduler, every job submitted before its first loop (so admitted together);
  each must end by length."""
  tokens: dict[int, list[int]] = {i: [] for i in indices}
  done = threading.Semaphore(0)

  def sink(i):
    def emit(event):
      if isinstance(event, sched.Tokens):
        tokens[i] += event.tokens
      elif isinstance(event, sched.Done):
        assert event.reason == "length", event
        done.release()
    return emit

  s = sched.Scheduler(engine, params, max_queue=8)
  s.submit([sched.Job(0, prompts[i], max_new, rows[i], sink(i)) for i in indices])
  s.start()
  try:
    for _ in indices:
      assert done.acquire(timeout=120)
  finally:
    s.stop()
  return tokens


# A tiny engine, four prompts and their rows' sampling, as the insert tests use them (test_speculative_inserts,
# test_prefill_insert).
INSERT_BASE = dict(base_emb_dim=32, base_num_query_heads=2, base_num_kv_heads=2, head_dim=16, base_mlp_dim=64,
                   base_num_decoder_layers=1, vocab_size=64, max_target_length=32, max_prefill_predict_length=8,
                   per_device_batch_size=1, print_config=False, dtype="float32")
INSERT_PROMPTS = [[5, 9, 2], [7, 1, 3, 3, 8, 4, 4, 1], [11, 4], [2, 2, 6, 1, 9]]
INSERT_ROWS = [RowParams(seed=0), RowParams(seed=1), RowParams(temperature=1.0, seed=7), RowParams(seed=3)]
INSERT_PAGED = dict(kv_cache_layout="paged", kv_page_size=4, prefix_caching="false")
