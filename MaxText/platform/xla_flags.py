"""Exports XLA / libtpu flags from the config before the JAX backend starts.

Flags the user already exported win: ours are added only for flag names not
already present, so `XLA_FLAGS=--foo=1 train.py xla_flags=--foo=2` keeps 1.
"""

from __future__ import annotations

import os
import shlex
from typing import MutableMapping

from MaxText.errors import ConfigError

# Flags of libtpu's TPU compiler (upstream's recipes pass them in LIBTPU_INIT_ARGS): jaxlib's XLA does not
# know them, and one in XLA_FLAGS aborts the process at backend start ("Unknown flag in XLA_FLAGS").
_LIBTPU_ONLY = ("--xla_tpu_", "--xla_sc_", "--xla_jf_")
# ... except DebugOptions of jaxlib's own XLA that share the prefix: XLA_FLAGS takes these.
_JAXLIB_FLAGS = frozenset(("--xla_tpu_detect_nan", "--xla_tpu_detect_inf"))


def _flag_name(flag: str) -> str:
  return flag.split("=", 1)[0]


def merge_flags(existing: str, extra: str) -> str:
  """`existing` plus each flag of `extra` whose name `existing` does not set."""
  present = {_flag_name(f) for f in shlex.split(existing)}
  added = [f for f in shlex.split(extra) if _flag_name(f) not in present]
  return " ".join(([existing] if existing.strip() else []) + added)


def export_flags(libtpu_init_args: str, xla_flags: str, environ: MutableMapping[str, str] | None = None) -> None:
  """Sets LIBTPU_INIT_ARGS and XLA_FLAGS; call before anything initialises a JAX backend."""
  environ = os.environ if environ is None else environ
  misplaced = [f for f in shlex.split(xla_flags) if f.startswith(_LIBTPU_ONLY) and _flag_name(f) not in _JAXLIB_FLAGS]
  if misplaced:
    raise ConfigError(f"xla_flags has libtpu's TPU compiler flag {misplaced[0]}, which XLA_FLAGS aborts on; pass TPU "
                      f"flags in libtpu_init_args (LIBTPU_INIT_ARGS), e.g. libtpu_init_args={misplaced[0]}")
  for name, extra in (("LIBTPU_INIT_ARGS", libtpu_init_args), ("XLA_FLAGS", xla_flags)):
    if extra.strip():
      environ[name] = merge_flags(environ.get(name, ""), extra)
