"""A conversation with images → prompt ids and pixel values, for decode.py and the server.

The messages go through input_pipeline/image_text.py as fine-tuning reads them (content parts, the
chat template's image marker expanded into each image's soft-token run), and the images through
their family's format (Family.image_format, families/image_format.py: Gemma 3's image and
pan-and-scan crops, Llama 4's tiles) into the views' pixel values the vision tower takes
(inference/image_prompts.py then keeps them beside the prompt). `ImageLimits` bound what one request may bring before any of
it is decoded: the server's serve_max_images, serve_max_image_bytes and serve_max_image_pixels
(an image's width x height, read from its header).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from MaxText.configuration.model_config import ModelConfig
from MaxText.configuration.vision_config import VisionConfig
from MaxText.errors import UserError
from MaxText.inference.image_prompts import PromptImages
from MaxText.families.image_format import ImageFormat, PreparedImage
from MaxText.input_pipeline import image_text
from MaxText.input_pipeline import chat
from MaxText.input_pipeline.chat import ChatTokenizer

BASE64_BYTES_PER_CHAR = 3 / 4


@dataclasses.dataclass(frozen=True)
class ImageLimits:
  max_images: int  # per request
  max_bytes: int  # per image, encoded (a data URL's decoded payload or a file's size)
  max_pixels: int  # per image, width x height


def _read(ref: str, files: bool, limits: ImageLimits | None) -> Any:
  if limits is not None and ref.startswith(image_text.DATA_URL_PREFIX):
    payload = len(ref) - len(ref.partition(",")[0]) - 1
    if payload * BASE64_BYTES_PER_CHAR > limits.max_bytes:
      raise UserError(f"an image of about {int(payload * BASE64_BYTES_PER_CHAR)} bytes is larger than "
                      f"serve_max_image_bytes={limits.max_bytes}")
  if limits is None:
    return image_text.read_image(ref, files=files)
  # The pixel limit is checked on the image's header, before its pixels are decoded.
  return image_text.read_image(ref, files=files, max_pixels=limits.max_pixels, limit_key="serve_max_image_pixels")


@dataclasses.dataclass(frozen=True)
class ImageChat:
  """What rendering a chat with images reads of a model's config, as plain picklable values: the
  engine's process resolves the family's image format (the family registry imports JAX) and sends
  this to its HTTP front ends (serve_frontend.FrontSpec), whose image code is PIL and numpy only."""
  vision: VisionConfig
  decoder_block: str
  fmt: ImageFormat | None  # the family's format; None for a text-only model (its images are refused first)
  limits: ImageLimits | None = None

  @classmethod
  def of(cls, cfg: ModelConfig, limits: ImageLimits | None = None) -> "ImageChat":
    fmt = image_text.image_format(cfg.decoder_block) if cfg.vision.use_multimodal else None
    return cls(cfg.vision, cfg.decoder_block, fmt, limits)

  def ids(self, tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, Any]], *, files: bool = False,
          add_generation_prompt: bool = True) -> tuple[list[int], PromptImages | None]:
    """conversation_ids with this config (the server's path, data: URLs only unless `files`)."""
    vision, limits = self.vision, self.limits
    templated, slots = image_text.split_images(messages, "the messages")
    image_text.refuse_images_without_vision(slots, vision)
    if limits is not None and len(slots) > limits.max_images:
      raise UserError(f"{len(slots)} images in one request; this server takes at most serve_max_images="
                      f"{limits.max_images}")
    if not vision.use_multimodal:
      templated = image_text.flat_text(templated)
    prepared = image_text.prepare_images([slot.ref for slot in slots], vision, self.decoder_block, files=files,
                                         read=lambda ref: _read(ref, files, limits), fmt=self.fmt)
    guard = chat.ContentGuard(tokenizer, templated)  # a typed marker or "<|im_end|>" stays text
    text = chat.render(tokenizer, guard.hide(templated), add_generation_prompt, what="the messages")
    return self.encode(tokenizer, text, prepared, guard)

  def encode(self, tokenizer: ChatTokenizer, text: str, prepared: Sequence[PreparedImage],
             guard: chat.ContentGuard | None = None) -> tuple[list[int], PromptImages | None]:
    if self.vision.use_multimodal:
      text = image_text.expand_image_markers(text, tokenizer, self.vision, self.decoder_block, prepared, self.fmt)
    ids = guard.encode(tokenizer, text)[0] if guard else list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids, PromptImages.of(np.concatenate([p.pixels for p in prepared])) if prepared else None


def conversation_ids(tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, Any]], cfg: ModelConfig, *, files: bool,
                     limits: ImageLimits | None = None, add_generation_prompt: bool = True
                     ) -> tuple[list[int], PromptImages | None]:
  """(prompt ids, the images' views' pixel values or None) of `messages` through the tokenizer's
  chat template. `files`: image parts may name local paths and gs:// objects (decode.py), else
  only data: URLs (the server). A text-only model refuses images; a multimodal one refuses an
  image marker typed without its image. `limits` count images as sent (a Llama 4 image is then
  up to image_max_tiles + 1 tiles, a Gemma 3 one 1 + image_pan_and_scan_max_num_crops views)."""
  return ImageChat.of(cfg, limits).ids(tokenizer, messages, files=files, add_generation_prompt=add_generation_prompt)


def encode_with_images(tokenizer: ChatTokenizer, text: str, cfg: ModelConfig, prepared: Sequence[PreparedImage]
                       ) -> tuple[list[int], PromptImages | None]:
  """`text` (holding one image marker per entry of `prepared`) as ids with the markers expanded,
  and every image's views in order."""
  return ImageChat.of(cfg).encode(tokenizer, text, prepared)


def image_marker(tokenizer: ChatTokenizer, cfg: ModelConfig) -> str:
  """The text a prompt holds where an image goes (the family's marker: Gemma 3's <start_of_image>, Llama 4's <|image|>)."""
  return image_text.image_format(cfg.decoder_block).marker(tokenizer, cfg.vision)
