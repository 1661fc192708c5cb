"""The benchmarks' own list and number arguments, checked before anything is measured.

A list is `key=a,b,c` read by config_yaml.split_items (the project's one rule: one trailing comma
allowed, any other empty item refused), then as whole numbers or as names of an allowed set. A bad
value is a UserError naming the key, which each script's run_cli prints as one `error:` line.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable, Collection, Sequence

from MaxText.configuration.config_yaml import split_items, whole_numbers
from MaxText.errors import UserError, run_cli


def items(key: str, text: str) -> list[str]:
  """The list's items; an empty list is refused (it would measure nothing, or silently everything)."""
  found = split_items(key, text)
  if not found:
    raise UserError(f"{key}={text!r} names nothing; give at least one item")
  return found


def numbers(key: str, text: str, like: str, minimum: int = 1) -> list[int]:
  """The list's items as whole numbers of at least `minimum`."""
  values = list(whole_numbers(key, items(key, text), like))
  for i, value in enumerate(values):
    if value < minimum:
      raise UserError(f"{key}'s item {i + 1} is {value}; each must be at least {minimum}, like {like}")
  return values


def decimals(key: str, text: str, like: str) -> list[float]:
  """The list's items as positive numbers (learning rates)."""
  values = []
  for i, item in enumerate(items(key, text)):
    try:
      value = float(item)
    except ValueError:
      value = float("nan")
    if not value > 0 or value == float("inf"):
      raise UserError(f"{key} must be comma-separated positive numbers like {like}; item {i + 1} is {item!r}")
    values.append(value)
  return values


def _unknown(key: str, item: str, allowed: Sequence[str]) -> UserError:
  close = difflib.get_close_matches(item, list(allowed), n=1, cutoff=0.6)
  hint = f" (did you mean {close[0]!r}?)" if close else ""
  return UserError(f"{key}: unknown {item!r}{hint}; choose from {', '.join(allowed)}")


def name(key: str, text: str, allowed: Collection[str]) -> str:
  """One name of the allowed set."""
  if text not in allowed:
    raise _unknown(key, text, list(allowed))
  return text


def names(key: str, text: str, allowed: Collection[str]) -> list[str]:
  """The list's items, each a name of the allowed set."""
  found = items(key, text)
  for item in found:
    name(key, item, allowed)
  return found


def at_least(key: str, value: float, minimum: float) -> None:
  """A count (steps, repeats, sizes): zero or less would divide by zero or time nothing, after the compile."""
  if value < minimum:
    raise UserError(f"{key}={value:g}: give a number of at least {minimum:g}")


def run(main: Callable[..., Any], with_argv: bool = False) -> None:
  """run_cli around a benchmark's main: what main returns (rows, None) is not an exit status."""
  def entry(argv: list[str]) -> int:
    result = main(argv[1:]) if with_argv else main()
    return result if isinstance(result, int) and not isinstance(result, bool) else 0
  run_cli(entry)
