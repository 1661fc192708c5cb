"""The config's YAML files read as meant: libyaml's parser means what PyYAML's own does, a text key keeps a number
as typed, and what YAML 1.1 would read otherwise (base 60, `=`, two merges, aliases repeating a million values) is
text or one line naming the file and the line."""

import pytest
import yaml

from MaxText.configuration import config_yaml
from MaxText.configuration.config import CONFIGS_DIR, load_config
from MaxText.errors import ConfigError
from tests.test_config_hostile import CPU8, load, load_file, refused

PURE = config_yaml.loader_on(yaml.SafeLoader)


def _read(data: bytes, loader: type) -> object:
  try:
    return config_yaml.load("f.yml", data, ("run_name",), loader)
  except ConfigError as e:
    return f"ConfigError: {e}"


@pytest.mark.parametrize("data", [
    b"run_name: 1.10\nsteps: 010\nlearning_rate: 1_0.5e-1\n", b"\xef\xbb\xbfsteps: 5\r\nrun_name: x\r\n",
    b"a: [yes, no, on, off, ~, null, '', 0x10, 1e5, .inf, -.Inf, .NaN, 1:30, 1:30.5, 2026-12-05, =, <<]\n",
    b"<<: [{steps: 1, run_name: 2.50}, {steps: 2}]\nsteps: 3\n", b"a: &x {b: 1.5}\nc: {<<: *x, d: *x}\n",
    b'a: "\\t\\u00e9\\x41"\nb: |\n  1.10\nc: >-\n  x\n  y\n', b"steps: 5\nsteps: 6\n", b"a: {b: 1, b: 2}\n",
    b"steps: !!python/object/apply:os.system ['echo no']\n", b"a: [1, 2\n", b"run_name: caf\xe9\n",
    *(pytest.param(p.read_bytes(), id=str(p.relative_to(CONFIGS_DIR))) for p in sorted(CONFIGS_DIR.rglob("*.yml"))),
])
def test_libyamls_parser_means_what_pyyamls_own_does(data):
  """The loader moved to libyaml's parser for speed: both read every shipped config and these the same."""
  assert config_yaml.Loader.__mro__[1] is getattr(yaml, "CSafeLoader", yaml.SafeLoader)
  fast, pure = _read(data, config_yaml.Loader), _read(data, PURE)
  if isinstance(fast, str) and isinstance(pure, str):  # both refuse: the two parsers word some problems apart
    assert fast.split(": ")[1] == pure.split(": ")[1]  # e.g. "cannot parse 'f.yml'"
  else:
    assert repr(fast) == repr(pure)


@pytest.mark.parametrize("typed", ["1.10", "1.0e-5", ".inf", ".NaN", "+5", "-0", "1_000.5", "1:30.5", "=", "<<"])
def test_a_text_key_keeps_a_number_as_typed(tmp_path, typed):
  """`run_name: 1.10` ran as '1.1', `.inf` as 'inf', `1:30.5` as '90.5': the number YAML read, printed back;
  `=` was "could not determine a constructor for the tag 'tag:yaml.org,2002:value'"."""
  assert load_file(tmp_path, f"run_name: {typed}\n")["run_name"] == typed
  assert load(f"run_name={typed}")["run_name"] == typed


def test_a_merged_or_aliased_text_key_keeps_its_text_and_the_mappings_own_key_wins(tmp_path):
  config = load_file(tmp_path, "run_name: &n 2.50\nprompt: *n\n")
  assert (config["run_name"], config["prompt"]) == ("2.50", "2.50")
  assert load_file(tmp_path, "<<: {run_name: 2.50, steps: 3}\n")["run_name"] == "2.50"
  config = load_file(tmp_path, "<<: {run_name: 2.50, steps: 3}\nrun_name: own\n")
  assert (config["run_name"], config["steps"]) == ("own", 3)


def test_a_base_60_float_is_text_not_a_number(tmp_path):
  """YAML 1.1 read `1:30.5` as 90.5, so a learning rate typed as a ratio or a time ran at 90.5."""
  message = "learning_rate must be a number like its default 3e-05, got '1:30.5'"
  assert refused(tmp_path, "learning_rate: 1:30.5\n") == message
  with pytest.raises(ConfigError, match=f"^{message}$"):
    load("learning_rate=1:30.5")


def test_a_number_past_floats_range_is_one_line(tmp_path):
  """A 400-digit learning_rate was an OverflowError traceback (int too large to convert to float)."""
  digits = "9" * 400
  assert refused(tmp_path, f"learning_rate: {digits}\n").startswith(
      "learning_rate must be a number like its default 3e-05, got 9999")
  with pytest.raises(ConfigError, match=r"^learning_rate must be a number .*\(400 characters\)$"):
    load(f"learning_rate={digits}")


@pytest.mark.parametrize("text, shown", [("0\n", "0"), ("false\n", "False"), ("''\n", "''"), ("[]\n", "[]")])
def test_a_file_holding_one_value_is_refused_not_read_as_empty(tmp_path, text, shown):
  """Only an empty file (or comments only) holds no keys: `0` or `[]` ran base.yml's values without a word."""
  assert refused(tmp_path, text).endswith(f"recipe.yml' must hold a mapping of key: value lines, not {shown}")
  assert load_file(tmp_path, "# nothing yet\n")["steps"] == load()["steps"]


def test_merging_twice_in_one_mapping_is_refused(tmp_path):
  """The second `<<` silently won over the first's keys."""
  assert refused(tmp_path, "<<: {steps: 3}\n<<: {steps: 4}\n").endswith(
      "recipe.yml': it merges with << twice (lines 1 and 2); merge several at once with `<<: [*a, *b]`")


def test_aliases_repeating_a_million_values_are_one_line(tmp_path):
  """Nine aliases of nine aliases ... took 13 s to walk at 9**7 values (minutes at 9**8) before any check."""
  lines = ["data_mixture_schedule:", "  - &a0 [x, x, x, x, x, x, x, x, x]"]
  lines += [f"  - &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 8)]
  assert refused(tmp_path, "\n".join(lines) + "\n").endswith(
      "recipe.yml' holds more than 1000000 values (counting what YAML aliases repeat); no config needs that many")


@pytest.mark.parametrize("text, hint", [
    ("run_name: @x\n", "(quote a value that starts with @)"),  # it said "(YAML indents with spaces, not tabs)"
    ("run_name: `x\n", "(quote a value that starts with `)"),
    ("steps: 5\n\ufeffrun_name: x\n", "(a byte-order mark (U+FEFF) inside the file, as joining two files leaves it: "
                                      "delete it)"),
])
def test_a_parse_error_names_the_character_libyaml_does_not(tmp_path, text, hint):
  message = refused(tmp_path, text)
  assert message.endswith(hint) and "tabs" not in message


def test_a_file_with_nul_bytes_says_to_save_it_as_utf8(tmp_path):
  """UTF-16 without a byte-order mark read "control characters are not allowed (at byte 1)" and nothing more."""
  assert refused(tmp_path, "steps: 5\n".encode("utf-16-le")).endswith(
      "recipe.yml': control characters are not allowed (line 1, byte 1); save it as UTF-8")


def test_an_empty_config_path_says_so():
  """`train.py "$CONFIG"` with CONFIG unset said the config file '' is a directory."""
  with pytest.raises(ConfigError, match=r"^the config file path is empty; name a .yml file, e\.g\. configs/base\.yml$"):
    load_config(["train.py", "", "steps=5"], environ={}, target=CPU8)


def test_a_key_given_twice_on_the_command_line_says_which_wins(capsys):
  """The first was dropped without a word; it stays last-wins (elastic's resize appends keys the user gave)."""
  assert load("steps=5", "steps=6")["steps"] == 6
  assert "config: steps is given twice on the command line (5, then 6); the last wins" in capsys.readouterr().out
  assert load("steps=6", "steps=6")["steps"] == 6
  assert "twice" not in capsys.readouterr().out


def test_an_empty_auto_switch_is_called_empty(tmp_path):
  """`prefix_caching:` said "must be one of auto, true, false; got 'none'", a value the user never typed."""
  assert refused(tmp_path, "prefix_caching:\n") == (
      "prefix_caching must be a string like its default 'auto', got an empty value (None)")
