"""Hugging Face checkpoint → parameters-only Orbax checkpoint.

  python3 -m MaxText.convert.hf_to_maxtext hf_model_path=DIR output_path=CKPT [model_name=<name>] \\
      [scan_layers=True|False] [weight_dtype=float32|bfloat16] [key=value ...]

Without model_name the family and every dimension come from DIR/config.json (printed as
key=value overrides); with it, a disagreement with config.json is an error naming the keys.
Writes CKPT (load it with `load_parameters_path=CKPT`) and CKPT/model_config.yml.

Memory (benchmarks/convert_memory.py): HF tensors are read one at a time (safetensors shard by
shard, .bin shards memory-mapped) and written into memory-mapped staging files beside CKPT, so
reading and re-laying-out holds about one copy of the largest tensor. The Orbax (OCDBT)
write then streams from those files one parameter at a time (`streaming.save_params_one_by_one`),
so it holds about one parameter: a whole layer stack when scan_layers=True, one layer's tensor
when False. Staging needs disk space for one extra copy of the converted model, removed at the end.
Measured figures are in getting_started/Models.md.

An MXFP4-quantised checkpoint (GPT-OSS as published) is dequantised to bfloat16 as it streams
(families/mxfp4.py); the model trains and is written back in bfloat16.

DIR and CKPT may be gs:// paths: HF shards are downloaded one at a time just before they are read,
and Orbax writes a gs:// CKPT itself (its staging files then go to the local temporary directory).
"""

from __future__ import annotations

import resource
import sys
import tempfile

from MaxText import families, startup
from MaxText import models
from MaxText.paths import storage
from MaxText.convert import cli, engine, hf_io, streaming
from MaxText.families import mxfp4
from MaxText.input_pipeline import tokenizer
from MaxText.errors import ConfigError, UserError, run_cli

PROG = "hf_to_maxtext"
TOOL = startup.Tool(PROG, reads_run=True, hardware="cpu", reads_data=False)  # conversion is host work
OWN_KEYS = ("hf_model_path", "output_path")  # its own key=value arguments; the rest are config keys


def convert(hf_path: str, output_path: str, user_args: list[str]) -> dict[str, float]:
  """Converts and returns a summary (tensor bytes, peak memory) for logs and tests."""
  def output_is_new() -> None:
    if storage.exists(output_path):
      raise UserError(f"{output_path} already exists; choose a new output_path or remove it first")

  hf_keys = cli.HfModelKeys(hf_path, PROG)
  config = startup.start(TOOL, [PROG, *user_args], paths={"hf_model_path": hf_path, "output_path": output_path},
                         check_paths=output_is_new, model_keys=hf_keys).config
  hf_config, model_keys = hf_keys.hf_config, hf_keys.model_keys
  cfg = config.model
  _check_tokenizer(hf_path, cfg.vocab_size)
  family = families.family_for_hf_config(hf_config)
  spec = models.build_model_spec(cfg)
  # Staging beside a local output keeps it on the disk the user chose for the checkpoint.
  staging_parent = None
  if not storage.is_remote(output_path):
    staging_parent = storage.parent(output_path)
    storage.makedirs(staging_parent)
  with tempfile.TemporaryDirectory(dir=staging_parent, prefix=".hf_to_maxtext-staging-") as staging_dir:
    staged = engine.StagedParams(spec.abstract_params, staging_dir, cfg.weight_dtype)
    tensors = hf_io.iter_hf_tensors(hf_path)
    if mxfp4.quant_method(hf_config) == "mxfp4":
      tensors = mxfp4.dequantized_tensors(tensors)
    largest = engine.stage_hf_tensors(tensors, family, cfg, staged, engine.null_fields_note(hf_config))
    streaming.save_params_one_by_one(output_path, staged.tree())
  saved = engine.write_model_config(output_path, model_keys, hf_path)
  left_out = [tower for tower in ("vision", "audio") if hf_config.get(f"{tower}_config")]
  if left_out and not cfg.vision.use_multimodal:  # an image-text checkpoint read as its text decoder
    print(f"{PROG}: {hf_path} is a multimodal checkpoint ({hf_config.get('model_type')}): its text decoder was "
          f"converted and its {' and '.join(left_out)} tower{'s were' if len(left_out) > 1 else ' was'} left out")
  peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  print(f"{PROG}: wrote {output_path} ({family.name}, {cfg.num_decoder_layers} layers, "
        f"{'scanned' if cfg.scan_layers else 'unrolled'}, {cfg.weight_dtype}) and {storage.name(saved)}; "
        f"largest HF tensor {largest / 2**20:.1f} MiB, peak resident memory {peak_mib:.0f} MiB (includes the runtime and mapped pages)")
  return {"largest_tensor_bytes": largest, "peak_rss_mib": peak_mib}


def _check_tokenizer(hf_path: str, vocab_size: int) -> None:
  """A tokenizer.json beside the weights with ids past vocab_size: those ids have no embedding row (transformers
  fails on them; a gather here gives NaN rows). Only a warning: the weights convert, and decode, serving and
  training refuse that tokenizer when it is given to them."""
  file = storage.join(hf_path, "tokenizer.json")
  if not storage.is_file(file):
    return
  try:
    ids = tokenizer.hf_vocab_size(tokenizer.read_hf_tokenizer(file, hf_path))
  except ConfigError:  # a damaged tokenizer is its readers' to refuse; the converter does not convert it
    return
  if ids > vocab_size:
    print(f"{PROG}: warning: {file} has ids up to {ids - 1} but config.json's vocab_size is {vocab_size}: those "
          "tokens have no embedding row; use the checkpoint's own tokenizer")


def main(argv: list[str]) -> int:
  own, user_args = cli.split_args(argv[1:], OWN_KEYS)
  convert(own["hf_model_path"], own["output_path"], user_args)
  return 0


if __name__ == "__main__":
  run_cli(main, sys.argv)
