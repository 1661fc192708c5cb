"""Image pre-processing (families/gemma3_images.py) equals HF's Gemma 3 image processor (its Pillow backend, what
transformers runs without torchvision) on generated images of several sizes, modes and
encodings; bad images are one UserError line naming the image, an image of too many pixels
refused from its header before any pixel is decoded."""

from __future__ import annotations

import io
import threading
import warnings

import numpy as np
import pytest
from PIL import Image, ImageFile

from big_images import peak_rss_growth, solid_png
from MaxText.errors import UserError
from MaxText.families import gemma3_images
from MaxText.input_pipeline import images

transformers = pytest.importorskip("transformers", reason="needs transformers (EXTRAS=test bash setup.sh)")
datasets = pytest.importorskip("datasets")

SIZE = 64


def _image(mode: str, width: int, height: int, seed: int = 0) -> Image.Image:
  """A smooth gradient plus noise (resampling must get both the slow and fast parts right)."""
  rng = np.random.default_rng(seed)
  y, x = np.mgrid[0:height, 0:width]
  channels = [(x * 255 // max(width - 1, 1)), (y * 255 // max(height - 1, 1)), (x + y) % 256, 255 - (x * y) % 256]
  array = np.clip(np.stack(channels, -1) + rng.integers(-40, 40, (height, width, 4)), 0, 255).astype(np.uint8)
  rgba = Image.fromarray(array, "RGBA")
  return rgba if mode == "RGBA" else rgba.convert(mode)


def _encoded(image: Image.Image, fmt: str) -> bytes:
  out = io.BytesIO()
  image.save(out, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
  return out.getvalue()


def _hf(image: Image.Image, **kwargs) -> np.ndarray:
  processor = transformers.Gemma3ImageProcessorPil(size={"height": SIZE, "width": SIZE})
  return np.asarray(processor(images=[image], return_tensors="np", **kwargs)["pixel_values"])


CASES = [("RGB", 100, 37, None), ("RGBA", 31, 90, None), ("L", 64, 64, None), ("LA", 200, 150, None),
         ("P", 48, 20, None), ("RGB", 90, 120, "PNG"), ("RGBA", 300, 80, "PNG"), ("L", 57, 33, "PNG"),
         ("RGB", 120, 70, "JPEG"), ("L", 40, 200, "JPEG")]


@pytest.mark.parametrize("mode, width, height, fmt", CASES)
def test_pixel_values_equal_hf(mode, width, height, fmt):
  image = _image(mode, width, height)
  if fmt:
    image = images.decode(_encoded(image, fmt), f"generated.{fmt.lower()}")
  ours = gemma3_images.pixel_values(image, gemma3_images.ImageOptions(image_size=SIZE))
  expected = _hf(image)
  assert ours.shape == expected.shape == (1, 3, SIZE, SIZE) and ours.dtype == np.float32
  np.testing.assert_allclose(ours, expected, atol=1e-6, rtol=0)


def _saved(image: Image.Image, fmt: str, **kwargs) -> bytes:
  out = io.BytesIO()
  image.save(out, format=fmt, **kwargs)
  return out.getvalue()


def _exif(orientation: int) -> Image.Exif:
  exif = Image.Exif()
  exif[images.ORIENTATION] = orientation
  return exif


_NOISE = _image("RGB", 40, 30, seed=4)
# Files as users hand them over: each decoded, then made RGB, must give HF's pixels.
ODD_FILES = {
    "16-bit grayscale PNG": lambda: _saved(Image.fromarray(
        np.random.default_rng(5).integers(0, 65536, (30, 40)).astype(np.uint16)), "PNG"),
    "palette PNG with a transparent entry": lambda: _saved(_NOISE.quantize(16), "PNG", transparency=3),
    "CMYK JPEG": lambda: _saved(_NOISE.convert("CMYK"), "JPEG"),
    "grayscale and alpha PNG": lambda: _saved(_image("LA", 40, 30), "PNG"),
    "1-bit PNG": lambda: _saved(_NOISE.convert("1"), "PNG"),
    "RGBA WEBP": lambda: _saved(_image("RGBA", 40, 30), "WEBP", lossless=True),
    "animated GIF": lambda: _saved(_NOISE, "GIF", save_all=True, append_images=[_image("RGB", 40, 30, seed=6)]),
    "1x1 PNG": lambda: _saved(Image.new("RGB", (1, 1), (1, 2, 3)), "PNG"),
    "1x500 PNG": lambda: _saved(_image("RGB", 1, 500), "PNG"),
    **{f"JPEG with EXIF orientation {o}": (lambda o=o: _saved(_NOISE, "JPEG", exif=_exif(o))) for o in (3, 6, 8)},
}


@pytest.mark.parametrize("name", list(ODD_FILES))
def test_odd_files_give_the_pixels_of_hfs_loader_and_processor(name):
  """HF's reference is its loaders (datasets' Image feature, as a dataset's images reach HF's processor:
  the first frame of an animation, EXIF orientation applied) then its processor."""
  data = ODD_FILES[name]()
  ours = gemma3_images.pixel_values(images.decode(data, name), gemma3_images.ImageOptions(image_size=SIZE))
  loaded = datasets.Image().decode_example({"bytes": data, "path": None})
  np.testing.assert_allclose(ours, _hf(loaded), atol=1e-6, rtol=0)


def test_an_exif_block_pillow_cannot_rewrite_still_turns_the_image_upright():
  """ImageOps.exif_transpose rewrites the EXIF block and fails on one whose Make tag (0x010f) now
  reads as ImageWidth (0x0100) holding text; its orientation still reads and is applied."""
  exif = _exif(6)
  exif[0x010F] = "Canon"
  data = bytearray(_saved(_NOISE, "JPEG", exif=exif))
  data[data.index(b"Exif\x00\x00") + 17] = 0x00  # the first entry's tag, big-endian: 0x010f -> 0x0100
  image = images.decode(bytes(data), "damaged.jpg")
  stored = Image.open(io.BytesIO(bytes(data)))
  np.testing.assert_array_equal(np.asarray(image), np.asarray(stored.transpose(Image.Transpose.ROTATE_270)))


@pytest.mark.parametrize("width, height", [(600, 200), (200, 900), (300, 280), (1000, 270)])
def test_pan_and_scan_equals_hf(width, height):
  image = _image("RGB", width, height, seed=1)
  options = gemma3_images.ImageOptions(image_size=SIZE, pan_and_scan=True, pan_and_scan_min_crop_size=64)
  ours = gemma3_images.pixel_values(image, options)
  expected = _hf(image, do_pan_and_scan=True, pan_and_scan_min_crop_size=64, pan_and_scan_max_num_crops=4,
                 pan_and_scan_min_ratio_to_activate=1.2)
  assert ours.shape == expected.shape, (ours.shape, expected.shape)
  np.testing.assert_allclose(ours, expected, atol=1e-6, rtol=0)


def test_transparency_is_composited_onto_white():
  clear = Image.new("RGBA", (8, 8), (10, 20, 30, 0))
  values = gemma3_images.pixel_values(clear, gemma3_images.ImageOptions(image_size=4))
  np.testing.assert_array_equal(values, np.ones((1, 3, 4, 4), np.float32))  # white, normalised


def test_batch_keeps_image_order():
  a, b = _image("RGB", 30, 30, seed=2), _image("L", 50, 20, seed=3)
  options = gemma3_images.ImageOptions(image_size=SIZE)
  batch = gemma3_images.batch_pixel_values([a, b], options)
  np.testing.assert_array_equal(batch, np.concatenate([gemma3_images.pixel_values(a, options), gemma3_images.pixel_values(b, options)]))


@pytest.mark.parametrize("data, message", [
    (b"not an image at all", "image upload.png: cannot be decoded as an image"),
    (_encoded(_image("RGB", 16, 16), "PNG")[:60], "image upload.png: cannot be decoded as an image"),
    (_encoded(_image("RGB", 16, 16), "TIFF"), "image upload.png: format TIFF is not supported; use one of PNG"),
])
def test_bad_images_are_one_line_errors(data, message):
  with pytest.raises(UserError) as raised:
    images.decode(data, "upload.png")
  assert message in str(raised.value) and "\n" not in str(raised.value)
  assert " at 0x" not in str(raised.value)  # no object address: the same bytes give the same line


def test_unreadable_file_names_the_path(tmp_path):
  with pytest.raises(UserError, match=f"image {tmp_path / 'missing.png'}: cannot be read"):
    images.load(str(tmp_path / "missing.png"))


def test_a_missing_gs_object_says_so(gcs_bucket):
  """gcsfs words a missing object as a URL fragment ('b/BUCKET/o/NAME'): the line says what it is."""
  with pytest.raises(UserError) as raised:
    images.load(f"{gcs_bucket}/shapes/missing.png")
  assert str(raised.value).startswith(f"image {gcs_bucket}/shapes/missing.png: cannot be read (no such file or object)")


def test_pillows_own_guard_is_our_limit():
  assert Image.MAX_IMAGE_PIXELS == images.MAX_IMAGE_PIXELS


def test_a_decompression_bomb_is_refused_from_its_header_fast_and_small():
  """A 9000x9000 PNG of one colour (a few hundred KB, 243 MB decoded) lies under Pillow's default
  guard; it is refused on its size alone, in milliseconds and without the decoded megabytes."""
  data = solid_png(9000, 9000)
  seconds, grown, raised = peak_rss_growth(lambda: images.decode(data, "bomb.png"))
  assert isinstance(raised, UserError) and f"larger than {images.MAX_IMAGE_PIXELS} pixels" in str(raised), raised
  assert grown < 32 << 20, (seconds, grown)  # not decoded (243 MB); time is no test here


def test_a_tool_limit_is_checked_before_decoding(monkeypatch):
  def no_decoding(self):
    raise AssertionError("pixels were decoded")

  monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
  with pytest.raises(UserError, match=r"image up.png: 100x60 pixels is larger than serve_max_image_pixels=2500;"):
    images.decode(solid_png(100, 60), "up.png", 50 * 50, "serve_max_image_pixels")
  with pytest.raises(UserError, match=r"format TIFF is not supported"):  # the format too, from the header
    images.decode(_encoded(_image("RGB", 16, 16), "TIFF"), "up.tiff")


@pytest.mark.parametrize("name", ["data:image/png;x=\n;base64", "records/" + "deep/" * 2000 + "cat.png"],
                         ids=["line-break", "very-long"])
def test_an_image_name_of_any_shape_is_one_short_line(name, tmp_path):
  """A data URL's header or a record's path is the user's text: one with a line break, or of
  thousands of characters, is quoted and cut, not copied into the line."""
  for read in (lambda: images.decode(b"not an image", name), lambda: images.load(name)):
    with pytest.raises(UserError) as raised:
      read()
    message = str(raised.value)
    assert "\n" not in message and len(message) < 400 and message.startswith(f"image {images.shown(name)}: ")
  assert images.shown("upload.png") == "upload.png"


def test_images_decoded_on_threads_at_once_leave_the_warning_filters_as_they_were(monkeypatch):
  """The server decodes its requests' images on worker threads. A catch_warnings around each decode
  swapped the process's filter list: two decodes inside Image.open together, the first leaving
  first, left an error filter behind for good (and a filter set meanwhile would have been lost)."""
  before = list(warnings.filters)
  data = _encoded(_image("RGB", 8, 8), "PNG")
  both_opened, first_done = threading.Barrier(2, timeout=10), threading.Event()
  real_open = Image.open

  def open_together(fp, *args, **kwargs):
    image = real_open(fp, *args, **kwargs)
    both_opened.wait()
    if threading.current_thread().name == "second":
      first_done.wait(10)
    return image

  monkeypatch.setattr(Image, "open", open_together)
  decoded = []

  def decode_then(done: threading.Event | None) -> None:
    decoded.append(images.decode(data, "up.png").size)
    if done is not None:
      done.set()

  threads = [threading.Thread(target=decode_then, args=(first_done,), name="first"),
             threading.Thread(target=decode_then, args=(None,), name="second")]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(20)
  assert decoded == [(8, 8), (8, 8)]
  assert warnings.filters == before
