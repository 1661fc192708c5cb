"""Images read for the vision-language models, on the host (Pillow): a file, a gs:// object or
bytes decoded into a Pillow image, which the model's family then cuts into its tower's views
(Family.image_format: families/gemma3_images.py, families/llama4_images.py).

A file or bytes that Pillow cannot decode, or decodes as a format outside SUPPORTED_FORMATS,
is one `UserError` line naming the image (a name that is long or not printable shortened, quoted).
So is one of more pixels than allowed, refused from its header before any pixel is decoded (a
small file can hold a huge image: a bomb). A photo's EXIF orientation is applied, as HF's image
loaders apply it.
"""

from __future__ import annotations

import io
import re
import warnings

from PIL import Image

from MaxText.errors import UserError
from MaxText.paths import storage

# What a user's image may be encoded as: the formats chat clients and datasets send.
SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# Pillow's name for a JPEG that carries more pictures after the first (many phones' and cameras' photos:
# the Multi-Picture Format); it is a JPEG, read like one (its first picture), as HF's loaders read it.
JPEG_ALIASES = ("MPO",)
# Decoding a huge image is where a bad input costs memory: no image of more pixels is decoded.
MAX_IMAGE_PIXELS = 8192 * 8192
# Pillow's own guard at the same limit, for every image this process opens (datasets' decoders too);
# its warning (images of up to twice the limit) is made an error once for the process, not per decode:
# catch_warnings swaps the whole filter list, which threads decoding at once (the server's) corrupt.
Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS
warnings.filterwarnings("error", category=Image.DecompressionBombWarning)
# An image's name in an error line: a data URL's header or a record's path, either of any length.
NAME_CHARS = 200
ORIENTATION = 0x0112  # the EXIF tag
# Each EXIF orientation's transpose to upright: ImageOps.exif_transpose's table, applied without
# rewriting the EXIF block (exif_transpose does, and fails on a damaged one).
_UPRIGHT = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
            5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
            8: Image.Transpose.ROTATE_90}


def _upright(image: Image.Image) -> Image.Image:
  """A camera's EXIF orientation applied, as HF's loaders apply it (transformers' load_image,
  datasets' Image feature): the pixels are then the upright image HF's processor sees."""
  try:
    orientation = image.getexif().get(ORIENTATION)
    method = _UPRIGHT.get(orientation) if isinstance(orientation, int) else None
  except Exception:  # noqa: BLE001 - a damaged EXIF block fails in Pillow's parser in many ways
    return image  # the pixels decoded: only the hint of how to turn them is lost
  return image if method is None else image.transpose(method)


def shown(name: str) -> str:
  """`name` as an error line shows it: as given when short and printable, else quoted and cut."""
  if len(name) <= NAME_CHARS and name.isprintable():
    return name
  return repr(name[:NAME_CHARS]) + ("..." if len(name) > NAME_CHARS else "")


def decode(data: bytes, name: str, max_pixels: int = MAX_IMAGE_PIXELS, limit_key: str = "") -> Image.Image:
  """An encoded image (PNG, JPEG, ...) as a loaded Pillow image; `name` says which in errors.
  Its size and format are read from its header and checked before its pixels are decoded: at
  most `max_pixels` (the config key `limit_key` when a tool sets its own) and MAX_IMAGE_PIXELS."""
  limit = f"{limit_key}={max_pixels}" if limit_key and max_pixels < MAX_IMAGE_PIXELS else f"{MAX_IMAGE_PIXELS} pixels"
  name = shown(name)
  try:
    image: Image.Image = Image.open(io.BytesIO(data))  # the header only: no pixel is decoded yet
    if image.format not in SUPPORTED_FORMATS + JPEG_ALIASES:
      raise UserError(f"image {name}: format {image.format} is not supported; use one of "
                      f"{', '.join(SUPPORTED_FORMATS)}")
    width, height = image.size
    if width * height > min(max_pixels, MAX_IMAGE_PIXELS):
      raise UserError(f"image {name}: {width}x{height} pixels is larger than {limit}; resize it first")
    image.load()
    image = _upright(image)
  except (Image.DecompressionBombWarning, Image.DecompressionBombError):  # Pillow's guard, in Image.open
    raise UserError(f"image {name}: larger than {limit}; resize it first") from None
  except (OSError, ValueError, SyntaxError) as e:  # Pillow's ways of saying "not an image I can read"
    # Pillow names the buffer by its repr (an address): dropped, so the same bytes get the same line.
    reason = re.sub(r" <[^<>]* at 0x[0-9a-fA-F]+>", "", str(e))
    raise UserError(f"image {name}: cannot be decoded as an image ({reason}); give a PNG, JPEG, WEBP, GIF or BMP "
                    "file") from None
  return image


def load(path: str, max_pixels: int = MAX_IMAGE_PIXELS, limit_key: str = "") -> Image.Image:
  """An image file (a local path or gs:// object) decoded as `decode` does."""
  try:
    data = storage.read_bytes(path)
  except FileNotFoundError:  # an object store's own words for it are a URL fragment
    raise UserError(f"image {shown(path)}: cannot be read (no such file or object); check the path (a relative path "
                    "is from the working directory)") from None
  except OSError as e:
    raise UserError(f"image {shown(path)}: cannot be read ({e.strerror or e})") from None
  return decode(data, path, max_pixels, limit_key)

