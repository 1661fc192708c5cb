"""What a vision family's image format is: how one image becomes the views its tower encodes, and
the tokens that replace its chat template's image marker given those views. A family with a vision
tower sets `Family.image_format` (gemma3_images.py, llama4_images.py); fine-tuning, decode.py, the
server (input_pipeline/image_text.py) and the logit checker reach it through the family record, so
an image is cut, and its prompt expanded, the same way everywhere.

Every view is one run of mm_tokens_per_image `image_token_id` placeholders, in the order of the
views, and one slot of pixel_values (what max_images_per_row counts).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
from PIL import Image

from MaxText.configuration.vision_config import VisionConfig
from MaxText.errors import UserError


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedImage:
  """One image as its family's tower takes it."""
  pixels: np.ndarray  # float32 [N, 3, R, R]: its views, in the order of their placeholder runs
  grid: tuple[int, int] | None = None  # a tiling format's tile grid (rows, columns); None for one view per image

  @property
  def num_views(self) -> int:
    return len(self.pixels)


@dataclasses.dataclass(frozen=True)
class ImageFormat:
  marker: Callable[[Any, VisionConfig], str]  # (tokenizer, vision) -> the template's text for one image
  prepare: Callable[[Image.Image, VisionConfig], PreparedImage]
  text: Callable[[Any, VisionConfig, PreparedImage], str]  # the run that replaces one marker
  # (vision, image, vocab_size) -> the run as token ids, where no tokenizer names them (the logit checker)
  run_ids: Callable[[VisionConfig, PreparedImage, int], list[int]]
  views: str  # what one pixel_values slot holds, for error lines and docs
  views_key: str  # the config key that bounds an image's view count, for error lines
  name: str  # the family in prose, for error lines
  # The image keys (configuration/vision_config.IMAGE_OPTION_KEYS) only this format reads: another
  # family's config that switches one on is refused.
  option_keys: tuple[str, ...]


def token(tokenizer: Any, token_id: int, name: str) -> str:
  text = tokenizer.convert_ids_to_tokens(token_id)
  if not isinstance(text, str):
    raise UserError(f"the tokenizer has no token for {name} {token_id}; use the model's own tokenizer")
  return text


def named_token(tokenizer: Any, text: str, family: str) -> str:
  """A special token the model's config does not number: the tokenizer's own."""
  if text not in tokenizer.get_vocab():
    raise UserError(f"the tokenizer has no {text} token, which {family}'s image prompts need; use the model's own "
                    "tokenizer")
  return text


def to_rgb(image: Image.Image) -> np.ndarray:
  """uint8 [H, W, 3]; an image with transparency (an alpha band or a transparent palette entry)
  is composited onto white first, as HF's processors do."""
  if "A" in image.getbands() or image.info.get("transparency") is not None:
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    image = Image.alpha_composite(white, rgba)
  return np.asarray(image.convert("RGB"))
