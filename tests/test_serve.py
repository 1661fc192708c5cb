"""The OpenAI-compatible server (MaxText/serve.py) on 127.0.0.1, driven by real clients: the official
`openai` client (greedy text equals the uncached greedy decode of the same model, streams join to the
same text, stop and max_tokens honoured), concurrent load (every answer equals its single-request
result, none lost, every slot released), lm-eval's `local-completions` backend (log-likelihoods equal
the model's own logits), and bad requests that get a JSON error while the server keeps serving;
scoring requests that leave no KV pages reserved, /health and /metrics."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="needs openai (EXTRAS=test bash setup.sh)")
uvicorn = pytest.importorskip("uvicorn", reason="needs uvicorn (pip install -r requirements.txt)")
try:  # the openai client's own HTTP library (httpx2 in openai 3.x, httpx before)
  import httpx2 as httpx
except ImportError:
  httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers", reason="chat templates need transformers (EXTRAS=test bash setup.sh)")

from MaxText.platform import sharding  # noqa: E402
from MaxText.configuration.config import Config  # noqa: E402
from MaxText.input_pipeline import chat  # noqa: E402
from MaxText import serve as serve_lib  # noqa: E402
from MaxText.inference import serve_routes  # noqa: E402
from MaxText.serve import build_app, build_server  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "inference"))
sys.path.insert(0, str(Path(__file__).parent / "input_pipeline"))
from decode_test_utils import one_device_mesh, uncached_greedy  # noqa: E402
from tests.uvicorn_thread import UvicornThread  # noqa: E402
from tests.compile_settings import cpu_xla_flags  # noqa: E402
from sft_fixtures import CHATML, write_tokenizer, without_markers  # noqa: E402

KEY = "test-key-123"
NOW = {"type": "function", "function": {"name": "the", "parameters": {"type": "object", "properties": {}}}}
# A compact ChatML without roles (the test model takes 32 prompt tokens) with a tools section (their names), an
# assistant turn's calls and tool results.
CHATML_TOOLS = ("{%- for tool in tools or [] %}{{ tool.function.name }}{%- endfor %}"
                "{%- for message in messages %}{{ '<|im_start|>' + message['content'] }}"
                "{%- for call in message.tool_calls or [] %}{{ call.function.name }}{%- endfor %}"
                "{{ '<|im_end|>' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>' }}{%- endif %}")
MODEL = dict(base_emb_dim=32, base_num_query_heads=4, base_num_kv_heads=2, head_dim=8, base_mlp_dim=64,
             base_num_decoder_layers=2, vocab_size=272, max_target_length=48, max_prefill_predict_length=32,
             dtype="float32", print_config=False, tokenizer_type="huggingface", add_bos=False,
             # The paged cache at a third of the dense capacity (4 slots x 12 pages): requests wait for pages.
             kv_cache_layout="paged", kv_page_size=4, kv_num_pages=16)
LIMITS = dict(serve_max_slots=4, serve_max_queue=28, serve_max_tokens=16, serve_max_n=4, serve_max_body_bytes=4096,
              serve_model_name="tiny")
PROMPTS = ["the quick brown fox", "to be or not", "shall i compare thee", "a lazy dog",
           "you are helpful", "is that so"]


class Served:
  def __init__(self, tmp: Path, model: dict = MODEL):
    self.tokenizer_dir = write_tokenizer(tmp / "tok", without_markers(CHATML))
    self.config = Config.for_testing(**model, **LIMITS, tokenizer_path=str(self.tokenizer_dir))
    self.server = build_server(self.config, mesh=one_device_mesh())
    self.engine, self.params = self.server.scheduler.engine, self.server.scheduler.params
    self.http = UvicornThread(build_app(self.server, api_key=KEY, max_body_bytes=4096))
    self.port, self.url = self.http.port, self.http.url
    self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    self._expected: dict[tuple[int, ...], list[int]] = {}

  def ids(self, text: str) -> list[int]:
    return self.server.codec.encode(text)

  def greedy(self, ids: list[int], max_tokens: int) -> list[int]:
    """The model's greedy tokens without a cache, up to the tokenizer's end of sequence."""
    key = tuple(ids)
    if key not in self._expected:
      length = self.config.model.max_target_length
      room = length + 1 - len(ids)
      self._expected[key] = uncached_greedy(self.engine.spec, self.params, ids, min(room, LIMITS["serve_max_tokens"]),
                                            length)
    out = self._expected[key][:max_tokens]
    eos = 2  # "</s>" in sft_fixtures.SPECIAL
    return out[:out.index(eos) + 1] if eos in out else out

  def text(self, ids: list[int]) -> str:
    return self.server.codec.decode(ids)

  def close(self) -> None:
    self.http.close()
    self.server.scheduler.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  s = Served(tmp_path_factory.mktemp("serve"))
  yield s
  s.close()


def test_openai_client_greedy_equals_uncached_decode_and_streams_join(served):
  prompt = PROMPTS[0]
  expected = served.greedy(served.ids(prompt), 12)
  out = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
  assert out.choices[0].text == served.text(expected)
  assert out.usage.completion_tokens == len(expected) and out.usage.prompt_tokens == len(served.ids(prompt))
  assert out.choices[0].finish_reason == ("stop" if len(expected) < 12 else "length")
  chunks = list(served.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                                 stream=True))
  assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
  assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason
  # Token ids as the prompt give the same answer; max_tokens=3 stops after three tokens.
  short = served.client.completions.create(model="tiny", prompt=served.ids(prompt), max_tokens=3, temperature=0)
  assert short.choices[0].text == served.text(expected[:3]) and short.usage.completion_tokens == min(3, len(expected))
  # Chat: the tokenizer's template, as SFT renders a user turn.
  messages = [{"role": "user", "content": "to be or not"}]
  chat_ids = chat.chat_prompt_ids(chat.load_chat_tokenizer(str(served.tokenizer_dir)), "to be or not")
  answer = served.client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
  assert answer.choices[0].message.content == served.text(served.greedy(chat_ids, 8))
  stream = served.client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True)
  assert "".join(c.choices[0].delta.content or "" for c in stream) == answer.choices[0].message.content
  assert [m.id for m in served.client.models.list().data] == ["tiny"]


@pytest.mark.slow  # a second server
def test_a_sparse_attention_model_is_served_like_its_uncached_decode(tmp_path):
  """DeepSeek-V3.2's indexer (top-4 of up to 48 positions) through the paged server."""
  dsa = dict(MODEL, decoder_block="deepseek32", attention_type="mla", base_num_kv_heads=4, head_dim=12,
             q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, index_topk=4,
             index_n_heads=2, index_head_dim=8)
  served = Served(tmp_path, dsa)
  try:
    for prompt in PROMPTS[:2]:
      expected = served.greedy(served.ids(prompt), 12)
      out = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
      assert out.choices[0].text == served.text(expected)
  finally:
    served.close()


@pytest.mark.slow  # a second server
@pytest.mark.parametrize("decoder_block,mlp", [
    ("qwen3_next", {}),
    ("qwen3_5_moe", dict(base_mlp_dim=16, num_experts=4, num_experts_per_tok=2, shared_experts=1,
                         shared_expert_gate=True))], ids=["qwen3_next", "qwen3_5_moe"])
def test_a_qwen3_next_model_is_served_like_its_uncached_decode(tmp_path, decoder_block, mlp):
  """Qwen3-Next's (and Qwen3.5's) Gated DeltaNet states as slot state beside the full-attention layers' pages; its
  prompts prefilled 5 tokens per scheduler step, shared by the prompts waiting (the state carried from chunk to
  chunk, kept while other slots generate); prefix caching off (refused for a recurrent state). Concurrent requests share the batch."""
  qwen3_next = dict(MODEL, **mlp, decoder_block=decoder_block, base_num_decoder_layers=4, full_attention_interval=2,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
                    linear_conv_kernel_dim=4, linear_attention_chunk_size=4, attention_output_gate=True,
                    use_qk_norm=True, partial_rotary_factor=0.5, normalization_type="rms_plus_one",
                    prefix_caching=False, prefill_chunk_size=5)
  served = Served(tmp_path, qwen3_next)
  try:
    expected = {prompt: served.text(served.greedy(served.ids(prompt), 12)) for prompt in PROMPTS[:3]}
    ask = lambda prompt: served.client.completions.create(model="tiny", prompt=prompt, max_tokens=12,  # noqa: E731
                                                          temperature=0).choices[0].text
    with ThreadPoolExecutor(3) as pool:
      answers = dict(zip(expected, pool.map(ask, expected)))
    assert answers == expected
    # chunked: one program per row count of a call sharing the chunk budget (1, 2 or 4 rows of 5 tokens)
    assert 1 <= served.engine.traces["extend"] <= 3 and max(len(served.ids(p)) for p in expected) > 5
  finally:
    served.close()


def test_stop_sequences_end_the_text_before_them(served):
  prompt = PROMPTS[2]
  full = served.text(served.greedy(served.ids(prompt), 16))
  assert len(full) > 6, full
  stop = full[3:6]
  want = full[:full.index(stop)]
  for stream in (False, True):
    out = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, stop=[stop],
                                           stream=stream)
    text = "".join(c.choices[0].text for c in out) if stream else out.choices[0].text
    assert text == want, (stream, text, want)


@pytest.mark.parametrize("fields, param", [
    (dict(tools=[NOW], tool_choice="required"), "tools"),  # this fixture's template renders no tools
    (dict(tools=[NOW]), "tools"),
], ids=["tool-choice-required", "tools-template"])
def test_tools_a_template_cannot_render_are_refused_by_name(served, fields, param):
  """What the server does not do is a 400 naming the field, not a free-text 200 (response_format and forced
  calls: tests/test_serve_constrained.py)."""
  with pytest.raises(openai.BadRequestError) as raised:
    served.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          **fields)
  assert raised.value.status_code == 400 and raised.value.body["param"] == param, raised.value.body
  assert param in raised.value.body["message"] and raised.value.body["code"] == "unsupported_parameter"


def test_tools_are_rendered_and_tool_messages_rendered_back(served, tmp_path, monkeypatch):
  """The openai client's tool flow against a random model with a template that renders tools: the
  prompt is the template's rendering with the tools, then with the assistant's call and the tool's result."""
  tok = write_tokenizer(tmp_path / "tok", CHATML_TOOLS)
  codec, _ = serve_lib._codec(Config.for_testing(**MODEL, **LIMITS, tokenizer_path=str(tok)))
  monkeypatch.setattr(served.server, "codec", codec)
  template = chat.load_chat_tokenizer(str(tok))

  def ids(messages):
    text = template.apply_chat_template(messages, tools=[NOW], tokenize=False, add_generation_prompt=True)
    return list(template(text, add_special_tokens=False)["input_ids"])

  messages = [{"role": "user", "content": "to be"}]
  answer = served.client.chat.completions.create(model="tiny", messages=messages, tools=[NOW], max_tokens=4,
                                                 temperature=0)
  assert answer.usage.prompt_tokens == len(ids(messages)) > len(ids(messages)[:-1])
  assert answer.choices[0].message.content == served.text(served.greedy(ids(messages), 4))  # no call: content
  assert not answer.choices[0].message.tool_calls and answer.choices[0].finish_reason in ("stop", "length")
  stream = served.client.chat.completions.create(model="tiny", messages=messages, tools=[NOW], max_tokens=4,
                                                 temperature=0, stream=True)
  assert "".join(c.choices[0].delta.content or "" for c in stream) == answer.choices[0].message.content
  call = {"id": "call_1", "type": "function", "function": {"name": "the", "arguments": "{}"}}
  follow = messages + [{"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "day"}]
  again = served.client.chat.completions.create(model="tiny", messages=follow, tools=[NOW], max_tokens=2,
                                                temperature=0)
  rendered = [*messages, {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {
      "name": "the", "arguments": {}}}]}, {"role": "tool", "content": "day"}]
  assert "<|im_start|>the<|im_end|><|im_start|>day<|im_end|>" in template.apply_chat_template(rendered, tools=[NOW], tokenize=False)
  assert again.usage.prompt_tokens == len(ids(rendered))


def test_a_generated_call_is_a_tool_call_the_openai_client_reads():
  """The chat route's answer for a generated call text, as the openai client's types read it."""
  text = '<tool_call>{"name": "now", "arguments": {"tz": "UTC"}}</tool_call>'
  body = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "tiny",
          "choices": [serve_routes.chat_choice(0, text, "stop", tools=True)]}
  choice = openai.types.chat.ChatCompletion.model_validate(body).choices[0]
  assert choice.finish_reason == "tool_calls" and choice.message.content is None
  assert choice.message.tool_calls[0].function.name == "now"
  assert choice.message.tool_calls[0].function.arguments == '{"tz": "UTC"}'


def test_a_stream_with_include_usage_ends_with_the_usage(served):
  messages = [{"role": "user", "content": "to be or not"}]
  whole = served.client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
  chunks = list(served.client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                      stream=True, stream_options={"include_usage": True}))
  assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
  assert all(c.usage is None for c in chunks[:-1])
  assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == whole.choices[0].message.content
  whole = served.client.completions.create(model="tiny", prompt="to be", max_tokens=3, temperature=0)
  completion = list(served.client.completions.create(model="tiny", prompt="to be", max_tokens=3, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
  assert completion[-1].choices == [] and completion[-1].usage == whole.usage


@pytest.mark.slow  # a second server
def test_four_steps_per_call_stream_chunks_of_several_tokens_with_the_whole_text_and_usage(tmp_path, monkeypatch):
  """decode_steps_per_call=4: a call's tokens reach a stream together and go out as one chunk, a logprob entry per
  token; the chunks join to the unstreamed text (the uncached greedy decode) and count its usage; a client gone
  mid-stream has its job cancelled."""
  served = Served(tmp_path, dict(MODEL, decode_steps_per_call=4))
  try:
    prompt = PROMPTS[1]
    expected = served.greedy(served.ids(prompt), 12)
    assert len(expected) >= 6  # several calls' worth
    whole = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=0)
    chunks = list(served.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                                   logprobs=0, stream=True, stream_options={"include_usage": True}))
    per_chunk = [len(c.choices[0].logprobs.tokens) for c in chunks[:-1] if c.choices[0].logprobs]
    assert sum(per_chunk) == whole.usage.completion_tokens == chunks[-1].usage.completion_tokens == len(expected)
    assert len(per_chunk) < sum(per_chunk)  # some chunk holds several tokens
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text == served.text(expected)
    _a_stream_dropped_after_two_chunks_is_cancelled(served, monkeypatch, max_tokens=12, call_seconds=1.0)
  finally:
    served.close()


def _a_stream_dropped_after_two_chunks_is_cancelled(served, monkeypatch, max_tokens: int, call_seconds: float) -> None:
  """A client reads two chunks of a stream and hangs up: the server notices (its once-a-second check), cancels the
  job before it ends on its own (each engine call is slowed to `call_seconds`, the request's calls to seconds) and
  frees the slot."""
  scheduler = served.server.scheduler
  step = scheduler.engine.decode_step

  def slow_step(*args, **kwargs):
    time.sleep(call_seconds)
    return step(*args, **kwargs)

  monkeypatch.setattr(scheduler.engine, "decode_step", slow_step)
  before = dict(scheduler.load())
  with httpx.stream("POST", f"{served.url}/v1/completions", headers={"authorization": f"Bearer {KEY}"},
                    json={"model": "tiny", "prompt": "to be", "max_tokens": max_tokens, "temperature": 0.0,
                          "stream": True}) as stream:
    lines = stream.iter_lines()
    next(lines), next(lines)
  deadline = time.monotonic() + 30
  while scheduler.load()["cancelled"] == before["cancelled"] or scheduler.load()["active"]:
    assert time.monotonic() < deadline, scheduler.load()
    time.sleep(0.05)
  after = scheduler.load()
  assert after["released"] == before["released"] + 1 and after["length"] == before["length"]


def test_a_client_gone_mid_stream_has_its_job_cancelled_and_its_slot_freed(served, monkeypatch):
  _a_stream_dropped_after_two_chunks_is_cancelled(served, monkeypatch, max_tokens=16, call_seconds=0.25)


def test_seeded_sampling_repeats_and_n_choices_differ(served):
  args = dict(model="tiny", prompt=PROMPTS[1], max_tokens=10, temperature=1.5, top_p=0.95, seed=7, n=3)
  first = served.client.completions.create(**args)
  again = served.client.completions.create(**args)
  texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
  assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
  assert len(set(texts)) > 1, texts


def test_a_seeded_prompt_samples_the_same_alone_or_in_a_list_of_prompts(served: Served) -> None:
  """Choice j of each prompt draws with seed + j: the second prompt of a list (lm-eval's batches, one seed) drew with
  the seed of its place in the answer, so its text changed with the batch it came in."""
  args = dict(model="tiny", max_tokens=8, temperature=1.5, seed=3, n=2)
  alone = served.client.completions.create(prompt=PROMPTS[1], **args)
  listed = served.client.completions.create(prompt=[PROMPTS[0], PROMPTS[1]], **args)
  texts = [c.text for c in sorted(listed.choices, key=lambda c: c.index)]
  assert texts[2:] == [c.text for c in sorted(alone.choices, key=lambda c: c.index)], texts


def _load(served, clients: int, per_client: int) -> None:
  rng = np.random.default_rng(0)
  work = [[(PROMPTS[int(rng.integers(len(PROMPTS)))], int(rng.integers(1, 17))) for _ in range(per_client)]
          for _ in range(clients)]
  for prompt, n in {w for client in work for w in client}:
    served.greedy(served.ids(prompt), n)  # the references, before the clock starts

  def run(jobs):
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    return [(p, n, client.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0).choices[0].text)
            for p, n in jobs]

  before = served.server.scheduler.load()
  start = time.monotonic()
  with ThreadPoolExecutor(clients) as pool:
    results = [r for batch in pool.map(run, work) for r in batch]
  elapsed = time.monotonic() - start
  assert len(results) == clients * per_client
  for prompt, n, text in results:
    assert text == served.text(served.greedy(served.ids(prompt), n)), (prompt, n)
  after = served.server.scheduler.load()
  assert after["active"] == 0 and after["waiting"] == 0
  assert after["released"] - before.get("released", 0) == clients * per_client  # every slot handed back
  stats = served.engine.cache_stats()
  assert stats["pages_used"] == 0 and stats["pages_free"] == stats["pages_total"] == 16  # every page handed back
  assert elapsed < 300, elapsed


def test_sixteen_clients_times_eight_requests_all_answered_correctly(served):
  _load(served, clients=16, per_client=8)


def _post(served, path: str, body: bytes | str, key: str | None = KEY) -> httpx.Response:
  headers = {"content-type": "application/json"}
  if key is not None:
    headers["authorization"] = f"Bearer {key}"
  return httpx.post(f"{served.url}{path}", content=body, headers=headers, timeout=60)


@pytest.mark.parametrize("body,key,status,message", [
    ('{"prompt": "the", ', KEY, 400, "not valid JSON"),
    ('{"model": "/etc/passwd", "prompt": "the"}', KEY, 404, "does not exist"),
    ('{"model": ["tiny"], "prompt": "the"}', KEY, 400, "model must be a string, got list"),  # was a 404
    ('{"model": 5, "prompt": "the"}', KEY, 400, "model must be a string, got int"),
    ('{"model": "tiny", "prompt": "' + "the quick brown fox " * 10 + '"}', KEY, 400, "at most 32"),
    ('{"model": "tiny", "prompt": "the", "max_tokens": -1}', KEY, 400, "max_tokens must be >= 1"),
    ('{"model": "tiny", "prompt": "the", "max_tokens": 17}', KEY, 400, "serve_max_tokens"),
    ('{"model": "tiny", "prompt": "the", "n": 5}', KEY, 400, "serve_max_n"),
    ('{"model": "tiny", "prompt": "' + "x" * 5000 + '"}', KEY, 413, "serve_max_body_bytes"),
    ('{"model": "tiny", "prompt": "the"}', None, 401, "API key"),
    ('{"model": "tiny", "prompt": "the"}', "wrong", 401, "API key"),
    # JSON integers have no size limit: beyond a float's range they are a 400 naming the field.
    ('{"model": "tiny", "prompt": "the", "temperature": HUGE}', KEY, 400, "temperature is an integer too large"),
    ('{"model": "tiny", "prompt": "the", "top_p": HUGE}', KEY, 400, "top_p is an integer too large"),
    ('{"model": "tiny", "prompt": "the", "max_tokens": HUGE}', KEY, 400, "serve_max_tokens"),
    ('{"model": "tiny", "prompt": "the", "n": HUGE}', KEY, 400, "serve_max_n"),
    ('{"model": "tiny", "prompt": "the", "logprobs": HUGE}', KEY, 400, "logprobs must be in [0, 5]"),
    ('{"model": "tiny", "prompt": [HUGE]}', KEY, 400, "outside the vocabulary"),
    ('{"model": "tiny", "prompt": "the", "seed": HUGE}', KEY, 400, "seed must be in [0, 2**32)"),
    ('{"model": "tiny", "prompt": "the", "temperature": 1e400}', KEY, 400, "temperature must be in [0, 2]"),
    ("[" * 3000, KEY, 400, "nested too deeply"),
], ids=["invalid-json", "unknown-model", "model-list", "model-int", "prompt-too-long", "negative-max-tokens", "max-tokens-over-limit",
        "n-over-limit", "oversized-body", "missing-key", "wrong-key", "huge-temperature", "huge-top-p",
        "huge-max-tokens", "huge-n", "huge-logprobs", "huge-token-id", "huge-seed", "infinite-temperature", "deep-nesting"])
def test_bad_requests_get_json_errors(served, body, key, status, message):
  response = _post(served, "/v1/completions", body.replace("HUGE", HUGE), key)
  assert response.status_code == status, response.text
  assert response.headers["content-type"] == "application/json"
  assert message in response.json()["error"]["message"]


HUGE = "1" + "0" * 400  # 10**400: a valid JSON number, beyond a float's range


def test_a_body_declared_too_large_is_refused_before_it_is_sent(served):
  """Content-Length over serve_max_body_bytes with only a little sent: a 413 at once. Before, the server waited for
  the whole declared body, for as long as the client kept the connection open."""
  import socket

  host, port = served.url.split("//")[1].rsplit(":", 1)
  with socket.create_connection((host, int(port)), timeout=30) as conn:
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                 b"\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n{}")
    answer = conn.recv(4096)  # socket.timeout (the test fails) when no answer comes
  assert answer.startswith(b"HTTP/1.1 413 ") and b"serve_max_body_bytes" in answer, answer


def test_huge_integers_with_a_meaning_are_served(served):
  """top_k beyond the vocabulary keeps every token (as 0 does)."""
  body = f'{{"model": "tiny", "prompt": "the", "max_tokens": 4, "temperature": 0, "top_k": {HUGE}}}'
  response = _post(served, "/v1/completions", body)
  assert response.status_code == 200, response.text
  assert response.json()["choices"][0]["text"] == served.text(served.greedy(served.ids("the"), 4))


def test_a_request_needing_more_pages_than_the_pool_is_refused(served, monkeypatch):
  monkeypatch.setattr(served.engine, "pages_needed", lambda tokens: 17)  # the pool has 16
  response = _post(served, "/v1/completions", '{"model": "tiny", "prompt": "the", "max_tokens": 4}')
  assert response.status_code == 400, response.text
  error = response.json()["error"]
  assert "need 17 KV pages but the whole pool has kv_num_pages=16" in error["message"]
  assert error["param"] == "max_tokens"
  assert served.server.scheduler.load()["waiting"] == 0


@pytest.mark.parametrize("header,status", [("bearer " + KEY, 200), ("BEARER " + KEY, 200), ("Bearer   " + KEY, 200),
                                           ("Basic " + KEY, 401), (KEY, 401), ("bearer", 401)])
def test_the_bearer_scheme_is_case_insensitive(served, header, status):
  response = httpx.get(f"{served.url}/v1/models", headers={"authorization": header}, timeout=30)
  assert response.status_code == status, response.text


def test_health_needs_no_key_and_models_does(served):
  assert httpx.get(f"{served.url}/health").json()["status"] == "ok"
  assert httpx.get(f"{served.url}/metrics").status_code == 200
  assert httpx.get(f"{served.url}/v1/models").status_code == 401


IDLE = {"status": "ok", "slots_total": 4, "slots_in_use": 0, "queue_length": 0, "pages_total": 16, "pages_free": 16,
        "pages_reserved": 0, "oldest_request_age_seconds": 0, "speculative_tokens": 0, "speculative_proposed_tokens": 0,
        "speculative_accepted_tokens": 0, "speculative_acceptance_rate": 0.0}


def _idle_health(served) -> dict:
  """/health when idle, without pages_cached (the prefixes earlier tests left), which it checks
  is a part of the free pages."""
  health = httpx.get(f"{served.url}/health", timeout=30).json()
  cached = health.pop("pages_cached")
  assert 0 <= cached <= health["pages_free"], health
  return health


def _metrics(served) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
  from prometheus_client.parser import text_string_to_metric_families

  text = httpx.get(f"{served.url}/metrics", timeout=30).text
  return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
          for family in text_string_to_metric_families(text) for sample in family.samples}


def test_health_and_metrics_show_a_stalled_scheduler(served):
  """A job whose consumer blocks the scheduler thread: /health and /metrics show the slots in use
  (its own and the next job's, admitted before the stall: prompts are prefilled into pages after
  admission), the request waiting behind them for pages, their pages and a growing oldest age;
  all back to idle after."""
  from MaxText.inference import scheduler as sched
  from MaxText.inference.sampling import RowParams

  gate, done = threading.Event(), threading.Semaphore(0)

  def held(event):  # called on the scheduler thread: it stalls there until the gate opens
    gate.wait(60)

  def count(event):
    if isinstance(event, sched.Done):
      done.release()

  # Three prompts of one length that share no page (their first tokens differ): admission counts
  # a page shared with a running request once, and this test is about the plain arithmetic.
  ids = served.ids(PROMPTS[0])
  first, second, third = ([7 + k] + ids[1:] for k in range(3))
  scheduler = served.server.scheduler
  need = served.engine.pages_needed(len(ids) + 8 - 1)
  assert 2 * need <= 16 < 3 * need  # two jobs fit the pool's reservations, the third waits
  scheduler.submit([sched.Job(0, first, 8, RowParams(), held)])
  scheduler.submit([sched.Job(0, second, 8, RowParams(), count), sched.Job(1, third, 8, RowParams(), count)])
  try:
    time.sleep(0.3)
    health = httpx.get(f"{served.url}/health", timeout=30).json()
    assert health["slots_in_use"] == 2 and health["queue_length"] == 1, health
    assert health["pages_reserved"] == 2 * need
    prompt_pages = served.engine.pages_needed(len(ids))
    assert 16 - 2 * need <= health["pages_free"] <= 16 - 2 * prompt_pages, health
    assert health["oldest_request_age_seconds"] >= 0.3
    gauges = _metrics(served)
    assert gauges[("maxtext_serve_slots_in_use", ())] == 2 and gauges[("maxtext_serve_queue_length", ())] == 1
    assert gauges[("maxtext_serve_kv_pages_reserved", ())] == 2 * need
    assert gauges[("maxtext_serve_oldest_request_age_seconds", ())] >= 0.3
  finally:
    gate.set()
  assert done.acquire(timeout=60) and done.acquire(timeout=60)
  _wait_idle(served)
  assert _idle_health(served) == IDLE


def _wait_idle(served, timeout: float = 30) -> None:
  deadline = time.monotonic() + timeout
  while (load := served.server.scheduler.load())["active"] or load["waiting"]:
    assert time.monotonic() < deadline, load
    time.sleep(0.02)


def test_metrics_count_requests_by_route_and_status_and_time_them(served):
  from MaxText.inference.serve_metrics import ServeMetrics

  before = _metrics(served)
  ok = served.client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=3, temperature=0)
  assert ok.choices[0].text
  assert _post(served, "/v1/completions", '{"model": "tiny", "prompt": "the"}', key="wrong").status_code == 401
  httpx.get(f"{served.url}/no/such/route", headers={"authorization": f"Bearer {KEY}"}, timeout=30)
  after = _metrics(served)

  def grew(name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0) - before.get(key, 0)

  assert grew("maxtext_serve_requests_total", route="/v1/completions", status="200") == 1
  assert grew("maxtext_serve_requests_total", route="/v1/completions", status="401") == 1
  assert grew("maxtext_serve_requests_total", route="other", status="404") == 1
  assert grew("maxtext_serve_request_seconds_count", route="/v1/completions") == 2
  assert grew("maxtext_serve_time_to_first_token_seconds_count", route="/v1/completions") == 1
  assert grew("maxtext_serve_completions_finished_total", reason="length") >= 0
  assert grew("maxtext_serve_engine_steps_total") >= 2
  ServeMetrics(served.server.scheduler.load).exposition()  # a second server's registry does not clash


def test_scoring_requests_give_back_their_pages_so_a_pool_sized_request_is_served(served):
  """Issue 33's hang: a scoring-only job (lm-eval's echo + max_tokens 0) admitted beside a
  generating one kept its slot's page reservation for ever; a later request needing most of the
  pool then waited until its deadline while the scheduler thread spun."""
  from MaxText.inference import scheduler as sched
  from MaxText.inference.sampling import RowParams

  long_ids = (served.ids("the quick brown fox jumps over a lazy dog ") * 8)[:32]
  ended = threading.Event()
  scheduler = served.server.scheduler
  # One submit: both are admitted in the same pass, the scoring one through a slot of its own.
  scheduler.submit([sched.Job(0, served.ids(PROMPTS[0]), 8, RowParams(), lambda e: None),
                    sched.Job(0, long_ids, 0, RowParams(), lambda e: ended.set() if isinstance(e, sched.Done) else 0,
                              score_prompt=True)])
  assert ended.wait(60)
  scoring = f'{{"model": "tiny", "prompt": {long_ids}, "max_tokens": 0, "echo": true, "logprobs": 1}}'
  generating = '{"model": "tiny", "prompt": "to be or not", "max_tokens": 12, "temperature": 0}'
  with ThreadPoolExecutor(6) as pool:
    answers = list(pool.map(lambda body: _post(served, "/v1/completions", body), [scoring, generating] * 3))
  assert [a.status_code for a in answers] == [200] * 6
  _wait_idle(served)
  assert _idle_health(served) == IDLE
  # 32 prompt tokens + 16 new ones: 47 cached tokens, 12 of the 16 pages.
  expected = served.text(served.greedy(long_ids, 16))
  body = f'{{"model": "tiny", "prompt": {long_ids}, "max_tokens": 16, "temperature": 0}}'
  response = httpx.post(f"{served.url}/v1/completions", content=body, timeout=30,
                        headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})
  assert response.status_code == 200 and response.json()["choices"][0]["text"] == expected
  _wait_idle(served)
  assert _idle_health(served) == IDLE


def test_flood_beyond_the_queue_gets_503_and_a_dropped_stream_frees_its_slot(served):
  body = '{"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 16, "temperature": 0}'
  capacity = LIMITS["serve_max_slots"] + LIMITS["serve_max_queue"]

  async def flood():
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as client:
      return await asyncio.gather(*[client.post(f"{served.url}/v1/completions", content=body, headers={
          "authorization": f"Bearer {KEY}", "content-type": "application/json"}) for _ in range(3 * capacity)])

  responses = asyncio.run(flood())
  codes = [r.status_code for r in responses]
  assert set(codes) <= {200, 503} and codes.count(503) > 0 and codes.count(200) >= capacity, codes
  busy = next(r for r in responses if r.status_code == 503)
  assert busy.headers["retry-after"] and "serve_max_queue" in busy.json()["error"]["message"]
  expected = served.text(served.greedy(served.ids("the quick brown fox"), 16))
  assert all(r.json()["choices"][0]["text"] == expected for r in responses if r.status_code == 200)
  # A client that reads two chunks of a stream and hangs up: its slot is released.
  released = served.server.scheduler.load().get("released", 0)
  with httpx.stream("POST", f"{served.url}/v1/completions", headers={"authorization": f"Bearer {KEY}"},
                    json={"model": "tiny", "prompt": "to be", "max_tokens": 16, "temperature": 0.0,
                          "stream": True}) as stream:
    lines = stream.iter_lines()
    next(lines), next(lines)
  deadline = time.monotonic() + 30
  while served.server.scheduler.load().get("released", 0) == released or served.server.scheduler.load()["active"]:
    assert time.monotonic() < deadline, served.server.scheduler.load()
    time.sleep(0.05)
  out = served.client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=6, temperature=0)
  assert out.choices[0].text == served.text(served.greedy(served.ids(PROMPTS[3]), 6))


def test_echo_logprobs_equal_the_model_log_softmax(served):
  """With echo and max_tokens=0 the prompt tokens' log-likelihoods, as harnesses ask for them."""
  ids = served.ids(PROMPTS[2])
  out = _post(served, "/v1/completions", f'{{"model": "tiny", "prompt": {ids}, "max_tokens": 0, "echo": true, '
              '"logprobs": 2, "temperature": 0}').json()
  logprobs = out["choices"][0]["logprobs"]
  assert out["choices"][0]["text"] == served.text(ids) and len(logprobs["tokens"]) == len(ids)
  expected = _direct_logprobs(served, ids)
  assert logprobs["token_logprobs"][0] is None
  np.testing.assert_allclose(logprobs["token_logprobs"][1:], expected, atol=1e-4)
  # The 2 best and the prompt's own token where it is not among them (the legacy API's N + 1).
  assert all(1 <= len(top) <= 3 and max(top.values()) >= lp and top[text] == pytest.approx(lp, abs=1e-5)
             for top, lp, text in zip(logprobs["top_logprobs"][1:], logprobs["token_logprobs"][1:],
                                      logprobs["tokens"][1:]))


def _choices_by_index(response: httpx.Response, stream: bool) -> dict[int, list[str]]:
  """Each choice's JSON without its index: the whole answer's, or a stream's chunks in order (without the chunks'
  id and creation time, which differ between answers)."""
  def keyed(choice: dict) -> tuple[int, str]:
    return choice["index"], json.dumps({k: v for k, v in choice.items() if k != "index"})

  out: dict[int, list[str]] = {}
  if not stream:
    for choice in response.json()["choices"]:
      index, text = keyed(choice)
      out.setdefault(index, []).append(text)
    return out
  for line in response.text.splitlines():
    if line.startswith("data: {"):
      for choice in json.loads(line[len("data: "):])["choices"]:
        index, text = keyed(choice)
        out.setdefault(index, []).append(text)
  return out


def test_echo_logprobs_score_each_prompt_once_and_every_choice_answers_as_one_alone(served, monkeypatch):
  """Echo with logprobs and n > 1, or a prompt listed twice: the engine scores each distinct prompt once (each choice
  scored it again before), and every choice's answer, whole or streamed, is byte for byte the answer n=1 gives."""
  engine = served.server.scheduler.engine
  scored: list[list[int]] = []
  score = engine.score

  def counted(params, prompt, **kwargs):
    scored.append(list(prompt))
    return score(params, prompt, **kwargs)

  monkeypatch.setattr(engine, "score", counted)
  ids = [served.ids(PROMPTS[2]), served.ids(PROMPTS[3])]
  base = {"model": "tiny", "max_tokens": 0, "echo": True, "logprobs": 2, "temperature": 0}
  for stream in (False, True):
    alone = [_choices_by_index(_post(served, "/v1/completions", json.dumps({**base, "prompt": p, "stream": stream})),
                               stream)[0] for p in ids]
    scored.clear()
    many = _choices_by_index(_post(served, "/v1/completions", json.dumps({**base, "prompt": ids[0], "n": 4,
                                                                           "stream": stream})), stream)
    assert scored == [ids[0]] and many == dict.fromkeys(range(4), alone[0])
    scored.clear()
    listed = _choices_by_index(_post(served, "/v1/completions", json.dumps({**base, "prompt": [ids[0], ids[1], ids[0]],
                                                                             "n": 1, "stream": stream})), stream)
    assert scored == ids and listed == {0: alone[0], 1: alone[1], 2: alone[0]}
  scored.clear()  # with generated tokens too (their log-probabilities may differ in the last bits: prefix caching)
  out = _post(served, "/v1/completions", json.dumps({**base, "prompt": ids[0], "n": 3, "max_tokens": 2})).json()
  echoed = {json.dumps({k: v[:len(ids[0])] for k, v in c["logprobs"].items()}) for c in out["choices"]}
  assert scored == [ids[0]]
  reference = _post(served, "/v1/completions", json.dumps({**base, "prompt": ids[0]})).json()["choices"][0]
  assert echoed == {json.dumps(reference["logprobs"])}


def test_a_stopping_server_gives_open_requests_the_drain_then_ends_them(monkeypatch):
  """serve.main's one-process server (serve_app.run: uvicorn and the drain) told to stop (SIGTERM sets uvicorn's
  should_exit) while a stream and an unstreamed request wait for jobs that never end: they get
  serve_app.DRAIN_SECONDS, then the stream ends with an error event and [DONE], the other is a 503 engine_gone, their
  jobs are cancelled and the server stops. Before, uvicorn waited for them for ever (its graceful shutdown has no
  time limit)."""
  from MaxText.inference import job_events, openai_api, serve_app, serve_metrics

  monkeypatch.setattr(serve_app, "DRAIN_SECONDS", 0.5)
  cancelled: list[int] = []

  class Job:
    def __init__(self, index: int):
      self.index, self.submitted = index, time.monotonic()

    def cancel(self) -> None:
      cancelled.append(self.index)

  class Endless(serve_app.HttpServer):
    """Each choice gets one token, then nothing more."""

    request_timeout_seconds = 300.0

    async def admit(self, request, score_prompt):
      self.check_serving()
      queue: asyncio.Queue = asyncio.Queue()
      queue.put_nowait([job_events.Tokens(c.index, [ord("a")], [-0.5], [[]]) for c in request.choices])
      return [Job(c.index) for c in request.choices], queue

  codec = openai_api.Codec(encode=lambda text: [ord(c) for c in text], decode=lambda ids: "".join(map(chr, ids)),
                           chat=lambda messages: [1])
  server = Endless(codec, openai_api.Limits("tiny", 256, 16, 32, 8, 2), serve_metrics.ServeMetrics(lambda: {}))
  sock = serve_lib.listen("127.0.0.1", 0)
  uv = uvicorn.Server(serve_app.uvicorn_config(build_app(server, api_key=""), 60.0))
  serving = threading.Thread(target=serve_app.run, args=(uv, server, [sock]), daemon=True)
  serving.start()
  url = serve_lib.address("127.0.0.1", sock)
  body = {"model": "tiny", "prompt": "x", "max_tokens": 8}
  unstreamed: list[httpx.Response] = []
  waiting = threading.Thread(target=lambda: unstreamed.append(httpx.post(f"{url}/v1/completions", json=body,
                                                                         timeout=60)))
  waiting.start()
  with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as stream:
    lines = stream.iter_lines()
    assert next(lines).startswith("data: ")
    time.sleep(0.5)  # the unstreamed request is in too
    uv.should_exit = True
    stopped = time.monotonic()
    events = [line for line in lines if line]
  assert serve_app.DRAIN_SECONDS <= time.monotonic() - stopped < 30
  assert events[-1] == "data: [DONE]", events
  error = json.loads(events[-2][len("data: "):])["error"]
  assert error["code"] == "engine_gone" and error["message"] == "the server is stopping", error
  waiting.join(30)
  [answer] = unstreamed
  assert answer.status_code == 503 and answer.json()["error"]["code"] == "engine_gone", answer.text
  serving.join(30)
  assert not serving.is_alive() and sorted(cancelled) == [0, 0]


def test_generated_tokens_carry_their_top_alternatives_only_when_asked(served):
  """logprobs=2: each generated token lists its best alternatives (the greedy token's log-probability the
  highest); logprobs=0: the same tokens and log-probabilities, and as alternatives the chosen token's alone (the
  legacy API always returns it; the scheduler reads no alternatives for such a request)."""
  ids = served.ids(PROMPTS[1])
  body = f'{{"model": "tiny", "prompt": {ids}, "max_tokens": 5, "temperature": 0, "logprobs": '
  two = _post(served, "/v1/completions", body + "2}").json()["choices"][0]["logprobs"]
  zero = _post(served, "/v1/completions", body + "0}").json()["choices"][0]["logprobs"]
  assert zero["tokens"] == two["tokens"] and len(two["tokens"]) == 5
  np.testing.assert_allclose(zero["token_logprobs"], two["token_logprobs"], atol=1e-6)
  assert all(1 <= len(top) <= 2 and max(top.values()) == pytest.approx(lp, abs=1e-5)
             for top, lp in zip(two["top_logprobs"], two["token_logprobs"]))
  assert [len(top) for top in zero["top_logprobs"]] == [1] * 5  # was {} each
  for top, best, lp in zip(zero["top_logprobs"], two["top_logprobs"], zero["token_logprobs"]):
    assert list(top) == [max(best, key=best.__getitem__)] and top[list(top)[0]] == lp


def _direct_logprobs(served, ids: list[int]) -> np.ndarray:
  """log p(token i | tokens < i) from one full forward pass of the model, outside the server."""
  tokens = jnp.asarray([ids])
  apply = sharding.unsharded()(served.engine.spec.apply)
  logits = apply(served.params, tokens, jnp.arange(len(ids))[None], jnp.ones_like(tokens))
  logprobs = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1)
  return np.asarray(jnp.take_along_axis(logprobs, tokens[0, 1:, None], axis=-1)[:, 0])


LM_EVAL_DOCS = [{"context": "the quick brown", "choices": [" fox", " dog", " day"], "label": 0},
                {"context": "to be or", "choices": [" not", " that"], "label": 0},
                {"context": "shall i", "choices": [" compare thee", " be"], "label": 1}]


@pytest.mark.slow  # lm-eval's start-up (datasets, tokenizer, task loading) dominates
def test_lm_eval_local_completions_log_likelihoods_equal_the_model(served, tmp_path, monkeypatch):
  """lm-eval's own client, tokenizer handling and parsing on a task written here (no downloads)."""
  lm_eval = pytest.importorskip("lm_eval", reason="needs lm-eval (EXTRAS=test bash setup.sh)")
  from lm_eval.tasks import TaskManager

  from tests.lm_eval_tasks import choice_task

  import json

  monkeypatch.setenv("OPENAI_API_KEY", KEY)
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  data = tmp_path / "docs.jsonl"
  data.write_text("".join(json.dumps(d) + "\n" for d in LM_EVAL_DOCS))
  (tmp_path / "task.yaml").write_text(choice_task("serve_tiny_choice", data))
  results = lm_eval.simple_evaluate(
      model="local-completions", tasks=["serve_tiny_choice"], task_manager=TaskManager(include_path=str(tmp_path)),
      model_args=dict(base_url=f"{served.url}/v1/completions", model="tiny", tokenizer=str(served.tokenizer_dir),
                      tokenizer_backend="huggingface", max_length=MODEL["max_target_length"], num_concurrent=2),
      log_samples=True)
  samples = results["samples"]["serve_tiny_choice"]
  assert len(samples) == len(LM_EVAL_DOCS)
  scored = 0
  for sample in samples:
    for (context, continuation), ((loglikelihood, _),) in zip(sample["arguments"], sample["resps"]):
      whole, context_ids = served.ids(context + continuation), served.ids(context)
      expected = _direct_logprobs(served, whole)[len(context_ids) - 1:].sum()
      assert loglikelihood == pytest.approx(float(expected), abs=1e-4), (context, continuation)
      scored += 1
  assert scored == sum(len(d["choices"]) for d in LM_EVAL_DOCS)


def test_server_without_a_tokenizer_or_checkpoint_is_a_clear_error(tmp_path):
  from MaxText.errors import UserError

  with pytest.raises(UserError, match="needs tokenizer_path"):
    build_server(Config.for_testing(**MODEL, **LIMITS), mesh=one_device_mesh())
  tokenizer = write_tokenizer(tmp_path / "tok", None)
  with pytest.raises(UserError, match="does not exist"):
    build_server(Config.for_testing(**MODEL, **LIMITS, tokenizer_path=str(tokenizer),
                                    load_parameters_path=str(tmp_path / "missing")), mesh=one_device_mesh())


def _free_port() -> int:
  import socket

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow  # two CLI processes (JAX start-up and compiles each)
def test_cli_server_answers_like_decode_py(tmp_path):
  """`python3 -m MaxText.serve` on a params-only checkpoint, key from MAXTEXT_API_KEY: its greedy text
  equals what `python3 -m MaxText.decode` prints for the same prompt and checkpoint."""
  import ast
  import os
  import subprocess

  from MaxText import models
  from MaxText.training import params_io
  from MaxText.convert import engine as convert_engine

  model_keys = {k: MODEL[k] for k in ("base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "head_dim",
                                       "base_mlp_dim", "base_num_decoder_layers", "vocab_size")}
  checkpoint = tmp_path / "params"
  spec = models.build_model_spec(Config.for_testing(**MODEL).model)
  params_io.save_params(str(checkpoint), jax.jit(spec.init_params)(jax.random.key(5)))
  convert_engine.write_model_config(str(checkpoint), model_keys, "a test")
  tokenizer = write_tokenizer(tmp_path / "tok", None)
  common = [f"load_parameters_path={checkpoint}", f"tokenizer_path={tokenizer}", "tokenizer_type=huggingface",
            "add_bos=False", "max_target_length=24", "max_prefill_predict_length=20", "dtype=float32"]
  repo = Path(__file__).resolve().parents[1]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(1), "MAXTEXT_API_KEY": KEY}
  decoded = subprocess.run([sys.executable, "-m", "MaxText.decode", "configs/base.yml", *common, "prompt=to be or not"],
                           cwd=repo, env=env, capture_output=True, text=True, timeout=300)
  assert decoded.returncode == 0, decoded.stderr[-2000:]
  line = next(l for l in decoded.stdout.splitlines() if l.startswith("completion: "))
  expected = ast.literal_eval(line.removeprefix("completion: "))
  assert expected, decoded.stdout  # a completion with visible text to compare
  port = _free_port()
  process = subprocess.Popen([sys.executable, "-m", "MaxText.serve", "configs/base.yml", *common, f"port={port}",
                              "serve_max_tokens=32"], cwd=repo, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.monotonic() + 240
    while True:
      assert process.poll() is None and time.monotonic() < deadline, process.stdout.read() if process.stdout else ""
      try:
        if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
          break
      except httpx.TransportError:
        time.sleep(0.5)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="to be or not", max_tokens=24 - 12 + 1, temperature=0)
    assert out.choices[0].text == expected
  finally:
    process.terminate()
    process.wait(30)


def test_cancelled_job_frees_its_slot_and_a_deadline_is_a_504(served, monkeypatch):
  import dataclasses

  from MaxText.inference import scheduler as sched
  from MaxText.inference.sampling import RowParams

  events, done = [], threading.Event()

  def emit(event):  # cancels after the first token, as a handler does for a gone client
    events.append(event)
    if isinstance(event, sched.Tokens):
      job.cancel()
    if isinstance(event, sched.Done):
      done.set()

  job = sched.Job(0, served.ids(PROMPTS[0]), 16, RowParams(), emit)
  before = served.server.scheduler.load()
  served.server.scheduler.submit([job])
  assert done.wait(60)
  after = served.server.scheduler.load()
  assert events[-1].reason == "cancelled" and job.generated < 16
  assert after["released"] == before.get("released", 0) + 1 and after["active"] == 0
  monkeypatch.setattr(served.server, "decode_cfg",
                      dataclasses.replace(served.server.decode_cfg, serve_request_timeout_seconds=1e-3))
  response = _post(served, "/v1/completions", '{"model": "tiny", "prompt": "the", "max_tokens": 16}')
  assert response.status_code == 504 and "serve_request_timeout_seconds" in response.json()["error"]["message"]


def test_lora_admin_routes_of_a_server_without_adapter_tables_say_how_to_get_them(served):
  """A server started without serve_lora_adapters / serve_lora_slots answers its admin routes with one line naming
  serve_lora_slots (was a bare 404 "Not Found", as for a wrong address); the key is still checked first."""
  route = f"{served.url}/v1/admin/lora_adapters"
  auth = {"authorization": f"Bearer {KEY}"}
  answers = [httpx.get(route, headers=auth, timeout=60),
             httpx.post(route, json={"name": "a", "path": "/tmp/a"}, headers=auth, timeout=60),
             httpx.delete(f"{route}/org/a", headers=auth, timeout=60)]
  for answer in answers:
    assert answer.status_code == 404, answer.text
    error = answer.json()["error"]
    assert error["code"] == "lora_disabled" and "start it with serve_lora_slots=N" in error["message"]
  assert httpx.get(route, timeout=60).status_code == 401
