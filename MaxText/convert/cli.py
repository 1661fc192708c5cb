"""What the converters and the logit checker share: argument splitting and choosing the model config
(from `model_name=`, from a checkpoint's model_config.yml, or inferred from HF config.json)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from MaxText import accelerators, families, run_record, storage
from MaxText import config as config_lib
from MaxText.convert import engine
from MaxText.errors import ConfigError, UserError


def split_args(argv: Sequence[str], flags: Sequence[str]) -> tuple[dict[str, str], list[str]]:
  """`--flag VALUE` / `--flag=VALUE` for the named flags; everything else must be key=value."""
  values: dict[str, str] = {}
  rest: list[str] = []
  args = list(argv)
  while args:
    arg = args.pop(0)
    if arg.startswith("--"):
      name, sep, value = arg[2:].partition("=")
      if name not in flags:
        raise UserError(f"unknown flag --{name}; expected {', '.join('--' + f for f in flags)} and key=value overrides")
      if not sep:
        if not args:
          raise UserError(f"--{name} needs a value")
        value = args.pop(0)
      values[name] = value
    else:
      rest.append(arg)
  missing = [f for f in flags if f not in values]
  if missing:
    raise UserError(f"missing {', '.join('--' + f for f in missing)}")
  return values, rest


def check_buckets(paths: Mapping[str, str], user_args: Sequence[str]) -> None:
  """Each gs:// bucket among `paths` ({"--flag" or key: path}) answers within storage_timeout_seconds
  (from user_args, else base.yml's), so a wrong bucket or endpoint is one line, not a hang."""
  timeout = config_lib.read_yaml(config_lib.BASE_CONFIG_PATH)["storage_timeout_seconds"]
  for arg in user_args:
    key, _, value = arg.partition("=")
    if key == "storage_timeout_seconds":
      timeout = value
  try:
    timeout = float(timeout)
  except ValueError:
    raise UserError(f"storage_timeout_seconds must be a number of seconds, got {timeout!r}") from None
  storage.check_buckets(dict(paths), timeout)


def start_backend(user_args: Sequence[str], default: str = "cpu") -> accelerators.DeviceTarget:
  """Picks the JAX platform before the backend starts: `hardware=` if given, else `default`
  (conversion is host work, so the converters keep JAX on the CPU)."""
  hardware = default
  for arg in user_args:
    key, _, value = arg.partition("=")
    if key == "hardware":
      hardware = value
  accelerators.select_jax_platforms(hardware)
  return accelerators.local_target()


def _user_keys(args: Sequence[str]) -> set[str]:
  return {arg.partition("=")[0] for arg in args}


def config_matching_hf(hf_config: Mapping[str, Any], user_args: Sequence[str], hf_path: str,
                       target: accelerators.DeviceTarget, prog: str) -> tuple[config_lib.Config, dict[str, Any]]:
  """The config for an HF checkpoint and its full model keys.

  Without model_name (and without saved model keys) every architecture key is inferred from
  config.json and printed as overrides; either way the final config must describe the same
  model as config.json, or this fails naming the differing keys.
  """
  family = families.family_for_hf_config(hf_config)
  schema = config_lib.read_yaml(config_lib.BASE_CONFIG_PATH)
  inferred = engine.full_model_keys(schema, family.model_keys(hf_config))
  yaml_args = list(user_args[:1]) if user_args and "=" not in user_args[0] else []
  key_args = list(user_args[len(yaml_args):])
  inferred_args: list[str] = []
  if "model_name" not in _user_keys(key_args) and not _saved_model_keys(key_args):
    inferred_args = engine.override_args(inferred)
    print(f"{prog}: inferred from {hf_path}/config.json ({family.name} family): {' '.join(inferred_args)}")
  argv = [prog, *yaml_args, *inferred_args, *_length_for(inferred, key_args), *key_args]
  config = config_lib.load_config(argv, target=target, reads_run=True)
  _require_scale_one(config)
  mismatch = engine.differences(dict(config.values), inferred)
  if mismatch:
    what = "model_name=" + config["model_name"] if "model_name" in _user_keys(key_args) else "the model config"
    raise ConfigError(f"{what} does not match {hf_path}/config.json (ours vs HF): {'; '.join(mismatch)}")
  return config, inferred


def _length_for(model_keys: Mapping[str, Any], key_args: Sequence[str]) -> list[str]:
  """Conversion and checking never train, so an unset max_target_length (the CPU defaults' 128)
  must not trip the check that it fits a learned position table: use the table's size."""
  if "max_target_length" in _user_keys(key_args) or model_keys.get("position_embedding") != "learned":
    return []
  return [f"max_target_length={model_keys['max_position_embeddings']}"]


def _saved_model_keys(user_args: Sequence[str]) -> bool:
  """Whether load_parameters_path names a checkpoint whose model keys were saved with it."""
  for arg in user_args:
    key, _, value = arg.partition("=")
    if key == "load_parameters_path" and value:
      return run_record.saved_model_keys(value) is not None
  return False


def _require_scale_one(config: config_lib.Config) -> None:
  if config["global_parameter_scale"] != 1:
    raise ConfigError("checkpoint conversion needs global_parameter_scale=1 (published shapes are absolute)")


def config_for_checkpoint(checkpoint: str, user_args: Sequence[str], target: accelerators.DeviceTarget,
                          prog: str) -> config_lib.Config:
  """The config of one of our checkpoints: the model keys saved with it (model_config.yml, or
  the config.yml of the run it belongs to), else model_name=; a given key must agree with them."""
  args = [f"load_parameters_path={checkpoint}", *user_args]
  saved = run_record.saved_model_keys(checkpoint)
  if saved is not None:
    model_keys = saved[0]
  elif "model_name" in _user_keys(user_args):
    name = [a.partition("=")[2] for a in user_args if a.startswith("model_name=")][-1]
    named = config_lib.MODELS_DIR / f"{name}.yml"
    model_keys = config_lib.read_yaml(named) if named.is_file() else {}
  else:
    raise UserError(f"{checkpoint} has no {config_lib.MODEL_CONFIG_FILE} and is not in a run directory with a "
                    "config.yml; say which model it holds with model_name=<name> (and any key=value overrides it "
                    "was trained with)")
  config = config_lib.load_config([prog, *_length_for(model_keys, user_args), *args], target=target, reads_run=True)
  _require_scale_one(config)
  return config
