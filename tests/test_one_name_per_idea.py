"""One name and one syntax per idea, across every config key and every tool's own arguments.

Every entry point (the MaxText tools and the benchmarks) is run in-process up to the moment it
parses its arguments: the config tools through config.parse_overrides, the others through
configuration/tool_args. From that come the canonical names of every tool; `SYNONYMS` lists the
names known to mean one idea, and no two of a group may both be canonical. Every tool takes
key=value for every argument, each option is spelled once (`--dest`, never `--dry-run` beside
`--DRY_RUN`), and every old spelling of a tool's option still works with one deprecation line.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import inspect
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from MaxText import startup
from MaxText.configuration import config as config_lib
from MaxText.configuration import spellings, tool_args

REPO = Path(__file__).resolve().parent.parent
CONFIG_KEYS = frozenset(config_lib.read_yaml(config_lib.BASE_CONFIG_PATH))

# Entry points that read key=value through the config, with arguments of their own to try.
CONFIG_TOOLS = {
    "MaxText.train": [], "MaxText.train_compile": [], "MaxText.decode": [], "MaxText.serve": [],
    "MaxText.rl.evaluate": [], "MaxText.generate_param_only_checkpoint": [],
    "MaxText.generate_teacher_top_k": [],
    "MaxText.plan": ["compile_topology=v5e-8", "max_candidates=2"],
    "MaxText.logit_checker": ["hf_model_path=/nowhere", "atol=0.5"],
    "MaxText.convert.hf_to_maxtext": ["hf_model_path=/nowhere", "output_path=/nowhere/out"],
    "MaxText.convert.maxtext_to_hf": ["load_parameters_path=/nowhere", "output_path=/nowhere/out", "max_shard_mb=7"],
}
ARGPARSE_MODULES = ("MaxText.train_tokenizer", "MaxText.input_pipeline.prepare_data", "MaxText.multihost_runner",
                    "MaxText.multihost_job")
BENCHMARKS = tuple(sorted(p.stem for p in (REPO / "benchmarks").glob("*.py") if "argparse" in p.read_text()))


@dataclasses.dataclass(frozen=True)
class Name:
  """A name in a synonym group; `other_meaning`: tools ("config" for base.yml) where the same
  name is canonical for a different idea, so it does not count there."""
  name: str
  other_meaning: frozenset[str] = frozenset()


def _n(name: str, *other_meaning: str) -> Name:
  return Name(name, frozenset(other_meaning))


# Names that mean the same idea: at most one of each group may be a canonical name anywhere.
SYNONYMS: list[tuple[Name, ...]] = [
    # sampling: one suffix family, <context>_sampling_{temperature,top_p,top_k}
    (_n("decode_sampling_top_p"), _n("decode_sampling_nucleus_p")),
    (_n("rl_sampling_temperature"), _n("rl_temperature")),
    (_n("rl_sampling_top_p"), _n("rl_top_p")),
    (_n("rl_sampling_top_k"), _n("rl_top_k")),
    # HF's partial_rotary_factor is ours; proportional RoPE's share is another idea with its own name
    (_n("rope_proportional_rotated_fraction"), _n("rope_partial_rotary_factor")),
    # RoPE's theta, *_max_timescale as for the text layers
    (_n("vision_rope_max_timescale"), _n("vision_rope_theta")),
    # upstream MaxText's names for settings of its recipes (spellings.RENAMED_KEYS)
    (_n("enable_jsonl_metrics"), _n("gcs_metrics")),
    (_n("profile_start_step"), _n("skip_first_n_steps_for_profiler")),
    (_n("profile_steps"), _n("profiler_steps")),
    (_n("moe_grouped_matmul"), _n("megablox")),  # spellings.SWITCHES: true is megablox, false ragged_dot
    # what a run trains: one key, the old flags are value aliases (spellings.VALUE_ALIASES)
    (_n("objective"), _n("use_sft"), _n("use_dpo"), _n("use_grpo")),
    # an HF model directory (hf_path in base.yml is the HF dataset)
    (_n("hf_model_path"), _n("hf_path", "config")),
    # the checkpoint a tool reads, the images of a prompt, where a tool writes, a corpus's files
    (_n("load_parameters_path"), _n("checkpoint")),
    (_n("image_path"), _n("images")),
    (_n("output_path"), _n("output"), _n("output_dir"), _n("out")),
    (_n("data_files"), _n("input"), _n("dataset_path", "config")),
    (_n("train_data_columns"), _n("text_column")),
    # the launchers' dry run, once spelled --dry-run and --DRY_RUN
    (_n("dry_run"), _n("dry-run"), _n("DRY_RUN")),
    # benchmark options named after the config key they set
    (_n("base_emb_dim"), _n("emb"), _n("hidden"), _n("width")),
    (_n("base_num_decoder_layers"), _n("layers", "linear_attention_bench")),  # there: the layer kinds timed
    (_n("base_num_query_heads"), _n("heads")),
    (_n("base_num_kv_heads"), _n("kv_heads")),
    (_n("vocab_size"), _n("vocab")),
    (_n("max_target_length"), _n("length")),
    # (elsewhere a benchmark's batch is its sequences per step, not per device)
    (_n("per_device_batch_size"), _n("per_device_batch"), _n("batch", "attention_bench", "cpu_train", "multimodal_bench")),
    (_n("kv_page_size"), _n("page_size"), _n("page-size")),
    (_n("kv_num_pages"), _n("pages")),
    (_n("serve_max_slots"), _n("slots", "decode_bench")),  # there: the decode batch sizes timed
    (_n("quantize_kvcache"), _n("int8")),
    (_n("max_prefill_predict_length"), _n("prefill")),
    (_n("max_completion_length"), _n("completion")),
    (_n("num_generations"), _n("generations")),
    (_n("num_pipeline_microbatches"), _n("micro")),
    (_n("ici_pipeline_parallelism"), _n("stages")),
    (_n("ici_sequence_parallelism"), _n("shards"), _n("ici_context_parallelism")),  # upstream's context axis
    (_n("dcn_sequence_parallelism"), _n("dcn_context_parallelism")),
    (_n("ici_expert_parallelism"), _n("expert")),
    (_n("num_experts"), _n("experts")),
    (_n("moe_ragged_buffer_factor"), _n("buffer_factor"), _n("buffer-factor")),
    (_n("max_images_per_row"), _n("images")),
    (_n("index_topk"), _n("topk")),
    (_n("index_n_heads"), _n("index_heads")),
    (_n("sliding_window_size"), _n("window")),
    # a switch is named for what it turns on (serve=false, not no_serve=true)
    (_n("serve"), _n("no_serve")),
    (_n("train"), _n("no_train")),
    (_n("decode"), _n("no_decode")),
]


class _Parsed(Exception):
  def __init__(self, what: Any):
    super().__init__("parsed")
    self.what = what


REAL_PARSE_ARGS = tool_args.parse_args


def _load(name: str) -> Any:
  if name in BENCHMARKS:
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", REPO / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
  return importlib.import_module(name)


def _call_main(main: Callable[..., Any], prog: str, argv: list[str]) -> None:
  required = [p for p in inspect.signature(main).parameters.values() if p.default is inspect.Parameter.empty]
  if required:
    main([prog, *argv] if not prog.endswith(".py") else argv)
  else:
    sys.argv = [prog, *argv]
    main()


@pytest.fixture
def quiet_process(monkeypatch):
  """No process-wide start-up and no environment left changed by a tool's import or start."""
  monkeypatch.setattr(startup, "prepare_process", lambda: None)
  monkeypatch.setattr(sys, "argv", list(sys.argv))
  saved = dict(os.environ)
  yield monkeypatch
  os.environ.clear()
  os.environ.update(saved)


def _config_overrides(module_name: str, argv: list[str], monkeypatch) -> config_lib.Overrides:
  module = _load(module_name)
  real = config_lib.parse_overrides

  def capture(args: list[str], environ: Any = None) -> config_lib.Overrides:
    raise _Parsed(real(args, environ={}))
  monkeypatch.setattr(config_lib, "parse_overrides", capture)
  with pytest.raises(_Parsed) as parsed:
    module.main([module_name.rsplit(".", 1)[-1], str(config_lib.BASE_CONFIG_PATH), *argv])
  return parsed.value.what


def _parser(name: str, monkeypatch) -> tuple[argparse.ArgumentParser, dict[str, str]]:
  """The tool's parser and the old names it renames, taken where it parses."""
  def capture(parser: argparse.ArgumentParser, argv: Any = None, renamed: Any = None) -> Any:
    raise _Parsed((parser, dict(renamed or {})))

  def bypass(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError(f"{name} parses its arguments with argparse directly; use configuration/tool_args")
  with monkeypatch.context() as patch:
    patch.setattr(tool_args, "parse_args", capture)
    patch.setattr(tool_args, "parse_known_args", capture)
    patch.setattr(argparse.ArgumentParser, "parse_args", bypass)
    patch.setattr(argparse.ArgumentParser, "parse_known_args", bypass)
    module = _load(name)
    with pytest.raises(_Parsed) as parsed:
      _call_main(module.main, f"{name}.py" if name in BENCHMARKS else name, [])
  return parsed.value.what


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
  return {a.dest: a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)}


def _positionals(parser: argparse.ArgumentParser) -> list[str]:
  """A value for each positional argument (its first choice)."""
  return [str(list(a.choices)[0]) if a.choices else "x" for a in parser._actions
          if not a.option_strings and a.nargs not in ("?", "*")]


def _sample(action: argparse.Action) -> tuple[str, Any]:
  """A key=value text for the option and the value it must give."""
  if action.nargs == 0:
    return ("false", False) if action.const is False else ("true", True)
  if action.choices:
    choice = list(action.choices)[-1]
    return str(choice), choice
  kind = action.type if callable(action.type) else str
  text = {int: "3", float: "0.5"}.get(kind, "some/value")  # type: ignore[call-overload]
  return text, kind(text)


def _deprecations(text: str) -> list[str]:
  return [line for line in text.splitlines() if "deprecated" in line]


# ---------------------------------------------------------------- every tool takes key=value

@pytest.mark.parametrize("module_name", sorted(CONFIG_TOOLS))
def test_every_config_tool_takes_key_value(module_name, quiet_process, capsys):
  own = CONFIG_TOOLS[module_name]
  overrides = _config_overrides(module_name, [*own, "steps=3", "decode_sampling_top_k=7"], quiet_process)
  assert overrides.argv_values["steps"] == 3 and overrides.argv_values["decode_sampling_top_k"] == 7
  own_keys = {arg.partition("=")[0] for arg in own} - CONFIG_KEYS
  assert not own_keys & set(overrides.argv_values), "a tool's own keys must not reach the config"
  assert not _deprecations(capsys.readouterr().err)


@pytest.mark.parametrize("name", [*ARGPARSE_MODULES, *BENCHMARKS])
def test_every_argparse_tool_takes_key_value_for_every_option_spelled_once(name, quiet_process, capsys):
  parser, renamed = _parser(name, quiet_process)
  options = _options(parser)
  assert options, f"{name}: no options found"
  for dest, action in options.items():
    assert action.option_strings == [f"--{dest}"], (
        f"{name}: {action.option_strings} for {dest}: declare each option once as --{dest} (old spellings go in "
        "the renamed table passed to tool_args)")
  samples = {dest: _sample(action) for dest, action in options.items()}
  args = REAL_PARSE_ARGS(parser, [*_positionals(parser), *(f"{dest}={text}" for dest, (text, _) in samples.items())])
  assert {dest: getattr(args, dest) for dest in options} == {dest: value for dest, (_, value) in samples.items()}
  assert not _deprecations(capsys.readouterr().err)
  for old, new in renamed.items():
    assert new in options, f"{name}: renamed {old!r} -> {new!r}, which is no option"
    assert old not in options, f"{name}: {old!r} is both an option and an old name"


@pytest.mark.parametrize("name", [*ARGPARSE_MODULES, *BENCHMARKS])
def test_every_old_flag_spelling_works_with_one_deprecation_line(name, quiet_process, capsys, monkeypatch):
  parser, renamed = _parser(name, quiet_process)
  options = _options(parser)
  positionals = _positionals(parser)
  for old_name, dest in [*((d, d) for d in options), *renamed.items()]:
    action = options[dest]
    text, value = _sample(action)
    switch = action.nargs == 0
    negated = old_name == f"no_{dest}"  # no_x=true is x=false
    tries = [([f"--{old_name}"], action.const) if switch else ([f"--{old_name}", text], value)]
    if old_name != dest:
      tries.append(([f"{old_name}={'true' if negated else text}"], (not negated) if switch else value))
    required = [f"{d}={_sample(a)[0]}" for d, a in options.items() if a.required and d != dest]
    for argv, expected in tries:
      monkeypatch.setattr(spellings, "_warned", set())
      args = REAL_PARSE_ARGS(parser, [*positionals, *required, *argv], renamed)
      assert getattr(args, dest) == expected, (name, argv)
      assert len(_deprecations(capsys.readouterr().err)) == 1, (name, argv)


def test_every_entry_point_is_covered():
  """A new entry point (Architecture.md's list) or argparse benchmark must be added above."""
  text = (REPO / "getting_started" / "Architecture.md").read_text()
  listed = re.search(r"Entry points: (.*?)\. Each declares", text, re.S)
  assert listed, "Architecture.md lists the entry points"
  modules = {"MaxText." + path[:-3].replace("/", ".") for path in re.findall(r"`([\w/]+\.py)`", listed.group(1))}
  assert modules == set(CONFIG_TOOLS) | set(ARGPARSE_MODULES)


# ---------------------------------------------------------------- one name per idea

def _canonical_names(monkeypatch) -> dict[str, set[str]]:
  """tool -> its canonical names ("config": base.yml's keys)."""
  from MaxText import logit_checker, plan
  from MaxText.convert import hf_to_maxtext, maxtext_to_hf

  names: dict[str, set[str]] = {"config": set(CONFIG_KEYS), "logit_checker": {f.name for f in dataclasses.fields(logit_checker.CheckerArgs)},
                                "plan": {f.name for f in dataclasses.fields(plan.PlanArgs)}, "hf_to_maxtext": set(hf_to_maxtext.OWN_KEYS),
                                "maxtext_to_hf": {*maxtext_to_hf.OWN_KEYS, *maxtext_to_hf.OPTIONAL_KEYS}}
  for name in (*ARGPARSE_MODULES, *BENCHMARKS):
    parser, _ = _parser(name, monkeypatch)
    names[name.rsplit(".", 1)[-1]] = set(_options(parser))
  return names


def test_no_two_canonical_names_mean_one_idea(quiet_process):
  names = _canonical_names(quiet_process)
  problems = []
  for group in SYNONYMS:
    canonical = {member.name: sorted(tool for tool, keys in names.items()
                                     if member.name in keys and tool not in member.other_meaning)
                 for member in group}
    used = {name: tools for name, tools in canonical.items() if tools}
    if len(used) > 1:
      problems.append(" and ".join(f"{name} ({', '.join(tools)})" for name, tools in used.items()))
  assert not problems, "two names for one idea (keep the first of its SYNONYMS group, the other as an alias): " + \
      "; ".join(problems)


def test_every_rename_is_listed_as_a_synonym(quiet_process):
  """An old spelling kept as an alias belongs in SYNONYMS beside its new name, so the test above
  keeps it from coming back as a second canonical name."""
  from MaxText import logit_checker
  from MaxText.convert import cli

  renames = {**spellings.RENAMED_KEYS, **cli.RENAMED, **logit_checker._RENAMED}
  for name in (*ARGPARSE_MODULES, *BENCHMARKS):
    renames.update(_parser(name, quiet_process)[1])
  grouped = {(old.name, new.name) for group in SYNONYMS for new in group[:1] for old in group[1:]}
  missing = sorted(f"{old} -> {new}" for old, new in renames.items() if (old, new) not in grouped)
  assert not missing, f"renames missing from SYNONYMS: {missing}"


def test_decode_and_rl_sampling_keys_share_one_suffix_family():
  suffixes = {prefix: {k.split("_sampling_", 1)[1] for k in CONFIG_KEYS if k.startswith(f"{prefix}_sampling_")}
              for prefix in ("decode", "rl")}
  assert suffixes["rl"] <= suffixes["decode"], suffixes
  assert not [k for k in CONFIG_KEYS if "nucleus" in k], "top_p is the name of the nucleus cut"
