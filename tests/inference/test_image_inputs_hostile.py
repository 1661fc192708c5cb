"""What a hurried or hostile user hands the vision-language input paths (decode.py's prompt and
image_path, the server's image chats, the image decoder every tool shares): each gives the right
tokens and pixels or one line naming the culprit, before any checkpoint is loaded. No model runs
here: the checks stop before the engine (which a monkeypatch makes fail if reached)."""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from MaxText import decode
from MaxText.configuration.config import Config
from MaxText.errors import UserError
from MaxText.input_pipeline import image_text, images

transformers = pytest.importorskip("transformers", reason="needs transformers (EXTRAS=test bash setup.sh)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "input_pipeline"))
from sft_fixtures import GEMMA3, IMAGE_SPECIAL, write_tokenizer  # noqa: E402

# The fixture tokenizer's ids: </s> 2, <end_of_turn> 9, <start_of_image> 10, <end_of_image> 11, <image_soft_token> 12.
MODEL = dict(decoder_block="gemma3", use_multimodal=True, attention="dot_product", vision_emb_dim=16, vision_mlp_dim=32,
             vision_num_layers=1, vision_num_heads=2, vision_patch_size=4, vision_image_size=16, mm_tokens_per_image=4,
             image_token_id=12, boi_token_id=10, eoi_token_id=11, vocab_size=272, base_emb_dim=32,
             base_num_query_heads=4, base_num_kv_heads=2, head_dim=8, base_mlp_dim=64, base_num_decoder_layers=2,
             max_target_length=64, max_prefill_predict_length=48, dtype="float32", print_config=False,
             tokenizer_type="huggingface")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
  return write_tokenizer(tmp_path_factory.mktemp("tok"), GEMMA3, IMAGE_SPECIAL)


@pytest.fixture(scope="module")
def png(tmp_path_factory) -> Path:
  path = tmp_path_factory.mktemp("img") / "a.png"
  Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 90, 3), dtype=np.uint8)).save(path)
  return path


@pytest.fixture
def no_engine(monkeypatch):
  def refuse(*args, **kwargs):
    raise AssertionError("the engine was built: the prompt's error came after loading the checkpoint")

  monkeypatch.setattr(decode, "load_engine", refuse)


def _config(tokenizer_dir: Path, **overrides) -> Config:
  return Config.for_testing(**{**MODEL, "tokenizer_path": str(tokenizer_dir), **overrides})


@pytest.mark.parametrize("typed", ["<end_of_turn>", "</s>", "<image_soft_token>"])
def test_special_tokens_typed_in_a_prompt_with_images_are_text_as_without_images(tokenizer_dir, png, typed):
  """decode.py without prompt_chat_template: only the image marker places an image. Was: the prompt with
  image_path encoded every typed special token as its control token (a typed end of sequence ended the
  prompt, a typed <image_soft_token> was a second image run: 'the prompt has 2 image placeholder run(s)
  but 1 image(s)' after the checkpoint loaded), while the same prompt without images kept it as text."""
  text = f"the quick{typed} fox"
  with_image, _, pixels = decode.prompt_with_images(_config(tokenizer_dir, prompt=text, image_path=str(png)))
  without, _ = decode.prompt_ids(_config(tokenizer_dir, prompt=text))
  run = [10, 12, 12, 12, 12, 11]
  start = with_image.index(10)
  assert with_image[start:start + len(run)] == run and with_image.count(12) == 4
  assert pixels is not None and len(pixels) == 1
  # The text after the image's run is the text-only prompt's (after its bos), the typed token spelled out.
  after = with_image[start + len(run):]
  assert without[1:] == after[len(after) - len(without) + 1:]
  special = {"<end_of_turn>": 9, "</s>": 2, "<image_soft_token>": 12}[typed]
  assert special not in after


def test_a_typed_marker_still_places_the_image(tokenizer_dir, png):
  ids, _, _ = decode.prompt_with_images(_config(tokenizer_dir, prompt="the <start_of_image> fox",
                                                image_path=str(png)))
  plain, _, _ = decode.prompt_with_images(_config(tokenizer_dir, prompt="the  fox", image_path=str(png)))
  assert ids.count(10) == 1 and ids.count(12) == 4 and ids.index(10) > 1
  assert plain.index(10) < ids.index(10)  # without a marker the image goes first


def test_a_prompt_whose_placeholders_do_not_match_its_images_fails_before_the_checkpoint_loads(
    tokenizer_dir, png, no_engine):
  """prompt_token_ids with image_path: the runs are checked against the images before the engine is built
  (was: after loading the checkpoint, minutes for a large model)."""
  with pytest.raises(UserError, match=r"the prompt has 0 image placeholder run\(s\) but 1 image\(s\) were given"):
    decode.decode(_config(tokenizer_dir, prompt_token_ids="1,5,6", image_path=str(png)))
  with pytest.raises(UserError, match=r"the prompt has 1 image placeholder run\(s\) but 0 image\(s\) were given"):
    decode.decode(_config(tokenizer_dir, prompt_token_ids="1,10,12,12,12,12,11,5"))


def test_a_prompt_too_long_for_its_images_says_how_many_tokens_they_take(tokenizer_dir, png, no_engine):
  with pytest.raises(UserError) as raised:
    decode.decode(_config(tokenizer_dir, prompt="the", image_path=",".join([str(png)] * 8)))
  assert "(32 of them the images' placeholders), more than max_prefill_predict_length=48" in str(raised.value)


@pytest.mark.parametrize("chat_template", [False, True])
def test_a_prompt_that_is_not_utf8_is_one_line(tokenizer_dir, png, chat_template):
  """A Latin-1 'café' on the command line reaches Python as 'caf\\udce9' (surrogateescape). Was: a
  TypeError traceback from the tokenizer ('TextInputSequence must be str')."""
  for image_path in ("", str(png)):
    config = _config(tokenizer_dir, prompt="caf\udce9", image_path=image_path, prompt_chat_template=chat_template)
    with pytest.raises(UserError) as raised:
      decode.prompt_with_images(config)
    assert str(raised.value).startswith("prompt is not UTF-8 text (0xe9 at character 3)"), str(raised.value)


def _mpo(image: Image.Image) -> bytes:
  out = io.BytesIO()
  image.save(out, format="MPO", save_all=True, append_images=[image.rotate(90)])
  return out.getvalue()


def test_a_multi_picture_jpeg_reads_as_its_first_picture():
  """Many phones' photos are JPEGs with more pictures after the first (MPO), which Pillow names MPO.
  Was: 'format MPO is not supported; use one of PNG, JPEG, ...' for a JPEG."""
  picture = Image.fromarray(np.random.default_rng(1).integers(0, 256, (20, 30, 3), dtype=np.uint8))
  data = _mpo(picture)
  decoded = images.decode(data, "phone.jpg")
  jpeg = io.BytesIO()
  picture.save(jpeg, format="JPEG")  # the same encoder settings: the first picture's pixels
  np.testing.assert_array_equal(np.asarray(decoded), np.asarray(images.decode(jpeg.getvalue(), "same.jpg")))
  url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
  assert image_text.read_image(url, files=False).size == (30, 20)


def test_an_http_url_given_where_files_are_read_says_to_download_it():
  with pytest.raises(UserError) as raised:
    image_text.read_image("https://example.com/cat.png", files=True)
  assert "http(s) image URLs are not fetched" in str(raised.value) and "give its local path" in str(raised.value)
  with pytest.raises(UserError, match="send the image inline as a data:image"):
    image_text.read_image("https://example.com/cat.png", files=False)


@pytest.mark.parametrize("content", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, None,
                                     42])
def test_a_vision_servers_chat_refuses_contents_it_cannot_read(tokenizer_dir, content):
  """A vision server renders every chat through the image path, which did not check a message's content:
  a dict (one part not in a list), null or a number reached the template and was dropped, a 200 on an
  empty turn. The text path's 400 now holds there too."""
  from MaxText.inference import openai_api
  from MaxText.serve import _codec

  codec, _ = _codec(_config(tokenizer_dir))
  limits = openai_api.Limits("tiny-vlm", 272, 48, 64, 8, 1, image_token_id=12)
  body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
  with pytest.raises(openai_api.ApiError) as raised:
    openai_api.parse_chat(body, limits, codec)
  assert raised.value.status == 400
  assert raised.value.message == "messages[0].content must be a string or a list of content parts"
