"""Does each tuning block of upstream MaxText's benchmark recipes load here as written? One line per
block: `loads` or the one-line error that stops it, then a count per file.

  python3 benchmarks/upstream_blocks.py upstream=<a MaxText checkout, or its bare git directory>
      [files=maxtext_trillium_model_configs.py,maxtext_v5p_model_configs.py,maxtext_v5e_model_configs.py]

Each block is built into a config for its own model (upstream's `model_type`: the same names here)
and slice: the `v5e-N`/`v5p-N`/`v6e-N` its name gives, else the file's default slice, times the
slices its `dcn_*` degrees ask for. This checks that every key and value is accepted and validated;
nothing is compiled. The recipe files are read as data: their imports of upstream's own modules
(the model dataclass, the XLA flag strings, the asset root) are stood in for here. Figures:
getting_started/AOT.md (*Which upstream tuning blocks run unchanged*).
"""

from __future__ import annotations

import argparse
import builtins
import math
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from MaxText.configuration import tool_args  # noqa: E402
from MaxText.configuration.config_yaml import split_items  # noqa: E402
from MaxText.errors import UserError, run_cli  # noqa: E402

# upstream's recipe file -> the slice a block runs on when its name gives none
FILES = {"maxtext_trillium_model_configs.py": "v6e-256", "maxtext_v5p_model_configs.py": "v5p-128",
         "maxtext_v5e_model_configs.py": "v5e-256", "maxtext_tpu7x_model_configs.py": "tpu7x-128"}
_SLICE_IN_NAME = re.compile(r"(v5e|v5p|v6e|tpu7x)[-_](\d+)")


def read_recipe_file(upstream: Path, name: str) -> str | None:
  """The text of benchmarks/<name> in a checkout or a bare git directory (HEAD); None if absent."""
  path = upstream / "benchmarks" / name
  if path.is_file():
    try:  # bytes that are not UTF-8 are left for the compile to report, with the other blocks' files read
      return path.read_bytes().decode("utf-8", errors="replace")
    except OSError as e:
      raise UserError(f"cannot read {path}: {e.strerror or e}") from None
  shown = subprocess.run(["git", f"--git-dir={upstream}", "show", f"HEAD:benchmarks/{name}"], capture_output=True,
                         check=False)
  return shown.stdout.decode("utf-8", errors="replace") if shown.returncode == 0 else None


class _NoFlags(str):
  """An empty flag string that may also be called (upstream's flag functions, e.g. a VMEM limit)."""

  def __call__(self, *args: Any, **kwargs: Any) -> str:
    return ""


class _AnyFlag(types.ModuleType):
  """Upstream's XLA flag library: every flag reads as empty (the blocks' keys are what is checked)."""

  def __getattr__(self, name: str) -> str:
    return _NoFlags()


def blocks_of(source: str) -> list[tuple[str, str, dict[str, Any]]]:
  """(block name, model_type, tuning_params) of every MaxTextModel a recipe file defines."""
  found: list[tuple[str, str, dict[str, Any]]] = []

  def model(model_name: str, model_type: str, tuning_params: dict[str, Any], **_: Any) -> types.SimpleNamespace:
    found.append((model_name, model_type, dict(tuning_params)))
    return types.SimpleNamespace(model_name=model_name)

  stand_ins = {
      "benchmarks.benchmark_utils": types.SimpleNamespace(
          MaxTextModel=model, _add_to_model_dictionary=lambda registry, m: registry.setdefault(m.model_name, m)),
      "benchmarks.xla_flags_library": _AnyFlag("xla_flags_library"),
      "benchmarks.globals": types.SimpleNamespace(MAXTEXT_ASSETS_ROOT="assets", MAXTEXT_PKG_DIR="src/maxtext",
                                                  MAXTEXT_REPO_ROOT="."),
  }
  real_import = builtins.__import__

  def importer(name: str, globals_: Any = None, locals_: Any = None, fromlist: Any = (), level: int = 0) -> Any:
    if name in stand_ins:
      return stand_ins[name]
    if name == "benchmarks":  # `from benchmarks import xla_flags_library`
      return types.SimpleNamespace(**{k.split(".", 1)[1]: v for k, v in stand_ins.items()})
    return real_import(name, globals_, locals_, fromlist, level)

  namespace: dict[str, Any] = {"__builtins__": {**vars(builtins), "__import__": importer}, "__name__": "recipes"}
  exec(compile(source, "recipes", "exec"), namespace)  # pylint: disable=exec-used  (upstream's data file)
  return found


def slice_of(block_name: str, default: str, params: dict[str, Any]) -> tuple[str, int]:
  """The topology a block runs on and its number of slices (the product of its dcn degrees, -1 as 1)."""
  match = _SLICE_IN_NAME.search(block_name)
  topology = f"{match.group(1)}-{match.group(2)}" if match else default
  degrees = {k: v for k, v in params.items() if k.startswith("dcn_") and k.endswith("_parallelism")}
  bad = [f"{k}={v!r}" for k, v in degrees.items()
         if isinstance(v, bool) or not (isinstance(v, int) or re.fullmatch(r"\s*[+-]?\d+\s*", str(v)))]
  if bad:
    raise UserError(f"{bad[0]} is not a whole number of slices")
  dcn = [int(v) for v in degrees.values() if int(v) > 0]
  return topology, math.prod(dcn) if dcn else 1


def try_block(model_type: str, params: dict[str, Any], topology: str, num_slices: int) -> str:
  """`loads`, or the one line that stops the block."""
  from MaxText.configuration.config import Config
  from MaxText.platform import accelerators

  try:  # a block's own slice too: its name may give one that does not exist
    target = accelerators.tpu_topology(topology).target(num_slices)
    Config.for_testing(target=target, run_name="upstream_block", model_name=model_type, num_slices=num_slices,
                       **params)
  except UserError as e:
    return f"error: {e}"
  return "loads"


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--upstream", required=True, help="a MaxText checkout, or its bare git directory")
  parser.add_argument("--files", default=",".join(FILES), help="recipe files under upstream's benchmarks/, comma-separated")
  args = tool_args.parse_args(parser, argv)
  upstream = Path(args.upstream).expanduser()
  text = str(args.files)
  names = split_items("files", text) if text.replace(",", "").strip() else []
  if not names:
    raise UserError(f"files={args.files} names no recipe file; leave it out for {','.join(FILES)}")
  sources = {name: read_recipe_file(upstream, name) for name in names}
  if not any(source is not None for source in sources.values()):
    found = "does not exist" if not upstream.exists() else f"holds no benchmarks/{{{','.join(names)}}}"
    raise UserError(f"upstream={args.upstream} {found}: name a MaxText checkout, or its bare git directory")
  for name, source in sources.items():
    if source is None:
      print(f"{name}: not in {args.upstream}")
      continue
    try:
      blocks = blocks_of(source)
    except (Exception, SystemExit) as e:  # upstream's file run as data: one that needs more than the stand-ins
      print(f"{name}: cannot be read here ({type(e).__name__}: {e})".splitlines()[0])
      continue
    results = []
    for block_name, model_type, params in blocks:
      try:
        topology, slices = slice_of(block_name, FILES.get(name, "v6e-256"), params)
      except UserError as e:
        results.append(f"error: {e}")
        print(f"{name} {block_name} ({model_type}): {results[-1]}", flush=True)
        continue
      results.append(try_block(model_type, params, topology, slices))
      where = topology if slices == 1 else f"{slices} x {topology}"
      print(f"{name} {block_name} ({model_type}, {where}): {results[-1]}", flush=True)
    print(f"{name}: {results.count('loads')} of {len(results)} blocks load")
  return 0


if __name__ == "__main__":
  run_cli(lambda argv: main(argv[1:]))
