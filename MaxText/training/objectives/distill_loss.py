"""The distillation loss (objective=distill; the objective is distill.py's): per token, a KL
divergence between the teacher's and the student's next-token distributions, mixed with the
cross-entropy on the labels.

With τ = distill_temperature, p = softmax(teacher logits / τ), q = softmax(student logits / τ):

    forward_kl:  KL(p || q) = Σ_v p(v) (log p(v) - log q(v))      (mass-covering; Hinton et al.)
    reverse_kl:  KL(q || p) = Σ_v q(v) (log q(v) - log p(v))      (mode-seeking; MiniLLM, on-policy)
    loss = α τ² KL + (1 - α) CE(labels)                           (α = distill_alpha; CE at τ = 1)

τ² keeps the KL term's gradient on the scale of the label term's as τ grows (Hinton et al.).

With distill_top_k = k > 0 the sum runs over K, the teacher's k most likely tokens at that
position, and both distributions are renormalised over K:

    p_K(v) = p(v) / Σ_{u∈K} p(u),    q_K(v) = q(v) / Σ_{u∈K} q(u)      (v ∈ K)

so a k-term KL between proper distributions (0 when the student matches the teacher on K up to
scale). The teacher is kept as its K (int32 indices [B, L, k]) and log p on them (float32 [B, L, k]),
never as [B, L, vocab] logits beside the student's: that is what a precomputed file would hold.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

FORWARD_KL, REVERSE_KL = "forward_kl", "reverse_kl"


@dataclasses.dataclass(frozen=True)
class TeacherTargets:
  """The teacher's distribution at every position: log p over the full vocabulary ([B, L, V],
  `indices` None) or over its top k ([B, L, k] log p at `indices` [B, L, k], not renormalised)."""

  logps: jax.Array
  indices: jax.Array | None = None


def teacher_targets(teacher_logits_BLV: jax.Array, temperature: float, top_k: int) -> TeacherTargets:
  """The teacher's log-probs at `temperature`: all of them (top_k 0) or its `top_k` most likely."""
  logps_BLV = jax.nn.log_softmax(teacher_logits_BLV.astype(jnp.float32) / temperature, axis=-1)
  if top_k <= 0:
    return TeacherTargets(jax.lax.stop_gradient(logps_BLV))
  logps_BLK, indices_BLK = jax.lax.top_k(logps_BLV, top_k)
  return TeacherTargets(jax.lax.stop_gradient(logps_BLK), indices_BLK.astype(jnp.int32))


def token_kl(student_logits_BLV: jax.Array, teacher: TeacherTargets, kind: str, temperature: float) -> jax.Array:
  """The KL divergence [B, L] at every position (see the module docstring)."""
  scaled_BLV = student_logits_BLV.astype(jnp.float32) / temperature
  if teacher.indices is None:
    log_q, log_p = jax.nn.log_softmax(scaled_BLV, axis=-1), teacher.logps
  else:
    picked_BLK = jnp.take_along_axis(scaled_BLV, teacher.indices, axis=-1)
    log_q = picked_BLK - jax.nn.logsumexp(picked_BLK, axis=-1, keepdims=True)
    log_p = teacher.logps - jax.nn.logsumexp(teacher.logps, axis=-1, keepdims=True)
  if kind == FORWARD_KL:
    return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
  assert kind == REVERSE_KL, kind
  return jnp.sum(jnp.exp(log_q) * (log_q - log_p), axis=-1)


def mixed(kl: jax.Array, xent: jax.Array, alpha: float, temperature: float) -> jax.Array:
  """The loss from the KL term and the label cross-entropy (the same shapes; sums or per token)."""
  return alpha * temperature ** 2 * kl + (1.0 - alpha) * xent
