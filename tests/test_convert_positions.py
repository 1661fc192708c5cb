"""config.json's max_position_embeddings, the longest sequence a model is meant for (serving stacks size their
context from it), survives hf_to_maxtext -> maxtext_to_hf for every RoPE family; a model trained from scratch
declares at least the length it was trained at; and on a RoPE model the key shapes nothing a resume must keep."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

import hf_families as H
from MaxText import families, models
from MaxText.configuration import run_record
from MaxText.configuration.config import Config
from MaxText.configuration.model_config import MODEL_KEYS
from MaxText.convert import engine, hf_to_maxtext, maxtext_to_hf, streaming

UNUSUAL = 12345  # no family's rule would land on it


def _rope_family_cases() -> list[str]:
  """One tiny reference model per RoPE family: the first it names."""
  cases: dict[str, str] = {}
  for name, fields in H.REFERENCE_CONFIGS.items():
    family = families.family_for_hf_config(fields)
    if family.name not in cases and family.model_keys(dict(fields)).get("position_embedding", "rope") == "rope":
      cases[family.name] = name
  return list(cases.values())


def _round_trip(model, tmp_path: Path, *export_args: str) -> dict:
  """`model` saved, converted with inferred keys and exported back: the exported config.json."""
  model.save_pretrained(str(tmp_path / "hf"))
  hf_to_maxtext.convert(str(tmp_path / "hf"), str(tmp_path / "ckpt"), [])
  maxtext_to_hf.export(str(tmp_path / "ckpt"), str(tmp_path / "back"), list(export_args))
  return json.loads((tmp_path / "back" / "config.json").read_text())


@pytest.mark.parametrize("name", _rope_family_cases())
def test_every_rope_family_round_trips_max_position_embeddings(name, tmp_path):
  exported = _round_trip(H.build_hf_model(name, max_position_embeddings=UNUSUAL), tmp_path)
  saved = yaml.safe_load((tmp_path / "ckpt" / "model_config.yml").read_text())
  assert saved["max_position_embeddings"] == UNUSUAL
  assert exported["max_position_embeddings"] == UNUSUAL


def test_a_multimodal_configs_text_config_value_round_trips(tmp_path):
  fields = H.MULTIMODAL_CONFIGS["gemma3-vision"]
  model = H.build_hf_multimodal_model(
      "gemma3-vision", text_config={**fields["text_config"], "max_position_embeddings": UNUSUAL})
  assert _round_trip(model, tmp_path)["text_config"]["max_position_embeddings"] == UNUSUAL


def test_llama3_rope_keeps_the_published_context_not_original_times_factor(tmp_path):
  """Llama 3.1's config.json: 131072 positions, RoPE scaled by 8 from 8192 (which would make 65536)."""
  rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
  model = H.build_hf_model("llama3.1", max_position_embeddings=131072, rope_parameters=rope)
  assert _round_trip(model, tmp_path)["max_position_embeddings"] == 131072


def test_a_longer_run_raises_what_the_export_declares(tmp_path):
  """A converted model exported with a longer max_target_length declares that length (its RoPE has no end)."""
  exported = _round_trip(H.build_hf_model("qwen3", max_position_embeddings=64), tmp_path, "max_target_length=300")
  assert exported["max_position_embeddings"] == 300


def test_a_model_trained_from_scratch_declares_its_length(tiny_overrides, tmp_path):
  """A parameters-only checkpoint of a model built from our keys (as generate_param_only_checkpoint writes it),
  whose max_position_embeddings is below the length it was trained and exported at."""
  config = Config.for_testing(**{**tiny_overrides, "max_position_embeddings": 16})
  params = models.build_model_spec(config.model).init_params(jax.random.key(0))
  ckpt = str(tmp_path / "params")
  streaming.save_params_one_by_one(ckpt, jax.tree.map(np.asarray, params))
  engine.write_model_config(ckpt, {k: config[k] for k in MODEL_KEYS if k in config.values}, "a test run")
  maxtext_to_hf.export(ckpt, str(tmp_path / "hf"), [f"max_target_length={tiny_overrides['max_target_length']}"])
  exported = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert exported["max_position_embeddings"] == tiny_overrides["max_target_length"] > 16


def test_on_a_rope_model_the_key_is_no_reason_to_refuse_a_resume_or_a_tool():
  """A run started before its model YAML gave the published value resumes, and a tool reading it with
  model_name= is not refused; a learned table's rows still fix its shape."""
  saved, now = {"position_embedding": "rope", "max_position_embeddings": 2048}, {"max_position_embeddings": 40960}
  assert run_record.resume_differences({**saved, **now}, saved) == []
  assert run_record.contradictions(now, saved) == []
  learned = {**saved, "position_embedding": "learned"}
  assert run_record.resume_differences({**learned, **now}, learned) == ["max_position_embeddings: 2048 -> 40960"]
  assert run_record.contradictions(now, learned) == ["max_position_embeddings=40960 (saved: 2048)"]


def test_a_runs_checkpoint_exports_the_length_the_run_trained_at(tmp_path):
  """From a training run's checkpoint the export took max_target_length only from its own arguments (the CPU
  default 128 if none), so a model trained longer declared less than it was trained at."""
  from MaxText import train

  args = dict(base_emb_dim=32, base_num_query_heads=2, base_num_kv_heads=2, head_dim=16, base_mlp_dim=64,
              base_num_decoder_layers=1, vocab_size=128, max_target_length=256, max_position_embeddings=64,
              per_device_batch_size=1, print_config=False, steps=1, run_name="long", base_output_directory=tmp_path,
              enable_tensorboard=False, cpu_peak_tflops=1.0, decoder_block="llama2")
  assert train.main(["train", "configs/base.yml"] + [f"{k}={v}" for k, v in args.items()]) == 0
  maxtext_to_hf.export(str(tmp_path / "long" / "checkpoints"), str(tmp_path / "hf"), [])
  assert json.loads((tmp_path / "hf" / "config.json").read_text())["max_position_embeddings"] == 256
  maxtext_to_hf.export(str(tmp_path / "long" / "checkpoints"), str(tmp_path / "hf2"), ["max_target_length=512"])
  assert json.loads((tmp_path / "hf2" / "config.json").read_text())["max_position_embeddings"] == 512
