"""The model's vision record (use_multimodal): the image encoder's shape, how its soft tokens enter
the decoder, and which parts of it train. Every field holds the base.yml key of its name;
ModelConfig nests it as `vision` (layers/vision_tower.py reads it). Checked without I/O.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Mapping

from MaxText.configuration import model_checks
from MaxText.configuration.config_fields import DATA_POSITION, OPTIMIZER, key, read_keys
from MaxText.configuration.config_fields import require as _require
from MaxText.errors import ConfigError

if TYPE_CHECKING:
  from MaxText.families.image_format import ImageFormat

# How an image becomes its tower's views; a family's image format (Family.image_format.option_keys)
# reads its own of them.
IMAGE_OPTION_KEYS = ("image_pan_and_scan", "image_pan_and_scan_min_crop_size", "image_pan_and_scan_max_num_crops",
                     "image_pan_and_scan_min_ratio", "image_max_tiles")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionConfig:
  """The image encoder and projector (use_multimodal=True; ignored otherwise). The
  vision_rope_max_timescale, vision_pixel_shuffle_ratio and vision_adapter_dim keys are Llama 4's only."""
  use_multimodal: bool = key(architecture=True)
  vision_emb_dim: int = key(architecture=True)
  vision_mlp_dim: int = key(architecture=True)
  vision_num_layers: int = key(architecture=True)
  vision_num_heads: int = key(architecture=True)
  vision_patch_size: int = key(architecture=True)
  vision_image_size: int = key(architecture=True)
  vision_layer_norm_epsilon: float = key(architecture=True)
  mm_tokens_per_image: int = key(architecture=True)
  vision_rope_max_timescale: float = key(architecture=True)
  vision_pixel_shuffle_ratio: float = key(architecture=True)
  vision_adapter_dim: int = key(architecture=True)
  image_token_id: int = key(architecture=True)  # the placeholder token each soft token replaces
  boi_token_id: int = key(architecture=True)
  eoi_token_id: int = key(architecture=True)
  # Frozen parts keep no optimizer state: a resume must agree.
  freeze_vision_encoder: bool = key(fixed_on_resume=OPTIMIZER)
  freeze_multimodal_projector: bool = key(fixed_on_resume=OPTIMIZER)
  # How an image becomes the tower's views (the family's image format, families/), the same in SFT,
  # decode and serve: Gemma 3's pan-and-scan crops, Llama 4's tile count. They change a record's
  # tokens, so a data position (pairs into a document) means something else under other values.
  image_pan_and_scan: bool = key(fixed_on_resume=DATA_POSITION)
  image_pan_and_scan_min_crop_size: int = key(fixed_on_resume=DATA_POSITION)
  image_pan_and_scan_max_num_crops: int = key(fixed_on_resume=DATA_POSITION)
  image_pan_and_scan_min_ratio: float = key(fixed_on_resume=DATA_POSITION)
  image_max_tiles: int = key(fixed_on_resume=DATA_POSITION)

  @property
  def patches_per_side(self) -> int:
    return self.vision_image_size // self.vision_patch_size

  @property
  def tokens_per_side(self) -> int:
    return math.isqrt(self.mm_tokens_per_image)

  @property
  def pixel_shuffle_factor(self) -> int:
    """s: Llama 4's adapter merges each s x s block of patches into one token."""
    return int(round(1 / self.vision_pixel_shuffle_ratio))

  @property
  def vision_head_dim(self) -> int:
    return self.vision_emb_dim // self.vision_num_heads

  @classmethod
  def from_values(cls, v: Mapping[str, Any], *, pipelined: bool, context_parallel: bool) -> "VisionConfig":
    values = read_keys(cls, v)
    for name in ("use_multimodal", "freeze_vision_encoder", "freeze_multimodal_projector", "image_pan_and_scan"):
      _require(isinstance(values[name], bool), f"{name} must be True or False, got {values[name]!r}")
    if not values["use_multimodal"]:
      frozen = [name for name in ("freeze_vision_encoder", "freeze_multimodal_projector") if values[name]]
      _require(not frozen, f"{frozen[0] if frozen else ''}=True needs use_multimodal=True (a text-only model has "
               "no vision encoder or projector)")
      return cls(**values)
    # The family's vision tower and image format (families/) check what is theirs alone.
    family = model_checks.family_of(v["decoder_block"])
    tower, image_format = (family.vision, family.image_format) if family else (None, None)
    if tower is None or image_format is None:
      blocks = sorted(b for f in model_checks.families().values() if f.vision and f.image_format
                      for b in f.decoder_blocks)
      raise ConfigError(f"use_multimodal=True is supported for decoder_block {', '.join(blocks)}; "
                        f"got {v['decoder_block']!r}")
    for name in ("vision_emb_dim", "vision_mlp_dim", "vision_num_layers", "vision_num_heads", "vision_patch_size",
                 "vision_image_size", "mm_tokens_per_image", "vision_layer_norm_epsilon"):
      _require(values[name] > 0, f"{name} must be > 0, got {values[name]}")
    _require(values["vision_emb_dim"] % values["vision_num_heads"] == 0,
             f"vision_emb_dim ({values['vision_emb_dim']}) must be a multiple of vision_num_heads "
             f"({values['vision_num_heads']})")
    _require(values["vision_image_size"] % values["vision_patch_size"] == 0,
             f"vision_image_size ({values['vision_image_size']}) must be a multiple of vision_patch_size "
             f"({values['vision_patch_size']})")
    _check_image_options(values, v["decoder_block"], image_format)
    if tower.check_keys is not None:
      tower.check_keys(values)
    ids = {name: values[name] for name in ("image_token_id", "boi_token_id", "eoi_token_id")}
    _require(all(isinstance(i, int) and i >= 0 for i in ids.values()) and len(set(ids.values())) == 3,
             f"image_token_id, boi_token_id and eoi_token_id must be three different token ids >= 0; got {ids}")
    _require(values["boi_token_id"] < v["vocab_size"] and values["eoi_token_id"] < v["vocab_size"],
             f"boi_token_id ({values['boi_token_id']}) and eoi_token_id ({values['eoi_token_id']}) must be below "
             f"vocab_size ({v['vocab_size']})")
    # Image tokens that see the rest of their image (a bidirectional block) need dot_product's mask.
    _require(not tower.bidirectional_images or v["attention"] in ("dot_product", "autoselected"),
             f"use_multimodal=True needs attention=dot_product or autoselected (which picks it): the bidirectional "
             f"mask over each image's tokens is dot_product's; got attention={v['attention']}")
    _require(not pipelined and not context_parallel,
             "use_multimodal=True does not support pipeline or sequence (context) parallelism yet; set "
             "ici/dcn_pipeline_parallelism=1 and ici/dcn_sequence_parallelism=1")
    _require(v["mtp_num_layers"] == 0, "use_multimodal=True does not support multi-token prediction (mtp_num_layers > 0)")
    return cls(**values)


def _check_image_options(values: Mapping[str, Any], decoder_block: str, image_format: ImageFormat) -> None:
  """How images are cut into views: a switch another family's format owns is refused."""
  for name in IMAGE_OPTION_KEYS:
    if values[name] is True and name not in image_format.option_keys:
      owners = [f.image_format.name for f in model_checks.families().values()
                if f.image_format and name in f.image_format.option_keys]
      raise ConfigError(f"{name}=True is {' or '.join(owners) or 'another family'}'s option; decoder_block "
                        f"{decoder_block!r} cuts images its own way ({image_format.name}: "
                        f"{', '.join(image_format.option_keys)})")
  for name in ("image_pan_and_scan_min_crop_size", "image_pan_and_scan_max_num_crops", "image_max_tiles"):
    _require(isinstance(values[name], int) and values[name] >= 1, f"{name} must be a whole number >= 1, got "
             f"{values[name]!r}")
  _require(values["image_pan_and_scan_max_num_crops"] >= 2 or not values["image_pan_and_scan"],
           f"image_pan_and_scan_max_num_crops must be >= 2 (pan-and-scan cuts an image into 2 or more crops), got "
           f"{values['image_pan_and_scan_max_num_crops']}")
  _require(values["image_pan_and_scan_min_ratio"] >= 1, "image_pan_and_scan_min_ratio must be >= 1 (long side / "
           f"short side), got {values['image_pan_and_scan_min_ratio']}")
