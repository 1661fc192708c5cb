"""The JAX persistent compilation cache that the test session shares with the processes it starts.

tests/conftest.py points JAX_COMPILATION_CACHE_DIR at a temporary directory for the session (one a
developer has set already is kept), so the many tests that train the same tiny models, in this
process or through `python3 -m MaxText.train`, compile each program once. A hit loads the executable
XLA compiled before, so results are bit for bit those of a fresh compile. Tests that give a
subprocess a clean environment add `**jax_cache_env()` to it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import jax
from jax.experimental.compilation_cache import compilation_cache

CACHE_VARIABLES = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")


def jax_cache_env() -> dict[str, str]:
  """The cache settings of this session, for a subprocess's environment ({} when the cache is off)."""
  return {name: os.environ[name] for name in CACHE_VARIABLES if name in os.environ}


@contextlib.contextmanager
def compiled_afresh() -> Iterator[None]:
  """Compiles inside skip the persistent cache. XLA:CPU cannot run an executable that was loaded from the
  cache and then serialized again (NOT_FOUND: Function ... not found), so a step written to
  compiled_trainstep_file must come from a fresh compile, as it does in a user's run."""
  previous = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()  # the cache decides once per process whether it is used
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", previous)
    compilation_cache.reset_cache()
