"""Llama 4's image pre-processing and prompt expansion (families/llama4_images.py) against
HF's Llama4ImageProcessor and Llama4Processor. The processor needs torchvision: without it, its
tile-grid choice, fitted size and tile order are checked with its own functions (imported with
a stand-in torchvision module, as they do not use it), the bfloat16 normalisation against the
same torch ops, and the whole processor only where torchvision is installed."""

import importlib
import sys
import types

import numpy as np
import pytest
from PIL import Image

from MaxText.families import llama4_images as L

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_functions():
  """transformers' image_processing_llama4 module, importable without torchvision."""
  import transformers.image_processing_backends  # noqa: F401 (before the stand-in goes in)
  names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2",
           "torchvision.transforms.v2.functional"]
  saved = {name: sys.modules.get(name) for name in names}
  try:
    if saved["torchvision"] is None:
      for name in names:
        sys.modules[name] = types.ModuleType(name)
      sys.modules["torchvision.transforms.v2"].functional = sys.modules[names[-1]]
    return importlib.import_module("transformers.models.llama4.image_processing_llama4")
  finally:
    for name, module in saved.items():
      if module is None:
        sys.modules.pop(name, None)


SIZES = [(336, 336), (200, 300), (13, 20), (1000, 250), (250, 1000), (640, 480), (4000, 300), (1, 1), (337, 336),
         (720, 1280), (3000, 2000), (100, 5000)]


def _hf_layout(m, height, width, tile, max_tiles):
  """What HF's _preprocess computes before resizing: (grid, fitted size)."""
  from transformers.image_utils import SizeDict
  resolutions = torch.tensor(m.find_supported_resolutions(max_tiles, SizeDict(height=tile, width=tile)))
  target = m.get_best_fit((height, width), resolutions)
  limited = (min(max(height, tile), int(target[0])), min(max(width, tile), int(target[1])))
  fitted = m.get_max_res_without_distortion((height, width), limited)
  return (int(target[0]) // tile, int(target[1]) // tile), (max(fitted[0], 1), max(fitted[1], 1))


@pytest.mark.parametrize("max_tiles", [16, 5])
def test_grid_and_fitted_size_equal_hf(hf_functions, max_tiles):
  from transformers.image_utils import SizeDict
  options = L.TileOptions(max_tiles=max_tiles)
  hf_grids = [(h // 336, w // 336) for h, w in hf_functions.find_supported_resolutions(
      max_tiles, SizeDict(height=336, width=336))]
  assert list(L.supported_grids(max_tiles)) == hf_grids
  for height, width in SIZES:
    grid, fitted = _hf_layout(hf_functions, height, width, 336, max_tiles)
    assert L.best_grid(height, width, options) == grid, (height, width)
    assert L._fit(height, width, grid, options) == fitted, (height, width)


def test_tiles_come_in_hf_order():
  from transformers.image_transforms import split_to_tiles
  canvas = np.random.default_rng(0).integers(0, 256, (2 * 8, 3 * 8, 3), dtype=np.uint8)
  out, grid = L.tiles(Image.fromarray(canvas), L.TileOptions(tile_size=8, max_tiles=6))
  assert grid == (2, 3) and out.shape == (7, 3, 8, 8)  # 6 tiles and the thumbnail
  normalised = torch.tensor(L._normalised(canvas, L.TileOptions()))[None]
  np.testing.assert_array_equal(out[:6], split_to_tiles(normalised, 2, 3)[0].numpy())


def test_bfloat16_normalisation_equals_hf_ops():
  """HF rescales and normalises in bfloat16 (rescale_and_normalize, then torchvision's normalize)."""
  pixels = np.arange(256, dtype=np.uint8).reshape(16, 16, 1).repeat(3, axis=2)
  x = torch.tensor(pixels.transpose(2, 0, 1)).to(torch.bfloat16) * (1 / 255)
  mean = torch.tensor([0.5, 0.5, 0.5], dtype=torch.bfloat16)[:, None, None]
  expected = ((x - mean) / mean).float().numpy()
  np.testing.assert_array_equal(L._normalised(pixels, L.TileOptions()), expected)


def test_a_one_tile_image_has_no_thumbnail():
  out, grid = L.tiles(Image.new("RGB", (28, 14), (255, 0, 0)), L.TileOptions(tile_size=28, max_tiles=4))
  assert grid == (1, 1) and out.shape == (1, 3, 28, 28)
  assert out[0, 0, 0, 0] == 1.0 and out[0, 0, -1, -1] == -1.0  # the image, then black padding below it


@pytest.mark.parametrize("size", [(28, 28), (60, 25), (25, 90), (57, 29)])
def test_whole_processor_equals_hf(size):
  pytest.importorskip("torchvision", reason="HF's Llama4ImageProcessor needs torchvision, which has no CPU "
                      "build on PyPI (requirements-test.txt says why); test_tiles_equal_hf_resize_kernel_* stands in")
  image = Image.fromarray(np.random.default_rng(1).integers(0, 256, size[::-1] + (3,), dtype=np.uint8))
  hf = transformers.Llama4ImageProcessor(size={"height": 28, "width": 28}, max_patches=6)(images=[image],
                                                                                          return_tensors="pt")
  ours, grid = L.tiles(image, L.TileOptions(tile_size=28, max_tiles=6))
  assert tuple(hf["aspect_ratios"][0].tolist()) == grid
  np.testing.assert_allclose(ours, hf["pixel_values"].float().numpy(), atol=2 / 255 * 2)


@pytest.mark.parametrize("size", [(60, 25), (25, 90), (57, 29), (300, 41), (1000, 250)])
def test_tiles_equal_hf_resize_kernel_without_torchvision(size):
  """HF's processor resizes the uint8 image with torchvision's resize (bilinear, antialias), which on CPU runs
  torch's uint8 antialiased bilinear kernel; built from that kernel, HF's tiles and thumbnail equal ours (Pillow's
  bilinear) within one uint8 level (after normalisation: 2/255 and bfloat16's rounding)."""
  width, height = size
  rgb = np.random.default_rng(2).integers(0, 256, (height, width, 3), dtype=np.uint8)
  options = L.TileOptions(tile_size=28, max_tiles=6)
  ours, grid = L.tiles(Image.fromarray(rgb), options)
  rows, cols = grid
  new_h, new_w = L._fit(height, width, grid, options)

  def kernel(out_h: int, out_w: int) -> np.ndarray:
    t = torch.tensor(rgb.transpose(2, 0, 1))[None]
    resized = torch.nn.functional.interpolate(t, size=(out_h, out_w), mode="bilinear", antialias=True,
                                              align_corners=False)
    return resized[0].numpy().transpose(1, 2, 0)

  canvas = np.zeros((rows * 28, cols * 28, 3), np.uint8)
  canvas[:new_h, :new_w] = kernel(new_h, new_w)
  expected = L._normalised(canvas, options).reshape(3, rows, 28, cols, 28).transpose(1, 3, 0, 2, 4)
  expected = expected.reshape(rows * cols, 3, 28, 28)
  if rows * cols > 1:
    expected = np.concatenate([expected, L._normalised(kernel(28, 28), options)[None]])
  assert ours.shape == expected.shape
  np.testing.assert_allclose(ours, expected, atol=2 / 255 + 0.016)


TOKENS = {"<|image_start|>": 1, "<|image_end|>": 2, "<|patch|>": 3, "<|tile_x_separator|>": 4,
          "<|tile_y_separator|>": 5, "<|image|>": 6}


@pytest.mark.parametrize("grid", [(1, 1), (1, 2), (2, 1), (2, 3), (4, 4)])
def test_prompt_expansion_equals_hf_processor(grid):
  processor = transformers.Llama4Processor
  per_tile = 144
  # replace_image_token's count of patch tokens per tile for Scout's 336-pixel tiles of 14-pixel patches.
  stand_in = types.SimpleNamespace(patch_size=14, downsample_ratio=4)
  stand_in._prompt_split_image = lambda ratio, count: processor._prompt_split_image(stand_in, ratio, count)
  text = processor.replace_image_token(stand_in, {"pixel_values": [np.zeros((3, 336, 336))], "aspect_ratios": [grid]},
                                       0)
  pieces = text.replace("|>", "|>\n").split()
  ids = L.ImageTokens(**{name: TOKENS[token] for name, token in (
      ("start", "<|image_start|>"), ("end", "<|image_end|>"), ("patch", "<|patch|>"),
      ("tile_x_separator", "<|tile_x_separator|>"), ("tile_y_separator", "<|tile_y_separator|>"),
      ("image", "<|image|>"))})
  assert L.expand_image(grid, per_tile, ids) == [TOKENS[piece] for piece in pieces]
  assert sum(piece == "<|patch|>" for piece in pieces) == per_tile * L.num_views(grid)
