"""Request parameters of /v1/completions and /v1/chat/completions against what OpenAI and vLLM clients expect:
a seeded prompt's choices do not depend on the other prompts in its list, and a completion's text continues its
prompt's (a SentencePiece tokenizer's leading space kept). Parsing and the routes' text, without a model or HTTP
(the served model's end-to-end checks: tests/test_serve.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
from typing import Any, AsyncGenerator, Callable

import pytest

from MaxText import serve
from MaxText.inference import job_events
from MaxText.inference import choice_text
from MaxText.inference import openai_api as api
from MaxText.inference import serve_routes
from MaxText.inference.row_params import RowParams
from tests.inference.test_tool_calls import _Job, _Server

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


Tops = Callable[[int], list[tuple[int, float]]]  # a chosen token's alternatives from the device


def _own(token: int) -> list[tuple[int, float]]:
  return [(token, -1.0)]


def _events_with_tops(tokens: list[int], tops: Tops = _own) -> list[job_events.Event]:
  events: list[job_events.Event] = [job_events.Tokens(0, [t], [-1.0], [tops(t)]) for t in tokens]
  return events + [job_events.Done(0, "length")]


def _logprobs_whole(codec: api.Codec, request: api.Request, tokens: list[int], tops: Tops = _own
                    ) -> tuple[str, dict[str, Any]]:
  """The unstreamed answer's text (the echoed prompt first) and logprobs."""
  choice = serve_routes._choices(_Server(codec), request)[0]  # type: ignore[arg-type]
  units = serve_routes._units(_events_with_tops(tokens, tops))
  if request.echo:
    units.insert(0, job_events.PromptScores(0, [0.0] * len(choice.prompt), [[]] * len(choice.prompt)))
  for unit in units:
    serve_routes._apply(unit, choice, _Job())  # type: ignore[arg-type]
  logprobs = serve_routes._logprobs(_Server(codec), choice, request.logprobs or 0, request.echo)  # type: ignore
  return (codec.decode(choice.prompt) if request.echo else "") + choice.text.text, logprobs


def _logprobs_streamed(codec: api.Codec, request: api.Request, tokens: list[int], per_chunk: int, tops: Tops = _own
                       ) -> tuple[str, dict[str, list[Any]]]:
  """The streamed text and the chunks' logprobs joined, `per_chunk` tokens reaching the stream together."""
  events = _events_with_tops(tokens, tops)
  batches = [events[i:i + per_chunk] for i in range(0, len(events), per_chunk)]
  if request.echo:
    prompt = request.choices[0].prompt
    batches.insert(0, [job_events.PromptScores(0, [0.0] * len(prompt), [[]] * len(prompt))])

  async def stream() -> AsyncGenerator[list[job_events.Event], None]:
    for batch in batches:
      yield batch

  async def collect() -> list[str]:
    server: Any = _Server(codec)
    jobs: Any = [_Job()]
    return [piece async for piece in serve_routes._stream(server, dataclasses.replace(request, stream=True),
                                                          jobs, stream(), serve._sse, chat=False)]

  chunks = [json.loads(e[len("data: "):])["choices"][0] for piece in asyncio.run(collect())
            for e in piece.split("\n\n") if e.startswith("data: {")]
  joined: dict[str, list[Any]] = {"tokens": [], "text_offset": [], "top_logprobs": []}
  for c in chunks:
    for key in joined:
      joined[key] += (c["logprobs"] or {}).get(key, [])
  return "".join(c["text"] for c in chunks), joined


def _check_token_texts(codec: api.Codec, prompt: list[int], generated: list[int], whole_characters: bool = True
                       ) -> None:
  for echo in (False, True):
    request = api.Request([api.Completion(0, prompt, 16, RowParams())], stream=False, stop=[], logprobs=1, echo=echo)
    text, logprobs = _logprobs_whole(codec, request, generated)
    assert "".join(logprobs["tokens"]) == text, (echo, logprobs["tokens"], text)
    starts = [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(logprobs["tokens"]))]
    assert logprobs["text_offset"] == starts
    tops = logprobs["top_logprobs"][len(prompt) if echo else 0:]
    if whole_characters:  # a chosen token keys its own alternative by its text
      assert [list(top) for top in tops] == [[t] for t in logprobs["tokens"][len(prompt) if echo else 0:]]
    for per_chunk in (1, 2, 100):
      streamed_text, streamed = _logprobs_streamed(codec, request, generated, per_chunk)
      assert streamed_text == text and streamed["tokens"] == logprobs["tokens"], (echo, per_chunk)
      assert streamed["text_offset"] == logprobs["text_offset"]
      assert streamed["top_logprobs"] == logprobs["top_logprobs"]


def test_logprobs_tokens_join_to_the_text_with_a_sentencepiece_leading_space(spm_codec: api.Codec) -> None:
  """Each token's text in `logprobs.tokens` (and the top alternatives' keys) is as it stands in the text, so that they
  join to it and `text_offset` indexes it, streamed or not, as vLLM answers. Each token was decoded alone: " world"
  after "hello" read "world", so the tokens joined to "helloworldthe" against the text "hello world the"."""
  prompt, generated = spm_codec.encode("hello"), spm_codec.encode(" world the")
  _check_token_texts(spm_codec, prompt, generated)
  request = api.Request([api.Completion(0, prompt, 16, RowParams())], stream=False, stop=[], logprobs=1)
  assert _logprobs_whole(spm_codec, request, generated)[1]["tokens"][0].startswith(" ")


def test_logprobs_tokens_of_a_character_split_across_tokens_join_to_the_text() -> None:
  """A token that ends inside a UTF-8 character reads "" and the one that completes it carries the character (it was
  U+FFFD each, so the tokens did not join to the text); one never completed reads U+FFFD, as the text does."""
  def decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")

  codec = api.Codec(encode=lambda text: list(text.encode()), decode=decode, chat=lambda messages: [104])
  euro = list("\u20ac".encode())
  _check_token_texts(codec, list(b"hi "), euro + list(b"ok") + euro[:2], whole_characters=False)
  # the prompt ends inside the character
  _check_token_texts(codec, [104] + euro[:2], euro[2:] + list(b"ok"), whole_characters=False)
  request = api.Request([api.Completion(0, list(b"a"), 16, RowParams())], stream=False, stop=[], logprobs=0)
  assert _logprobs_whole(codec, request, euro + list(b"!"))[1]["tokens"] == ["", "", "\u20ac", "!"]


def test_completions_top_logprobs_hold_the_chosen_token_when_not_among_the_best() -> None:
  """The legacy API always returns the chosen token's logprob, so a position has up to N + 1 alternatives (was: only
  the N best, so a sampled or masked token lacked its own entry; logprobs=0 gave {}). Its key is its own entry in
  `tokens` ('' for a character's first piece, the character for its last: lm-eval's greedy check compares the two;
  it was U+FFFD for both pieces), the others' their text after the same previous token; a better token of the same
  text keeps the key (N entries). Streamed in any chunking equals unstreamed; an echoed prompt's tokens get theirs too."""
  def decode(ids: list[int]) -> str:  # 0x100 | c reads as c too; bytes otherwise (split characters and all)
    return bytes(i & 0xFF for i in ids).decode("utf-8", errors="replace")

  codec = api.Codec(encode=lambda text: list(text.encode()), decode=decode, chat=lambda messages: [104])
  best = {ord("o"): [(0x100 | ord("o"), -0.1), (ord("z"), -0.5)], ord("k"): [(ord("z"), -0.5), (ord("k"), -1.0)]}

  def tops(token: int) -> list[tuple[int, float]]:
    return best.get(token, [(ord("z"), -0.5), (ord("y"), -0.7)])

  generated = list(b"ok") + list("\u00e9".encode()) + [0xF0]  # é in two tokens, then a character never finished
  for n in (0, 1, 2, 5):
    expected = [dict([("o", -0.1), ("z", -0.5)][:n]) or {"o": -1.0}, {**dict([("z", -0.5), ("k", -1.0)][:n]),
                                                                         "k": -1.0}]
    expected += [{**dict([("z", -0.5), ("y", -0.7)][:n]), chosen: -1.0} for chosen in ("", "\u00e9", "\ufffd")]
    for echo in (False, True):
      request = api.Request([api.Completion(0, list(b"hi"), 16, RowParams())], stream=False, stop=[], logprobs=n,
                            echo=echo)
      text, whole = _logprobs_whole(codec, request, generated, tops)
      assert whole["top_logprobs"] == ([None, {"i": 0.0}] if echo else []) + expected, (n, echo)
      assert whole["tokens"][-5:] == ["o", "k", "", "\u00e9", "\ufffd"]
      for per_chunk in (1, 2, 100):
        streamed_text, streamed = _logprobs_streamed(codec, request, generated, per_chunk, tops)
        assert streamed_text == text and streamed["top_logprobs"] == whole["top_logprobs"], (n, echo, per_chunk)


def test_best_of_below_n_is_refused_naming_best_of() -> None:
  """OpenAI and vLLM refuse best_of < n (the n returned are chosen among best_of); best_of=1 with n=2 was served as n=2.
  best_of is read only at 1, so with n > 1 it is left out; n alone, or best_of=1 with n=1, still works."""
  with pytest.raises(api.ApiError) as refused:
    api.parse_completion({"prompt": "the", "n": 2, "best_of": 1}, LIMITS, CODEC)
  assert (refused.value.status, refused.value.param) == (400, "best_of") and "n" in refused.value.message
  for body in ({"n": 2}, {"n": 1, "best_of": 1}, {"best_of": 1}, {"n": 2, "best_of": None}):
    assert len(api.parse_completion({"prompt": "the", **body}, LIMITS, CODEC).choices) == body.get("n", 1)


def test_logprobs_zero_decodes_no_alternative() -> None:
  """With logprobs=0 a position's only entry is its chosen token, keyed by its text in `tokens`: no decode per token
  (it was two per token, about a tenth of the event loop's time in a streaming benchmark)."""
  def alternative(position: int, token: int) -> str:
    raise AssertionError(f"decoded an alternative at {position}: {token}")

  out = choice_text.completion_logprobs(["a", "b"], [5, 6], [-0.5, -0.25], [[(5, -0.5)], [(6, -0.25)]], 0, alternative)
  assert out["top_logprobs"] == [{"a": -0.5}, {"b": -0.25}]
