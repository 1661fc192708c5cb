"""Gemma 3's image format: its image processor on the host (Pillow and numpy) and the prompt run of
one image (the family record's `image_format`, families/image_format.py).

`pixel_values(image, options)` gives what HF's Gemma 3 image processor gives (its Pillow backend,
`Gemma3ImageProcessorPil`): the image made RGB (transparency composited onto white), optionally
cut into pan-and-scan crops, each resized to `image_size` x `image_size` with Pillow's bilinear
filter, rescaled by 1/255 and normalised per channel, channels first: float32 [N, 3, S, S]
(N = 1, or 1 + the crops with image_pan_and_scan). Input pipeline workers call it: nothing here
runs on the accelerator. `vision_tower.image_embeddings` turns the result into soft tokens.

The marker <start_of_image> becomes begin-of-image, mm_tokens_per_image placeholders,
end-of-image for each view, in Gemma3Processor's words.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Sequence

import numpy as np
from PIL import Image

from MaxText.configuration.vision_config import VisionConfig
from MaxText.families.image_format import ImageFormat, PreparedImage, to_rgb, token


@dataclasses.dataclass(frozen=True)
class ImageOptions:
  """How an image becomes pixel values (Gemma 3's processor defaults; image_size is the tower's)."""
  image_size: int
  mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
  std: tuple[float, float, float] = (0.5, 0.5, 0.5)
  rescale: float = 1 / 255
  pan_and_scan: bool = False
  pan_and_scan_min_crop_size: int = 256
  pan_and_scan_max_num_crops: int = 4
  pan_and_scan_min_ratio_to_activate: float = 1.2


def pan_and_scan_crops(rgb_HWC: np.ndarray, options: ImageOptions) -> list[np.ndarray]:
  """Gemma 3's pan and scan: an image whose long side is at least min_ratio_to_activate times
  its short side is cut along the long side into 2 .. max_num_crops equal crops (about as many
  as the aspect ratio, each side at least min_crop_size); none otherwise. The last crop may be
  narrower (the crop width is rounded up)."""
  height, width = rgb_HWC.shape[:2]
  long_side, short_side = max(width, height), min(width, height)
  if long_side / short_side < options.pan_and_scan_min_ratio_to_activate:
    return []
  count = min(int(math.floor(long_side / short_side + 0.5)),
              int(math.floor(long_side / options.pan_and_scan_min_crop_size)))
  count = min(options.pan_and_scan_max_num_crops, max(2, count))
  crops_w, crops_h = (count, 1) if width >= height else (1, count)
  crop_w, crop_h = int(math.ceil(width / crops_w)), int(math.ceil(height / crops_h))
  if min(crop_w, crop_h) < options.pan_and_scan_min_crop_size:
    return []
  return [rgb_HWC[top:top + crop_h, left:left + crop_w]
          for top, left in itertools.product(range(0, crop_h * crops_h, crop_h), range(0, crop_w * crops_w, crop_w))]


def _normalised(rgb_HWC: np.ndarray, options: ImageOptions) -> np.ndarray:
  """One view: resized, rescaled (in float64, then float32, as HF rounds), normalised; [3, S, S]."""
  size = options.image_size
  resized = Image.fromarray(rgb_HWC).resize((size, size), Image.Resampling.BILINEAR)
  scaled = (np.asarray(resized).astype(np.float64) * options.rescale).astype(np.float32)
  mean, std = np.asarray(options.mean, np.float32), np.asarray(options.std, np.float32)
  return ((scaled - mean) / std).transpose(2, 0, 1)


def pixel_values(image: Image.Image, options: ImageOptions) -> np.ndarray:
  """float32 [N, 3, S, S]: the whole image, then its pan-and-scan crops when enabled."""
  rgb = to_rgb(image)
  views = [rgb] + (pan_and_scan_crops(rgb, options) if options.pan_and_scan else [])
  return np.stack([_normalised(view, options) for view in views])


def batch_pixel_values(images: Sequence[Image.Image], options: ImageOptions) -> np.ndarray:
  """float32 [sum of N, 3, S, S] for several images in order (HF's `pixel_values` of a prompt)."""
  return np.concatenate([pixel_values(image, options) for image in images])


def marker(tokenizer: Any, vision: VisionConfig) -> str:
  return token(tokenizer, vision.boi_token_id, "boi_token_id")


def options_of(vision: VisionConfig) -> ImageOptions:
  return ImageOptions(image_size=vision.vision_image_size, pan_and_scan=vision.image_pan_and_scan,
                      pan_and_scan_min_crop_size=vision.image_pan_and_scan_min_crop_size,
                      pan_and_scan_max_num_crops=vision.image_pan_and_scan_max_num_crops,
                      pan_and_scan_min_ratio_to_activate=vision.image_pan_and_scan_min_ratio)


def prepare(image: Image.Image, vision: VisionConfig) -> PreparedImage:
  return PreparedImage(pixel_values(image, options_of(vision)))


def run_ids(vision: VisionConfig, image: PreparedImage, vocab_size: int) -> list[int]:
  """Each view's begin-of-image, mm_tokens_per_image placeholders, end-of-image."""
  del vocab_size  # every token is the config's own
  return ([vision.boi_token_id] + [vision.image_token_id] * vision.mm_tokens_per_image
          + [vision.eoi_token_id]) * image.num_views


def text(tokenizer: Any, vision: VisionConfig, image: PreparedImage) -> str:
  """Blank lines around begin-of-image, mm_tokens_per_image placeholders, end-of-image; with
  pan-and-scan crops the original image and then each crop, as Gemma3Processor writes them."""
  one = (f"\n\n{marker(tokenizer, vision)}"
         f"{token(tokenizer, vision.image_token_id, 'image_token_id') * vision.mm_tokens_per_image}"
         f"{token(tokenizer, vision.eoi_token_id, 'eoi_token_id')}\n\n")
  crops = image.num_views - 1
  if not crops:
    return one
  return f"Here is the original image {one} and here are some crops to help you see better " + " ".join([one] * crops)


IMAGE_FORMAT = ImageFormat(marker, prepare, text, run_ids,
                           views="image views (each image, and each of its pan-and-scan crops)",
                           views_key="image_pan_and_scan_max_num_crops", name="Gemma 3",
                           option_keys=("image_pan_and_scan", "image_pan_and_scan_min_crop_size",
                                        "image_pan_and_scan_max_num_crops", "image_pan_and_scan_min_ratio"))
