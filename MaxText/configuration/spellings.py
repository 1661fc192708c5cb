"""Old spellings of config keys and tool arguments: each still works, maps to its one canonical
name and prints one deprecation line per process; both spellings with different values is an error.

`RENAMED_KEYS` holds the config keys (base.yml) that were renamed. Saved records (a run's
config.yml, a checkpoint's model_config.yml) written before a rename are read through
`upgrade` without a warning: the user did not type them. Tools with arguments of their own
(converters, the logit checker, argparse tools) keep their renamed arguments beside their
parsers and report them through `warn_deprecated` (configuration/tool_args.py).
"""

from __future__ import annotations

import sys
from typing import Any, Mapping

from MaxText.errors import ConfigError

# old config key -> the key it was renamed to
RENAMED_KEYS: dict[str, str] = {
    # decode and RL sampling share one suffix family: <context>_sampling_{temperature,top_p,top_k}
    "decode_sampling_nucleus_p": "decode_sampling_top_p",
    "rl_temperature": "rl_sampling_temperature",
    "rl_top_p": "rl_sampling_top_p",
    "rl_top_k": "rl_sampling_top_k",
    # not HF's partial_rotary_factor (the rotated share of the features, our partial_rotary_factor):
    # rope_type=proportional's share of frequency pairs that turn, over the whole head
    "rope_partial_rotary_factor": "rope_proportional_rotated_fraction",
    # RoPE's theta is rope_max_timescale (and rope_local_max_timescale) for the text layers
    "vision_rope_theta": "vision_rope_max_timescale",
}

_warned: set[str] = set()


def warn_deprecated(old: str, new: str) -> None:
  """`warning: 'old' is deprecated; use 'new'` on stderr, once per process per old spelling."""
  if old in _warned:
    return
  _warned.add(old)
  print(f"warning: '{old}' is deprecated; use '{new}'", file=sys.stderr, flush=True)


def clash_error(old: str, new: str, old_value: Any, new_value: Any, source: str) -> ConfigError:
  return ConfigError(f"'{old}' (deprecated) and '{new}' name the same setting but {source} gives them different "
                     f"values ({old_value!r} and {new_value!r}); keep only '{new}'")


def same_value(a: Any, b: Any) -> bool:
  return a == b or str(a) == str(b)


def canonical(values: Mapping[str, Any], source: str, renamed: Mapping[str, str] = RENAMED_KEYS,
              warn: bool = True) -> dict[str, Any]:
  """`values` with every old spelling replaced by its new one (order kept); `source` names where
  they come from, for the clash error. `warn=False` for saved records."""
  out: dict[str, Any] = {}
  for key, value in values.items():
    new = renamed.get(key)
    if new is None:
      if key in out and not same_value(out[key], value):  # the old spelling came first
        old = next(o for o, n in renamed.items() if n == key and o in values)
        raise clash_error(old, key, out[key], value, source)
      out[key] = value
      continue
    if warn:
      warn_deprecated(key, new)
    if new in out and not same_value(out[new], value):
      raise clash_error(key, new, value, out[new], source)
    out[new] = value
  return out


def upgrade(values: Mapping[str, Any]) -> dict[str, Any]:
  """A saved record's keys under their current names (a record never holds both spellings; if one
  does, the current one wins)."""
  return {RENAMED_KEYS.get(k, k): v for k, v in values.items() if RENAMED_KEYS.get(k) not in values}


def rename(key: str, renamed: Mapping[str, str] = RENAMED_KEYS) -> str:
  """The canonical name of one given key, warning when it is an old spelling."""
  new = renamed.get(key)
  if new is None:
    return key
  warn_deprecated(key, new)
  return new
