"""Write a parameters-only checkpoint (for decode.py or fine-tuning) from a training run's full state.

    python3 -m MaxText.generate_param_only_checkpoint configs/base.yml run_name=RUN \\
        param_only_checkpoint_path=OUT [force_unroll=True] [load_full_state_path=STEP_OR_CHECKPOINTS_DIR]

Reads only the parameters of the latest complete checkpoint of `run_name` (or of
`load_full_state_path`), never the optimizer state, so it needs about one model's worth of
memory. A LoRA run's adapters (lora_rank > 0) are merged into their base weights, so the
output is a plain model; `lora_peft_export_path=DIR` also writes the adapters in PEFT's format.
`force_unroll=True` writes `layers_0..N` instead of a scanned stack. The model keys
are written beside the checkpoint (model_config.yml), so later runs need no model_name.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # `python3 MaxText/generate_param_only_checkpoint.py`
  sys.path[0] = str(Path(__file__).resolve().parent.parent)

import jax

from MaxText import models
from MaxText.training import lora, model_assembly, params_io
from MaxText.paths import storage
from MaxText.configuration.config import Config
from MaxText.configuration.model_config import MODEL_KEYS
from MaxText.convert import engine, peft_adapters
from MaxText.errors import ConfigError, UserError, run_cli
from MaxText import startup
from MaxText.platform.distributed import log


def generate(config: Config) -> str:
  """Returns the path written."""
  cfg = config.checkpoint
  output = cfg.param_only_checkpoint_path
  if not output:
    raise ConfigError("set param_only_checkpoint_path=DIR: where to write the parameters-only checkpoint")
  source = cfg.load_full_state_path or cfg.directory
  if not storage.exists(source):
    raise UserError(f"no checkpoint to read: {source} does not exist (set run_name of a run with checkpoints, "
                    "or load_full_state_path)")
  if storage.exists(output):
    raise UserError(f"{output} already exists; choose a new param_only_checkpoint_path or remove it first")
  if cfg.lora_peft_export_path and storage.exists(cfg.lora_peft_export_path):  # before the long read
    raise UserError(f"{cfg.lora_peft_export_path} already exists; choose a new lora_peft_export_path or remove it "
                    "first")
  _, params = model_assembly.assemble_model(config, source)
  if cfg.lora_peft_export_path:  # before merging: the adapters as they are
    targets = peft_adapters.save(cfg.lora_peft_export_path, jax.device_get(lora.split(params)[0]), config.model)
    log(f"wrote the LoRA adapters ({', '.join(targets)}) in PEFT's format to {cfg.lora_peft_export_path}")
  if config.model.lora.lora_rank > 0:  # a plain model: decode.py and maxtext_to_hf read it without LoRA keys
    lora_scale = config.model.lora.lora_alpha / config.model.lora.lora_rank
    params = jax.jit(lambda p: lora.merge(p, lora_scale))(params)
    log(f"merged the LoRA adapters (scale {lora_scale:g}) into their base weights")
  if cfg.force_unroll and config.model.scan_layers:
    params = models.unstack_layers(params, config.model.num_moe_stack_layers)
  params_io.save_params(output, params)
  if jax.process_index() == 0:
    keys = {k: config[k] for k in MODEL_KEYS if k in config.values}
    engine.write_model_config(output, keys, f"training checkpoint {source}")
  layout = "unrolled layers_0..N" if cfg.force_unroll or not config.model.scan_layers else "scanned layers"
  log(f"wrote parameters-only checkpoint ({layout}) to {output}")
  return output


TOOL = startup.Tool("generate_param_only_checkpoint", reads_run=True, joins_job=True, reads_data=False)

main = startup.config_main(TOOL, generate)


if __name__ == "__main__":
  run_cli(main)
