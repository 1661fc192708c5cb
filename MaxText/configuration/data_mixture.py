"""A training mixture of several data sources (`data_mixture`, `data_mixture_schedule`): each
source is the run's data keys with a few of them replaced, a name and a sampling weight; the
schedule changes the weights from given steps on. Parsed and checked without I/O (the files are
opened by input_pipeline.check_sources)."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping, Sequence

from MaxText.configuration.config_fields import require as _require
from MaxText.configuration.config_yaml import split_items
from MaxText.errors import ConfigError, UserError
from MaxText.paths import storage

# The data keys a source may set for itself; the rest (packing, lengths, shuffling) are the run's.
SOURCE_KEYS = ("dataset_type", "dataset_path", "dataset_name", "train_split", "hf_path", "hf_data_files",
               "grain_train_files", "stream_train_files", "train_data_columns")
# Keys a source may repeat only with the run's value: another tokenizer's ids would mean other words.
_SAME_AS_RUN = ("tokenizer_type", "tokenizer_path", "add_bos", "add_eos")
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclasses.dataclass(frozen=True)
class MixtureSource:
  name: str  # also the metrics' `data/tokens/<name>` and the key of its saved position
  weight: float
  keys: tuple[tuple[str, Any], ...]  # SOURCE_KEYS it sets, in the order given

  def values(self, run_values: Mapping[str, Any]) -> dict[str, Any]:
    """The run's flat data values with this source's keys in place."""
    return {**run_values, **dict(self.keys)}


@dataclasses.dataclass(frozen=True)
class MixtureStage:
  step: int  # from this step on (0-based, the batch index) the weights are
  weights: tuple[float, ...]  # one per source, in data_mixture's order


def _weight(what: str, value: object) -> float:
  number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
  _require(math.isfinite(number) and number >= 0, f"{what} must be a number >= 0, got {value!r}")
  return number


def _check_sum(what: str, weights: Sequence[float]) -> None:
  _require(sum(weights) > 0, f"{what} sum to {sum(weights):g}; give at least one source a positive weight")
  # Weights near the float limit overflow their sum, and every probability would then be 0.
  _require(math.isfinite(sum(weights)), f"{what} sum past the largest float; they are relative, so scale them "
           "down (3 and 1 mean the same as 3e300 and 1e300)")


def _name(i: int, value: object) -> str:
  # YAML reads `name:` as null and `name: yes` as true: neither is the name the user meant.
  name = str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
  _require(bool(_NAME.fullmatch(name)), f"data_mixture source {i + 1} needs a name of letters, digits, '_', '-' "
           f"or '.' (it names its metrics and saved position), got {value!r}")
  return name


def _setting(name: str, key: str, value: object) -> object:
  """A source's value of `key` in the type the run's key has (as the run's own keys are read), or
  a ConfigError: a list of files or a number would otherwise reach the readers."""
  if key == "train_data_columns":
    if isinstance(value, str):
      value = split_items(f"data_mixture source {name!r} {key}", value)
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
      return tuple(value)
  elif value is None:  # YAML's `grain_train_files:` with nothing after it: the key's "needs" line follows
    return ""
  elif isinstance(value, (str, int, float)) and not isinstance(value, bool):
    return str(value)
  hint = " (comma-separated files or globs in one string)" if key.endswith("_files") else ""
  raise ConfigError(f"data_mixture source {name!r} sets {key} to {value!r}; it must be a "
                    f"{'list of column names' if key == 'train_data_columns' else 'string'}{hint} like the "
                    f"run's {key}")


def _same_path(key: str, a: object, b: object) -> bool:
  """tokenizer_path spelled another way (./tok.model, its absolute path): the same file, by text alone (no I/O)."""
  if key != "tokenizer_path" or not isinstance(a, str) or not isinstance(b, str) or not a or not b:
    return False
  try:
    return storage.resolve(a) == storage.resolve(b)
  except UserError:
    return False


def _mappings(value: object, message: str) -> list[Mapping[str, Any]]:
  """`value` as the list of mappings it must be, else the ConfigError `message`."""
  _require(isinstance(value, (list, tuple)) and all(isinstance(s, Mapping) for s in value), message)
  return [s for s in value if isinstance(s, Mapping)] if isinstance(value, (list, tuple)) else []


def _reads(source: MixtureSource, run_values: Mapping[str, Any]) -> dict[str, Any]:
  """What data `source` reads: its SOURCE_KEYS over the run's (lists as tuples, as a source holds them)."""
  values = source.values(run_values)
  return {key: tuple(values[key]) if isinstance(values[key], list) else values[key] for key in SOURCE_KEYS}


def parse_sources(value: object, run_values: Mapping[str, Any]) -> tuple[MixtureSource, ...]:
  """data_mixture: a list of mappings {name, weight, and any of SOURCE_KEYS}."""
  if not value:
    return ()
  specs = _mappings(value, "data_mixture must be a list of sources, each like {name: web, weight: 0.7, "
                    f"dataset_type: hf, hf_data_files: web/*.jsonl}}, got {value!r}")
  sources, names = [], set()
  for i, spec in enumerate(specs):
    name = _name(i, spec.get("name", ""))
    _require(name not in names, f"data_mixture names source {name!r} twice; give each source its own name")
    names.add(name)
    _require("weight" in spec, f"data_mixture source {name!r} has no weight; add weight: <number >= 0>")
    weight = _weight(f"data_mixture source {name!r}'s weight", spec["weight"])
    keys = []
    for key, setting in spec.items():
      if key in ("name", "weight"):
        continue
      if key in _SAME_AS_RUN:
        _require(setting == run_values[key] or _same_path(key, setting, run_values[key]),
                 f"data_mixture source {name!r} sets {key}={setting!r} but the run "
                 f"uses {run_values[key]!r}: every source must share the run's tokenizer (another tokenizer's "
                 "ids mean other words); retokenize the source or drop the key")
        continue
      _require(key in SOURCE_KEYS, f"data_mixture source {name!r} sets {key!r}, which a source cannot set; "
               f"a source sets only {', '.join(SOURCE_KEYS)} (the rest are the run's)")
      keys.append((key, _setting(name, key, setting)))
    sources.append(MixtureSource(name, weight, tuple(keys)))
  _check_sum("data_mixture's weights", [s.weight for s in sources])
  # Two names for the same data would read it twice as often, split over two sets of metrics.
  for i, source in enumerate(sources):
    twin = next((other for other in sources[:i] if _reads(other, run_values) == _reads(source, run_values)), None)
    _require(twin is None, f"data_mixture sources {twin.name if twin else ''!r} and {source.name!r} read the same "
             "data; make them one source whose weight is their sum")
  return tuple(sources)


def parse_schedule(value: object, sources: Sequence[MixtureSource]) -> tuple[MixtureStage, ...]:
  """data_mixture_schedule: a list of mappings {step: N, <source name>: weight, ...}, steps rising;
  a source a stage does not name gets weight 0 from that step."""
  if not value:
    return ()
  _require(bool(sources), "data_mixture_schedule changes the weights of data_mixture's sources; set data_mixture "
           "or leave the schedule empty")
  specs = _mappings(value, "data_mixture_schedule must be a list like [{step: 1000, web: 0.5, code: 0.5}], "
                    f"got {value!r}")
  names = [s.name for s in sources]
  stages: list[MixtureStage] = []
  for spec in specs:
    step = spec.get("step")
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
      raise ConfigError(f"data_mixture_schedule entry {dict(spec)} needs step: <whole number >= 0>")
    _require(not stages or step > stages[-1].step, f"data_mixture_schedule steps must rise; {step} follows "
             f"{stages[-1].step if stages else ''}")
    unknown = [k for k in spec if k != "step" and k not in names]
    _require(not unknown, f"data_mixture_schedule step {step} names {unknown}, not sources of data_mixture "
             f"({', '.join(names)})")
    weights = tuple(_weight(f"data_mixture_schedule step {step}'s weight for {n!r}", spec.get(n, 0)) for n in names)
    _check_sum(f"data_mixture_schedule step {step}'s weights", weights)
    stages.append(MixtureStage(step, weights))
  return tuple(stages)
