"""The JAX persistent compilation cache that the test session shares with the processes it starts.

tests/conftest.py points JAX_COMPILATION_CACHE_DIR at a temporary directory for the session (one a
developer has set already is kept), so the many tests that train the same tiny models, in this
process or through `python3 -m MaxText.train`, compile each program once. A hit loads the executable
XLA compiled before, so results are bit for bit those of a fresh compile. Tests that give a
subprocess a clean environment add `**jax_cache_env()` to it.
"""

from __future__ import annotations

import os


CACHE_VARIABLES = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")


def jax_cache_env() -> dict[str, str]:
  """The cache settings of this session, for a subprocess's environment ({} when the cache is off)."""
  return {name: os.environ[name] for name in CACHE_VARIABLES if name in os.environ}

