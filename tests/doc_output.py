"""Comparing a quoted output (an `output` or `sample` block) with what a command printed.

Lines. The quoted lines are an excerpt of the printed ones: the first quoted line may match any printed
line, and from there every quoted line must match the next printed line. A quoted line that is only
`...` is the elision marker: any number of printed lines (none included) may stand there. Without one,
an extra printed line between two quoted lines fails. Blank lines are ignored on both sides; printed
lines before the first and after the last quoted line are not part of the excerpt.

Within a line: text must be equal, except that runs of white space match any run of white space
(columns move with the numbers) and `...` inside a line matches any text.

Figures. Every number in a quoted line is compared by value with the printed one, within the tolerance
its block states in a `tol=` tag (none stated: the value exactly as quoted):

  tol=loss:2e-3,GiB:1%,MFU:0.5,s:any,*:5%

Each entry is KEY:TOLERANCE. TOLERANCE is absolute (`2e-3`, `0.5`: |printed - quoted| <= it),
relative (`1%`: within 1% of the quoted value) or `any` (any number). KEY (case-insensitive) picks the
figures it applies to: the word right before the number (its label: `loss 6.0686`, `MFU 2.67%`,
`perplexity=1.08`) or the unit right after it (`6.640 GiB`, `0.550 s`, `1863.2 tokens/s`, `41.5%`);
`*` is every other number. A label entry wins over a unit entry, a unit entry over `*`.
"""

from __future__ import annotations

import dataclasses
import math
import re

ELISION = "..."

_TOKEN = re.compile(r"(\.\.\.)|(?<![\w.])([-+]?\d[\d,]*(?:\.\d+(?:[eE][-+]?\d+)?|[eE][-+]?\d+|(?:\.\d+)?))|(\s+)")
_ANY_NUMBER = r"([-+]?(?:\d[\d,]*(?:\.\d*)?(?:[eE][-+]?\d+)?|nan|inf))"
_LABEL = re.compile(r"([A-Za-z_][\w/.-]*)[\s:=|(]*$")
_UNIT = re.compile(r"^\s*(%|[A-Za-z][\w/]*)")


class ToleranceError(ValueError):
  pass


@dataclasses.dataclass(frozen=True)
class Tolerance:
  absolute: float = 0.0
  relative: float = 0.0  # a fraction: 1% is 0.01
  any: bool = False

  def allows(self, quoted: float, printed: float) -> bool:
    if self.any:
      return not math.isnan(printed) or math.isnan(quoted)
    if math.isnan(quoted) or math.isnan(printed):
      return math.isnan(quoted) and math.isnan(printed)
    return abs(printed - quoted) <= max(self.absolute, self.relative * abs(quoted))

  def __str__(self) -> str:
    return "any" if self.any else f"{self.relative:.4g} relative" if self.relative else f"{self.absolute:g}"


EXACT = Tolerance()


def parse_tolerances(spec: str) -> dict[str, Tolerance]:
  """`loss:2e-3,GiB:1%,s:any` -> {"loss": .., "gib": .., "s": ..} (keys lower-cased)."""
  out: dict[str, Tolerance] = {}
  for entry in spec.split(","):
    key, sep, value = entry.partition(":")
    key, value = key.strip().lower(), value.strip()
    if not sep or not key or not value:
      raise ToleranceError(f"tolerance entry {entry!r} is not KEY:TOLERANCE")
    try:
      if value == "any":
        out[key] = Tolerance(any=True)
      elif value.endswith("%"):
        out[key] = Tolerance(relative=float(value[:-1]) / 100)
      else:
        out[key] = Tolerance(absolute=float(value))
    except ValueError:
      raise ToleranceError(f"tolerance {value!r} of {key!r} is not a number, N% or any") from None
  return out


@dataclasses.dataclass(frozen=True)
class Figure:
  text: str  # as quoted
  key: str  # what picked its tolerance: a label, a unit, "*", or "" (exact)
  tolerance: Tolerance


@dataclasses.dataclass(frozen=True)
class LinePattern:
  quoted: str
  regex: re.Pattern[str]
  figures: tuple[Figure, ...]

  def compare(self, printed: str) -> tuple[bool, str | None]:
    """(the line's shape matches, why a figure is out of tolerance or None)."""
    m = self.regex.fullmatch(printed.strip())
    if m is None:
      return False, None
    for figure, got in zip(self.figures, m.groups()):
      if not figure.tolerance.allows(_value(figure.text), _value(got)):
        how = f"tolerance {figure.tolerance} ({figure.key})" if figure.key else "no tolerance: exact"
        return True, f"{figure.text} is printed as {got}, beyond its {how}"
    return True, None


def _value(number: str) -> float:
  return float(number.replace(",", ""))


def _figure(quoted: str, start: int, end: int, tolerances: dict[str, Tolerance]) -> Figure:
  label = _LABEL.search(quoted[:start])
  unit = _UNIT.match(quoted[end:])
  for key in (label.group(1) if label else None, unit.group(1) if unit else None, "*"):
    if key is not None and key.lower() in tolerances:
      return Figure(quoted[start:end], key, tolerances[key.lower()])
  return Figure(quoted[start:end], "", EXACT)


def line_pattern(quoted: str, tolerances: dict[str, Tolerance] | None = None) -> LinePattern | None:
  """What one quoted output line stands for; None for a blank line or the `...` marker."""
  quoted = quoted.strip()
  if quoted in ("", ELISION):
    return None
  parts: list[str] = []
  figures: list[Figure] = []
  pos = 0
  for m in _TOKEN.finditer(quoted):
    parts.append(re.escape(quoted[pos:m.start()]))
    ellipsis, number, space = m.groups()
    if ellipsis:
      parts.append(".*?")
    elif space:
      parts.append(r"\s+")
    else:
      parts.append(_ANY_NUMBER)
      figures.append(_figure(quoted, m.start(2), m.end(2), tolerances or {}))
    pos = m.end()
  parts.append(re.escape(quoted[pos:]))
  return LinePattern(quoted, re.compile("".join(parts)), tuple(figures))


@dataclasses.dataclass
class Match:
  pairs: list[tuple[str, str]]  # (quoted line, printed line), in order; complete when problem is None
  problem: str | None


def match_output(quoted: str, printed: str, tolerances: dict[str, Tolerance] | None = None) -> Match:
  """The quoted lines matched in order against the printed ones (see the module docstring)."""
  items: list[LinePattern | None] = []  # None: an elision
  for line in quoted.splitlines():
    if line.strip() == ELISION:
      if not items or items[-1] is not None:
        items.append(None)
    elif line.strip():
      pattern = line_pattern(line, tolerances)
      assert pattern is not None
      items.append(pattern)
  actual = [line.rstrip() for line in printed.splitlines() if line.strip()]
  failed: set[tuple[int, int]] = set()
  best: tuple[int, str] = (-1, "")  # the deepest quoted line that failed, and why

  def fail(qi: int, why: str) -> bool:
    nonlocal best
    if qi > best[0]:
      best = (qi, why)
    return False

  def walk(qi: int, pi: int, pairs: list[tuple[str, str]]) -> bool:
    if qi == len(items):
      return True
    if (qi, pi) in failed:
      return False
    item = items[qi]
    ok = False
    if item is None:
      ok = any(walk(qi + 1, p, pairs) for p in range(pi, len(actual) + 1))
    elif pi == len(actual):
      fail(qi, f"{item.quoted!r} is quoted after the last printed line")
    else:
      shaped, off = item.compare(actual[pi])
      if not shaped and qi > 0 and items[qi - 1] is None:
        fail(qi, f"{item.quoted!r}: no printed line after the `...` has this shape")
      elif not shaped:
        fail(qi, f"{item.quoted!r}: the printed line there is {actual[pi].strip()!r} (mark left-out lines "
                 "with a `...` line)")
      elif off:
        fail(qi, f"{item.quoted!r}: {off}; printed: {actual[pi].strip()!r}")
      else:
        pairs.append((item.quoted, actual[pi]))
        ok = walk(qi + 1, pi + 1, pairs)
        if not ok:
          pairs.pop()
    if not ok:
      failed.add((qi, pi))
    return ok

  if not items:
    return Match([], None)
  first = items[0]
  for start in range(len(actual)):
    pairs: list[tuple[str, str]] = []
    if first is None or first.compare(actual[start])[0]:
      if walk(0, start, pairs):
        return Match(pairs, None)
  if best[0] <= 0 and first is not None and not any(first.compare(a)[0] for a in actual):
    return Match([], f"{first.quoted!r}: no printed line has this shape")
  return Match([], best[1] or "the quoted lines were not printed in this order")
