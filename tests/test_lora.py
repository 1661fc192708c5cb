"""LoRA (MaxText/training/lora.py): logits and merged weights against PEFT on a tiny HF Llama, only the
adapters train (base weights bitwise unchanged, optimizer state for adapters only), adapters
sharded like their base weights, resume and the merged params-only export, bad targets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import models
from MaxText.training import lora, train_state
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from tests import hf_families as hf
from tests.conftest import REPO_ROOT
from tests.train_utils import Run, assert_accumulation_equals_one_big_batch

peft = pytest.importorskip("peft", reason="needs peft (EXTRAS=test bash setup.sh)")

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK, ALPHA = 4, 8.0
# Our projection of each PEFT target in a Llama layer.
OURS = {"q_proj": ("self_attention", "query"), "k_proj": ("self_attention", "key"),
        "v_proj": ("self_attention", "value"), "o_proj": ("self_attention", "out"),
        "gate_proj": ("mlp", "wi_0"), "up_proj": ("mlp", "wi_1"), "down_proj": ("mlp", "wo")}


def _lora_keys(**extra) -> dict:
  return dict(lora_rank=RANK, lora_alpha=ALPHA, lora_target_modules=",".join(ALL_TARGETS), **extra)


def _random_adapters(config: Config, seed: int) -> dict:
  """Our freshly initialised adapters with lora_b made non-zero (a fresh one adds nothing)."""
  adapters = lora.split(jax.device_get(models.build_model_spec(config.model).init_params(jax.random.key(seed))))[0]
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: (0.2 * rng.standard_normal(x.shape)).astype(x.dtype) if path[-1].key == "lora_b" else x,
      adapters)


def _to_peft(dense: dict) -> tuple[np.ndarray, np.ndarray]:
  """Our unrolled adapter (lora_a [in dims..., r], lora_b [r, out dims...]) → PEFT's
  (lora_A.weight [r, in], lora_B.weight [out, r]). Llama's kernels are HF's weights transposed
  and reshaped with no permutation when rope_interleaved is False."""
  a, b = np.asarray(dense["lora_a"]), np.asarray(dense["lora_b"])
  return a.reshape(-1, RANK).T, b.reshape(RANK, -1).T


def test_logits_and_merged_weights_match_peft(tmp_path):
  import torch

  model = hf.build_hf_model("llama3.1")
  base_config = hf.our_config(model, scan_layers=False)
  assert not base_config.model.rope.rope_interleaved
  base = hf.our_params(model, base_config, tmp_path / "base")
  config = hf.our_config(model, scan_layers=False, **_lora_keys())
  adapters = _random_adapters(config, seed=1)
  params = lora.combine(adapters, base)

  peft_model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                          target_modules=list(ALL_TARGETS)))
  with torch.no_grad():
    for i in range(config.model.num_decoder_layers):
      for target, (block, name) in OURS.items():
        group = "self_attn" if block == "self_attention" else "mlp"
        module = peft_model.base_model.model.model.layers[i].get_submodule(f"{group}.{target}")
        assert module.scaling["default"] == ALPHA / RANK  # PEFT's default scaling, the one we match
        a, b = _to_peft(adapters[f"layers_{i}"][block][name])
        module.lora_A["default"].weight.copy_(torch.from_numpy(a.copy()))
        module.lora_B["default"].weight.copy_(torch.from_numpy(b.copy()))
  peft_model.eval()

  tokens = hf.tokens()
  ours = hf.our_logits(config, params, tokens)
  with torch.no_grad():
    theirs = peft_model(torch.tensor(tokens)).logits.float().numpy()
  without = hf.our_logits(base_config, base, tokens)
  assert np.max(np.abs(ours - without)) > 1e-2  # the adapters change the function
  np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=2e-4)

  # Our PEFT-format export, from unrolled and scanned parameters, loads onto the HF base model.
  from MaxText.convert import peft_adapters
  exported = dict(peft_adapters.adapter_tensors(params, config.model))
  scanned_config = hf.our_config(model, scan_layers=True, **_lora_keys())
  scanned = dict(peft_adapters.adapter_tensors(models.stack_layers(params, 2), scanned_config.model))
  assert exported.keys() == scanned.keys() and len(exported) == 2 * 2 * len(ALL_TARGETS)
  for name, tensor in peft_model.state_dict().items():
    if "lora_" in name:
      np.testing.assert_array_equal(exported[name.replace(".default.", ".")], tensor.numpy(), err_msg=name)
      np.testing.assert_array_equal(scanned[name.replace(".default.", ".")], tensor.numpy(), err_msg=name)
  assert sorted(peft_adapters.save(str(tmp_path / "adapter"), params, config.model)) == sorted(ALL_TARGETS)
  loaded = peft.PeftModel.from_pretrained(hf.build_hf_model("llama3.1"), str(tmp_path / "adapter")).eval()
  with torch.no_grad():
    np.testing.assert_allclose(loaded(torch.tensor(tokens)).logits.float().numpy(), ours, atol=2e-4, rtol=2e-4)

  merged_hf = peft_model.merge_and_unload()
  expected = hf.our_params(merged_hf, base_config, tmp_path / "merged")
  merged = jax.device_get(lora.merge(params, ALPHA / RANK))
  assert jax.tree.structure(merged) == jax.tree.structure(expected)
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(merged)[0], jax.tree.leaves(expected)):
    np.testing.assert_allclose(x, y, atol=1e-6, rtol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_fresh_adapters_follow_peft_init_and_leave_the_model_unchanged(tiny_overrides):
  config = Config.for_testing(**tiny_overrides, **_lora_keys(), scan_layers=True)
  spec = models.build_model_spec(config.model)
  params = jax.device_get(spec.init_params(jax.random.key(0)))
  attention = params["layers"]["self_attention"]
  fan_in = {"query": 64, "key": 64, "value": 64, "out": 4 * 16}
  for name, dense in attention.items():
    bound = 1 / np.sqrt(fan_in[name])  # kaiming_uniform(a=sqrt(5)) on a [r, in] weight
    assert np.all(np.abs(dense["lora_a"]) <= bound) and np.std(dense["lora_a"]) > 0.5 * bound / np.sqrt(3)
    assert not np.any(dense["lora_b"])
  tokens = np.random.default_rng(0).integers(0, 128, size=(2, 32))
  base_config = Config.for_testing(**tiny_overrides, scan_layers=True)
  base_logits = hf.our_logits(base_config, lora.split(params)[1], tokens)
  np.testing.assert_array_equal(hf.our_logits(config, params, tokens), base_logits)
  adapted = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.1 if path[-1].key == "lora_b" else x, params)
  assert np.max(np.abs(hf.our_logits(config, adapted, tokens) - base_logits)) > 1e-3
  # adapters_off: the same tree computing the base model (e.g. a DPO reference).
  np.testing.assert_array_equal(hf.our_logits(config, lora.adapters_off(adapted), tokens), base_logits)


def test_only_adapters_train_and_are_sharded_like_their_base_weights(tiny_overrides):
  config = Config.for_testing(**tiny_overrides, **_lora_keys(), dataset_type="synthetic", ici_fsdp_parallelism=2,
                              ici_data_parallelism=-1, learning_rate=1e-2, sharding_tolerance=0.5,
                              skip_nonfinite_steps=False)
  run = Run(config)
  specs = train_state.shardings_summary(run.setup.state_shardings.params)
  for name in ("query", "out"):
    prefix = f"['layers']['self_attention']['{name}']"
    kernel, a, b = specs[prefix + "['kernel']"], specs[prefix + "['lora_a']"], specs[prefix + "['lora_b']"]
    num_in = 2 if name == "out" else 1  # + the layer dim in front
    assert a == kernel[:1 + num_in] + (None,) and b == (kernel[0], None) + kernel[1 + num_in:], (name, kernel, a, b)
  assert any("fsdp" in s for s in specs.values())

  # Per layer: q 64x4 + 4x64, k and v 64x4 + 4x32, o 64x4 + 4x64, gate/up 64x4 + 4x128, down 128x4 + 4x64.
  assert sum(x.size for x in jax.tree.leaves(lora.split(run.setup.abstract_state.params)[0])) == 2 * 4096
  assert run.assembly.lora_description().startswith("lora: 0.01M adapter parameters train (rank 4, alpha 8, on q_proj")
  state = run.init()
  adapters, _ = lora.split(state.params)
  opt_leaves = jax.tree.leaves(state.opt_state)
  # Adam's mu and nu for the adapters only (+ the step counts): no state of a base weight's size.
  assert sum(x.size for x in opt_leaves) == 2 * sum(x.size for x in jax.tree.leaves(adapters)) + 2
  before = jax.device_get(state.params)
  state, history = run.train(state, 4)
  after = jax.device_get(state.params)
  (a0, f0), (a1, f1) = lora.split(before), lora.split(after)
  for x, y in zip(jax.tree.leaves(f0), jax.tree.leaves(f1)):
    assert x.tobytes() == y.tobytes()  # bitwise
  assert all(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a0), jax.tree.leaves(a1)))
  assert all(np.isfinite(h["loss"]) and h["grad_norm"] > 0 for h in history)


@pytest.mark.parametrize("overrides, message", [
    (dict(lora_target_modules="qkv"), "lora_target_modules ['qkv'] names ['qkv'] in this model; valid names: "
     "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"),
    (dict(lora_target_modules="gate_proj", mlp_activations="gelu"), "valid names: q_proj, k_proj, v_proj, o_proj, "
     "up_proj, down_proj"),
    (dict(lora_target_modules="q_proj", attention_type="mla", q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8,
          qk_rope_head_dim=8, v_head_dim=16, base_num_kv_heads=4), "valid names: q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj"),
    (dict(lora_target_modules="q_proj,up_proj", num_experts=4, num_experts_per_tok=2),
     "LoRA on mixture-of-experts MLPs is not supported"),
    (dict(lora_alpha=0.0), "lora_alpha must be a finite float32 number > 0 (the adapters' scale is lora_alpha / "
     "lora_rank), got 0.0"),
    (dict(lora_alpha=float("inf")), "lora_alpha must be a finite float32 number > 0"),  # inf * 0: NaN at step 1
    (dict(lora_alpha=1e39), "lora_alpha must be a finite float32 number > 0"),  # inf gradients at step 1
    (dict(lora_rank=0, lora_peft_export_path="adapter"), "lora_peft_export_path exports LoRA adapters; the model has"),
])
def test_bad_lora_keys_are_config_errors(tiny_overrides, overrides, message):
  with pytest.raises(ConfigError, match=None) as error:
    Config.for_testing(**{**tiny_overrides, **_lora_keys(), **overrides})
  assert message in str(error.value), str(error.value)


def test_targets_naming_nothing_is_one_error_line_and_exit_2(tmp_path):
  command = [sys.executable, "-m", "MaxText.train", "configs/base.yml", "run_name=bad", f"base_output_directory={tmp_path}",
             "dataset_type=synthetic", "steps=1", "lora_rank=4", "lora_target_modules=[attn,mlp]"]
  env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)}
  proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
  assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
  assert "lora_target_modules ['attn', 'mlp'] names ['attn', 'mlp'] in this model; valid names: q_proj" in errors[0]
  assert not (tmp_path / "bad" / "checkpoints").exists()


def test_resume_and_merged_params_only_export(tiny_overrides, tmp_path):
  """A LoRA run's full state (masked optimizer state included) resumes exactly; the params-only
  export is a plain model (no adapter leaves) holding the merged kernels, and a LoRA run started
  from it (load_parameters_path) computes that model with fresh adapters."""
  from MaxText import generate_param_only_checkpoint
  from MaxText.training import params_io, run_start
  from MaxText.run_dir import checkpointing

  values = dict(tiny_overrides, **_lora_keys(), base_output_directory=str(tmp_path), run_name="run", steps=20,
                dataset_type="synthetic", learning_rate=1e-2, sharding_tolerance=0.5)
  config = Config.for_testing(**values)
  run = Run(config)
  checkpoints = checkpointing.RunCheckpoints.for_run(config.checkpoint)
  state, _ = run.train(run.init(), 2)
  checkpoints.save(2, state, run.data.get_state(), {"step": 2})
  checkpoints.wait()
  checkpoints.close()
  uninterrupted, _ = run.train(state, 2)

  fresh = Run(config)
  restored = run_start.initial_state(config, fresh.setup, checkpointing.RunCheckpoints.for_run(config.checkpoint),
                                     fresh.init)
  assert restored.description.startswith("resumed from step 2")
  fresh.data = fresh.assembly.data_iterator(start_step=2)
  checkpointed = jax.device_get(restored.state.params)
  resumed, _ = fresh.train(restored.state, 2)
  for x, y in zip(jax.tree.leaves(jax.device_get(resumed)), jax.tree.leaves(jax.device_get(uninterrupted))):
    np.testing.assert_array_equal(x, y)

  from MaxText.convert import maxtext_to_hf
  from MaxText.errors import UserError
  with pytest.raises(UserError, match="holds LoRA adapters; write a parameters-only checkpoint"):
    maxtext_to_hf._open_checkpoint(str(tmp_path / "run" / "checkpoints"), Config.for_testing(**tiny_overrides))

  # A tool reading the run gets its LoRA keys from the run's config.yml (no lora_* given here).
  from MaxText import startup
  from MaxText.configuration import run_record
  run_record.record_start(config, str(tmp_path / "run"))
  export = str(tmp_path / "export")
  generate_param_only_checkpoint.generate(startup.start(generate_param_only_checkpoint.TOOL, [
      "generate_param_only_checkpoint", "configs/base.yml", "run_name=run", f"base_output_directory={tmp_path}",
      f"param_only_checkpoint_path={export}", f"lora_peft_export_path={tmp_path / 'adapter'}"]).config)
  adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert adapter_config["r"] == RANK and adapter_config["lora_alpha"] == ALPHA
  assert sorted(adapter_config["target_modules"]) == sorted(ALL_TARGETS)
  assert (tmp_path / "adapter" / "adapter_model.safetensors").stat().st_size > 2 * 4096 * 4
  plain_config = Config.for_testing(**tiny_overrides)
  plain_spec = models.build_model_spec(plain_config.model)
  exported = jax.device_get(params_io.load_params(export, plain_spec.abstract_params, jax.tree.map(
      lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), plain_spec.abstract_params)))
  assert not lora.has_adapters(exported)
  expected = jax.device_get(lora.merge(checkpointed, ALPHA / RANK))
  assert jax.tree.structure(exported) == jax.tree.structure(expected)
  for x, y in zip(jax.tree.leaves(exported), jax.tree.leaves(expected)):
    np.testing.assert_allclose(x, y, atol=1e-6, rtol=1e-6)  # jitted vs eager float32 rounding
  tokens = np.random.default_rng(0).integers(0, 128, size=(2, 32))
  merged_logits = hf.our_logits(plain_config, exported, tokens)
  np.testing.assert_allclose(merged_logits, hf.our_logits(config, checkpointed, tokens), atol=1e-4, rtol=1e-4)

  # The run's own checkpoints hold adapters: loading them as parameters is refused (export them first).
  with pytest.raises(UserError, match="holds LoRA adapters, and this run reads base weights only"):
    params_io.load_params(str(tmp_path / "run" / "checkpoints"), plain_spec.abstract_params,
                          models.shard_params_like(plain_spec, run.mesh, plain_config.mesh.logical_axis_rules))

  # So are they for a LoRA run (it would start fresh adapters and take the adapters-off model as its start).
  again = Config.for_testing(**{**values, "run_name": "again", "load_parameters_path": str(tmp_path / "run" / "checkpoints")})
  with pytest.raises(UserError, match="a LoRA run starts fresh adapters on them.*resume their run"):
    run_start.initial_state(again, Run(again).setup, None, lambda: None)

  tuned = Config.for_testing(**{**values, "run_name": "tuned", "load_parameters_path": export})
  tuned_run = Run(tuned)
  start = run_start.initial_state(tuned, tuned_run.setup, None, tuned_run.init)
  assert start.description.startswith(f"loaded parameters from {export}")
  params = jax.device_get(start.state.params)
  lora_b = [x for path, x in jax.tree_util.tree_flatten_with_path(params)[0] if path[-1].key == "lora_b"]
  assert lora_b and not any(np.any(b) for b in lora_b)  # fresh adapters
  np.testing.assert_array_equal(hf.our_logits(tuned, params, tokens), merged_logits)


@pytest.mark.parametrize("family", ["llama3.1", "mistral", "mixtral", "deepseek3", "deepseek2-lite", "gemma", "gemma2",
                                    "gemma3", "gpt3", "gpt_oss", "llama4", "llama4-maverick", "qwen3",
                                    "qwen3_moe"])
@pytest.mark.parametrize("scan_layers", [True, False])
def test_every_family_gets_adapters_on_each_target_named_like_its_base_weight(family, scan_layers):
  from MaxText import families
  from MaxText.configuration.model_checks import MLP_LORA_TARGETS, lora_targets

  hf_config = hf.hf_config(family).to_dict()
  keys = families.family_for_hf_config(hf_config).model_keys(hf_config)
  base = Config.for_testing(**keys, max_target_length=24, print_config=False, scan_layers=scan_layers)
  targets = [t for t in lora_targets(base.values) if base.model.moe.num_experts == 1 or t not in MLP_LORA_TARGETS]
  config = Config.for_testing(**keys, max_target_length=24, print_config=False, scan_layers=scan_layers,
                              lora_rank=2, lora_target_modules=",".join(targets))
  spec = models.build_model_spec(config.model)
  names = dict(jax.tree_util.tree_flatten_with_path(spec.logical_names, is_leaf=lambda x: isinstance(x, tuple))[0])
  adapted = {path[:-1] for path in names if path[-1].key == "lora_a"}
  # Each target is one projection per layer (scanned: per stack, a dense_layers stack included).
  stacks = sum(k in spec.abstract_params for k in models.LAYER_STACKS) if scan_layers else base.model.num_decoder_layers
  assert len(adapted) == len(targets) * stacks, (family, sorted(map(jax.tree_util.keystr, adapted)))
  for dense in adapted:
    kernel, a, b = names[dense + (jax.tree_util.DictKey("kernel"),)], names[dense + (jax.tree_util.DictKey("lora_a"),)], \
        names[dense + (jax.tree_util.DictKey("lora_b"),)]
    num_in = len(a) - 1
    assert a == kernel[:num_in] + (None,), (dense, kernel, a)
    lead = kernel[:1] if scan_layers else ()
    assert b == lead + (None,) + kernel[num_in:], (dense, kernel, b)
  assert spec.abstract_params.keys() == models.build_model_spec(base.model).abstract_params.keys()
  # PEFT-format export: two tensors per adapted projection and layer; GPT-2's fused c_attn and
  # [in, out] Conv1D weights are not a re-layout of our kernels: refused in one line.
  from MaxText.convert import peft_adapters
  from MaxText.errors import UserError
  zeros = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), spec.abstract_params)
  if family == "gpt3":
    with pytest.raises(UserError, match="cannot export the LoRA adapter of transformer.h.0.attn"):
      dict(peft_adapters.adapter_tensors(zeros, config.model))
  else:
    exported = dict(peft_adapters.adapter_tensors(zeros, config.model))
    assert len(exported) == 2 * len(targets) * base.model.num_decoder_layers
    assert {name.split(".")[-3] for name in exported} == set(targets)


@pytest.mark.slow  # a composition (MLA's absorbed decode with adapters): the default run covers each part
def test_mla_decoding_includes_the_adapters():
  """MLA decodes in the absorbed form, reading wkv_b's kernel itself: its adapter must be folded in."""
  from MaxText.platform import sharding
  from MaxText.layers import kv_cache

  tiny_v3 = dict(decoder_block="deepseek3", base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=4, head_dim=12,
                 base_mlp_dim=32, base_num_decoder_layers=2, vocab_size=128, max_target_length=16,
                 per_device_batch_size=1, print_config=False, attention_type="mla", q_lora_rank=24, kv_lora_rank=16,
                 qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, num_experts=4, num_experts_per_tok=2,
                 first_dense_layers=1, dtype="float32", scan_layers=False,
                 lora_rank=2, lora_target_modules="q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj")
  config = Config.for_testing(**tiny_v3)
  spec = models.build_model_spec(config.model)
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.3 if path[-1].key == "lora_b" else x, spec.init_params(jax.random.key(0)))
  tokens = np.random.default_rng(0).integers(0, 128, size=(1, 16))
  full = hf.our_logits(config, params, tokens)
  caches = kv_cache.model_caches(config.model, 1, 16)
  decode = jax.jit(sharding.unsharded()(spec.apply_decode))
  prefill, caches = decode(params, jnp.asarray(tokens[:, :12]), jnp.arange(12)[None], caches)
  step, _ = decode(params, jnp.asarray(tokens[:, 12:13]), jnp.asarray([[12]]), caches)
  np.testing.assert_allclose(np.asarray(prefill[0]), full[0, :12], atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(np.asarray(step[0, 0]), full[0, 12], atol=2e-5, rtol=2e-5)
  off = hf.our_logits(config, lora.adapters_off(params), tokens)
  assert np.max(np.abs(off - full)) > 1e-3


@pytest.mark.slow  # two train.py runs of 40 steps
def test_sft_with_lora_learns_and_leaves_the_base_weights(tmp_path):
  """configs/sft.yml with LoRA from a briefly fine-tuned base: the assistant-token eval loss keeps
  falling, and the base weights in the LoRA run's checkpoint are the loaded ones, bitwise."""
  from MaxText.training import params_io
  from tests.test_sft_train import MODEL, train

  pretrain = tmp_path / "pretrain"
  pretrain.mkdir()
  proc = train(pretrain, "steps=20", "eval_interval=20", "enable_checkpointing=True", "checkpoint_period=20")
  assert proc.returncode == 0, proc.stderr[-3000:]
  eval_losses = lambda run: [json.loads(line)["eval_loss"] for line in (run / "sft" / "metrics.jsonl").read_text()  # noqa: E731
                             .splitlines() if "eval_loss" in line]
  [base_eval] = eval_losses(pretrain)
  base_dir = str(pretrain / "sft" / "checkpoints")
  proc = train(tmp_path, "steps=40", "eval_interval=20", f"load_parameters_path={base_dir}", f"lora_rank={RANK}",
               f"lora_alpha={ALPHA}", f"lora_target_modules={','.join(ALL_TARGETS)}", "learning_rate=1e-2",
               "enable_checkpointing=True", "checkpoint_period=40")
  assert proc.returncode == 0, proc.stderr[-3000:]
  evals = eval_losses(tmp_path)
  assert len(evals) == 2 and evals[1] < evals[0] < base_eval, (base_eval, evals)

  def params(path: str, **lora_keys) -> dict:
    keys = dict(item.split("=", 1) for item in MODEL if item.split("=", 1)[0].startswith(("base_", "head_dim", "vocab")))
    spec = models.build_model_spec(Config.for_testing(**keys, **lora_keys).model)
    one_device = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), spec.abstract_params)
    return jax.device_get(params_io.load_params(path, spec.abstract_params, one_device))

  tuned = params(str(tmp_path / "sft" / "checkpoints"), **_lora_keys())
  start = params(base_dir)
  frozen = lora.split(tuned)[1]
  assert jax.tree.structure(frozen) == jax.tree.structure(start)
  for x, y in zip(jax.tree.leaves(frozen), jax.tree.leaves(start)):
    assert x.tobytes() == y.tobytes()


@pytest.mark.slow  # ~70 s a schedule on 2 shared cores: four steps compiled over 8 devices
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_adapters_under_the_pipeline_match_the_non_pipelined_run(schedule):
  """Adapters are part of the stage-sharded stack: 2 stages give the adapters' gradients and the
  step's parameters of the run without stages (base weights unchanged in both)."""
  from tests.test_pipeline_parallel import _grads_and_step, _model_overrides, _packed_batch

  keys = dict(_model_overrides(2), **_lora_keys(), sharding_tolerance=1.0)
  piped = Config.for_testing(**keys, ici_pipeline_parallelism=2, pipeline_schedule=schedule,
                             num_pipeline_microbatches=4, ici_fsdp_parallelism=1, ici_data_parallelism=4)
  plain = Config.for_testing(**keys)
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.05 if path[-1].key == "lora_b" else x, jax.device_get(Run(plain).init().params))
  batch = _packed_batch(plain.data.global_batch_size, 16, 64)
  want_grads, _, want_metrics, want_params = _grads_and_step(plain, params, batch)
  got_grads, _, got_metrics, got_params = _grads_and_step(piped, params, batch)
  assert not lora.split(got_grads)[1]  # gradients of the adapters only
  close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)  # noqa: E731
  jax.tree.map(close, got_grads, want_grads)
  jax.tree.map(close, got_params, want_params)
  np.testing.assert_allclose(got_metrics["loss"], want_metrics["loss"], rtol=2e-5)
  for x, y in zip(jax.tree.leaves(lora.split(got_params)[1]), jax.tree.leaves(lora.split(params)[1])):
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


@pytest.mark.slow  # ~65 s on 2 shared cores
def test_gradient_accumulation_of_adapters_equals_one_big_batch(tiny_overrides):
  base = dict(tiny_overrides, **_lora_keys(), per_device_batch_size=2, ici_fsdp_parallelism=-1, sharding_tolerance=0.5,
              dataset_type="synthetic", learning_rate=1e-2)
  assert_accumulation_equals_one_big_batch(base, 2)


def test_a_checkpoint_of_another_lora_rank_is_one_line_naming_both(tmp_path: Path) -> None:
  """decode/serve/GRPO given a LoRA checkpoint and a lora_rank other than its adapters' (was: Orbax's "Requested
  shape (2, 32, 4) is not compatible with the stored shape (2, 32, 8) ... set `strict=False`")."""
  from MaxText.errors import UserError
  from MaxText.training import params_io

  tiny = dict(base_emb_dim=32, base_num_query_heads=2, base_num_kv_heads=2, head_dim=16, base_mlp_dim=64,
              base_num_decoder_layers=2, vocab_size=64, max_target_length=16, lora_target_modules="q_proj")
  specs = {r: models.build_model_spec(Config.for_testing(**tiny, lora_rank=r, lora_alpha=8.0).model) for r in (8, 4)}
  params_io.save_params(str(tmp_path / "ckpt"), jax.tree.map(lambda x: np.zeros(x.shape, x.dtype),
                                                             specs[8].abstract_params))
  abstract = specs[4].abstract_params
  shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), abstract)
  with pytest.raises(UserError) as e:
    params_io.load_params(str(tmp_path / "ckpt"), abstract, shardings)
  assert str(e.value) == (f"{tmp_path / 'ckpt'} (parameters-only checkpoint) holds LoRA adapters of rank 8, this "
                          "model's places are of rank 4: set lora_rank=8")
