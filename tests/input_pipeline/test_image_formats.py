"""Each family's image format (Family.image_format: families/image_format.py) through its callers: Gemma 3's
pan-and-scan key gives the prompt and pixel values of HF's Gemma3Processor with do_pan_and_scan
(its Pillow image processor, Gemma3ImageProcessorPil: torchvision is not installed) in a chat
request and a fine-tuning record alike; Llama 4's records become one placeholder run per tile,
counted against max_images_per_row, truncated and packed without splitting an image's tiles; and
the one-line errors of the keys and formats."""

from __future__ import annotations

import base64
import dataclasses
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from MaxText.configuration.config import Config
from MaxText.configuration.vision_config import VisionConfig
from MaxText.errors import ConfigError, UserError
from MaxText.inference import image_chat
from MaxText.families import image_format, llama4_images
from MaxText.input_pipeline import chat, image_sft, image_text
from MaxText.input_pipeline.packing import DocumentCursor, ImageDocument, ImageSlots, pack_row
from sft_fixtures import GEMMA3, IMAGE_SPECIAL, LLAMA4, LLAMA4_IMAGE_IDS, LLAMA4_IMAGE_SPECIAL, write_tokenizer

transformers = pytest.importorskip("transformers", reason="needs transformers (EXTRAS=test bash setup.sh)")

# The fixture tokenizer's Gemma 3 ids: <start_of_image> 10, <end_of_image> 11, <image_soft_token> 12.
GEMMA3_MODEL = dict(decoder_block="gemma3", use_multimodal=True, attention="dot_product", vision_emb_dim=16,
                    vision_mlp_dim=32, vision_num_layers=1, vision_num_heads=2, vision_patch_size=4,
                    vision_image_size=16, mm_tokens_per_image=4, image_token_id=12, boi_token_id=10, eoi_token_id=11,
                    vocab_size=272, print_config=False)
PAN_AND_SCAN = dict(image_pan_and_scan=True, image_pan_and_scan_min_crop_size=16, image_pan_and_scan_max_num_crops=3,
                    image_pan_and_scan_min_ratio=1.5)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
  return write_tokenizer(tmp_path_factory.mktemp("gemma3_tok"), GEMMA3, IMAGE_SPECIAL)


def _wide(width: int = 130, height: int = 40, seed: int = 0) -> Image.Image:
  return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _data_url(image: Image.Image) -> str:
  buffer = io.BytesIO()
  image.save(buffer, "PNG")
  return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _hf_gemma3(tokenizer_dir: Path, text: str, image: Image.Image) -> dict:
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir), extra_special_tokens={
      "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
  processor = transformers.Gemma3Processor(
      image_processor=transformers.Gemma3ImageProcessorPil(size={"height": 16, "width": 16}), tokenizer=tokenizer,
      image_seq_length=4)
  return processor(text=[text], images=[[image]], do_pan_and_scan=True, pan_and_scan_min_crop_size=16,
                   pan_and_scan_max_num_crops=3, pan_and_scan_min_ratio_to_activate=1.5, add_special_tokens=False,
                   return_tensors="np")


def test_pan_and_scan_key_gives_hf_gemma3_processors_prompt_and_pixels(gemma3_dir):
  """The server's and decode.py's path (image_chat.conversation_ids) and fine-tuning's
  (image_sft.ImageSftEncoder) read the key from the config."""
  config = Config.for_testing(**GEMMA3_MODEL, **PAN_AND_SCAN)
  image = _wide()
  messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(image)}},
                                           {"type": "text", "text": "what is this"}]}]
  tokenizer = chat.load_chat_tokenizer(str(gemma3_dir))
  ids, images = image_chat.conversation_ids(tokenizer, messages, config.model, files=False)
  templated, _ = image_text.split_images(messages)
  hf = _hf_gemma3(gemma3_dir, tokenizer.apply_chat_template(templated, tokenize=False, add_generation_prompt=True),
                  image)
  assert hf["pixel_values"].shape == (4, 3, 16, 16)  # the image and its 3 crops
  assert ids == hf["input_ids"][0].tolist()
  assert images is not None
  np.testing.assert_allclose(images.pixels_MCRR, hf["pixel_values"], atol=1e-6, rtol=0)

  record = {"messages": [*messages, {"role": "assistant", "content": "a fox"}]}
  document = image_sft.ImageSftEncoder(tokenizer, 256, True, True, True, config.model.vision, "gemma3", 4)(record)
  assert isinstance(document, ImageDocument) and document.image_of_run.tolist() == [0, 0, 0, 0]
  np.testing.assert_allclose(document.pixels, hf["pixel_values"], atol=1e-6, rtol=0)
  np.testing.assert_array_equal(document.tokens[0][:len(ids) - 4], ids[:-4])  # up to the generation prompt
  without = Config.for_testing(**GEMMA3_MODEL)
  assert len(image_chat.conversation_ids(tokenizer, messages, without.model, files=False)[1]) == 1  # off: no crops
  with pytest.raises(UserError) as raised:
    image_sft.ImageSftEncoder(tokenizer, 256, True, True, True, config.model.vision, "gemma3", 3)(record)
  assert ("1 image(s) give 4 image views (each image, and each of its pan-and-scan crops), more than "
          "max_images_per_row=3") in str(raised.value) and "image_pan_and_scan_max_num_crops" in str(raised.value)


# ---- Llama 4 records: 8 x 8 tiles of 4 soft tokens, at most 4 tiles per image.

def _llama4_vision() -> VisionConfig:
  fields = {f.name: 0 for f in dataclasses.fields(VisionConfig)}
  return VisionConfig(**{**fields, "use_multimodal": True, "mm_tokens_per_image": 4, "vision_image_size": 8,
                         "image_max_tiles": 4, **LLAMA4_IMAGE_IDS, "freeze_vision_encoder": False,
                         "freeze_multimodal_projector": False, "image_pan_and_scan": False})


@pytest.fixture(scope="module")
def llama4_tokenizer(tmp_path_factory):
  return chat.load_chat_tokenizer(str(write_tokenizer(tmp_path_factory.mktemp("llama4_tok"), LLAMA4,
                                                      LLAMA4_IMAGE_SPECIAL)))


def _answer_with_images(*paths: str) -> dict:
  """Images after the trained text, so a truncation inside them keeps a trainable sample."""
  return {"messages": [{"role": "user", "content": "what is this"},
                       {"role": "assistant", "content": [{"type": "text", "text": "a red fox"},
                                                         *({"type": "image", "image": p} for p in paths)]}]}


def _encoder(tokenizer, length: int = 512, max_images: int = 8) -> image_sft.ImageSftEncoder:
  return image_sft.ImageSftEncoder(tokenizer, length, True, True, True, _llama4_vision(), "llama4", max_images)


def test_a_llama4_record_has_a_run_per_tile_and_its_tiles_pixels(llama4_tokenizer, tmp_path):
  _wide(20, 8).save(tmp_path / "wide.png")  # a 1 x 3 grid of 8-pixel tiles, and the thumbnail
  _wide(6, 6, seed=1).save(tmp_path / "small.png")  # one tile
  document = _encoder(llama4_tokenizer)(_answer_with_images(str(tmp_path / "wide.png"), str(tmp_path / "small.png")))
  assert isinstance(document, ImageDocument)
  assert document.image_of_run.tolist() == [0, 0, 0, 0, 1] and (document.runs[:, 1] - document.runs[:, 0] == 4).all()
  options = llama4_images.TileOptions(tile_size=8, max_tiles=4)
  expected = np.concatenate([llama4_images.tiles(Image.open(tmp_path / name), options)[0]
                             for name in ("wide.png", "small.png")])
  np.testing.assert_array_equal(document.pixels, expected)
  text = llama4_tokenizer.decode(document.tokens[0])
  tile = "<|patch|>" * 4
  wide_run = (f"<|image_start|>{tile}<|tile_x_separator|>{tile}<|tile_x_separator|>{tile}<|tile_y_separator|>"
              f"<|image|>{tile}<|image_end|>")
  assert f"a red fox{wide_run}<|image_start|><|image|>{tile}<|image_end|><|eot|>" in text, text
  with pytest.raises(UserError) as raised:  # 5 tiles for 4 slots
    _encoder(llama4_tokenizer, max_images=4)(_answer_with_images(str(tmp_path / "wide.png"),
                                                                 str(tmp_path / "small.png")))
  assert ("2 image(s) give 5 tiles (each image's tiles, and its global thumbnail when it has several), more than "
          "max_images_per_row=4") in str(raised.value) and "lower image_max_tiles" in str(raised.value)


def test_truncation_falls_before_an_image_whose_tiles_it_would_cut(llama4_tokenizer, tmp_path):
  _wide(20, 8).save(tmp_path / "wide.png")
  record = _answer_with_images(str(tmp_path / "wide.png"), str(tmp_path / "wide.png"))
  full = _encoder(llama4_tokenizer)(record)
  assert isinstance(full, ImageDocument) and len(full.runs) == 8
  # Inputs ending between the second image's first and second tile runs: the whole image goes.
  short = _encoder(llama4_tokenizer, length=int(full.runs[5][0]))(record)
  assert isinstance(short, ImageDocument) and short.tokens.shape[1] == full.runs[4][0]
  np.testing.assert_array_equal(short.runs, full.runs[:4])
  np.testing.assert_array_equal(short.pixels, full.pixels[:4])


def _tiled_doc(length: int, images: list[list[int]]) -> ImageDocument:
  """Tokens t, except runs of 3 tokens (id 7) at each image's run starts; view v has pixels v + 1."""
  tokens = np.arange(length, dtype=np.int32) + 100
  starts = [start for image in images for start in image]
  for start in starts:
    tokens[start:start + 3] = 7
  pixels = np.stack([np.full((3, 2, 2), v + 1, np.float32) for v in range(len(starts))])
  owners = np.repeat(np.arange(len(images), dtype=np.int32), [len(image) for image in images])
  return ImageDocument(np.stack([tokens, np.ones_like(tokens)]), pixels,
                       np.asarray([[s, s + 3] for s in starts], np.int32), owners)


def _rows(docs: list, length: int, per_row: int) -> list[dict]:
  cursor, rows = DocumentCursor(lambda index: iter(docs[index:]), max_empty_run=len(docs)), []
  while (row := pack_row(cursor, length, True, ImageSlots(per_row=per_row, size=2))) is not None:
    rows.append(row)
  return rows


def test_packing_never_splits_an_images_tiles_between_rows():
  # Image 0: one view at 1; image 1: views at 5 and 9. A row of 16 pairs with 2 slots holds image 0
  # and then has one slot left: image 1 (two tiles) starts the next row, whole.
  rows = _rows([_tiled_doc(20, [[1], [5, 9]])], 16, 2)
  assert [[float(p[0, 0, 0]) for p in row["pixel_values"] if p.any()] for row in rows] == [[1.0], [2.0, 3.0]]
  assert [int((row["inputs"] == 7).sum()) for row in rows] == [3, 6]
  # A row that would end between image 1's two runs ends before its first one instead.
  rows = _rows([_tiled_doc(20, [[1], [5, 11]])], 12, 3)
  assert [int((row["inputs"] == 7).sum()) for row in rows] == [3, 6, 0]
  assert rows[0]["inputs_segmentation"].tolist() == [1] * 5 + [0] * 7


def test_an_image_with_more_views_than_a_rows_slots_is_one_error_line():
  with pytest.raises(UserError, match="an image's 3 views need more than max_images_per_row=2 slots"):
    _rows([_tiled_doc(20, [[1, 5, 9]])], 16, 2)


# ---- the formats' and keys' one-line errors

def test_a_tokenizer_without_llama4s_image_tokens_is_one_error_line(gemma3_dir):
  gemma3_tokenizer = chat.load_chat_tokenizer(str(gemma3_dir))
  one_tile = image_format.PreparedImage(np.zeros((1, 3, 8, 8), np.float32), (1, 1))
  with pytest.raises(UserError, match=r"the tokenizer has no <\|image\|> token, which Llama 4's image prompts need"):
    image_text.expand_image_markers("look", gemma3_tokenizer, _llama4_vision(), "llama4", [one_tile])


def test_a_llama4_image_without_its_grid_is_refused(llama4_tokenizer):
  views = image_format.PreparedImage(np.zeros((2, 3, 8, 8), np.float32), (1, 2))  # 1 x 2 needs the thumbnail too
  with pytest.raises(UserError, match=r"got grid \(1, 2\) for 2 view\(s\)"):
    image_text.expand_image_markers("<|image|>", llama4_tokenizer, _llama4_vision(), "llama4", [views])


LLAMA4_MODEL = dict(decoder_block="llama4", use_multimodal=True, vision_emb_dim=32, vision_mlp_dim=128,
                    vision_num_layers=2, vision_num_heads=4, vision_patch_size=4, vision_image_size=32,
                    mm_tokens_per_image=16, vision_pixel_shuffle_ratio=0.5, vision_adapter_dim=48, image_token_id=122,
                    boi_token_id=120, eoi_token_id=121, vocab_size=128, attention_layer_pattern=["global"],
                    print_config=False)


@pytest.mark.parametrize("model, overrides, message", [
    (LLAMA4_MODEL, {"image_pan_and_scan": True}, "image_pan_and_scan=True is Gemma 3's option; decoder_block "
                                                 "'llama4' cuts images its own way (Llama 4: image_max_tiles)"),
    (LLAMA4_MODEL, {"image_max_tiles": 0}, "image_max_tiles must be a whole number >= 1, got 0"),
    (GEMMA3_MODEL, {**PAN_AND_SCAN, "image_pan_and_scan_max_num_crops": 1},
     "image_pan_and_scan_max_num_crops must be >= 2"),
    (GEMMA3_MODEL, {"image_pan_and_scan_min_crop_size": 0}, "image_pan_and_scan_min_crop_size must be a whole number"),
    (GEMMA3_MODEL, {"image_pan_and_scan_min_ratio": 0.5}, "image_pan_and_scan_min_ratio must be >= 1"),
], ids=["pan-and-scan-on-llama4", "tiles", "crops", "crop-size", "ratio"])
def test_image_option_keys_are_checked_in_one_line(model, overrides, message):
  with pytest.raises(ConfigError) as raised:
    Config.for_testing(**{**model, **overrides})
  assert message in str(raised.value) and "\n" not in str(raised.value), str(raised.value)
