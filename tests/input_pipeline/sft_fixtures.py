"""A small Hugging Face tokenizer directory with a chat template, for the fine-tuning tests, and two
chat templates written here in the layouts of released models (ChatML as Qwen uses it, Llama 3's
headers), each also with `{% generation %}` markers so transformers can compute its own mask."""

from __future__ import annotations

import json
from pathlib import Path

CHATML = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
          "{%- if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
          "{% endgeneration %}{{ '\\n' }}{%- else %}{{ message['content'] + '<|im_end|>\\n' }}{%- endif %}"
          "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA3 = ("{{ bos_token }}{%- for message in messages %}"
          "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
          "{%- if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
          "{% endgeneration %}{%- else %}{{ message['content'] | trim + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
          "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
# Gemma 3's turn layout with content parts: an image part writes the begin-of-image marker.
GEMMA3 = ("{{ bos_token }}{%- for message in messages %}"
          "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}"
          "{%- if message['content'] is string %}{{ message['content'] | trim }}{%- else %}"
          "{%- for part in message['content'] %}{%- if part['type'] == 'image' %}{{ '<start_of_image>' }}"
          "{%- elif part['type'] == 'text' %}{{ part['text'] | trim }}{%- endif %}{%- endfor %}{%- endif %}"
          "{{ '<end_of_turn>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}"
          "{%- endif %}")
# Llama 4's turn layout with content parts: an image part writes <|image|>, which Llama4Processor
# (and its image format, families/llama4_images.py) replace by the image's tile run.
LLAMA4 = ("{{ bos_token }}{%- for message in messages %}"
          "{{ '<|header_start|>' + message['role'] + '<|header_end|>\\n\\n' }}"
          "{%- if message['content'] is string %}{{ message['content'] | trim }}{%- else %}"
          "{%- for part in message['content'] %}{%- if part['type'] == 'image' %}{{ '<|image|>' }}"
          "{%- elif part['type'] == 'text' %}{{ part['text'] | trim }}{%- endif %}{%- endfor %}{%- endif %}"
          "{{ '<|eot|>' }}{%- endfor %}{%- if add_generation_prompt %}"
          "{{ '<|header_start|>assistant<|header_end|>\\n\\n' }}{%- endif %}")
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3}
IMAGE_SPECIAL = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
# After SPECIAL's 8: <|image_start|> 11, <|image_end|> 12, <|patch|> 13 (the model's boi, eoi and
# image_token_id), the separators 14 and 15, <|image|> 16.
LLAMA4_IMAGE_SPECIAL = ["<|header_start|>", "<|header_end|>", "<|eot|>", "<|image_start|>", "<|image_end|>", "<|patch|>",
                        "<|tile_x_separator|>", "<|tile_y_separator|>", "<|image|>"]
LLAMA4_IMAGE_IDS = {"boi_token_id": 11, "eoi_token_id": 12, "image_token_id": 13}
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>"]
WORDS = ("the quick brown fox jumps over a lazy dog to be or not that is question continue this line "
         "user assistant system you are helpful shall i compare thee summer day").split()


def without_markers(template: str) -> str:
  return template.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def write_tokenizer(directory: Path, template: str | None, extra_special: list[str] | None = None) -> Path:
  """tokenizer.json (byte-level BPE over WORDS) and tokenizer_config.json with `template`;
  `extra_special` tokens follow SPECIAL (write_tokenizer(d, GEMMA3, IMAGE_SPECIAL): Gemma 3's
  image and turn markers; write_tokenizer(d, LLAMA4, LLAMA4_IMAGE_SPECIAL): Llama 4's)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  text = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
  tokenizer.train_from_iterator(text * 4, trainers.BpeTrainer(vocab_size=250, special_tokens=SPECIAL + (extra_special or []),
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  directory.mkdir(parents=True, exist_ok=True)
  tokenizer.save(str(directory / "tokenizer.json"))
  config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
  if template is not None:
    config["chat_template"] = template
  (directory / "tokenizer_config.json").write_text(json.dumps(config))
  return directory


CONVERSATION = {"messages": [
    {"role": "system", "content": "you are helpful"},
    {"role": "user", "content": "continue this line: shall i compare thee"},
    {"role": "assistant", "content": "to a summer day"},
    {"role": "user", "content": "to be or not"},
    {"role": "assistant", "content": "to be that is the question"},
]}
