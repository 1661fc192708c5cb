"""The planner's analytical model with a distillation teacher (plan.model_shape, plan_model.estimate):
its sharded weights and kept log-probs in the memory per chip, its forward FLOPs in the step, and a
teacher too large to fit named in the planner's answer; an image-text model's vision tower FLOPs in the
step. No compiles."""

from types import SimpleNamespace

import pytest

from MaxText import plan, startup
from MaxText.aot import plan_model
from MaxText.configuration import config as config_lib
from MaxText.configuration.config import BASE_CONFIG_PATH
from MaxText.errors import UserError
from MaxText.layers.attention import select_kernel
from MaxText.platform import accelerators
from MaxText.training import metrics
from MaxText.training.objectives import distill

STUDENT = dict(base_emb_dim=256, base_num_query_heads=2, base_num_kv_heads=2, head_dim=64, base_mlp_dim=512,
               base_num_decoder_layers=2, vocab_size=256, max_target_length=64, print_config=False)
TEACHER = "vocab_size=256,base_num_decoder_layers=8,base_emb_dim=512,base_mlp_dim=1024"
SETTINGS = dict(per_device_batch_size=4, remat_policy="full", ici_fsdp_parallelism=4)


def argv(**overrides: object) -> list[str]:
  return ["plan", str(BASE_CONFIG_PATH)] + [f"{k}={v}" for k, v in overrides.items()]


def estimate(**overrides: object) -> tuple[plan_model.ModelShape, plan_model.Estimate]:
  topology = accelerators.tpu_topology("v5e-4")
  config = config_lib.build_config(startup.read_overrides(argv(compile_topology="v5e-4", **STUDENT, **SETTINGS,
                                                               **overrides)), topology.target(), default_run_name="plan")
  settings = {k: config[k] for k in plan.SEARCH_KEYS}
  settings.update(ici_fsdp_parallelism=4, ici_data_parallelism=1)
  model = plan.model_shape(config)
  return model, plan_model.estimate(model, settings, topology, 1, config.data.max_target_length,
                                    config.mesh.logical_axis_rules,
                                    select_kernel(config.model.attn.attention, "tpu", config.model))


def test_a_teacher_adds_its_sharded_weights_and_its_forward_flops(tmp_path):
  _, alone = estimate()
  model, taught = estimate(objective="distill", distill_teacher_path=tmp_path, distill_teacher_model_name="default",
                           distill_teacher_overrides=TEACHER)
  (teacher,) = model.teachers
  assert teacher.shape.cfg.num_decoder_layers == 8 and teacher.shape.opt_multiple == 0  # frozen: no optimizer state
  teacher_bytes = teacher.shape.num_params * teacher.shape.leaves[0][1] / 4  # every leaf split over fsdp=4
  assert taught.teacher == pytest.approx(teacher_bytes, rel=0.01)
  assert alone.teacher == 0 and taught.params == alone.params and taught.optimizer == alone.optimizer
  # The teacher's weights, plus its float32 log-probs over the vocabulary kept through the student's step
  # (or its forward's working set, when larger).
  assert taught.activations >= alone.activations + 4 * 64 * 256 * 4
  assert taught.total - alone.total == taught.teacher + taught.activations - alone.activations
  assert taught.total - alone.total == pytest.approx(teacher_bytes, rel=0.1)
  # Its forward once per row: 2 FLOPs per weight and token, plus its attention, over the 4 chips' rows.
  weights, attention = metrics.forward_flops_per_sequence(teacher.shape.cfg, 64)
  assert taught.flops - alone.flops == pytest.approx(4 * 4 * (weights + attention) / 4, rel=1e-6)
  peak = accelerators.TPU_GENERATIONS["v5e"].peak_tflops * 1e12
  assert (taught.compute_s - alone.compute_s) * peak == pytest.approx(taught.flops - alone.flops, rel=1e-6)
  assert taught.step_s > alone.step_s


def test_top_k_and_on_policy_teachers_keep_less(tmp_path, monkeypatch):
  keys = dict(distill_teacher_path=tmp_path, distill_teacher_model_name="default", distill_teacher_overrides=TEACHER)
  model, _ = estimate(objective="distill", distill_top_k=8, **keys)
  assert [(t.held_bytes_per_token, t.per_micro_batch) for t in model.teachers] == [(64, True)]
  # On-policy distillation: the teacher scores each rollout batch once and keeps one log-prob per token.
  monkeypatch.setattr(distill, "teacher_config", lambda config, use: SimpleNamespace(model=f"teacher for {use}"))
  on_policy = SimpleNamespace(data=SimpleNamespace(objective="grpo"), distill=SimpleNamespace(distill_top_k_path=""),
                              rl=SimpleNamespace(rl_teacher_kl_weight=1.0))
  assert distill.teacher_runs(on_policy) == (distill.TeacherRun("teacher for rl_teacher_kl_weight > 0", 4, False),)
  on_policy.rl.rl_teacher_kl_weight = 0.0
  assert distill.teacher_runs(on_policy) == ()


def test_a_teacher_too_large_to_fit_is_named(tmp_path, monkeypatch):
  monkeypatch.setattr(plan, "_compile_all", lambda *a, **k: pytest.fail("the planner compiled a candidate"))
  big = "vocab_size=256,base_num_decoder_layers=64,base_emb_dim=4096,base_mlp_dim=16384,base_num_query_heads=32,base_num_kv_heads=32"
  with pytest.raises(UserError, match=r"does not fit 1 x v5e-4 at any setting the planner searches: its leanest "
                                      r"setting .* needs [\d.]+ GiB per chip \(parameters [\d.]+ \+ the teacher's "
                                      r"parameters [\d.]+ \+ optimizer"):
    plan.main(argv(compile_topology="v5e-4", **STUDENT, objective="distill", distill_teacher_path=tmp_path,
                   distill_teacher_model_name="default", distill_teacher_overrides=big, cache_dir=tmp_path / "cache"))


def test_an_image_text_models_vision_tower_is_in_the_steps_flops():
  """The planner's compute left out the views a row's vision tower encodes (max_images_per_row), which train_compile
  and the training metrics count (metrics.vision_tower_flops): a vision-language step was priced as its text alone."""
  from tests.test_flops_hostile import GEMMA3_VISION
  vision = {k: v for k, v in GEMMA3_VISION.items() if k not in ("vocab_size", "base_emb_dim", "print_config")}
  sft = dict(objective="sft", dataset_type="hf", hf_path="x", tokenizer_type="huggingface", tokenizer_path="t",
             eval_interval=-1, **vision)
  _, text = estimate(**sft)
  model, images = estimate(**sft, max_images_per_row=2)
  assert model.images_per_row == 2
  weights, scores = metrics.vision_tower_flops(model.cfg)
  # 4 rows a chip, 2 views each, at forward + backward (the tower trains).
  assert images.flops - text.flops == pytest.approx(4 * 2 * (weights + scores), rel=1e-9)
  peak = accelerators.TPU_GENERATIONS["v5e"].peak_tflops * 1e12
  assert (images.compute_s - text.compute_s) * peak == pytest.approx(images.flops - text.flops, rel=1e-6)
