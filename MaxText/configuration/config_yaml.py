"""The config's YAML files, read with libyaml's parser (PyYAML's pure-Python one where PyYAML lacks it) and YAML 1.1's
surprises taken out: a key set twice, octal, base 60, dates and `=` are refused or stay text, a text key keeps a
number as typed, and each problem is one line naming the file and the line. Also the one rule for a list typed as
comma-separated text (`split_items`): the list keys', the path lists' and the tools' list arguments."""

from __future__ import annotations

import re
import reprlib
from typing import Any, Collection

import yaml

from MaxText.errors import ConfigError
from MaxText.paths import storage

_STR, _INT, _FLOAT = "tag:yaml.org,2002:str", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_MERGE = "tag:yaml.org,2002:merge"
# Past 4300 digits Python refuses to read an integer (a ValueError traceback); no count is that long.
DECIMAL = re.compile(r"[-+]?[0-9]{1,4000}")
# Deeper than this a value is no config value, and printing it overflows Python's stack.
MAX_DEPTH = 64
# More than this, counted through YAML aliases (`&a [*b, *b, ...]` nine deep is 9**9), is no config value either.
MAX_VALUES = 1_000_000


def loader_on(parser: type) -> type:
  """The config loader on `parser`'s reader and parser: libyaml's (yaml.CSafeLoader) or PyYAML's own
  (yaml.SafeLoader), which the tests compare."""

  class Loader(parser):  # type: ignore[misc]
    """yaml.safe_load's loader, refusing a mapping that sets a key twice (PyYAML keeps the last silently, so a
    recipe's remat placement or batch size typed twice ran with whichever came second). On libyaml's parser where
    PyYAML has it: the pure-Python one spent most of a config's construction reading base.yml."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
      lines: dict[Any, int] = {}
      merged = 0
      for key_node, _ in node.value:
        line = key_node.start_mark.line + 1
        if key_node.tag == _MERGE:  # `<<: *anchor`'s keys may be set again, `<<` itself only once
          if merged:
            raise yaml.constructor.ConstructorError(
                None, None, f"it merges with << twice (lines {merged} and {line}); merge several at once with "
                "`<<: [*a, *b]`", key_node.start_mark)
          merged = line
          continue
        key = self.construct_object(key_node, deep=deep)
        if isinstance(key, str) and key in lines:
          raise yaml.constructor.ConstructorError(
              None, None, f"it sets {key} twice (lines {lines[key]} and {line}); keep one", key_node.start_mark)
        if isinstance(key, str):
          lines[key] = line
      return super().construct_mapping(node, deep)

    def construct_decimal(self, node: yaml.ScalarNode) -> int | str:
      text = str(self.construct_scalar(node))
      return int(text) if DECIMAL.fullmatch(text) else text

  # Not YAML 1.1's integers, dates and values: `steps: 010` was octal 8, `1:30` base-60 90 (`1:30.5` 90.5), a
  # run_name of `2024_05_01` the number 20240501, one of `2024-05-01` a date and one of `=` an error naming a tag.
  # Only plain decimals are numbers; other spellings stay text, which coerce reads by the key's type (an int key
  # takes 010, 1_000, 0x10 and 1e3).
  Loader.yaml_implicit_resolvers = {
      first: [(tag, rx) for tag, rx in resolvers
              if tag not in (_INT, _FLOAT, "tag:yaml.org,2002:timestamp", "tag:yaml.org,2002:value")]
      for first, resolvers in Loader.yaml_implicit_resolvers.items()}
  Loader.add_implicit_resolver(_INT, re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$"), list("-+0123456789"))
  Loader.add_constructor(_INT, Loader.construct_decimal)
  Loader.add_implicit_resolver(_FLOAT, re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?
                      |\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?
                      |[-+]?\.(?:inf|Inf|INF)
                      |\.(?:nan|NaN|NAN))$""", re.X), list("-+0123456789."))
  Loader.add_constructor(_MERGE, Loader.construct_scalar)  # `run_name: <<` is text; `<<:` as a key still merges
  return Loader


Loader = loader_on(getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def size_problem(value: object) -> str:
  """What makes `value` too large to be a config value ('' if nothing), walked without recursion."""
  stack, count = [(value, 0)], 0
  while stack:
    item, depth = stack.pop()
    if depth > MAX_DEPTH:
      return f"nests lists or mappings more than {MAX_DEPTH} deep; no config value does"
    count += 1
    if count > MAX_VALUES:
      return f"holds more than {MAX_VALUES} values (counting what YAML aliases repeat); no config needs that many"
    if isinstance(item, (list, tuple)):
      stack.extend((child, depth + 1) for child in item)
    elif isinstance(item, dict):
      stack.extend((child, depth + 1) for child in item.values())
  return ""


def shown(value: object) -> str:
  """repr(value), cut short: a pasted file's worth of text or digits would fill the terminal with one line."""
  if value is None:  # `steps:` with nothing after it; `null` and `~` read the same
    return "an empty value (None)"
  text = reprlib.repr(value) if size_problem(value) else repr(value)
  return text if len(text) <= 200 else f"{text[:60]}... ({len(text)} characters)"


# Commas other scripts' keyboards type (fullwidth, ideographic, small): no list item means one.
_OTHER_COMMAS = "\uff0c\u3001\ufe50\uff64"


def split_items(key: str, text: str) -> list[str]:
  """A list typed as comma-separated text (`5,17,42`), each item stripped; the one rule of every key and field
  that takes one. As in YAML's `[5, 17,]`, one trailing comma is allowed; an empty item elsewhere (`1,,2`, `,1`)
  is refused, not dropped, as is a bracketed list YAML could not read (`[1,,2]` was the items '[1' and '2]')."""
  body = text.strip()
  if body.count("[") != body.count("]"):
    more_open = body.count("[") > body.count("]")
    raise ConfigError(f"{key}={shown(body)} has a {'[' if more_open else ']'!r} without its "
                      f"{']' if more_open else '['!r}; write [a, b] or a,b")
  opened = body.startswith("[") and body.endswith("]")
  items = [item.strip() for item in (body[1:-1] if opened else body).split(",")]
  if items == [""]:
    return []
  if len(items) > 1 and not items[-1]:
    items.pop()
  for i, item in enumerate(items):
    if not item:
      raise ConfigError(f"{key} has an empty item at position {i + 1} of {shown(text.strip())} (two commas in a "
                        "row, or one first); remove the extra comma")
    other = next((c for c in item if c in _OTHER_COMMAS), "")
    if other:
      raise ConfigError(f"{key}'s item {shown(item)} holds {other!r} (U+{ord(other):04X}), not a comma that "
                        "separates items; separate items with ','")
    if len(item) >= 2 and item[0] == item[-1] and item[0] in "'\"":
      raise ConfigError(f"{key}'s item {i + 1} is quoted ({shown(item)}); quote the whole list or none of it "
                        "(a,b or \"a,b\")")
  if opened:  # its items are fine, so YAML refused something else: a ':' or a '{' inside
    raise ConfigError(f"{key}={shown(body)} is not a list YAML reads; write [a, b] or a,b")
  return items


def whole_numbers(key: str, items: Collection[Any], like: str) -> tuple[int, ...]:
  """A list's items as integers; the first that is none is named, not the whole list echoed."""
  numbers = []
  for i, item in enumerate(items):
    text = str(item)
    if isinstance(item, bool) or not DECIMAL.fullmatch(text.strip()):
      spaces = " (separate items with ',', not spaces)" if len(text.split()) > 1 else ""
      raise ConfigError(f"{key} must be comma-separated integers like {like}; item {i + 1} is {shown(item)}{spaces}")
    numbers.append(int(text))
  return tuple(numbers)


_HINTS = {"\t": "YAML indents with spaces, not tabs", "@": "quote a value that starts with @",
          "`": "quote a value that starts with `", "%": "quote a value that starts with %"}


def _parse_error(path: str, e: yaml.YAMLError, data: bytes) -> ConfigError:
  """One line naming the file, the line and column and what is wrong there (PyYAML's first line named only the
  construct it was reading, e.g. `while parsing a flow sequence`)."""
  if isinstance(e, yaml.reader.ReaderError):
    fix = "; save it as UTF-8" if "UTF" in e.reason or "utf" in e.reason or b"\x00" in data else ""
    line = data[:e.position].count(b"\n") + 1
    return ConfigError(f"cannot read {path!r}: {e.reason} (line {line}, byte {e.position}){fix}")
  problem = getattr(e, "problem", None) or str(e).splitlines()[0]
  mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
  where = f" line {mark.line + 1}, column {mark.column + 1}:" if mark is not None else ""
  context = getattr(e, "context", None)
  hint = ""
  if mark is not None:  # libyaml's "found character that cannot start any token" does not say which
    lines = data.decode("utf-8-sig", "replace").splitlines() + [""]
    text = lines[min(mark.line, len(lines) - 1)]
    found = text[mark.column] if mark.column < len(text) else ""
    hint = ("a byte-order mark (U+FEFF) inside the file, as joining two files leaves it: delete it" if "\ufeff" in text
            else _HINTS.get(found, "") if "cannot start any token" in problem else "")
  return ConfigError(f"cannot parse {path!r}:{where} {problem}{f' ({context})' if context else ''}"
                     f"{f' ({hint})' if hint else ''}")


def load(path: str, data: bytes, text_keys: Collection[str] = (), loader_class: type | None = None) -> Any:
  """The file's one document; a key of `text_keys` set to a plain number keeps its text (`run_name: 1.10` was
  '1.1', `.inf` 'inf', `+5` '5': the number's repr, not what was typed)."""
  loader = None
  try:
    loader = (loader_class or Loader)(data)  # PyYAML's own reader decodes the whole file here
    node = loader.get_single_node()
    value = None if node is None else loader.construct_document(node)
  except yaml.constructor.ConstructorError as e:
    line = f" (line {e.problem_mark.line + 1})" if e.problem_mark and "line" not in str(e.problem) else ""
    raise ConfigError(f"cannot use {path!r}{line}: {e.problem}") from None
  except yaml.YAMLError as e:
    raise _parse_error(path, e, data) from None
  finally:
    if loader is not None:
      loader.dispose()
  if text_keys and isinstance(value, dict) and isinstance(node, yaml.MappingNode):
    # node.value holds merged pairs first, then the mapping's own: the last pair of a key is the one it kept
    last = {k.value: v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.tag == _STR}
    for key, value_node in last.items():
      if key not in text_keys:
        continue
      if _typed_number(value_node):
        value[key] = value_node.value
      elif isinstance(value_node, yaml.SequenceNode) and isinstance(value[key], list) \
          and len(value[key]) == len(value_node.value):  # a list of names: its numbers as typed too
        value[key] = [item.value if _typed_number(item) else v for item, v in zip(value_node.value, value[key])]
  return value


def value_of(text: str, items_as_typed: bool = False) -> Any:
  """One command-line value read as YAML (yaml.YAMLError when it is none); `items_as_typed`: a list's plain numbers
  stay the text typed (a list of names: `[1.10]` is '1.10')."""
  loader = Loader(text)
  try:
    node = loader.get_single_node()
    value = None if node is None else loader.construct_document(node)
  finally:
    loader.dispose()
  if items_as_typed and isinstance(node, yaml.SequenceNode) and isinstance(value, list) \
      and len(value) == len(node.value):
    value = [item.value if _typed_number(item) else v for item, v in zip(node.value, value)]
  return value


def _typed_number(node: yaml.Node) -> bool:
  return isinstance(node, yaml.ScalarNode) and node.tag in (_INT, _FLOAT) and not node.style


def read_yaml(path: Any, stop_at: Any = None, text_keys: Collection[str] = (),
              _below: tuple[str, ...] = ()) -> dict[str, Any]:
  """Reads one YAML mapping (a local or gs:// file), following `base_config: parent.yml`
  (relative to the file).

  The chain stops before `stop_at` (used to keep base.yml out of a recipe's own values). `text_keys`: keys whose
  values are text, kept as typed where YAML reads a number. `_below`: the files that named this one as their base
  (a chain that comes back to one of them is an error).
  """
  path = str(path)
  if not path.strip():  # `train.py "$CONFIG"` with CONFIG unset named the current folder
    raise ConfigError("the config file path is empty; name a .yml file, e.g. configs/base.yml")
  if stop_at is not None and storage.same_file(path, str(stop_at)):
    return {}
  for child in _below:  # a user's own base.yml naming `base_config: base.yml` names itself
    if storage.same_file(path, child):
      chain = " -> ".join(repr(p) for p in (*_below, path))
      raise ConfigError(f"base_config goes round in a circle ({chain}); point one of them at another file")
  if not storage.is_file(path):
    raise ConfigError(f"config file {path!r} is a directory; name a .yml file in it" if storage.is_dir(path)
                      else f"config file {path!r} does not exist")
  data = load(path, storage.read_bytes(path), text_keys)
  if data is None:  # an empty file, or one of comments only
    data = {}
  if not isinstance(data, dict):  # `0`, `false` or `[]` read as no keys at all
    raise ConfigError(f"{path!r} must hold a mapping of key: value lines, not {shown(data)}")
  for key in data:  # `5: 3` or `yes: 1` reached the key checks as a number or a boolean: a TypeError traceback
    if not isinstance(key, str):
      raise ConfigError(f"{path!r} has a key YAML reads as {key!r}, not a name: config keys are names like steps")
  problem = size_problem(data)
  if problem:
    raise ConfigError(f"{path!r} {problem}")
  parent = data.pop("base_config", None)
  if parent is None:
    return data
  if not isinstance(parent, str) or not parent.strip():  # `base_config: [a.yml]` said "config file \"['a.yml']\""
    raise ConfigError(f"{path!r}: base_config must name one .yml file, got {shown(parent)}")
  # join keeps an absolute parent as it is; a gs:// parent is taken whole
  parent_path = str(parent) if storage.is_remote(str(parent)) else storage.join(storage.parent(path), str(parent))
  return {**read_yaml(parent_path, stop_at, text_keys, (*_below, path)), **data}
