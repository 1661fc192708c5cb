"""The compile settings that the test session shares with the processes it starts.

- One persistent compilation cache: tests/conftest.py points JAX_COMPILATION_CACHE_DIR at a temporary
  directory for the session (one a developer has set already is kept), so the many tests that train the
  same tiny models, in this process or through `python3 -m MaxText.train`, compile each program once. A
  hit loads the executable XLA compiled before, so results are bit for bit those of a fresh compile.
- LLVM's optimisation of the CPU code off (FAST_COMPILE_FLAG): most of each tiny program's compile is
  that optimisation. Every HLO pass, the sharding and the schedule still run as they do for users; only
  float32 rounding differs (the order of accumulation), and the tests' tolerances are float32's.
  getting_started/First_run.md (section 7) has the figures.

Tests that give a subprocess a clean environment add `**jax_cache_env()` to it and set its XLA_FLAGS with
`cpu_xla_flags(devices)`.
"""

from __future__ import annotations

import os


CACHE_VARIABLES = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"


def jax_cache_env() -> dict[str, str]:
  """The cache settings of this session, for a subprocess's environment ({} when the cache is off)."""
  return {name: os.environ[name] for name in CACHE_VARIABLES if name in os.environ}


def cpu_xla_flags(devices: int = 1) -> str:
  """XLA_FLAGS for a test's subprocess: `devices` simulated CPU devices, compiled like the test session's."""
  return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE_FLAG}"
