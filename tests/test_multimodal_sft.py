"""Multimodal SFT end to end on the 8-device CPU mesh: generated 32x32 images of coloured squares
and circles, each named by the assistant; the tiny Gemma 3 vision model of
tests/layers/test_multimodal_vs_hf.py trains on them through the real pipeline (hf JSONL files,
the chat template, packing with pixel_values). Held-out loss falls; the freeze options and LoRA
keep the tower bitwise; the exported checkpoint gives transformers' Gemma3ForConditionalGeneration
our logits on an image prompt. The tiny Llama 4 trains the same way on 64x32 images, each cut
into two 32-pixel tiles and a thumbnail (three pixel_values slots)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from PIL import Image, ImageDraw

import train_utils
from MaxText import families
from MaxText.configuration.config import Config
from MaxText.errors import UserError
from MaxText.input_pipeline import chat, image_sft
from MaxText.training import lora, params_io

pytest.importorskip("transformers", reason="needs transformers (EXTRAS=test bash setup.sh)")
sys.path.insert(0, str(Path(__file__).parent / "input_pipeline"))
from sft_fixtures import GEMMA3, IMAGE_SPECIAL, LLAMA4, LLAMA4_IMAGE_IDS, LLAMA4_IMAGE_SPECIAL, write_tokenizer  # noqa: E402

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 30, 220)}
SHAPES = ("square", "circle")
TOWER = ("vision_encoder", "multimodal_projector")


def shape_image(path: Path, colour: str, shape: str, rng: random.Random, width: int = 32) -> str:
  image = Image.new("RGB", (width, 32), (255, 255, 255))
  side = rng.randrange(14, 24)
  left, top = rng.randrange(0, width - side), rng.randrange(0, 32 - side)
  draw = ImageDraw.Draw(image)
  (draw.rectangle if shape == "square" else draw.ellipse)((left, top, left + side, top + side), fill=COLOURS[colour])
  image.save(path)
  return str(path)


def shape_records(directory: Path, count: int, seed: int, width: int = 32) -> list[dict]:
  rng = random.Random(seed)
  directory.mkdir(parents=True, exist_ok=True)
  records = []
  for i in range(count):
    colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
    image = shape_image(directory / f"{i}.png", colour, shape, rng, width)
    records.append({"messages": [
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "what is this"}]},
        {"role": "assistant", "content": f"{colour} {shape}"}]})
  return records


def write_jsonl(path: Path, records: list[dict]) -> str:
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  """(tokenizer directory, train file, eval file, the tokenizer's image token ids)."""
  root = tmp_path_factory.mktemp("shapes")
  tokenizer_dir = write_tokenizer(root / "tok", GEMMA3, IMAGE_SPECIAL)
  tokenizer = chat.load_chat_tokenizer(str(tokenizer_dir))
  ids = dict(zip(("boi_token_id", "eoi_token_id", "image_token_id"),
                 tokenizer.convert_tokens_to_ids(["<start_of_image>", "<end_of_image>", "<image_soft_token>"])))
  train = write_jsonl(root / "train.jsonl", shape_records(root / "train", 192, 0))
  evaluation = write_jsonl(root / "eval.jsonl", shape_records(root / "eval", 16, 1))
  return str(tokenizer_dir), train, evaluation, ids


def model_keys(ids: dict) -> dict:
  """The tiny Gemma 3 vision reference (families/gemma.py) with 32x32 images, 4 soft tokens each,
  the fixture tokenizer's image tokens and a window that sees a whole conversation; every key
  inferred from its HF config, so the export is a model transformers computes."""
  import transformers

  fields = dict(families.multimodal_reference_hf_configs()["gemma3-vision"])
  fields.update(mm_tokens_per_image=4, boi_token_index=ids["boi_token_id"], eoi_token_index=ids["eoi_token_id"],
                image_token_index=ids["image_token_id"],
                text_config={**fields["text_config"], "vocab_size": 320, "max_position_embeddings": 128,
                             "sliding_window": 64},
                vision_config={**fields["vision_config"], "image_size": 32})
  hf = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields).to_dict()
  return families.family_for_hf_config(hf).model_keys(hf)


def config(data, tmp_path: Path, **overrides) -> Config:
  tokenizer_dir, train, evaluation, ids = data
  return Config.for_testing(**{
      **model_keys(ids), "max_target_length": 128, "per_device_batch_size": 1, "dtype": "float32",
      "base_output_directory": str(tmp_path), "objective": "sft", "dataset_type": "hf", "hf_path": "json",
      "hf_data_files": train, "hf_eval_files": evaluation, "tokenizer_type": "huggingface",
      "tokenizer_path": tokenizer_dir, "max_images_per_row": 2, "learning_rate": 3e-3, "warmup_steps_fraction": 0.0,
      "data_prefetch_batches": 0, "eval_interval": 10, "print_config": False, "ici_fsdp_parallelism": 8,
      **overrides})


def eval_loss(run: train_utils.Run, state) -> float:
  iterator = run.assembly.eval_iterator()
  assert iterator is not None
  totals = [jax.device_get(run.assembly.eval_step(state, next(iterator))) for _ in range(2)]
  return float(sum(t["xent_sum"] for t in totals) / sum(t["weight_sum"] for t in totals))


def tower(params) -> list[np.ndarray]:
  return [np.asarray(x) for part in TOWER for x in jax.tree.leaves(jax.device_get(params[part]))]


def test_image_batches_are_sharded_by_rows(data, tmp_path):
  """The fast end-to-end check (no compile): real records through the run's own iterator →
  pixel_values [B, 2, 3, 32, 32] split along the batch like the tokens, each row's images in its
  first slots (one per placeholder run), zeros after them, no loss on a placeholder."""
  run = train_utils.Run(config(data, tmp_path))
  batch = next(run.data)
  pixels = batch["pixel_values"]
  assert pixels.shape == (8, 2, 3, 32, 32) and pixels.dtype == np.float32
  assert pixels.sharding.spec[0] == batch["inputs"].sharding.spec[0] and pixels.sharding.spec[1:] == (None,) * 4
  host, inputs = np.asarray(pixels), np.asarray(batch["inputs"])
  image_id = run.config.model.vision.image_token_id
  counts = [int((inputs[row] == image_id).sum()) // 4 for row in range(8)]
  assert max(counts) == 2  # packing put two one-image conversations in a row
  for row, count in enumerate(counts):
    assert host[row, :count].any(axis=(1, 2, 3)).all() and not host[row, count:].any()
  assert not np.asarray(batch["targets_segmentation"])[np.asarray(batch["targets"]) == image_id].any()
  assert run.assembly.objective.batch_fields[-1] == "pixel_values"


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
  """40 steps of the shape task: (run, starting state's eval loss, final state, its eval loss)."""
  run = train_utils.Run(config(data, tmp_path_factory.mktemp("run")))
  state = run.init()
  first, start_tower = eval_loss(run, state), tower(state.params)
  state, _ = run.train(state, 40)
  assert any(not np.array_equal(a, b) for a, b in zip(start_tower, tower(state.params)))  # the tower trains
  return run, first, state, eval_loss(run, state)


@pytest.mark.slow  # 40 steps with the vision tower on 2 shared cores
def test_held_out_loss_falls_and_the_answer_depends_on_the_image(trained, data):
  run, first, state, last = trained
  assert last < 0.5 * first, (first, last)
  # Six answers a model blind to the image cannot tell apart: showing each eval record the image of
  # one with another answer must cost the trained model loss.
  tokenizer_dir, _, evaluation, _ = data
  records = [json.loads(line) for line in Path(evaluation).read_text().splitlines()]
  encoder = image_sft.ImageSftEncoder(chat.load_chat_tokenizer(tokenizer_dir), 128, True, True, True,
                                      run.config.model.vision, "gemma3", 2)
  right, wrong = _answer_losses(run, state, encoder, records)
  assert wrong > 3 * right, (right, wrong)


def _answer_losses(run: train_utils.Run, state, encoder: image_sft.ImageSftEncoder, records: list[dict]
                   ) -> tuple[float, float]:
  """Mean assistant-token loss with each record's own image, and with the next record's image
  where that one shows a different answer."""
  from MaxText import models
  from MaxText.platform import sharding

  spec = models.build_model_spec(run.config.model)
  apply = jax.jit(sharding.unsharded()(spec.apply))
  params = jax.device_get(state.params)

  def loss(record: dict, image_record: dict) -> float:
    document = encoder(record)
    picture = encoder(image_record)
    tokens, weights = document.tokens
    logits = np.asarray(apply(params, tokens[None, :-1], np.arange(len(tokens) - 1)[None],
                              np.ones((1, len(tokens) - 1), np.int32), None, picture.pixels[None]))[0]
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    picked = logp[np.arange(len(tokens) - 1), tokens[1:]]
    return float(-(picked * weights[1:]).sum() / weights[1:].sum())

  answers = [r["messages"][1]["content"] for r in records]
  pairs = [(i, next(j for j in range(i + 1, i + len(records)) if answers[j % len(records)] != answers[i]) % len(records))
           for i in range(len(records))]
  right = float(np.mean([loss(records[i], records[i]) for i, _ in pairs]))
  wrong = float(np.mean([loss(records[i], records[j]) for i, j in pairs]))
  return right, wrong


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [{"freeze_vision_encoder": True, "freeze_multimodal_projector": True},
                                       {"lora_rank": 4}], ids=["frozen-tower", "lora"])
def test_frozen_tower_and_lora_keep_the_tower_bitwise(data, tmp_path, overrides):
  run = train_utils.Run(config(data, tmp_path, **overrides))
  start = run.init()
  before, embedding = tower(start.params), np.asarray(jax.device_get(start.params["token_embedder"]["embedding"]))
  adapters = jax.tree.leaves(jax.device_get(lora.split(start.params)[0]))
  state, history = run.train(start, 4)
  assert all(np.isfinite(h["loss"]) for h in history)
  if adapters:  # LoRA: its adapters train
    assert any(not np.array_equal(a, b) for a, b in zip(adapters, jax.tree.leaves(lora.split(state.params)[0])))
  else:
    assert history[-1]["loss"] < history[0]["loss"]
  assert all(np.array_equal(a, b) for a, b in zip(before, tower(state.params)))
  moved = not np.array_equal(embedding, np.asarray(jax.device_get(state.params["token_embedder"]["embedding"])))
  assert moved == ("lora_rank" not in overrides)  # LoRA trains only its adapters


def test_a_bad_image_stops_the_iterator_naming_the_record(data, tmp_path):
  tokenizer_dir, train, evaluation, ids = data
  records = [json.loads(line) for line in Path(train).read_text().splitlines()[:8]]
  broken = tmp_path / "broken.png"
  broken.write_bytes(b"\x89PNG not really")
  records[2]["messages"][0]["content"][0]["image"] = str(broken)
  bad = write_jsonl(tmp_path / "bad.jsonl", records)
  run_config = config((tokenizer_dir, bad, evaluation, ids), tmp_path, enable_data_shuffling=False)
  from MaxText.input_pipeline import create_data_iterator
  from MaxText.platform import sharding

  with pytest.raises(UserError) as raised:
    next(create_data_iterator(run_config, sharding.create_mesh(run_config.mesh)))
  assert f"{bad} line 3: image {broken}: cannot be decoded" in str(raised.value), str(raised.value)


@pytest.mark.slow  # transformers' model beside ours
def test_the_exported_checkpoint_gives_transformers_our_logits_on_an_image_prompt(trained, data, tmp_path):
  import hf_families as H
  from MaxText.convert import engine, maxtext_to_hf

  run, _, state, _ = trained
  tokenizer_dir, _, evaluation, ids = data
  ckpt = tmp_path / "params"
  params_io.save_params(str(ckpt), state.params)
  engine.write_model_config(str(ckpt), model_keys(ids), "test_multimodal_sft")
  maxtext_to_hf.export(str(ckpt), str(tmp_path / "hf"), [])
  model = H.transformers.Gemma3ForConditionalGeneration.from_pretrained(str(tmp_path / "hf"),
                                                                        attn_implementation="eager").eval()
  encoder = image_sft.ImageSftEncoder(chat.load_chat_tokenizer(tokenizer_dir), 128, True, True, True,
                                      run.config.model.vision, "gemma3", 2)
  record = json.loads(Path(evaluation).read_text().splitlines()[0])
  document = encoder(record)
  tokens, pixels = document.tokens[0][None], document.pixels[None]
  ours = H.our_multimodal_logits(run.config, jax.device_get(state.params), tokens, pixels)
  np.testing.assert_allclose(H.hf_multimodal_logits(model, tokens, pixels), ours, atol=1e-4, rtol=0)


@pytest.mark.parametrize("overrides, message", [
    ({"max_images_per_row": -1}, "max_images_per_row must be a whole number >= 0, got -1"),
    ({"use_multimodal": False}, "max_images_per_row=2 gives batches images, which only objective=sft reads, for a "
                                "use_multimodal=True model"),
    ({"max_target_length": 6}, "max_target_length (6) must exceed an image's 6 tokens"),
])
def test_image_slot_keys_are_checked_in_one_line(data, tmp_path, overrides, message):
  from MaxText.errors import ConfigError

  with pytest.raises(ConfigError) as raised:
    config(data, tmp_path, **overrides)
  assert message in str(raised.value) and "\n" not in str(raised.value)


# ---- Llama 4: 64 x 32 images are a 1 x 2 tile grid and a thumbnail, three slots of a row each.

LLAMA4_TILES = 3


@pytest.fixture(scope="module")
def llama4_data(tmp_path_factory):
  root = tmp_path_factory.mktemp("llama4_shapes")
  tokenizer_dir = write_tokenizer(root / "tok", LLAMA4, LLAMA4_IMAGE_SPECIAL)
  train = write_jsonl(root / "train.jsonl", shape_records(root / "train", 96, 0, width=64))
  evaluation = write_jsonl(root / "eval.jsonl", shape_records(root / "eval", 16, 1, width=64))
  return str(tokenizer_dir), train, evaluation


def llama4_config(llama4_data, tmp_path: Path, **overrides) -> Config:
  """The tiny Llama 4 vision reference (families/llama4.py) with the fixture tokenizer's image
  tokens; every key inferred from its HF config."""
  import transformers

  tokenizer_dir, train, evaluation = llama4_data
  fields = dict(families.multimodal_reference_hf_configs()["llama4-vision"])
  fields.update(boi_token_index=LLAMA4_IMAGE_IDS["boi_token_id"], eoi_token_index=LLAMA4_IMAGE_IDS["eoi_token_id"],
                image_token_index=LLAMA4_IMAGE_IDS["image_token_id"],
                text_config={**fields["text_config"], "vocab_size": 320, "max_position_embeddings": 256})
  hf = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields).to_dict()
  return Config.for_testing(**{
      **families.family_for_hf_config(hf).model_keys(hf), "max_target_length": 128, "per_device_batch_size": 1,
      "dtype": "float32", "base_output_directory": str(tmp_path), "objective": "sft", "dataset_type": "hf",
      "hf_path": "json", "hf_data_files": train, "hf_eval_files": evaluation, "tokenizer_type": "huggingface",
      "tokenizer_path": tokenizer_dir, "max_images_per_row": LLAMA4_TILES, "learning_rate": 3e-3,
      "warmup_steps_fraction": 0.0, "data_prefetch_batches": 0, "eval_interval": 10, "print_config": False,
      "ici_fsdp_parallelism": 8, **overrides})


def test_llama4_batches_hold_each_images_tiles_in_a_rows_slots(llama4_data, tmp_path):
  """No compile: each row holds one conversation, its image's two tiles and thumbnail in its three
  slots (one per placeholder run), no loss on a placeholder."""
  run = train_utils.Run(llama4_config(llama4_data, tmp_path))
  batch = next(run.data)
  pixels, inputs = np.asarray(batch["pixel_values"]), np.asarray(batch["inputs"])
  assert pixels.shape == (8, LLAMA4_TILES, 3, 32, 32)
  image_id = LLAMA4_IMAGE_IDS["image_token_id"]
  assert [int((row == image_id).sum()) for row in inputs] == [LLAMA4_TILES * 16] * 8
  assert pixels.any(axis=(2, 3, 4)).all()
  assert not np.asarray(batch["targets_segmentation"])[np.asarray(batch["targets"]) == image_id].any()


@pytest.mark.slow  # 30 steps with the vision tower and the MoE text stack on 2 shared cores
def test_llama4_held_out_loss_falls(llama4_data, tmp_path):
  run = train_utils.Run(llama4_config(llama4_data, tmp_path))
  state = run.init()
  first, start_tower = eval_loss(run, state), tower(state.params)
  state, history = run.train(state, 30)
  assert all(np.isfinite(h["loss"]) for h in history)
  assert any(not np.array_equal(a, b) for a, b in zip(start_tower, tower(state.params)))  # the tower trains
  last = eval_loss(run, state)
  assert last < 0.5 * first, (first, last)
