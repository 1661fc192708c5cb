"""Image pre-processing for the vision-language models, on the host (Pillow and numpy).

`pixel_values(image, options)` gives what HF's Gemma 3 image processor gives (its Pillow backend,
`Gemma3ImageProcessorPil`): the image made RGB (transparency composited onto white), optionally
cut into pan-and-scan crops, each resized to `image_size` x `image_size` with Pillow's bilinear
filter, rescaled by 1/255 and normalised per channel, channels first: float32 [N, 3, S, S]
(N = 1, or 1 + the crops with pan-and-scan). Input pipeline workers call it: nothing here runs
on the accelerator. `vision_tower.image_embeddings` turns the result into soft tokens.

A file or bytes that Pillow cannot decode, or decodes as a format outside SUPPORTED_FORMATS,
is one `UserError` line naming the image. So is one of more pixels than allowed, refused from its
header before any pixel is decoded (a small file can hold a huge image: a bomb).
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import math
import warnings
from typing import Sequence

import numpy as np
from PIL import Image

from MaxText.errors import UserError
from MaxText.paths import storage

# What a user's image may be encoded as: the formats chat clients and datasets send.
SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# Decoding a huge image is where a bad input costs memory: no image of more pixels is decoded.
MAX_IMAGE_PIXELS = 8192 * 8192
# Pillow's own guard at the same limit, for every image this process opens (datasets' decoders too).
Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS


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


def decode(data: bytes, name: str, max_pixels: int = MAX_IMAGE_PIXELS, limit_key: str = "") -> Image.Image:
  """An encoded image (PNG, JPEG, ...) as a loaded Pillow image; `name` says which in errors.
  Its size and format are read from its header and checked before its pixels are decoded: at
  most `max_pixels` (the config key `limit_key` when a tool sets its own) and MAX_IMAGE_PIXELS."""
  limit = f"{limit_key}={max_pixels}" if limit_key and max_pixels < MAX_IMAGE_PIXELS else f"{MAX_IMAGE_PIXELS} pixels"
  with warnings.catch_warnings():
    warnings.simplefilter("error", Image.DecompressionBombWarning)
    try:
      image = Image.open(io.BytesIO(data))  # the header only: no pixel is decoded yet
      if image.format not in SUPPORTED_FORMATS:
        raise UserError(f"image {name}: format {image.format} is not supported; use one of "
                        f"{', '.join(SUPPORTED_FORMATS)}")
      width, height = image.size
      if width * height > min(max_pixels, MAX_IMAGE_PIXELS):
        raise UserError(f"image {name}: {width}x{height} pixels is larger than {limit}; resize it first")
      image.load()
    except (Image.DecompressionBombWarning, Image.DecompressionBombError):  # Pillow's guard, in Image.open
      raise UserError(f"image {name}: larger than {limit}; resize it first") from None
    except (OSError, ValueError, SyntaxError) as e:  # Pillow's ways of saying "not an image I can read"
      raise UserError(f"image {name}: cannot be decoded as an image ({e}); give a PNG, JPEG, WEBP, GIF or BMP "
                      "file") from None
  return image


def load(path: str, max_pixels: int = MAX_IMAGE_PIXELS, limit_key: str = "") -> Image.Image:
  """An image file (a local path or gs:// object) decoded as `decode` does."""
  try:
    data = storage.read_bytes(path)
  except OSError as e:
    raise UserError(f"image {path}: cannot be read ({e.strerror or e})") from None
  return decode(data, path, max_pixels, limit_key)


def to_rgb(image: Image.Image) -> np.ndarray:
  """uint8 [H, W, 3]; an image with transparency (an alpha band or a transparent palette entry)
  is composited onto white first, as HF's processors do."""
  if "A" in image.getbands() or image.info.get("transparency") is not None:
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    image = Image.alpha_composite(white, rgba)
  return np.asarray(image.convert("RGB"))


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
