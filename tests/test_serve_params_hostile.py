"""Request parameters of /v1/completions and /v1/chat/completions against what OpenAI and vLLM clients expect:
a seeded prompt's choices do not depend on the other prompts in its list, and a completion's text continues its
prompt's (a SentencePiece tokenizer's leading space kept). Parsing and the routes' text, without a model or HTTP
(the served model's end-to-end checks: tests/test_serve.py)."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any, AsyncGenerator

import pytest

from MaxText import serve
from MaxText.inference import job_events
from MaxText.inference import openai_api as api
from MaxText.inference import serve_routes
from MaxText.inference.row_params import RowParams

LIMITS = api.Limits("tiny", 272, 32, 48, 16, 8)
CODEC = api.Codec(encode=lambda text: [5, 6, 7], decode=lambda ids: "x", chat=lambda messages: [5, 6, 7])


def _seeds(body: dict[str, Any]) -> list[int]:
  return [c.row.seed for c in api.parse_completion(body, LIMITS, CODEC).choices]


def test_a_seeded_prompt_draws_the_same_alone_or_in_a_list_of_prompts() -> None:
  """Choice j of every prompt draws with seed + j. Before, it was seed + its index in the answer, so the same prompt
  sampled differently by its place in the list (lm-eval sends batches of prompts with one seed)."""
  base = {"temperature": 1.0, "seed": 11, "n": 2}
  together = _seeds({**base, "prompt": [[5, 6], [7, 8], [9]]})
  assert together == [11, 12] * 3
  assert _seeds({**base, "prompt": [7, 8]}) == together[2:4]
  assert _seeds({"temperature": 1.0, "seed": 2**32 - 1, "prompt": [[5], [6]], "n": 2}) == [2**32 - 1, 0] * 2


@pytest.fixture(scope="module")
def spm_codec() -> api.Codec:
  """A SentencePiece BPE model trained on a few words: its decode drops the space a text's first word carries."""
  spm = pytest.importorskip("sentencepiece")
  text = "hello world the quick brown fox jumps over the lazy dog\n" * 50
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(sentence_iterator=iter(text.splitlines()), model_writer=model, vocab_size=60,
                                 model_type="bpe", minloglevel=2)
  sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
  return api.Codec(encode=sp.EncodeAsIds, decode=sp.DecodeIds, chat=lambda messages: sp.EncodeAsIds("hello"))


class _Job:
  def cancel(self) -> None:
    pass


class _Server:
  class limits:
    model_name = "tiny"

  def __init__(self, codec: api.Codec):
    self.codec = codec

  def token_text(self, token: int) -> str:
    return self.codec.decode([token])


def _events(tokens: list[int]) -> list[job_events.Event]:
  events: list[job_events.Event] = [job_events.Tokens(0, [t], [-1.0], [[]]) for t in tokens]
  return events + [job_events.Done(0, "length")]


def _whole(codec: api.Codec, request: api.Request, tokens: list[int], chat: bool) -> str:
  choice = serve_routes._choices(_Server(codec), request, chat)[0]  # type: ignore[arg-type]
  for unit in serve_routes._units(_events(tokens)):
    serve_routes._apply(unit, choice, _Job())  # type: ignore[arg-type]
  return choice.text.text


def _streamed(codec: api.Codec, request: api.Request, tokens: list[int], chat: bool) -> str:
  async def events() -> AsyncGenerator[list[job_events.Event], None]:
    for event in _events(tokens):
      yield [event]

  async def collect() -> list[str]:
    jobs: list[Any] = [_Job()]
    return [piece async for piece in serve_routes._stream(_Server(codec), request, jobs,  # type: ignore[arg-type]
                                                          events(), serve._sse, chat=chat)]

  chunks = [json.loads(e[len("data: "):]) for piece in asyncio.run(collect()) for e in piece.split("\n\n")
            if e.startswith("data: {")]
  return "".join((c["choices"][0]["delta"].get("content") or "") if chat else c["choices"][0]["text"]
                 for c in chunks if c["choices"])


@pytest.mark.parametrize("stop", [[], ["fox"]])
def test_a_completion_keeps_the_leading_space_a_sentencepiece_token_carries(spm_codec: api.Codec,
                                                                          stop: list[str]) -> None:
  """Prompt + text is the whole text, as vLLM and OpenAI answer: "hello" continued by " world" was "world" (each
  choice's tokens were decoded alone, and SentencePiece drops a text's leading space), so an echoed completion read
  "helloworld". A chat's reply is a message of its own and starts without it."""
  prompt, generated = spm_codec.encode("hello"), spm_codec.encode(" world the")
  whole = spm_codec.decode(prompt + generated)
  assert whole == "hello world the" and not spm_codec.decode(generated).startswith(" ")
  request = api.Request([api.Completion(0, prompt, 16, RowParams())], stream=False, stop=stop)
  assert _whole(spm_codec, request, generated, chat=False) == " world the"
  assert _streamed(spm_codec, request, generated, chat=False) == " world the"
  echoed = api.Request(request.choices, stream=True, stop=stop, echo=True)
  assert _streamed(spm_codec, echoed, generated, chat=False) == whole
  assert _whole(spm_codec, request, generated, chat=True) == _streamed(spm_codec, request, generated, chat=True) \
      == "world the"


def test_a_prompt_ending_inside_a_character_leaves_the_text_as_its_tokens_alone() -> None:
  """A prompt of token ids may end inside a UTF-8 sequence that the first generated token completes: its text is then
  not a prefix of the joined text, and the choice's text is its own tokens' (what it was before the context)."""
  def decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")

  codec = api.Codec(encode=lambda text: list(text.encode()), decode=decode, chat=lambda messages: [104])
  euro = list("\u20ac".encode())  # 3 bytes
  request = api.Request([api.Completion(0, [104] + euro[:2], 16, RowParams())], stream=False, stop=[])
  generated = euro[2:] + list(b"ok")
  assert _whole(codec, request, generated, chat=False) == _streamed(codec, request, generated, False) == decode(
      generated)
  plain = api.Request([api.Completion(0, list(b"hi "), 16, RowParams())], stream=False, stop=["k"])
  assert _whole(codec, plain, list(b"ok"), chat=False) == "o"


def test_top_k_minus_one_keeps_every_token_as_vllm_reads_it() -> None:
  """vLLM's clients send top_k -1 for "all tokens" (0 too); it was a 400. Below -1 is still a 400 naming top_k."""
  for route, base in ((api.parse_completion, {"prompt": "the"}),
                      (api.parse_chat, {"messages": [{"role": "user", "content": "hi"}]})):
    for top_k, kept in ((-1, 0), (0, 0), (1, 1), (10**30, LIMITS.vocab_size)):
      assert [c.row.top_k for c in route({**base, "top_k": top_k}, LIMITS, CODEC).choices] == [kept]
    for bad in (-2, 2.5, "5", True):
      with pytest.raises(api.ApiError) as refused:
        route({**base, "top_k": bad}, LIMITS, CODEC)
      assert (refused.value.status, refused.value.param) == (400, "top_k")
