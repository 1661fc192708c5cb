"""The gated delta rule (Gated DeltaNet's linear attention) in its two forms, and the short causal conv
in front of it.

Per value head, with a state S [Q, W] (key dim × value dim), each token t does
  S ← exp(g_t) · S                       (decay, g_t <= 0)
  S ← S + k_t ⊗ β_t (v_t − Sᵀ k_t)       (delta rule: write only what S does not yet predict)
  o_t = Sᵀ q_t
`recurrent` runs that token by token (decoding, and the reference); `chunked` gives the same outputs
in chunks of `chunk_size` tokens: inside a chunk the updates are folded into one lower-triangular
solve (the WY / UT form), so the work is matmuls, and only the state crosses chunks (a `lax.scan`).
Both are pure JAX (no Pallas kernel yet): XLA turns the chunk's matmuls into MXU / tensor-core work,
and the scan carries one [Q, W] state per head, so the chunked form is linear in length.

Legend beyond layers/__init__.py: Y value heads of the linear attention, Q its key head dim,
W its value head dim, U chunks, c positions in a chunk (c2 the second index of a pair),
Z conv channels, w the conv width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# g added at a document's first token (packed rows): exp of it is ~1e-13, so no state crosses
# documents; a finite value keeps the chunked form's differences of cumulative sums exact enough.
DOCUMENT_RESET_LOG_DECAY = -30.0


def recurrent(q_BLYQ: jax.Array, k_BLYQ: jax.Array, v_BLYW: jax.Array, g_BLY: jax.Array, beta_BLY: jax.Array,
              state_BYQW: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Token by token: (outputs [B, L, Y, W], final state [B, Y, Q, W]), all in float32."""

  def one_token(state: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
    q_BYQ, k_BYQ, v_BYW, g_BY, beta_BY = xs
    state = state * jnp.exp(g_BY)[:, :, None, None]
    predicted_BYW = jnp.einsum("byqw,byq->byw", state, k_BYQ)
    delta_BYW = (v_BYW - predicted_BYW) * beta_BY[:, :, None]
    state = state + k_BYQ[:, :, :, None] * delta_BYW[:, :, None, :]
    return state, jnp.einsum("byqw,byq->byw", state, q_BYQ)

  xs = tuple(jnp.moveaxis(x.astype(jnp.float32), 1, 0) for x in (q_BLYQ, k_BLYQ, v_BLYW, g_BLY, beta_BLY))
  state, out_LBYW = jax.lax.scan(one_token, state_BYQW.astype(jnp.float32), xs)
  return jnp.moveaxis(out_LBYW, 0, 1), state


def chunked(q_BLYQ: jax.Array, k_BLYQ: jax.Array, v_BLYW: jax.Array, g_BLY: jax.Array, beta_BLY: jax.Array,
            state_BYQW: jax.Array, chunk_size: int) -> tuple[jax.Array, jax.Array]:
  """The same as `recurrent`, chunk by chunk (see the module docstring); float32."""
  b, length, y, _ = k_BLYQ.shape
  wd = v_BLYW.shape[-1]
  c = chunk_size
  pad = -length % c
  # Padding tokens have k = v = β = 0 and g = 0: they neither write nor decay the state.
  def chunks(x: jax.Array) -> jax.Array:  # [B, L, Y, ...] -> [B, Y, U, c, ...]
    x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape((b, (length + pad) // c, c) + x.shape[2:])
    return jnp.moveaxis(x, 3, 1)

  q, k, v = chunks(q_BLYQ), chunks(k_BLYQ), chunks(v_BLYW)
  g_BYUc, beta_BYUc = chunks(g_BLY), chunks(beta_BLY)
  cum_BYUc = jnp.cumsum(g_BYUc, axis=-1)
  lower_cc = jnp.tril(jnp.ones((c, c), bool))[None, None, None]  # [1, 1, 1, c, c]: no implicit rank promotion
  eye_cc = jnp.eye(c, dtype=jnp.float32)[None, None, None]
  # The log decay between two tokens of a chunk, Σ g over (j, i], summed directly rather than as
  # cum_i − cum_j: with strong decay the cumulative sums grow large and their difference loses digits.
  strictly_lower = jnp.tril(jnp.ones((c, c), bool), -1)[None, None, None]
  gap = jnp.cumsum(jnp.where(strictly_lower, jnp.broadcast_to(g_BYUc[..., :, None], g_BYUc.shape + (c,)), 0.0), axis=-2)
  decay_BYUcc = jnp.where(lower_cc, jnp.exp(jnp.where(lower_cc, gap, 0.0)), 0.0)
  k_beta = k * beta_BYUc[..., None]
  # The chunk's updates as one unit-lower-triangular system (I + L) X = rhs, L strictly lower.
  strict_BYUcc = jnp.einsum("byucq,byudq->byucd", k_beta, k) * decay_BYUcc * (1.0 - eye_cc)
  inverse_BYUcc = unit_lower_inverse(strict_BYUcc + eye_cc)
  solve = lambda rhs: jnp.einsum("byucd,byud...->byuc...", inverse_BYUcc, rhs)  # noqa: E731
  u_BYUcW = solve(v * beta_BYUc[..., None])  # what each token writes, before the state's prediction
  w_BYUcQ = solve(k_beta * jnp.exp(cum_BYUc)[..., None])  # how each token reads the chunk's incoming state
  intra_BYUcc = jnp.einsum("byucq,byudq->byucd", q, k) * decay_BYUcc
  q_decayed = q * jnp.exp(cum_BYUc)[..., None]
  last_BYU = cum_BYUc[..., -1]
  to_end_BYUc = jnp.flip(jnp.cumsum(jnp.flip(g_BYUc, -1), axis=-1), -1) - g_BYUc  # Σ g over (i, end]
  k_to_end = k * jnp.exp(to_end_BYUc)[..., None]

  def one_chunk(state: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
    u, w, intra, q_dec, k_dec, last = xs
    v_new = u - jnp.einsum("bycq,byqw->bycw", w, state)
    out = jnp.einsum("bycq,byqw->bycw", q_dec, state) + jnp.einsum("bycd,bydw->bycw", intra, v_new)
    state = state * jnp.exp(last)[:, :, None, None] + jnp.einsum("bycq,bycw->byqw", k_dec, v_new)
    return state, out

  per_chunk = tuple(jnp.moveaxis(x, 2, 0) for x in (u_BYUcW, w_BYUcQ, intra_BYUcc, q_decayed, k_to_end, last_BYU))
  state, out_UBYcW = jax.lax.scan(one_chunk, state_BYQW.astype(jnp.float32), per_chunk)
  out_BLYW = jnp.moveaxis(out_UBYcW, 0, 1).transpose(0, 1, 3, 2, 4).reshape(b, length + pad, y, wd)
  return out_BLYW[:, :length], state


def unit_lower_inverse(m: jax.Array) -> jax.Array:
  """The inverse of unit-lower-triangular matrices [..., n, n], by matmuls only: diagonal blocks of
  size s are inverted first (size 1: the unit diagonal), then each pair of them joins into a block
  of size 2s through inv([[A, 0], [B, D]]) = [[A⁻¹, 0], [−D⁻¹ B A⁻¹, D⁻¹]]. Every intermediate is
  a block of the true inverse, so nothing grows past it (a power series of the strictly lower part
  would, and cancel). jax.scipy's solve_triangular is not used: on CPU its LAPACK kernel waits for
  work it queues on the thread pool that the simulated devices' programs occupy, and a sharded
  program deadlocks."""
  n = m.shape[-1]
  size = 1 << max(n - 1, 0).bit_length()  # the next power of two; padded with the identity
  batch = m.shape[:-2]
  eye = jnp.eye(size, dtype=m.dtype)
  if size != n:
    m = jnp.pad(m, [(0, 0)] * len(batch) + [(0, size - n), (0, size - n)])
    padding_row = jnp.broadcast_to((jnp.arange(size) >= n)[:, None], m.shape)
    m = jnp.where(padding_row, jnp.broadcast_to(eye, m.shape), m)
  inverse = jnp.broadcast_to(eye, batch + (size, size))
  s = 1
  while s < size:
    k = size // (2 * s)  # blocks of size 2s on the diagonal
    # [..., k, 2, s, k, 2, s]: block (i, p) x (j, r) of size s; the diagonal pairs i == j are wanted.
    m_blocks = m.reshape(batch + (k, 2, s, k, 2, s))
    inv_blocks = inverse.reshape(batch + (k, 2, s, k, 2, s))
    below = jnp.einsum("...iaiB->...iaB", m_blocks[..., :, 1, :, :, 0, :])       # B [..., k, s, s]
    top = jnp.einsum("...iaiB->...iaB", inv_blocks[..., :, 0, :, :, 0, :])       # A⁻¹
    bottom = jnp.einsum("...iaiB->...iaB", inv_blocks[..., :, 1, :, :, 1, :])    # D⁻¹
    corner = -jnp.einsum("...iab,...ibc,...icd->...iad", bottom, below, top)     # −D⁻¹ B A⁻¹
    zeros = jnp.zeros_like(corner)
    joined = jnp.stack([jnp.stack([top, zeros], -3), jnp.stack([corner, bottom], -3)], -4)  # [..., k, 2, 2, s, s]
    joined = jnp.moveaxis(joined, -2, -3)  # [..., k, 2 (p), s (a), 2 (r), s (b)]
    diagonal = jnp.eye(k, dtype=m.dtype)
    inverse = jnp.einsum("...ipaqb,ij->...ipajqb", joined, diagonal).reshape(batch + (size, size))
    s *= 2
  return inverse[..., :n, :n]


def causal_conv(x_BLZ: jax.Array, state_BwZ: jax.Array, kernel_wZ: jax.Array,
                segment_ids_BL: jax.Array | None = None, lengths_B: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
  """Depthwise causal conv of width w over the sequence, preceded by the w − 1 inputs in `state_BwZ`
  (zeros at a sequence's start): (silu of the conv [B, L, Z], the last w − 1 inputs as the next state).
  With `segment_ids_BL`, a token never reads an earlier document's inputs (packed rows). With
  `lengths_B`, only each row's first lengths[b] tokens are real: the next state ends at the last of them."""
  width = kernel_wZ.shape[0]
  length = x_BLZ.shape[1]
  history = jnp.concatenate([state_BwZ.astype(x_BLZ.dtype), x_BLZ], axis=1)
  out = jnp.zeros(x_BLZ.shape, jnp.float32)
  for j in range(width):  # tap j reads the input width − 1 − j places back
    back = width - 1 - j
    tap_BLZ = history[:, j:j + length].astype(jnp.float32)
    if segment_ids_BL is not None and back > 0:
      earlier = jnp.pad(segment_ids_BL, ((0, 0), (back, 0)), constant_values=-1)[:, :length]
      tap_BLZ = tap_BLZ * (earlier == segment_ids_BL)[:, :, None]
    out = out + tap_BLZ * kernel_wZ[j].astype(jnp.float32)[None, None, :]
  if lengths_B is None:
    return jax.nn.silu(out).astype(x_BLZ.dtype), history[:, history.shape[1] - (width - 1):]
  # history[b, n : n + w − 1] are the w − 1 inputs up to token n − 1 (the state's own when n < w − 1).
  last = jax.vmap(lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, width - 1, axis=0))(history, lengths_B)
  return jax.nn.silu(out).astype(x_BLZ.dtype), last


def l2_normalize(x: jax.Array, epsilon: float = 1e-6) -> jax.Array:
  """x / sqrt(Σx² + ε) over the last dim, in float32 (Gated DeltaNet's query and key norm)."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + epsilon)
