"""SIGTERM, what TPU/GKE preemption sends, as "checkpoint at the next step boundary"; and the
elastic supervisor's SIGTERM that grows a job back, whose step goes to the local tier only."""

from __future__ import annotations

import signal
import types

import jax
import numpy as np
from jax.experimental import multihost_utils

from MaxText.paths import storage

# In the run folder while MaxText/elastic.py stops the job to grow it back: the processes that
# stay hold the stop's step on their local disks and hand it to the returning ones, so the slow
# persistent save of a preemption is not needed.
GROW_BACK_MARKER = "elastic_grow_back"


def is_grow_back(run_dir: str) -> bool:
  """Whether the SIGTERM being handled is the elastic supervisor's grow-back stop; every process
  gets process 0's answer (collective: call it at the same step everywhere)."""
  seen = np.int32(jax.process_index() == 0 and storage.exists(storage.join(run_dir, GROW_BACK_MARKER)))
  if jax.process_count() == 1:
    return bool(seen)
  return bool(multihost_utils.broadcast_one_to_all(seen))


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
