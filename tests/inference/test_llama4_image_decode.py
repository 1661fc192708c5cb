"""Llama 4 decoding with images end to end, on a tiny random Llama4ForConditionalGeneration whose
image tokens are the fixture tokenizer's (tests/input_pipeline/sft_fixtures.py, LLAMA4): a
conversation with a wide image (a 1 x 3 tile grid and its thumbnail) and a one-tile image goes
through the chat template and Llama 4's image format (families/llama4_images.py) into ids
and tile pixel values; the engine's greedy tokens equal HF `generate` on them, and decode.py with
image_path (a converted checkpoint, the chat template) gives the same tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from MaxText.inference import image_chat
from MaxText.inference.engine import Engine, Request, serve
from MaxText.families import llama4_images
from MaxText.input_pipeline import chat
from decode_test_utils import one_device_mesh

pytest.importorskip("transformers", reason="needs transformers (EXTRAS=test bash setup.sh)")
sys.path.insert(0, str(Path(__file__).parents[1] / "input_pipeline"))
from sft_fixtures import LLAMA4, LLAMA4_IMAGE_IDS, LLAMA4_IMAGE_SPECIAL, write_tokenizer  # noqa: E402

TARGET, PREFILL, NEW = 144, 128, 6
TILE_TOKENS = 16  # the tiny tower's soft tokens per 32 x 32 tile


@pytest.fixture(scope="module")
def hf():
  import hf_families
  return hf_families


def tiny_llama4(hf):
  text = {**hf.MULTIMODAL_CONFIGS["llama4-vision"]["text_config"], "vocab_size": 320, "max_position_embeddings": 256}
  return hf.build_hf_multimodal_model("llama4-vision", boi_token_index=LLAMA4_IMAGE_IDS["boi_token_id"],
                                      eoi_token_index=LLAMA4_IMAGE_IDS["eoi_token_id"],
                                      image_token_index=LLAMA4_IMAGE_IDS["image_token_id"], text_config=text)


@pytest.fixture(scope="module")
def setup(hf, tmp_path_factory):
  """(tokenizer directory, HF model, our config, our parameters, the two image paths)."""
  root = tmp_path_factory.mktemp("llama4_decode")
  tokenizer_dir = write_tokenizer(root / "tok", LLAMA4, LLAMA4_IMAGE_SPECIAL)
  model = tiny_llama4(hf)
  config = hf.our_config(model, dtype="float32", max_target_length=TARGET, max_prefill_predict_length=PREFILL,
                         tokenizer_type="huggingface", tokenizer_path=str(tokenizer_dir))
  rng = np.random.default_rng(0)
  paths = []
  for name, (width, height) in (("wide.png", (70, 30)), ("square.png", (20, 20))):
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(root / name)
    paths.append(str(root / name))
  return tokenizer_dir, model, config, hf.our_params(model, config, root / "staging"), paths


def messages(paths: list[str], text: str = "compare") -> list[dict]:
  return [{"role": "user", "content": [{"type": "image", "image": paths[0]}, {"type": "text", "text": text},
                                       {"type": "image", "image": paths[1]}]}]


def test_the_prompt_holds_each_images_tile_run_and_its_tiles(setup):
  tokenizer_dir, _, config, _, paths = setup
  tokenizer = chat.load_chat_tokenizer(str(tokenizer_dir))
  ids, images = image_chat.conversation_ids(tokenizer, messages(paths), config.model, files=True)
  assert images is not None and images.pixels_MCRR.shape == (3 + 1 + 1, 3, 32, 32)  # 1 x 3 tiles, thumbnail, 1 tile
  named = dict(zip(("tile_x_separator", "tile_y_separator", "image"),
                   tokenizer.convert_tokens_to_ids(["<|tile_x_separator|>", "<|tile_y_separator|>", "<|image|>"])))
  tokens = llama4_images.ImageTokens(start=11, end=12, patch=13, **named)
  wide, square = (llama4_images.expand_image(grid, TILE_TOKENS, tokens) for grid in ((1, 3), (1, 1)))
  text = chat.load_chat_tokenizer(str(tokenizer_dir))("compare", add_special_tokens=False)["input_ids"]
  start = ids.index(11)
  assert ids[start:start + len(wide) + len(text) + len(square)] == wide + text + square
  expected, _ = llama4_images.tiles(Image.open(paths[0]), llama4_images.TileOptions(tile_size=32))
  np.testing.assert_array_equal(images.pixels_MCRR[:4], expected)


def test_greedy_decode_with_images_equals_hf_generate(hf, setup):
  tokenizer_dir, model, config, params, paths = setup
  ids, images = image_chat.conversation_ids(chat.load_chat_tokenizer(str(tokenizer_dir)), messages(paths),
                                            config.model, files=True)
  engine = Engine(config, mesh=one_device_mesh())
  ours = serve(engine, params, [Request(ids, NEW, images=images)])[0].output
  assert ours == hf.hf_generate(model, ids, images.pixels_MCRR, NEW)
  other = images.of(images.pixels_MCRR[::-1].copy())  # the same prompt, the views in another order
  assert serve(engine, params, [Request(ids, NEW, images=other)])[0].output != ours


@pytest.mark.slow  # a checkpoint conversion and decode.py's two compiles
def test_decode_py_with_image_path_equals_hf_generate(hf, setup, tmp_path):
  from MaxText import decode, startup
  from MaxText.convert import hf_to_maxtext

  tokenizer_dir, model, config, _, paths = setup
  model.save_pretrained(str(tmp_path / "hf"))
  hf_to_maxtext.convert(str(tmp_path / "hf"), str(tmp_path / "ckpt"), [])
  base = str(Path(__file__).resolve().parents[2] / "configs" / "base.yml")
  run = startup.start(decode.TOOL, ["decode", base, f"load_parameters_path={tmp_path / 'ckpt'}", "dtype=float32",
                                    f"max_target_length={TARGET}", f"max_prefill_predict_length={PREFILL}",
                                    "tokenizer_type=huggingface", f"tokenizer_path={tokenizer_dir}",
                                    "prompt=compare", "prompt_chat_template=True",
                                    f"image_path={paths[0]},{paths[1]}"]).config
  got = decode.decode(run)
  # decode.py puts the images first, then the prompt, in one user turn.
  ids, images = image_chat.conversation_ids(
      chat.load_chat_tokenizer(str(tokenizer_dir)),
      [{"role": "user", "content": [{"type": "image", "image": p} for p in paths] + [{"type": "text",
                                                                                       "text": "compare"}]}],
      config.model, files=True)
  assert got == hf.hf_generate(model, ids, images.pixels_MCRR, TARGET - len(ids) + 1)
