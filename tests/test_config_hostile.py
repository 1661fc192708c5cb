"""Config loading fed what a hurried or hostile user types: broken YAML, odd spellings of numbers, keys in other
tools' styles, values too large or too deep to print. Each is the value meant or one `error:` line naming the
culprit."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from MaxText.platform.accelerators import DeviceTarget
from MaxText.configuration import config as config_lib, config_fields
from MaxText.configuration.config import BASE_CONFIG_PATH, Config, load_config
from MaxText.errors import ConfigError

CPU8 = DeviceTarget(platform="cpu", device_kind="cpu", num_devices=8)
REPO = Path(__file__).resolve().parent.parent


def load(*args: str, path: Path | str = BASE_CONFIG_PATH) -> Config:
  return load_config(["train.py", str(path), *args], environ={}, target=CPU8)


def load_file(tmp_path: Path, text: str | bytes, *args: str) -> Config:
  recipe = tmp_path / "recipe.yml"
  recipe.write_bytes(text.encode() if isinstance(text, str) else text)
  return load(*args, path=recipe)


def refused(tmp_path: Path, text: str | bytes, *args: str) -> str:
  with pytest.raises(ConfigError) as info:
    load_file(tmp_path, text, *args)
  message = str(info.value)
  assert "\n" not in message and len(message) < 400, message
  return message


@pytest.mark.parametrize("text, message", [
    # PyYAML's first line named only what it was reading ("while parsing a flow sequence"): no line, no problem.
    ("steps: 5\nmlp_activations: [silu, linear\n",
     r"recipe.yml': line 3, column 1: did not find expected ',' or ']' \(while parsing a flow sequence\)$"),
    ("\tsteps: 5\n", r"recipe.yml': line 1, column 1: found character that cannot start any token "
                     r"\(while scanning for the next token\) \(YAML indents with spaces, not tabs\)$"),
    ("steps: 5\n\trun_name: x\n", r"recipe.yml': line 2, column 1: found a tab character that violates indentation "
                                  r"\(while scanning a plain scalar\)$"),
    ("steps: 5\n  run_name: x\n", r"recipe.yml': line 2, column 11: mapping values are not allowed in this context$"),
])
def test_a_yaml_syntax_error_names_the_line_and_what_is_wrong(tmp_path, text, message):
  assert re.fullmatch(r"cannot parse '.*" + message, refused(tmp_path, text))


def test_a_config_file_that_is_not_utf8_says_so(tmp_path):
  """A Latin-1 file read "unacceptable character #x-001: incomplete UTF-8 octet sequence"."""
  assert refused(tmp_path, b"steps: 5\nrun_name: caf\xe9\n").endswith(
      "recipe.yml': incomplete UTF-8 octet sequence (line 2, byte 22); save it as UTF-8")


@pytest.mark.parametrize("text, shown", [("5: 3\n", "5"), ("yes: 3\n", "True"), ("~: 3\n", "None")])
def test_a_key_yaml_reads_as_a_number_or_boolean_is_one_line(tmp_path, text, shown):
  """A key that is no name reached the unknown-key check as an int: a TypeError traceback from difflib."""
  assert refused(tmp_path, text).endswith(
      f"recipe.yml' has a key YAML reads as {shown}, not a name: config keys are names like steps")


@pytest.mark.parametrize("text, key, value", [
    # YAML 1.1 read a leading zero as octal, a colon as base 60 and dropped underscores, all without a word
    ("steps: 010\n", "steps", 10),
    ("run_name: 012\n", "run_name", "012"),
    ("run_name: 1:30\n", "run_name", "1:30"),
    ("run_name: 2024_05_01\n", "run_name", "2024_05_01"),
    ("run_name: 0x1F\n", "run_name", "0x1F"),
    ("run_name: 2024-05-01\n", "run_name", "2024-05-01"),  # a YAML date: "got datetime.date(2024, 5, 1)"
    # whole numbers as people type them reach an int key as the number
    ("steps: 1e3\n", "steps", 1000),
    ("steps: 2.5e3\n", "steps", 2500),
])
def test_a_config_file_value_is_read_as_typed(tmp_path, text, key, value):
  assert load_file(tmp_path, text)[key] == value


def test_a_count_keeps_its_other_spellings_once_yaml_reads_only_decimals(tmp_path):
  """`010`, `1_000` and `0x10` are text to the loader now; an int key still takes each as the number."""
  config = load_file(tmp_path, "steps: 010\ncheckpoint_period: 1_000\nlog_period: 0x10\nlearning_rate: 1e-4\n")
  assert (config["steps"], config["checkpoint_period"], config["log_period"]) == (10, 1000, 16)
  assert config["learning_rate"] == 1e-4
  config = load("steps=010", "checkpoint_period=1_000", "log_period=0x10", "ici_fsdp_parallelism=08")
  assert (config["steps"], config["checkpoint_period"], config["log_period"], config["ici_fsdp_parallelism"]) == (
      10, 1000, 16, 8)


@pytest.mark.parametrize("arg, key, value", [
    ("steps=010", "steps", 10),  # octal 8 before
    ("steps=1e3", "steps", 1000),  # "must be a whole number ..., got '1e3'" before
    ("steps=1.5e3", "steps", 1500),
])
def test_a_command_line_number_is_read_as_typed(arg, key, value):
  assert load(arg)[key] == value


def test_a_base_60_number_for_an_int_key_is_refused_as_typed(tmp_path):
  assert refused(tmp_path, "steps: 1:30\n") == "steps must be a whole number like its default 150001, got '1:30'"


def test_values_too_long_or_too_deep_are_one_short_line(tmp_path):
  """Past 4300 digits Python refused to read the number and a few thousand brackets overflowed the stack: a
  ValueError or RecursionError traceback. The message shows the start of the value, not all of it."""
  digits = "9" * 5000
  with pytest.raises(ConfigError, match=r"^steps must be a whole number like its default 150001, got '9{59}\.\.\. "
                                        r"\(5002 characters\)$"):
    load(f"steps={digits}")
  assert refused(tmp_path, f"steps: {digits}\n").endswith("(5002 characters)")
  with pytest.raises(ConfigError, match=r"^steps must be a whole number like its default 150001, got '\[{59}\.\.\."):
    load("steps=" + "[" * 3000 + "]" * 3000)
  assert refused(tmp_path, "steps: " + "[" * 3000 + "]" * 3000 + "\n").endswith(
      "recipe.yml' nests lists or mappings more than 64 deep; no config value does")


def test_a_key_in_another_tools_style_gets_a_suggestion():
  """difflib matches case-sensitively: `STEPS=5` was "unknown config key 'STEPS'" with no hint."""
  for given, wanted in [("STEPS", "steps"), ("--STEPS", "steps"), ("Max-Target-Length", "max_target_length")]:
    with pytest.raises(ConfigError, match=rf"^unknown config key '{given}' from the command line \(did you mean "
                                          rf"'{wanted}'\?\)$"):
      load(f"{given}=5")


def test_a_config_file_after_a_key_value_says_it_goes_first():
  with pytest.raises(ConfigError, match=r"^expected key=value, got 'configs/base.yml' \(the config file goes first, "
                                        r"before any key=value\)$"):
    load_config(["train.py", "steps=5", "configs/base.yml"], environ={}, target=CPU8)


def test_an_empty_value_is_called_empty_not_none(tmp_path):
  """`steps:` with nothing after it read "got None", a value the user never typed."""
  assert refused(tmp_path, "steps:\n") == (
      "steps must be a whole number like its default 150001, got an empty value (None)")


def test_a_base_config_that_is_not_a_file_name_says_so(tmp_path):
  """`base_config: [base.yml]` read "config file \"<dir>/['base.yml']\" does not exist"."""
  assert refused(tmp_path, "base_config: [base.yml]\nsteps: 5\n").endswith(
      "recipe.yml': base_config must name one .yml file, got ['base.yml']")
  assert refused(tmp_path, "base_config: ''\nsteps: 5\n").endswith(
      "recipe.yml': base_config must name one .yml file, got ''")


def test_train_py_exits_2_with_one_error_line_for_a_key_that_is_no_name(tmp_path):
  recipe = tmp_path / "recipe.yml"
  recipe.write_text(f"base_config: {BASE_CONFIG_PATH}\n5: 3\n")
  env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
  proc = subprocess.run([sys.executable, "-m", "MaxText.train", str(recipe), f"base_output_directory={tmp_path}"],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "has a key YAML reads as 5, not a name" in errors[0], proc.stderr[-2000:]


@pytest.mark.parametrize("argv, line", [
    (["muon_beta=0.9"], "warning: opt_type=adamw does not read muon_beta=0.9; it changes nothing"),
    (["opt_type=sgd", "adam_weight_decay=0.2", "adam_b2=0.99"],
     "warning: opt_type=sgd does not read adam_b2=0.99, adam_weight_decay=0.2; they change nothing"),
    (["opt_type=muon", "muon_beta=0.9", "adam_weight_decay=0.2"], None),  # muon reads both
    (["adam_b2=0.99"], None),
    (["muon_beta=0.95"], None),  # base.yml's value: as a companion (draft, teacher) config passes every key
])
def test_an_optimizer_key_the_opt_type_does_not_read_is_one_warning(argv, line, capsys):
  """muon_beta with adamw, or adam_b2 with sgd, was accepted without a word and changed nothing."""
  config_fields.WARNED.clear()
  config_lib.load_config(["train", "configs/base.yml", *argv])
  warnings = [w for w in capsys.readouterr().err.splitlines() if "does not read" in w]
  assert warnings == ([line] if line else [])


def test_a_companion_config_of_an_adamw_run_warns_about_nothing(capsys):
  """A draft's or a teacher's config passes every one of the run's keys on as if given (muon_* included)."""
  config = config_lib.load_config(["decode", "configs/base.yml", "speculative_tokens=2", "draft_model_name=default"])
  config_fields.WARNED.clear()
  config_lib.draft_config(config)
  assert "does not read" not in capsys.readouterr().err


QUANTIZE_WEIGHTS_LINE = ("warning: quantize_weights=int8 sets how decode, serve and GRPO rollouts store the weights "
                         "they decode from; objective={objective} decodes nothing, so it changes nothing here and the "
                         "weights train in float (for int8 training matmuls set quantization=int8)")


@pytest.mark.parametrize("argv, reads_data, line", [
    (["quantize_weights=int8"], True, QUANTIZE_WEIGHTS_LINE.format(objective="lm")),
    (["quantize_weights=int8", "objective=dpo", "dataset_type=hf", "hf_data_files=pairs.jsonl",
      "tokenizer_type=huggingface", "tokenizer_path=tok"], True, QUANTIZE_WEIGHTS_LINE.format(objective="dpo")),
    (["quantize_weights=int8"], False, None),  # decode, serve: the engine stores its weights so
    ([], True, None),
])
def test_quantize_weights_in_a_run_that_decodes_nothing_is_one_warning(argv, reads_data, line, capsys):
  """train.py (and train_compile, plan) with quantize_weights and an objective that decodes nothing trained float
  weights; only train.py said so, in a note after the model was built: now one warning where the config is
  checked, as for an optimizer key opt_type does not read. GRPO's rollouts read it (configs/grpo.yml)."""
  config_fields.WARNED.clear()
  overrides = config_lib.parse_overrides(["train", "configs/base.yml", *argv], environ={})
  config_lib.build_config(overrides, CPU8, reads_data=reads_data)
  warnings = [w for w in capsys.readouterr().err.splitlines() if "quantize_weights" in w]
  assert warnings == ([line] if line else [])


def test_quantize_weights_with_grpo_rollouts_warns_about_nothing(capsys):
  config_fields.WARNED.clear()
  load_config(["train", "configs/grpo.yml", "quantize_weights=int8", "tokenizer_path=tok", "hf_data_files=p.jsonl",
               "reward_functions=exact_match", "per_device_batch_size=8"])
  assert "quantize_weights" not in capsys.readouterr().err


def test_a_list_of_names_keeps_its_numbers_as_typed_and_refuses_other_items(tmp_path):
  """A list of names (data columns, eval tasks, mesh axes) holding a number kept YAML's float (1.10 became the number
  1.1, a column no file has, found only at the first batch); a `true` or a mapping in it passed on to wherever the
  item was first used. Now numbers are the text typed, in a file and on the
  command line, and any other item is one line naming the key and the item."""
  config = load_file(tmp_path, f"base_config: {BASE_CONFIG_PATH}\ntrain_data_columns: [1.10, 2e3, text]\n")
  assert config.data.train_data_columns == ("1.10", "2e3", "text")
  assert load("train_data_columns=[1.10,b]").data.train_data_columns == ("1.10", "b")
  message = refused(tmp_path, f"base_config: {BASE_CONFIG_PATH}\neval_tasks: [hellaswag, yes]\n")
  assert message.startswith("eval_tasks's items must be text; item 1 is bool") and "quote it" in message
  message = refused(tmp_path, f"base_config: {BASE_CONFIG_PATH}\ntrain_data_columns: [{{a: 1}}]\n")
  assert message.startswith("train_data_columns's items must be text; item 0 is dict")


@pytest.mark.parametrize("key", ["mlp_activations", "attention_layer_pattern", "rope_layer_pattern"])
def test_a_long_list_of_names_with_unknown_items_names_a_few(key):
  """A per-layer pattern of thousands of items with a typo in it was echoed whole: one 27,000-character line."""
  items = ["zzz"] * 2000 + [f"typo{i}" for i in range(8)]
  with pytest.raises(ConfigError) as info:
    load(f"{key}=[{','.join(items)}]")
  message = str(info.value)
  assert len(message) < 300 and message.endswith("got 2008 items, among them 'zzz', 'typo0', 'typo1', 'typo2', "
                                                 "'typo3' and 4 more"), message
  with pytest.raises(ConfigError, match=f"^{key} must be a non-empty list of .*; got an empty list$"):
    load(f"{key}=[]")


def test_an_error_line_holding_a_huge_value_is_cut_in_the_middle(capsys):
  """Whatever check echoes a value, `error:` stays one line a terminal can show: the culprit first, the end kept."""
  from MaxText import errors

  def main(argv):
    raise ConfigError("data_mixture names a source " + "x" * 50_000 + " that has no files; check its path")

  with pytest.raises(SystemExit) as exit_info:
    errors.run_cli(main, ["prog"])
  line = capsys.readouterr().err.strip()
  assert exit_info.value.code == 2 and "\n" not in line and len(line) <= errors.ERROR_LINE_CHARACTERS + 100
  assert line.startswith("error: data_mixture names a source xxx") and line.endswith("that has no files; check its path")
  assert "characters left out" in line
