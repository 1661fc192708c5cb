"""What the converters and the logit checker share: argument splitting and choosing the model config
(from `model_name=`, from a checkpoint's model_config.yml, or inferred from HF config.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from MaxText import accelerators
from MaxText import config as config_lib
from MaxText.convert import engine, registry
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


def start_cpu_backend() -> accelerators.DeviceTarget:
  """Conversion is host work: keep JAX on the CPU (unless JAX_PLATFORMS says otherwise)."""
  accelerators.select_jax_platforms("cpu")
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
  family = registry.family_for_hf_config(hf_config)
  schema = config_lib.read_yaml(config_lib.BASE_CONFIG_PATH)
  inferred = engine.full_model_keys(schema, family.model_keys(hf_config))
  argv = [prog, *user_args]
  if "model_name" not in _user_keys(user_args) and not _saved_model_keys(user_args):
    print(f"{prog}: inferred from {hf_path}/config.json ({family.name} family): "
          f"{' '.join(engine.override_args(inferred))}")
    argv = [prog, *engine.override_args(inferred), *user_args]
  config = config_lib.load_config(argv, target=target)
  _require_scale_one(config)
  mismatch = engine.differences(dict(config.values), inferred)
  if mismatch:
    what = "model_name=" + config["model_name"] if "model_name" in _user_keys(user_args) else "the model config"
    raise ConfigError(f"{what} does not match {hf_path}/config.json (ours vs HF): {'; '.join(mismatch)}")
  return config, inferred


def _saved_model_keys(user_args: Sequence[str]) -> bool:
  for arg in user_args:
    key, _, value = arg.partition("=")
    if key == "load_parameters_path" and value:
      return (Path(value) / config_lib.MODEL_CONFIG_FILE).is_file()
  return False


def _require_scale_one(config: config_lib.Config) -> None:
  if config["global_parameter_scale"] != 1:
    raise ConfigError("checkpoint conversion needs global_parameter_scale=1 (published shapes are absolute)")


def config_for_checkpoint(checkpoint: str, user_args: Sequence[str], target: accelerators.DeviceTarget,
                          prog: str) -> config_lib.Config:
  """The config of one of our checkpoints: model_name= if given, else its saved model_config.yml."""
  args = [f"load_parameters_path={checkpoint}", *user_args]
  if "model_name" not in _user_keys(user_args) and not _saved_model_keys(args):
    raise UserError(f"{checkpoint} has no {config_lib.MODEL_CONFIG_FILE}; say which model it holds with "
                    "model_name=<name> (and any key=value overrides it was trained with)")
  config = config_lib.load_config([prog, *args], target=target)
  _require_scale_one(config)
  return config
