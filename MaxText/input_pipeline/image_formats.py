"""Each vision family's image format: how one image becomes the views its tower encodes, and the
text that replaces its chat template's image marker given those views. Fine-tuning (image_sft.py),
decode.py and the server (inference/image_chat.py) all go through `image_format(decoder_block)`,
so an image is cut, and its prompt expanded, the same way everywhere.

  Gemma 3   one view of vision_image_size², plus pan-and-scan crops with image_pan_and_scan
            (images.py); the marker <start_of_image> becomes begin-of-image, mm_tokens_per_image
            placeholders, end-of-image for each view, in Gemma3Processor's words.
  Llama 4   the best grid of at most image_max_tiles tiles and, past one tile, a global thumbnail
            (llama4_images.py); the marker <|image|> becomes Llama4Processor's run for that grid:
            mm_tokens_per_image placeholders per tile between tile separators.

Either way every view is one run of mm_tokens_per_image `image_token_id` placeholders, in the
order of the views, and one slot of pixel_values (what max_images_per_row counts).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
from PIL import Image

from MaxText.configuration.vision_config import VisionConfig
from MaxText.errors import UserError
from MaxText.input_pipeline import images, llama4_images


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedImage:
  """One image as its family's tower takes it."""
  pixels: np.ndarray  # float32 [N, 3, R, R]: its views, in the order of their placeholder runs
  grid: tuple[int, int] | None = None  # Llama 4: the tile grid (rows, columns); None for Gemma 3

  @property
  def num_views(self) -> int:
    return len(self.pixels)


@dataclasses.dataclass(frozen=True)
class ImageFormat:
  marker: Callable[[Any, VisionConfig], str]  # (tokenizer, vision) -> the template's text for one image
  prepare: Callable[[Image.Image, VisionConfig], PreparedImage]
  text: Callable[[Any, VisionConfig, PreparedImage], str]  # the run that replaces one marker
  views: str  # what one pixel_values slot holds, for error lines and docs


def token(tokenizer: Any, token_id: int, name: str) -> str:
  text = tokenizer.convert_ids_to_tokens(token_id)
  if not isinstance(text, str):
    raise UserError(f"the tokenizer has no token for {name} {token_id}; use the model's own tokenizer")
  return text


def _named_token(tokenizer: Any, text: str) -> str:
  """A special token the model's config does not number (Llama 4's separators): the tokenizer's own."""
  if text not in tokenizer.get_vocab():
    raise UserError(f"the tokenizer has no {text} token, which Llama 4's image prompts need; use the model's own "
                    "tokenizer")
  return text


# ---- Gemma 3

def gemma3_marker(tokenizer: Any, vision: VisionConfig) -> str:
  return token(tokenizer, vision.boi_token_id, "boi_token_id")


def gemma3_options(vision: VisionConfig) -> images.ImageOptions:
  return images.ImageOptions(image_size=vision.vision_image_size, pan_and_scan=vision.image_pan_and_scan,
                             pan_and_scan_min_crop_size=vision.image_pan_and_scan_min_crop_size,
                             pan_and_scan_max_num_crops=vision.image_pan_and_scan_max_num_crops,
                             pan_and_scan_min_ratio_to_activate=vision.image_pan_and_scan_min_ratio)


def gemma3_prepare(image: Image.Image, vision: VisionConfig) -> PreparedImage:
  return PreparedImage(images.pixel_values(image, gemma3_options(vision)))


def gemma3_text(tokenizer: Any, vision: VisionConfig, image: PreparedImage) -> str:
  """Blank lines around begin-of-image, mm_tokens_per_image placeholders, end-of-image; with
  pan-and-scan crops the original image and then each crop, as Gemma3Processor writes them."""
  one = (f"\n\n{gemma3_marker(tokenizer, vision)}"
         f"{token(tokenizer, vision.image_token_id, 'image_token_id') * vision.mm_tokens_per_image}"
         f"{token(tokenizer, vision.eoi_token_id, 'eoi_token_id')}\n\n")
  crops = image.num_views - 1
  if not crops:
    return one
  return f"Here is the original image {one} and here are some crops to help you see better " + " ".join([one] * crops)


# ---- Llama 4

LLAMA4_MARKER = "<|image|>"
LLAMA4_SEPARATORS = ("<|tile_x_separator|>", "<|tile_y_separator|>")


def llama4_marker(tokenizer: Any, vision: VisionConfig) -> str:
  return _named_token(tokenizer, LLAMA4_MARKER)


def llama4_prepare(image: Image.Image, vision: VisionConfig) -> PreparedImage:
  options = llama4_images.TileOptions(tile_size=vision.vision_image_size, max_tiles=vision.image_max_tiles)
  pixels, grid = llama4_images.tiles(image, options)
  return PreparedImage(pixels, grid)


def llama4_text(tokenizer: Any, vision: VisionConfig, image: PreparedImage) -> str:
  """Llama4Processor's run for the image's grid (llama4_images.expand_image), as token text."""
  if image.grid is None or llama4_images.num_views(image.grid) != image.num_views:
    raise UserError(f"a Llama 4 image needs its tile grid and one view per tile (and thumbnail), got grid "
                    f"{image.grid} for {image.num_views} view(s)")
  x_separator, y_separator = (_named_token(tokenizer, t) for t in LLAMA4_SEPARATORS)
  by_id = {vision.boi_token_id: token(tokenizer, vision.boi_token_id, "boi_token_id"),
           vision.eoi_token_id: token(tokenizer, vision.eoi_token_id, "eoi_token_id"),
           vision.image_token_id: token(tokenizer, vision.image_token_id, "image_token_id")}
  # expand_image numbers the tokens; here they are named, so give it stand-in ids for the named ones.
  named = {-1: x_separator, -2: y_separator, -3: llama4_marker(tokenizer, vision)}
  ids = llama4_images.ImageTokens(start=vision.boi_token_id, end=vision.eoi_token_id, patch=vision.image_token_id,
                                  tile_x_separator=-1, tile_y_separator=-2, image=-3)
  return "".join({**by_id, **named}[i] for i in llama4_images.expand_image(image.grid, vision.mm_tokens_per_image, ids))


IMAGE_FORMATS: dict[str, ImageFormat] = {
    "gemma3": ImageFormat(gemma3_marker, gemma3_prepare, gemma3_text,
                          views="image views (each image, and each of its pan-and-scan crops)"),
    "llama4": ImageFormat(llama4_marker, llama4_prepare, llama4_text,
                          views="tiles (each image's tiles, and its global thumbnail when it has several)"),
}


def image_format(decoder_block: str) -> ImageFormat:
  if decoder_block not in IMAGE_FORMATS:
    raise UserError(f"decoder_block {decoder_block!r} has no image prompt format; images need one of "
                    f"{', '.join(IMAGE_FORMATS)}")
  return IMAGE_FORMATS[decoder_block]
