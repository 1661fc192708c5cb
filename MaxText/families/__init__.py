"""Model families, each in its own module of this package, found by listing the package.

A family module (llama.py, gemma.py, gpt3.py, mixtral.py, ...) describes itself with one or
more `Family` records and calls `register_family(...)` at import:
  * which HF `model_type`s it reads and which `decoder_block`s (configs/models/*.yml) it writes,
  * its model parts: `layer`, the decoder-layer class it runs (none: layers/decoders.DecoderLayer);
    `vision`, its image side with use_multimodal (a `VisionTower`, with the checks of its own vision
    keys); `per_layer_inputs`, a module giving each layer its own input (gemma4_layers.PerLayerInputs);
    a layer class with `per_layer_shapes = True` reads the per-layer-shape keys; a family's own layer
    code lives beside it in this package (gemma4_layers.py, llama4_vision.py),
  * `model_keys(hf_config)`: HF config.json → our base.yml model keys,
  * `hf_config(cfg)`: our ModelConfig → HF config.json,
  * `tensors(cfg)`: its HF ↔ ours tensor table (families/tensor_maps.py),
  * `reference_hf_configs`: tiny HF configs with the family's distinctive features on; the
    tests check our logits and conversions against HF `transformers` on each of them
    (`multimodal_reference_hf_configs`: its image-text model, checked with images),
  * `image_format`: with a vision tower, how an image becomes its views and its prompt's tokens
    (image_format.py; gemma3_images.py, llama4_images.py), for fine-tuning, decode, the server and
    the logit checker alike, and the image keys only it reads; `hf_image_text_logits`: HF's logits
    of an image-text model_type whose own forward the logit checker cannot call.
To add a family, text or vision: a module here (with its own layer or vision modules if no shared
one computes them) plus its configs/models/*.yml. The model (MaxText/models/), the config checks
(configuration/model_checks.families), the converters, the logit checker and the tests find it
here; nothing outside this package names a family.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import TYPE_CHECKING, Any, Callable, Mapping

from MaxText.errors import ConfigError

if TYPE_CHECKING:
  from MaxText.families.tensor_maps import TensorMap
  from MaxText.configuration.model_config import ModelConfig
  from MaxText.families.image_format import ImageFormat
  from MaxText.layers.vision_tower import ViewFlops
  import numpy as np


@dataclasses.dataclass(frozen=True)
class VisionTower:
  """A family's image side: its encoder and projector, each built as `(cfg, rngs=)`, the projector's
  output soft tokens [images, tokens, emb_dim] that the model places at the image placeholders;
  whether each image's tokens see each other both ways in the text stack; and the checks of the
  vision keys its own shape needs, run by configuration/vision_config.py after the shared ones
  (the key values by name -> raises one ConfigError line); and the forward FLOPs of one view (image, crop
  or tile) through it, for the model FLOPs behind MFU."""
  encoder: Callable[..., Any]
  projector: Callable[..., Any]
  bidirectional_images: bool
  flops_per_view: Callable[["ModelConfig"], "ViewFlops"]
  check_keys: Callable[[Mapping[str, Any]], None] | None = None


@dataclasses.dataclass(frozen=True)
class Family:
  name: str
  hf_model_types: tuple[str, ...]
  decoder_blocks: tuple[str, ...]
  model_keys: Callable[[Mapping[str, Any]], dict[str, Any]]
  hf_config: Callable[["ModelConfig"], dict[str, Any]]
  tensors: Callable[["ModelConfig"], list["TensorMap"]]
  # The decoder layer, built as `layer(cfg, rngs=)` (and `layer_index=` where the class sets
  # per_layer_shapes); None: the shared pre-norm block, layers/decoders.DecoderLayer.
  layer: Callable[..., Any] | None = None
  # name -> HF config fields (model_type included) of a tiny model for the outside-truth tests.
  reference_hf_configs: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
  # The same for its image-text model (use_multimodal), tested with images (tests/layers/test_multimodal_vs_hf.py).
  multimodal_reference_hf_configs: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
  vision: VisionTower | None = None  # None: a text-only family
  # With layer_shapes' per_layer_input_dim: a module `(cfg, rngs=)` mapping (tokens [B, L], input
  # embeddings [B, L, D]) to every layer's own input [B, L, M, P]; layer i gets [:, :, i] as per_layer_input_BLP.
  per_layer_inputs: Callable[..., Any] | None = None
  image_format: "ImageFormat | None" = None  # None: a text-only family
  # HF model_type -> (its transformers model, token ids [B, L], pixel values [I, 3, R, R] or None) -> logits
  hf_image_text_logits: Mapping[str, Callable[[Any, "np.ndarray", "np.ndarray | None"], "np.ndarray"]] = (
      dataclasses.field(default_factory=dict))
  # upstream MaxText's model names (its recipes' model_type) -> this family's configs/models name for them
  upstream_model_names: Mapping[str, str] = dataclasses.field(default_factory=dict)

  @property
  def per_layer_shapes(self) -> bool:
    """Whether its layer reads the per-layer-shape keys (configuration/layer_shapes_config.py): the
    model then builds each unrolled layer with its index."""
    return bool(getattr(self.layer, "per_layer_shapes", False))


_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
  _FAMILIES[family.name] = family
  return family


def families() -> dict[str, Family]:
  """Every family, importing each module of this package once."""
  for module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{module.name}")
  return dict(_FAMILIES)


def family_for_hf_config(hf_config: Mapping[str, Any]) -> Family:
  model_type = hf_config.get("model_type")
  for family in families().values():
    if model_type in family.hf_model_types:
      return family
  known = ", ".join(sorted(t for f in families().values() for t in f.hf_model_types))
  if "text_config" in hf_config:  # LLaVA, ... as image-text models
    text_type = (hf_config.get("text_config") or {}).get("model_type", "its text model")
    raise ConfigError(f"HF model_type {model_type!r} is a multimodal checkpoint (it has a text_config); only "
                      f"text-only models and Gemma 3's, Gemma 4's, Llama 4's and Qwen3.5's are supported "
                      f"({text_type} as a text-only checkpoint would be); supported model types: {known}")
  raise ConfigError(f"HF model_type {model_type!r} has no converter; supported: {known}")


def family_for_decoder_block(decoder_block: str) -> Family:
  for family in families().values():
    if decoder_block in family.decoder_blocks:
      return family
  known = sorted(b for f in families().values() for b in f.decoder_blocks)
  raise ConfigError(f"unknown decoder_block {decoder_block!r}; known: {', '.join(known)}")


def reference_hf_configs() -> dict[str, Mapping[str, Any]]:
  """Every family's tiny reference HF configs, by name."""
  return {name: fields for family in families().values() for name, fields in family.reference_hf_configs.items()}


def multimodal_reference_hf_configs() -> dict[str, Mapping[str, Any]]:
  """Every family's tiny image-text reference HF configs, by name."""
  return {name: fields for family in families().values()
          for name, fields in family.multimodal_reference_hf_configs.items()}
