"""The server with a vision-language model (a tiny random Gemma 3 with its vision tower and a
Gemma-3-style tokenizer), driven by the official `openai` client on 127.0.0.1: a chat request with
an image_url content part gets the greedy answer of the engine alone on the same conversation;
an http(s) URL, too many or too large images, an undecodable or unsupported image, a marker
typed without its image, and images sent to a text-only model each get a 400 JSON error; images
are decoded off the event loop."""

from __future__ import annotations

import base64
import io
import sys
import threading
import time
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
from sft_fixtures import GEMMA3, IMAGE_SPECIAL, write_tokenizer  # noqa: E402

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


def png_url(seed: int, size: int = 24, noise: bool = False, kind: str = "PNG") -> str:
  rng = np.random.default_rng(seed)
  pixels = (rng.integers(0, 256, (size, size, 3)) if noise
            else np.broadcast_to(rng.integers(0, 256, 3), (size, size, 3))).astype(np.uint8)
  buffer = io.BytesIO()
  Image.fromarray(pixels).save(buffer, kind)
  return f"data:image/{kind.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def image_message(text: str, *urls: str) -> list[dict]:
  parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
  return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


class Served:
  def __init__(self, tmp: Path):
    self.tokenizer_dir = write_tokenizer(tmp / "tok", GEMMA3, IMAGE_SPECIAL)
    self.config = Config.for_testing(**MODEL, **SERVING, tokenizer_path=str(self.tokenizer_dir))
    self.server = build_server(self.config, mesh=one_device_mesh())
    self.params = self.server.scheduler.params
    self.uv = uvicorn.Server(uvicorn.Config(build_app(self.server, api_key="k"), host="127.0.0.1", port=0,
                                            log_level="warning"))
    self.thread = threading.Thread(target=self.uv.run, daemon=True)
    self.thread.start()
    deadline = time.monotonic() + 60
    while not self.uv.started:
      assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
      time.sleep(0.05)
    port = self.uv.servers[0].sockets[0].getsockname()[1]
    self.url = f"http://127.0.0.1:{port}"
    self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="k", max_retries=0, timeout=120)

  def engine_answer(self, messages: list[dict], max_tokens: int) -> str:
    """The same conversation through the engine alone (dense cache, whole prefill), greedy."""
    tokenizer = chat.load_chat_tokenizer(str(self.tokenizer_dir))
    ids, images = image_chat.conversation_ids(tokenizer, messages, self.config.model, files=False)
    engine = Engine(Config.for_testing(**MODEL), mesh=one_device_mesh())
    tokens = serve(engine, self.params, [Request(ids, max_tokens, images=images)], eos_id=EOS)[0].output
    return self.server.codec.decode(tokens)

  def close(self) -> None:
    self.uv.should_exit = True
    self.thread.join(30)
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
    ([{"role": "user", "content": "look <start_of_image> here"}], "1 image marker(s)"),
], ids=["http", "too-many", "bytes", "pixels", "undecodable", "unsupported", "not-an-image-url", "marker"])
def test_bad_images_get_400_json_errors(served, messages, message):
  with pytest.raises(openai.BadRequestError) as raised:
    served.client.chat.completions.create(model="tiny-vlm", messages=messages, max_tokens=4)
  assert raised.value.status_code == 400 and message in raised.value.body["message"], raised.value.body


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


def test_images_are_decoded_off_the_event_loop(served, monkeypatch):
  """While one request's images are being read (held here until /health has answered), the
  server keeps answering other requests."""
  try:  # the openai client's own HTTP library (httpx2 in openai 3.x, httpx before)
    import httpx2 as httpx
  except ImportError:
    import httpx

  health_answered = threading.Event()
  original = image_chat.conversation_ids

  def slow(*args, **kwargs):
    assert health_answered.wait(30), "/health did not answer while an image was being decoded"
    return original(*args, **kwargs)

  monkeypatch.setattr(image_chat, "conversation_ids", slow)
  result: list = []
  worker = threading.Thread(target=lambda: result.append(served.client.chat.completions.create(
      model="tiny-vlm", messages=image_message("what", png_url(1)), max_tokens=2, temperature=0)))
  worker.start()
  time.sleep(0.5)
  assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200
  health_answered.set()
  worker.join(120)
  assert result and result[0].choices[0].message.content is not None
