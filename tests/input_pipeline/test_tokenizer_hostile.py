"""Tokenizers as hurried or hostile users hand them over (a damaged tokenizer.json on the chat path, a
ranks file that repeats or skips, a vocabulary with holes, the wrong tokenizer_type, an empty file, a
mistyped path): each loads as the file says or stops with one line naming it and what to do."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from MaxText.configuration.config import Config
from MaxText.errors import ConfigError, UserError
from MaxText.input_pipeline import chat, check_sources
from MaxText.input_pipeline.tokenizer import load_tokenizer
from tests.input_pipeline.sft_fixtures import CHATML, write_tokenizer

BYTE_RANKS = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]


def _one_line(load) -> str:
  with pytest.raises(UserError) as raised:
    load()
  message = str(raised.value)
  assert "\n" not in message, message
  return message


@pytest.mark.parametrize("content, problem", [
    (b'{"version": "1.0", "model": {"type": "BPE", "vocab": {', "(EOF while parsing"),
    (b"\xff\xfe{}", "('utf-8' codec can't decode byte 0xff"),
], ids=["cut", "not-utf8"])
def test_a_damaged_tokenizer_json_stops_sft_in_one_line(tmp_path, content, problem):
  """Was: a bare `Exception` / UnicodeDecodeError traceback: the chat path read tokenizer.json itself, and
  check_sources loads it before the plain tokenizer that already named the file."""
  directory = write_tokenizer(tmp_path / "tok", CHATML)
  (directory / "tokenizer.json").write_bytes(content)
  (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "to be", "completion": "or not"}) + "\n")
  config = Config.for_testing(dataset_type="hf", objective="sft", tokenizer_type="huggingface",
                              tokenizer_path=str(directory), hf_data_files=str(tmp_path / "train.jsonl"),
                              vocab_size=320, print_config=False)
  message = _one_line(lambda: check_sources(config.data))
  assert message.startswith(f"tokenizer_path {directory}: cannot read {directory / 'tokenizer.json'} as a Hugging "
                            f"Face tokenizer {problem}"), message


@pytest.mark.parametrize("lines, problem", [
    (BYTE_RANKS + ["QUI= 256", "QkM= 256"], "line 258 repeats rank 256 of line 257"),  # was a Rust panic
    (BYTE_RANKS + ["QUI= 256", "QUI= 257"], "line 258 repeats the token b'AB' of line 257"),  # kept 257, silently
    (BYTE_RANKS + ["QUI= -1"], "line 257 has rank -1, outside [0, "),  # was OverflowError
    (BYTE_RANKS + ["QUI= 99999999999"], "line 257 has rank 99999999999, outside [0, "),  # was OverflowError
    (BYTE_RANKS[:65] + BYTE_RANKS[66:], "it ranks 255 of the 256 single bytes (none for 0x41)"),  # panic on "A"
], ids=["repeated-rank", "repeated-token", "negative", "past-u32", "missing-byte"])
def test_a_ranks_file_that_repeats_or_misses_is_named_by_line(tmp_path, lines, problem):
  path = tmp_path / "bad.tiktoken"
  path.write_text("\n".join(lines) + "\n")
  message = _one_line(lambda: load_tokenizer("tiktoken", str(path)))
  assert message.startswith(f"tokenizer_path {path} is not a tiktoken BPE ranks file: {problem}"), message


def test_ranks_that_skip_numbers_put_the_special_tokens_after_the_highest(tmp_path):
  """Was: the special ids followed the ranks' count, so bos/eos were 257/258, ids the ranks already
  used, and vocab_size 513 was below the ids encode returned (which passed the vocab_size check)."""
  path = tmp_path / "gaps.tiktoken"
  path.write_text("\n".join(BYTE_RANKS + ["QUI= 600", "QUJD 1000"]) + "\n")
  tokenizer = load_tokenizer("tiktoken", str(path))
  assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id) == (1001 + 256, 1001, 1002)
  ids = tokenizer.encode("ABC AB")
  assert 1000 in ids and 600 in ids and max(ids) < tokenizer.vocab_size
  assert tokenizer.decode(ids) == "ABC AB"


def test_a_vocabulary_with_holes_counts_up_to_its_highest_id(tmp_path, spm_model, prepared):
  """Was: vocab_size 3 (the tokens' count) though "far" encodes to 300, so vocab_size=128 passed the check
  and id 300 reached an embedding of 128 rows."""
  from tokenizers import Tokenizer, models, pre_tokenizers

  hf = Tokenizer(models.WordLevel({"<unk>": 0, "near": 1, "far": 300}, unk_token="<unk>"))
  hf.pre_tokenizer = pre_tokenizers.Whitespace()
  hf.save(str(tmp_path / "tokenizer.json"))
  tokenizer = load_tokenizer("huggingface", str(tmp_path))
  assert tokenizer.vocab_size == 301 and tokenizer.encode("near far") == [1, 300]
  config = Config.for_testing(dataset_type="grain", tokenizer_type="huggingface", tokenizer_path=str(tmp_path),
                              grain_train_files=str(prepared / "arrayrecord" / "train.array_record"), vocab_size=128,
                              add_bos=False, add_eos=False, print_config=False)
  assert "has 301 tokens, more than vocab_size=128" in _one_line(lambda: check_sources(config.data))


def test_an_empty_vocabulary_is_refused_when_loaded(tmp_path):
  """Was: loaded, then a bare `Exception` ("Unk token `<unk>` not found") from the first document's encode."""
  from tokenizers import Tokenizer, models

  Tokenizer(models.WordLevel({}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
  assert "has an empty vocabulary" in _one_line(lambda: load_tokenizer("huggingface", str(tmp_path)))


@pytest.mark.parametrize("kind, given, hint", [
    ("sentencepiece", "hf_dir", "is not a SentencePiece model; it is a directory holding tokenizer.json: "
     "set tokenizer_type=huggingface"),  # was "[Errno 21] Is a directory"
    ("sentencepiece", "tokenizer_json", "it looks like a Hugging Face tokenizer.json: set tokenizer_type=huggingface"),
    ("huggingface", "spm", "it looks like a SentencePiece model: set tokenizer_type=sentencepiece"),
    ("sentencepiece", "ranks", "it looks like a tiktoken BPE ranks file: set tokenizer_type=tiktoken"),
    ("tiktoken", "spm", "it looks like a SentencePiece model: set tokenizer_type=sentencepiece"),
    ("tiktoken", "empty_dir", "is not a tiktoken BPE ranks file; it is a directory: point tokenizer_path at the "
     "tokenizer's file"),
], ids=["spm-given-hf-dir", "spm-given-tokenizer-json", "hf-given-spm", "spm-given-ranks", "tiktoken-given-spm",
        "tiktoken-given-empty-dir"])
def test_the_wrong_tokenizer_type_names_the_one_the_file_looks_like(tmp_path, spm_model, kind, given, hint):
  """Was: the library's reason alone ("ParseFromArray", "utf-8 codec can't decode"), with nothing to do."""
  hf_dir = write_tokenizer(tmp_path / "hf", None)
  (tmp_path / "ranks.tiktoken").write_text("\n".join(BYTE_RANKS) + "\n")
  (tmp_path / "empty_dir").mkdir()
  paths = {"hf_dir": hf_dir, "tokenizer_json": hf_dir / "tokenizer.json", "spm": Path(spm_model),
           "ranks": tmp_path / "ranks.tiktoken", "empty_dir": tmp_path / "empty_dir"}
  message = _one_line(lambda: load_tokenizer(kind, str(paths[given])))
  assert message.startswith(f"tokenizer_path {paths[given]}") and message.endswith(hint), message


@pytest.mark.parametrize("kind", ["sentencepiece", "huggingface"])
def test_a_tokenizer_config_given_for_the_tokenizer_names_its_folder(tmp_path, kind):
  """Was: "it looks like a Hugging Face tokenizer.json" of the config (which is none), or nothing to do."""
  directory = write_tokenizer(tmp_path / "hf", None)
  assert _one_line(lambda: load_tokenizer(kind, str(directory / "tokenizer_config.json"))).endswith(
      f"; its folder holds {directory / 'tokenizer.json'}: set tokenizer_type=huggingface tokenizer_path={directory}")


@pytest.mark.parametrize("kind", ["sentencepiece", "tiktoken", "huggingface"])
def test_an_empty_file_is_named_as_empty(tmp_path, kind):
  """Was: "unk is not defined", "it holds no ranks", "EOF while parsing a value"."""
  (tmp_path / "tokenizer.json").write_bytes(b"")
  assert _one_line(lambda: load_tokenizer(kind, str(tmp_path / "tokenizer.json"))) == (
      f"tokenizer_path {tmp_path / 'tokenizer.json'} is an empty file; copy the tokenizer's file again")


def test_a_gs_folder_given_as_a_sentencepiece_file_is_named_as_a_folder(gcs_bucket, tmp_path):
  """Was: "unk is not defined" (an object store's folder reads as no bytes)."""
  from MaxText.paths import storage

  directory = write_tokenizer(tmp_path / "hf", None)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    storage.write_bytes(f"{gcs_bucket}/hf/{name}", (directory / name).read_bytes())
  assert _one_line(lambda: load_tokenizer("sentencepiece", f"{gcs_bucket}/hf")).endswith(
      "it is a directory holding tokenizer.json: set tokenizer_type=huggingface")


def test_the_chat_path_refuses_a_mistyped_tokenizer_path(tmp_path):
  """Was: the missing path's parent folder was read, and its tokenizer used without a word (rl.evaluate and GRPO
  rollouts load only this one)."""
  directory = write_tokenizer(tmp_path / "tok", CHATML)
  message = _one_line(lambda: chat.load_chat_tokenizer(str(directory / "tokenzier"), require_template=False))
  assert message.startswith(f"tokenizer_path {directory / 'tokenzier'} does not exist"), message


def test_the_chat_path_refuses_a_bos_the_tokenizer_does_not_hold(tmp_path):
  """Was: transformers added "<bos>" as a new token, id 264, past the tokenizer's vocabulary: the plain
  loader already refused this pair."""
  directory = write_tokenizer(tmp_path / "tok", CHATML)
  (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "</s>",
                                                               "chat_template": CHATML}))
  assert f"names bos_token '<bos>', which {directory / 'tokenizer.json'} does not hold" in _one_line(
      lambda: chat.load_chat_tokenizer(str(directory)))


def test_a_chat_template_file_that_is_not_utf8_is_named(tmp_path):
  """Was: a UnicodeDecodeError traceback."""
  directory = write_tokenizer(tmp_path / "tok", None)
  (directory / "chat_template.jinja").write_bytes(b"{{ messages }}\xff")
  assert _one_line(lambda: chat.load_chat_tokenizer(str(directory))) == (
      f"{directory / 'chat_template.jinja'} is not UTF-8 text (byte 0xff at offset 14); replace it with the "
      "model's own chat_template.jinja")


def test_rl_evaluate_refuses_a_tokenizer_larger_than_the_model(tmp_path, tiny_overrides):
  """Was: no check (decode and serve have one): prompt ids past the embedding, scored silently."""
  from MaxText.rl import evaluate

  directory = write_tokenizer(tmp_path / "tok", CHATML)
  config = Config.for_testing(**{**tiny_overrides, "objective": "grpo", "dataset_type": "hf",
                                 "hf_data_files": str(tmp_path / "prompts.jsonl"), "tokenizer_type": "huggingface",
                                 "tokenizer_path": str(directory), "reward_functions": "exact_match",
                                 "num_generations": 4, "max_prefill_predict_length": 8, "max_completion_length": 6,
                                 "max_target_length": 16, "eval_interval": -1})
  assert _one_line(lambda: evaluate.evaluate(config)) == (
      f"the tokenizer {directory} has 264 tokens but the model's vocab_size is 128: this tokenizer does not belong "
      "to this checkpoint")


@pytest.mark.parametrize("add_bos, add_eos, problem", [
    (True, False, "add_bos=True but the tokenizer defines no beginning-of-sequence token; set add_bos=False"),
    (False, True, "add_eos=True but the tokenizer defines no end-of-sequence token; set add_eos=False"),
])
def test_add_bos_or_eos_without_the_token_stops_before_any_state(tmp_path, prepared, add_bos, add_eos, problem):
  """Was: check_sources passed, and the refusal came from the data iterator, once the train state was built
  (a checkpoint loaded)."""
  directory = write_tokenizer(tmp_path / "tok", None)
  (directory / "tokenizer_config.json").unlink()  # names no bos_token / eos_token
  values = dict(dataset_type="grain", tokenizer_type="huggingface", tokenizer_path=str(directory),
                grain_train_files=str(prepared / "arrayrecord" / "train.array_record"), vocab_size=320,
                print_config=False)
  config = Config.for_testing(**values, add_bos=add_bos, add_eos=add_eos)
  assert _one_line(lambda: check_sources(config.data)) == problem
  check_sources(Config.for_testing(**values, add_bos=False, add_eos=False).data)


def test_a_distillation_teacher_of_the_same_tokenizer_spelled_otherwise_is_accepted(tmp_path, tiny_overrides,
                                                                                     spm_model, monkeypatch):
  """Was: "the teacher was trained with tokenizer .../spm.model, the student reads spm.model: distillation needs
  the same tokenizer": the two paths' text was compared, not the file they name."""
  from MaxText.configuration import run_record
  from MaxText.training.objectives import distill

  model = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=128,
               base_num_decoder_layers=3, vocab_size=512)
  run_dir = tmp_path / "teacher_run"
  run_record.record_start(Config.for_testing(**model, tokenizer_path=spm_model, print_config=False), str(run_dir))
  monkeypatch.chdir(Path(spm_model).parent)
  student = dict(tiny_overrides, vocab_size=512, objective="distill", distill_teacher_path=str(run_dir),
                 distill_teacher_model_name="")
  name = Path(spm_model).name
  for spelled in (name, f"./{name}", f"{Path(spm_model).parent}//{name}"):
    teacher = distill.teacher_config(Config.for_testing(**student, tokenizer_path=spelled))
    assert teacher.model.vocab_size == 512
  with pytest.raises(UserError, match="was trained with tokenizer .* the student reads"):
    distill.teacher_config(Config.for_testing(**student, tokenizer_path=str(tmp_path / "other.model")))


@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.jinja"])
def test_a_chat_template_that_does_not_parse_is_one_line_at_load_naming_its_file(tmp_path, where):
  """A template with a syntax error loaded, and failed only at its first render: after the start-up (a server's
  first request), in a line that did not say which file holds it. A template using transformers' own tags
  ({% generation %}) still loads."""
  broken = "{% for message in messages %}{{ message['content'] }\n{% endfor %}"
  directory = write_tokenizer(tmp_path / "tok", broken if where == "tokenizer_config.json" else None)
  if where == "chat_template.jinja":
    (directory / "chat_template.jinja").write_text(broken)
  with pytest.raises(ConfigError) as error:
    chat.load_chat_tokenizer(str(directory))
  assert str(error.value) == (f"the chat template in {directory / where} does not parse: unexpected '}}' (line 1 of the "
                              "template); replace it with the model's own template")
  tracked = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
  loaded = chat.load_chat_tokenizer(str(write_tokenizer(tmp_path / "ok", tracked)))
  assert chat.render(loaded, [{"role": "user", "content": "hi"}], False) == "hi"
