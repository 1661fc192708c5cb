"""Several decode steps in one device call: the loop that keeps the host off the critical path.

Shape legend (as engine.py): T slots, K steps per call (decode_steps_per_call), E stop tokens.

`run` repeats an engine's one-step function up to K times inside a `lax.while_loop`. Before each
step it works out which slots are live: a slot steps while its sequence is shorter than its end
(`ends_T`: prompt length + max new tokens; positions count from 0, so the sequence holds
next_position + 1 tokens) and its latest token is not a stop token. A slot that stops emits
nothing more, and its position, pending token and PRNG key stay where they stopped (the step
rewrites its pending token's cache entry with the same values; the engine keeps recurrent states).
Live slots compute exactly what one call per step computes, so the tokens are the same. The loop
ends early once no slot is live.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from MaxText.inference.decode_state import DecodeState
from MaxText.inference.engine_api import TokenLogprobs

# (state, live_T) -> (the state after one step for every slot, (tokens [T], their TokenLogprobs))
Step = Callable[[DecodeState, jax.Array], tuple[DecodeState, tuple[jax.Array, TokenLogprobs]]]


def live_rows(state: DecodeState, ends_T: jax.Array, stop_E: jax.Array) -> jax.Array:
  """bool [T]: the slots that may take another step."""
  stopped_T = jnp.any(state.tokens_B[:, None] == stop_E[None, :], axis=-1)
  return (state.next_positions_B + 1 < ends_T) & ~stopped_T


def _where_rows(live_T: jax.Array, new: Any, old: Any) -> Any:
  """`new` in the live slots, `old` elsewhere (leaves with the slot on axis 0)."""
  return jax.tree.map(lambda n, o: jnp.where(live_T.reshape((-1,) + (1,) * (n.ndim - 1)), n, o), new, old)


def run(step: Step, state: DecodeState, k: int, ends_T: jax.Array, stop_E: jax.Array
        ) -> tuple[DecodeState, tuple[jax.Array, jax.Array, TokenLogprobs]]:
  """(state after up to k steps, (tokens [T, k], counts [T], TokenLogprobs fields [T, k] / [T, k, top])):
  slot t emitted tokens[t, :counts[t]] (traced)."""
  num_slots = state.tokens_B.shape[0]
  shapes = jax.eval_shape(lambda s: step(s, jnp.ones((num_slots,), bool))[1], state)
  buffers = jax.tree.map(lambda x: jnp.zeros((x.shape[0], k) + tuple(x.shape[1:]), x.dtype), shapes)

  def cond(carry: tuple[jax.Array, DecodeState, Any, jax.Array]) -> jax.Array:
    i, now, _, _ = carry
    return (i < k) & jnp.any(live_rows(now, ends_T, stop_E))

  def body(carry: tuple[jax.Array, DecodeState, Any, jax.Array]) -> tuple[jax.Array, DecodeState, Any, jax.Array]:
    i, now, out, counts_T = carry
    live_T = live_rows(now, ends_T, stop_E)
    new, emitted = step(now, live_T)
    moved = DecodeState(new.caches, *_where_rows(live_T, (new.next_positions_B, new.tokens_B, new.sampling),
                                                 (now.next_positions_B, now.tokens_B, now.sampling)))
    out = jax.tree.map(lambda buffer, x: buffer.at[:, i].set(x), out, emitted)
    return i + 1, moved, out, counts_T + live_T.astype(jnp.int32)

  _, state, (tokens_TK, logprobs), counts_T = jax.lax.while_loop(
      cond, body, (jnp.int32(0), state, buffers, jnp.zeros((num_slots,), jnp.int32)))
  return state, (tokens_TK, counts_T, logprobs)
