"""Multimodal supervised fine-tuning: conversation records whose contents hold images become
documents that carry their images' pixel values (packing.ImageDocument).

A record is an SFT record (chat.py) whose message contents may be lists of parts, images among
them (image_text.py: local paths, gs:// objects or data:image URLs). In order, per record:
  image parts → template parts and image refs (image_text.split_images) → the image count against
  max_images_per_row → each image read, decoded and cut into its family's views here, on the host
  (the family's image format, families/image_format.py: Gemma 3's image and pan-and-scan crops,
  Llama 4's tiles and thumbnail; this runs in the input pipeline's worker threads) → the view count against max_images_per_row (a
  slot holds one view) → the chat template → each marker replaced by the image's run
  (image_text.expand_image_markers), the trained spans moved with it → tokens and 0/1 weights, 0
  on every image placeholder → the placeholder runs, one per view of mm_tokens_per_image tokens,
  checked → truncation to max_target_length + 1 tokens, before an image any of whose runs it
  would cut (the images after the cut are dropped).

A text-only model keeps chat.SftEncoder's behaviour and refuses a record with images.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import numpy as np

from MaxText.configuration.vision_config import VisionConfig
from MaxText.errors import UserError
from MaxText.families.image_format import PreparedImage
from MaxText.input_pipeline import image_text
from MaxText.input_pipeline.chat import PAIR_FIELDS, SftEncoder, as_mapping, as_messages
from MaxText.input_pipeline.packing import ImageDocument, image_units


def _has_image_part(parts: Any) -> bool:
  return (isinstance(parts, list) and all(isinstance(p, dict) and p.get("type") in image_text.PART_TYPES for p in parts)
          and any(p["type"] != "text" for p in parts))


def _images_as_text(text: Any) -> bool:
  """Whether a string is content parts with images, or messages holding them, written as JSON: what
  `datasets` makes of a list in a file read after one whose values there were all strings (the
  first file's type wins). Text parts only are left as text: a model may be taught to write them."""
  if not isinstance(text, str) or not text.lstrip().startswith("["):
    return False
  try:
    value = json.loads(text)
  except json.JSONDecodeError:
    return False
  return _has_image_part(value) or (isinstance(value, list) and any(
      isinstance(m, dict) and _has_image_part(m.get("content")) for m in value))


def _refuse_images_as_text(text: Any, where: str) -> None:
  if _images_as_text(text):  # else its images would silently be trained on as text
    raise UserError(f"{where} is a list with images turned into JSON text by the dataset reader (a file of strings "
                    f"there read first); {image_text.SAME_SHAPE}")


def _split(messages: list[dict[str, Any]], where: str) -> tuple[list[dict[str, Any]], list[image_text.ImageSlot]]:
  for i, message in enumerate(messages):
    _refuse_images_as_text(message.get("content"), f"{where}: message {i}'s content")
  return image_text.split_images(messages, where)


# The columns TRL's layout keeps a record's images in (a list, or one image), beside bare image parts.
IMAGE_COLUMNS = ("images", "image")


def _refuse_images_column(record: Mapping[str, Any]) -> None:
  """TRL's and many hub datasets' layout, bare {"type": "image"} parts and the images in an `images`
  (or `image`) column, is not read: one line saying where the images go instead of each part's
  'needs its image'."""
  column = next((name for name in IMAGE_COLUMNS if record.get(name) is not None), None)
  if column is None:  # a table reader's filler, or no such column
    return
  fields = ("messages",) if record.get("messages") is not None else PAIR_FIELDS
  for field in fields:
    messages = record.get(field)
    for message in messages if isinstance(messages, list) else []:
      content = message.get("content") if isinstance(message, Mapping) else None
      for part in content if isinstance(content, list) else []:
        if isinstance(part, Mapping) and part.get("type") == "image" and not any(
            part.get(key) for key in ("image", "path", "url")):
          raise UserError(f"this record's images are in an {column!r} column beside bare {{\"type\": \"image\"}} "
                          "parts, which is not read; put each image in its part: {\"type\": \"image\", \"image\": "
                          "PATH} (a path, gs:// object or data:image/...;base64, URL)")


def split_record(record: Mapping[str, Any]) -> tuple[dict[str, Any], list[image_text.ImageSlot]]:
  """(the record with template parts for image parts, its images in the order rendered)."""
  _refuse_images_column(record)
  if record.get("messages") is not None:  # None: a table reader's filler (SftEncoder.render)
    messages, slots = _split(as_messages(record["messages"], "messages"), "a conversation")
    return {**record, "messages": messages}, slots
  out, slots = dict(record), []
  if all(record.get(field) is not None for field in PAIR_FIELDS):
    for field in PAIR_FIELDS:  # rendered prompt first, then completion
      _refuse_images_as_text(record[field], f"the {field}")
      if isinstance(record[field], list):
        out[field], more = _split(as_messages(record[field], field), f"the {field}")
        slots += more
  return out, slots


def placeholder_runs(tokens: list[int], image_token_id: int) -> np.ndarray:
  """int32 [k, 2]: each run of consecutive `image_token_id` tokens as [start, end)."""
  is_image = np.concatenate([[0], np.asarray(tokens) == image_token_id, [0]]).astype(np.int8)
  edges = np.flatnonzero(np.diff(is_image))
  return edges.reshape(-1, 2).astype(np.int32)


class ImageSftEncoder:
  """record → int32 [2, n] (tokens, target weights), or an ImageDocument when images remain after
  truncation; an empty document for a dropped sample (as SftEncoder, which renders the text).
  `max_images` counts views (the family's image format), what a batch row's pixel_values slots hold."""

  def __init__(self, tokenizer: Any, max_target_length: int, completion_only: bool, add_bos: bool, add_eos: bool,
               vision: VisionConfig, decoder_block: str, max_images: int, model_name: str = "the model"):
    self.text = SftEncoder(tokenizer, max_target_length, completion_only, add_bos, add_eos)
    self.tokenizer, self.max_tokens, self.dropped = tokenizer, self.text.max_tokens, self.text.dropped
    self.vision, self.decoder_block, self.max_images, self.model_name = vision, decoder_block, max_images, model_name

  def __call__(self, record: Any) -> np.ndarray | ImageDocument:
    record = as_mapping(record)
    templated, slots = split_record(record)
    if not self.vision.use_multimodal:
      image_text.refuse_images_without_vision(slots, self.vision, self.model_name)
      return self.text(record)
    image_format = image_text.image_format(self.decoder_block)
    if len(slots) > self.max_images:  # before decoding any: every image is at least one view
      raise UserError(f"{len(slots)} image(s), more than max_images_per_row={self.max_images} (the image slots of a "
                      "batch row); raise max_images_per_row or give the record fewer images")
    prepared = image_text.prepare_images([slot.ref for slot in slots], self.vision, self.decoder_block, files=True)
    needed = sum(image.num_views for image in prepared)
    if needed > self.max_images:
      raise UserError(f"{len(slots)} image(s) give {needed} {image_format.views}, more than max_images_per_row="
                      f"{self.max_images} (a batch row's slots, one per view); raise max_images_per_row or give the "
                      f"record fewer images, or lower {image_format.views_key}")

    def expand(text: str, spans: list[tuple[int, int]]) -> tuple[str, list[tuple[int, int]]]:
      return self._expand(text, spans, prepared)

    tokens, weights = self.text.tokens_and_weights(templated, rewrite=expand)
    image_id = self.vision.image_token_id
    weights = [0 if token == image_id else weight for token, weight in zip(tokens, weights)]
    runs = placeholder_runs(tokens, image_id)
    lengths = set((runs[:, 1] - runs[:, 0]).tolist())
    if len(runs) != needed or (needed and lengths != {self.vision.mm_tokens_per_image}):
      raise UserError(f"the tokens hold {int(np.sum(np.asarray(tokens) == image_id))} image placeholder tokens "
                      f"(id {image_id}) in {len(runs)} run(s), but its {needed} image view(s) need {needed} run(s) "
                      f"of {self.vision.mm_tokens_per_image}; remove image placeholder tokens typed in text")
    image_of_run = np.repeat(np.arange(len(prepared), dtype=np.int32), [image.num_views for image in prepared])
    pixels = np.concatenate([image.pixels for image in prepared]) if prepared else None
    return self._truncated(tokens, weights, runs, pixels, image_of_run)

  def explain_empty(self) -> str | None:
    return self.text.explain_empty()

  def _expand(self, text: str, spans: list[tuple[int, int]], prepared: list[PreparedImage]
              ) -> tuple[str, list[tuple[int, int]]]:
    """The text with each image marker replaced by its run; spans moved to match."""
    expanded = image_text.expand_image_markers(text, self.tokenizer, self.vision, self.decoder_block, prepared)
    marker = image_text.image_format(self.decoder_block).marker(self.tokenizer, self.vision)
    grown, at = [], -1
    for image in prepared:  # expand_image_markers checked there is one marker per image
      at = text.index(marker, at + 1)
      one = image_text.expand_image_markers(marker, self.tokenizer, self.vision, self.decoder_block, [image])
      grown.append((at, len(one) - len(marker)))

    def moved(position: int) -> int:
      return position + sum(growth for start, growth in grown if start < position)

    return expanded, [(moved(a), moved(b)) for a, b in spans]

  def _truncated(self, tokens: list[int], weights: list[int], runs: np.ndarray, pixels: np.ndarray | None,
                 image_of_run: np.ndarray) -> np.ndarray | ImageDocument:
    cut = len(tokens)
    if cut > self.max_tokens:
      cut = self.max_tokens
      for _, _, start, end in image_units(runs, image_of_run):  # inputs are tokens[:cut - 1]; no image may straddle it
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
    return ImageDocument(array, pixels[:kept], runs[:kept], image_of_run[:kept])
