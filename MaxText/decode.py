"""Complete a prompt with a trained or converted model:

    python3 -m MaxText.decode configs/base.yml load_parameters_path=CKPT tokenizer_path=TOK prompt="..." \\
        [model_name=...] [max_prefill_predict_length=64] [max_target_length=...] \\
        [decode_sampling_strategy=greedy|weighted|nucleus|topk] [prompt_token_ids=5,17,42] \\
        [image_path=cat.png,gs://bucket/dog.jpg]   (a vision-language model: Multimodal.md)
        [speculative_tokens=4 draft_model_name=... draft_load_parameters_path=DRAFT_CKPT]   (Decode.md)

Reads like a table of contents: config → prompt ids → engine (mesh, params) → prefill → generate → report.
Without model_name the model keys saved beside the checkpoint (model_config.yml) are used, as in
train.py. Prints the completion text (with a tokenizer), the generated ids, and prefill and
generate tokens/s measured after compilation. With speculative_tokens > 0 a draft model proposes
that many tokens per round and the target verifies them in one pass (inference/speculative.py):
greedy output is the same, the acceptance rate is printed too.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python3 MaxText/decode.py`: import the package, not sibling files.
  sys.path[0] = str(Path(__file__).resolve().parent.parent)

import jax
import numpy as np

from MaxText.configuration import config as config_lib, config_yaml
from MaxText.errors import UserError, run_cli
from MaxText.inference import image_chat, image_prompts, speculative_engine
from MaxText.inference.engine import load_engine
from MaxText.inference.engine_api import Emitted
from MaxText.inference.image_prompts import PromptImages
from MaxText.input_pipeline import image_text
from MaxText.input_pipeline.tokenizer import DocumentEncoder, Tokenizer, load_tokenizer
from MaxText import startup
from MaxText.training import params_io
from MaxText.platform.distributed import log


def prompt_ids(config: config_lib.Config) -> tuple[list[int], Tokenizer | None]:
  """The prompt as ids (prompt_token_ids, else the tokenized prompt) and the tokenizer, if any."""
  data, vocab_size = config.data, config.model.vocab_size
  tokenizer = load_tokenizer(data.tokenizer_type, data.tokenizer_path) if data.tokenizer_path else None
  if tokenizer is not None and tokenizer.vocab_size > vocab_size:
    raise UserError(f"the tokenizer {data.tokenizer_path} has {tokenizer.vocab_size} tokens but the model's "
                    f"vocab_size is {vocab_size}: this tokenizer does not belong to this checkpoint")
  if config.decode.prompt_token_ids:
    return list(config.decode.prompt_token_ids), tokenizer
  if tokenizer is None:
    raise UserError("set tokenizer_path=... to encode prompt, or give prompt_token_ids=5,17,42")
  if config.decode.prompt_chat_template:
    from MaxText.input_pipeline import chat

    hf_tokenizer = chat.load_chat_tokenizer(data.tokenizer_path, needs=CHAT_TEMPLATE_NEEDS)
    return chat.chat_prompt_ids(hf_tokenizer, prompt_text(config)), tokenizer
  return DocumentEncoder(tokenizer, data.add_bos, add_eos=False)(prompt_text(config)), tokenizer


def prompt_text(config: config_lib.Config) -> str:
  """`prompt`, refused in one line unless it is Unicode text: bytes that are not UTF-8 on the command
  line reach Python as lone surrogates, which no tokenizer encodes (it raised a TypeError traceback)."""
  prompt = config.decode.prompt
  try:
    prompt.encode("utf-8")
  except UnicodeEncodeError as e:
    # Python keeps an undecodable argv byte b as the surrogate U+DC00 + b.
    bad = " ".join(f"0x{ord(c) - 0xDC00:02x}" if 0xDC80 <= ord(c) <= 0xDCFF else f"U+{ord(c):04X}"
                   for c in prompt[e.start:e.end])
    raise UserError(f"prompt is not UTF-8 text ({bad} at character {e.start}); give it in UTF-8 (the terminal's or "
                    "file's encoding, e.g. LANG=C.UTF-8), or give its ids as prompt_token_ids=5,17,42") from None
  return prompt


def image_paths(config: config_lib.Config) -> list[str]:
  return config_yaml.split_items("image_path", config.decode.image_path)


def prompt_with_images(config: config_lib.Config) -> tuple[list[int], Tokenizer | None, PromptImages | None]:
  """The prompt's ids, the tokenizer and the images of image_path (None without): with
  prompt_chat_template, one user turn of the images then the prompt; else the prompt with each of
  its image markers expanded (the images go first when it has none). prompt_token_ids must
  already hold each view's placeholder run (Llama 4: each tile's and the thumbnail's, as the
  image's tile grid gives them; the family's image format)."""
  paths = image_paths(config)
  if not paths:
    ids, tokenizer = prompt_ids(config)
    return ids, tokenizer, None
  from MaxText.input_pipeline import chat

  cfg, data = config.model, config.data
  image_text.refuse_images_without_vision([image_text.ImageSlot(p, 0) for p in paths], cfg.vision)
  if config.decode.prompt_token_ids:
    _, tokenizer = prompt_ids(config)
    prepared = image_text.prepare_images(paths, cfg.vision, cfg.decoder_block, files=True)
    return list(config.decode.prompt_token_ids), tokenizer, PromptImages.of(np.concatenate([p.pixels for p in prepared]))
  if not data.tokenizer_path:
    raise UserError("set tokenizer_path=... to encode prompt with its images")
  tokenizer = load_tokenizer(data.tokenizer_type, data.tokenizer_path)
  hf_tokenizer = chat.load_chat_tokenizer(data.tokenizer_path, require_template=config.decode.prompt_chat_template,
                                         needs=CHAT_TEMPLATE_NEEDS)
  if config.decode.prompt_chat_template:
    parts = [{"type": "image", "image": p} for p in paths] + [{"type": "text", "text": prompt_text(config)}]
    ids, prompt_images = image_chat.conversation_ids(hf_tokenizer, [{"role": "user", "content": parts}], cfg,
                                                     files=True)
    return ids, tokenizer, prompt_images
  text = prompt_text(config)
  marker = image_chat.image_marker(hf_tokenizer, cfg)
  if marker not in text:
    text = marker * len(paths) + text
  prepared = image_text.prepare_images(paths, cfg.vision, cfg.decoder_block, files=True)
  # Only the markers are control tokens (the images' places, expanded into their runs): any other special token
  # typed in the prompt stays text, as DocumentEncoder writes a prompt without images.
  pieces = text.split(marker)
  guard = chat.ContentGuard(hf_tokenizer, pieces)
  hidden = marker.join(guard.hide(piece) for piece in pieces)
  ids, prompt_images = image_chat.ImageChat.of(cfg).encode(hf_tokenizer, hidden, prepared, guard)
  return DocumentEncoder(tokenizer, data.add_bos, add_eos=False)("") + ids, tokenizer, prompt_images


def decode(config: config_lib.Config) -> list[int]:
  """Runs one prompt (with image_path's images); returns the generated ids (also printed)."""
  if config.decode.serve_lora_adapters:  # else the base model's tokens, silently
    raise UserError("decode.py reads no LoRA adapters (serve_lora_adapters is MaxText.serve's): serve them and name "
                    "one as a request's model, or decode a checkpoint with the adapter merged in")
  if config.checkpoint.load_parameters_path:  # before the tokenizer is held against a model it may not describe
    params_io.params_directory(config.checkpoint.load_parameters_path)
  ids, tokenizer, prompt_images = prompt_with_images(config)
  rows = [prompt_images]
  limit = config.decode.max_prefill_predict_length
  if not ids:
    raise UserError("the prompt is empty (no tokens, and add_bos=False adds none); give a prompt, or set add_bos=True "
                    "to start from the beginning-of-sequence token alone")
  if len(ids) > limit:
    placeholders = ids.count(config.model.vision.image_token_id) if prompt_images else 0
    of_images = f" ({placeholders} of them the images' placeholders)" if placeholders else ""
    raise UserError(f"the prompt has {len(ids)} tokens{of_images}, more than max_prefill_predict_length={limit}; "
                    "raise max_prefill_predict_length or shorten the prompt")
  # Before the checkpoint loads (minutes for a large model): the prompt's placeholder runs against its images.
  image_prompts.image_runs(ids, config.model.vision, prompt_images)
  if config.decode.speculative_tokens:
    return decode_speculative(config, ids, tokenizer)
  engine, params = load_engine(config, 1, FRESH_NOTE)
  num_new = config.model.max_target_length - len(ids) + 1  # the last token needs no cache slot
  seed = config.decode.decode_sampling_seed

  engine.prefill(params, [ids], seed, images=rows).first_tokens_B.block_until_ready()  # compile
  start = time.perf_counter()
  prefix = engine.prefill(params, [ids], seed, images=rows)
  prefix.first_tokens_B.block_until_ready()
  prefill_s = time.perf_counter() - start

  state = engine.insert(prefix, engine.init_decode_state(seed), slot=0)
  generated = [int(prefix.first_tokens_B[0])]
  state, emitted = engine.decode_step(params, state)  # compile + first call, outside the timing
  generated += _slot0(jax.device_get(emitted))
  start = time.perf_counter()
  calls = []
  for _ in range(-(-max(num_new - len(generated), 0) // config.decode.decode_steps_per_call)):
    state, emitted = engine.decode_step(params, state)
    calls.append(emitted)  # read back after the loop: the host never waits inside it
  new = [_slot0(e) for e in jax.device_get(calls)]
  steps = sum(len(tokens) for tokens in new)
  generated = (generated + [t for tokens in new for t in tokens])[:num_new]
  generate_s = time.perf_counter() - start

  generated = report(ids, generated, tokenizer, prefill_s, limit)
  if steps:
    log(f"generate: {steps} steps in {generate_s * 1e3:.1f} ms ({generate_s / steps * 1e3:.2f} ms/token, "
        f"{steps / generate_s:.1f} tokens/s)")
  return generated


def _slot0(emitted: Emitted) -> list[int]:
  """Slot 0's tokens of one decode_step (1, or up to decode_steps_per_call)."""
  return [emitted.token(0, i) for i in range(emitted.count(0))]


def decode_speculative(config: config_lib.Config, ids: list[int], tokenizer: Tokenizer | None) -> list[int]:
  """`decode` by speculative rounds (draft proposes, target verifies) until max_target_length or
  the end of sequence; also prints the draft's acceptance rate."""
  engine, params = speculative_engine.load(config, 1, FRESH_NOTE)
  num_new = config.model.max_target_length - len(ids) + 1
  seed, eos = config.decode.decode_sampling_seed, None if tokenizer is None else tokenizer.eos_id
  engine.prefill(params, [ids], seed).first_tokens_B.block_until_ready()  # compile
  start = time.perf_counter()
  prefix = engine.prefill(params, [ids], seed)
  prefix.first_tokens_B.block_until_ready()
  prefill_s = time.perf_counter() - start

  state = engine.insert(prefix, engine.init_decode_state(seed), slot=0)
  generated, rounds, start, timed_from = [int(prefix.first_tokens_B[0])], 0, 0.0, 0
  while len(generated) < num_new and generated[-1] != eos:
    state, emitted = engine.decode_step(params, state, [True])
    generated += [emitted.token(0, i) for i in range(emitted.count(0))]
    rounds += 1
    if rounds == 1:  # the first round compiles: timed from the second on
      start, timed_from = time.perf_counter(), len(generated)
  generate_s = time.perf_counter() - start
  generated = report(ids, generated[:num_new], tokenizer, prefill_s, config.decode.max_prefill_predict_length)
  metrics = engine.metrics()
  log(f"speculative: k={engine.speculative_tokens}, {rounds} rounds, {metrics['accepted']} of {metrics['proposed']} "
      f"draft tokens accepted (acceptance rate {metrics['acceptance_rate']:.2f}), "
      f"{(len(generated) - 1) / max(rounds, 1):.2f} tokens per round")
  if rounds > 1:
    timed = len(generated) - timed_from
    log(f"generate: {timed} tokens in {rounds - 1} rounds, {generate_s * 1e3:.1f} ms "
        f"({generate_s / max(timed, 1) * 1e3:.2f} ms/token, {timed / generate_s:.1f} tokens/s)")
  return generated


def report(ids: list[int], generated: list[int], tokenizer: Tokenizer | None, prefill_s: float, limit: int
           ) -> list[int]:
  """Prints the prompt, the completion (up to the end of sequence) and the prefill time; returns
  the generated ids up to the end of sequence."""
  if tokenizer is not None and tokenizer.eos_id in generated:  # steps run on (shape-stable); shown up to eos
    generated = generated[:generated.index(tokenizer.eos_id) + 1]
  if tokenizer is not None:
    log(f"prompt: {tokenizer.decode(ids)!r}")
    log(f"completion: {tokenizer.decode(generated)!r}")
  log(f"prompt ids: {ids}")
  log(f"generated ids: {generated}")
  log(f"prefill: {len(ids)} tokens in {prefill_s * 1e3:.1f} ms ({len(ids) / prefill_s:.1f} tokens/s, padded to {limit})")
  return generated


FRESH_NOTE = "decode: no load_parameters_path given; using randomly initialised parameters"
CHAT_TEMPLATE_NEEDS = "decode with prompt_chat_template=True"  # what the tokenizer's chat template is for, in errors
TOOL = startup.Tool("decode", reads_run=True, joins_job=True, reads_data=False)

main = startup.config_main(TOOL, decode)


if __name__ == "__main__":
  run_cli(main)
