"""A stream sends the tokens that reach it together (a call of several decode steps) as one chunk:
the text and the per-token logprobs equal those of one chunk per token, stop sequences cut at the
same place, and the scheduler thread's events wake the event loop once for every job (serve._Mailbox)."""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest

from MaxText import serve
from MaxText.inference import choice_text
from MaxText.inference import openai_api as api
from MaxText.inference import scheduler as sched
from MaxText.inference import serve_routes
from MaxText.inference.sampling import RowParams

TEXT = "hello, streaming world"


class _Job:
  cancelled = False

  def cancel(self) -> None:
    self.cancelled = True


class _Server:
  class limits:
    model_name = "tiny"

  codec = api.Codec(encode=lambda t: [5], decode=lambda ids: "".join(chr(i) for i in ids), chat=lambda m: [5])

  @staticmethod
  def token_text(token: int) -> str:
    return chr(token)


def _tokens(text: str) -> list[sched.Tokens]:
  return [sched.Tokens(0, [ord(ch)], [-0.5 - i], [[(ord(ch), -0.5 - i)]]) for i, ch in enumerate(text)]


def _chunks(batches: list[list[sched.Event]], stop: list[str], chat: bool = False) -> tuple[list[dict], _Job]:
  request = api.Request([api.Completion(0, [5], 99, RowParams())], stream=True, stop=stop,
                        logprobs=None if chat else 1)
  job = _Job()
  return [json.loads(e[len("data: "):]) for piece in _pieces(batches, request, job, chat)
          for e in piece.split("\n\n") if e.startswith("data: {")], job


def _pieces(batches: list[list[sched.Event]], request: api.Request, job: _Job, chat: bool) -> list[str]:
  """What the stream yields: each piece is one write of the answer."""
  async def events():
    for batch in batches:
      yield batch

  async def collect():
    return [piece async for piece in serve_routes._stream(_Server(), request, [job], events(),  # type: ignore[arg-type]
                                                          serve._sse, chat=chat)]

  return asyncio.run(collect())


def _text_and_logprobs(chunks: list[dict]) -> tuple[str, list[str], list[float]]:
  choices = [c["choices"][0] for c in chunks]
  tokens = [t for c in choices if c.get("logprobs") for t in c["logprobs"]["tokens"]]
  logprobs = [lp for c in choices if c.get("logprobs") for lp in c["logprobs"]["token_logprobs"]]
  return "".join(c.get("text") or "" for c in choices), tokens, logprobs


def test_tokens_that_arrive_together_go_out_as_one_chunk_with_a_logprob_per_token():
  tokens = _tokens(TEXT)
  one_each, _ = _chunks([[t] for t in tokens] + [[sched.Done(0, "length")]], stop=[])
  together, _ = _chunks([tokens[:8], tokens[8:] + [sched.Done(0, "length")]], stop=[])
  assert _text_and_logprobs(together) == _text_and_logprobs(one_each) == (TEXT, list(TEXT),
                                                                          [-0.5 - i for i in range(len(TEXT))])
  assert len(one_each) == len(TEXT) + 1 and len(together) == 3  # two calls' chunks, then the finish_reason
  first = together[0]["choices"][0]
  assert first["text"] == TEXT[:8] and first["logprobs"]["text_offset"] == list(range(8))
  assert together[-1]["choices"][0]["finish_reason"] == "length"


def test_a_stop_sequence_inside_a_call_cuts_where_it_does_token_by_token():
  tokens = _tokens(TEXT)
  for stop in (["streaming"], [", s", "o"], ["zzz"]):
    one_each, job_each = _chunks([[t] for t in tokens] + [[sched.Done(0, "cancelled")]], stop=stop)
    together, job_together = _chunks([tokens, [sched.Done(0, "cancelled")]], stop=stop)
    assert _text_and_logprobs(together) == _text_and_logprobs(one_each), stop
    assert job_together.cancelled == job_each.cancelled == (stop != ["zzz"])
  assert _text_and_logprobs(together)[0] == TEXT  # no stop found: all of it
  text, got, _ = _text_and_logprobs(_chunks([tokens, [sched.Done(0, "cancelled")]], stop=[", s", "o"])[0])
  assert text == "hell" and got == list("hello")  # the token that completed the stop is counted, as before


def test_a_chat_stream_joins_a_calls_tokens_into_one_delta():
  chunks, _ = _chunks([_tokens(TEXT), [sched.Done(0, "length")]], stop=[], chat=True)
  deltas = [c["choices"][0]["delta"] for c in chunks]
  assert deltas == [{"role": "assistant", "content": ""}, {"content": TEXT}, {}]


def test_the_mailbox_wakes_the_loop_once_for_every_job_and_keeps_each_jobs_order():
  async def main() -> list[list[list[int]]]:
    loop = asyncio.get_running_loop()
    mailbox = serve._Mailbox(loop)
    queues = [asyncio.Queue[list[sched.Event]]() for _ in range(3)]
    emits = [mailbox.emitter(q) for q in queues]
    moves = []
    original = mailbox._move
    mailbox._move = lambda: (moves.append(1), original())  # type: ignore[method-assign]

    def scheduler_thread() -> None:  # one call's tokens for three jobs, delivered before the loop runs
      for step in range(4):
        for job, emit in enumerate(emits):
          emit(sched.Tokens(job, [10 * job + step], [0.0], [[]]))

    thread = threading.Thread(target=scheduler_thread)
    thread.start()
    thread.join()
    got = [[[t for e in await q.get() if isinstance(e, sched.Tokens) for t in e.tokens]] for q in queues]
    assert len(moves) == 1 and all(q.empty() for q in queues)
    emits[1](sched.Done(1, "length"))  # the next event schedules the next move
    assert [e.reason for e in await asyncio.wait_for(queues[1].get(), 5) if isinstance(e, sched.Done)] == ["length"]
    return got

  assert asyncio.run(main()) == [[[0, 1, 2, 3]], [[10, 11, 12, 13]], [[20, 21, 22, 23]]]


def test_the_events_that_arrive_together_go_out_in_one_write_and_the_last_with_the_end_of_the_stream():
  tokens = _tokens(TEXT)
  request = api.Request([api.Completion(0, [5], 99, RowParams())], stream=True, stop=[], logprobs=1,
                        include_usage=True)
  pieces = _pieces([tokens[:8], tokens[8:] + [sched.Done(0, "length")]], request, _Job(), chat=False)
  assert len(pieces) == 2  # a call's tokens; then the last call's with its finish_reason, the usage and [DONE]
  assert pieces[0].count("data: ") == 1 and pieces[1].count("data: ") == 4
  assert pieces[1].endswith(serve_routes.STREAM_END)

  async def answer() -> list[dict]:
    async def body():
      for piece in pieces:
        yield piece

    sent: list[dict] = []

    async def send(message: dict) -> None:
      sent.append(message)

    await serve_routes.SseResponse(body(), media_type="text/event-stream").stream_response(send)
    return sent

  sent = asyncio.run(answer())
  assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
  assert [m["more_body"] for m in sent[1:]] == [True, False]  # no separate empty write ends the answer
  assert b"".join(m["body"] for m in sent[1:]).decode() == "".join(pieces)


def test_a_stream_starts_no_task_listening_for_the_clients_disconnect():
  """Under uvicorn's ASGI 2.3 StreamingResponse reads `receive` in a task beside the stream to notice a client gone;
  SseResponse leaves that to serve.Server.events' once-a-second check, so the stream alone runs."""
  async def answer() -> tuple[list[dict], int]:
    async def body():
      yield "data: {}\n\n" + serve_routes.STREAM_END

    sent: list[dict] = []
    reads = 0

    async def receive() -> dict:
      nonlocal reads
      reads += 1
      await asyncio.sleep(3600)
      return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
      sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
    await serve_routes.SseResponse(body(), media_type="text/event-stream")(scope, receive, send)
    return sent, reads

  sent, reads = asyncio.run(answer())
  assert reads == 0 and [m.get("more_body") for m in sent] == [None, False]


def _bytes_text(ids: list[int]) -> str:
  """A byte-level tokenizer's decode: a token is one byte; an incomplete or invalid UTF-8 sequence is U+FFFD."""
  return bytes(ids).decode("utf-8", errors="replace")


def _streamed(tokens: list[int], stops: list[str], per_call: int) -> tuple[str, choice_text.ChoiceText]:
  """The deltas a stream sends (`per_call` tokens arrive together) joined, and the choice's text."""
  text, deltas = choice_text.ChoiceText(_bytes_text, stops), []
  for at in range(0, len(tokens), per_call):
    deltas.append(text.add_many(tokens[at:at + per_call])[0] if per_call > 1 else text.add(tokens[at]))
    if text.stopped:
      break
  deltas.append(text.flush())
  return "".join(deltas), text


def test_characters_split_across_tokens_stream_the_unstreamed_text_and_stop_where_it_does():
  """Multi-byte characters split across tokens, beside invalid bytes (the model's own U+FFFD): an incomplete character's
  U+FFFD neither goes out nor matches a stop sequence before the token that completes it; the streamed deltas join to
  the choice's text, which is the whole decode cut before a stop sequence that it holds."""
  rare = "\U00018dcf".encode()  # four bytes
  tokens = list(b"i\x80") + list(rare) + list("é".encode())
  # A stop that starts before an incomplete character (was: "i" sent, then the text cut to "").
  streamed, text = _streamed(tokens, ["i\ufffd\U00018dcf"], 1)
  assert streamed == text.text == "" and text.stopped
  # A stop of U+FFFD is not found in a character still being completed, only in the model's invalid byte (was: "").
  streamed, text = _streamed(list("é".encode()) + [0x80], ["\ufffd"], 1)
  assert streamed == text.text == "é" and text.stopped
  rng = np.random.default_rng(0)
  pieces = [b"a", b"\x80", "é".encode(), "日".encode(), rare, b"\xf0\x9f"]  # the last: cut short
  for _ in range(200):
    ids = [b for i in rng.integers(0, len(pieces), 8) for b in pieces[i]]
    whole = _bytes_text(ids)
    at = int(rng.integers(0, len(whole)))
    stops = [whole[at:at + int(rng.integers(1, 4))]] if rng.random() < 0.8 else []
    for per_call in (1, 8):
      streamed, text = _streamed(ids, stops, per_call)
      assert streamed == text.text, (ids, stops, per_call)
      if text.stopped:
        assert any(whole.startswith(text.text + s) for s in stops), (ids, stops)
      else:
        assert text.text == whole and not any(s in whole for s in stops), (ids, stops)


def test_a_stop_sequence_in_the_last_characters_ends_the_choice_with_stop():
  """A stop sequence that only the end of the choice settles (its last character U+FFFD) is cut there: finish_reason
  "stop", as it would be found mid-stream."""
  choice = serve_routes._Choice(choice_text.ChoiceText(_bytes_text, ["\ufffd"]), [5])
  job = _Job()
  assert serve_routes._apply(sched.Tokens(0, list(b"ab\x80"), [0.0] * 3, [[]] * 3), choice, job) == "ab"  # type: ignore[arg-type]
  assert serve_routes._apply(sched.Done(0, "length"), choice, job) == ""  # type: ignore[arg-type]
  assert choice.text.text == "ab" and choice.finish_reason == "stop"


def test_response_ids_are_unique_without_a_random_draw_per_response(monkeypatch: pytest.MonkeyPatch):
  """Each answer's id is its own (24 hex digits after its prefix, as before) with no system call for randomness per
  answer (was: a uuid4 each, an os.urandom call on the event loop); a forked child draws its own random part."""
  import os
  import re

  monkeypatch.setattr(os, "urandom", lambda n: (_ for _ in ()).throw(AssertionError("os.urandom per id")))
  ids = [serve_routes._new_id("cmpl") for _ in range(1000)]
  assert len(set(ids)) == 1000 and all(re.fullmatch(r"cmpl-[0-9a-f]{24}", i) for i in ids)
  monkeypatch.undo()
  read, write = os.pipe()
  pid = os.fork()
  if pid == 0:  # the child: its first id, then out without pytest's teardown
    os.write(write, serve_routes._new_id("cmpl").encode())
    os._exit(0)
  os.waitpid(pid, 0)
  child = os.read(read, 64).decode()
  assert child[5:17] != serve_routes._new_id("cmpl")[5:17]


def test_streamed_text_offsets_count_from_the_choices_start_as_unstreamed():
  """Each token's text_offset is its place in the choice's text (after the echoed prompt), whatever the chunks: a call
  per token gave every token offset 0, and each chunk started again at 0."""
  tokens = _tokens(TEXT)
  for batches in ([[t] for t in tokens], [tokens[:3], tokens[3:10], tokens[10:]]):
    chunks, _ = _chunks(batches + [[sched.Done(0, "length")]], stop=[])
    offsets = [o for c in chunks if c["choices"][0]["logprobs"] for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == list(range(len(TEXT))), offsets
  prompt = [ord(ch) for ch in "say:"]
  request = api.Request([api.Completion(0, prompt, 99, RowParams())], stream=True, stop=[], logprobs=0, echo=True)
  scores = sched.PromptScores(0, [0.0, -1.0, -1.0, -1.0], [[]] * 4)
  pieces = _pieces([[scores], tokens[:5], tokens[5:] + [sched.Done(0, "length")]], request, _Job(), chat=False)
  chunks = [json.loads(e[len("data: "):]) for piece in pieces for e in piece.split("\n\n") if e.startswith("data: {")]
  offsets = [o for c in chunks if c["choices"][0]["logprobs"] for o in c["choices"][0]["logprobs"]["text_offset"]]
  assert offsets == list(range(len("say:") + len(TEXT))), offsets


def _tokenizers() -> dict[str, object]:
  """A byte-level BPE (GPT-2/Llama 3 style) and a SentencePiece-style BPE with byte fallback and a leading-space
  strip (Llama 2 style), trained here on a few sentences."""
  import json as _json

  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  text = "the quick brown fox jumps over a lazy dog; to be or not to be, that is the question. naïve café 日本 ok"
  byte_level = Tokenizer(models.BPE())
  byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  byte_level.decoder = decoders.ByteLevel()
  byte_level.train_from_iterator([text] * 4, trainers.BpeTrainer(vocab_size=320,
                                                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  piece = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
  piece.pre_tokenizer = pre_tokenizers.Metaspace()
  piece.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
  piece.train_from_iterator([text] * 4, trainers.BpeTrainer(
      vocab_size=320, special_tokens=["<unk>"] + [f"<0x{b:02X}>" for b in range(256)]))
  spec = _json.loads(piece.to_str())  # the byte tokens are vocabulary, not special tokens decode would skip
  spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] == "<unk>"]
  return {"byte-level": byte_level, "sentencepiece": Tokenizer.from_str(_json.dumps(spec))}


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_a_choices_text_decodes_only_its_new_tokens_and_equals_the_whole_decode(kind: str):
  """Was: every call decoded the choice's whole token list (and with stop sequences every token did), so a long
  completion cost the event loop time quadratic in its length (4096 tokens: most of a second). Now the work per
  call is the tokens since the last settled ones, and the text, the deltas and the stop cut are those of decoding
  the whole: random ids of two tokenizer styles (byte pieces among them), a prompt token before, 1 to 8 tokens a
  call, with and without stop sequences."""
  tokenizer = _tokenizers()[kind]
  decoded = [0]

  def decode(ids: list[int]) -> str:
    decoded[0] += len(ids)
    return tokenizer.decode(ids)  # type: ignore[attr-defined]

  vocab = tokenizer.get_vocab_size()  # type: ignore[attr-defined]
  rng = np.random.default_rng(1)
  byte_ids = {tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256)} - {None}  # type: ignore[attr-defined]
  words = [i for i in range(1, vocab) if i not in byte_ids]

  def draw(length: int) -> list[int]:
    """Ids as a model writes them: byte-fallback tokens only as whole UTF-8 characters (a run of byte tokens
    that is not UTF-8 reads as U+FFFD throughout, a text that later tokens rewrite, which no stream can send)."""
    if not byte_ids:
      return [int(i) for i in rng.integers(1, vocab, length)]
    out: list[int] = []
    while len(out) < length:
      if rng.random() < 0.25:
        out += [tokenizer.token_to_id(f"<0x{b:02X}>") for b in "é日\U0001F600"[int(rng.integers(0, 3))].encode()]  # type: ignore[attr-defined]
      else:
        out.append(words[int(rng.integers(0, len(words)))])
    return out

  for trial in range(120):
    ids = draw(int(rng.integers(1, 40)))
    context = draw(1)[-1:]
    whole = tokenizer.decode(context + ids)  # type: ignore[attr-defined]
    head = tokenizer.decode(context)  # type: ignore[attr-defined]
    expected = whole[len(head):] if whole.startswith(head) else tokenizer.decode(ids)  # type: ignore[attr-defined]
    at = int(rng.integers(0, max(len(expected), 1)))
    stops = [expected[at:at + int(rng.integers(1, 4))]] if trial % 3 and expected.strip("\ufffd") else []
    for per_call in (1, 3, 8):
      text, deltas = choice_text.ChoiceText(decode, stops, context=context), []
      for start in range(0, len(ids), per_call):
        deltas.append(text.add_many(ids[start:start + per_call])[0])
        if text.stopped:
          break
      deltas.append(text.flush())
      assert "".join(deltas) == text.text, (kind, ids, stops, per_call)
      if text.stopped:
        assert any(expected.startswith(text.text + s) for s in stops), (kind, ids, stops, per_call)
        assert not any(s in text.text for s in stops)
      else:
        assert text.text == expected, (kind, context, ids, per_call)
  for _ in range(40):  # any ids, invalid byte runs too: what went out is the text
    ids = [int(i) for i in rng.integers(1, vocab, 30)]
    text, deltas = choice_text.ChoiceText(decode, [], context=ids[:1]), []
    deltas += [text.add_many(ids[start:start + 3])[0] for start in range(1, len(ids), 3)] + [text.flush()]
    assert "".join(deltas) == text.text, (kind, ids)
  long_ids = draw(3000)
  for stops in ([], ["\x00never"]):
    decoded[0] = 0
    text = choice_text.ChoiceText(decode, stops, context=long_ids[:1])
    for token in long_ids[1:]:
      text.add_many([token])
    text.flush()
    assert decoded[0] < 20 * len(long_ids), (stops, decoded[0])  # was ~ n^2 / 2: 4.5 million


def test_an_event_is_json_whatever_its_text_and_an_infinite_logprob_reads_as_the_floor():
  """Server-sent events are written by orjson; a text orjson refuses (a lone surrogate, which a request's text can
  hold) still goes out, through json; a -inf log-probability is -9999.0, as the OpenAI API reports it (was: json's
  `-Infinity`, which is not JSON: a strict client's parser rejects the whole event)."""
  from MaxText.inference import serve_app

  for obj in ({"text": "caf\u00e9 \U0001F600", "n": [1, 2.5, None]}, {"text": "lone \ud800 surrogate"}):
    event = serve_app.sse(obj)
    assert event.startswith("data: ") and event.endswith("\n\n") and json.loads(event[6:]) == obj
  out = choice_text.completion_logprobs(["a", "b"], [1, 2], [float("-inf"), -0.5], [[(1, float("-inf"))], [(3, -0.1)]], 1,
                                lambda i, token: chr(96 + token))
  assert out["token_logprobs"] == [-9999.0, -0.5] and out["top_logprobs"] == [{"a": -9999.0}, {"c": -0.1, "b": -0.5}]
  json.loads(serve_app.sse(out)[6:], parse_constant=lambda name: pytest.fail(f"{name} in an event"))


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_logprob_token_texts_read_a_one_token_run_from_the_servers_cache(kind: str):
  """Each token's logprobs text is decoded after the run settled before it; a run of one token (most) is read from
  the server's cache of single-token texts: one decode per token, not two, and the same texts."""
  tokenizer = _tokenizers()[kind]
  decoded = [0]

  def decode(ids: list[int]) -> str:
    decoded[0] += 1
    return tokenizer.decode(ids)  # type: ignore[attr-defined]

  cache: dict[int, str] = {}
  rng = np.random.default_rng(2)
  text_ids = tokenizer.encode("to be or not to be, that is the question; the lazy dog " * 3).ids  # type: ignore[attr-defined]
  for trial in range(31):
    ids = text_ids[:40] if trial == 30 else [int(i) for i in rng.integers(1, tokenizer.get_vocab_size(), 40)]  # type: ignore[attr-defined]
    decoded[0] = 0
    plain = choice_text.TokenTexts(decode, ids[:1])
    expected = [t for at in range(1, 40, 5) for t in plain.add(ids[at:at + 5])] + plain.finish()
    before, decoded[0] = decoded[0], 0
    cached = choice_text.TokenTexts(decode, ids[:1], lambda t: cache.setdefault(t, tokenizer.decode([t])))  # type: ignore[attr-defined]
    got = [t for at in range(1, 40, 5) for t in cached.add(ids[at:at + 5])] + cached.finish()
    assert got == expected and decoded[0] < before, (ids, before, decoded[0])
    if trial == 30:  # a text's tokens: each its own settled run
      assert decoded[0] <= len(ids) and before >= 2 * (len(ids) - 1), (before, decoded[0])
