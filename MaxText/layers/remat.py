"""The jax.checkpoint policy of a remat policy record (MaxText/configuration/remat_policies.py;
ModelConfig.remat resolves `remat_policy` and, for `custom`, its placement keys)."""

from __future__ import annotations

from typing import Callable

import jax

from MaxText.configuration import remat_policies

# jax.checkpoint's `policy` (None: its default, save nothing), or "none": no jax.checkpoint
# around the layer at all.
CheckpointPolicy = Callable[..., bool] | None | str


def checkpoint_policy(policy: remat_policies.RematPolicy | str) -> CheckpointPolicy:
  """jax's policy for a record, or for a fixed policy's name."""
  if isinstance(policy, str):
    assert policy != "custom", "remat_policy=custom places tensors by its keys: pass ModelConfig.remat"
    policy = remat_policies.by_name(policy)
  policies = jax.checkpoint_policies
  if policy.keeps == "everything":
    return "none"
  if policy.keeps == "nothing":
    return policies.nothing_saveable
  if policy.keeps == "dots":
    if policy.offloaded:
      return policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    return policies.checkpoint_dots_with_no_batch_dims
  if policy.offloaded:
    return policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(policy.device), names_which_can_be_offloaded=list(policy.offload),
        offload_src="device", offload_dst="pinned_host")
  return policies.save_only_these_names(*policy.device)
