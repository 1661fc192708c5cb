"""One argument syntax for every tool: `key=value`, as the config keys are given.

Tools with arguments of their own beside the config keys (the converters, the logit checker, the
planner) split theirs out with `split_tool_args`, or typed into a record of their own with
`parse_tool_record`; tools with an argparse parser (the tokenizer trainer, data
preparation, the TPU launchers, the benchmarks) parse with `parse_args`, which reads `key=value`
for every option (its key is the option's dest; a flag takes `key=true|false`). The old spellings
keep working with one deprecation line each (spellings.warn_deprecated): `--key VALUE`,
`--key=VALUE`, `--KEY`, `--some-key`, and keys a tool renamed (its `renamed`: old -> new). One
setting given twice under different spellings with different values is one `error:` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import sys
import types
import typing
from typing import Any, Callable, Mapping, NoReturn, Sequence, TypeVar

from MaxText.configuration import spellings
from MaxText.errors import ConfigError, UserError

Record = TypeVar("Record")

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def normalized(name: str) -> str:
  """`--Some-Key` -> `some_key`: the key an old flag spelling stands for."""
  return name.lstrip("-").lower().replace("-", "_")


class _Given:
  """The settings given so far, by canonical key, with the spelling that set each."""

  def __init__(self) -> None:
    self.values: dict[str, str] = {}
    self.spelled: dict[str, str] = {}

  def set(self, key: str, spelling: str, value: str) -> None:
    earlier = self.spelled.get(key)
    if earlier is not None and earlier != spelling and not spellings.same_value(self.values[key], value):
      old, new = (spelling, earlier) if spelling != key else (earlier, spelling)
      old_value, new_value = (value, self.values[key]) if spelling != key else (self.values[key], value)
      raise spellings.clash_error(old, new, old_value, new_value, "the command line")
    self.values[key], self.spelled[key] = value, spelling


def _deprecated_flag(flag: str, key: str, switch_value: str | None = None) -> None:
  """`--flag` is an old spelling of key=... (a switch: of key=true, or key=false for a store_false flag)."""
  spellings.warn_deprecated(flag, f"{key}={switch_value or '...'}")


def split_tool_args(argv: Sequence[str], keys: Sequence[str], renamed: Mapping[str, str] | None = None
                    ) -> tuple[dict[str, str], list[str]]:
  """A tool's own `key=value` arguments (`keys`), and the rest (a YAML path, config key=value) in
  order. Old spellings (`--key VALUE`, `--key=VALUE`, a `renamed` key) warn once; a clash raises."""
  renamed = dict(renamed or {})
  given = _Given()
  rest: list[str] = []
  args = list(argv)
  while args:
    arg = args.pop(0)
    if arg.startswith("--"):
      name, sep, value = arg[2:].partition("=")
      key = renamed.get(normalized(name), normalized(name))
      if key not in keys:
        raise UserError(f"unknown argument {arg.partition('=')[0]}; this tool takes key=value arguments: its own "
                        f"({', '.join(keys)}) and config keys")
      if not sep:
        if not args:
          raise UserError(f"{arg} needs a value: write {key}=VALUE")
        value = args.pop(0)
      _deprecated_flag(f"--{name}", key)
      given.set(key, f"--{name}", value)
      continue
    name, sep, value = arg.partition("=")
    if sep and (name in keys or name in renamed):
      key = spellings.rename(name, renamed)
      given.set(key, name, value)
    else:
      rest.append(arg)
  return given.values, rest


def renamed_key_values(argv: Sequence[str], renamed: Mapping[str, str]) -> list[str]:
  """argv with each `old=value` of a tool's renamed keys written `new=value` (one warning each);
  an old and a new spelling with different values raise."""
  given = _Given()
  out = []
  for arg in argv:
    name, sep, value = arg.partition("=")
    key = renamed.get(name, name)
    if sep and key in renamed.values():
      if name != key:
        spellings.warn_deprecated(name, key)
      given.set(key, name, value)
      arg = f"{key}={value}"
    out.append(arg)
  return out


_FROM_TEXT: dict[object, Callable[[str], object]] = {str: str, int: int, float: float}


def _typed(key: str, text: str, kind: object) -> object:
  """`text` as the record field's type: str, int, float, bool, or one of them or None."""
  if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
    kind = next(k for k in typing.get_args(kind) if k is not type(None))
  if kind is bool:
    word = text.strip().lower()
    if word not in _TRUE | _FALSE:
      raise ConfigError(f"{key} must be true or false, got {text!r}")
    return word in _TRUE
  try:
    return _FROM_TEXT[kind](text)
  except ValueError:
    raise ConfigError(f"{key} must be a{'n' if kind is int else ''} {getattr(kind, '__name__', kind)}, "
                      f"got {text!r}") from None


def parse_tool_record(record: type[Record], argv: Sequence[str], renamed: Mapping[str, str] | None = None
                      ) -> tuple[Record, list[str]]:
  """A tool's own `key=value` arguments as `record` (a dataclass: one field per key, with its
  default and its type), and the rest (a YAML path, config key=value) in order, as split_tool_args
  splits them. A value that does not read as its field's type is one ConfigError line."""
  fields = {f.name: f for f in dataclasses.fields(record)}  # type: ignore[arg-type]
  hints = typing.get_type_hints(record)
  given, rest = split_tool_args(argv, tuple(fields), renamed)
  values = {key: _typed(key, text, hints[key]) for key, text in given.items()}
  return record(**values), rest


# ---------------------------------------------------------------- argparse tools

def _is_switch(action: argparse.Action) -> bool:
  return action.nargs == 0 and isinstance(action.const, bool)


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
  return {action.dest: action for action in parser._actions
          if action.option_strings and not isinstance(action, argparse._HelpAction)}


def _one_line_error(parser: argparse.ArgumentParser) -> Any:
  def error(message: str) -> NoReturn:
    message = re.sub(r"--([A-Za-z0-9_-]+)", lambda m: normalized(m.group(1)), message)
    parser.exit(2, f"error: {message} ({parser.prog} -h lists the keys)\n")
  return error


class _KeyValueHelp(argparse.HelpFormatter):
  """-h lists options as key=VALUE (a flag as key=true)."""

  def _format_action_invocation(self, action: argparse.Action) -> str:
    if not action.option_strings or isinstance(action, argparse._HelpAction):
      return super()._format_action_invocation(action)
    if _is_switch(action):
      return f"{action.dest}={'false' if action.const is False else 'true'}"
    return f"{action.dest}={self._get_default_metavar_for_optional(action)}"

  def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
    if isinstance(action.metavar, str):
      return action.metavar
    return "|".join(str(c) for c in action.choices) if action.choices else action.dest.upper()


def _key_value_help(parser: argparse.ArgumentParser) -> None:
  base = parser.formatter_class
  if not (isinstance(base, type) and issubclass(base, _KeyValueHelp)):
    bases: tuple[Any, ...] = (_KeyValueHelp, base)  # keeps the parser's own formatting (e.g. a raw description)
    formatter: Any = type(f"KeyValue{getattr(base, '__name__', 'Help')}", bases, {})
    parser.formatter_class = formatter
  if parser.usage is None:
    positionals = " ".join(a.dest for a in parser._actions if not a.option_strings)
    parser.usage = f"%(prog)s {positionals + ' ' if positionals else ''}[key=value ...]"


def _translate(parser: argparse.ArgumentParser, argv: Sequence[str], renamed: Mapping[str, str], known: bool
               ) -> tuple[list[str], list[str]]:
  """argv in the parser's own option spelling (`--dest=value`), and the arguments left for the
  caller (known=True: the key=value and --flags that name no option)."""
  options = _options(parser)
  by_name = {normalized(s): a.dest for a in options.values() for s in a.option_strings if s.startswith("--")}
  by_name.update({dest: dest for dest in options})

  def key_of(name: str) -> str | None:
    name = normalized(name)
    return by_name.get(renamed.get(name, name))

  given = _Given()
  positionals: list[str] = []
  rest: list[str] = []
  args = list(argv)
  while args:
    arg = args.pop(0)
    if arg in ("-h", "--help"):
      positionals.append(arg)
      continue
    if arg.startswith("--"):
      name, sep, value = arg[2:].partition("=")
      key = key_of(name)
      if key is None:
        if known:
          rest.append(arg)
          continue
        parser.error(f"unknown argument --{name}")
      action = options[key]
      if _is_switch(action):
        if sep:
          parser.error(f"--{name} takes no value: write {key}=true or {key}=false")
        value = "false" if action.const is False else "true"
      elif not sep:
        if not args:
          parser.error(f"--{name} needs a value: write {key}=VALUE")
        value = args.pop(0)
      _deprecated_flag(f"--{name}", key, value if _is_switch(action) else None)
      given.set(key, f"--{name}", value)
      continue
    name, sep, value = arg.partition("=")
    key = key_of(name) if sep and _KEY.fullmatch(name) else None
    if key is None:
      if sep and _KEY.fullmatch(name) and not known:
        close = difflib.get_close_matches(normalized(name), list(options), n=1, cutoff=0.6)
        parser.error(f"unknown key {name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
      (rest if known and sep else positionals).append(arg)
      continue
    if name != key:
      spellings.warn_deprecated(name, key)
      if normalized(name) == f"no_{key}" and _is_switch(options[key]):  # no_x=true is x=false
        value = {"true": "false", "false": "true"}.get(value.strip().lower(), value)
    given.set(key, name, value)

  translated: list[str] = []
  for key, value in given.values.items():
    action = options[key]
    flag = next(s for s in action.option_strings if s.startswith("--"))
    if _is_switch(action):
      text = value.strip().lower()
      if text not in _TRUE | _FALSE:
        parser.error(f"{key} must be true or false, got {value!r}")
      on = text in _TRUE
      if on == (action.const is True):  # store_true given true, store_false given false
        translated.append(flag)
    else:
      translated.append(f"{flag}={value}")
  return translated + positionals, rest


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None,
               renamed: Mapping[str, str] | None = None) -> argparse.Namespace:
  """`parser.parse_args` reading key=value (argv: without the program name; None = sys.argv[1:])."""
  parser.error = _one_line_error(parser)  # type: ignore[method-assign]
  _key_value_help(parser)
  try:
    translated, _ = _translate(parser, sys.argv[1:] if argv is None else argv, dict(renamed or {}), known=False)
  except UserError as e:  # a clash
    parser.exit(2, f"error: {e}\n")
  return parser.parse_args(translated)


def parse_known_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None,
                     renamed: Mapping[str, str] | None = None) -> tuple[argparse.Namespace, list[str]]:
  """As parse_args, returning the arguments that name no option of the parser (e.g. config
  key=value overrides a benchmark passes on, other positional arguments) instead of refusing them."""
  parser.error = _one_line_error(parser)  # type: ignore[method-assign]
  _key_value_help(parser)
  try:
    translated, rest = _translate(parser, sys.argv[1:] if argv is None else argv, dict(renamed or {}), known=True)
  except UserError as e:
    parser.exit(2, f"error: {e}\n")
  args, extra = parser.parse_known_args(translated)
  return args, rest + extra
