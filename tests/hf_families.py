"""Tiny random Hugging Face models, one per family, with each family's distinctive features on,
and helpers to run them and our converted copy on the same tokens.

Every parameter is randomised (HF initialises norms to 1 or 0 and biases to 0, which would hide
a swapped norm or a dropped bias).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401 (re-exported for tests)
import numpy as np

from MaxText import models
from MaxText.configuration.config import Config
from MaxText import families, logit_checker
from MaxText.platform import sharding
from MaxText.convert import engine

torch = __import__("pytest").importorskip("torch", reason="needs torch (EXTRAS=test bash setup.sh)")
transformers = __import__("pytest").importorskip("transformers", reason="needs transformers (EXTRAS=test bash setup.sh)")

BATCH, LENGTH, VOCAB = 2, 24, 128
# Every family's tiny reference models (MaxText/families/): a new family is tested by adding it.
REFERENCE_CONFIGS = families.reference_hf_configs()
FAMILIES = tuple(REFERENCE_CONFIGS)
# Families whose forward pass does not finish on the 8 simulated CPU devices, with the reason tests skip them
# there. None since Qwen3-Next's chunked form stopped calling LAPACK's triangular solve, whose CPU kernel
# deadlocked the simulated devices' thread pool (layers/gated_delta_rule.unit_lower_inverse).
MESH_HANGS: dict[str, str] = {}
# The float32 bound on |our logits - HF's| that the parity tests and the logit checker hold each family to
# (FP32_ATOL elsewhere: a missing feature moves the logits by >= 0.3). The DeltaNet families: a chunk's
# triangular inverse has entries in the hundreds and carries rounding into the logits (2.4e-5 seen on the
# 8-device mesh; 2.2e-5 for Qwen3.5's MoE on one device with the tests' unoptimised CPU code,
# tests/compile_settings.py). Qwen3.5's MoE through the checker on the 8-device mesh: one position of 64 at
# 6.3e-5 (the rest under 2e-5, KL 1e-10 there, the same with optimised code), 3.3e-5 on one device: the
# sharded experts' sums in another order, amplified as above. Gemma 4's logit check on the mesh: logits
# soft-capped at 30 round to 2.3e-5 at one position of 32 with that code, under 2e-5 with optimised code.
FP32_ATOL = 2e-5
DELTANET_FP32_ATOL = 5e-5
CHECKER_FP32_ATOL = {"qwen3_next": DELTANET_FP32_ATOL, "qwen3_5": DELTANET_FP32_ATOL,
                     "qwen3_5_moe": 1e-4, "gemma4": 3e-5}


def checker_atol(family: str) -> str:
  """The logit checker's `atol=` argument for a family's float32 check."""
  return f"atol={CHECKER_FP32_ATOL.get(family, FP32_ATOL):g}"


def hf_config(family: str, **overrides: Any) -> Any:
  """The tiny HF config `family` names in its family module; `overrides` replace its top-level fields
  (the shape grids of tests/layers/test_shape_grids.py)."""
  fields = {**REFERENCE_CONFIGS[family], **overrides}
  config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
  assert config.vocab_size == VOCAB, f"{family}: the reference configs share vocab_size={VOCAB}"
  return config


def build_hf_model(family: str, seed: int = 0, **overrides: Any) -> Any:
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **overrides), attn_implementation="eager")
  return logit_checker.break_index_ties_by_position(randomize(model.eval(), seed))


def randomize(model: Any, seed: int) -> Any:
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for param in model.parameters():
      noise = torch.randn(param.shape, generator=generator)
      # Vectors (norm gains, biases) move off their 1/0 init; matrices get O(1/sqrt(64)) entries.
      param.copy_(param + 0.1 * noise if param.ndim == 1 else 0.15 * noise)
    for name, buffer in model.named_buffers():  # DeepSeek-V3's routing bias is a buffer, zero at init
      if name.endswith("e_score_correction_bias"):
        buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
      if name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale, one at init
        buffer.copy_(1 + 0.1 * torch.randn(buffer.shape, generator=generator))
  return model


def hf_config_dict(model: Any) -> dict:
  return model.config.to_dict()


def our_config(model: Any, **overrides: Any) -> Config:
  """Our config for `model`, every architecture key inferred from its HF config."""
  family = families.family_for_hf_config(hf_config_dict(model))
  keys = {**family.model_keys(hf_config_dict(model)), "max_target_length": LENGTH, "print_config": False}
  return Config.for_testing(**{**keys, **overrides})


def our_params(model: Any, config: Config, staging_dir: Path) -> Any:
  """HF state dict → our parameter tree through the converter's tensor table."""
  family = families.family_for_hf_config(hf_config_dict(model))
  spec = models.build_model_spec(config.model)
  staging_dir.mkdir(parents=True, exist_ok=True)
  staged = engine.StagedParams(spec.abstract_params, str(staging_dir), config.model.weight_dtype)
  tensors = ((name, t.detach().float().numpy()) for name, t in model.state_dict().items())
  engine.stage_hf_tensors(tensors, family, config.model, staged)
  return jax.tree.map(np.array, staged.tree())


def converted_checkpoint(ckpt: Path) -> tuple[Config, Any]:
  """A checkpoint hf_to_maxtext wrote: its config (float32, the tests' length) and its parameters on one device."""
  from MaxText.training import params_io
  config = Config.for_testing(load_parameters_path=str(ckpt), dtype="float32", max_target_length=LENGTH,
                              print_config=False)
  spec = models.build_model_spec(config.model)
  one_device = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",)),
                                          jax.sharding.PartitionSpec())
  return config, params_io.load_params(str(ckpt), spec.abstract_params,
                                       jax.tree.map(lambda _: one_device, spec.abstract_params))


def tokens(seed: int = 0, length: int = LENGTH) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, VOCAB, size=(BATCH, length))


def hf_logits(model: Any, token_ids: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(token_ids)).logits.float().numpy()


def our_logits(config: Config, params: Any, token_ids: np.ndarray) -> np.ndarray:
  spec = models.build_model_spec(config.model)
  positions = np.broadcast_to(np.arange(token_ids.shape[1]), token_ids.shape)
  apply = jax.jit(sharding.unsharded()(spec.apply))  # a reference comparison on one device
  return np.asarray(apply(params, jnp.asarray(token_ids), jnp.asarray(positions), jnp.ones(token_ids.shape, jnp.int32)))


def round_to_bfloat16(model: Any) -> Any:
  """The same model with every weight rounded to bfloat16 (kept in float32)."""
  with torch.no_grad():
    for param in model.parameters():
      param.copy_(param.to(torch.bfloat16).float())
  return model


# ---- image-text models (use_multimodal): the families' multimodal reference configs, prompts with images.

MULTIMODAL_CONFIGS = families.multimodal_reference_hf_configs()
MULTIMODAL = tuple(MULTIMODAL_CONFIGS)


def build_hf_multimodal_model(name: str, seed: int = 0, **overrides: Any) -> Any:
  """The family's tiny multimodal reference, randomised; `overrides` replace its top-level HF fields."""
  fields = {**MULTIMODAL_CONFIGS[name], **overrides}
  config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
  torch.manual_seed(seed)
  model = transformers.AutoModelForImageTextToText.from_config(config, attn_implementation="eager").eval()
  return randomize(model, seed)


# Llama 4's prompts: each image's tile grid (rows, columns) by image index, so the images of a row
# cover a one-tile image, a wide one and a tall one (a grid of several tiles adds the thumbnail).
LLAMA4_GRIDS = ((1, 2), (1, 1), (2, 1))


def _llama4_tokens(config: Any) -> Any:
  from MaxText.families import llama4_images
  return llama4_images.ImageTokens(start=config.boi_token_index, end=config.eoi_token_index,
                                   patch=config.image_token_index, tile_x_separator=123, tile_y_separator=124,
                                   image=125)


def image_runs(model: Any, num_images: int) -> tuple[list[list[int]], int, int]:
  """(each image's token run, how many views (tiles) each image has in total, tile side) as the
  chat template and processor write them: Gemma 3's begin-of-image, mm_tokens_per_image
  placeholders, end-of-image; Llama 4's expansion of its tile grid (families/llama4_images.py)."""
  config = model.config
  if config.model_type == "llama4":
    from MaxText.families import llama4_images
    vision = config.vision_config
    per_tile = (vision.image_size // vision.patch_size) ** 2 // round(1 / vision.pixel_shuffle_ratio**2)
    grids = [LLAMA4_GRIDS[k % len(LLAMA4_GRIDS)] for k in range(num_images)]
    runs = [llama4_images.expand_image(grid, per_tile, _llama4_tokens(config)) for grid in grids]
    return runs, sum(llama4_images.num_views(grid) for grid in grids), vision.image_size
  run = [config.boi_token_index] + [config.image_token_index] * config.mm_tokens_per_image + [config.eoi_token_index]
  return [run] * num_images, num_images, config.vision_config.image_size


def multimodal_prompt(model: Any, num_images: int, seed: int = 0, length: int = 20) -> tuple[np.ndarray, np.ndarray]:
  """(token ids [BATCH, L], pixel values [BATCH, views, 3, R, R]): each row `length` random
  text tokens with `num_images` images at random places, each as `image_runs` writes it."""
  config = model.config
  runs, views, size = image_runs(model, num_images)
  special = {config.boi_token_index, config.eoi_token_index, config.image_token_index} | (
      {123, 124, 125} if config.model_type == "llama4" else set())
  rng = np.random.default_rng(seed)
  text_ids = np.array([t for t in range(VOCAB) if t not in special])
  rows = []
  for _ in range(BATCH):
    text = list(rng.choice(text_ids, size=length))
    places = sorted(rng.choice(np.arange(1, length), size=num_images, replace=False), reverse=True)
    for place, run in zip(places, reversed(runs)):  # the last place takes the last image
      text[place:place] = run
    rows.append(text)
  pixels = rng.uniform(-1, 1, size=(BATCH, views, 3, size, size)).astype(np.float32)
  return np.asarray(rows), pixels


def hf_multimodal_logits(model: Any, token_ids: np.ndarray, pixels: np.ndarray | None) -> np.ndarray:
  """HF's logits as its processor's inputs drive it (Gemma 3: token_type_ids mark the image tokens)."""
  if model.config.model_type == "llama4":
    return llama4_logits(model, token_ids, pixels)
  inputs = {"input_ids": torch.tensor(token_ids)}
  if model.config.model_type == "gemma3":
    inputs["token_type_ids"] = torch.tensor(token_ids == model.config.image_token_index, dtype=torch.long)
  if pixels is not None:
    inputs["pixel_values"] = torch.tensor(pixels.reshape((-1,) + pixels.shape[2:]))
  with torch.no_grad():
    return model(**inputs).logits.float().numpy()


def llama4_logits(model: Any, token_ids: np.ndarray, pixels: np.ndarray | None) -> np.ndarray:
  """Llama4ForConditionalGeneration.forward's steps, on its own modules: transformers 5.24's forward
  fails building its output record (MoeCausalLMOutputWithPast has no image_outputs)."""
  from MaxText.families.llama4_images import hf_image_text_logits
  return hf_image_text_logits(model, token_ids, None if pixels is None else pixels.reshape((-1,) + pixels.shape[2:]))


def hf_soft_tokens(model: Any, pixels_ICRR: np.ndarray) -> np.ndarray:
  """HF's soft tokens [I, T, D] of images (Llama 4: of tiles), before they are placed."""
  with torch.no_grad():
    features = model.get_image_features(torch.tensor(pixels_ICRR), return_dict=True)
    if model.config.model_type == "llama4":
      return model.multi_modal_projector(features.last_hidden_state).numpy()
    return features.pooler_output.numpy()


def our_multimodal_logits(config: Config, params: Any, token_ids: np.ndarray, pixels: np.ndarray | None) -> np.ndarray:
  spec = models.build_model_spec(config.model)
  positions = np.broadcast_to(np.arange(token_ids.shape[1]), token_ids.shape)
  apply = jax.jit(sharding.unsharded()(spec.apply))
  return np.asarray(apply(params, jnp.asarray(token_ids), jnp.asarray(positions), jnp.ones(token_ids.shape, jnp.int32),
                          None, None if pixels is None else jnp.asarray(pixels)))


def hf_generate(model: Any, prompt: list[int], pixels_MCRR: np.ndarray, num_new: int) -> list[int]:
  """HF's greedy `generate` on one prompt with its images' views [M, 3, R, R] (Gemma 3: with the
  token_type_ids its processor gives). Llama 4: transformers 5.24's forward fails building its
  output record from the language model's (which has no image_outputs), so a forward hook gives
  the language model's output that field; generate, its cache and its image placing run as they are."""
  ids = torch.tensor([prompt])
  extra: dict[str, Any] = {}
  hooks = []
  if model.config.model_type == "gemma3":
    extra["token_type_ids"] = (ids == model.config.image_token_index).long()
  if model.config.model_type == "llama4":
    from transformers.models.llama4 import modeling_llama4

    def with_image_outputs(module: Any, args: Any, output: Any) -> Any:
      return modeling_llama4.Llama4CausalLMOutputWithPast(**dict(output), image_outputs=None)

    hooks.append(model.language_model.register_forward_hook(with_image_outputs))
  try:
    with torch.no_grad():
      out = model.generate(ids, pixel_values=torch.tensor(pixels_MCRR), max_new_tokens=num_new,
                           min_new_tokens=num_new, do_sample=False, pad_token_id=0, eos_token_id=None, **extra)
  finally:
    for hook in hooks:
      hook.remove()
  return out[0, len(prompt):].tolist()
