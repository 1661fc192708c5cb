"""Our checkpoint → a Hugging Face model directory (config.json + safetensors shards).

  python3 -m MaxText.convert.maxtext_to_hf load_parameters_path=CKPT output_path=DIR [model_name=<name>] \\
      [max_shard_mb=5000] [key=value ...]

CKPT may be a parameters-only checkpoint (model keys from its model_config.yml unless
model_name is given), a training step directory or a run's checkpoints directory (then pass
model_name and the overrides the run used). `transformers.AutoModelForCausalLM.from_pretrained(DIR)`
loads the result. Tensors are written in the config's weight dtype.

Streaming: our parameters are restored one at a time (a whole layer stack when the checkpoint
is scanned) and dropped after their last HF tensor is produced; each HF tensor is appended to
the shard's data file on disk at once, and the shard gets its header when it is full (at most
max_shard_mb). Peak host memory is about the largest stored parameter plus one HF tensor
(measured in getting_started/Models.md, benchmarks/convert_memory.py, which converts both ways).

CKPT and DIR may be gs:// paths: Orbax reads CKPT from the bucket; for a gs:// DIR the shards are
written to a local temporary directory (needs disk for the whole model) and uploaded at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from typing import Any, Iterator

import numpy as np

from MaxText import families, startup
from MaxText import models
from MaxText.training import lora, params_io
from MaxText.paths import storage
from MaxText.configuration import config as config_lib, config_yaml, run_record
from MaxText.configuration.model_config import ModelConfig
from MaxText.convert import cli, engine, hf_io, streaming
from MaxText.errors import ConfigError, UserError, run_cli
from MaxText.run_dir.checkpointing import first_line

PROG = "maxtext_to_hf"
TOOL = startup.Tool(PROG, reads_run=True, hardware="cpu", reads_data=False)  # conversion is host work
OWN_KEYS = ("load_parameters_path", "output_path")  # its own key=value arguments; the rest are config keys
OPTIONAL_KEYS = ("max_shard_mb",)


def _open_checkpoint(checkpoint: str, config: config_lib.Config) -> tuple[_CheckedReader, ModelConfig]:
  """A one-parameter-at-a-time reader and the model config in the checkpoint's stored layer
  layout, after checking every stored shape against the model config."""
  directory, kind = params_io.params_directory(checkpoint)  # the same checkpoint kinds as load_params
  with _read_errors_as_one_line(f"{checkpoint} ({kind} checkpoint)", kind):
    reader = streaming.ParamReader(directory, config.model.weight_dtype)
  if any(path[-1] in lora.ADAPTER_KEYS for path in reader.shapes):  # the HF model would silently lose them
    raise UserError(f"{checkpoint} ({kind} checkpoint) holds LoRA adapters; write a parameters-only checkpoint with "
                    "MaxText.generate_param_only_checkpoint first (it merges them into the base weights) and convert that")
  cfg = dataclasses.replace(config.model, scan_layers=reader.scanned)
  expected = engine.flat_abstract(models.build_model_spec(cfg).abstract_params)
  wrong = [f"{'/'.join(p)} {reader.shapes.get(p, 'missing')} vs {a.shape}" for p, a in expected.items()
           if reader.shapes.get(p) != tuple(a.shape)]
  if wrong:
    reader.close()
    raise UserError(f"{checkpoint} ({kind} checkpoint) does not match the model config in {len(wrong)} "
                    f"parameter(s), e.g. {'; '.join(wrong[:3])}; pass the model keys the checkpoint was written with")
  # A trained parameter the keys leave out (a further unrolled layer, the untied output layer) would be dropped.
  extra = sorted("/".join(p) for p in reader.shapes if p not in expected)
  if extra:
    reader.close()
    raise UserError(f"{checkpoint} ({kind} checkpoint) holds {len(extra)} parameter(s) the model config does not "
                    f"have, e.g. {', '.join(extra[:3])}; pass the model keys the checkpoint was written with")
  return _CheckedReader(reader, checkpoint, kind), cfg


@contextlib.contextmanager
def _read_errors_as_one_line(what: str, kind: str) -> Iterator[None]:
  """A read error (a data file cut short, zeroed or missing) inside the block becomes one UserError line."""
  try:
    yield
  except Exception as e:  # noqa: BLE001 - what params_io.is_read_error names is one line; the rest is raised
    if not (params_io.is_read_error(e) or isinstance(e, OSError)):
      raise
    raise UserError(f"cannot read {what}: {first_line(e)}; {params_io.remedy(e, kind)}") from None


class _CheckedReader:
  """A ParamReader whose read errors (a data file cut short, zeroed or missing) are one UserError line."""

  def __init__(self, reader: streaming.ParamReader, checkpoint: str, kind: str):
    self.reader, self.checkpoint, self.kind = reader, checkpoint, kind
    self.shapes, self.scanned = reader.shapes, reader.scanned

  def read(self, path: streaming.ParamPath) -> np.ndarray:
    with _read_errors_as_one_line(f"{'/'.join(path)} from {self.checkpoint} ({self.kind} checkpoint)", self.kind):
      return self.reader.read(path)

  def close(self) -> None:
    self.reader.close()


def _hf_config(config: config_lib.Config, family: families.Family) -> dict[str, Any]:
  """config.json for the model, refusing models the HF class would compute differently."""
  hf_config = family.hf_config(config.model)
  schema = config_yaml.read_yaml(config_lib.BASE_CONFIG_PATH)
  round_trip = engine.full_model_keys(schema, engine.hf_model_keys(family, hf_config))
  lost = engine.differences(dict(config.values), round_trip, ignore=engine.NOT_IN_HF_CONFIG)
  if lost:
    raise ConfigError(f"HF {hf_config['model_type']} cannot express this model (ours vs what HF would "
                      f"compute): {'; '.join(lost)}")
  return hf_config


def export(checkpoint: str, output_path: str, user_args: list[str], max_shard_mb: int = 5000) -> list[str]:
  def output_is_empty() -> None:
    if storage.is_file(output_path):
      raise UserError(f"{output_path} is a file; output_path is the directory to write the model to")
    if storage.exists(output_path) and (not storage.is_dir(output_path) or storage.listdir(output_path)):
      raise UserError(f"{output_path} exists and is not empty; choose a new output_path")

  paths = {"load_parameters_path": checkpoint, "output_path": output_path}
  trained = _trained_length(checkpoint)
  if trained and not any(arg.startswith("max_target_length=") for arg in user_args):
    user_args = [*user_args, f"max_target_length={trained}"]  # what config.json's max_position_embeddings declares
  config = startup.start(TOOL, [PROG, *user_args], paths=paths,
                         check_paths=output_is_empty, model_keys=cli.CheckpointModelKeys(checkpoint, PROG)).config
  family = families.family_for_decoder_block(config.model.decoder_block)
  hf_config = _hf_config(config, family)
  reader, cfg = _open_checkpoint(checkpoint, config)
  dtype = str(np.dtype(cfg.weight_dtype))
  with storage.local_output(output_path) as out:  # uploaded when the block ends if output_path is gs://
    created = not storage.exists(out)  # else an empty directory (checked at start-up): all in it is ours
    storage.makedirs(out)
    writer = hf_io.SafetensorsWriter(out, max_shard_mb * 2**20)
    try:
      try:
        for name, array in engine.hf_tensors_from_params(reader.read, family, cfg):
          writer.add(name, array)
          del array  # may be a view of a stored parameter the generator is about to drop
      finally:
        reader.close()
      files = writer.close()
      storage.write_text(storage.join(out, hf_io.CONFIG_FILE), json.dumps({**hf_config, "dtype": dtype}, indent=2) + "\n")
    except BaseException:  # a half-written model must not look like a model (nor block the rerun's empty check)
      writer.abort()
      _remove_written(out, created)
      raise
  print(f"{PROG}: wrote {output_path} ({hf_config['model_type']}, {len(files)} safetensors file(s), "
        f"{writer.total_bytes / 2**20:.1f} MiB, {dtype})")
  return files


def _trained_length(checkpoint: str) -> int | None:
  """The max_target_length of the run a checkpoint belongs to (its config.yml), None for another checkpoint: a
  model trained longer than its config.json's max_position_embeddings declares the length it was trained at."""
  run_dir = run_record.run_dir_of(checkpoint)
  saved = run_record.read_saved(run_dir) if run_dir is not None else None
  length = (saved or {}).get("max_target_length")
  return length if isinstance(length, int) and not isinstance(length, bool) and length > 0 else None


def _remove_written(directory: str, created: bool) -> None:
  if created:
    storage.remove_tree(directory)
    return
  for name in storage.listdir(directory):
    storage.remove_tree(storage.join(directory, name))


def main(argv: list[str]) -> int:
  own, user_args = cli.split_args(argv[1:], OWN_KEYS, OPTIONAL_KEYS)
  text = own.get("max_shard_mb", "5000")
  if not text.isdigit() or int(text) < 1:
    raise UserError(f"max_shard_mb must be a positive whole number of MiB, got {text!r}")
  export(own["load_parameters_path"], own["output_path"], user_args, int(text))
  return 0


if __name__ == "__main__":
  run_cli(main, sys.argv)
