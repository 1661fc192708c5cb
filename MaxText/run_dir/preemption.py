"""SIGTERM, what TPU/GKE preemption sends, as "checkpoint at the next step boundary"."""

from __future__ import annotations

import signal
import types

import jax
from jax.experimental import multihost_utils


class PreemptionWatcher:
  """Turns SIGTERM (what TPU/GKE preemption sends) into "checkpoint at the next step boundary".

  With several processes JAX's own preemption sync point makes every process pick the same
  step; a single process installs a SIGTERM handler that sets a flag.
  """

  def __init__(self) -> None:
    self._flag = False
    self._multi = jax.process_count() > 1
    self._previous = None
    if not self._multi:
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

  def _on_sigterm(self, signum: int, frame: types.FrameType | None) -> None:
    self._flag = True

  def reached(self, step: int) -> bool:
    if self._multi:
      return multihost_utils.reached_preemption_sync_point(step)
    return self._flag

  def close(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None
