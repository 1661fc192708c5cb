"""Prompts with images for the decode engine: a prompt's pixel values beside its tokens.

Shape legend: M views of one prompt's images (an image, each pan-and-scan crop, each Llama 4 tile
or thumbnail counts as one; the family's image format, families/image_format.py), R view side.

A vision-language prompt holds one run of `image_token_id` placeholders per view
(mm_tokens_per_image long, written by input_pipeline/image_text.py), the views' pixel values in
the same order. Prefill runs them through the vision tower; Gemma 3's tokens of one view attend
to each other both ways, so the engine never splits a view's run between two prefill calls (a
Llama 4 image's tiles may fall in different calls: its text stack is causal over them):
- chunked prefill ends a chunk before a run that would not fit in it (`chunk_end`), which needs
  prefill_chunk_size >= mm_tokens_per_image (checked when the engine is built);
- a cached prefix (prefix caching) is cut back to the page where a run it would split begins
  (`whole_runs_start`).
Every placeholder has the same id, so prefix caching keys each page that holds an image's tokens
by the image's content as well (`page_salts`): two prompts with the same text and different
images share no page from the first image on.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

import numpy as np

from MaxText.configuration.vision_config import VisionConfig
from MaxText.errors import UserError

Run = tuple[int, int]  # [start, end) of one image's placeholder tokens in the prompt


@dataclasses.dataclass(frozen=True, eq=False)
class PromptImages:
  """One prompt's images, in prompt order."""

  pixels_MCRR: np.ndarray  # float32 [M, 3, R, R] (Family.image_format's views)
  digests: tuple[bytes, ...]  # sha256 of each image's pixel values

  @classmethod
  def of(cls, pixels_MCRR: np.ndarray) -> "PromptImages":
    pixels = np.ascontiguousarray(pixels_MCRR, np.float32)
    if pixels.ndim != 4 or pixels.shape[1] != 3 or not len(pixels):
      raise UserError(f"a prompt's images must be pixel values [M, 3, R, R] with M >= 1, got {pixels.shape}")
    return cls(pixels, tuple(hashlib.sha256(image.tobytes()).digest() for image in pixels))

  def __len__(self) -> int:
    return len(self.pixels_MCRR)


def image_runs(prompt: Sequence[int], vision: VisionConfig, images: PromptImages | None) -> list[Run]:
  """The placeholder runs of `prompt`, checked against its images: one run of
  mm_tokens_per_image placeholders per image, of the size the vision tower takes."""
  if not vision.use_multimodal:
    if images is not None:
      raise UserError("images given to a text-only model (use_multimodal=False)")
    return []
  is_image = np.asarray(prompt) == vision.image_token_id
  edges = np.flatnonzero(np.diff(np.concatenate([[0], is_image.astype(np.int8), [0]])))
  runs = [(int(s), int(e)) for s, e in zip(edges[::2], edges[1::2])]
  count = 0 if images is None else len(images)
  if len(runs) != count:
    raise UserError(f"the prompt has {len(runs)} image placeholder run(s) but {count} image(s) were given")
  if any(e - s != vision.mm_tokens_per_image for s, e in runs):
    raise UserError(f"each image's run of placeholders must have mm_tokens_per_image={vision.mm_tokens_per_image} "
                    f"tokens, got {[e - s for s, e in runs]}")
  if images is not None and images.pixels_MCRR.shape[2:] != (vision.vision_image_size,) * 2:
    raise UserError(f"images of {images.pixels_MCRR.shape[2:]} pixels; the vision tower takes "
                    f"vision_image_size={vision.vision_image_size}")
  return runs


def pixel_batch(rows: Sequence[PromptImages | None], count: int = 0) -> np.ndarray | None:
  """The rows' images as one [B, M, 3, R, R] array, each row zero-padded to M = the most images of
  a row (at least `count`); None when no row has any."""
  given = [r for r in rows if r is not None and len(r)]
  if not given:
    return None
  most = max(count, max(len(r) for r in given))
  out = np.zeros((len(rows), most) + given[0].pixels_MCRR.shape[1:], np.float32)
  for i, row in enumerate(rows):
    if row is not None:
      out[i, :len(row)] = row.pixels_MCRR
  return out


def chunk_end(start: int, end: int, runs: Sequence[Run]) -> int:
  """Where a prefill call over prompt[start:end] must end so that no image run is split: before
  a run that starts inside it and ends past it."""
  for run_start, run_end in runs:
    if start < run_start < end < run_end:
      return run_start
  return end


def images_within(images: PromptImages | None, runs: Sequence[Run], start: int, end: int) -> np.ndarray | None:
  """[1, M', 3, R, R]: the images whose runs lie in prompt[start:end], their count padded to a
  power of two (a few compiled programs, not one per count); None when there are none."""
  inside = [i for i, (s, e) in enumerate(runs) if start <= s and e <= end]
  if images is None or not inside:
    return None
  return pixel_batch([PromptImages(images.pixels_MCRR[inside], ())], 1 << (len(inside) - 1).bit_length())


def page_salts(runs: Sequence[Run], images: PromptImages | None, page_size: int) -> dict[int, bytes]:
  """Page index -> the digests of the images whose tokens it holds, for the prefix chain hash."""
  salts: dict[int, bytes] = {}
  if images is None:
    return salts
  for (start, end), digest in zip(runs, images.digests):
    for page in range(start // page_size, (end - 1) // page_size + 1):
      salts[page] = salts.get(page, b"") + digest
  return salts


def whole_runs_start(cached: int, runs: Sequence[Run], page_size: int) -> int:
  """The longest cached prefix (a multiple of page_size, at most `cached`) that splits no run:
  the rest of the prompt is prefilled in one call, which must hold each of its images whole."""
  for start, end in reversed(runs):  # a cut may move back into an earlier run's page
    if start < cached < end:
      cached = start // page_size * page_size
  return cached
