"""What the converters and the logit checker share: their own key=value arguments and the model keys their
config takes (from `model_name=`, from a checkpoint's model_config.yml, or inferred from HF
config.json), as a layer `startup.start` puts below the user's own arguments."""

from __future__ import annotations

import math
from typing import Any, Iterator, Mapping, Sequence

from MaxText import families
from MaxText.configuration import run_record, tool_args
from MaxText.configuration import config as config_lib, config_yaml
from MaxText.convert import engine, hf_io
from MaxText.families import mxfp4
from MaxText.errors import ConfigError, UserError


# The converters' old spellings: `--hf_path DIR` (also hf_path=, which no converter reads as a
# dataset) and `--checkpoint CKPT`, the checkpoint every other tool reads as load_parameters_path.
RENAMED = {"hf_path": "hf_model_path", "checkpoint": "load_parameters_path"}


def split_args(argv: Sequence[str], required: Sequence[str], optional: Sequence[str] = ()
               ) -> tuple[dict[str, str], list[str]]:
  """A converter's own key=value arguments (`required` and `optional` keys; the old `--key VALUE`
  spellings warn), and the rest: config key=value overrides."""
  values, rest = tool_args.split_tool_args(argv, (*required, *optional), RENAMED)
  missing = [key for key in required if not values.get(key)]
  if missing:
    raise UserError(f"missing {', '.join(key + '=...' for key in missing)}")
  return values, rest


class HfModelKeys:
  """The model keys of an HF checkpoint's config.json, for `startup.start`.

  Without model_name (and without saved model keys) every architecture key is inferred from
  config.json and printed as overrides; either way the final config must describe the same
  model as config.json, or this fails naming the differing keys. Read once the buckets answered
  and the backend started: config.json may be on gs://.
  """

  def __init__(self, hf_path: str, prog: str):
    self.hf_path, self.prog = hf_path, prog
    self.hf_config: dict[str, Any] = {}
    self.model_keys: dict[str, Any] = {}  # the full model keys, once the config is checked
    self._inferred: dict[str, Any] = {}
    self._named = False

  def values(self, overrides: config_lib.Overrides) -> tuple[Mapping[str, Any], str]:
    self.hf_config = hf_io.read_hf_config(self.hf_path)
    family = families.family_for_hf_config(self.hf_config)
    schema = config_yaml.read_yaml(config_lib.BASE_CONFIG_PATH)
    _check_field_numbers(self.hf_path, self.hf_config)
    _check_positive(self.hf_path, self.hf_config)
    try:
      hf_keys = engine.hf_model_keys(family, self.hf_config)
    except KeyError as e:  # a key the family's config always has, left out (a hand-written or cut config.json)
      raise ConfigError(f"{self.hf_path}/config.json has no {_missing_field(self.hf_config, e)!r}, which a "
                        f"{self.hf_config.get('model_type')} config always has and the converter takes no default "
                        "for (transformers' would describe another model); use the checkpoint's own config.json") from None
    except (TypeError, AttributeError, ValueError) as e:  # a value of another type than the family's ("yes" for a dict)
      raise ConfigError(f"{self.hf_path}/config.json has a value the {family.name} converter cannot read "
                        f"({type(e).__name__}: {' '.join(str(e).split())[:150]}); use the checkpoint's own "
                        "config.json") from None
    _check_numbers(self.hf_path, self.hf_config, hf_keys, schema)
    self._inferred = engine.full_model_keys(schema, hf_keys)
    method = mxfp4.quant_method(self.hf_config)
    if method not in (None, "mxfp4"):  # its weights are integer or float8 codes with scales beside them
      raise ConfigError(f"{self.hf_path}/config.json: this checkpoint is quantised with quant_method={method!r}; "
                        "only unquantised weights and MXFP4 experts (quant_method 'mxfp4') can be read: dequantise "
                        "it to bfloat16 first")
    self._named = "model_name" in overrides.explicit_keys()
    implied = _length_for(self._inferred, overrides)
    if not self._named and not _saved_model_keys(overrides):
      implied = {**self._inferred, **implied}
      print(f"{self.prog}: inferred from {self.hf_path}/config.json ({family.name} family): "
            f"{engine.describe_keys(self._inferred)}")
    return implied, f"{self.hf_path}/config.json"

  def check(self, config: config_lib.Config) -> None:
    _require_scale_one(config)
    mismatch = engine.differences(dict(config.values), self._inferred, ignore=engine.NOT_IN_HF_CONFIG)
    if mismatch:
      what = "model_name=" + config.startup.model_name if self._named else "the model config"
      raise ConfigError(f"{what} does not match {self.hf_path}/config.json (ours vs HF): {'; '.join(mismatch)}")
    self.model_keys = {**self._inferred, **{key: config.values[key] for key in engine.NOT_IN_HF_CONFIG}}


class CheckpointModelKeys:
  """The model keys of one of our checkpoints, for `startup.start`: those saved with it
  (model_config.yml, or the config.yml of the run it belongs to), else model_name=; a given key
  must agree with them."""

  def __init__(self, checkpoint: str, prog: str):
    self.checkpoint, self.prog = checkpoint, prog

  def values(self, overrides: config_lib.Overrides) -> tuple[Mapping[str, Any], str]:
    saved = run_record.saved_model_keys(self.checkpoint)
    if saved is not None:
      model_keys = saved[0]
    elif "model_name" in overrides.explicit_keys():
      named = config_lib.model_path(str(overrides.peek('model_name')))
      model_keys = config_yaml.read_yaml(named) if named.is_file() else {}
    else:
      raise UserError(f"{self.checkpoint} has no {config_lib.MODEL_CONFIG_FILE} and is not in a run directory with a "
                      "config.yml; say which model it holds with model_name=<name> (and any key=value overrides it "
                      "was trained with)")
    return {**_length_for(model_keys, overrides), "load_parameters_path": self.checkpoint}, self.prog

  def check(self, config: config_lib.Config) -> None:
    _require_scale_one(config)


def _check_numbers(hf_path: str, hf_config: Mapping[str, Any], hf_keys: Mapping[str, Any],
                   schema: Mapping[str, Any]) -> None:
  """A number config.json gives as text ("64") reaches a model key whose default is a number: refused naming the
  field (was: the model config does not match config.json, 64.0 vs '64')."""
  for key, value in hf_keys.items():
    default = schema.get(key)
    if isinstance(value, str) and isinstance(default, (int, float)) and not isinstance(default, bool):
      text = hf_config.get("text_config")
      fields = [(f, v) for f, v in hf_config.items()] + (
          [(f"text_config.{f}", v) for f, v in text.items()] if isinstance(text, Mapping) else [])
      field = next((f for f, v in fields if v == value), key)
      raise ConfigError(f"{hf_path}/config.json: {field} is the text {value[:40]!r} where a number belongs; write it "
                        "without quotes")


# Fields that are text by design (labels, versions, names, paths): a number-like value there is no number.
_TEXT_FIELDS = ("id2label", "label2id", "quantization_config")
_TEXT_SUFFIXES = ("_version", "name", "_path", "_type", "_types", "_act", "dtype")


def _fields(values: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
  """(dotted field name, value) of every leaf of config.json, nested objects and lists included."""
  items = values.items() if isinstance(values, Mapping) else ((str(i), v) for i, v in enumerate(values))
  for field, value in items:
    field = str(field)
    if field.startswith("_") or field in _TEXT_FIELDS or field.endswith(_TEXT_SUFFIXES):
      continue
    name = f"{prefix}[{field}]" if isinstance(values, list) else prefix + field
    if isinstance(value, (Mapping, list)):
      yield from _fields(value, name + ("" if isinstance(value, list) else "."))
    else:
      yield name, value


def _is_number_text(value: str) -> bool:
  try:
    float(value)  # what transformers' own float()/int() casts, where it makes them, would take
  except ValueError:
    return False
  return True


def _check_field_numbers(hf_path: str, hf_config: Mapping[str, Any]) -> None:
  """Numbers written as text ("10000", " 32 ", "1_000", "nan") or non-finite (JSON's NaN, Infinity as Python writes
  them): float() reads them all, so the converter would build a model transformers refuses or runs as NaN."""
  for name, value in _fields(hf_config):
    if isinstance(value, str) and _is_number_text(value):
      raise ConfigError(f"{hf_path}/config.json: {name} is the text {value[:40]!r} where a number belongs; write it "
                        "without quotes")
    if isinstance(value, float) and not math.isfinite(value):
      raise ConfigError(f"{hf_path}/config.json: {name} is {value}, not a finite number; use the checkpoint's own "
                        "config.json")


# config.json fields no model has at zero or below (norm epsilons, RoPE bases, widths, counts), in every family's
# spelling; num_key_value_heads has its own check (null is allowed there).
_POSITIVE_FIELDS = ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_eps", "rope_theta",
                    "rope_local_base_freq", "num_attention_heads", "n_head", "hidden_size", "n_embd",
                    "num_hidden_layers", "n_layer", "head_dim", "vocab_size")


def _check_positive(hf_path: str, hf_config: Mapping[str, Any]) -> None:
  """A zero or negative norm epsilon, RoPE base, width or count, or true/false for one (float() reads true as 1):
  refused naming the field (was: converted, or named only by our model key)."""
  for field, value in _fields(hf_config):
    if field.rsplit(".", 1)[-1] not in _POSITIVE_FIELDS or value is None:
      continue
    if isinstance(value, bool):
      raise ConfigError(f"{hf_path}/config.json: {field} is {str(value).lower()} where a number belongs")
    if isinstance(value, (int, float)) and value <= 0:
      raise ConfigError(f"{hf_path}/config.json: {field} is {value}, which must be positive; use the checkpoint's "
                        "own config.json")


def _missing_field(hf_config: Mapping[str, Any], error: KeyError) -> str:
  """The config.json field a family's reader found missing: a multimodal config's text decoder reads its
  text_config, so a field missing there is named text_config.<field>."""
  field = str(error.args[0]) if error.args else "?"
  text = hf_config.get("text_config")
  return f"text_config.{field}" if isinstance(text, dict) and field not in hf_config and field not in text else field


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
