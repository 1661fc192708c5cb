"""Loads, type-checks and freezes the run configuration.

Sources, lowest to highest precedence:
  1. `configs/base.yml`,
  2. `configs/cpu_defaults.yml` when the backend is CPU and `cpu_defaults` is True,
  3. the YAML given as the first argument, if it is not base.yml (it may name a parent
     through `base_config: base.yml`),
  4. `configs/models/<model_name>.yml` (a key the YAML of 3. sets otherwise is an error),
  5. `M_<UPPERCASE_KEY>` environment variables,
  6. `key=value` command-line arguments (argv wins over the environment, as in MaxText;
     a key set in both is reported).

Every key must exist in base.yml; values are coerced to the type of the base.yml default.
The result is a frozen `Config` holding the flat values plus typed groups
(`config.model`, `config.mesh`, ...) built in `config_groups.py`.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import difflib
import os
import re
import types
from pathlib import Path
from typing import Any, Mapping

import yaml

from MaxText.configuration import config_fields, config_groups, config_yaml, data_config, decode_config, model_checks, spellings
from MaxText.configuration.config_yaml import read_yaml, shown as _shown
from MaxText.configuration.config_yaml import size_problem as _too_large
from MaxText.platform import accelerators
from MaxText.configuration import run_record
from MaxText.paths import storage
from MaxText.platform.accelerators import DeviceTarget
from MaxText.errors import ConfigError
from MaxText.configuration.model_config import MODEL_KEYS, ModelConfig
from MaxText.configuration.rl_config import RLConfig
from MaxText.configuration.task_eval_config import TaskEvalConfig
from MaxText.configuration.distill_config import DistillConfig

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
BASE_CONFIG_PATH = CONFIGS_DIR / "base.yml"
CPU_DEFAULTS_PATH = CONFIGS_DIR / "cpu_defaults.yml"
MODELS_DIR = CONFIGS_DIR / "models"
# Written beside a converted or exported checkpoint: its model keys, used when no model_name is given.
MODEL_CONFIG_FILE = run_record.MODEL_CONFIG_FILE
ENV_PREFIX = "M_"
# Keys whose values are paths (comma-separated lists allowed): each may be local or gs://.
PATH_KEYS = ("base_output_directory", "load_parameters_path", "draft_load_parameters_path", "load_full_state_path",
             "param_only_checkpoint_path", "compiled_trainstep_file", "tokenizer_path", "dataset_path", "hf_path", "hf_data_files", "hf_eval_files",
             "grain_train_files", "grain_eval_files")

# Values computed from other keys; setting them directly is a mistake we can explain.
DERIVED_KEYS = {
    "emb_dim": "base_emb_dim",
    "num_query_heads": "base_num_query_heads",
    "num_kv_heads": "base_num_kv_heads",
    "mlp_dim": "base_mlp_dim",
    "num_decoder_layers": "base_num_decoder_layers",
    "global_batch_size": "per_device_batch_size",
}

_KEY_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*):.*?\s#\s?(.*)$")
_MESH_DEGREE = re.compile(r"(ici|dcn)_[a-z_]+_parallelism")
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def read_descriptions(path: Path = BASE_CONFIG_PATH) -> dict[str, str]:
  """The one-line description of each key: its trailing comment in base.yml."""
  descriptions = {}
  for line in path.read_text().splitlines():
    match = _KEY_LINE.match(line)
    if match:
      descriptions[match.group(1)] = match.group(2).strip()
  return descriptions


_TYPE_NAMES = {bool: "boolean (true or false)", int: "whole number", float: "number", str: "string", list: "list"}


def _type_name(value: object) -> str:
  return _TYPE_NAMES.get(type(value), type(value).__name__)


def _whole_number(text: str) -> int | None:
  """A count as people type it: 1000, 1_000, 0x3e8, or 1e3 (YAML reads an exponent without a dot as text)."""
  text = text.strip()
  if re.fullmatch(r"[-+]?[0-9]+(_[0-9]+)*", text) and len(text) <= 4000:
    return int(text)
  if re.fullmatch(r"[-+]?0[xX][0-9a-fA-F]{1,1000}", text):
    return int(text, 16)
  if re.fullmatch(r"[-+]?[0-9]+(\.[0-9]*)?[eE]\+?[0-9]{1,3}", text) and float(text).is_integer():
    return int(float(text)) if float(text) < 2**53 else int(decimal.Decimal(text))
  return None


def _float(number: int | float) -> float | None:
  """float(number), or None past float's range (a 400-digit learning_rate was an OverflowError traceback)."""
  try:
    return float(number)
  except OverflowError:
    return None


def coerce(key: str, value: Any, default: Any) -> Any:
  """Converts `value` (a YAML scalar/list or a command-line string) to the type of `default`."""
  if key in decode_config.AUTO_SWITCHES and isinstance(value, (str, int)):  # auto | true | false, an old boolean
    text = str(value).strip().lower()
    return "true" if text in _TRUE else "false" if text in _FALSE else text
  if isinstance(default, bool):
    if isinstance(value, bool):
      return value
    text = str(value).strip().lower()
    if text in _TRUE:
      return True
    if text in _FALSE:
      return False
  elif isinstance(default, int):
    if isinstance(value, int) and not isinstance(value, bool):
      return value
    number = _whole_number(value) if isinstance(value, str) else None
    if number is not None:
      return number
    if isinstance(value, float) and value.is_integer():
      return int(value)
  elif isinstance(default, float):
    real: int | float | None = value if isinstance(value, (int, float)) and not isinstance(value, bool) else (
        _whole_number(value) if isinstance(value, str) else None)  # 0x10 and 1_000 as for an int key
    if real is not None and _float(real) is not None:
      return _float(real)
    try:
      if real is None:  # past float's range it names what was typed, not inf
        return float(str(value))
    except (ValueError, OverflowError):
      pass
  elif isinstance(default, str):
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
      return str(value)
  elif isinstance(default, list):
    if isinstance(value, (list, tuple)):
      return list(value)
    if isinstance(value, str):
      return config_yaml.split_items(key, value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return [value]  # `prompt_token_ids=5`: YAML read the one-item list as a number
  # A recipe's `query_proj: off` or `run_name: yes` reaches here as False or True (YAML 1.1's booleans): the
  # line says so, else "got False" names a value the user never typed.
  yaml_bool = (" (YAML reads an unquoted true/false, yes/no or on/off as a boolean: quote it to mean the word)"
               if isinstance(value, bool) and isinstance(default, str) else "")
  # `auto` is what other tools call the degree that takes the rest
  rest = "; -1 gives this axis what the other degrees leave" if _MESH_DEGREE.fullmatch(key) else ""
  raise ConfigError(
      f"{key} must be a {_type_name(default)} like its default {default!r}, got {_shown(value)}{yaml_bool}{rest}"
  )


_TEXT_LIST_KEYS = config_fields.text_list_keys(config_groups.GROUPS)


def _parse_cli_value(text: str, default: Any = None, key: str = "") -> Any:
  """Command-line values are YAML scalars/flow lists (`[a, b]`); anything unparsable stays text.

  A string-typed key takes the text as is (YAML would turn `run_name=off` into False)."""
  if isinstance(default, str):
    quoted = len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""
    return text[1:-1] if quoted else text
  if not text.strip():
    return ""  # `key=` means an empty value, not YAML's null
  # the files' loader: its integers, and libyaml's parser, which `[[[...` does not take past Python's stack
  try:
    value = config_yaml.value_of(text, key in _TEXT_LIST_KEYS)
  except yaml.YAMLError:
    return text
  return text if _too_large(value) else value


def _unknown_key_error(key: str, known: Mapping[str, Any], source: str) -> ConfigError:
  if key in DERIVED_KEYS:
    return ConfigError(
        f"{key} ({source}) is derived, not set directly: set {DERIVED_KEYS[key]!r} instead"
    )
  # `--steps`, `STEPS` or `max-target-length` name a key in another tool's style; difflib misses the upper case ones
  plain = key.lstrip("-").lower().replace("-", "_")
  close = [plain] if plain in known or plain in DERIVED_KEYS else difflib.get_close_matches(
      key, list(known) + list(DERIVED_KEYS), n=1, cutoff=0.6)
  suggestion = DERIVED_KEYS.get(close[0], close[0]) if close else None  # derived names point at their base key
  hint = f" (did you mean {suggestion!r}?)" if suggestion else ""
  return ConfigError(f"unknown config key {key!r} from {source}{hint}")


@dataclasses.dataclass(frozen=True)
class Overrides:
  """What the user asked for, before any platform is known: YAML path, argv and env overrides."""

  yaml_path: Path | str  # local or gs://
  file_values: Mapping[str, Any]
  argv_values: Mapping[str, Any]
  env_values: Mapping[str, Any]
  schema: Mapping[str, Any]
  # old False flags (spellings.VALUE_ALIASES) of the environment or argv that set nothing there: each
  # rules out one value a lower layer may set (old flag -> key, value, source)
  negated: Mapping[str, tuple[str, str, str]] = dataclasses.field(default_factory=dict)

  def explicit_keys(self) -> set[str]:
    return set(self.argv_values) | set(self.env_values)

  def below_argv(self, values: Mapping[str, Any], source: str) -> "Overrides":
    """`values` (typed like base.yml) as if given on the command line before the user's own
    key=value arguments: a tool's inferred or implied keys, which the user may still override."""
    return dataclasses.replace(self, argv_values={**_typed(values, self.schema, source), **self.argv_values})

  def peek(self, key: str) -> Any:
    """The value of `key` ignoring the model/CPU layers (used for platform and flag selection)."""
    for layer in (self.argv_values, self.env_values, self.file_values):
      if key in layer:
        return layer[key]
    return self.schema[key]


def _set_once(values: dict[str, Any], spelled: dict[str, str], key: str, given: str, value: object, source: str,
              prefix: str = "") -> None:
  """values[key] = value, unless an old and a new spelling of the key give it different values."""
  earlier = spelled.get(key)
  if earlier is not None and earlier != given and not spellings.same_value(values[key], value):
    old, new = (given, earlier) if given != key else (earlier, given)
    old_value, new_value = (value, values[key]) if given != key else (values[key], value)
    shown = (prefix + old.upper(), prefix + new.upper()) if prefix else None
    raise spellings.clash_error(old, new, old_value, new_value, source, shown)
  values[key], spelled[key] = value, given


def parse_overrides(argv: list[str], environ: Mapping[str, str] | None = None) -> Overrides:
  """Parses `prog [config.yml] key=value ...` and `M_<KEY>` variables, checking every key."""
  environ = os.environ if environ is None else environ
  schema = read_yaml(BASE_CONFIG_PATH)
  args = list(argv[1:])
  yaml_path: Path | str = BASE_CONFIG_PATH
  if args and "=" not in args[0]:
    yaml_path = args.pop(0)
  # the user's own YAML layer
  text_keys = {k for k, v in schema.items() if isinstance(v, str)} | _TEXT_LIST_KEYS
  text_keys |= {old for old, new in spellings.RENAMED_KEYS.items() if new in text_keys}
  file_values = spellings.canonical(read_yaml(yaml_path, BASE_CONFIG_PATH, text_keys), str(yaml_path))
  for key in file_values:
    if key not in schema:
      raise _unknown_key_error(key, schema, str(yaml_path))

  argv_values: dict[str, Any] = {}
  spelled: dict[str, str] = {}  # the spelling that set each key (an old one and its new one must agree)
  flags: dict[str, Any] = {}  # old flags that choose a key's value (spellings.VALUE_ALIASES)
  for arg in args:
    given, sep, text = arg.partition("=")
    if not sep or not given:
      first = " (the config file goes first, before any key=value)" if arg.endswith((".yml", ".yaml")) else ""
      raise ConfigError(f"expected key=value, got {arg!r}{first}")
    if given in spellings.VALUE_ALIASES:
      flags[given] = text
      continue
    key = spellings.rename(given)
    if key not in schema:
      raise _unknown_key_error(given, schema, "the command line")
    value = coerce(key, spellings.switch_value(given, _parse_cli_value(text, schema[key], key), "the command line"),
                   schema[key])
    if spelled.get(key) == given and not spellings.same_value(argv_values[key], value):
      # not refused: a wrapper's (or elastic's resize) key=value after the user's overrides it on purpose
      print(f"config: {given} is given twice on the command line ({argv_values[key]!r}, then {value!r}); the "
            "last wins")
    _set_once(argv_values, spelled, key, given, value, "the command line")

  argv_values = spellings.fold_value_aliases(argv_values, flags, "the command line")
  negated = spellings.negations(flags, argv_values, "the command line")
  env_values: dict[str, Any] = {}
  env_spelled: dict[str, str] = {}
  env_flags: dict[str, Any] = {}
  for name, text in environ.items():
    if not name.startswith(ENV_PREFIX) or len(name) == len(ENV_PREFIX):
      continue
    given = name[len(ENV_PREFIX):].lower()
    if given in spellings.VALUE_ALIASES:
      env_flags[given] = text
      continue
    key = spellings.rename(given)
    if key not in schema:
      raise _unknown_key_error(given, schema, f"environment variable {name}")
    value = spellings.switch_value(given, _parse_cli_value(text, schema[key], key), f"environment variable {name}")
    _set_once(env_values, env_spelled, key, given, coerce(key, value, schema[key]), "the environment",
              prefix=ENV_PREFIX)
    if key in argv_values:
      print(f"config: {key} is set by both {name} and the command line; the command line wins")

  env_values = spellings.fold_value_aliases(env_values, env_flags, "the environment")
  env_negated = spellings.negations(env_flags, env_values, "the environment")
  negated = {**{k: v for k, v in env_negated.items() if v[0] not in argv_values}, **negated}
  file_values = {k: coerce(k, v, schema[k]) for k, v in file_values.items()}
  return Overrides(yaml_path, file_values, argv_values, env_values, schema, negated)


def model_path(model_name: str) -> Path:
  """configs/models/<model_name>.yml; a name of upstream MaxText's for one of them (a family's
  upstream_model_names) reads that file, with one warning line."""
  path = MODELS_DIR / f"{model_name}.yml"
  if path.is_file():
    return path
  for family in model_checks.families().values():
    ours = family.upstream_model_names.get(model_name)
    if ours is not None:
      spellings.warn_model_name(model_name, ours)
      return MODELS_DIR / f"{ours}.yml"
  return path


def _model_values(model_name: str, schema: Mapping[str, Any]) -> dict[str, Any]:
  path = model_path(model_name)
  if not path.is_file():
    known = sorted(p.stem for p in MODELS_DIR.glob("*.yml"))
    raise ConfigError(f"unknown model_name {model_name!r}; known models: {', '.join(known)}")
  return _read_model_keys(path, schema)


def _read_model_keys(path: Path | str, schema: Mapping[str, Any]) -> dict[str, Any]:
  return _typed(read_yaml(path), schema, str(path))


def _typed(values: Mapping[str, Any], schema: Mapping[str, Any], source: str) -> dict[str, Any]:
  """Values from a file of model keys or from a tool, each known to base.yml and coerced to its type."""
  values = spellings.canonical(values, source)
  for key in values:
    if key not in schema:
      raise _unknown_key_error(key, schema, source)
  return {k: coerce(k, v, schema[k]) for k, v in values.items()}


def _saved_model_layer(overrides: Overrides, schema: Mapping[str, Any],
                       reads_run: bool) -> tuple[dict[str, Any], str] | None:
  """The model keys saved with the checkpoint this start reads, and where they come from:
  load_full_state_path, else load_parameters_path (a converted or exported checkpoint's
  model_config.yml, or the config.yml of the run a checkpoint belongs to), else, for a tool
  that reads a run (`reads_run`), the run directory base_output_directory/run_name."""
  sources = [str(overrides.peek(key)) for key in ("load_full_state_path", "load_parameters_path")]
  run_name = str(overrides.peek("run_name"))
  if reads_run and run_name:
    sources.append(storage.join(str(overrides.peek("base_output_directory")), run_name))
  for source in filter(None, sources):
    found = run_record.saved_model_keys(source)
    if found is not None:
      values, where = found
      return _typed(values, schema, where), where
  return None


def _model_layer(overrides: Overrides, schema: Mapping[str, Any], reads_run: bool) -> dict[str, Any]:
  """configs/models/<model_name>.yml, or, when the user named no model, the model keys saved
  with the checkpoint this start reads (see _saved_model_layer). A tool that reads a run
  (`reads_run`) refuses a named model or a given key that contradicts the saved keys."""
  named = "model_name" in overrides.file_values or "model_name" in overrides.explicit_keys()
  found = _saved_model_layer(overrides, schema, reads_run)
  if found is None or (named and not reads_run):
    return _model_values(str(overrides.peek("model_name")), schema)
  saved, where = found
  model_values = _model_values(str(overrides.peek("model_name")), schema) if named else {}
  if reads_run:
    conflicts = run_record.contradictions(model_values, saved)
    if conflicts:
      raise ConfigError(f"model_name={overrides.peek('model_name')} contradicts the model saved in {where}: "
                        f"{'; '.join(conflicts)}; drop model_name (the saved keys are used) or read another checkpoint")
    given = {**overrides.file_values, **overrides.env_values, **overrides.argv_values}
    conflicts = run_record.contradictions(given, saved)
    if conflicts:
      raise ConfigError(f"{'; '.join(conflicts)}: contradicts the model saved in {where}; drop the key(s) "
                        "(the saved values are used) or read another checkpoint")
  if not named:
    print(f"config: no model_name given; using the model keys saved with the checkpoint in {where}")
  return {**model_values, **saved}


def _refuse_dropped_file_values(overrides: Overrides, model: Mapping[str, Any]) -> None:
  """The model layer is read after the user's YAML: a key the file sets and the model sets otherwise would be dropped
  unseen (a recipe's `base_num_decoder_layers: 4` beside `model_name: llama2-7b` trained 32 layers). The command line
  and M_* variables still win over both."""
  dropped = sorted(k for k, v in overrides.file_values.items()
                   if k in model and model[k] != v and k not in overrides.explicit_keys())
  if not dropped:
    return
  named = "model_name" in overrides.file_values or "model_name" in overrides.explicit_keys()
  source = (f"model_name={overrides.peek('model_name')} ({model_path(str(overrides.peek('model_name'))).name})"
            if named else "the model keys saved with the checkpoint it reads")
  keys = ", ".join(f"{k}: {overrides.file_values[k]!r}" for k in dropped)
  shown = ", ".join(f"{k}={model[k]!r}" for k in dropped)
  raise ConfigError(f"{str(overrides.yaml_path)!r} sets {keys}, which {source} sets otherwise ({shown}) and wins; drop "
                    "it from the file, or give it on the command line, which wins over the model")


def resolve_values(overrides: Overrides, platform: str, reads_run: bool = False) -> dict[str, Any]:
  """Merges every layer into one flat dict of typed values. `reads_run`: a tool reading a run
  or checkpoint (export, conversion, decode, AOT compile), which takes the model keys saved
  with it and refuses contradicting ones; train.py sets it False (a fine-tune may change them)."""
  schema = overrides.schema
  values = dict(schema)
  if platform == "cpu" and overrides.peek("cpu_defaults"):
    values.update({k: coerce(k, v, schema[k]) for k, v in read_yaml(CPU_DEFAULTS_PATH).items()})
  values.update(overrides.file_values)
  model = _model_layer(overrides, schema, reads_run)
  _refuse_dropped_file_values(overrides, model)
  values.update(model)
  values.update(overrides.env_values)
  values.update(overrides.argv_values)
  for old, (key, value, source) in overrides.negated.items():
    if values[key] == value:
      raise spellings.negation_error(old, key, value, source)
  return values


class Config:
  """The immutable configuration of one run: flat values (`config["steps"]`) and typed groups."""

  def __init__(self, values: Mapping[str, Any], target: DeviceTarget, reads_data: bool = True):
    groups = config_groups.build_groups(values, target, reads_data)
    self.values: Mapping[str, Any] = types.MappingProxyType(dict(values))
    self.target = target
    self.model: ModelConfig = groups.model
    self.mesh: config_groups.MeshConfig = groups.mesh
    self.optim: config_groups.OptimConfig = groups.optim
    self.data: data_config.DataConfig = groups.data
    self.run: config_groups.RunConfig = groups.run
    self.checkpoint: config_groups.CheckpointConfig = groups.checkpoint
    self.decode: decode_config.DecodeConfig = groups.decode
    self.startup: config_groups.StartupConfig = groups.startup
    self.rl: RLConfig = groups.rl
    self.tasks: TaskEvalConfig = groups.tasks
    self.distill: DistillConfig = groups.distill
    self._frozen = True

  def __setattr__(self, name: str, value: object) -> None:
    if getattr(self, "_frozen", False):
      raise AttributeError("Config is immutable; build a new one with different overrides")
    super().__setattr__(name, value)

  def __getitem__(self, key: str) -> Any:
    return self.values[key]

  def to_yaml(self) -> str:
    """The resolved flat values plus the derived ones, as YAML (saved next to the run's outputs)."""
    derived = {
        "emb_dim": self.model.emb_dim,
        "num_query_heads": self.model.num_query_heads,
        "num_kv_heads": self.model.num_kv_heads,
        "mlp_dim": self.model.mlp_dim,
        "num_decoder_layers": self.model.num_decoder_layers,
        "global_batch_size": self.data.global_batch_size,
        "mesh_shape": dict(self.mesh.shape),
        "platform": self.target.platform,
        "num_devices": self.target.num_devices,
    }
    return yaml.safe_dump({**dict(self.values), "derived": derived}, sort_keys=False)

  def describe(self) -> str:
    """Human-readable key = value listing, one per line, derived values last."""
    lines = [f"  {k} = {v!r}" for k, v in self.values.items()]
    lines.append(f"  (derived) model = {self.model}")
    lines.append(f"  (derived) mesh = {dict(self.mesh.shape)}")
    lines.append(f"  (derived) global_batch_size = {self.data.global_batch_size}")
    return "\n".join(lines)

  @classmethod
  def for_testing(cls, target: DeviceTarget | None = None, **overrides: object) -> "Config":
    """A config from base.yml (+ CPU defaults on CPU) and keyword overrides, for tests."""
    target = target or accelerators.local_target()
    parsed = parse_overrides(["test"], environ={})
    # A string is read as on the command line ("[local,global]", "5,17"); other values as they are.
    values = {k: _parse_cli_value(v, parsed.schema.get(k), k) if isinstance(v, str) else v for k, v in overrides.items()}
    return build_config(parsed.below_argv(values, "Config.for_testing"), target)


def build_config(overrides: Overrides, target: DeviceTarget, reads_run: bool = False,
                 default_run_name: str | None = None, reads_data: bool = True) -> Config:
  """The validated, frozen Config for `target`. An empty run_name becomes `default_run_name`, or
  run_<local time> (the clock is read here, not while validating), which only a single-process
  run may use: every process must name the same run directory. `reads_data`: False for a tool
  that reads no training data (startup.Tool), whose config may name none."""
  values = resolve_values(overrides, target.platform, reads_run)
  # Only values other than base.yml's: a companion's config (a draft, a teacher) passes all of the run's as argv.
  _warn_unused_optimizer_keys(values, {k for k in overrides.explicit_keys()
                                       if k in overrides.schema and values.get(k) != overrides.schema[k]})
  if not values["run_name"]:
    if default_run_name is None and target.num_processes > 1:
      raise ConfigError(f"set run_name=NAME: with {target.num_processes} processes each would otherwise name "
                        "the run after its own clock")
    values["run_name"] = default_run_name or datetime.datetime.now().strftime("run_%Y%m%d_%H%M%S")
  config = Config(values, target, reads_data)
  _warn_unread_weight_storage(values, reads_data)  # after the checks: a refused config's line comes alone
  return config


_ADAM_KEYS = ("adam_b1", "adam_b2", "adam_eps", "adam_eps_root", "adam_weight_decay")


def _warn_unused_optimizer_keys(values: Mapping[str, Any], given: set[str]) -> None:
  """One warning (per process) for an optimizer key given on the command line that opt_type does not read
  (muon_beta with adamw, adam_b2 with sgd): it was accepted and changed nothing."""
  opt_type = values["opt_type"]
  unused = [key for key in sorted(given) if (key.startswith("muon_") and opt_type != "muon")
            or (key in _ADAM_KEYS and opt_type == "sgd")]
  line = (f"warning: opt_type={opt_type} does not read {', '.join(f'{k}={values[k]!r}' for k in unused)}; "
          f"{'it changes' if len(unused) == 1 else 'they change'} nothing" if unused else "")
  if line:
    config_fields.warn_once(line)


def _warn_unread_weight_storage(values: Mapping[str, Any], reads_data: bool) -> None:
  """One warning for quantize_weights in a training run whose objective decodes nothing (GRPO's rollouts are the
  only training that does): the key sets how an engine stores the weights it decodes from, so such a run trains
  float weights, which reads as 8-bit training (that is `quantization`). Tools that read no training data (decode,
  serve, a companion model's config) decode with it."""
  mode, objective = values["quantize_weights"], values["objective"]
  if mode and reads_data and objective != "grpo":
    config_fields.warn_once(f"warning: quantize_weights={mode} sets how decode, serve and GRPO rollouts store the "
                            f"weights they decode from; objective={objective} decodes nothing, so it changes nothing "
                            f"here and the weights train in float (for {mode} training matmuls set quantization={mode})")


def load_config(
    argv: list[str], environ: Mapping[str, str] | None = None, target: DeviceTarget | None = None,
    reads_run: bool = False) -> Config:
  """argv/env → validated, frozen Config for `target` (the local devices unless given)."""
  return build_config(parse_overrides(argv, environ), target or accelerators.local_target(), reads_run)


# Keys of the target that never pass to its speculative draft: which model and parameters it is.
_TARGET_ONLY_KEYS = ("model_name", "load_parameters_path", "load_full_state_path", "draft_model_name",
                     "draft_load_parameters_path", "draft_overrides", "speculative_tokens")


def draft_config(config: Config) -> Config:
  """The speculative draft's configuration: the model of draft_model_name (else the model keys
  saved beside draft_load_parameters_path) with draft_overrides on top, every other key the
  target's (decode, cache, mesh, dtype, max_target_length: the draft must cache what the target
  does), and draft_load_parameters_path as its load_parameters_path."""
  d = config.decode
  return companion_config(config, "draft", d.draft_model_name, d.draft_load_parameters_path, d.draft_overrides,
                          ("draft_model_name", "draft_load_parameters_path", "draft_overrides"),
                          "speculative decoding with a draft model")


def companion_config(config: Config, role: str, model_name: str, path: str, model_overrides: tuple[str, ...],
                     names: tuple[str, str, str], use: str, **fixed: Any) -> Config:
  """The configuration of a model run beside `config`'s (a speculative draft, a distillation
  teacher): the model of `model_name` (else the model keys saved beside `path`) with
  `model_overrides` (key=value items) on top, `path` as its load_parameters_path, `fixed` keys, and
  every other key `config`'s. `names`: the keys holding (model_name, path, model_overrides), `use`:
  what needs the model, for the messages."""
  schema = read_yaml(BASE_CONFIG_PATH)
  if not model_name and (not path or run_record.saved_model_keys(path) is None):
    where = (f"no model_config.yml or run config.yml is saved with {names[1]}={path}" if path
             else f"no {role} is named")
    raise ConfigError(f"{use}: {where}; set {names[0]}=<a configs/models name> (and {names[2]}=key=value,... to "
                      "resize it)")
  argv = {k: v for k, v in config.values.items() if k not in MODEL_KEYS and k not in _TARGET_ONLY_KEYS}
  argv["load_parameters_path"] = path
  if model_name:
    argv["model_name"] = model_name
  for item in model_overrides:
    key, _, text = str(item).partition("=")
    given, key = key.strip(), spellings.rename(key.strip())
    if key not in schema:
      raise _unknown_key_error(key, schema, names[2])
    if key in _TARGET_ONLY_KEYS:
      raise ConfigError(f"{names[2]} cannot set {key}: name the {role} with {names[0]} and {names[1]}")
    argv[key] = coerce(key, spellings.switch_value(given, _parse_cli_value(text.strip(), schema[key], key), names[2]),
                       schema[key])
  argv.update(fixed)
  overrides = Overrides(BASE_CONFIG_PATH, {}, argv, {}, schema)
  try:
    return build_config(overrides, config.target, default_run_name=str(config["run_name"]), reads_data=False)
  except ConfigError as e:  # the companion's model keys with the run's others (e.g. its max_target_length)
    named = f"{names[1]}={path}" if path else f"{names[0]}={model_name}"
    raise ConfigError(f"{use}: the {role} ({named}) with this run's other keys: {e}") from None
