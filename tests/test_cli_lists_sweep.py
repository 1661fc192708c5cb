"""Lists typed on the command line (`key=a,b`, `key=[a, b]`) fed what a hurried user types: an empty item, a
bracket left open, a quoted item, a comma from another script. Each is the list meant or one line naming the key
and the item; the same rule holds for every key and file field that takes comma-separated items."""

import subprocess
import sys
from pathlib import Path

import pytest

from MaxText.configuration import config as config_lib
from MaxText.configuration import data_mixture
from MaxText.configuration.config import BASE_CONFIG_PATH
from MaxText.configuration.task_eval_config import TaskEvalConfig
from MaxText.errors import ConfigError
from MaxText.platform.accelerators import DeviceTarget
from MaxText.input_pipeline import files

REPO = Path(__file__).resolve().parent.parent


def argv_value(arg: str) -> object:
  parsed = config_lib.parse_overrides(["train.py", str(BASE_CONFIG_PATH), arg], environ={})
  return next(iter(parsed.argv_values.values()))


def refused(arg: str) -> str:
  with pytest.raises(ConfigError) as info:
    config_lib.parse_overrides(["train.py", str(BASE_CONFIG_PATH), arg], environ={})
  message = str(info.value)
  assert "\n" not in message and len(message) < 400, message
  return message


@pytest.mark.parametrize("arg, expected", [
    ("prompt_token_ids=1,2", ["1", "2"]), ("prompt_token_ids= 1 , 2 ", ["1", "2"]),
    ("prompt_token_ids=1,2,", ["1", "2"]),  # one trailing comma, as YAML's own [1, 2,] allows
    ("prompt_token_ids=[1,2,]", [1, 2]), ("prompt_token_ids=5", [5]), ("prompt_token_ids=", []),
    ("prompt_token_ids=[]", []), ("eval_tasks=arc_easy,hellaswag", ["arc_easy", "hellaswag"]),
    ("draft_overrides=base_num_decoder_layers=2,", ["base_num_decoder_layers=2"]),
])
def test_a_comma_separated_list_reads_as_typed(arg, expected):
  assert argv_value(arg) == expected


@pytest.mark.parametrize("arg, start", [
    ("prompt_token_ids=1,,2", "prompt_token_ids has an empty item at position 2 of '1,,2'"),
    ("prompt_token_ids=,1", "prompt_token_ids has an empty item at position 1 of ',1'"),
    ("prompt_token_ids=1,2,,", "prompt_token_ids has an empty item at position 3 of '1,2,,'"),
    ("prompt_token_ids=,", "prompt_token_ids has an empty item at position 1 of ','"),
    ("eval_tasks=a,,b", "eval_tasks has an empty item at position 2 of 'a,,b'"),
    ("metric_trackers=wandb,,vertex_tensorboard", "metric_trackers has an empty item at position 2"),
    ("reward_weights=1, ,2", "reward_weights has an empty item at position 2"),
    ("attention_layer_pattern=local,,global", "attention_layer_pattern has an empty item at position 2"),
    ("draft_overrides=a=1,,b=2", "draft_overrides has an empty item at position 2"),
])
def test_an_empty_item_is_refused_not_dropped(arg, start):
  """`1,,2` was read as [1, 2]: a token id (or a task, a tracker) lost without a word."""
  message = refused(arg)
  assert message.startswith(start), message
  assert "remove the extra comma" in message


@pytest.mark.parametrize("arg, start", [
    ("prompt_token_ids=[1,,2]", "prompt_token_ids has an empty item at position 2 of '[1,,2]'"),
    ("eval_tasks=[a,,b]", "eval_tasks has an empty item at position 2 of '[a,,b]'"),
    ("eval_tasks=[a,b", "eval_tasks='[a,b' has a '[' without its ']'"),
    ("eval_tasks=a,b]", "eval_tasks='a,b]' has a ']' without its '['"),
])
def test_a_bracketed_list_yaml_cannot_read_is_one_line(arg, start):
  """`[a,,b]` became the items '[a' and 'b]': two task names no registry has, found only when the run started."""
  message = refused(arg)
  assert message.startswith(start), message


def test_a_comma_of_another_script_is_named():
  """`a，b` (a fullwidth comma, as a CJK keyboard types it) was one item 'a，b'."""
  message = refused("eval_tasks=arc_easy，hellaswag")
  assert message.startswith("eval_tasks's item 'arc_easy，hellaswag' holds '，' (U+FF0C)"), message
  assert "separate items with ','" in message


def test_a_quoted_item_is_refused():
  """`"a","b"` kept the quotes as part of each name."""
  message = refused('eval_tasks="arc_easy","hellaswag"')
  assert message.startswith("eval_tasks's item 1 is quoted ('\"arc_easy\"')"), message


def test_a_huge_list_with_an_empty_item_is_not_echoed_whole():
  message = refused("prompt_token_ids=" + ",".join(["7"] * 100_000) + ",,1")
  assert message.startswith("prompt_token_ids has an empty item at position 100001 of '7,7,7")


def test_group_and_file_fields_split_by_the_same_rule():
  """metric_trackers, eval_tasks, a mixture source's train_data_columns and a data key's files each split text
  themselves, each dropping an empty item."""
  with pytest.raises(ConfigError, match=r"^eval_tasks has an empty item at position 2 of 'a,,b'"):
    TaskEvalConfig.from_values({"eval_tasks": "a,,b", "eval_tasks_path": "", "eval_tasks_interval": 5,
                                "eval_tasks_limit": 0, "eval_tasks_num_fewshot": -1, "eval_interval": 5})
  with pytest.raises(ConfigError, match=r"^data_mixture source 'web' train_data_columns has an empty item at "
                                        r"position 1"):
    data_mixture._setting("web", "train_data_columns", ",text")  # pylint: disable=protected-access
  assert data_mixture._setting("web", "train_data_columns", "text,") == ("text",)  # pylint: disable=protected-access
  with pytest.raises(ConfigError, match=r"^hf_data_files has an empty item at position 2 of 'a.jsonl,,b.jsonl'"):
    files.expand_files("hf_data_files", "a.jsonl,,b.jsonl")


def test_an_empty_item_on_the_command_line_exits_with_one_error_line():
  result = subprocess.run([sys.executable, "-m", "MaxText.train", "configs/base.yml", "run_name=x",
                           "eval_tasks=a,,b"], cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 2, result.stderr[-2000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
  assert errors == ["error: eval_tasks has an empty item at position 2 of 'a,,b' (two commas in a row, or one "
                    "first); remove the extra comma"], result.stderr[-2000:]


def load(*args: str) -> config_lib.Config:
  target = DeviceTarget(platform="cpu", device_kind="cpu", num_devices=8)
  return config_lib.load_config(["train.py", str(BASE_CONFIG_PATH), "run_name=x", *args], environ={}, target=target)


@pytest.mark.parametrize("arg, end", [
    ("prompt_token_ids=5,x,7", "; item 2 is 'x'"),
    ("prompt_token_ids=5 17 42", "; item 1 is '5 17 42' (separate items with ',', not spaces)"),
    ("prompt_token_ids=" + ",".join(["7"] * 100_000) + ",1.5", "; item 100001 is '1.5'"),
], ids=["letter", "spaces", "huge"])
def test_a_token_id_that_is_no_integer_is_named(arg, end):
  """The line echoed the whole list (100,000 ids for one bad one) and never said which item was wrong."""
  with pytest.raises(ConfigError) as info:
    load(arg)
  message = str(info.value)
  assert message == "prompt_token_ids must be comma-separated integers like 5,17,42" + end, message[:300]


def test_an_empty_image_path_item_is_refused_before_a_model_loads():
  """decode and the logit checker dropped the empty item of `a.png,,b.png` (one image fewer than typed)."""
  with pytest.raises(ConfigError, match=r"^image_path has an empty item at position 2 of 'a.png,,b.png'"):
    load("image_path=a.png,,b.png")
  assert load("image_path=a.png,b.png,").decode.image_path == "a.png,b.png,"


def test_a_token_id_outside_the_vocabulary_is_named():
  with pytest.raises(ConfigError) as info:
    load("prompt_token_ids=" + ",".join(["7"] * 50_000) + ",999999999")
  assert str(info.value).endswith("); item 50001 is 999999999"), str(info.value)[:300]


def test_an_item_holding_brackets_is_not_called_unbalanced():
  """`x=[a,b]` inside a key=value list has both brackets: whatever its items say, no bracket is 'without its ['."""
  assert argv_value("draft_overrides=base_num_decoder_layers=2,attention_layer_pattern=[local,global]") == [
      "base_num_decoder_layers=2", "attention_layer_pattern=[local", "global]"]  # the draft's check names 'global]'
  assert argv_value('draft_overrides=[base_num_decoder_layers=2, "attention_layer_pattern=[local,global]"]') == [
      "base_num_decoder_layers=2", "attention_layer_pattern=[local,global]"]


def test_the_planners_block_sizes_split_by_the_same_rule():
  """`attention_blocks=512,,1024` compiled two block sizes where three items were typed."""
  from MaxText import plan  # pylint: disable=import-outside-toplevel
  with pytest.raises(ConfigError, match=r"^attention_blocks has an empty item at position 2 of '512,,1024'"):
    plan.PlanArgs(attention_blocks="512,,1024").block_sizes()
  assert plan.PlanArgs(attention_blocks="512,1024,").block_sizes() == [512, 1024]


def test_prepare_datas_formats_split_by_the_same_rule(tmp_path):
  """`formats=jsonl,,tfds` wrote two formats without a word about the empty item."""
  import argparse  # pylint: disable=import-outside-toplevel
  from MaxText.input_pipeline import prepare_data  # pylint: disable=import-outside-toplevel
  args = argparse.Namespace(output_path=str(tmp_path / "out"), formats="jsonl,,tfds")
  with pytest.raises(ConfigError, match=r"^formats has an empty item at position 2 of 'jsonl,,tfds'"):
    prepare_data._check_args(args, [])  # pylint: disable=protected-access


@pytest.mark.parametrize("arg", ["ici_fsdp_parallelism=auto", "dcn_data_parallelism=rest", "ici_tensor_parallelism=2.5"])
def test_a_mesh_degree_that_is_no_number_says_what_fills_the_rest(arg):
  """`auto` for a mesh degree got only 'must be a whole number': -1, the spelling that fills the rest, went unsaid."""
  message = refused(arg)
  assert message.endswith("; -1 gives this axis what the other degrees leave"), message


@pytest.mark.parametrize("arg, value", [("ici_tensor_parallelism=2.0", 2), ('ici_tensor_parallelism="2"', 2),
                                        ("ici_fsdp_parallelism=-1", -1), ("dcn_data_parallelism= 4 ", 4)])
def test_a_mesh_degree_reads_as_typed(arg, value):
  assert argv_value(arg) == value


def test_an_unknown_data_sharding_axis_lists_the_mesh_axes():
  """The line named the typo but not the axes there are, as logical_axis_rules' own line does."""
  with pytest.raises(ConfigError) as info:
    load("data_sharding=data,fsdpp")
  assert str(info.value) == ("data_sharding names unknown mesh axis 'fsdpp'; mesh axes are data, stage, fsdp, "
                             "fsdp_transpose, sequence, tensor, expert, autoregressive")


@pytest.mark.parametrize("args, message", [
    (("data_sharding=data,fsdp,data",), "data_sharding names mesh axis 'data' twice; name each axis once"),
    (("eval_tasks=arc_easy,hellaswag,arc_easy", "eval_interval=5"),
     "eval_tasks names arc_easy twice; name each task once"),
])
def test_a_name_listed_twice_is_refused_as_metric_trackers_and_reward_functions_are(args, message):
  """A batch split twice over one axis reached JAX's sharding (a traceback mid-start); a task twice was scored twice."""
  with pytest.raises(ConfigError) as info:
    load(*args)
  assert str(info.value) == message


def test_a_long_list_of_distinct_tasks_is_checked_for_repeats_at_once():
  tasks = ",".join(f"task{i}" for i in range(100_000))
  with pytest.raises(ConfigError, match=r"^eval_tasks names task0 twice"):
    TaskEvalConfig.from_values({"eval_tasks": tasks + ",task0", "eval_tasks_path": "", "eval_tasks_interval": 5,
                                "eval_tasks_limit": 0, "eval_tasks_num_fewshot": -1, "eval_interval": 5})
