"""A per_device_batch_size under 1: the rows split over the axes the model splits rows over, the
other data_sharding axes (tensor, sequence) holding the same rows, as upstream MaxText's recipes
(v5p/v5e gpt-3-175b at 0.5 with tensor parallelism, v6e llama3.1-70b at 0.125 with context
parallelism) expect."""

import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from MaxText.input_pipeline import create_data_iterator
from MaxText.input_pipeline.pipeline import HostShard, host_shard
from MaxText.platform import sharding
from MaxText.platform.accelerators import DeviceTarget
from MaxText.training.run_assembly import build_run

# 4 sequences on 8 devices: fsdp=4 splits them, tensor=2 repeats each.
HALF_WITH_TENSOR = dict(per_device_batch_size=0.5, ici_fsdp_parallelism=4, ici_tensor_parallelism=2)


def test_rows_split_over_fsdp_and_repeat_over_tensor(tiny_overrides):
  config = Config.for_testing(**{**tiny_overrides, **HALF_WITH_TENSOR})
  assert config.data.global_batch_size == 4
  assert config.data.batch_axes == ("data", "stage", "fsdp", "fsdp_transpose", "expert", "autoregressive")
  mesh = sharding.create_mesh(config.mesh)
  batch = next(create_data_iterator(config, mesh))
  # Upstream's input sharding for this mesh: rows over fsdp, none over tensor.
  assert {name: x.sharding.spec for name, x in batch.items()} == {name: PartitionSpec("fsdp", None) for name in batch}
  rows = batch["inputs"]
  fsdp = {d: int(np.argwhere(mesh.devices == d)[0][mesh.axis_names.index("fsdp")]) for d in mesh.devices.flat}
  for shard in rows.addressable_shards:
    assert shard.data.shape == (1, 32)
    np.testing.assert_array_equal(shard.data, np.asarray(rows)[fsdp[shard.device]:fsdp[shard.device] + 1])
  # Two simulated hosts (devices 0-3, 4-7) each build their own 2 rows, repeated on their devices.
  on_host = lambda device: int(device.id >= 4)  # noqa: E731
  assert [host_shard(rows.sharding, 4, 32, p, on_host) for p in (0, 1)] == [HostShard(0, 2, 2), HostShard(1, 2, 2)]
  # The activations' rows split the same way, so the step moves no rows between devices.
  activation = sharding.logical_to_mesh_spec(("activation_batch", "activation_length", "activation_embed"),
                                             config.mesh.logical_axis_rules, mesh, (4, 32, 64))
  assert activation[0] == "fsdp"


def test_a_batch_that_divides_every_device_keeps_its_split(tiny_overrides):
  config = Config.for_testing(**{**tiny_overrides, **HALF_WITH_TENSOR, "per_device_batch_size": 1})
  assert config.data.batch_axes == config.mesh.data_sharding


@pytest.mark.parametrize("overrides, message", [
    (dict(HALF_WITH_TENSOR, per_device_batch_size=0.25),
     "global batch 2 (per_device_batch_size 0.25 x 8 devices) must split evenly into gradient_accumulation_steps=1 "
     "micro-batches over the 4 devices that split rows (fsdp=4; rows repeated over tensor=2); set "
     "per_device_batch_size to a multiple of 0.5, or move parallelism from those axes to tensor or sequence"),
    (dict(per_device_batch_size=0.5, ici_fsdp_parallelism=8),
     "global batch 4 (per_device_batch_size 0.5 x 8 devices) must split evenly into gradient_accumulation_steps=1 "
     "micro-batches over the 8 devices of data_sharding (fsdp=8); set per_device_batch_size to a multiple of 1"),
    # The advice also splits each step into the pipeline's 4 microbatches over fsdp=4 (16 rows, not 8: its
    # "multiple of 1" met the pipeline check next)
    (dict(per_device_batch_size=0.5, ici_pipeline_parallelism=2, ici_fsdp_parallelism=4, num_pipeline_microbatches=4),
     "over the 8 devices of data_sharding (stage=2, fsdp=4); set per_device_batch_size to a multiple of 2, or move"),
    (dict(per_device_batch_size=1.5, ici_pipeline_parallelism=2, ici_fsdp_parallelism=4, num_pipeline_microbatches=4,
          gradient_accumulation_steps=3), "set per_device_batch_size to a multiple of 6, or move"),
], ids=["rows_repeated_over_tensor", "no_axis_to_repeat_over", "pipeline_microbatches", "pipeline_and_accumulation"])
def test_a_batch_that_cannot_split_is_one_line_naming_the_numbers(tiny_overrides, overrides, message):
  with pytest.raises(ConfigError) as raised:
    Config.for_testing(**{**tiny_overrides, **overrides})
  assert message in str(raised.value) and "\n" not in str(raised.value)
  advised = re.search(r"a multiple of ([\d.]+)", str(raised.value))
  if advised:  # following the advice gives a batch that loads
    Config.for_testing(**{**tiny_overrides, **overrides, "per_device_batch_size": float(advised.group(1))})


def test_a_batch_of_2_31_tokens_or_more_is_one_line(tiny_overrides):
  """1e20 sequences per device passed validation and failed in the first step's data with a traceback."""
  with pytest.raises(ConfigError, match=r"^per_device_batch_size 1e\+20 x 8 devices x max_target_length 32 = 2.56e\+22 "
                                        r"tokens per step, over the 2\*\*31 this project accepts: lower per_device_batch_size$"):
    Config.for_testing(**{**tiny_overrides, "per_device_batch_size": 1e20})
  with pytest.raises(ConfigError, match=r"= 2.15e\+09 tokens per step"):
    Config.for_testing(**{**tiny_overrides, "per_device_batch_size": 2**23, "max_target_length": 32})
  Config.for_testing(**{**tiny_overrides, "per_device_batch_size": 2**23 - 1, "max_target_length": 32})


# 8 sequences, 2 pipeline stages of 4 devices on tensor: each microbatch's 2 rows repeated over tensor.
PIPELINED_OVER_TENSOR = dict(ici_pipeline_parallelism=2, ici_tensor_parallelism=4, num_pipeline_microbatches=4)


def test_pipeline_microbatches_split_over_the_axes_that_split_rows(tiny_overrides):
  config = Config.for_testing(**{**tiny_overrides, **PIPELINED_OVER_TENSOR})
  assert config.data.batch_axes == ("data", "stage", "fsdp", "fsdp_transpose", "expert", "autoregressive")
  assert config.model.pipeline.num_pipeline_microbatches == 4


def test_pipeline_microbatches_that_cannot_split_are_one_line_naming_the_numbers(tiny_overrides):
  with pytest.raises(ConfigError) as raised:
    Config.for_testing(**{**tiny_overrides, "per_device_batch_size": 0.5, "ici_pipeline_parallelism": 2,
                          "ici_fsdp_parallelism": 2, "ici_tensor_parallelism": 2, "num_pipeline_microbatches": 4})
  assert str(raised.value) == (
      "the batch of 4 sequences per gradient-accumulation step must split into num_pipeline_microbatches=4 "
      "microbatches, each split over the 2 devices that split rows (fsdp=2; rows repeated over tensor=2); make the "
      "global batch 4 (per_device_batch_size x devices) a multiple of 8, or change num_pipeline_microbatches")


def _train(config: Config, devices: list, steps: int) -> tuple[list[float], dict]:
  run = build_run(config, devices=devices)
  data, state, rng = run.data_iterator(), run.init_state(), jax.random.key(config.run.init_weights_seed)
  losses = []
  for _ in range(steps):
    state, metrics = run.train_step(state, next(data), rng)
    losses.append(float(jax.device_get(metrics["loss"])))
  return losses, jax.device_get(state.params)


@pytest.mark.slow
def test_half_a_sequence_per_device_trains_like_the_same_batch_on_fewer_devices(tiny_overrides):
  """4 sequences on 8 devices, each repeated over tensor=2 or sequence=2, against the same 4 on
  4 devices, one each: the same losses and parameters."""
  devices = jax.devices()
  four = DeviceTarget(platform="cpu", device_kind=devices[0].device_kind, num_devices=4)
  whole = Config.for_testing(**{**tiny_overrides, "per_device_batch_size": 1, "ici_fsdp_parallelism": 4},
                             target=four)
  reference_losses, reference_params = _train(whole, devices[:4], 3)
  for repeated in ("ici_tensor_parallelism", "ici_sequence_parallelism"):
    fractional = Config.for_testing(**{**tiny_overrides, "per_device_batch_size": 0.5, "ici_fsdp_parallelism": 4,
                                       repeated: 2})
    losses, params = _train(fractional, devices, 3)
    np.testing.assert_allclose(losses, reference_losses, rtol=2e-6, err_msg=repeated)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=repeated), params,
                 reference_params)


@pytest.mark.slow
def test_pipeline_microbatches_repeated_over_tensor_train_like_the_same_batch_unpipelined(tiny_overrides):
  """8 sequences in 4 microbatches through 2 stages, each microbatch on 4 devices of tensor, against
  the same 8 on 8 devices of fsdp: the same losses."""
  whole = Config.for_testing(**{**tiny_overrides, "ici_fsdp_parallelism": 8})
  reference_losses, _ = _train(whole, jax.devices(), 2)
  # tensor=4 leaves the tiny model's norms whole: allowed, the batch is the point here.
  pipelined = Config.for_testing(**{**tiny_overrides, **PIPELINED_OVER_TENSOR, "sharding_tolerance": 1.0})
  losses, _ = _train(pipelined, jax.devices(), 2)
  np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
