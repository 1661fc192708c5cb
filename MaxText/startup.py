"""Start-up, the same for every entry point that builds a model config:

    argv / M_* env ─► Overrides ─► gs:// buckets answer ─► JAX platform ─► XLA / libtpu flags
                  ─► jax.distributed (multi-process) ─► Config for the local devices

The order matters: the platform and the flags must be set before the JAX backend starts, and
`jax.distributed.initialize` must run before anything asks for devices. `train.py`,
`decode.py` and `generate_param_only_checkpoint.py` call `load_config`; `train_compile.py`,
whose target is a topology rather than the local devices, uses the first steps only.
"""

from __future__ import annotations

from typing import Mapping

import jax

from MaxText import accelerators, distributed, storage, storage_retry, xla_flags
from MaxText import config as config_lib


def read_overrides(argv: list[str], extra_paths: Mapping[str, str] | None = None) -> config_lib.Overrides:
  """The user's layers (YAML, env, argv), every key checked, and every gs:// bucket a path key
  (or a tool's own path flag in `extra_paths`) names reachable, before any backend starts or
  anything compiles."""
  overrides = config_lib.parse_overrides(argv)
  paths = {key: str(overrides.peek(key)) for key in config_lib.PATH_KEYS}
  storage_retry.configure(float(overrides.peek("storage_retry_seconds")))
  storage.check_buckets({**paths, **(extra_paths or {})}, float(overrides.peek("storage_timeout_seconds")))
  return overrides


def start_backend(overrides: config_lib.Overrides, hardware: str | None = None) -> None:
  """Selects the JAX platform (`hardware=` unless the caller decides) and exports the flags."""
  accelerators.select_jax_platforms(hardware or str(overrides.peek("hardware")))
  xla_flags.export_flags(str(overrides.peek("libtpu_init_args")), str(overrides.peek("xla_flags")))


def load_config(argv: list[str], reads_run: bool = False) -> config_lib.Config:
  """The whole start-up for the local devices. `reads_run`: a tool reading a run or checkpoint
  (see config.resolve_values)."""
  overrides = read_overrides(argv)
  start_backend(overrides)
  distributed.initialize(accelerators.requested_platform(), int(overrides.peek("distributed_init_timeout_seconds")),
                         int(overrides.peek("distributed_heartbeat_timeout_seconds")))
  return config_lib.build_config(overrides, accelerators.local_target(), reads_run)


def log(message: str) -> None:
  """Prints on process 0 only (every process runs the same program)."""
  if jax.process_index() == 0:
    print(message, flush=True)
