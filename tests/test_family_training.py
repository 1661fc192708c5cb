"""Every model family trains on the 8-device CPU mesh with its model sharded (fsdp x tensor, plus
the expert axis for the MoE families, through both MoE dispatches) and the losses and gradient
norms equal those of the same run with the model replicated (data parallelism only).

The families come from their tiny reference HF configs (MaxText/families/), so a new family is
covered by adding it there.
"""

from __future__ import annotations

import numpy as np
import pytest

import hf_families as H
import train_utils
from MaxText.configuration.config import Config

STEPS = 2
# Run by default: one dense family with mixed local/global layers (every other family is in the slow run;
# an MoE stack trains sharded by default in tests/layers/test_moe.py, under expert parallelism).
DEFAULT = ("gemma3",)


def _is_moe(keys: dict) -> bool:
  return keys.get("num_experts", 1) > 1


def _config(family: str, **mesh: object) -> Config:
  # Tiny shapes leave some tensors unsplit (Gemma's single KV head over tensor=2, GPT-3's learned
  # positions): allowed here, the test is about equal results, not coverage.
  keys = H.families.family_for_hf_config(H.hf_config(family).to_dict()).model_keys(H.hf_config(family).to_dict())
  return Config.for_testing(**{**keys, "dataset_type": "synthetic", "enable_checkpointing": False,
                               "per_device_batch_size": 1, "max_target_length": H.LENGTH, "dtype": "float32",
                               "print_config": False, "sharding_tolerance": 0.2, **mesh})


def _history(config: Config) -> list[dict]:
  run = train_utils.Run(config)
  return run.train(run.init(), STEPS)[1]


def _cases() -> list:
  cases = []
  for family in H.FAMILIES:
    is_moe = "experts" in str(H.REFERENCE_CONFIGS[family])
    meshes = [{"ici_fsdp_parallelism": 2, "ici_tensor_parallelism": 2, "ici_data_parallelism": -1}]
    if is_moe:  # the expert axis, with each dispatch
      meshes = [{"ici_fsdp_parallelism": 2, "ici_expert_parallelism": 2, "ici_tensor_parallelism": 2,
                 "ici_data_parallelism": -1, "moe_dispatch": dispatch} for dispatch in ("all_to_all", "gather")]
    for mesh in meshes:
      # The default run keeps one dispatch; all-to-all against gather is tests/layers/test_moe_dispatch.py's.
      default = family in DEFAULT and mesh.get("moe_dispatch", "gather") == "gather"
      marks = () if default else (pytest.mark.slow,)
      if family in H.MESH_HANGS:
        marks = (pytest.mark.skip(reason=H.MESH_HANGS[family]),)
      cases.append(pytest.param(family, mesh, marks=marks, id=f"{family}-{mesh.get('moe_dispatch', 'dense')}"))
  return cases


@pytest.mark.parametrize("family, mesh", _cases())
def test_sharded_training_equals_the_replicated_run(family, mesh):
  sharded = _config(family, **mesh)
  shape = dict(sharded.mesh.shape)
  assert shape["fsdp"] == 2 and shape["tensor"] == 2, shape
  if "moe_dispatch" in mesh:
    assert shape["expert"] == 2, shape
  replicated = _config(family, ici_fsdp_parallelism=1, ici_data_parallelism=-1,
                       **{k: v for k, v in mesh.items() if k == "moe_dispatch"})
  ours, reference = _history(sharded), _history(replicated)
  for key in ("loss", "grad_norm"):
    np.testing.assert_allclose([h[key] for h in ours], [h[key] for h in reference], rtol=2e-5, err_msg=key)


@pytest.mark.slow  # DeepSeek's expert-parallel training is itself in the slow run
def test_deepseek3_with_its_mtp_module_trains_sharded_like_replicated():
  mesh = {"ici_fsdp_parallelism": 2, "ici_expert_parallelism": 2, "ici_tensor_parallelism": 2,
          "ici_data_parallelism": -1, "mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.3}
  ours = _history(_config("deepseek3", **mesh))
  reference = _history(_config("deepseek3", ici_fsdp_parallelism=1, ici_data_parallelism=-1, mtp_num_layers=1,
                               mtp_loss_scaling_factor=0.3))
  for key in ("loss", "grad_norm", "mtp_loss"):
    np.testing.assert_allclose([h[key] for h in ours], [h[key] for h in reference], rtol=2e-5, err_msg=key)
