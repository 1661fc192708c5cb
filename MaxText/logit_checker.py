"""Runs one token batch through our model and through Hugging Face transformers and compares logits.

  python3 -m MaxText.logit_checker configs/base.yml [model_name=<name>] load_parameters_path=CKPT \\
      hf_model_path=DIR [atol=A] [max_kl=K] [hf_dtype=float32|bfloat16] [batch_size=2] \\
      [sequence_length=32] [seed=0] [key=value ...]

Prints, per position, the largest |Δlogit| over the batch and vocabulary, the mean
KL(HF ‖ ours) and the top-1 agreement, then the totals; exits 1 when max |Δlogit| > atol or the
mean KL > max_kl. The model keys come from model_name, else from CKPT/model_config.yml, else
from DIR/config.json (printed as key=value overrides); a model_name that disagrees with
config.json is an error. Default tolerances suit real checkpoints: float32 (dtype=float32)
atol=0.01, max_kl=1e-5; bfloat16 atol=1.0, max_kl=0.01. CKPT and DIR may be gs:// paths (DIR's
top-level files are downloaded to a temporary directory for transformers).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python3 MaxText/logit_checker.py`
  sys.path[0] = str(Path(__file__).resolve().parent.parent)

import jax
import jax.numpy as jnp
import numpy as np

from MaxText import startup
from MaxText.training import model_assembly
from MaxText.platform import sharding
from MaxText.configuration.config import Config
from MaxText.convert import cli, hf_io
from MaxText.errors import UserError, run_cli

PROG = "logit_checker"
_CHECKER_KEYS = {"hf_model_path": "", "atol": None, "max_kl": None, "hf_dtype": "float32", "batch_size": 2,
                 "sequence_length": 32, "seed": 0}
_DEFAULT_TOLERANCES = {"float32": (0.01, 1e-5)}  # anything lower-precision: (1.0, 0.01)


def split_checker_args(args: list[str]) -> tuple[dict[str, Any], list[str]]:
  """The checker's own key=value arguments, typed; the rest go to the model config."""
  values: dict[str, Any] = dict(_CHECKER_KEYS)
  rest = []
  for arg in args:
    key, sep, text = arg.partition("=")
    if not sep or key not in _CHECKER_KEYS:
      rest.append(arg)
      continue
    try:
      values[key] = text if key in ("hf_model_path", "hf_dtype") else (
          float(text) if key in ("atol", "max_kl") else int(text))
    except ValueError:
      raise UserError(f"{key} must be a number, got {text!r}") from None
  if not values["hf_model_path"]:
    raise UserError("set hf_model_path=DIR: the Hugging Face model directory to compare with")
  if values["hf_dtype"] not in ("float32", "bfloat16"):
    raise UserError(f"hf_dtype must be float32 or bfloat16, got {values['hf_dtype']!r}")
  return values, rest


def our_logits(config: Config, token_ids: np.ndarray) -> np.ndarray:
  checkpoint = config.checkpoint.load_parameters_path
  if not checkpoint:
    raise UserError("set load_parameters_path=CKPT: the checkpoint to check")
  model, params = model_assembly.assemble_model(config, checkpoint)

  def forward(p: Any, tokens_BL: jax.Array) -> jax.Array:
    positions_BL = jnp.broadcast_to(jnp.arange(tokens_BL.shape[1]), tokens_BL.shape)
    with sharding.activation_sharding(model.mesh, model.rules):
      return model.spec.apply(p, tokens_BL, positions_BL, jnp.ones_like(tokens_BL))

  return np.asarray(jax.jit(forward)(params, jnp.asarray(token_ids, jnp.int32)))


def hf_logits(hf_model_path: str, token_ids: np.ndarray, hf_dtype: str) -> np.ndarray:
  try:
    import torch
    import transformers
  except ImportError:
    raise UserError("the logit checker needs torch and transformers: install them with EXTRAS=hf bash setup.sh") from None
  with hf_io.local_model_dir(hf_model_path) as local:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        local, dtype=getattr(torch, hf_dtype), attn_implementation="eager").eval()
  with torch.no_grad():
    return model(torch.tensor(token_ids)).logits.float().numpy()


def _log_softmax(x: np.ndarray) -> np.ndarray:
  x = x.astype(np.float64)
  shifted = x - x.max(axis=-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def compare(ours_BLV: np.ndarray, hf_BLV: np.ndarray) -> dict[str, np.ndarray]:
  """Per-position [L] max |Δlogit|, mean KL(HF ‖ ours) and top-1 agreement, over the batch."""
  log_p, log_q = _log_softmax(hf_BLV), _log_softmax(ours_BLV)
  kl_BL = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)
  return {"max_abs_diff": np.abs(ours_BLV - hf_BLV).max(axis=(0, 2)), "kl": kl_BL.mean(axis=0),
          "top1": (ours_BLV.argmax(-1) == hf_BLV.argmax(-1)).mean(axis=0)}


def report(per_position: dict[str, np.ndarray], atol: float, max_kl: float) -> bool:
  print(f"{'position':>8}  {'max |Δlogit|':>12}  {'mean KL':>10}  {'top-1 agree':>11}")
  for i, (diff, kl, top1) in enumerate(zip(per_position["max_abs_diff"], per_position["kl"], per_position["top1"])):
    print(f"{i:>8}  {diff:>12.3e}  {kl:>10.2e}  {top1:>11.0%}")
  max_diff, mean_kl = float(per_position["max_abs_diff"].max()), float(per_position["kl"].mean())
  top1 = float(per_position["top1"].mean())
  passed = max_diff <= atol and mean_kl <= max_kl
  print(f"{PROG}: {'PASS' if passed else 'FAIL'}: max |Δlogit| {max_diff:.3e} (atol {atol:g}), "
        f"mean KL {mean_kl:.3e} (max_kl {max_kl:g}), top-1 agreement {top1:.1%}")
  return passed


TOOL = startup.Tool(PROG, reads_run=True)


def main(argv: list[str]) -> int:
  checker, config_args = split_checker_args(argv[1:])
  hf_path = checker["hf_model_path"]
  config = startup.start(TOOL, [PROG, *config_args], paths={"hf_model_path": hf_path},
                         model_keys=cli.HfModelKeys(hf_path, PROG)).config
  default_atol, default_kl = _DEFAULT_TOLERANCES.get(config.model.dtype, (1.0, 0.01))
  atol = default_atol if checker["atol"] is None else checker["atol"]
  max_kl = default_kl if checker["max_kl"] is None else checker["max_kl"]
  rng = np.random.default_rng(checker["seed"])
  token_ids = rng.integers(0, config.model.vocab_size, size=(checker["batch_size"], checker["sequence_length"]))
  ours = our_logits(config, token_ids)
  theirs = hf_logits(hf_path, token_ids, checker["hf_dtype"])
  print(f"{PROG}: {config.model.decoder_block} model ({config.model.dtype}) vs HF {hf_path} ({checker['hf_dtype']}), "
        f"{token_ids.shape[0]} sequences x {token_ids.shape[1]} tokens")
  return 0 if report(compare(ours, theirs), atol, max_kl) else 1


if __name__ == "__main__":
  run_cli(main)
