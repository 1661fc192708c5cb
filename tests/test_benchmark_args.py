"""The benchmarks refuse a bad argument as the entry points do: one `error:` line naming it, a non-zero exit, no
traceback, and before anything is measured (a bad list item such as `lengths=128,,256` or `kernels=flsh` was a
traceback after the earlier items had already been measured, sometimes for minutes)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from typing import Any

import pytest

from MaxText.errors import UserError
from tests.conftest import REPO_ROOT

# (script, arguments with one bad value, what the error line must name)
BAD = [
    ("attention_bench", ["lengths=16,,32"], "lengths"),
    ("attention_bench", ["lengths=16", "kernels=dot_product,flsh"], "did you mean 'flash'"),
    ("attention_bench", ["lengths=16", "repeats=0"], "repeats"),
    ("context_parallel_bench", ["max_target_length=64", "strategies=ring,rng"], "strategies"),
    ("decode_bench", ["slots=1,,8"], "slots"),
    ("decode_bench", ["layouts=unroled"], "layouts"),
    ("decode_bench", ["caches=dense,pagd"], "caches"),
    ("decode_bench", ["caches=paged", "pool_multiples=one"], "pool_multiples"),
    ("decode_bench", ["quantize_weights=none,int4"], "quantize_weights"),
    ("linear_attention_bench", ["lengths=64,,128"], "lengths"),
    ("linear_attention_bench", ["lengths=64", "layers=linear,ful"], "layers"),
    ("sparse_attention_bench", ["lengths=64,x"], "lengths"),
    ("sparse_attention_bench", ["lengths=64", "forms=full,gathred"], "forms"),
    ("mxfp8_bench", ["sizes=64,,128"], "sizes"),
    ("mxfp8_bench", ["sizes=64", "modes=fp9"], "modes"),
    ("optimizer_bench", ["learning_rates=1e-3,,1e-2"], "learning_rates"),
    ("optimizer_bench", ["learning_rates=1e-3,fast"], "learning_rates"),
    ("moe_paths", ["tpu=v5p-8", "dispatch=all_to_all,gathr"], "dispatch"),
    ("moe_paths", ["tpu=v5p-8", "models=nope"], "models"),
    ("rl_bench", ["modes=same,,split"], "modes"),
    ("serve_bench", ["prompt_lengths=8,,16"], "prompt_lengths"),
    ("serve_bench", ["concurrency=1,,4"], "concurrency"),
    ("serve_bench", ["caches=dense,pagd"], "caches"),
    ("serve_bench", ["prefix_caching=ture"], "prefix_caching"),
    ("serve_bench", ["speculative_tokens=0,x"], "speculative_tokens"),
    ("peer_aot", ["peer_python=/nowhere/python", "cases=nope"], "cases"),
    ("peer_aot", ["peer_python=/nowhere/python", "columns=upstrem"], "columns"),
    ("estimator_table", ["slices=1,,2"], "slices"),
    ("step_time_table", ["compile", "slices=1,,2"], "slices"),
    ("gpu_suite", ["rows=1b,9b"], "rows"),
    ("gpu_suite", ["quants=bf8"], "quants"),
    ("gpu_train", ["smoke=true", "compare=attention"], "compare"),
    ("cpu_train", ["steps=0"], "steps"),
    ("checkpoint_bench", ["steps=0"], "steps"),
    ("context_parallel_bench", ["max_target_length=64", "repeats=0"], "repeats"),
    ("multimodal_bench", ["steps=0"], "steps"),
    ("lora_bench", ["repeats=0"], "repeats"),
    ("mixture_bench", ["batches=0"], "batches"),
    ("pipeline_bench", ["repeats=0"], "repeats"),
    ("convert_memory", ["vocab_size=0"], "vocab_size"),
]


def _run(script: str, args: list[str]) -> subprocess.CompletedProcess[str]:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / f"{script}.py"), *args], cwd=REPO_ROOT,
                        capture_output=True, text=True, timeout=180, env=env)


@pytest.mark.parametrize("script,args,named", BAD, ids=[f"{s}:{' '.join(a)}" for s, a, _ in BAD])
def test_a_bad_argument_is_one_line_before_anything_is_measured(script: str, args: list[str], named: str) -> None:
  proc = _run(script, args)
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
  assert proc.returncode != 0 and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr[-3000:])
  assert len(errors) == 1 and named in errors[0], proc.stderr[-3000:]
  assert proc.stdout.strip() == "", proc.stdout[-3000:]  # no header, no row: nothing was measured


def _load(script: str) -> Any:
  spec = importlib.util.spec_from_file_location(f"_args_{script}", REPO_ROOT / "benchmarks" / f"{script}.py")
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_good_lists_parse_as_the_one_rule_reads_them() -> None:
  from benchmarks import bench_args

  assert bench_args.numbers("lengths", "128,256,", "128,256") == [128, 256]  # one trailing comma is allowed
  assert bench_args.numbers("slots", " 1, 8 ", "1,8") == [1, 8]
  assert bench_args.names("kernels", "flash,dot_product", ("dot_product", "flash")) == ["flash", "dot_product"]
  assert bench_args.decimals("learning_rates", "1e-3,3e-3", "1e-3,3e-3") == [1e-3, 3e-3]
  for bad in ("", ",", "1,,2", ",1", "0"):
    with pytest.raises(UserError, match="lengths"):
      bench_args.numbers("lengths", bad, "128,256")


def test_good_arguments_of_the_list_benchmarks_parse_in_process() -> None:
  serve = _load("serve_bench")
  args = serve.parse(["concurrency=1,4,", "prefix_caching=false,true", "caches=paged"])
  assert args.concurrency == [1, 4] and args.prefix_caching == [False, True] and args.caches == ["paged"]
  decode = _load("decode_bench")
  args = decode.parse(["slots=1,8", "caches=dense,paged", "quantize_weights=none,int8"])
  assert args.slots == [1, 8] and args.caches == ["dense", "paged"] and args.quantize_weights == ["none", "int8"]
  attention = _load("attention_bench")
  args = attention.parse(["lengths=64,128", "kernels=flash"])
  assert args.lengths == [64, 128] and args.kernels == ["flash"]
  for module in (serve, decode, attention):  # the defaults themselves read as good lists
    module.parse([])
  estimator = _load("estimator_table")
  assert estimator.chosen_points("", "") == {"1", "2", "4", "8", "16", "32"}
  assert estimator.chosen_points("v5p", "1,") == {"1"}
  mxfp8 = _load("mxfp8_bench")
  assert mxfp8.parse(["modes=bf16,fp8"]).modes == ["", "fp8"]
  assert mxfp8.parse([]).modes == ["", "fp8", "mxfp8"]


def test_the_recipe_lists_refuse_an_empty_item_rather_than_drop_it() -> None:
  """`recipes=a,,b` planned a and b as if the middle item were not there (a typo'd list ran for hours)."""
  recipes = _load("plan_recipes")
  with pytest.raises(UserError, match="recipes has an empty item at position 2"):
    recipes.recipe_names("v5e/32b,,v5e/16b")
  assert recipes.recipe_names("v5e/32b,") == ["v5e/32b"]
  blocks = _load("upstream_blocks")
  with pytest.raises(UserError, match="files has an empty item at position 2"):
    blocks.main(["upstream=/nowhere", "files=a.py,,b.py"])
