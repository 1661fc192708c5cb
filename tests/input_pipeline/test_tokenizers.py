"""The three tokenizer kinds, bos/eos handling and the train_tokenizer entry point."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import pytest

from MaxText.errors import ConfigError
from MaxText.input_pipeline.tokenizer import DocumentEncoder, load_tokenizer
from tests.conftest import REPO_ROOT
from tests.input_pipeline.data_fixtures import numbered_documents

TEXT = "To be, or not to be: that is the question."


def test_sentencepiece_round_trip_with_bos_and_eos(spm_model):
  tokenizer = load_tokenizer("sentencepiece", spm_model)
  assert tokenizer.vocab_size == 512 and (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)
  ids = DocumentEncoder(tokenizer, add_bos=True, add_eos=True)(TEXT)
  assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:-1]
  assert tokenizer.decode(ids[1:-1]) == TEXT
  assert DocumentEncoder(tokenizer, add_bos=False, add_eos=False)(TEXT) == ids[1:-1]


def test_huggingface_tokenizer_json_with_its_config(tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  hf = Tokenizer(models.BPE(unk_token="<unk>"))
  hf.pre_tokenizer = pre_tokenizers.Whitespace()
  hf.train_from_iterator(numbered_documents() + [TEXT], trainers.BpeTrainer(
      vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
  hf.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
  tokenizer = load_tokenizer("huggingface", str(tmp_path))
  assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2) and tokenizer.vocab_size <= 120
  ids = DocumentEncoder(tokenizer, True, True)("doc 3 alpha bravo")
  assert ids[0] == 1 and ids[-1] == 2 and tokenizer.decode(ids[1:-1]) == "doc 3 alpha bravo"


def test_tiktoken_ranks_file_in_llama3_layout(tmp_path):
  path = tmp_path / "bytes.tiktoken"
  path.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
  tokenizer = load_tokenizer("tiktoken", str(path))
  assert tokenizer.vocab_size == 512 and (tokenizer.bos_id, tokenizer.eos_id) == (256, 257)
  ids = tokenizer.encode(TEXT + " <|begin_of_text|>")
  assert ids[:2] == [ord("T"), ord("o")] and max(ids) < 256  # special-token text in data stays text
  assert tokenizer.decode(ids) == TEXT + " <|begin_of_text|>"


def test_ids_past_the_vocabulary_decode_to_no_text(tmp_path, spm_model):
  """A model's vocab_size is often padded past its tokenizer's, and decode.py prints what it sampled: SentencePiece
  raised IndexError (OUT_OF_RANGE) and tiktoken KeyError on such an id, a traceback after the whole decode. They
  have no text, as Hugging Face tokenizers already wrote them."""
  path = tmp_path / "bytes.tiktoken"
  path.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
  for tokenizer in (load_tokenizer("sentencepiece", spm_model), load_tokenizer("tiktoken", str(path))):
    ids = tokenizer.encode(TEXT)
    past = [tokenizer.vocab_size, tokenizer.vocab_size + 100, -1]
    assert tokenizer.decode(ids[:3] + past + ids[3:]) == tokenizer.decode(ids) == TEXT


def test_tokenizer_errors(tmp_path, spm_model):
  with pytest.raises(ConfigError, match="tokenizer_type must be one of"):
    load_tokenizer("bytes", spm_model)
  with pytest.raises(ConfigError, match="does not exist"):
    load_tokenizer("sentencepiece", str(tmp_path / "missing.model"))
  (tmp_path / "junk.model").write_text("not a model")
  with pytest.raises(ConfigError, match="not a SentencePiece model"):
    load_tokenizer("sentencepiece", str(tmp_path / "junk.model"))
  with pytest.raises(ConfigError, match="tokenizer_path is empty"):
    load_tokenizer("sentencepiece", "")


def test_train_tokenizer_command_line(tmp_path):
  corpus = tmp_path / "corpus.jsonl"
  corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in numbered_documents() * 3))
  output = tmp_path / "out" / "tok.model"
  command = [sys.executable, "-m", "MaxText.train_tokenizer", f"data_files={tmp_path / '*.jsonl'}",
             "vocab_size=80", f"output_path={output}"]
  proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert "wrote" in proc.stdout and load_tokenizer("sentencepiece", str(output)).vocab_size == 80
  bad = subprocess.run(command[:3] + [f"data_files={tmp_path / 'none*.txt'}"] + command[4:], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=120)
  assert bad.returncode == 2 and bad.stderr.strip().startswith("error: data_files: no file matches")


@pytest.mark.parametrize("config, problem", [
    (b'{"bos_token": "<s>",', "is not valid JSON"), (b"\xff\xfe", "is not valid JSON"),
    (b'["<s>"]', "holds a JSON list, not the object of a tokenizer's config"),
    (b'{"chat_template": 5}', "chat_template is a int, not a template's text"),
], ids=["cut", "not-utf8", "a-list", "template-a-number"])
def test_a_damaged_tokenizer_config_is_one_line_naming_it(tmp_path, config, problem):
  """Was: JSONDecodeError / UnicodeDecodeError / AttributeError tracebacks from the tokenizer's loading."""
  from MaxText.input_pipeline import chat
  from tests.input_pipeline.sft_fixtures import write_tokenizer

  directory = write_tokenizer(tmp_path / "tok", None)
  (directory / "tokenizer_config.json").write_bytes(config)
  loads = [lambda: chat.load_chat_tokenizer(str(directory))]
  if problem != "chat_template is a int, not a template's text":  # only the chat paths read the template
    loads.append(lambda: load_tokenizer("huggingface", str(directory)))
  for load in loads:
    with pytest.raises(ConfigError) as raised:
      load()
    assert f"{directory / 'tokenizer_config.json'}" in str(raised.value) and problem in str(raised.value)
    assert "\n" not in str(raised.value)


def test_train_tokenizer_reads_json_lines_or_names_the_line_it_cannot(tmp_path):
  """A BOM before the first JSON line is the file's (was: JSONDecodeError "Unexpected UTF-8 BOM"); a cut line, a string record or a non-text field is one line naming file and line (were tracebacks)."""
  from MaxText import train_tokenizer
  from MaxText.errors import UserError

  good = tmp_path / "good.jsonl"
  good.write_bytes(b'\xef\xbb\xbf{"text": "first"}\n\n{"text": "second", "id": 2}\n{"id": 3}\n')
  assert list(train_tokenizer.iterate_lines([str(good)], "text", 100)) == ["first", "second"]
  for name, content, problem in [
      ("cut.jsonl", '{"text": "a"}\n{"text": "b', "line 2 is not a JSON record (Unterminated string"),
      ("string.jsonl", '"just text"\n', "line 1 is a string, not a JSON object"),
      ("number.jsonl", '{"text": 5}\n', "line 1: field 'text' is a number, not text")]:
    (tmp_path / name).write_text(content)
    with pytest.raises(UserError) as raised:
      list(train_tokenizer.iterate_lines([str(tmp_path / name)], "text", 100))
    assert str(raised.value).startswith(f"{tmp_path / name} {problem}"), str(raised.value)


def _with_config_tokens(directory, entries):
  """tokenizer_config.json of `directory` given added_tokens_decoder entries {id: (content, special)}, as
  transformers writes them; tokenizer.json left as it is."""
  config = json.loads((directory / "tokenizer_config.json").read_text())
  config["added_tokens_decoder"] = {str(i): {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                                             "single_word": False, "special": special}
                                    for i, (content, special) in entries.items()}
  (directory / "tokenizer_config.json").write_text(json.dumps(config))


def test_tokens_only_tokenizer_config_adds_are_read_as_transformers_reads_them(tmp_path):
  """A token listed only in tokenizer_config.json's added_tokens_decoder (not in tokenizer.json's added_tokens) was
  ignored: split into bytes, its id never produced, vocab_size short of it. transformers adds it; so do both the
  document tokenizer and the chat tokenizer, with the same ids."""
  import transformers
  from tokenizers import Tokenizer

  from MaxText.input_pipeline import chat
  from tests.input_pipeline.sft_fixtures import CHATML, write_tokenizer

  directory = write_tokenizer(tmp_path / "tok", CHATML)
  n = Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
  # transformers also lists tokenizer.json's own added tokens there (<|im_start|> is id 3).
  _with_config_tokens(directory, {3: ("<|im_start|>", True), n: ("<tool_call>", True), n + 1: ("<think>", False)})
  reference = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
  text = "the fox <tool_call> jumps <think> over <|im_start|> a dog"
  expected = reference(text, add_special_tokens=False)["input_ids"]
  assert n in expected and n + 1 in expected  # the reference does add them

  chat_tokenizer = chat.load_chat_tokenizer(str(directory))
  assert chat_tokenizer(text, add_special_tokens=False)["input_ids"] == expected
  assert ({i: (t.content, t.special) for i, t in chat_tokenizer.added_tokens_decoder.items()}  # type: ignore[attr-defined]
          == {i: (t.content, t.special) for i, t in reference.added_tokens_decoder.items()})
  assert chat_tokenizer.decode(expected, skip_special_tokens=True) == reference.decode(expected, skip_special_tokens=True)

  documents = load_tokenizer("huggingface", str(directory))
  assert documents.vocab_size == len(reference) == n + 2
  # Documents read special spellings as text (tokenizer.py); the non-special added token is one token, as there.
  plain = "the fox <think> over"
  assert documents.encode(plain) == reference(plain, add_special_tokens=False)["input_ids"]
  assert documents.special_id("<tool_call>") == n and documents.special_id("<think>") is None  # type: ignore[attr-defined]


@pytest.mark.parametrize("entries, problem", [
    ({300: ("<tool_call>", True)}, "gives '<tool_call>' id 300, but added to {file} it gets id {n}"),
    ({3: ("<|im_end|>", True)}, "gives '<|im_end|>' id 3, but {file} holds it as id 4"),
], ids=["past-the-next-id", "another-tokens-id"])
def test_a_config_token_whose_id_disagrees_with_the_tokenizer_is_one_line(tmp_path, entries, problem):
  """transformers gives such a token the id its tokenizer.json assigns, silently: ids the model did not learn."""
  from tokenizers import Tokenizer

  from MaxText.input_pipeline import chat
  from tests.input_pipeline.sft_fixtures import write_tokenizer

  directory = write_tokenizer(tmp_path / "tok", None)
  n = Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
  _with_config_tokens(directory, entries)
  for load in (lambda: load_tokenizer("huggingface", str(directory)),
               lambda: chat.load_chat_tokenizer(str(directory), require_template=False)):
    with pytest.raises(ConfigError) as raised:
      load()
    message = str(raised.value)
    assert f"{directory / 'tokenizer_config.json'}'s added_tokens_decoder" in message and "\n" not in message
    assert problem.format(file=directory / "tokenizer.json", n=n) in message
