"""Fine-tuning records → tokens and loss weights: the assistant-token mask equals transformers' own
(`return_assistant_tokens_mask` on templates with generation markers), prompt/completion pairs,
packing keeps each conversation's weights and segments, truncation drops and counts samples left
with nothing to train, and bad records fail with one clear line."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from MaxText.errors import ConfigError, UserError
from MaxText.input_pipeline import chat
from MaxText.input_pipeline.packing import DocumentCursor, pack_batch
from sft_fixtures import CONVERSATION, TEMPLATES, write_tokenizer, without_markers

transformers = pytest.importorskip("transformers", reason="needs transformers (EXTRAS=test bash setup.sh)")


def encoder(tmp_path, template: str, length: int = 512, completion_only: bool = True) -> chat.SftEncoder:
  directory = write_tokenizer(tmp_path / "tok", without_markers(template))
  return chat.SftEncoder(chat.load_chat_tokenizer(str(directory)), length, completion_only, True, True)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_assistant_mask_equals_transformers_generation_mask(name, tmp_path):
  ours = encoder(tmp_path, TEMPLATES[name])(CONVERSATION)
  truth_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tok" / "tokenizer.json"),
                                                         bos_token="<s>", eos_token="</s>")
  truth = truth_tokenizer.apply_chat_template(CONVERSATION["messages"], chat_template=TEMPLATES[name], tokenize=True,
                                              return_dict=True, return_assistant_tokens_mask=True)
  np.testing.assert_array_equal(ours[0], truth["input_ids"])
  np.testing.assert_array_equal(ours[1], truth["assistant_masks"])
  trained = truth_tokenizer.decode([t for t, w in zip(*ours) if w])
  assert "to a summer day" in trained and "question" in trained and "compare" not in trained, trained


def test_every_token_trains_without_completion_only(tmp_path):
  tokens, weights = encoder(tmp_path, TEMPLATES["chatml"], completion_only=False)(CONVERSATION)
  assert weights.all() and len(tokens) == len(weights)


def test_prompt_completion_pairs_plain_and_conversational(tmp_path):
  encode = encoder(tmp_path, TEMPLATES["chatml"])
  tokenizer = encode.tokenizer
  tokens, weights = encode({"prompt": "shall i compare thee", "completion": " to a summer day"})
  assert tokens[0] == tokenizer.bos_token_id and tokens[-1] == tokenizer.eos_token_id
  assert tokenizer.decode([t for t, w in zip(tokens, weights) if w]) == " to a summer day</s>"
  assert not weights[:len(tokenizer("<s>shall i compare thee", add_special_tokens=False)["input_ids"])].any()
  # Conversational: only the completion's assistant turn trains, not the prompt's.
  messages = CONVERSATION["messages"]
  tokens, weights = encode({"prompt": messages[:4], "completion": messages[4:]})
  trained = tokenizer.decode([t for t, w in zip(tokens, weights) if w])
  assert trained == "to be that is the question<|im_end|>", trained


def test_packing_keeps_each_conversations_weights_and_segments(tmp_path):
  encode = encoder(tmp_path, TEMPLATES["llama3"])
  docs = [encode(CONVERSATION), encode({"prompt": "to be", "completion": " or not"})]
  length = len(docs[0][0]) + len(docs[1][0])  # both fit one row
  batch, _ = pack_batch(DocumentCursor(lambda i: iter(docs[i:]), 4), 1, length, packing=True)
  first = len(docs[0][0]) - 1
  np.testing.assert_array_equal(batch["inputs_segmentation"][0, :first], 1)
  np.testing.assert_array_equal(batch["inputs_segmentation"][0, first:first + len(docs[1][0]) - 1], 2)
  # A pair is weighed by its target's mask; prompts are segment 0 in targets_segmentation only.
  np.testing.assert_array_equal(batch["targets_segmentation"][0, :first], docs[0][1][1:])
  np.testing.assert_array_equal(batch["targets_segmentation"][0, first:first + len(docs[1][0]) - 1],
                                2 * docs[1][1][1:])
  assert batch["inputs_position"][0, first] == 0


def test_truncation_keeps_trained_tokens_or_drops_and_counts(tmp_path, capsys):
  encode = encoder(tmp_path, TEMPLATES["chatml"], length=40)
  long_prompt = {"messages": [{"role": "user", "content": " ".join(["the quick brown fox"] * 10)},
                              {"role": "assistant", "content": "a lazy dog"}]}
  dropped = encode(long_prompt)
  assert dropped.shape == (2, 0) and encode.dropped.count == 1
  assert "dropped a sample (no assistant token within max_target_length + 1 = 41 tokens); 1 dropped" in \
      capsys.readouterr().out
  kept = encode({"messages": [{"role": "user", "content": "to be"},
                              {"role": "assistant", "content": " ".join(["or not"] * 10)}]})
  assert kept.shape[1] == 41 and kept[1, 1:].any() and encode.dropped.count == 1


@pytest.mark.parametrize("record, error, message", [
    ({"text": "hello"}, UserError, "an sft record needs a 'messages' list or 'prompt' and 'completion' fields; it has text"),
    ({"messages": [{"role": "user", "content": "hi"}]}, UserError,
     "an sft conversation has no assistant turn to train on (roles: user)"),
    ({"messages": "hi"}, UserError, "sft field 'messages' must be a list of"),
    ({"messages": []}, UserError, "an sft conversation is empty (no messages)"),
    ({"messages": None, "prompt": "hi", "completion": None}, UserError, "'completion' fields; it has prompt"),
    ({"prompt": "hi", "completion": [{"role": "assistant", "content": "x"}]}, UserError,
     "an sft record's 'prompt' and 'completion' must both be strings or both be lists of messages; got str and list"),
    # An ArrayRecord record (bytes) that is not JSON (was: JSONDecodeError, UnicodeDecodeError, RecursionError).
    (b"plain text", UserError, "sft records must be JSON objects; this one is not valid JSON (Expecting value at "
                               "column 1)"),
    (b"\xff\xfe", UserError, "sft records must be JSON objects; this one is not UTF-8 text (byte 1)"),
    pytest.param(b"[" * 100000, UserError, "this one is not valid JSON (nested too deeply)", id="deep"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', UserError, "the sft record holds an unpaired UTF-16"),
])
def test_bad_records_fail_in_one_line(record, error, message, tmp_path):
  with pytest.raises(error) as raised:
    encoder(tmp_path, TEMPLATES["chatml"])(record)
  assert message in str(raised.value) and "\n" not in str(raised.value)


def test_a_record_with_no_token_to_train_on_is_refused(tmp_path):
  """An empty plain-text completion without add_eos trains nothing at any length: it was packed with every weight 0,
  and a file of them ran its steps at loss 0 (a warning each step, exit 0)."""
  directory = write_tokenizer(tmp_path / "tok", without_markers(TEMPLATES["chatml"]))
  no_eos = chat.SftEncoder(chat.load_chat_tokenizer(str(directory)), 512, True, True, add_eos=False)
  with pytest.raises(UserError) as raised:
    no_eos({"prompt": "to be", "completion": ""})
  assert str(raised.value) == ("an sft record has no token to train on: its completion is empty (and add_eos=False adds "
                               "no end-of-sequence token after a plain-text one); give it a completion or remove the "
                               "record"), str(raised.value)
  assert no_eos({"prompt": "to be", "completion": " or not"})[1].any()
  # With add_eos the end of sequence is the completion's one token; an empty assistant turn trains its end of turn.
  with_eos = encoder(tmp_path, TEMPLATES["chatml"])
  tokens, weights = with_eos({"prompt": "to be", "completion": ""})
  assert tokens[weights != 0].tolist() == [with_eos.tokenizer.eos_token_id]
  assert no_eos({"messages": [{"role": "user", "content": "to be"}, {"role": "assistant", "content": ""}]})[1].any()


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path):
  directory = write_tokenizer(tmp_path / "plain", None)
  with pytest.raises(ConfigError, match="has no chat template"):
    chat.load_chat_tokenizer(str(directory))


def test_chat_tokenizers_built_on_many_threads_at_once_all_load(tmp_path):
  """transformers' lazy module is not thread-safe: threads building the first chat tokenizers of a process
  together failed with "module 'transformers' has no attribute 'PreTrainedTokenizerFast'" (in about 5 processes of
  6). Each try in a fresh process, so that transformers is not imported yet."""
  import subprocess
  import sys
  from pathlib import Path

  directory = write_tokenizer(tmp_path / "tok", without_markers(TEMPLATES["chatml"]))
  code = ("import sys, threading\nassert 'transformers' not in sys.modules\n"
          "from MaxText.input_pipeline import chat\n"
          "start, failed = threading.Barrier(32), []\n"
          "def build():\n  start.wait(60)\n  try:\n"
          "    chat.chat_prompt_ids(chat.load_chat_tokenizer(sys.argv[1]), 'to be')\n"
          "  except Exception as e:\n    failed.append(repr(e))\n"
          "threads = [threading.Thread(target=build) for _ in range(32)]\n"
          "for t in threads: t.start()\n"
          "for t in threads: t.join()\n"
          "print(failed)\n")
  for _ in range(3):
    proc = subprocess.run([sys.executable, "-c", code, str(directory)], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def test_a_template_that_rewrites_history_is_refused(tmp_path):
  # Renders earlier assistant turns differently once a later turn exists (as reasoning templates do).
  rewriting = ("{%- for message in messages %}{{ message['role'] + ': ' }}"
               "{%- if message['role'] == 'assistant' and not loop.last %}[old]{% else %}{{ message['content'] }}"
               "{% endif %}{{ '\\n' }}{%- endfor %}{%- if add_generation_prompt %}assistant: {% endif %}")
  with pytest.raises(ConfigError, match="does not render a conversation as a prefix"):
    encoder(tmp_path, rewriting)(CONVERSATION)


# Through the whole pipeline (hf JSONL files, as configs/sft.yml reads them): a refused record or
# an unreadable line is named by file and line, and a length that drops every sample names the
# max_target_length that would keep one.
GOOD = {"messages": [{"role": "user", "content": "to be"}, {"role": "assistant", "content": "or not"}]}


def first_batch(tmp_path, lines: list[str], name: str = "train.jsonl", **overrides):
  from MaxText.platform import sharding
  from MaxText.configuration.config import Config
  from MaxText.input_pipeline import create_data_iterator

  data = tmp_path / name
  data.write_text("".join(line + "\n" for line in lines))
  tokenizer = write_tokenizer(tmp_path / "tok", without_markers(TEMPLATES["chatml"]))
  values = dict(dataset_type="hf", objective="sft", tokenizer_type="huggingface", tokenizer_path=str(tokenizer),
                hf_data_files=str(data), vocab_size=320, max_target_length=32, per_device_batch_size=1,
                print_config=False, data_prefetch_batches=0, enable_data_shuffling=False)
  config = Config.for_testing(**{**values, **overrides})
  iterator = create_data_iterator(config, sharding.create_mesh(config.mesh))
  for _ in range(4):  # the global batch is one row per device: enough rows to reach every record
    next(iterator)
  return data


def test_a_file_mixing_conversations_and_pairs_trains(tmp_path):
  """datasets gives the pairs messages=None and the conversations prompt=completion=None; the pair was refused with
  "sft field 'messages' must be a list of ... messages, got 'None'"."""
  first_batch(tmp_path, [json.dumps(GOOD), json.dumps({"prompt": "to be", "completion": " or not"})])


def test_an_empty_conversation_is_named_by_file_and_line(tmp_path):
  lines = [json.dumps(GOOD), "", json.dumps(GOOD), json.dumps({"messages": []})]
  with pytest.raises(UserError) as raised:
    first_batch(tmp_path, lines)
  message = str(raised.value)
  assert message.startswith(f"{tmp_path / 'train.jsonl'} line 4: an sft conversation is empty"), message
  assert "\n" not in message


@pytest.mark.parametrize("lines, problem", [
    ([json.dumps(GOOD), '{"messages": [', json.dumps(GOOD)], "line 2: not valid JSON (Expecting value at column 15)"),
    ([json.dumps(GOOD), json.dumps(GOOD), "", '"just text"'], "line 4: a JSON string, not an object (one record per line)"),
    (['[{"messages": []},', '  {"messages": [}]'], "is not valid JSON (Expecting value at line 2, column 17)"),
], ids=["truncated", "not-an-object", "json-array"])
def test_a_malformed_json_line_names_file_and_line(tmp_path, lines, problem, capfd):
  name = "train.json" if lines[0].startswith("[") else "train.jsonl"
  with pytest.raises(ConfigError) as raised:
    first_batch(tmp_path, lines, name=name)
  message = str(raised.value)
  assert message == f"hf_data_files: {tmp_path / name} {problem}; fix or remove that record", message
  assert "Failed to load JSON" not in capfd.readouterr().err  # datasets' own log lines are not repeated


@pytest.mark.parametrize("message, problem", [
    ({"role": "user", "content": None}, "message 0 (role 'user'): its content is null"),
    ({"role": "user", "content": 7}, "message 0 (role 'user'): its content is 7, a number"),
    ({"role": "user", "content": True}, "message 0 (role 'user'): its content is true, a boolean"),
    ({"role": "user", "content": {"text": "to be"}}, "message 0 (role 'user'): its content is an object"),
    ({"role": 3, "content": "to be"}, "message 0: its role is 3, a number; give each message a role string"),
], ids=["null", "number", "boolean", "object", "numeric-role"])
def test_a_message_whose_content_is_not_text_is_named_by_file_line_index_and_role(tmp_path, message, problem):
  """Was the chat template's own error ("TypeError: unsupported operand type(s) for +: 'int' and 'str'", or for null
  "'dict object' has no attribute 'content'"), which does not say what to change."""
  record = {"messages": [message, {"role": "assistant", "content": "or not"}]}
  with pytest.raises(UserError) as raised:
    first_batch(tmp_path, [json.dumps(GOOD), json.dumps(record)])
  message_text = str(raised.value)
  assert message_text.startswith(f"{tmp_path / 'train.jsonl'} line 2: sft field 'messages': {problem}"), message_text
  if "content" in problem:
    assert message_text.endswith("give it a string, or a list of content parts ([{\"type\": \"text\", \"text\": ...}]); "
                                 "null is for an assistant turn with tool_calls only"), message_text
  assert "\n" not in message_text


def test_an_assistant_turn_that_only_calls_tools_may_have_null_content(tmp_path):
  tools = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
           "{%- if message.content %}{{ message.content }}{% endif %}"
           "{%- for call in message.tool_calls or [] %}{{ call.function.name }}{%- endfor %}"
           "{{ '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
  directory = write_tokenizer(tmp_path / "tok", tools)
  encode = chat.SftEncoder(chat.load_chat_tokenizer(str(directory)), 512, True, True, True)
  call = {"type": "function", "function": {"name": "question", "arguments": {}}}
  tokens, weights = encode({"messages": [{"role": "user", "content": "to be"},
                                         {"role": "assistant", "content": None, "tool_calls": [call]},
                                         {"role": "tool", "content": "or not"},
                                         {"role": "assistant", "content": "that is"}]})
  assert "question" in encode.tokenizer.decode(tokens[weights != 0].tolist(), skip_special_tokens=True)
  for message in ({"role": "assistant", "content": None}, {"role": "tool", "content": None, "tool_calls": [call]}):
    with pytest.raises(UserError, match="its content is null"):
      encode({"messages": [{"role": "user", "content": "to be"}, message]})


def test_every_sample_too_long_names_the_max_target_length_that_keeps_one(tmp_path):
  prompts = [" ".join(["the quick brown fox"] * n) for n in (8, 5, 12)]
  records = [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": "a lazy dog"}]}
             for p in prompts]
  with pytest.raises(UserError) as raised:
    first_batch(tmp_path, [json.dumps(r) for r in records])
  message = str(raised.value)
  assert "add_bos" not in message and "max_target_length + 1 = 33 tokens" in message, message
  needed = int(re.search(r"max_target_length >= (\d+) keeps at least one", message).group(1))
  longest = int(re.search(r"the longest sample is (\d+) tokens", message).group(1))
  # The figure is exact: one token less drops the shortest-prompt sample, that length keeps it.
  shortest = records[1]
  assert encoder(tmp_path, TEMPLATES["chatml"], length=needed)(shortest)[1, 1:].any()
  assert encoder(tmp_path, TEMPLATES["chatml"], length=needed - 1)(shortest).shape == (2, 0)
  assert longest == max(len(encoder(tmp_path, TEMPLATES["chatml"])(r)[0]) for r in records)


def _write_parquet(path, messages: list, large: bool = False) -> None:
  import pyarrow as pa
  import pyarrow.parquet as pq

  table = pa.Table.from_pylist([{"messages": m} for m in messages])
  if large:  # what polars and some exporters write
    text = pa.large_string()
    table = table.cast(pa.schema([("messages", pa.list_(pa.struct([("role", text), ("content", text)])))]))
  pq.write_table(table, str(path))


@pytest.mark.parametrize("second", ["name-field", "large-string"])
def test_parquet_files_whose_message_schemas_differ_harmlessly_train(tmp_path, second):
  """datasets types the table by the first file and failed to cast a second whose messages had a `name` field
  more ('Couldn't cast array of type', no file named)."""
  from MaxText.input_pipeline import hf

  _write_parquet(tmp_path / "a.parquet", [GOOD["messages"]] * 2)
  named = [{**m, "name": "ann"} for m in GOOD["messages"]]
  _write_parquet(tmp_path / "b.parquet", [named if second == "name-field" else GOOD["messages"]] * 2,
                 large=second == "large-string")
  source, _ = hf.open_split("", str(tmp_path / "*.parquet"), "train", "hf_data_files")
  assert [m["content"] for m in source[3]["messages"]] == ["to be", "or not"]
  first_batch(tmp_path, [], name="unused.jsonl", hf_data_files=str(tmp_path / "*.parquet"))


def test_parquet_files_whose_messages_differ_in_kind_are_named_both(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  from MaxText.input_pipeline import hf

  _write_parquet(tmp_path / "a.parquet", [GOOD["messages"]])
  pq.write_table(pa.table({"messages": ["to be or not"]}), str(tmp_path / "b.parquet"))
  with pytest.raises(ConfigError) as raised:
    hf.open_split("", str(tmp_path / "*.parquet"), "train", "hf_data_files")
  assert str(raised.value) == (
      f"hf_data_files: column 'messages' is list<element: struct<role: string, content: string>> in "
      f"{tmp_path / 'a.parquet'} but string in {tmp_path / 'b.parquet'}; give it one type in every file")
