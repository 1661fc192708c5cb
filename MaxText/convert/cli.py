"""What the converters and the logit checker share: argument splitting and choosing the model config
(from `model_name=`, from a checkpoint's model_config.yml, or inferred from HF config.json)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from MaxText import accelerators, families, run_record, startup
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


def read_overrides(prog: str, user_args: Sequence[str], paths: Mapping[str, str]) -> config_lib.Overrides:
  """The user's key=value arguments (and M_* variables) as start-up reads them, every key
  checked, and each gs:// bucket among `paths` ({"--flag": path}) and the path keys answering
  within storage_timeout_seconds, so a wrong bucket or endpoint is one line, not a hang."""
  return startup.read_overrides([prog, *user_args], extra_paths=paths)


def start_backend(overrides: config_lib.Overrides, default: str = "cpu") -> accelerators.DeviceTarget:
  """Starts JAX on `hardware=` if the user set it, else on `default` (conversion is host work,
  so the converters keep JAX on the CPU), with the user's XLA flags."""
  given = "hardware" in overrides.explicit_keys() or "hardware" in overrides.file_values
  startup.start_backend(overrides, None if given else default)
  return accelerators.local_target()


def config_matching_hf(hf_config: Mapping[str, Any], overrides: config_lib.Overrides, hf_path: str,
                       target: accelerators.DeviceTarget, prog: str) -> tuple[config_lib.Config, dict[str, Any]]:
  """The config for an HF checkpoint and its full model keys.

  Without model_name (and without saved model keys) every architecture key is inferred from
  config.json and printed as overrides; either way the final config must describe the same
  model as config.json, or this fails naming the differing keys.
  """
  family = families.family_for_hf_config(hf_config)
  schema = config_lib.read_yaml(config_lib.BASE_CONFIG_PATH)
  inferred = engine.full_model_keys(schema, family.model_keys(hf_config))
  named = "model_name" in overrides.explicit_keys()
  implied = _length_for(inferred, overrides)
  if not named and not _saved_model_keys(overrides):
    implied = {**inferred, **implied}
    print(f"{prog}: inferred from {hf_path}/config.json ({family.name} family): {engine.describe_keys(inferred)}")
  config = config_lib.build_config(overrides.below_argv(implied, f"{hf_path}/config.json"), target, reads_run=True)
  _require_scale_one(config)
  mismatch = engine.differences(dict(config.values), inferred, ignore=engine.NOT_IN_HF_CONFIG)
  if mismatch:
    what = "model_name=" + config.startup.model_name if named else "the model config"
    raise ConfigError(f"{what} does not match {hf_path}/config.json (ours vs HF): {'; '.join(mismatch)}")
  return config, {**inferred, **{key: config.values[key] for key in engine.NOT_IN_HF_CONFIG}}


def _length_for(model_keys: Mapping[str, Any], overrides: config_lib.Overrides) -> dict[str, Any]:
  """Conversion and checking never train, so an unset max_target_length (the CPU defaults' 128)
  must not trip the check that it fits a learned position table: use the table's size."""
  if "max_target_length" in overrides.explicit_keys() or model_keys.get("position_embedding") != "learned":
    return {}
  return {"max_target_length": model_keys["max_position_embeddings"]}


def _saved_model_keys(overrides: config_lib.Overrides) -> bool:
  """Whether load_parameters_path names a checkpoint whose model keys were saved with it."""
  path = str(overrides.peek("load_parameters_path"))
  return bool(path) and run_record.saved_model_keys(path) is not None


def _require_scale_one(config: config_lib.Config) -> None:
  if config.model.global_parameter_scale != 1:
    raise ConfigError("checkpoint conversion needs global_parameter_scale=1 (published shapes are absolute)")


def config_for_checkpoint(checkpoint: str, overrides: config_lib.Overrides, target: accelerators.DeviceTarget,
                          prog: str) -> config_lib.Config:
  """The config of one of our checkpoints: the model keys saved with it (model_config.yml, or
  the config.yml of the run it belongs to), else model_name=; a given key must agree with them."""
  saved = run_record.saved_model_keys(checkpoint)
  if saved is not None:
    model_keys = saved[0]
  elif "model_name" in overrides.explicit_keys():
    named = config_lib.MODELS_DIR / f"{overrides.peek('model_name')}.yml"
    model_keys = config_lib.read_yaml(named) if named.is_file() else {}
  else:
    raise UserError(f"{checkpoint} has no {config_lib.MODEL_CONFIG_FILE} and is not in a run directory with a "
                    "config.yml; say which model it holds with model_name=<name> (and any key=value overrides it "
                    "was trained with)")
  implied = {**_length_for(model_keys, overrides), "load_parameters_path": checkpoint}
  config = config_lib.build_config(overrides.below_argv(implied, prog), target, reads_run=True)
  _require_scale_one(config)
  return config
