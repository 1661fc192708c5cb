"""One name per idea: every old spelling of a config key still works, maps to its new name and
prints one deprecation line; both spellings with different values is one `error:` line; a saved
record written before a rename reads without a word."""

from __future__ import annotations

import json
import types

import pytest
import yaml

from MaxText import errors
from MaxText.configuration import config as config_lib
from MaxText.configuration import model_checks, run_record, spellings
from MaxText.errors import ConfigError

SCHEMA = config_lib.read_yaml(config_lib.BASE_CONFIG_PATH)
# A valid value for each renamed key, other than its default (so the test sees it arrive).
SAMPLE_VALUE = {"decode_sampling_top_p": 0.5, "rl_sampling_temperature": 0.7, "rl_sampling_top_p": 0.8,
                "rl_sampling_top_k": 5, "rope_proportional_rotated_fraction": 0.25, "vision_rope_max_timescale": 500.0,
                "enable_jsonl_metrics": False, "profile_start_step": 7, "profile_steps": 2,
                "ici_sequence_parallelism": 2, "dcn_sequence_parallelism": 2}


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
  monkeypatch.setattr(spellings, "_warned", set())


def _deprecations(text: str) -> list[str]:
  return [line for line in text.splitlines() if "deprecated" in line]


def test_every_renamed_key_names_a_key_and_no_old_one_is_still_a_key():
  assert set(SAMPLE_VALUE) == set(spellings.RENAMED_KEYS.values())
  for old, new in spellings.RENAMED_KEYS.items():
    assert new in SCHEMA, f"{old} -> {new}: {new} is not in base.yml"
    assert old not in SCHEMA, f"{old} is still a key of base.yml beside {new}"


@pytest.mark.parametrize("old, new", sorted(spellings.RENAMED_KEYS.items()))
def test_an_old_key_on_the_command_line_sets_the_new_one_with_one_warning(old, new, capsys):
  value = SAMPLE_VALUE[new]
  for _ in range(2):  # a second parse in the same process says nothing more
    overrides = config_lib.parse_overrides(["prog", f"{old}={value}"], environ={})
    assert overrides.argv_values == {new: value} and old not in overrides.argv_values
  assert _deprecations(capsys.readouterr().err) == [f"warning: '{old}' is deprecated; use '{new}'"]


def test_an_old_key_works_from_the_environment_a_yaml_file_and_a_tools_values(tmp_path, capsys):
  overrides = config_lib.parse_overrides(["prog"], environ={"M_RL_TOP_P": "0.8"})
  assert overrides.env_values == {"rl_sampling_top_p": 0.8}
  recipe = tmp_path / "recipe.yml"
  recipe.write_text(f"base_config: {config_lib.BASE_CONFIG_PATH}\nrl_temperature: 0.7\n")
  assert config_lib.parse_overrides(["prog", str(recipe)], environ={}).file_values == {"rl_sampling_temperature": 0.7}
  config = config_lib.Config.for_testing(decode_sampling_nucleus_p=0.5)  # a tool's own values take them too
  assert config["decode_sampling_top_p"] == 0.5 and "decode_sampling_nucleus_p" not in config.values
  assert _deprecations(capsys.readouterr().err) == [
      "warning: 'rl_top_p' is deprecated; use 'rl_sampling_top_p'",
      "warning: 'rl_temperature' is deprecated; use 'rl_sampling_temperature'",
      "warning: 'decode_sampling_nucleus_p' is deprecated; use 'decode_sampling_top_p'"]


def test_both_spellings_agreeing_is_fine_and_disagreeing_is_one_error_line(capsys):
  same = config_lib.parse_overrides(["prog", "rl_top_k=5", "rl_sampling_top_k=5"], environ={})
  assert same.argv_values == {"rl_sampling_top_k": 5}
  for argv in (["rl_top_k=5", "rl_sampling_top_k=6"], ["rl_sampling_top_k=6", "rl_top_k=5"]):
    with pytest.raises(ConfigError, match="'rl_top_k' \\(deprecated\\) and 'rl_sampling_top_k' name the same "
                       "setting but the command line gives them different values \\(5 and 6\\); keep only "
                       "'rl_sampling_top_k'"):
      config_lib.parse_overrides(["prog", *argv], environ={})
  with pytest.raises(ConfigError, match="'M_RL_TOP_K' \\(deprecated\\) and 'M_RL_SAMPLING_TOP_K'"):
    config_lib.parse_overrides(["prog"], environ={"M_RL_TOP_K": "5", "M_RL_SAMPLING_TOP_K": "6"})
  capsys.readouterr()
  with pytest.raises(SystemExit) as exit_info:
    errors.run_cli(lambda argv: config_lib.parse_overrides(argv, environ={}) and 0,
                   ["prog", "rl_top_k=5", "rl_sampling_top_k=6"])
  err = capsys.readouterr().err
  assert exit_info.value.code == 2
  assert [line for line in err.splitlines() if line.startswith("error")] == [err.splitlines()[-1]]
  assert err.splitlines()[-1].startswith("error: 'rl_top_k' (deprecated) and 'rl_sampling_top_k'")


def test_a_saved_record_under_an_old_name_reads_as_the_new_one_without_a_warning(tmp_path, capsys):
  checkpoint = tmp_path / "ckpt"
  checkpoint.mkdir()
  (checkpoint / run_record.MODEL_CONFIG_FILE).write_text(yaml.safe_dump({"rope_partial_rotary_factor": 0.25}))
  assert run_record.saved_model_keys(str(checkpoint))[0] == {"rope_proportional_rotated_fraction": 0.25}
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  (run_dir / run_record.CONFIG_FILE).write_text(yaml.safe_dump({"rl_top_p": 0.8, "steps": 3}))
  assert run_record.read_saved(str(run_dir)) == {"rl_sampling_top_p": 0.8, "steps": 3}
  assert not _deprecations(capsys.readouterr().err)


# ---------------------------------------------------------------- upstream's megablox switch

@pytest.mark.parametrize("given, chosen", [("true", "megablox"), ("False", "ragged_dot"), ("1", "megablox")])
def test_upstreams_megablox_switch_chooses_the_grouped_matmul_kernel(given, chosen, tmp_path, capsys):
  assert "megablox" not in SCHEMA
  assert config_lib.parse_overrides(["prog", f"megablox={given}"], environ={}).argv_values == {
      "moe_grouped_matmul": chosen}
  assert config_lib.parse_overrides(["prog"], environ={"M_MEGABLOX": given}).env_values == {
      "moe_grouped_matmul": chosen}
  recipe = tmp_path / "recipe.yml"
  recipe.write_text(f"base_config: {config_lib.BASE_CONFIG_PATH}\nmegablox: {given}\n")
  assert config_lib.parse_overrides(["prog", str(recipe)], environ={}).file_values == {"moe_grouped_matmul": chosen}
  assert _deprecations(capsys.readouterr().err) == ["warning: 'megablox' is deprecated; use 'moe_grouped_matmul'"]
  assert config_lib.Config.for_testing(megablox=chosen == "megablox", sparse_matmul=True)["moe_grouped_matmul"] == chosen


def test_megablox_without_sparse_matmul_says_in_one_line_that_its_kernel_does_not_run(monkeypatch, capsys):
  """Upstream's sparse_matmul defaults to True, ours to False: a block that sets only megablox=true would run
  padded dense experts without a word."""
  from MaxText.configuration import model_config

  monkeypatch.setattr(model_config, "_WARNED_UNUSED_KERNEL", set())
  moe = dict(num_experts=4, num_experts_per_tok=2)
  config_lib.Config.for_testing(megablox=True)  # a dense model: no experts to run
  config_lib.Config.for_testing(**moe, megablox=True, sparse_matmul=True)
  config_lib.Config.for_testing(**moe, megablox=False)
  assert "sparse_matmul" not in capsys.readouterr().err
  for _ in range(2):
    assert config_lib.Config.for_testing(**moe, megablox=True)["moe_grouped_matmul"] == "megablox"
  assert [line for line in capsys.readouterr().err.splitlines() if "sparse_matmul" in line] == [
      "warning: moe_grouped_matmul=megablox (upstream's megablox=true) is the kernel of sparse_matmul, which is False "
      "(upstream's default is True): the experts run as padded dense matmuls; set sparse_matmul=True to run the "
      "grouped matmuls"]


def test_megablox_and_moe_grouped_matmul_disagreeing_is_one_error_line():
  assert config_lib.parse_overrides(["prog", "megablox=false", "moe_grouped_matmul=ragged_dot"],
                                    environ={}).argv_values == {"moe_grouped_matmul": "ragged_dot"}
  for argv in (["megablox=true", "moe_grouped_matmul=ragged_dot"], ["moe_grouped_matmul=ragged_dot", "megablox=true"]):
    with pytest.raises(ConfigError, match=r"^'megablox' \(deprecated\) chooses moe_grouped_matmul='megablox' but the "
                       r"command line also gives moe_grouped_matmul='ragged_dot'; keep only 'moe_grouped_matmul'$"):
      config_lib.parse_overrides(["prog", *argv], environ={})
  # From the environment: the variables as spelled, and megablox's choice as the switch's (it read as
  # M_MEGABLOX='megablox', a value the variable was not given).
  with pytest.raises(ConfigError, match=r"^'M_MEGABLOX' \(deprecated\) chooses M_MOE_GROUPED_MATMUL='megablox' but the "
                     r"environment also gives M_MOE_GROUPED_MATMUL='ragged_dot'; keep only 'M_MOE_GROUPED_MATMUL'$"):
    config_lib.parse_overrides(["prog"], environ={"M_MEGABLOX": "true", "M_MOE_GROUPED_MATMUL": "ragged_dot"})
  with pytest.raises(ConfigError, match=r"^megablox \(the command line\) must be true or false, got 'tpu'; it is "
                     r"deprecated: set moe_grouped_matmul=megablox \(true\) or moe_grouped_matmul=ragged_dot \(false\)$"):
    config_lib.parse_overrides(["prog", "megablox=tpu"], environ={})
  with pytest.raises(ConfigError, match=r"^'megablox' \(deprecated\) chooses moe_grouped_matmul='ragged_dot' but "
                     r"Config.for_testing also gives moe_grouped_matmul='megablox'"):
    config_lib.Config.for_testing(megablox=False, moe_grouped_matmul="megablox")


# ---------------------------------------------------------------- objective: the old use_sft/use_dpo/use_grpo

@pytest.mark.parametrize("flag, objective", sorted((k, v) for k, (_, v) in spellings.VALUE_ALIASES.items()))
def test_an_old_objective_flag_chooses_the_objective_with_one_warning(flag, objective, tmp_path, capsys):
  assert flag not in SCHEMA and SCHEMA["objective"] == "lm"
  assert config_lib.parse_overrides(["t", f"{flag}=True"], environ={}).argv_values == {"objective": objective}
  env = config_lib.parse_overrides(["t"], environ={f"M_{flag.upper()}": "true"})
  assert env.env_values == {"objective": objective}
  recipe = tmp_path / "recipe.yml"
  recipe.write_text(f"{flag}: true\n")
  assert config_lib.parse_overrides(["t", str(recipe)], environ={}).file_values == {"objective": objective}
  assert _deprecations(capsys.readouterr().err) == [f"warning: '{flag}' is deprecated; use 'objective={objective}'"]
  # False says only "not this objective": alone it sets nothing
  assert config_lib.parse_overrides(["t", f"{flag}=false"], environ={}).argv_values == {}


@pytest.mark.parametrize("argv, message", [
    (["use_sft=True", "use_dpo=True"], "'use_sft' and 'use_dpo' (deprecated) from the command line choose two values "
     "of objective; set only objective=sft or objective=dpo"),
    (["objective=dpo", "use_grpo=true"], "'use_grpo' (deprecated) says use_grpo=True but the command line also gives "
     "objective='dpo'; keep only 'objective'"),
    (["use_sft=false", "objective=sft"], "'use_sft' (deprecated) says use_sft=False but the command line also gives "
     "objective='sft'"),
    (["use_dpo=maybe"], "use_dpo (the command line) must be true or false, got 'maybe'; it is deprecated: set "
     "objective=dpo"),
])
def test_old_objective_flags_that_disagree_are_one_error_line(argv, message):
  with pytest.raises(ConfigError) as error:
    config_lib.parse_overrides(["t", *argv], environ={})
  assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("argv, environ", [(["use_sft=false"], {}), ([], {"M_USE_SFT": "false"})])
def test_a_false_flag_over_a_recipe_that_chose_its_objective_is_an_error_not_ignored(argv, environ):
  """configs/sft.yml use_sft=False once trained a plain language model; now it must not train SFT."""
  overrides = config_lib.parse_overrides(["t", str(config_lib.CONFIGS_DIR / "sft.yml"), *argv], environ=environ)
  with pytest.raises(ConfigError, match=r"^use_sft=False \(deprecated, from the (command line|environment)\) "
                     r"contradicts objective=sft, which the config file"):
    config_lib.resolve_values(overrides, "cpu")
  other = config_lib.parse_overrides(["t", str(config_lib.CONFIGS_DIR / "dpo.yml"), *argv], environ=environ)
  assert config_lib.resolve_values(other, "cpu")["objective"] == "dpo"
  # a higher layer's objective wins over the environment's flag
  if environ:
    higher = config_lib.parse_overrides(["t", str(config_lib.CONFIGS_DIR / "sft.yml"), "objective=lm"], environ=environ)
    assert config_lib.resolve_values(higher, "cpu")["objective"] == "lm"


def test_agreeing_old_and_new_objective_spellings_are_fine():
  assert config_lib.parse_overrides(["t", "objective=sft", "use_sft=true", "use_dpo=false"],
                                    environ={}).argv_values == {"objective": "sft"}


def test_an_unknown_objective_lists_the_choices():
  with pytest.raises(ConfigError, match=r"^objective must be one of lm, sft, dpo, grpo, distill, distill_sft; got 'rlhf'$"):
    config_lib.Config.for_testing(objective="rlhf")


def test_a_run_saved_with_use_sft_resumes_as_objective_sft_without_a_warning(tmp_path, capsys):
  assert "objective" in run_record.FIXED_ON_RESUME["data position"]
  (tmp_path / run_record.CONFIG_FILE).write_text(yaml.safe_dump(
      {"use_sft": True, "use_dpo": False, "use_grpo": False, "steps": 3}))
  saved = run_record.read_saved(str(tmp_path))
  assert saved == {"objective": "sft", "steps": 3}
  assert run_record.resume_differences({"objective": "sft"}, saved) == []
  assert run_record.resume_differences({"objective": "lm"}, saved) == ["objective: 'sft' -> 'lm'"]
  # the keys saved with a checkpoint step are read the same way
  step_keys = ({"use_sft": True, "use_dpo": False, "use_grpo": False}, "step 4's keys")
  empty = tmp_path / "no_config"
  empty.mkdir()
  def run(objective):
    return types.SimpleNamespace(values={"objective": objective}, data=types.SimpleNamespace(global_batch_size=8))
  assert run_record.check_resume(run("sft"), str(empty), "checkpoint step 4", step_keys)
  with pytest.raises(ConfigError, match="objective: 'sft' -> 'lm'"):
    run_record.check_resume(run("lm"), str(empty), "checkpoint step 4", step_keys)
  # a record whose flags are all False was a plain language-model run
  plain = spellings.upgrade({"use_sft": False, "use_dpo": False, "use_grpo": False})
  assert plain == {"objective": "lm"}
  assert not _deprecations(capsys.readouterr().err)


# ---------------------------------------------------------------- tools' own arguments

def test_the_converters_old_flags_map_to_their_key_value_names_with_one_warning_each(capsys):
  from MaxText.convert import cli

  own, rest = cli.split_args(["--hf_path", "hf", "--output_path=out", "scan_layers=false"],
                             ("hf_model_path", "output_path"))
  assert own == {"hf_model_path": "hf", "output_path": "out"} and rest == ["scan_layers=false"]
  own, rest = cli.split_args(["configs/base.yml", "--checkpoint", "ckpt", "output_path=hf", "max_shard_mb=7"],
                             ("load_parameters_path", "output_path"), ("max_shard_mb",))
  assert own == {"load_parameters_path": "ckpt", "output_path": "hf", "max_shard_mb": "7"}
  assert rest == ["configs/base.yml"]
  assert cli.split_args(["hf_path=hf", "output_path=out"], ("hf_model_path", "output_path"))[0] == {
      "hf_model_path": "hf", "output_path": "out"}  # the old name in the new syntax
  assert _deprecations(capsys.readouterr().err) == [
      "warning: '--hf_path' is deprecated; use 'hf_model_path=...'",
      "warning: '--output_path' is deprecated; use 'output_path=...'",
      "warning: '--checkpoint' is deprecated; use 'load_parameters_path=...'",
      "warning: 'hf_path' is deprecated; use 'hf_model_path'"]
  with pytest.raises(ConfigError, match="'--hf_path' \\(deprecated\\) and 'hf_model_path' name the same setting"):
    cli.split_args(["hf_model_path=a", "--hf_path", "b", "output_path=o"], ("hf_model_path", "output_path"))
  with pytest.raises(errors.UserError, match="unknown argument --output; this tool takes key=value arguments"):
    cli.split_args(["--output", "o"], ("hf_model_path", "output_path"))


def test_the_logit_checkers_images_is_the_config_key_image_path(capsys):
  from MaxText import logit_checker

  checker, rest = logit_checker.split_checker_args(["hf_model_path=hf", "images=a.png,b.png", "dtype=float32"])
  assert checker.hf_model_path == "hf" and not hasattr(checker, "images")
  assert rest == ["image_path=a.png,b.png", "dtype=float32"]  # read by the config, as decode.py reads it
  assert _deprecations(capsys.readouterr().err) == ["warning: 'images' is deprecated; use 'image_path'"]
  with pytest.raises(ConfigError, match="'images' \\(deprecated\\) and 'image_path'"):
    logit_checker.split_checker_args(["hf_model_path=hf", "image_path=a.png", "images=b.png"])


def test_the_data_tools_take_key_value_and_their_old_flags_with_one_warning_each(tmp_path, capsys):
  from MaxText import train_tokenizer
  from MaxText.input_pipeline import prepare_data

  args = prepare_data._parse(["prepare_data", "data_files=a.txt", "output_path=o", "split_by=line"])
  assert (args.data_files, args.output_path, args.split_by) == ("a.txt", "o", "line")
  assert not _deprecations(capsys.readouterr().err)
  args = prepare_data._parse(["prepare_data", "--input", "a.txt", "--output_dir=o", "--split_by", "line"])
  assert (args.data_files, args.output_path, args.split_by) == ("a.txt", "o", "line")
  args = train_tokenizer._parse(["train_tokenizer", "--dataset_path", "c.txt", "--vocab_size", "9", "--output", "m",
                                 "--text_column", "body"])
  assert (args.data_files, args.vocab_size, args.output_path, args.train_data_columns) == ("c.txt", 9, "m", "body")
  assert _deprecations(capsys.readouterr().err) == [
      "warning: '--input' is deprecated; use 'data_files=...'",
      "warning: '--output_dir' is deprecated; use 'output_path=...'",
      "warning: '--split_by' is deprecated; use 'split_by=...'",
      "warning: '--dataset_path' is deprecated; use 'data_files=...'",
      "warning: '--vocab_size' is deprecated; use 'vocab_size=...'",
      "warning: '--output' is deprecated; use 'output_path=...'",
      "warning: '--text_column' is deprecated; use 'train_data_columns=...'"]
  with pytest.raises(SystemExit) as exit_info:
    prepare_data._parse(["prepare_data", "--input=a.txt", "data_files=b.txt", "output_path=o"])
  assert exit_info.value.code == 2
  assert capsys.readouterr().err.splitlines()[-1] == (
      "error: '--input' (deprecated) and 'data_files' name the same setting but the command line gives them different "
      "values ('a.txt' and 'b.txt'); keep only 'data_files'")


def test_prepare_data_reads_several_files_as_one_corpus(tmp_path, capsys):
  from MaxText.input_pipeline import prepare_data

  for name, text in [("a.txt", "one\n\ntwo\n"), ("b.txt", "three\n\nfour\n")]:
    (tmp_path / name).write_text(text)
  assert prepare_data.main(["prepare_data", f"data_files={tmp_path / 'a.txt'},{tmp_path / 'b*.txt'}",
                            f"output_path={tmp_path / 'out'}", "formats=jsonl", "eval_fraction=0.25"]) == 0
  lines = (tmp_path / "out" / "jsonl" / "train.jsonl").read_text().splitlines()
  assert [json.loads(line)["text"] for line in lines] == ["one", "two", "three"]
  assert json.loads((tmp_path / "out" / "jsonl" / "validation.jsonl").read_text())["text"] == "four"


def test_the_tpu_launchers_take_key_value_and_both_old_dry_run_spellings(capsys):
  from MaxText import multihost_job, multihost_runner

  args = multihost_runner.parse_args(["tpu_prefix=p", "command=python3 -m MaxText.train steps=5", "num_slices=2",
                                      "dry_run=true", "use_existing_folder=true", "run_name=r"])
  assert (args.tpu_prefix, args.command, args.num_slices, args.dry_run, args.use_existing_folder) == (
      "p", "python3 -m MaxText.train steps=5", 2, True, True)
  assert not _deprecations(capsys.readouterr().err)
  for old in ("--dry-run", "--DRY_RUN"):
    args = multihost_runner.parse_args(["--TPU_PREFIX=p", "--COMMAND", "true", old])
    assert (args.tpu_prefix, args.command, args.dry_run) == ("p", "true", True)
  args = multihost_job.parse_args(["--TPU_TYPE=v5litepod-16", "--VERSION=v", "--BUCKET_NAME=b", "command=true"])
  assert (args.tpu_type, args.version, args.bucket_name) == ("v5litepod-16", "v", "b")
  assert _deprecations(capsys.readouterr().err) == [
      "warning: '--TPU_PREFIX' is deprecated; use 'tpu_prefix=...'",
      "warning: '--COMMAND' is deprecated; use 'command=...'",
      "warning: '--dry-run' is deprecated; use 'dry_run=true'",
      "warning: '--DRY_RUN' is deprecated; use 'dry_run=true'",
      "warning: '--TPU_TYPE' is deprecated; use 'tpu_type=...'",
      "warning: '--VERSION' is deprecated; use 'version=...'",
      "warning: '--BUCKET_NAME' is deprecated; use 'bucket_name=...'"]


def test_the_planners_and_checkers_own_arguments_are_typed_by_tool_args(capsys):
  """One parser (tool_args.parse_tool_record) for the tools' typed own arguments: the old --flag
  spelling warns once, a value of the wrong type is one line naming the key."""
  from MaxText import logit_checker, plan

  args, rest = plan.PlanArgs.parse(["plan", "configs/base.yml", "--max_candidates", "3", "headroom=0.2", "steps=5"])
  assert (args.max_candidates, args.headroom, args.workers) == (3, 0.2, 0)
  assert rest == ["plan", "configs/base.yml", "steps=5"]
  assert _deprecations(capsys.readouterr().err) == ["warning: '--max_candidates' is deprecated; use 'max_candidates=...'"]
  checker, rest = logit_checker.split_checker_args(["hf_model_path=hf", "atol=0.5", "seed=3", "dtype=float32"])
  assert (checker.atol, checker.max_kl, checker.seed, rest) == (0.5, None, 3, ["dtype=float32"])
  with pytest.raises(ConfigError, match="^batch_size must be an int, got 'two'$"):
    logit_checker.split_checker_args(["hf_model_path=hf", "batch_size=two"])
  with pytest.raises(ConfigError, match="^budget_minutes must be a float, got 'soon'$"):
    plan.PlanArgs.parse(["plan", "budget_minutes=soon"])


# ---------------------------------------------------------------- upstream's model names

def test_upstreams_model_names_read_our_files_with_one_warning_line(capsys):
  """Each of upstream MaxText's other names reads the same configs/models file as ours, saying so once;
  every name it maps to is a file here, and none is a file of its own (one file per model)."""
  names = {k: v for family in model_checks.families().values() for k, v in family.upstream_model_names.items()}
  assert names
  for upstream, ours in names.items():
    assert config_lib.MODELS_DIR.joinpath(f"{ours}.yml").is_file()
    assert not config_lib.MODELS_DIR.joinpath(f"{upstream}.yml").exists()
  model = config_lib.Config.for_testing(model_name="llama4-17b-16e", print_config=False).model
  assert model == config_lib.Config.for_testing(model_name="llama4-scout-17b-16e", print_config=False).model
  config_lib.Config.for_testing(model_name="llama4-17b-16e", print_config=False)
  warned = [line for line in capsys.readouterr().err.splitlines() if "model_name" in line]
  assert warned == ["warning: model_name 'llama4-17b-16e' is upstream MaxText's name; here it is 'llama4-scout-17b-16e'"]
