"""Llama 4's image format: its image pre-processing and prompt expansion, on the host (Pillow and
numpy), the family record's `image_format` (families/image_format.py).

`tiles(image, options)` gives what HF's `Llama4ImageProcessor` gives: the image resized, without
distortion, to fit the best grid of `tile_size` tiles for its aspect ratio (at most `max_tiles`),
padded with black on the right and bottom to fill the grid, cut into tiles row by row, and, when
there is more than one tile, a global thumbnail (the whole image squashed to one tile) last;
rescaled and normalised in bfloat16 as HF does, returned as float32 [N, 3, S, S] with the
grid (rows, columns). `expand_image` is the token run Llama4Processor writes for one `<|image|>`
of that grid; the model (its vision tower) takes each tile as one "image" of
mm_tokens_per_image soft tokens, placed over the run's patch tokens in order.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from typing import Any

import ml_dtypes
import numpy as np
from PIL import Image

from MaxText.configuration.vision_config import VisionConfig
from MaxText.errors import UserError
from MaxText.families.image_format import ImageFormat, PreparedImage, named_token, to_rgb, token


@dataclasses.dataclass(frozen=True)
class TileOptions:
  """HF Llama4ImageProcessor's defaults (tile_size: the tower's vision_image_size)."""
  tile_size: int = 336
  max_tiles: int = 16  # HF's max_patches
  mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
  std: tuple[float, float, float] = (0.5, 0.5, 0.5)
  rescale: float = 1 / 255


@dataclasses.dataclass(frozen=True)
class ImageTokens:
  """The special tokens of Llama 4's image runs; the defaults are the published tokenizer's ids."""
  start: int = 200080  # <|image_start|>
  end: int = 200081  # <|image_end|>
  patch: int = 200092  # <|patch|>: the placeholder each soft token replaces (image_token_id)
  tile_x_separator: int = 200084  # <|tile_x_separator|>
  tile_y_separator: int = 200085  # <|tile_y_separator|>
  image: int = 200090  # <|image|>, before the global thumbnail's patches


def image_tokens(start: int, end: int, patch: int, vocab_size: int) -> ImageTokens:
  """A model's image tokens (its boi, eoi and image_token_id); the separators and <|image|> keep the
  published ids, or, past a smaller (test) vocabulary, take `start`'s: both models see the same text."""
  published = ImageTokens()
  def own(token: int) -> int:
    return token if token < vocab_size else start
  return ImageTokens(start=start, end=end, patch=patch, tile_x_separator=own(published.tile_x_separator),
                     tile_y_separator=own(published.tile_y_separator), image=own(published.image))


@functools.lru_cache(maxsize=8)
def supported_grids(max_tiles: int) -> tuple[tuple[int, int], ...]:
  """Every (rows, columns) grid of at most max_tiles tiles, in HF's order (grouped by aspect ratio
  in first-seen order, going down from max_tiles tiles; the order breaks ties below)."""
  by_ratio: dict[float, list[tuple[int, int]]] = {}
  for count in range(max_tiles, 0, -1):
    for rows in sorted(f for f in range(1, count + 1) if count % f == 0):
      by_ratio.setdefault(rows / (count // rows), []).append((rows, count // rows))
  return tuple(grid for grids in by_ratio.values() for grid in grids)


def best_grid(height: int, width: int, options: TileOptions) -> tuple[int, int]:
  """The grid HF picks: the smallest upscale (float32, as HF computes it) that fits a grid without
  distortion, else the least downscale; among equal scales the fewest tiles."""
  grids = supported_grids(options.max_tiles)
  size = np.float32(options.tile_size)
  scales = [min(size * np.float32(cols) / np.float32(width), size * np.float32(rows) / np.float32(height))
            for rows, cols in grids]
  ups = [s for s in scales if s >= 1]
  chosen = min(ups) if ups else max(scales)
  candidates = [grid for grid, s in zip(grids, scales) if s == chosen]
  return min(candidates, key=lambda grid: grid[0] * grid[1])  # the first smallest, as argmin


def _fit(height: int, width: int, grid: tuple[int, int], options: TileOptions) -> tuple[int, int]:
  """The (height, width) the image is resized to inside the grid: never upscaled past one tile's
  side unless smaller than it, aspect ratio kept (rounded down)."""
  size = options.tile_size
  target_h, target_w = min(max(height, size), grid[0] * size), min(max(width, size), grid[1] * size)
  scale_w, scale_h = target_w / width, target_h / height
  if scale_w < scale_h:
    new_h, new_w = min(math.floor(height * scale_w), target_h), target_w
  else:
    new_h, new_w = target_h, min(math.floor(width * scale_h), target_w)
  return max(new_h, 1), max(new_w, 1)


def _normalised(rgb_HWC: np.ndarray, options: TileOptions) -> np.ndarray:
  """uint8 [H, W, 3] -> float32 [3, H, W], rescaled and normalised op by op in bfloat16 as HF does."""
  bf16 = ml_dtypes.bfloat16
  x = rgb_HWC.transpose(2, 0, 1).astype(np.float32)
  x = (x * np.float32(options.rescale)).astype(bf16).astype(np.float32)
  mean = np.asarray(options.mean, bf16).astype(np.float32)[:, None, None]
  std = np.asarray(options.std, bf16).astype(np.float32)[:, None, None]
  x = (x - mean).astype(bf16).astype(np.float32)
  return (x / std).astype(bf16).astype(np.float32)


def tiles(image: Image.Image, options: TileOptions) -> tuple[np.ndarray, tuple[int, int]]:
  """(float32 [N, 3, S, S], (rows, columns)): the grid's tiles row by row, then the global
  thumbnail when rows x columns > 1 (N = rows x columns + 1; else N = 1)."""
  rgb = to_rgb(image)
  height, width = rgb.shape[:2]
  rows, cols = best_grid(height, width, options)
  new_h, new_w = _fit(height, width, (rows, cols), options)
  size = options.tile_size
  canvas = np.zeros((rows * size, cols * size, 3), np.uint8)
  canvas[:new_h, :new_w] = np.asarray(Image.fromarray(rgb).resize((new_w, new_h), Image.Resampling.BILINEAR))
  grid = _normalised(canvas, options).reshape(3, rows, size, cols, size).transpose(1, 3, 0, 2, 4)
  out = grid.reshape(rows * cols, 3, size, size)
  if rows * cols > 1:
    thumbnail = np.asarray(Image.fromarray(rgb).resize((size, size), Image.Resampling.BILINEAR))
    out = np.concatenate([out, _normalised(thumbnail, options)[None]])
  return out, (rows, cols)


def expand_image(grid: tuple[int, int], tokens_per_tile: int, ids: ImageTokens = ImageTokens()) -> list[int]:
  """The tokens in place of one <|image|> (Llama4Processor): image start; with more than one
  tile, each tile's patch tokens, a x-separator between tiles of a row and a y-separator after
  each row; then <|image|> and the global view's patch tokens (the only view of a one-tile
  image); image end. The patch tokens come in the order of `tiles`' output."""
  rows, cols = grid
  out = [ids.start]
  if rows * cols > 1:
    for _ in range(rows):
      for col in range(cols):
        out += [ids.patch] * tokens_per_tile + ([ids.tile_x_separator] if col < cols - 1 else [])
      out.append(ids.tile_y_separator)
  return out + [ids.image] + [ids.patch] * tokens_per_tile + [ids.end]


def num_views(grid: tuple[int, int]) -> int:
  """How many tiles (soft-token groups) an image of this grid gives: its tiles and, if several, the thumbnail."""
  return grid[0] * grid[1] + (1 if grid[0] * grid[1] > 1 else 0)


# ---- the family's image format: the marker <|image|> becomes Llama4Processor's run for the image's
# grid, mm_tokens_per_image placeholders per tile between tile separators.

MARKER = "<|image|>"
SEPARATORS = ("<|tile_x_separator|>", "<|tile_y_separator|>")


def marker(tokenizer: Any, vision: VisionConfig) -> str:
  return named_token(tokenizer, MARKER, "Llama 4")


def prepare(image: Image.Image, vision: VisionConfig) -> PreparedImage:
  pixels, grid = tiles(image, TileOptions(tile_size=vision.vision_image_size, max_tiles=vision.image_max_tiles))
  return PreparedImage(pixels, grid)


def _grid(image: PreparedImage) -> tuple[int, int]:
  if image.grid is None or num_views(image.grid) != image.num_views:
    raise UserError(f"a Llama 4 image needs its tile grid and one view per tile (and thumbnail), got grid "
                    f"{image.grid} for {image.num_views} view(s)")
  return image.grid


def run_ids(vision: VisionConfig, image: PreparedImage, vocab_size: int) -> list[int]:
  """`expand_image`'s run with the model's image tokens (`image_tokens`)."""
  ids = image_tokens(vision.boi_token_id, vision.eoi_token_id, vision.image_token_id, vocab_size)
  return expand_image(_grid(image), vision.mm_tokens_per_image, ids)


def text(tokenizer: Any, vision: VisionConfig, image: PreparedImage) -> str:
  """Llama4Processor's run for the image's grid (expand_image), as token text."""
  grid = _grid(image)
  x_separator, y_separator = (named_token(tokenizer, t, "Llama 4") for t in SEPARATORS)
  by_id = {vision.boi_token_id: token(tokenizer, vision.boi_token_id, "boi_token_id"),
           vision.eoi_token_id: token(tokenizer, vision.eoi_token_id, "eoi_token_id"),
           vision.image_token_id: token(tokenizer, vision.image_token_id, "image_token_id")}
  # expand_image numbers the tokens; here they are named, so give it stand-in ids for the named ones.
  named = {-1: x_separator, -2: y_separator, -3: marker(tokenizer, vision)}
  ids = ImageTokens(start=vision.boi_token_id, end=vision.eoi_token_id, patch=vision.image_token_id,
                    tile_x_separator=-1, tile_y_separator=-2, image=-3)
  return "".join({**by_id, **named}[i] for i in expand_image(grid, vision.mm_tokens_per_image, ids))


IMAGE_FORMAT = ImageFormat(marker, prepare, text, run_ids,
                           views="tiles (each image's tiles, and its global thumbnail when it has several)",
                           views_key="image_max_tiles", name="Llama 4", option_keys=("image_max_tiles",))


def hf_image_text_logits(model: Any, token_ids: np.ndarray, pixels_ICRR: np.ndarray | None) -> np.ndarray:
  """Llama4ForConditionalGeneration's logits, its forward's steps run on its own modules (embed,
  vision model, projector, placing over the image_token_index placeholders, language model):
  transformers 5.24's forward itself fails building its output record. For the logit checker."""
  import torch
  ids = torch.tensor(token_ids)
  with torch.no_grad():
    embeds = model.get_input_embeddings()(ids)
    if pixels_ICRR is not None:
      pixels = torch.tensor(pixels_ICRR, dtype=embeds.dtype)
      features = model.get_image_features(pixel_values=pixels, return_dict=True).last_hidden_state
      soft = model.multi_modal_projector(features.reshape(-1, features.shape[-1])).to(embeds.dtype)
      placeholders = (ids == model.config.image_token_index)[..., None].expand_as(embeds)
      embeds = embeds.masked_scatter(placeholders, soft)
    return model.language_model(inputs_embeds=embeds).logits.float().numpy()
