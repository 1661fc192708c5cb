"""Images inside conversations: content parts in, a chat-templated text with each image's soft-token
run and the images in order out. Shared by multimodal fine-tuning, decode.py and the server.

A message's content may be a string or a list of parts (OpenAI's and HF's shapes):
  {"type": "text", "text": "..."}
  {"type": "image", "image": REF}                 (HF datasets' shape; also "path" or "url" for REF)
  {"type": "image_url", "image_url": {"url": REF}} (OpenAI's shape; a bare string url too)
REF is a `data:image/...;base64,` URL, or, where files are allowed (training, decode.py), a local
path or a gs:// object. Nothing is fetched over the network: an http(s) URL is refused.

The chat template sees the parts as HF's templates expect ({"type": "image"} / {"type": "text"})
and writes its image marker for each image; `expand_image_markers` then replaces every marker
with the family's soft-token run for that image's views (its `Family.image_format`,
families/image_format.py: what the HF processor inserts), so the tokenizer sees the same text it
would under `transformers`.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from typing import Any, Callable, Mapping, Sequence

from PIL import Image

from MaxText.configuration.vision_config import VisionConfig
from MaxText import families
from MaxText.errors import UserError
from MaxText.families.image_format import ImageFormat, PreparedImage
from MaxText.input_pipeline import images

DATA_URL_PREFIX = "data:"
PART_TYPES = ("text", "image", "image_url")
# `datasets` gives a JSON column the type of the first file it reads: a list content read after
# string contents becomes JSON text, a string read after lists becomes a list of its characters.
SAME_SHAPE = ("in data files, give every message's content the same shape in every file: a list of parts (a "
              "message without images too: [{\"type\": \"text\", \"text\": ...}])")


@dataclasses.dataclass(frozen=True)
class ImageSlot:
  """One image of a conversation: where it comes from, and where its part stood."""
  ref: str
  message: int  # index of the message holding it


def _image_ref(part: Mapping[str, Any], where: str) -> str:
  kind = part.get("type")
  if kind == "image_url":
    url = part.get("image_url")
    ref = url.get("url") if isinstance(url, Mapping) else url
  else:
    ref = next((part[k] for k in ("image", "path", "url") if isinstance(part.get(k), str)), None)
  if not isinstance(ref, str) or not ref:
    raise UserError(f"{where}: an {kind} part needs its image as a string (a data:image/...;base64, URL; "
                    "a path or gs:// object too where files are read, as decode.py and datasets do), "
                    f"got {str(part)[:80]!r}")
  return ref


def split_images(messages: Sequence[Mapping[str, Any]], where: str = "a conversation"
                 ) -> tuple[list[dict[str, Any]], list[ImageSlot]]:
  """(the messages as a chat template takes them, the images in order). String contents pass
  unchanged; list contents become HF template parts."""
  out, slots = [], []
  for i, message in enumerate(messages):
    content = message.get("content")
    if not isinstance(content, list):
      out.append(dict(message))
      continue
    parts: list[dict[str, Any]] = []
    for part in content:
      if isinstance(part, str):  # a string content that a dataset reader split into characters
        raise UserError(f"{where}: message {i}'s content parts must be objects with a 'type', got the string "
                        f"{str(part)[:80]!r}; {SAME_SHAPE}")
      if not isinstance(part, Mapping) or "type" not in part:
        raise UserError(f"{where}: message {i}'s content parts must be objects with a 'type', got {str(part)[:80]!r}")
      if part["type"] == "text":
        if not isinstance(part.get("text"), str):
          raise UserError(f"{where}: message {i} has a text part without a 'text' string")
        parts.append({"type": "text", "text": part["text"]})
      elif part["type"] in ("image", "image_url"):
        slots.append(ImageSlot(_image_ref(part, f"{where}, message {i}"), i))
        parts.append({"type": "image"})
      else:
        kind = str(part["type"])[:40]  # a type of any length or shape
        raise UserError(f"{where}: message {i} has a content part of type {kind!r}; the types are text, image and "
                        "image_url")
    out.append({**message, "content": parts})
  return out, slots


def flat_text(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """Text-only messages: list contents joined into one string (for templates without part support)."""
  return [{**m, "content": "".join(p["text"] for p in m["content"])} if isinstance(m.get("content"), list) else dict(m)
          for m in messages]


def read_image(ref: str, *, files: bool, max_pixels: int = images.MAX_IMAGE_PIXELS, limit_key: str = ""
               ) -> Image.Image:
  """A data: URL, or with `files` a local path or gs:// object, decoded (images.decode's checks,
  `max_pixels` among them). http(s) URLs are refused: nothing here reaches the network."""
  if ref.startswith(("http://", "https://")):
    instead = "download it and give its local path or gs:// object" if files else (
        "send the image inline as a data:image/...;base64, URL")
    raise UserError(f"image {ref[:60]!r}: http(s) image URLs are not fetched (nothing here reaches the network); "
                    f"{instead}")
  if ref.startswith(DATA_URL_PREFIX):
    header, comma, payload = ref.partition(",")
    if not comma or not header.endswith(";base64") or not header[len(DATA_URL_PREFIX):].startswith("image/"):
      raise UserError(f"image {ref[:40]!r}...: a data URL must read data:image/<format>;base64,<data>")
    try:
      # Line breaks are the wrapping of `base64` and MIME encoders, which HF's load_image accepts too.
      data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
      raise UserError(f"image {images.shown(header)}: its base64 data does not decode; give the file's bytes in "
                      "standard base64 (A-Z, a-z, 0-9, + and /, padded with =)") from None
    return images.decode(data, header, max_pixels, limit_key)
  if not files:
    raise UserError(f"image {ref[:60]!r}: only data:image/...;base64, URLs are accepted here")
  return images.load(ref, max_pixels, limit_key)


def image_format(decoder_block: str) -> ImageFormat:
  """The image format of decoder_block's family (one line naming the formats' blocks when it has none)."""
  found = families.family_for_decoder_block(decoder_block).image_format
  if found is None:
    known = [block for family in families.families().values() if family.image_format for block in family.decoder_blocks]
    raise UserError(f"decoder_block {decoder_block!r} has no image prompt format; images need one of "
                    f"{', '.join(known)}")
  return found


def expand_image_markers(text: str, tokenizer: Any, vision: VisionConfig, decoder_block: str,
                         prepared: Sequence[PreparedImage], fmt: ImageFormat | None = None) -> str:
  """`text` with its i-th image marker replaced by image i's run (its family's format, given the
  views it was cut into; `fmt`, where given, is that format without the family lookup). A marker count that differs from the image
  count is one error line (a marker typed without an image, or an image the template did not place)."""
  family_format = fmt or image_format(decoder_block)
  marker = family_format.marker(tokenizer, vision)
  pieces = text.split(marker)
  if len(pieces) - 1 != len(prepared):
    raise UserError(f"the text has {len(pieces) - 1} image marker(s) ({marker}) but {len(prepared)} image(s) were "
                    "given; put one image part per image and no marker in text parts")
  out = [pieces[0]]
  for image, piece in zip(prepared, pieces[1:]):
    out.append(family_format.text(tokenizer, vision, image))
    out.append(piece)
  return "".join(out)


def prepare_images(refs: Sequence[str], vision: VisionConfig, decoder_block: str, *, files: bool,
                   read: Callable[[str], Image.Image] | None = None, fmt: ImageFormat | None = None
                   ) -> list[PreparedImage]:
  """Each image read (`read`, else read_image) and cut into its family's views (`fmt`, else the
  family's format looked up, which imports every family and so JAX)."""
  prepare = (fmt or image_format(decoder_block)).prepare
  return [prepare((read or (lambda r: read_image(r, files=files)))(ref), vision) for ref in refs]


def refuse_images_without_vision(slots: Sequence[ImageSlot], vision: VisionConfig, model_name: str = "the model") -> None:
  if slots and not vision.use_multimodal:
    raise UserError(f"{len(slots)} image(s) given to {model_name}, a text-only model (use_multimodal=False); "
                    "use a vision model's config (a model_name of configs/models/*-vision.yml) or remove the images")
