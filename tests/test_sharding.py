"""Mesh construction, logical→mesh mapping, and numerical agreement across meshes."""

import jax
import numpy as np
import pytest

from MaxText import models
from MaxText.platform import sharding
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from MaxText.training.train_state import shardings_summary
from train_utils import Run, losses

MESHES = {
    "data=8": dict(ici_data_parallelism=8, ici_fsdp_parallelism=1),
    "fsdp=8": dict(ici_fsdp_parallelism=8),
    "fsdp=4,tensor=2": dict(ici_fsdp_parallelism=4, ici_tensor_parallelism=2),
    "data=2,fsdp=2,tensor=2": dict(ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2),
    "autoregressive=2,fsdp=4": dict(ici_autoregressive_parallelism=2, ici_fsdp_parallelism=4),
}
# float32 everywhere; differences come only from the order of cross-device sums.
RTOL = 2e-5


def test_param_shardings_follow_logical_rules(tiny_overrides):
  config = Config.for_testing(**tiny_overrides, **MESHES["fsdp=4,tensor=2"])
  run = Run(config)
  specs = shardings_summary(run.setup.state_shardings.params)
  assert specs["['token_embedder']['embedding']"] == ('tensor', 'fsdp')
  assert specs["['layers']['self_attention']['query']['kernel']"] == (None, 'fsdp', 'tensor', None)
  assert specs["['layers']['self_attention']['out']['kernel']"] == (None, 'tensor', None, 'fsdp')
  assert specs["['layers']['mlp']['wi_0']['kernel']"] == (None, 'fsdp', 'tensor')
  assert specs["['layers']['mlp']['wo']['kernel']"] == (None, 'tensor', 'fsdp')
  assert specs["['logits_dense']['kernel']"] == ('fsdp', 'tensor')
  assert specs["['decoder_norm']['scale']"] == (None,)
  # Adam moments are sharded exactly like the parameters they belong to.
  mu = run.setup.state_shardings.opt_state[1][0].mu
  assert shardings_summary(mu) == specs
  # The state is born sharded: each device holds 1/8 of the query kernel.
  state = run.init()
  query = state.params["layers"]["self_attention"]["query"]["kernel"]
  assert query.addressable_shards[0].data.size == query.size // 8


def test_logical_rules_first_unused_axis_wins_and_unknown_names_fail():
  rules = (("a", ("fsdp",)), ("b", ("fsdp",)), ("b", ("tensor",)), ("c", ()))
  assert sharding.logical_to_mesh_spec(("a", "b", "c"), rules) == jax.sharding.PartitionSpec("fsdp", "tensor", None)
  with pytest.raises(ConfigError, match="logical axis 'zz' has no entry in logical_axis_rules"):
    sharding.logical_to_mesh_spec(("zz",), rules)


def test_too_much_replication_fails_loudly(tiny_overrides):
  # kv_heads=2 cannot be split 8 ways over tensor; with a zero tolerance the run must refuse.
  config = Config.for_testing(**{**tiny_overrides, "ici_fsdp_parallelism": 1, "ici_tensor_parallelism": 8,
                                 "sharding_tolerance": 0.0})
  with pytest.raises(ConfigError, match=r"not fully sharded .*largest: layers/self_attention/out/kernel \[2, 4, 16, "
                                        r"64\] 9.1%, layers/self_attention/query/kernel"):
    Run(config)


def test_lora_adapters_far_above_the_model_widths_are_named_in_the_replication_error(tiny_overrides):
  """lora_rank=1000 on a width-64 model made the adapters a third of the bytes, whole on every device; the
  error blamed the parallelism degrees, and no change to them helps (the rank axis is never split)."""
  config = Config.for_testing(**tiny_overrides, lora_rank=1000, lora_target_modules="q_proj")
  with pytest.raises(ConfigError, match=r"largest: layers/self_attention/query/lora_b \[2, 1000, 4, 16\] 36.9%.*"
                                        r"LoRA adapters \(lora_a, lora_b\) are among them.*: lower lora_rank"):
    Run(config)


def test_loss_agrees_across_meshes(tiny_overrides):
  results = {name: losses(Config.for_testing(**tiny_overrides, **mesh), 3) for name, mesh in MESHES.items()}
  reference = results["data=8"]
  for name, values in results.items():
    np.testing.assert_allclose(values, reference, rtol=RTOL, err_msg=name)


def test_scan_and_unrolled_layers_agree(tiny_overrides):
  scanned = Config.for_testing(**tiny_overrides, scan_layers=True)
  unrolled = Config.for_testing(**tiny_overrides, scan_layers=False)
  params = jax.device_get(Run(scanned).init().params)
  unstacked = models.unstack_layers(params, scanned.model.num_decoder_layers)
  np.testing.assert_allclose(losses(unrolled, 3, unstacked), losses(scanned, 3, params), rtol=RTOL)


# Each policy takes ~25 s on the 2-core CI machine: full and offloaded (the distinct code paths) by default.
@pytest.mark.parametrize("policy", ["full", pytest.param("minimal", marks=pytest.mark.slow),
                                    pytest.param("save_dot_except_mlp", marks=pytest.mark.slow),
                                    pytest.param("save_qkv_proj", marks=pytest.mark.slow), "minimal_offloaded"])
def test_remat_policies_do_not_change_the_math(tiny_overrides, policy):
  reference = losses(Config.for_testing(**tiny_overrides, remat_policy="none"), 3)
  np.testing.assert_allclose(losses(Config.for_testing(**tiny_overrides, remat_policy=policy), 3), reference,
                             rtol=RTOL)


class _FakeDevice:
  """Stands in for a device of a multi-slice TPU job (only what mesh_utils reads)."""

  def __init__(self, index: int, slice_index: int):
    self.id, self.slice_index, self.process_index = index, slice_index, index // 4
    self.platform, self.device_kind, self.coords, self.core_on_chip = "cpu", "fake", (index % 4, 0, 0), 0

  def __repr__(self) -> str:
    return f"D{self.id}/s{self.slice_index}"


def test_two_slices_get_a_hybrid_mesh_with_dcn_across_slices():
  from MaxText.platform.accelerators import DeviceTarget

  target = DeviceTarget(platform="cpu", device_kind="fake", num_devices=8, num_slices=2)
  config = Config.for_testing(target=target, ici_fsdp_parallelism=-1, dcn_data_parallelism=-1, print_config=False)
  assert dict(config.mesh.dcn)["data"] == 2 and dict(config.mesh.ici)["fsdp"] == 4
  devices = [_FakeDevice(i, slice_index=i // 4) for i in range(8)]
  array = sharding.device_array(config.mesh, devices)
  assert array.shape == (2, 1, 4, 1, 1, 1, 1, 1)  # one entry per mesh axis
  # Each data-parallel replica lives entirely inside one slice; fsdp never crosses slices.
  for replica in range(2):
    assert {d.slice_index for d in array[replica].flat} == {replica}


def test_constrain_is_an_explicit_choice_outside_a_mesh():
  """A model call outside activation_sharding loses its sharding: refused, unless unsharded() says so."""
  x = jax.numpy.ones((8, 4))
  with pytest.raises(RuntimeError, match="outside sharding.activation_sharding"):
    sharding.constrain(x, ("activation_batch", "activation_embed"))
  with sharding.unsharded():
    assert sharding.constrain(x, ("activation_batch", "activation_embed")) is x
    assert sharding.current_activation_context() is None
