"""Llama 4 chats with images through the HTTP front-end processes (serve_http_processes >= 1): a front end cuts
each image into Llama 4's tiles (a wide image: a tile grid and its thumbnail) without JAX and sends their pixel
values with the submit; the answers are the one-process server's, greedy, and bad images get its 400 bodies
(test_serve_processes_shared.py does the same for Gemma 3)."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import pytest

from tests.inference.test_serve_processes_shared import answered_alike

sys.path.insert(0, str(Path(__file__).parent.parent / "input_pipeline"))
from sft_fixtures import LLAMA4, LLAMA4_IMAGE_SPECIAL, write_tokenizer  # noqa: E402


@pytest.mark.slow  # two servers of a tiny Llama 4 with its vision tower (JAX start-up and compiles each)
def test_llama4_image_chats_through_two_front_ends_answer_as_the_one_process_server(tmp_path):
  from tests.test_serve_images import LLAMA4_SERVING, image_message, llama4_model_keys, png_url

  tokenizer = write_tokenizer(tmp_path / "tok", LLAMA4, LLAMA4_IMAGE_SPECIAL)
  keys = {**llama4_model_keys(), **LLAMA4_SERVING}
  wide = png_url(8, size=20, width=44, noise=True)  # a 1 x 2 tile grid and its thumbnail: 3 tiles
  chats = [image_message("what is this", wide), image_message("compare", png_url(2), wide),
           image_message("what is this", png_url(4, noise=True))]
  typed = [[{"role": "user", "content": "look <|image|> here"}],  # the image marker typed: text (test_image_text.py)
           [{"role": "user", "content": "look <|patch|> here"}]]  # a placeholder typed: text too
  bad = [image_message("hi", png_url(1), png_url(2), png_url(3)),  # more than serve_max_images
         image_message("hi", png_url(6, size=64)),  # more pixels than serve_max_image_pixels
         image_message("hi", png_url(5, size=40, noise=True)),  # more bytes than serve_max_image_bytes
         image_message("hi", "data:image/png;base64," + base64.b64encode(b"not an image").decode()),
         image_message("hi", "https://example.com/cat.png")]

  with answered_alike(tokenizer, keys, chats + typed, bad) as (_, _, expected):
    assert len({text for _, text in expected[:len(chats)]}) == len(chats)  # the images change the answer
