"""Prints the share of MaxText's lines that mypy checks with the strict flags: the modules
listed in pyproject.toml's [[tool.mypy.overrides]] that set disallow_untyped_defs, over all
lines of MaxText/**/*.py. `python3 tests/strict_coverage.py [-v]`."""

from __future__ import annotations

import fnmatch
import sys
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def module_name(path: Path) -> str:
  parts = path.relative_to(REPO_ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def strict_patterns() -> list[str]:
  config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
  if config["tool"]["mypy"].get("disallow_untyped_defs"):  # strict for every module
    return ["MaxText", "MaxText.*"]
  patterns: list[str] = []
  for override in config["tool"]["mypy"].get("overrides", []):
    if override.get("disallow_untyped_defs"):
      modules = override["module"]
      patterns += [modules] if isinstance(modules, str) else modules
  return patterns


def is_strict(module: str, patterns: list[str]) -> bool:
  """mypy's matching: `a.b` is that module; `a.b.*` is a.b and everything under it."""
  for pattern in patterns:
    if pattern.endswith(".*"):
      if module == pattern[:-2] or fnmatch.fnmatchcase(module, pattern):
        return True
    elif module == pattern:
      return True
  return False


def main(verbose: bool) -> None:
  patterns = strict_patterns()
  total = strict = 0
  for path in sorted((REPO_ROOT / "MaxText").rglob("*.py")):
    lines = len(path.read_text().splitlines())
    total += lines
    if is_strict(module_name(path), patterns):
      strict += lines
      if verbose:
        print(f"  {lines:6d}  {module_name(path)}")
  print(f"strict mypy: {strict} of {total} lines ({strict / total:.1%})")


if __name__ == "__main__":
  main("-v" in sys.argv[1:])
