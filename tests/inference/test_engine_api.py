"""The decode engine's boundary: the code that drives an engine (server, decode.py, rollouts,
benchmarks) calls only engine_api.DecodeEngine's members, and only kv_layout.make asks which
cache layout is configured."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

from MaxText.configuration.config import Config
from MaxText.errors import ConfigError, UserError
from MaxText.inference import engine_api, kv_layout

ROOT = pathlib.Path(__file__).resolve().parents[2]
CALLERS = ("MaxText/serve.py", "MaxText/decode.py", "MaxText/rl/rollouts.py", "MaxText/rl/interleaved_episodes.py",
           "MaxText/rl/evaluate.py",
           "MaxText/inference/scheduler.py", "MaxText/inference/serve_routes.py", "benchmarks/decode_bench.py",
           "benchmarks/serve_bench.py", "benchmarks/gpu_suite.py", "benchmarks/gpu_serving.py", "MaxText/train_compile.py",
           "benchmarks/lora_bench.py")
# Building an engine is not driving one: parameters come with it.
CONSTRUCTION = {"load_params", "compile_step"}
ENGINE_MODULES = ("engine.py", "speculative.py", "speculative_engine.py", "mtp_draft.py", "page_prefill.py",
                  "decode_state.py", "decode_block.py", "lora_adapters.py")
# The engine's own side: its modules, the protocol and the parts it composes.
ENGINE_SIDE = {f"MaxText/inference/{name}" for name in ENGINE_MODULES + ("engine_api.py", "kv_layout.py")}


def protocol_members() -> set[str]:
  """DecodeEngine's members and those of the optional protocols an engine may also offer."""
  protocols = (engine_api.DecodeEngine, engine_api.PrefillsRestsTogether, engine_api.PrefillsChunksTogether,
               engine_api.InsertsRowsTogether, engine_api.PrefillsIntoSlots)
  return {name for protocol in protocols for name in vars(protocol) if not name.startswith("_")}


def engine_attributes(path: pathlib.Path) -> list[tuple[int, str]]:
  """(line, attribute) of every `engine.x` / `self.engine.x` / `<...>.scheduler.engine.x` in the file."""
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    if not isinstance(node, ast.Attribute):
      continue
    value = node.value
    named = (isinstance(value, ast.Name) and value.id == "engine") or \
        (isinstance(value, ast.Attribute) and value.attr == "engine")
    if named:
      found.append((node.lineno, node.attr))
  return found


@pytest.mark.parametrize("caller", CALLERS)
def test_callers_use_only_the_protocol(caller: str) -> None:
  allowed = protocol_members() | CONSTRUCTION
  outside = [f"{caller}:{line} engine.{attr}" for line, attr in engine_attributes(ROOT / caller)
             if attr not in allowed]
  assert not outside, "engine internals used outside inference's engine modules: " + "; ".join(outside)


def test_every_module_that_reaches_an_engine_is_a_checked_caller() -> None:
  """A new tool or benchmark that imports an engine module is held to the protocol too."""
  sources = [p for folder in ("MaxText", "benchmarks", "end_to_end") for p in (ROOT / folder).rglob("*.py")]
  reaching = set()
  for path in sources:
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module is not None:
        names = {f"{node.module}.{a.name}" for a in node.names} | {node.module}
        if any(n.startswith(("MaxText.inference.engine", "MaxText.inference.speculative_engine")) for n in names):
          reaching.add(str(path.relative_to(ROOT)))
  unchecked = sorted(reaching - set(CALLERS) - ENGINE_SIDE)
  assert not unchecked, f"modules that reach an engine but are not in CALLERS: {unchecked}"


def test_only_the_factory_branches_on_the_cache_layout() -> None:
  branches = []
  for name in ENGINE_MODULES + ("kv_layout.py",):
    for node in ast.walk(ast.parse((ROOT / "MaxText/inference" / name).read_text())):
      if isinstance(node, ast.Attribute) and node.attr in ("kv_cache_layout", "paged"):
        branches.append(f"{name}:{node.lineno} .{node.attr}")
  assert branches == [f"kv_layout.py:{_factory_line()} .kv_cache_layout"], branches


def _factory_line() -> int:
  tree = ast.parse((ROOT / "MaxText/inference/kv_layout.py").read_text())
  make = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "make")
  return next(n.lineno for n in ast.walk(make) if isinstance(n, ast.Attribute) and n.attr == "kv_cache_layout")


def test_dense_layout_refuses_prompts_prefilled_into_pages() -> None:
  layout = kv_layout.DenseLayout.__new__(kv_layout.DenseLayout)  # no model needed for the refusal
  with pytest.raises(UserError, match="chunked prefill needs kv_cache_layout=paged"):
    layout.prompt_pages()


def test_emitted_reads_one_token_or_a_round_per_slot() -> None:
  logprobs = engine_api.TokenLogprobs(np.asarray([-1.0, -2.0]), np.asarray([[5, 6], [7, 8]]),
                                      np.asarray([[-0.5, -1.5], [-0.25, -3.0]]))
  one = engine_api.Emitted(np.asarray([3, 4]), logprobs)
  assert [one.count(s) for s in (0, 1)] == [1, 1] and one.token(1) == 4
  assert one.scores(1) == (-2.0, [(7, -0.25), (8, -3.0)])
  round_logprobs = engine_api.TokenLogprobs(np.zeros((2, 3)), np.zeros((2, 3, 1), np.int32), np.zeros((2, 3, 1)))
  rounds = engine_api.Emitted(np.asarray([[1, 2, 3], [4, 5, 6]]), round_logprobs, np.asarray([3, 1]))
  assert [rounds.token(0, i) for i in range(rounds.count(0))] == [1, 2, 3]
  assert [rounds.token(1, i) for i in range(rounds.count(1))] == [4]


def test_prefix_caching_is_auto_true_or_false_and_true_needs_pages() -> None:
  """auto (the default) applies prefix caching where the cache has pages; an explicit true with the dense cache
  is refused in one line instead of being ignored; an old config's boolean still reads."""
  assert Config.for_testing().decode.prefix_caching == "auto"
  assert Config.for_testing(prefix_caching=False).decode.prefix_caching == "false"
  assert Config.for_testing(prefix_caching="True", kv_cache_layout="paged").decode.prefix_caching == "true"
  with pytest.raises(ConfigError, match="prefix_caching=true needs kv_cache_layout=paged .* or prefix_caching=auto"):
    Config.for_testing(prefix_caching=True)
  with pytest.raises(ConfigError, match="prefix_caching must be one of auto, true, false"):
    Config.for_testing(prefix_caching="sometimes")
