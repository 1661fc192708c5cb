"""Hostile structured-output requests against the server (inference/grammar.py through openai_api), driven by the
official `openai` client where it can send the request: a schema whose required text holds a character no token of
the tokenizer spells (a tokenizer without byte tokens) is a 400 naming response_format, not a failed generation
(500) on every request; and a schema or a forced tool's parameters holding NaN or Infinity (which Python's json
reads from a body, though JSON has no such number) is a 400 naming the part, not a reply forced to `null`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

openai = pytest.importorskip("openai", reason="needs openai (EXTRAS=test bash setup.sh)")
pytest.importorskip("uvicorn", reason="needs uvicorn (pip install -r requirements.txt)")
pytest.importorskip("llguidance", reason="needs llguidance (pip install -r requirements.txt)")
pytest.importorskip("transformers", reason="the tokenizer is read through transformers")
try:  # the openai client's own HTTP library (httpx2 in openai 3.x, httpx before)
  import httpx2 as httpx
except ImportError:
  httpx = pytest.importorskip("httpx")

from MaxText.configuration.config import Config  # noqa: E402
from MaxText.serve import build_app, build_server  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from decode_test_utils import one_device_mesh  # noqa: E402
from tests.uvicorn_thread import UvicornThread  # noqa: E402
from test_serve_constrained import MODEL, TEMPLATE  # noqa: E402

MESSAGES = [{"role": "user", "content": "a b"}]
SPELLED = "a b ab ba {} : , \" 1 2 3 [ ] null true false"  # every character the tokenizer below knows


def write_tokenizer_without_byte_tokens(directory: Path) -> Path:
  """A SentencePiece-style BPE (Llama's decoder) trained on SPELLED only: no byte tokens, so a character outside
  SPELLED (a `z`) has no token; llguidance reads it (ByteFallback decoder)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
  tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
  tokenizer.train_from_iterator([SPELLED] * 5, trainers.BpeTrainer(vocab_size=60,
                                                                   special_tokens=["<unk>", "<s>", "</s>"]))
  directory.mkdir(parents=True, exist_ok=True)
  tokenizer.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": TEMPLATE}))
  return directory


class Served:
  def __init__(self, tmp: Path):
    tokenizer = write_tokenizer_without_byte_tokens(tmp / "tok")
    self.server = build_server(Config.for_testing(**MODEL, tokenizer_path=str(tokenizer)), mesh=one_device_mesh())
    self.http = UvicornThread(build_app(self.server, api_key="k"))
    self.client = openai.OpenAI(base_url=f"{self.http.url}/v1", api_key="k", max_retries=0, timeout=300)

  def post(self, body: dict[str, Any]) -> httpx.Response:
    """A chat request sent as Python's json writes it (NaN and Infinity as such), which the openai client refuses
    to send."""
    return httpx.post(f"{self.http.url}/v1/chat/completions", content=json.dumps(body), timeout=300,
                      headers={"content-type": "application/json", "authorization": "Bearer k"})

  def close(self) -> None:
    self.http.close()
    self.server.scheduler.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
  s = Served(tmp_path_factory.mktemp("hostile"))
  yield s
  s.close()


def schema(s: dict[str, Any]) -> dict[str, Any]:
  return {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}


def still_serves_json(served: Served) -> None:
  answer = served.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0,
                                                 response_format={"type": "json_object"})
  assert answer.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("fmt", [
    schema({"type": "object", "properties": {"zz": {"type": "integer"}}, "required": ["zz"]}),
    schema({"const": "z"}),
    {"type": "regex", "regex": "az"},
    {"type": "regex", "regex": "(a|b)z"},
    {"type": "regex", "regex": "[ab]+\u00e9"},
    {"type": "grammar", "grammar": 'start: ("a" | "b") "z"'},
], ids=["required-key", "const", "regex", "regex-after-a-choice", "regex-after-a-loop", "lark-after-a-choice"])
def test_a_required_character_no_token_spells_is_a_400(served: Served, fmt: dict[str, Any]) -> None:
  """Was: compiled, and every reply reached the character, took llguidance's stand-in token and ended as a 500
  generation_failed (a regex or a Lark grammar whose model chooses before the character: compiled even after the
  forced opening was walked; the reply dead-ended, or looped to max_tokens)."""
  with pytest.raises(openai.BadRequestError) as raised:
    served.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
                                          response_format=fmt)
  body = raised.value.body
  assert body["param"] == "response_format" and "no text satisfies it" in body["message"], body
  assert "\n" not in body["message"]
  still_serves_json(served)


def test_nan_or_infinity_anywhere_in_a_body_is_a_400_naming_it(served: Served) -> None:
  """Was: {"const": NaN} compiled (llguidance reads NaN as null) and the reply was `null` with finish_reason stop;
  a temperature of NaN passed the range check (every comparison with NaN is false). JSON has neither: the body is
  refused as it is read (the grammar compiler refuses them too, for callers that are not the HTTP routes)."""
  tools = [{"type": "function", "function": {"name": "f", "parameters": {
      "type": "object", "properties": {"a": {"const": float("-inf")}}, "required": ["a"]}}}]
  for fields, constant in (({"response_format": schema({"const": float("nan")})}, "NaN"),
                           ({"response_format": schema({"type": "object", "properties": {
                               "a": {"enum": [1, float("inf")]}}, "required": ["a"]})}, "Infinity"),
                           ({"tools": tools, "tool_choice": "required"}, "-Infinity"),
                           ({"temperature": float("nan")}, "NaN")):
    answer = served.post({"model": "tiny", "messages": MESSAGES, "max_tokens": 8, **fields})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_json", error
    assert f"{constant} is not a JSON number (JSON has no NaN or Infinity)" in error["message"], error
    assert "\n" not in error["message"], error
  still_serves_json(served)


@pytest.fixture(scope="module")
def compiler(tmp_path_factory: pytest.TempPathFactory) -> Any:
  from transformers import PreTrainedTokenizerFast

  from MaxText.inference import grammar

  directory = write_tokenizer_without_byte_tokens(tmp_path_factory.mktemp("speller") / "tok")
  return grammar.Compiler(PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json")), 64, [2])


def dead_ends(compiled: Any, depth: int = 12) -> tuple[list[list[int]], int]:
  """Every token sequence the masks allow (up to `depth` tokens) that reaches a dead end, and how many complete."""
  dead: list[list[int]] = []
  complete = 0
  stack: list[list[int]] = [[]]
  while stack:
    tokens = stack.pop()
    constraint = compiled.constraint()
    ended = any([constraint.advance(t) for t in tokens])
    if constraint.failure():
      dead.append(tokens)
    elif ended:
      complete += 1
    elif len(tokens) < depth:
      row = constraint.mask()[0]
      stack += [tokens + [t] for t in range(64) if (row[t // 32] >> (t % 32)) & 1]
  return dead, complete


@pytest.mark.parametrize("s", [
    {"enum": ["az", "b"]},
    {"type": "string", "pattern": "^(az|b)$"},
    {"type": "object", "properties": {"a": {"enum": ["az", "b"]}}, "required": ["a"], "additionalProperties": False},
    {"anyOf": [{"const": "az"}, {"const": "ba"}]},
], ids=["enum", "pattern", "nested-enum", "const"])
def test_a_branch_no_token_spells_is_pruned_not_a_failed_generation(compiler: Any, s: dict[str, Any]) -> None:
  """Was: a reply could start "az" (its `a` has a token), then find no token for `z` and take llguidance's stand-in,
  a 500 generation_failed mid-reply. The branch is pruned at compile: every reply the masks allow completes."""
  dead, complete = dead_ends(compiler.json_schema(s))
  assert not dead and complete, dead


def test_a_schema_with_only_unspellable_branches_is_a_400_at_compile(compiler: Any) -> None:
  from MaxText.inference import grammar

  for s in ({"enum": ["az", "zb"]}, {"type": "object", "properties": {"a": {"const": "az"}}, "required": ["a"]}):
    with pytest.raises(grammar.GrammarError) as refused:
      compiler.json_schema(s)
    assert "no text satisfies it" in str(refused.value) and "spells" in str(refused.value), refused.value


@pytest.mark.parametrize("pattern", ["(a|bz)", "(zz|a)b?", "(a|\u00e9)+", "a|\U0001f600", "[a-z]{1,3}", "\"[^\"]{0,2}\""])
def test_a_regex_text_no_token_spells_is_pruned_not_a_failed_generation(compiler: Any, pattern: str) -> None:
  """Was: a reply could start the branch of `z` (or é, an emoji: no token writes them) and dead-end there. The
  pattern's texts are kept to the characters the tokens write: every reply the masks allow completes."""
  dead, complete = dead_ends(compiler.regex(pattern), depth=6)
  assert not dead and complete, dead


@pytest.mark.parametrize("pattern", ["(a|b)z", "a+z", "[ab]*\u00e9", "(\U0001f600|z)+", "[^ab\"\\[\\]{}:, 1-3a-z]"])
def test_a_regex_no_token_sequence_spells_is_a_grammar_error(compiler: Any, pattern: str) -> None:
  from MaxText.inference import grammar

  with pytest.raises(grammar.GrammarError, match="no text satisfies it") as refused:
    compiler.regex(pattern)
  assert "\n" not in str(refused.value)


def test_the_written_characters_are_read_once_per_tokenizer_and_let_split_characters_through() -> None:
  """What the tokens write, computed once (schemas: the speller too; it was built per request, reading every token).
  A token holding part of a character (not UTF-8 alone) can join others into any character: nothing non-ASCII is
  dropped then, so the pruning stays exact."""
  from MaxText.inference import grammar

  split: Any = grammar.Compiler.__new__(grammar.Compiler)
  split.__dict__["_pieces"] = frozenset({b"a", b"b\xc3", b"\xa9"})
  assert split._written == "[\\x{61}-\\x{62}\\x{80}-\\x{D7FF}\\x{E000}-\\x{10FFFF}]"
  whole: Any = grammar.Compiler.__new__(grammar.Compiler)
  whole.__dict__["_pieces"] = frozenset({b"a", b"c", b"\xc3\xa9"})
  assert whole._written == "[\\x{61}\\x{63}\\x{E9}]"
  assert whole._speller is whole._speller and whole._speller.chars == "ac\u00e9"
  nothing: Any = grammar.Compiler.__new__(grammar.Compiler)
  nothing.__dict__["_pieces"] = frozenset()
  assert nothing._written == "[^\\x{0}-\\x{10FFFF}]"


@pytest.mark.parametrize("template, starts", [
    ("{{ messages[0]['nonexistent'].upper() }}", False),
    ("{{ raise_exception('a system turn first') if messages[0]['role'] != 'system' }}x", True),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", True),
], ids=["fails", "refuses-some", "renders"])
def test_a_chat_template_that_fails_every_conversation_stops_the_server_at_start(
    tmp_path: Path, template: str, starts: bool) -> None:
  """Was: the server started and every chat request was a 400 blaming the client's messages. A template's own
  raise_exception may refuse only some conversations (alternation, a required system turn): the server starts."""
  from MaxText.errors import UserError
  from MaxText.inference import serve_codec

  directory = write_tokenizer_without_byte_tokens(tmp_path / "tok")
  config = json.loads((directory / "tokenizer_config.json").read_text())
  (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
  spec = serve_codec.CodecSpec("huggingface", str(directory), False, 64)
  serve_codec.build(spec)  # a front end's codec does not probe
  if starts:
    serve_codec.build(spec, probe_chat=True)
  else:
    with pytest.raises(UserError, match=f"chat template of {directory}.*every chat request") as refused:
      serve_codec.build(spec, probe_chat=True)
    assert "\n" not in str(refused.value)
