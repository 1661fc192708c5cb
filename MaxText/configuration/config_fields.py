"""How a config group's dataclass fields relate to base.yml keys.

A group field is either
  * `key()`: it holds the base.yml key of the same name (lists become tuples; a `-1 = auto`
    value may be resolved by the group), so a new key is one base.yml line plus one field;
  * `derived()`: computed by the group from keys (scaled sizes, the global batch, paths);
  * `record(Group)`: a nested group (ModelConfig's rope, attn, moe, ...), so a layer can take
    just the part it reads. Its keys still count as the outer group's, each by its own name.
Field metadata also says what a resume must keep (`fixed_on_resume`) and which keys fix a
checkpoint's architecture; run_record and the converters read those lists from here.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING, Any, Mapping

from MaxText.errors import ConfigError

if TYPE_CHECKING:
  from _typeshed import DataclassInstance

_KEY = "key"
_RECORD = "record"
FIXED = "fixed_on_resume"
ARCHITECTURE = "architecture"

# What a resume keeps, by what it decides (the order of the resume report).
MODEL = "model shape and function"
LAYOUT = "state layout"
OPTIMIZER = "optimizer state"
DATA_POSITION = "data position"
FIXED_KINDS = (MODEL, LAYOUT, OPTIMIZER, DATA_POSITION)


def key(*, fixed_on_resume: str = "", architecture: bool = False) -> Any:
  """A field holding the base.yml key of its own name. `architecture`: the key fixes a
  checkpoint's parameter shapes or the function they compute (implies fixed_on_resume=MODEL)."""
  fixed = MODEL if architecture else fixed_on_resume
  assert fixed in ("", *FIXED_KINDS), fixed
  return dataclasses.field(metadata={_KEY: True, FIXED: fixed, ARCHITECTURE: architecture})


def derived(default: Any = dataclasses.MISSING, *, fixed_on_resume: str = "") -> Any:
  """A field the group computes from keys."""
  return dataclasses.field(default=default, metadata={_KEY: False, FIXED: fixed_on_resume, ARCHITECTURE: False})


def record(group: type) -> Any:
  """A field holding a nested group; the key helpers below walk into it."""
  return dataclasses.field(metadata={_KEY: False, FIXED: "", ARCHITECTURE: False, _RECORD: group})


WARNED: set[str] = set()  # the warnings a config build printed in this process


def warn_once(line: str) -> None:
  """`line` on stderr once per process: tools (and a run's draft or teacher) build a config more than once."""
  if line not in WARNED:
    WARNED.add(line)
    print(line, file=sys.stderr, flush=True)


def require(condition: bool, message: str) -> None:
  if not condition:
    raise ConfigError(message)


def key_fields(group: type) -> list[dataclasses.Field[Any]]:
  """The group's own key fields (not those of its nested records)."""
  return [f for f in dataclasses.fields(group) if f.metadata.get(_KEY)]


def nested_fields(group: type) -> list[dataclasses.Field[Any]]:
  """Every field of the group and, in place of each record field, its record's fields (recursively)."""
  out: list[dataclasses.Field[Any]] = []
  for f in dataclasses.fields(group):
    inner = f.metadata.get(_RECORD)
    out += nested_fields(inner) if inner is not None else [f]
  return out


def key_values(group: DataclassInstance) -> dict[str, Any]:
  """The key fields of a built group and of its nested records, by key name."""
  out: dict[str, Any] = {}
  for f in dataclasses.fields(group):
    if f.metadata.get(_RECORD) is not None:
      out.update(key_values(getattr(group, f.name)))
    elif f.metadata.get(_KEY):
      out[f.name] = getattr(group, f.name)
  return out


def read_keys(group: type, values: Mapping[str, Any], **resolved: object) -> dict[str, Any]:
  """The group's key fields from the flat values (lists as tuples), with `resolved` replacing
  the values the group worked out itself (auto -1 values, parsed ids)."""
  out = {}
  for f in key_fields(group):
    value = values[f.name]
    out[f.name] = _items(f.name, value, f.type) if isinstance(value, (list, tuple)) else value
  unknown = set(resolved) - set(out)
  assert not unknown, f"not key fields of {group.__name__}: {unknown}"
  return {**out, **resolved}


# A list of names (its field annotated so; the module's annotations are text). Lists of numbers (token ids,
# weights) are checked by their groups, which take a command line's `5,17` as text too.
_NAMES = "tuple[str, ...]"


def _items(name: str, value: list[Any] | tuple[Any, ...], annotation: object) -> tuple[Any, ...]:
  """`value` as the key's tuple; in a list of names a number is its text, and any other item (`true`, a mapping) is one
  line naming the key and the item, not a failure wherever the item is first used."""
  if annotation != _NAMES:
    return tuple(value)
  out = []
  for index, item in enumerate(value):
    if isinstance(item, (int, float)) and not isinstance(item, bool):
      item = str(item)
    if not isinstance(item, str):
      hint = (" (YAML reads an unquoted true/false, yes/no, on/off or null as no text: quote it)"
              if item is None or isinstance(item, bool) else "")
      raise ConfigError(f"{name}'s items must be text; item {index} is {type(item).__name__} {str(item)[:80]!r}{hint}")
    out.append(item)
  return tuple(out)


def text_list_keys(groups: tuple[type, ...]) -> set[str]:
  """Keys holding a list of names, whose numbers a YAML file keeps as typed (`[1.10]` is '1.10', not '1.1')."""
  return {f.name for group in groups for f in nested_fields(group)
          if f.metadata.get(_KEY) and f.type == _NAMES}


def keys_where(groups: tuple[type, ...], name: str, value: object) -> tuple[str, ...]:
  """Keys and derived values whose field metadata `name` equals `value`, in field order, each once."""
  found: dict[str, None] = {}
  for group in groups:
    for f in nested_fields(group):
      if f.metadata.get(name) == value:
        found[f.name] = None
  return tuple(found)


def all_keys(groups: tuple[type, ...]) -> set[str]:
  return {f.name for group in groups for f in nested_fields(group) if f.metadata.get(_KEY)}
