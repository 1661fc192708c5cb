"""Multimodal supervised fine-tuning: conversation records whose contents hold images become
documents that carry their images' pixel values (packing.ImageDocument).

A record is an SFT record (chat.py) whose message contents may be lists of parts, images among
them (image_text.py: local paths, gs:// objects or data:image URLs). In order, per record:
  image parts → template parts and image refs (image_text.split_images) → the count against
  max_images_per_row → each image read, decoded and made into pixel values here, on the host
  (images.py; this runs in the input pipeline's worker threads) → the chat template → each marker
  replaced by the image's soft-token run (image_text.expand_image_markers), the trained spans
  moved with it → tokens and 0/1 weights, 0 on every image placeholder → the placeholder runs,
  one per image of mm_tokens_per_image tokens, checked → truncation to max_target_length + 1
  tokens, before an image whose run it would cut (the images after the cut are dropped).

A text-only model keeps chat.SftEncoder's behaviour and refuses a record with images.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from MaxText.configuration.vision_config import VisionConfig
from MaxText.errors import UserError
from MaxText.input_pipeline import image_text, images
from MaxText.input_pipeline.chat import PAIR_FIELDS, SftEncoder, as_mapping, as_messages
from MaxText.input_pipeline.packing import ImageDocument


def split_record(record: Mapping[str, Any]) -> tuple[dict[str, Any], list[image_text.ImageSlot]]:
  """(the record with template parts for image parts, its images in the order rendered)."""
  if "messages" in record:
    messages, slots = image_text.split_images(as_messages(record["messages"], "messages"))
    return {**record, "messages": messages}, slots
  out, slots = dict(record), []
  if all(field in record for field in PAIR_FIELDS):
    for field in PAIR_FIELDS:  # rendered prompt first, then completion
      if isinstance(record[field], list):
        out[field], more = image_text.split_images(as_messages(record[field], field), f"the {field}")
        slots += more
  return out, slots


def placeholder_runs(tokens: list[int], image_token_id: int) -> np.ndarray:
  """int32 [k, 2]: each run of consecutive `image_token_id` tokens as [start, end)."""
  is_image = np.concatenate([[0], np.asarray(tokens) == image_token_id, [0]]).astype(np.int8)
  edges = np.flatnonzero(np.diff(is_image))
  return edges.reshape(-1, 2).astype(np.int32)


class ImageSftEncoder:
  """record → int32 [2, n] (tokens, target weights), or an ImageDocument when images remain after
  truncation; an empty document for a dropped sample (as SftEncoder, which renders the text)."""

  def __init__(self, tokenizer: Any, max_target_length: int, completion_only: bool, add_bos: bool, add_eos: bool,
               vision: VisionConfig, decoder_block: str, max_images: int, model_name: str = "the model"):
    self.text = SftEncoder(tokenizer, max_target_length, completion_only, add_bos, add_eos)
    self.tokenizer, self.max_tokens, self.dropped = tokenizer, self.text.max_tokens, self.text.dropped
    self.vision, self.decoder_block, self.max_images, self.model_name = vision, decoder_block, max_images, model_name
    self.options = images.ImageOptions(image_size=vision.vision_image_size)

  def __call__(self, record: Any) -> np.ndarray | ImageDocument:
    record = as_mapping(record)
    templated, slots = split_record(record)
    if not self.vision.use_multimodal:
      image_text.refuse_images_without_vision(slots, self.vision, self.model_name)
      return self.text(record)
    self._check_count(len(slots), "")
    views = [images.pixel_values(image_text.read_image(slot.ref, files=True), self.options) for slot in slots]
    crops = [len(v) - 1 for v in views]
    self._check_count(sum(len(v) for v in views), " (counting pan-and-scan crops)")

    def expand(text: str, spans: list[tuple[int, int]]) -> tuple[str, list[tuple[int, int]]]:
      return self._expand(text, spans, crops)

    tokens, weights = self.text.tokens_and_weights(templated, rewrite=expand)
    image_id = self.vision.image_token_id
    weights = [0 if token == image_id else weight for token, weight in zip(tokens, weights)]
    runs = placeholder_runs(tokens, image_id)
    needed = sum(len(v) for v in views)
    lengths = set((runs[:, 1] - runs[:, 0]).tolist())
    if len(runs) != needed or (needed and lengths != {self.vision.mm_tokens_per_image}):
      raise UserError(f"the tokens hold {int(np.sum(np.asarray(tokens) == image_id))} image placeholder tokens "
                      f"(id {image_id}) in {len(runs)} run(s), but its {needed} image(s) need {needed} run(s) of "
                      f"{self.vision.mm_tokens_per_image}; remove image placeholder tokens typed in text")
    return self._truncated(tokens, weights, runs, np.concatenate(views) if views else None)

  def explain_empty(self) -> str | None:
    return self.text.explain_empty()

  def _check_count(self, count: int, what: str) -> None:
    if count > self.max_images:
      raise UserError(f"{count} image(s){what}, more than max_images_per_row={self.max_images} (the image slots of a "
                      "batch row); raise max_images_per_row or give the record fewer images")

  def _expand(self, text: str, spans: list[tuple[int, int]], crops: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """The text with each image marker replaced by its soft-token run; spans moved to match."""
    expanded = image_text.expand_image_markers(text, self.tokenizer, self.vision, self.decoder_block, crops)
    marker_of, _ = image_text.IMAGE_TEXT[self.decoder_block]
    marker = marker_of(self.tokenizer, self.vision)
    grown, at = [], -1
    for count in crops:  # expand_image_markers checked there is one marker per image
      at = text.index(marker, at + 1)
      one = image_text.expand_image_markers(marker, self.tokenizer, self.vision, self.decoder_block, [count])
      grown.append((at, len(one) - len(marker)))

    def moved(position: int) -> int:
      return position + sum(growth for start, growth in grown if start < position)

    return expanded, [(moved(a), moved(b)) for a, b in spans]

  def _truncated(self, tokens: list[int], weights: list[int], runs: np.ndarray,
                 pixels: np.ndarray | None) -> np.ndarray | ImageDocument:
    cut = len(tokens)
    if cut > self.max_tokens:
      cut = self.max_tokens
      for start, end in runs.tolist():  # inputs are tokens[:cut - 1]; no run may straddle its end
        if start < cut - 1 < end:
          cut = start
          break
      if not any(weights[1:cut]):
        first = next((i for i, w in enumerate(weights) if i and w), None)
        self.dropped.add(f"no assistant token within max_target_length + 1 = {self.max_tokens} tokens (or before an "
                         "image that would be cut)", needed=first, num_tokens=len(tokens))
        return np.zeros((2, 0), np.int32)
    array = np.asarray([tokens[:cut], weights[:cut]], np.int32)
    kept = int(np.sum(runs[:, 1] <= cut - 1)) if len(runs) else 0
    if not kept or pixels is None:
      return array
    return ImageDocument(array, pixels[:kept], runs[:kept])
