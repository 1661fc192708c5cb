"""objective=distill_sft: distillation on chat-format records. The batches are objective=sft's (the
chat template, the prompt's targets weighted 0), and the KL counts the completion's tokens only."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from MaxText import models
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from MaxText.platform import accelerators, sharding
from MaxText.training import params_io
from MaxText.training.objectives import distill_loss
from MaxText.training.run_assembly import build_run

pytest.importorskip("transformers", reason="needs transformers (EXTRAS=test bash setup.sh)")
sys.path.insert(0, str(Path(__file__).parent / "input_pipeline"))
from sft_fixtures import CHATML, without_markers, write_tokenizer  # noqa: E402

MODEL = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=128,
             base_num_decoder_layers=2, vocab_size=320, max_target_length=64, per_device_batch_size=2,
             print_config=False)
TEACHER = {**MODEL, "base_num_decoder_layers": 3}


def _one_device(**values: object) -> Config:
  return Config.for_testing(dataclasses.replace(accelerators.local_target(), num_devices=1), **values)


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory) -> dict:
  root = tmp_path_factory.mktemp("distill_sft")
  tokenizer = write_tokenizer(root / "tokenizer", without_markers(CHATML))
  records = [{"messages": [{"role": "user", "content": "continue this line: the quick brown"},
                           {"role": "assistant", "content": "fox jumps over"}]},
             {"messages": [{"role": "user", "content": "say the next words: over the"},
                           {"role": "assistant", "content": "lazy dog"}]}] * 8
  data = root / "train.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in records))
  teacher = str(root / "teacher")
  params_io.save_params(teacher, jax.jit(models.build_model_spec(_one_device(**TEACHER).model).init_params)(
      jax.random.key(3)))
  overrides = ",".join(f"{k}={v}" for k, v in TEACHER.items() if k.startswith("base_") or k in ("head_dim", "vocab_size"))
  return dict(MODEL, dataset_type="hf", hf_path="json", hf_data_files=str(data), tokenizer_type="huggingface",
              tokenizer_path=str(tokenizer), distill_teacher_path=teacher, distill_teacher_model_name="default",
              distill_teacher_overrides=overrides, distill_alpha=0.5, enable_data_shuffling=False)


def test_the_batches_are_sfts_and_the_kl_counts_the_completion_only(chat_run):
  no_teacher = {**chat_run, "objective": "sft", "distill_teacher_path": ""}  # sft refuses a teacher it would not read
  sft = build_run(_one_device(**no_teacher), devices=jax.devices()[:1])
  run = build_run(_one_device(**{**chat_run, "objective": "distill_sft"}), devices=jax.devices()[:1])
  batch = jax.device_get(next(run.data_iterator()))
  assert all(np.array_equal(batch[name], value) for name, value in jax.device_get(next(sft.data_iterator())).items())
  completion = batch["targets_segmentation"] != 0
  assert 0 < completion.sum() < 0.5 * (batch["inputs_segmentation"] != 0).sum()  # the prompts weigh nothing
  state = run.init_state()
  sums = jax.device_get(run.eval_step(state, next(run.data_iterator())))
  assert sums["weight_sum"] == completion.sum()
  # The KL sum is the per-token KL over the completion's positions, not over every position.
  inputs = [batch[name] for name in ("inputs", "inputs_position", "inputs_segmentation")]

  @jax.jit
  def token_kl(params: dict, teacher_params: dict) -> jax.Array:
    with sharding.unsharded():  # one device
      student = run.setup.on_mesh.spec.apply(params, *inputs)
      teacher = run.objective.teacher.apply(teacher_params, *inputs)  # type: ignore[attr-defined]
    return distill_loss.token_kl(student, distill_loss.teacher_targets(teacher, 1.0, 0), "forward_kl", 1.0)

  kl_BL = np.asarray(token_kl(state.params, state.teacher))
  assert float(sums["distill_kl_sum"]) == pytest.approx(float(kl_BL[completion].sum()), rel=1e-4)
  assert kl_BL[~completion].sum() > 0.1 * kl_BL[completion].sum()  # the mask matters


def test_distill_sft_needs_conversation_data(chat_run):
  with pytest.raises(ConfigError, match="objective=distill_sft reads conversation records with dataset_type=hf"):
    _one_device(**{**chat_run, "objective": "distill_sft", "dataset_type": "synthetic"})
  with pytest.raises(ConfigError, match="objective=distill_sft needs a teacher"):
    _one_device(**{**chat_run, "objective": "distill_sft", "distill_teacher_path": ""})
