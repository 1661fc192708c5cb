"""The objective seam (MaxText/training/objectives/): each objective reads the batch batch_spec declares,
train_step.py names no objective or partition, and an objective the step has never seen trains
through build_run's step unchanged."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from MaxText import models
from MaxText.training import lora, run_assembly
from MaxText.training import train_step as train_step_module
from MaxText.platform import accelerators
from MaxText.configuration import objective_registry
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from MaxText.input_pipeline import document_encoder
from MaxText.input_pipeline.batch_spec import FIELDS, batch_spec
from MaxText.training.objectives import LanguageModel, Objective, ObjectiveRecord, Preference, objective_for
from MaxText.training.objectives.base import Batch, Metrics, Params, Sums, T
from MaxText.training.train_state import PreferenceState, TrainState, reference_of

MAXTEXT = Path(__file__).resolve().parent.parent / "MaxText"
DPO_DATA = dict(objective="dpo", dataset_type="hf", hf_data_files="train.jsonl", tokenizer_type="huggingface",
                tokenizer_path="tokenizer")


@pytest.mark.parametrize("data, lora_rank, kind", [
    ({}, 0, LanguageModel), (dict(objective="sft", dataset_type="hf", hf_data_files="train.jsonl",
                                  tokenizer_type="huggingface", tokenizer_path="tokenizer"), 0, LanguageModel),
    (DPO_DATA, 0, Preference), (DPO_DATA, 4, Preference)])
def test_each_objective_reads_the_fields_batch_spec_declares(tiny_overrides, data, lora_rank, kind):
  config = Config.for_testing(**tiny_overrides, **data, lora_rank=lora_rank, lora_target_modules="q_proj")
  objective = objective_for(config, models.build_model_spec(config.model), lora.partition_for(config.model))
  assert type(objective) is kind
  assert objective.batch_fields == tuple(batch_spec(config.data))
  # DPO keeps a copy of the starting weights as its reference, except when LoRA's frozen base is one.
  extra = objective.extra_state({"w": 1}, lambda p: dict(p))
  assert extra == ({"reference": {"w": 1}} if kind is Preference and lora_rank == 0 else {})


def test_the_step_and_the_model_name_no_objective_or_partition():
  step = Path(train_step_module.__file__).read_text()
  for word in ("objective ==", "lora_rank", "lora", "dpo", "pair_count", "xent_sum", "moe_", "host_offload", "mtp"):
    assert word not in step, word
  model = "".join(p.read_text() for p in Path(models.__file__).parent.glob("*.py"))  # the model package
  assert "pipeline_1f1b" not in model and "pipelined_loss" not in model and "load_balance_loss_weight" not in model
  # Outside the configuration's checks, code asks the registries by the objective's name instead of
  # comparing names; the one exception is the GRPO-only evaluation tool refusing another config.
  compares = re.compile(r"objective\s*(?:==|!=|in \()")
  readers = sorted(p.relative_to(MAXTEXT).as_posix() for p in MAXTEXT.rglob("*.py") if compares.search(p.read_text()))
  assert [p for p in readers if not p.startswith("configuration/")] == ["rl/evaluate.py"]


def test_every_registered_objective_declares_its_loss_fields_and_data():
  for name in objective_registry.OBJECTIVES:
    record = objective_registry.record(name)
    assert isinstance(record, ObjectiveRecord) and FIELDS == record.batch_fields[:len(FIELDS)], name
    assert callable(record.build) and callable(record.encoder), name


class _AnchoredRows(Objective):
  """A made-up objective: next-token loss per *row* plus a pull towards a frozen anchor (a copy of
  the starting weights in the state), with its own sums and metrics names."""

  batch_fields = FIELDS
  state_class = PreferenceState

  def __init__(self, model: models.ModelSpec, pull: float):
    self.model, self.pull = model, pull

  def extra_state(self, params: T, copy: Callable[[T], T]) -> dict[str, T]:
    return {"reference": copy(params)}

  def context(self, state: TrainState) -> Params | None:
    anchor: Params = reference_of(state)
    return anchor

  def eval_sums(self, params: Params, context: Params | None, batch: Batch) -> Sums:
    return self.loss_sums(params, context, batch, None)[1]

  def loss_sums(self, params: Params, context: Params | None, batch: Batch,
                dropout_rng: jax.Array | None) -> tuple[jax.Array, Sums]:
    logits = self.model.apply(params, batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    weights = (batch["targets_segmentation"] != 0).astype(jnp.float32)
    nll = jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]) * weights)
    rows = jnp.asarray(batch["inputs"].shape[0], jnp.float32)
    assert context is not None
    distance = sum(jnp.sum(jnp.square(p.astype(jnp.float32) - a.astype(jnp.float32)))
                   for p, a in zip(jax.tree.leaves(params), jax.tree.leaves(context)))
    return nll + self.pull * rows * distance, {"nll_sum": nll, "row_count": rows, "weight_sum": jnp.sum(weights)}

  def divisor(self, sums: Sums) -> jax.Array:
    return sums["row_count"]

  def train_metrics(self, sums: Sums) -> Metrics:
    return {"loss": sums["nll_sum"] / sums["row_count"]}

  def eval_metrics(self, totals: Mapping[str, float]) -> tuple[dict[str, float], str]:
    loss = totals["nll_sum"] / totals["row_count"]
    return {"eval_loss": loss}, f"nll per row {loss:.3f}"


# The made-up objective as its module declares it (this file is the module): documents as the data,
# its own batch fields (the plain ones), its builder.
ANCHORED_ROWS = ObjectiveRecord(lambda config, model, partition: _AnchoredRows(model, 1e-4), FIELDS, document_encoder,
                                whole_records=False, chat_template=None)


def test_a_new_objective_is_its_module_plus_one_registry_line(tiny_overrides, monkeypatch):
  """Registered by one line, the made-up objective passes the config check, gives the batch its
  fields and trains through build_run's step unchanged."""
  one_device = dataclasses.replace(accelerators.local_target(), num_devices=1)
  overrides = dict(tiny_overrides, learning_rate=1e-2, warmup_steps_fraction=0.0, objective="anchored_rows")
  with pytest.raises(ConfigError, match="objective must be one of .*got 'anchored_rows'"):
    Config.for_testing(one_device, **overrides)
  monkeypatch.setitem(objective_registry.OBJECTIVES, "anchored_rows", f"{__name__}.ANCHORED_ROWS")
  config = Config.for_testing(one_device, **overrides)
  assert tuple(batch_spec(config.data)) == FIELDS
  run = run_assembly.build_run(config, devices=jax.devices()[:1])
  assert isinstance(run.objective, _AnchoredRows) and isinstance(run.setup.abstract_state, PreferenceState)
  state = run.init_state()
  anchor = jax.device_get(state.reference)
  batch = next(run.data_iterator())
  losses = []
  for _ in range(6):
    state, metrics = run.train_step(state, batch, jax.random.key(0))
    losses.append(float(metrics["loss"]))
  assert set(metrics) >= {"loss", "grad_norm", "num_tokens", "learning_rate"} and "z_loss" not in metrics
  assert float(metrics["num_tokens"]) == float(jnp.sum(batch["targets_segmentation"] != 0))
  assert losses[-1] < losses[0] - 0.1, losses
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(anchor), jax.tree.leaves(jax.device_get(state.reference))))
  scalars, line = run.objective.eval_metrics(jax.device_get(run.eval_step(state, batch)))
  assert scalars["eval_loss"] < losses[-1] and line.startswith("nll per row")  # evaluated after the last update
