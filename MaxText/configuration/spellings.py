"""Old spellings of config keys and tool arguments: each still works, maps to its one canonical
name and prints one deprecation line per process; both spellings with different values is an error.

`RENAMED_KEYS` holds the config keys (base.yml) that were renamed. Saved records (a run's
config.yml, a checkpoint's model_config.yml) written before a rename are read through
`upgrade` without a warning: the user did not type them. Tools with arguments of their own
(converters, the logit checker, argparse tools) keep their renamed arguments beside their
parsers and report them through `warn_deprecated` (configuration/tool_args.py).

`VALUE_ALIASES` holds old boolean keys that each chose one value of a newer key (`use_sft=True`
is `objective=sft`); `False` only asserts that the newer key is not that value. `SWITCHES` holds
boolean keys whose True and False each choose a value of a newer key (`megablox=False` is
`moe_grouped_matmul=ragged_dot`).
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
    # upstream MaxText's names, so that its recipes' tuning blocks run as written:
    # its per-step metrics file in the run folder (gs:// when base_output_directory is) is metrics.jsonl
    "gcs_metrics": "enable_jsonl_metrics",
    # the trace's first step and length; a step count of the run, not since a restart
    "skip_first_n_steps_for_profiler": "profile_start_step",
    "profiler_steps": "profile_steps",
    # its `context` mesh axis is our `sequence` axis: the activations split along the sequence, the
    # attention by context_parallel_strategy, the weights sharded over it as over fsdp (its own
    # ici_sequence_parallelism names an axis its mesh no longer has)
    "ici_context_parallelism": "ici_sequence_parallelism",
    "dcn_context_parallelism": "dcn_sequence_parallelism",
}

# old boolean key -> (the key it chose a value of, the value True means)
VALUE_ALIASES: dict[str, tuple[str, str]] = {
    "use_sft": ("objective", "sft"),
    "use_dpo": ("objective", "dpo"),
    "use_grpo": ("objective", "grpo"),
}
# upstream MaxText's boolean keys that chose between two values of a key of ours:
# old key -> (the key, the value True means, the value False means)
SWITCHES: dict[str, tuple[str, str, str]] = {
    # the grouped matmul of sparse_matmul: the Pallas TPU kernel, else jax.lax.ragged_dot
    "megablox": ("moe_grouped_matmul", "megablox", "ragged_dot"),
}
# what a saved record meant when it held the flags of a key and none of them was True
VALUE_ALIAS_NONE: dict[str, str] = {"objective": "lm"}

_warned: set[str] = set()


def warn_deprecated(old: str, new: str) -> None:
  """`warning: 'old' is deprecated; use 'new'` on stderr, once per process per old spelling."""
  if old in _warned:
    return
  _warned.add(old)
  print(f"warning: '{old}' is deprecated; use '{new}'", file=sys.stderr, flush=True)


def warn_model_name(name: str, ours: str) -> None:
  """One warning line per process that upstream MaxText's model name `name` reads `ours` here."""
  if name not in _warned:
    _warned.add(name)
    print(f"warning: model_name '{name}' is upstream MaxText's name; here it is '{ours}'", file=sys.stderr, flush=True)


def clash_error(old: str, new: str, old_value: object, new_value: object, source: str,
                shown: tuple[str, str] | None = None) -> ConfigError:
  """`shown`: the two keys as the user spelled them, when not as config keys (M_<KEY> variables)."""
  old_name, new_name = shown or (old, new)
  if old in SWITCHES:  # old_value is already the value it chose
    return ConfigError(f"'{old_name}' (deprecated) chooses {new_name}={old_value!r} but {source} also gives "
                       f"{new_name}={new_value!r}; keep only '{new_name}'")
  return ConfigError(f"'{old_name}' (deprecated) and '{new_name}' name the same setting but {source} gives them "
                     f"different values ({old_value!r} and {new_value!r}); keep only '{new_name}'")


def same_value(a: object, b: object) -> bool:
  return a == b or str(a) == str(b)


def _flag(key: str, value: object, source: str) -> bool:
  if isinstance(value, bool):
    return value
  text = str(value).strip().lower()
  if text in ("true", "1", "yes", "on", "false", "0", "no", "off"):
    return text in ("true", "1", "yes", "on")
  if key in SWITCHES:
    new, on, off = SWITCHES[key]
    raise ConfigError(f"{key} ({source}) must be true or false, got {value!r}; it is deprecated: set {new}={on} "
                      f"(true) or {new}={off} (false)")
  new, chosen = VALUE_ALIASES[key]
  raise ConfigError(f"{key} ({source}) must be true or false, got {value!r}; it is deprecated: set {new}={chosen}")


def switch_value(key: str, value: object, source: str) -> object:
  """The value of the new key that `key`=`value` spells: a SWITCHES key's choice, else `value`."""
  if key not in SWITCHES:
    return value
  _, on, off = SWITCHES[key]
  return on if _flag(key, value, source) else off


def fold_value_aliases(values: Mapping[str, Any], flags: Mapping[str, Any], source: str,
                       warn: bool = True) -> dict[str, Any]:
  """`values` (one source's keys, without old flags) with the old flags `flags` of the same source
  folded in: a True flag sets its key; two flags choosing different values, or a flag that
  contradicts the key given beside it, is an error."""
  out = dict(values)
  chosen: dict[str, tuple[str, str]] = {}  # new key -> (the flag that set it, its value)
  for old, given in flags.items():
    new, value = VALUE_ALIASES[old]
    if warn:
      warn_deprecated(old, f"{new}={value}")
    on = _flag(old, given, source)
    if new in values:
      if on != (values[new] == value):
        raise ConfigError(f"'{old}' (deprecated) says {old}={on} but {source} also gives {new}={values[new]!r}; "
                          f"keep only '{new}'")
      continue
    if not on:
      continue
    if new in chosen and chosen[new][1] != value:
      raise ConfigError(f"'{chosen[new][0]}' and '{old}' (deprecated) from {source} choose two values of {new}; "
                        f"set only {new}={chosen[new][1]} or {new}={value}")
    chosen[new] = (old, value)
    out[new] = value
  return out


def negations(flags: Mapping[str, Any], values: Mapping[str, Any], source: str) -> dict[str, tuple[str, str, str]]:
  """The False flags of one source that set nothing there (`values` holds no key of theirs): old flag
  -> (the key, the value it rules out, `source`), for a check against the lower sources' value."""
  out = {}
  for old, given in flags.items():
    new, value = VALUE_ALIASES[old]
    if new not in values and not _flag(old, given, source):
      out[old] = (new, value, source)
  return out


def negation_error(old: str, new: str, value: str, source: str) -> ConfigError:
  return ConfigError(f"{old}=False (deprecated, from {source}) contradicts {new}={value}, which the config file or "
                     f"another lower source sets; set {new} to the value you want instead")


def canonical(values: Mapping[str, Any], source: str, renamed: Mapping[str, str] = RENAMED_KEYS,
              warn: bool = True) -> dict[str, Any]:
  """`values` with every old spelling replaced by its new one (order kept); `source` names where
  they come from, for the clash error. `warn=False` for saved records."""
  flags = {k: v for k, v in values.items() if k in VALUE_ALIASES}
  if flags:
    rest = canonical({k: v for k, v in values.items() if k not in VALUE_ALIASES}, source, renamed, warn)
    return fold_value_aliases(rest, flags, source, warn)
  out: dict[str, Any] = {}
  for key, value in values.items():
    new = SWITCHES[key][0] if key in SWITCHES else renamed.get(key)
    if new is None:
      if key in out and not same_value(out[key], value):  # the old spelling came first
        old = next(o for o in values if o != key and (SWITCHES[o][0] if o in SWITCHES else renamed.get(o)) == key)
        raise clash_error(old, key, out[key], value, source)
      out[key] = value
      continue
    if warn:
      warn_deprecated(key, new)
    value = switch_value(key, value, source)
    if new in out and not same_value(out[new], value):
      raise clash_error(key, new, value, out[new], source)
    out[new] = value
  return out


def upgrade(values: Mapping[str, Any]) -> dict[str, Any]:
  """A saved record's keys under their current names (a record never holds both spellings; if one
  does, the current one wins)."""
  flags = {k: v for k, v in values.items() if k in VALUE_ALIASES}
  out = {RENAMED_KEYS.get(k, k): v for k, v in values.items()
         if RENAMED_KEYS.get(k) not in values and k not in VALUE_ALIASES}
  for old, given in flags.items():
    new, value = VALUE_ALIASES[old]
    if new not in values and given is True:
      out[new] = value
  for old in flags:
    new = VALUE_ALIASES[old][0]
    if new not in out:
      out[new] = VALUE_ALIAS_NONE[new]
  return out


def rename(key: str, renamed: Mapping[str, str] = RENAMED_KEYS) -> str:
  """The canonical name of one given key, warning when it is an old spelling."""
  new = SWITCHES[key][0] if key in SWITCHES else renamed.get(key)
  if new is None:
    return key
  warn_deprecated(key, new)
  return new
