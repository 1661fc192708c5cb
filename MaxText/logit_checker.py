"""Runs one token batch through our model and through Hugging Face transformers and compares logits.

  python3 -m MaxText.logit_checker configs/base.yml [model_name=<name>] load_parameters_path=CKPT \\
      hf_model_path=DIR [atol=A] [max_kl=K] [hf_dtype=float32|bfloat16] [batch_size=2] \\
      [sequence_length=32] [seed=0] [image_path=PNG,JPEG,...] [key=value ...]

Prints, per position, the largest |Δlogit| over the batch and vocabulary, the mean
KL(HF ‖ ours) and the top-1 agreement, then the totals; exits 1 when max |Δlogit| > atol or the
mean KL > max_kl. The model keys come from model_name, else from CKPT/model_config.yml, else
from DIR/config.json (printed as key=value overrides); a model_name that disagrees with
config.json is an error. Default tolerances suit real checkpoints: float32 (dtype=float32)
atol=0.01, max_kl=1e-5; bfloat16 atol=1.0, max_kl=0.01. CKPT and DIR may be gs:// paths (DIR's
top-level files are downloaded to a temporary directory for transformers).

A vision-language model (use_multimodal) is checked with images too: `image_path=` (the key decode.py
reads its prompt's images from) names image files (local or gs://), cut into views as HF's processor
does and placed in every sequence as token runs, both by the family's image format
(Family.image_format: Gemma 3's begin-of-image, mm_tokens_per_image placeholders, end-of-image per
view; Llama 4's tiles' expansion), so the vision tower, the projector and the image mask are compared.

A sparse-attention model's indexer (DeepSeek-V3.2) runs on HF's side with equal index scores taken
lowest key position first, as ours takes them: torch leaves that order unspecified
(`break_index_ties_by_position`).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python3 MaxText/logit_checker.py`
  sys.path[0] = str(Path(__file__).resolve().parent.parent)

import jax
import jax.numpy as jnp
import numpy as np

from MaxText import families, startup
from MaxText.training import model_assembly
from MaxText.platform import sharding
from MaxText.configuration import config_yaml, tool_args
from MaxText.configuration.config import Config
from MaxText.configuration.vision_config import VisionConfig
from MaxText.families.image_format import ImageFormat
from MaxText.input_pipeline import images
from MaxText.convert import cli, hf_io
from MaxText.errors import UserError, run_cli

PROG = "logit_checker"
_RENAMED = {"images": "image_path"}  # the checker's old key for the config key decode.py reads images from
_DEFAULT_TOLERANCES = {"float32": (0.01, 1e-5)}  # anything lower-precision: (1.0, 0.01)


@dataclasses.dataclass(frozen=True)
class CheckerArgs:
  """The checker's own key=value arguments (tool_args.parse_tool_record), with their defaults."""
  hf_model_path: str = ""
  atol: float | None = None  # None: the HF dtype's default
  max_kl: float | None = None
  hf_dtype: str = "float32"
  batch_size: int = 2
  sequence_length: int = 32
  seed: int = 0


def split_checker_args(args: list[str]) -> tuple[CheckerArgs, list[str]]:
  """The checker's own key=value arguments, typed; the rest go to the model config."""
  checker, rest = tool_args.parse_tool_record(CheckerArgs, tool_args.renamed_key_values(args, _RENAMED))
  if not checker.hf_model_path:
    raise UserError("set hf_model_path=DIR: the Hugging Face model directory to compare with")
  if checker.hf_dtype not in ("float32", "bfloat16"):
    raise UserError(f"hf_dtype must be float32 or bfloat16, got {checker.hf_dtype!r}")
  # A nan or negative tolerance failed every comparison, reading as a wrong conversion.
  for name in ("atol", "max_kl"):
    value = getattr(checker, name)
    if value is not None and not value >= 0:
      raise UserError(f"{name} must be a number >= 0 (0 = exact), got {value}")
  for name in ("batch_size", "sequence_length"):
    if getattr(checker, name) < 1:
      raise UserError(f"{name} must be >= 1, got {getattr(checker, name)}")
  return checker, rest


def our_logits(config: Config, token_ids: np.ndarray, pixels_BMCRR: np.ndarray | None = None) -> np.ndarray:
  checkpoint = config.checkpoint.load_parameters_path
  if not checkpoint:
    raise UserError("set load_parameters_path=CKPT: the checkpoint to check")
  model, params = model_assembly.assemble_model(config, checkpoint)

  def forward(p: model_assembly.Params, tokens_BL: jax.Array, pixels: jax.Array | None) -> jax.Array:
    positions_BL = jnp.broadcast_to(jnp.arange(tokens_BL.shape[1]), tokens_BL.shape)
    with sharding.activation_sharding(model.mesh, model.rules):
      return model.spec.apply(p, tokens_BL, positions_BL, jnp.ones_like(tokens_BL), None, pixels)

  pixels = None if pixels_BMCRR is None else jnp.asarray(pixels_BMCRR)
  return np.asarray(jax.jit(forward)(params, jnp.asarray(token_ids, jnp.int32), pixels))


def hf_logits(hf_model_path: str, token_ids: np.ndarray, hf_dtype: str, pixels_BMCRR: np.ndarray | None = None,
              image_token_id: int | None = None) -> np.ndarray:
  """HF's logits; a multimodal model gets what its processor would give: token_type_ids marking the
  image placeholders (`image_token_id`) and the images' pixel values in order."""
  try:
    import torch
    import transformers
  except ImportError:
    raise UserError("the logit checker needs torch and transformers: install them with EXTRAS=hf bash setup.sh") from None
  with hf_io.local_model_dir(hf_model_path) as local:
    model_type = transformers.AutoConfig.from_pretrained(local).model_type
    # A family's own runner (Family.hf_image_text_logits) takes an image-text checkpoint that
    # AutoModelForCausalLM would read as its text model alone.
    own = next((family.hf_image_text_logits[model_type] for family in families.families().values()
                if model_type in family.hf_image_text_logits), None)
    auto = transformers.AutoModelForImageTextToText if own else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(local, dtype=getattr(torch, hf_dtype), attn_implementation="eager").eval()
  break_index_ties_by_position(model)
  if own is not None:
    return own(model, token_ids, None if pixels_BMCRR is None else pixels_BMCRR.reshape((-1,) + pixels_BMCRR.shape[2:]))
  inputs = {"input_ids": torch.tensor(token_ids)}
  if image_token_id is not None:
    inputs["token_type_ids"] = torch.tensor(token_ids == image_token_id, dtype=torch.long)
  if pixels_BMCRR is not None:
    flat = pixels_BMCRR.reshape((-1,) + pixels_BMCRR.shape[2:])
    inputs["pixel_values"] = torch.tensor(flat, dtype=getattr(torch, hf_dtype))
  with torch.no_grad():
    return model(**inputs).logits.float().numpy()


def _first_k_by_position(scores: Any, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Any:
  """torch.topk with equal scores taken lowest index first (jax.lax.top_k's documented order)."""
  import torch
  del sorted  # a stable sort returns them sorted either way
  values, indices = torch.sort(scores, dim=dim, descending=largest, stable=True)
  return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


def break_index_ties_by_position(model: Any) -> Any:
  """`model` (a transformers model) with each sparse-attention indexer's top-k (DeepSeek-V3.2's
  `DeepseekV32Indexer`, any module with `index_topk`) taking equal index scores lowest key position
  first, as ours does (masks.top_k_keys). Every score whose heads' ReLUs are all 0 is exactly 0, so
  with few index heads such ties at the top-k boundary are common; torch.topk leaves their order
  unspecified (DeepSeek's reference calls it too), and on CPU it is neither first nor last, which
  would fail a correct conversion. Other top-k choices (MoE routing) are left as they are."""
  import torch
  for module in model.modules():
    if not hasattr(module, "index_topk") or getattr(module, "_ties_by_position", False):
      continue

    def forward(*args: Any, _forward: Any = module.forward, **kwargs: Any) -> Any:
      method, function = torch.Tensor.topk, torch.topk
      torch.Tensor.topk = torch.topk = _first_k_by_position  # type: ignore[method-assign, assignment]
      try:
        return _forward(*args, **kwargs)
      finally:
        torch.Tensor.topk, torch.topk = method, function  # type: ignore[method-assign]

    module.forward = forward
    module._ties_by_position = True
  return model


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


def image_prompts(token_ids: np.ndarray, vision: VisionConfig, paths: list[str], image_format: ImageFormat | None,
                  vocab_size: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
  """(token ids with the images' runs (`image_format`'s, as HF's processor writes them) placed evenly
  through every row, pixel values [B, M, 3, R, R] of their views); the random text never holds the
  image tokens themselves."""
  special = [vision.image_token_id, vision.boi_token_id, vision.eoi_token_id]
  token_ids = np.where(np.isin(token_ids, special), 0, token_ids)
  if not paths or image_format is None:
    return token_ids, None
  prepared = [image_format.prepare(images.load(path), vision) for path in paths]
  blocks = [image_format.run_ids(vision, image, vocab_size) for image in prepared]
  pixels_MCRR = np.concatenate([image.pixels for image in prepared])
  cuts = [token_ids.shape[1] * (k + 1) // (len(paths) + 1) for k in range(len(paths))]
  rows = []
  for row in token_ids.tolist():
    pieces = np.split(np.asarray(row), cuts)
    rows.append(np.concatenate([np.concatenate([piece, block]) for piece, block in zip(pieces[:-1], blocks)]
                               + [pieces[-1]]))
  pixels = np.broadcast_to(pixels_MCRR[None], (token_ids.shape[0],) + pixels_MCRR.shape)
  return np.stack(rows).astype(token_ids.dtype), np.ascontiguousarray(pixels)


TOOL = startup.Tool(PROG, reads_run=True, reads_data=False)


def main(argv: list[str]) -> int:
  checker, config_args = split_checker_args(argv[1:])
  hf_path = checker.hf_model_path
  config = startup.start(TOOL, [PROG, *config_args], paths={"hf_model_path": hf_path},
                         model_keys=cli.HfModelKeys(hf_path, PROG)).config
  default_atol, default_kl = _DEFAULT_TOLERANCES.get(config.model.dtype, (1.0, 0.01))
  atol = default_atol if checker.atol is None else checker.atol
  max_kl = default_kl if checker.max_kl is None else checker.max_kl
  table = config.model.max_position_embeddings
  if config.model.position_embedding == "learned" and checker.sequence_length > table:
    # Past it a learned position table is read out of range (clamped here, an index error in HF); a RoPE
    # model has no such end.
    raise UserError(f"sequence_length={checker.sequence_length} is longer than this model's learned position table "
                    f"({table} positions, max_position_embeddings): use sequence_length={table} or less")
  rng = np.random.default_rng(checker.seed)
  token_ids = rng.integers(0, config.model.vocab_size, size=(checker.batch_size, checker.sequence_length))
  paths = config_yaml.split_items("image_path", config.decode.image_path)
  vision = config.model.vision
  if paths and not vision.use_multimodal:
    raise UserError(f"image_path= given, but {config.model.decoder_block} here is a text-only model (use_multimodal=False)")
  pixels, image_token_id = None, None
  if vision.use_multimodal:
    image_format = families.family_for_decoder_block(config.model.decoder_block).image_format
    token_ids, pixels = image_prompts(token_ids, vision, paths, image_format, config.model.vocab_size)
    image_token_id = vision.image_token_id
  ours = our_logits(config, token_ids, pixels)
  theirs = hf_logits(hf_path, token_ids, checker.hf_dtype, pixels, image_token_id)
  print(f"{PROG}: {config.model.decoder_block} model ({config.model.dtype}) vs HF {hf_path} ({checker.hf_dtype}), "
        f"{token_ids.shape[0]} sequences x {token_ids.shape[1]} tokens"
        + (f", {len(paths)} image(s) each" if paths else ""))
  return 0 if report(compare(ours, theirs), atol, max_kl) else 1


if __name__ == "__main__":
  run_cli(main)
