"""The remat policies (`remat_policy`): one record each, read by config validation
(model_config), the model's jax.checkpoint policy (layers/remat.py) and the planner's
activation-memory and recompute model (plan_model.py). Free of jax, so the configuration can
import it; layers/remat.py turns a record into jax's policy.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

# What the backward pass finds saved rather than recomputing: nothing, the matmuls without batch
# dimensions (weights × activations), the tensors named by `checkpoint_name` in `names`, or
# everything (no rematerialisation at all).
Keeps = Literal["nothing", "dots", "names", "everything"]
# The widths the planner counts per token and layer, as plan_model._widths names them.
Width = Literal["qkv", "out", "mlp_in", "mlp_out", "attn", "norms", "mlp_act"]

# The attention projections' checkpoint names (layers/linears.DenseGeneral's `tag`).
QKV_PROJ = ("query_proj", "key_proj", "value_proj")
ATTENTION_PROJ = QKV_PROJ + ("out_proj",)


@dataclasses.dataclass(frozen=True)
class RematPolicy:
  name: str
  keeps: Keeps
  names: tuple[str, ...] = ()  # with keeps="names"
  # The kept tensors go to pinned host memory and come back for the backward pass.
  offloaded: bool = False
  # What the planner counts as kept per token and layer besides the layer input (on the host
  # when offloaded), and the share of the forward's matmul FLOPs the backward re-runs.
  saved: tuple[Width, ...] = ()
  recompute: float = 0.0
  searched_by_planner: bool = True

  @property
  def saved_on_device(self) -> tuple[Width, ...]:
    return () if self.offloaded else self.saved

  @property
  def saved_on_host(self) -> tuple[Width, ...]:
    return self.saved if self.offloaded else ()


_MINIMAL: tuple[Width, ...] = ("qkv", "out", "mlp_in", "mlp_out")
_ATTENTION: tuple[Width, ...] = ("qkv", "out")

# In the order the planner searches them (it breaks ties between equal estimates by this order).
REMAT_POLICIES: tuple[RematPolicy, ...] = (
    RematPolicy("full", "nothing", recompute=1 / 3),
    RematPolicy("save_qkv_proj", "names", QKV_PROJ, saved=("qkv",), recompute=0.22),
    RematPolicy("save_dot_except_mlp", "names", ATTENTION_PROJ, saved=_ATTENTION, recompute=0.2),
    RematPolicy("minimal", "dots", saved=_MINIMAL, recompute=0.02),
    RematPolicy("minimal_offloaded", "dots", offloaded=True, saved=_MINIMAL, recompute=0.02),
    RematPolicy("save_dot_except_mlp_offloaded", "names", ATTENTION_PROJ, offloaded=True, saved=_ATTENTION,
                recompute=0.2),
    RematPolicy("none", "everything", saved=_MINIMAL + ("attn", "norms", "mlp_act"), searched_by_planner=False),
)
BY_NAME: dict[str, RematPolicy] = {policy.name: policy for policy in REMAT_POLICIES}
NAMES: tuple[str, ...] = tuple(BY_NAME)


def by_name(name: str) -> RematPolicy:
  return BY_NAME[name]
