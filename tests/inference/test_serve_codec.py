"""The server's tokenizer (inference/serve_codec.py) against chat templates that refuse a conversation: the template's
own error is a 400 naming `messages`, as any other bad request (not a 500 with a traceback)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="chat templates need transformers (EXTRAS=test bash setup.sh)")

from MaxText.inference import openai_api as api  # noqa: E402
from MaxText.inference import serve_codec  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent.parent / "input_pipeline"))
from sft_fixtures import write_tokenizer  # noqa: E402

# As many published templates do: roles must alternate user/assistant (raise_exception), tools rendered by name.
STRICT = ("{%- for tool in tools or [] %}{{ tool.function.name }}{%- endfor %}"
          "{%- for message in messages %}"
          "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
          "{{ '<|im_start|>' + message['content'] + '<|im_end|>' }}{%- endfor %}"
          "{%- if add_generation_prompt %}{{ '<|im_start|>' }}{%- endif %}")


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
  directory = write_tokenizer(tmp_path_factory.mktemp("strict"), STRICT)
  return serve_codec.build(serve_codec.CodecSpec("huggingface", str(directory), False, 272))[0]


@pytest.mark.parametrize("tools", [False, True], ids=["chat", "chat-tools"])
def test_a_conversation_the_template_refuses_is_a_400_naming_messages(codec, tools):
  good = [{"role": "user", "content": "hi"}]
  bad = [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]
  tool = [{"type": "function", "function": {"name": "now"}}]
  render = (lambda m: codec.chat_tools(m, tool)) if tools else codec.chat
  assert render(good)
  with pytest.raises(api.ApiError) as raised:
    render(bad)
  assert raised.value.status == 400 and raised.value.param == "messages"
  assert "Conversation roles must alternate" in raised.value.message and "\n" not in raised.value.message


def test_prompt_ids_the_tokenizer_cannot_decode_are_a_400_naming_prompt(codec):
  """The tokenizer has fewer ids than the model's vocab_size: ids between the two are refused as ids past
  the model's are, since the answer's text could not be written."""
  assert codec.token_limit is not None and codec.token_limit < 272
  limits = api.Limits("tiny", 272, 32, 48, 16, 4)
  last = codec.token_limit - 1
  assert api.parse_completion({"prompt": [5, last], "max_tokens": 1}, limits, codec).choices[0].prompt == [5, last]
  for token, bound in ((codec.token_limit, f"[0, {codec.token_limit}) of the tokenizer"), (271, "of the tokenizer"),
                       (272, "[0, 272)"), (-1, "outside the vocabulary")):
    with pytest.raises(api.ApiError) as raised:
      api.parse_completion({"prompt": [[5], [5, token]]}, limits, codec)
    assert raised.value.status == 400 and raised.value.param == "prompt", raised.value.message
    assert f"token id {token} is outside the vocabulary" in raised.value.message and bound in raised.value.message
