"""The jax.checkpoint policy of a remat policy record (MaxText/configuration/remat_policies.py;
ModelConfig.remat resolves `remat_policy` and, for `custom`, its placement keys)."""

from __future__ import annotations

from typing import Any, Callable

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
  if policy.keeps == "dots":  # the dots without batch dimensions, and the named tensors beside them
    dots = policies.checkpoint_dots_with_no_batch_dims
    if policy.offloaded:
      offload_dots = policies.offload_dot_with_no_batch_dims("device", "pinned_host")
      offload_names = _names_policy(policy)

      def either(prim: Any, *args: Any, **params: Any) -> Any:
        return (offload_dots if dots(prim, *args, **params) else offload_names)(prim, *args, **params)
      return either
    return policies.save_from_both_policies(dots, policies.save_only_these_names(*policy.device))
  if policy.offloaded:
    return _names_policy(policy)
  return policies.save_only_these_names(*policy.device)


def _names_policy(policy: remat_policies.RematPolicy) -> Callable[..., Any]:
  return jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=list(policy.device), names_which_can_be_offloaded=list(policy.offload),
      offload_src="device", offload_dst="pinned_host")
