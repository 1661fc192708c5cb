"""The server with a vision-language model (a tiny random Gemma 3 with its vision tower and a
Gemma-3-style tokenizer; a tiny Llama 4 with Llama 4's tile prompts), driven by the official
`openai` client on 127.0.0.1: a chat request with an image_url content part gets the greedy
answer of the engine alone on the same conversation (Llama 4: chunks that cut between tiles,
prefix pages keyed by the tiles' pixels);
an http(s) URL, too many or too large images, an undecodable or unsupported image, and images sent
to a text-only model each get a 400 JSON error (a marker typed in text is text: test_image_text.py);
images are decoded off the event loop."""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="needs openai (EXTRAS=test bash setup.sh)")
uvicorn = pytest.importorskip("uvicorn", reason="needs uvicorn (pip install -r requirements.txt)")
pytest.importorskip("transformers", reason="chat templates need transformers (EXTRAS=test bash setup.sh)")
from PIL import Image  # noqa: E402

from MaxText.configuration.config import Config  # noqa: E402
from MaxText.inference import image_chat, openai_api  # noqa: E402
from MaxText.inference.engine import Engine, Request, serve  # noqa: E402
from MaxText.input_pipeline import chat  # noqa: E402
from MaxText.serve import _codec, build_app, build_server  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "inference"))
sys.path.insert(0, str(Path(__file__).parent / "input_pipeline"))
from decode_test_utils import one_device_mesh  # noqa: E402
from tests.uvicorn_thread import UvicornThread, answers_health_while_held  # noqa: E402
from sft_fixtures import GEMMA3, IMAGE_SPECIAL, LLAMA4, LLAMA4_IMAGE_IDS, LLAMA4_IMAGE_SPECIAL, write_tokenizer  # noqa: E402

# The fixture tokenizer's ids: <start_of_image> 10, <end_of_image> 11, <image_soft_token> 12.
MODEL = dict(decoder_block="gemma3", use_multimodal=True, attention="dot_product", vision_emb_dim=16,
             vision_mlp_dim=32, vision_num_layers=1, vision_num_heads=2, vision_patch_size=4, vision_image_size=16,
             mm_tokens_per_image=4, image_token_id=12, boi_token_id=10, eoi_token_id=11, vocab_size=272,
             base_emb_dim=32, base_num_query_heads=4, base_num_kv_heads=2, head_dim=8, base_mlp_dim=64,
             base_num_decoder_layers=2, max_target_length=64, max_prefill_predict_length=48, dtype="float32",
             print_config=False, tokenizer_type="huggingface", add_bos=False)
# Paged with prefix caching and chunks of 8 (two images' runs of 4 fit; one may be cut before).
SERVING = dict(kv_cache_layout="paged", kv_page_size=4, prefill_chunk_size=8, serve_max_slots=2,
               serve_max_tokens=8, serve_model_name="tiny-vlm", serve_max_images=2, serve_max_image_bytes=3000,
               serve_max_image_pixels=48 * 48)
EOS = 2


def png_url(seed: int, size: int = 24, noise: bool = False, kind: str = "PNG", width: int = 0) -> str:
  rng = np.random.default_rng(seed)
  shape = (size, width or size, 3)
  pixels = (rng.integers(0, 256, shape) if noise else np.broadcast_to(rng.integers(0, 256, 3), shape)).astype(np.uint8)
  buffer = io.BytesIO()
  Image.fromarray(pixels).save(buffer, kind)
  return f"data:image/{kind.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def image_message(text: str, *urls: str) -> list[dict]:
  parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
  return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


class Served:
  def __init__(self, tmp: Path, model: dict = MODEL, template: str = GEMMA3, special: list[str] = IMAGE_SPECIAL,
               serving: dict = SERVING):
    self.model = model
    self.tokenizer_dir = write_tokenizer(tmp / "tok", template, special)
    self.config = Config.for_testing(**model, **serving, tokenizer_path=str(self.tokenizer_dir))
    self.server = build_server(self.config, mesh=one_device_mesh())
    self.params = self.server.scheduler.params
    self.http = UvicornThread(build_app(self.server, api_key="k"))
    self.url = self.http.url
    self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="k", max_retries=0, timeout=120)

  def engine_answer(self, messages: list[dict], max_tokens: int) -> str:
    """The same conversation through the engine alone (dense cache, whole prefill), greedy."""
    tokenizer = chat.load_chat_tokenizer(str(self.tokenizer_dir))
    ids, images = image_chat.conversation_ids(tokenizer, messages, self.config.model, files=False)
    engine = Engine(Config.for_testing(**self.model), mesh=one_device_mesh())
    tokens = serve(engine, self.params, [Request(ids, max_tokens, images=images)], eos_id=EOS)[0].output
    return self.server.codec.decode(tokens)

  def close(self) -> None:
    self.http.close()
    self.server.scheduler.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  s = Served(tmp_path_factory.mktemp("serve_images"))
  yield s
  s.close()


def test_an_image_chat_gets_the_engines_greedy_answer(served):
  for messages in (image_message("what is this", png_url(1)), image_message("compare", png_url(2), png_url(3))):
    answer = served.client.chat.completions.create(model="tiny-vlm", messages=messages, max_tokens=6, temperature=0)
    assert answer.choices[0].message.content == served.engine_answer(messages, 6)
  one, other = (served.client.chat.completions.create(model="tiny-vlm", messages=image_message("what is this", url),
                                                      max_tokens=6, temperature=0).choices[0].message.content
                for url in (png_url(1), png_url(4)))
  assert one != other  # same text, another image: no cached page of the first image is reused
  assert served.server.scheduler.load()["pages_reserved"] == 0


@pytest.mark.parametrize("messages, message", [
    (image_message("hi", "https://example.com/cat.png"), "http(s) image URLs are not fetched"),
    (image_message("hi", png_url(1), png_url(2), png_url(3)), "at most serve_max_images=2"),
    (image_message("hi", png_url(5, size=40, noise=True)), "larger than serve_max_image_bytes=3000"),
    (image_message("hi", png_url(6, size=64)), "64x64 pixels is larger than serve_max_image_pixels=2304"),
    (image_message("hi", "data:image/png;base64," + base64.b64encode(b"not an image").decode()),
     "cannot be decoded as an image"),
    (image_message("hi", png_url(7, kind="TIFF")), "TIFF"),
    (image_message("hi", "data:text/plain;base64,aGk="), "a data URL must read data:image/"),
    (image_message("hi", "data:image/png;name=a\nb;base64,@@"), "image 'data:image/png;name=a\\nb;base64': its base64"),
], ids=["http", "too-many", "bytes", "pixels", "undecodable", "unsupported", "not-an-image-url", "line-break-in-header"])
def test_bad_images_get_400_json_errors(served, messages, message):
  with pytest.raises(openai.BadRequestError) as raised:
    served.client.chat.completions.create(model="tiny-vlm", messages=messages, max_tokens=4)
  assert raised.value.status_code == 400 and message in raised.value.body["message"], raised.value.body
  assert "\n" not in raised.value.body["message"]


def test_placeholder_tokens_without_images_are_a_400(served):
  with pytest.raises(openai.BadRequestError, match="image placeholder token 12 but no image"):
    served.client.completions.create(model="tiny-vlm", prompt=[5, 12, 12, 12, 12, 6], max_tokens=2)


def test_a_text_only_model_refuses_images(served, tmp_path):
  config = Config.for_testing(**{**MODEL, "use_multimodal": False, "attention": "autoselected"},
                              tokenizer_path=str(served.tokenizer_dir))
  codec, _ = _codec(config)
  limits = openai_api.Limits("tiny", 272, 48, 64, 8, 1)
  with pytest.raises(openai_api.ApiError, match="a text-only model") as raised:
    openai_api.parse_chat({"messages": image_message("hi", png_url(1))}, limits, codec)
  assert raised.value.status == 400


def test_an_image_chat_the_template_refuses_is_a_400(tmp_path):
  """The template's raise_exception (roles that do not alternate) on an image chat was a TemplateError: a 500."""
  refusing = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
  config = Config.for_testing(**MODEL, tokenizer_path=str(write_tokenizer(tmp_path / "tok", refusing, IMAGE_SPECIAL)))
  codec, _ = _codec(config)
  with pytest.raises(openai_api.ApiError) as raised:
    openai_api.parse_chat({"messages": image_message("hi", png_url(1))}, openai_api.Limits("tiny", 272, 48, 64, 8, 1),
                          codec)
  assert raised.value.status == 400 and "\n" not in raised.value.message
  assert raised.value.message.startswith("the chat template cannot render the messages: TemplateError: Conversation "
                                         "roles must alternate"), raised.value.message


def test_a_decompression_bomb_is_refused_before_decoding(tmp_path):
  """A 9400x9400 PNG of one colour (a few hundred KB as a data URL, 265 MB decoded) under
  serve_max_image_bytes: the request gets its 400 from the image's header, fast and without the
  decoded megabytes."""
  from big_images import peak_rss_growth, solid_png

  bomb = "data:image/png;base64," + base64.b64encode(solid_png(9400, 9400)).decode()
  config = Config.for_testing(**MODEL, **{**SERVING, "serve_max_image_bytes": 1 << 20},
                              tokenizer_path=str(write_tokenizer(tmp_path / "tok", GEMMA3, IMAGE_SPECIAL)))
  codec, _ = _codec(config)
  limits = openai_api.Limits("tiny-vlm", 272, 48, 64, 8, 1, image_token_id=12)
  body = {"messages": image_message("what is this", bomb), "max_tokens": 2}
  seconds, grown, raised = peak_rss_growth(lambda: openai_api.parse_chat(body, limits, codec))
  assert isinstance(raised, openai_api.ApiError) and raised.status == 400, raised
  assert "larger than serve_max_image_pixels=2304" in raised.message, raised.message
  assert grown < 32 << 20, (seconds, grown)  # not decoded (243 MB); time is no test here


def test_images_are_decoded_off_the_event_loop(served, monkeypatch):
  """While one request's images are being read (held until /health has answered), the server keeps
  answering other requests."""
  answer = answers_health_while_held(served.url, monkeypatch, image_chat.ImageChat, "ids", lambda: served.client.chat
                                     .completions.create(model="tiny-vlm", messages=image_message("what", png_url(1)),
                                                         max_tokens=2, temperature=0))
  assert answer.choices[0].message.content is not None


# ---- Llama 4: a tiny random model (families/llama4.py's reference) with the fixture tokenizer's
# image tokens, 32 x 32 tiles of 16 soft tokens.

def llama4_model_keys() -> dict:
  import transformers

  from MaxText import families

  fields = dict(families.multimodal_reference_hf_configs()["llama4-vision"])
  fields.update(boi_token_index=LLAMA4_IMAGE_IDS["boi_token_id"], eoi_token_index=LLAMA4_IMAGE_IDS["eoi_token_id"],
                image_token_index=LLAMA4_IMAGE_IDS["image_token_id"],
                text_config={**fields["text_config"], "vocab_size": 320, "max_position_embeddings": 256})
  hf = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields).to_dict()
  return {**families.family_for_hf_config(hf).model_keys(hf), "max_target_length": 128,
          "max_prefill_predict_length": 112, "dtype": "float32", "print_config": False,
          "tokenizer_type": "huggingface", "add_bos": False}


# Chunks of 20: a wide image's tile runs (16 placeholders and a separator each) fall in different
# chunks, which Llama 4's causal text stack allows; each tile's run stays whole.
LLAMA4_SERVING = {**SERVING, "prefill_chunk_size": 20}


@pytest.fixture(scope="module")
def served_llama4(tmp_path_factory):
  s = Served(tmp_path_factory.mktemp("serve_llama4"), llama4_model_keys(), LLAMA4, LLAMA4_IMAGE_SPECIAL,
             LLAMA4_SERVING)
  yield s
  s.close()


@pytest.mark.slow  # a second tiny model's server and engine: about a minute on 2 shared cores
def test_a_llama4_image_chat_gets_the_engines_greedy_answer(served_llama4):
  wide = png_url(8, size=20, width=44, noise=True)  # a 1 x 2 tile grid and its thumbnail: 3 tiles
  for messages in (image_message("what is this", wide), image_message("compare", png_url(2), wide)):
    answer = served_llama4.client.chat.completions.create(model="tiny-vlm", messages=messages, max_tokens=6,
                                                          temperature=0)
    assert answer.choices[0].message.content == served_llama4.engine_answer(messages, 6)
  # The same text with another image shares only the pages before the image's first tile run; the
  # same image again shares its pages too (prefix caching keys image pages by the tiles' pixels).
  other = image_message("what is this", png_url(9, size=20, width=44, noise=True))
  ids, _ = image_chat.conversation_ids(chat.load_chat_tokenizer(str(served_llama4.tokenizer_dir)), other,
                                       served_llama4.config.model, files=False)
  first_tile = ids.index(LLAMA4_IMAGE_IDS["image_token_id"])
  page = SERVING["kv_page_size"]

  def cached_tokens(messages: list[dict]) -> tuple[str, int]:
    before = served_llama4.server.scheduler.load()["prefix_cached_tokens"]
    answer = served_llama4.client.chat.completions.create(model="tiny-vlm", messages=messages, max_tokens=6,
                                                          temperature=0).choices[0].message.content
    return answer, served_llama4.server.scheduler.load()["prefix_cached_tokens"] - before

  answer, cached = cached_tokens(other)
  assert cached == first_tile // page * page and answer == served_llama4.engine_answer(other, 6)
  assert cached_tokens(image_message("what is this", wide))[1] > cached
  assert served_llama4.server.scheduler.load()["pages_reserved"] == 0

