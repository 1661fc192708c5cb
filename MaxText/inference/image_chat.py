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
from MaxText.errors import UserError
from MaxText.inference.image_prompts import PromptImages
from MaxText.families.image_format import PreparedImage
from MaxText.input_pipeline import image_text
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


def conversation_ids(tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, Any]], cfg: ModelConfig, *, files: bool,
                     limits: ImageLimits | None = None, add_generation_prompt: bool = True
                     ) -> tuple[list[int], PromptImages | None]:
  """(prompt ids, the images' views' pixel values or None) of `messages` through the tokenizer's
  chat template. `files`: image parts may name local paths and gs:// objects (decode.py), else
  only data: URLs (the server). A text-only model refuses images; a multimodal one refuses an
  image marker typed without its image. `limits` count images as sent (a Llama 4 image is then
  up to image_max_tiles + 1 tiles, a Gemma 3 one 1 + image_pan_and_scan_max_num_crops views)."""
  vision = cfg.vision
  templated, slots = image_text.split_images(messages, "the messages")
  image_text.refuse_images_without_vision(slots, vision)
  if limits is not None and len(slots) > limits.max_images:
    raise UserError(f"{len(slots)} images in one request; this server takes at most serve_max_images="
                    f"{limits.max_images}")
  if not vision.use_multimodal:
    templated = image_text.flat_text(templated)
  prepared = image_text.prepare_images([slot.ref for slot in slots], vision, cfg.decoder_block, files=files,
                                       read=lambda ref: _read(ref, files, limits))
  text = tokenizer.apply_chat_template(templated, tokenize=False, add_generation_prompt=add_generation_prompt)
  return encode_with_images(tokenizer, text, cfg, prepared)


def encode_with_images(tokenizer: ChatTokenizer, text: str, cfg: ModelConfig, prepared: Sequence[PreparedImage]
                       ) -> tuple[list[int], PromptImages | None]:
  """`text` (holding one image marker per entry of `prepared`) as ids with the markers expanded,
  and every image's views in order."""
  if cfg.vision.use_multimodal:
    text = image_text.expand_image_markers(text, tokenizer, cfg.vision, cfg.decoder_block, prepared)
  ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
  return ids, PromptImages.of(np.concatenate([p.pixels for p in prepared])) if prepared else None


def image_marker(tokenizer: ChatTokenizer, cfg: ModelConfig) -> str:
  """The text a prompt holds where an image goes (the family's marker: Gemma 3's <start_of_image>, Llama 4's <|image|>)."""
  return image_text.image_format(cfg.decoder_block).marker(tokenizer, cfg.vision)
