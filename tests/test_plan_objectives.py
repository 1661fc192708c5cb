"""The planner prices objectives other than language modelling as training counts them: DPO's and GRPO's passes
per row in the step's FLOPs (metrics.objective_tflops_per_step of the built objective), their remat re-runs once
per trained sequence, and a frozen reference copy of the parameters in the memory per chip. The passes come from
each objective's ObjectiveRecord.cost, the one source the built objective reads too. A rollout mesh of its
own (rl_rollout_devices) is refused. No compiles."""

from types import SimpleNamespace
from typing import Any

import pytest

from MaxText import plan
from MaxText.aot import plan_model
from MaxText.configuration import objective_registry
from MaxText.configuration.config import Config
from MaxText.platform import accelerators
from MaxText.training import lora, metrics
from MaxText.training.objectives import objective_for
from MaxText.errors import ConfigError
from tests.test_plan_teacher import STUDENT, argv, estimate

# DPO's records and GRPO's prompts are read by the run, not the planner: any names do.
DPO = dict(objective="dpo", dataset_type="hf", hf_path="x", tokenizer_type="huggingface", tokenizer_path="t",
           eval_interval=-1)
GRPO = dict(objective="grpo", dataset_type="hf", hf_data_files="prompts.jsonl", tokenizer_type="huggingface",
            tokenizer_path="t", eval_interval=-1, reward_functions="exact_match", num_generations=4,
            max_prefill_predict_length=16, max_completion_length=16)
CHIPS, ROWS = 4, 16  # v5e-4 at per_device_batch_size=4 (test_plan_teacher.SETTINGS)


def training_flops(model: plan_model.ModelShape, cost: metrics.ObjectiveCost) -> float:
  """Model FLOPs per chip as the run counts them for an objective of `cost` (no teacher, no images)."""
  counted = SimpleNamespace(passes_per_row=cost.passes_per_row, trained_per_row=cost.trained_per_row,
                            trains_indexer=cost.trains_indexer, forward_only_models=())
  config = SimpleNamespace(model=model.cfg, data=SimpleNamespace(global_batch_size=ROWS, max_target_length=64,
                                                                 max_images_per_row=0))
  return metrics.objective_tflops_per_step(config, counted).total_tflops * 1e12 / CHIPS  # type: ignore[arg-type]


def test_dpo_is_priced_at_its_eight_passes_with_its_reference_copy() -> None:
  """The planner priced DPO as language modelling (3 passes a row, no reference): a step that runs two trained
  sequences and two reference forwards a row, beside a frozen copy of the parameters, looked 8/3 cheaper and
  a whole parameter copy smaller than train_compile finds it."""
  _, lm = estimate()
  model, dpo = estimate(**DPO)
  assert (model.cost.passes_per_row, model.cost.trained_per_row, model.cost.reference_copy) == (8, 2, True)
  assert dpo.flops == pytest.approx(lm.flops * 8 / 3, rel=1e-9)
  assert dpo.flops == pytest.approx(training_flops(model, model.cost), rel=1e-9)
  # Full remat re-runs each trained sequence's forward: twice a row.
  assert dpo.recompute_flops == pytest.approx(2 * lm.recompute_flops, rel=1e-9) and lm.recompute_flops > 0
  peak = accelerators.TPU_GENERATIONS["v5e"].peak_tflops * 1e12
  added = dpo.flops - lm.flops + dpo.recompute_flops - lm.recompute_flops
  assert (dpo.compute_s - lm.compute_s) * peak >= added * (1 - 1e-9)  # and the kernels' re-runs, per trained sequence
  # The reference: the parameters again, sharded like them (every leaf split over fsdp=4).
  assert lm.reference == 0 and dpo.reference == dpo.params > 0
  assert dpo.total - lm.total == pytest.approx(dpo.params + dpo.activations - lm.activations, rel=1e-9)


def test_dpo_under_lora_keeps_no_copy() -> None:
  model, dpo = estimate(**DPO, lora_rank=4)
  assert model.cost.passes_per_row == 8 and not model.cost.reference_copy and dpo.reference == 0


@pytest.mark.parametrize("keys, passes, trained, copy", [
    (dict(grpo_beta=0.0), 3, 1, False),  # one update, no reference: language modelling's passes
    (dict(grpo_beta=0.1, grpo_num_iterations=2), 2 * 3 + 2, 2, True),  # π_old's and π_ref's forwards
    (dict(grpo_beta=0.0, rl_importance_sampling="token_truncate"), 3 + 1, 1, False),  # π_old's forward kept apart
])
def test_grpo_is_priced_at_its_updates_and_fixed_forwards(keys: dict[str, object], passes: int, trained: int,
                                                          copy: bool) -> None:
  _, lm = estimate()
  model, grpo = estimate(**GRPO, **keys)
  assert (model.cost.passes_per_row, model.cost.trained_per_row, model.cost.reference_copy) == (passes, trained, copy)
  assert grpo.flops == pytest.approx(training_flops(model, model.cost), rel=1e-9)
  assert grpo.flops == pytest.approx(lm.flops * passes / 3, rel=1e-9)
  assert grpo.recompute_flops == pytest.approx(trained * lm.recompute_flops, rel=1e-9)
  assert grpo.reference == (grpo.params if copy else 0.0)


@pytest.mark.parametrize("name, keys", [("lm", {}), ("dpo", DPO), ("dpo", dict(DPO, lora_rank=4)),
                                        ("grpo", dict(GRPO, grpo_beta=0.1, grpo_num_iterations=3)),
                                        ("grpo", dict(GRPO, grpo_beta=0.1, lora_rank=4))])
def test_each_records_cost_is_what_its_built_objective_counts(tiny_overrides: dict[str, Any], name: str,
                                                              keys: dict[str, Any]) -> None:
  """One source: the cost the planner reads from the record is the built objective's passes and copy."""
  config = Config.for_testing(**{**tiny_overrides, **keys})
  partition = lora.partition_for(config.model)
  cost = objective_registry.record(name).cost(config, partition)
  built = objective_for(config, None, partition)  # type: ignore[arg-type]  # the passes need no model
  assert (cost.passes_per_row, cost.trained_per_row, cost.trains_indexer) == (
      built.passes_per_row, built.trained_per_row, built.trains_indexer)
  assert cost.reference_copy == ("reference" in built.extra_state({"w": 1}, lambda p: p))
  assert plan.model_shape(config).cost == cost


def test_a_rollout_mesh_of_its_own_is_refused_not_planned_empty(tmp_path: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
  """With rl_rollout_devices the training mesh is the slice less the rollout devices, but the planner ranked
  layouts of the whole slice: every candidate failed as a config and the short list came back empty."""
  monkeypatch.setattr(plan, "_compile_all", lambda *a, **k: pytest.fail("the planner compiled a candidate"))
  with pytest.raises(ConfigError, match="rl_rollout_devices=4: the planner lays the training mesh over the whole "
                                        "slice"):
    plan.main(argv(compile_topology="v5e-8", **STUDENT, **GRPO, grpo_beta=0.1, rl_rollout_devices=4,
                   cache_dir=tmp_path / "cache"))
