"""The Optax optimizer and learning-rate schedule built from OptimConfig, and `Updater`: how the
train step applies gradients (which parameters train, where the optimizer state lives)."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from MaxText.configuration.config_groups import OptimConfig
from MaxText.errors import ConfigError
from MaxText.training import muon

HOST_MEMORY_KIND = "pinned_host"

# A nested dict of arrays (or of their shapes or shardings).
Params = dict[str, Any]


def learning_rate_schedule(cfg: OptimConfig) -> optax.Schedule:
  """Linear warmup from 0 to the peak, then cosine decay to `cosine_final_fraction` of it.

  Steps past `schedule_steps` stay at the final value.
  """
  peak = cfg.learning_rate
  decay_steps = max(1, cfg.learning_rate_schedule_steps - cfg.warmup_steps)
  cosine = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.cosine_learning_rate_final_fraction)
  if cfg.warmup_steps == 0:
    return cosine
  warmup = optax.linear_schedule(0.0, peak, cfg.warmup_steps)
  return optax.join_schedules([warmup, cosine], [cfg.warmup_steps])


def scale_by_pax_adam(b1: float, b2: float, eps: float, eps_root: float) -> optax.GradientTransformation:
  """Adam's direction m / (sqrt(v + eps_root) + eps), Pax's way (upstream's opt_type=adam_pax): each moment
  is kept already bias-corrected, updated with the decay b (1 - b^(t-1)) / (1 - b^t) at step t, instead of
  raw moments divided by (1 - b^t) when read. The moments take the gradients' dtype."""

  def corrected(decay: float, count: jax.Array) -> jax.Array:
    t = count.astype(jnp.float32) + 1.0  # in float32 even for bfloat16 moments: decay^t must not round to 1
    return decay * (1.0 - decay ** (t - 1.0)) / (1.0 - decay ** t)

  def init(params: Params) -> optax.ScaleByAdamState:
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=jax.tree.map(jnp.zeros_like, params),
                                  nu=jax.tree.map(jnp.zeros_like, params))

  def update(grads: Params, state: optax.ScaleByAdamState, params: Params | None = None
             ) -> tuple[Params, optax.ScaleByAdamState]:
    del params
    d1, d2 = corrected(b1, state.count), corrected(b2, state.count)

    def moment(decay: jax.Array, g: jax.Array, m: jax.Array) -> jax.Array:
      decay = decay.astype(g.dtype)
      return (1.0 - decay) * g + decay * m

    mu = jax.tree.map(lambda g, m: moment(d1, g, m), grads, state.mu)
    nu = jax.tree.map(lambda g, v: moment(d2, g * g, v), grads, state.nu)
    direction = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + eps_root) + eps), mu, nu)
    return direction, optax.ScaleByAdamState(count=state.count + 1, mu=mu, nu=nu)

  return optax.GradientTransformation(init, update)


def create_optimizer(cfg: OptimConfig, logical_names: Params | None = None) -> optax.GradientTransformation:
  """AdamW; plain SGD (opt_type=sgd); Pax-style Adam (adam_pax); or (muon) Muon on the weight matrices and
  AdamW on the rest, which needs the model's parameter `logical_names` (ModelSpec.logical_names) to tell them
  apart. All under the same schedule and clipping."""
  schedule = learning_rate_schedule(cfg)
  optimizer: optax.GradientTransformation
  if cfg.opt_type == "sgd":  # upstream's: no momentum, no weight decay, no state
    optimizer = optax.sgd(schedule)
  elif cfg.opt_type == "adam_pax":  # decay added to the direction, then both scaled by the learning rate
    optimizer = optax.chain(scale_by_pax_adam(cfg.adam_b1, cfg.adam_b2, cfg.adam_eps, cfg.adam_eps_root),
                            optax.add_decayed_weights(cfg.adam_weight_decay), optax.scale_by_learning_rate(schedule))
  else:
    optimizer = optax.adamw(schedule, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps, eps_root=cfg.adam_eps_root,
                            weight_decay=cfg.adam_weight_decay)
  if cfg.opt_type == "muon":
    if logical_names is None:
      raise ValueError("opt_type=muon needs the parameters' logical names")
    optimizer = muon.muon(cfg, schedule, optimizer, logical_names)
  if cfg.gradient_clipping_threshold > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.gradient_clipping_threshold), optimizer)
  return optimizer


def check_host_memory_kinds(kinds: set[str], platform: str) -> None:
  """One-line error when the backend cannot hold arrays in pinned host memory."""
  if HOST_MEMORY_KIND not in kinds:
    raise ConfigError(
        f"optimizer_memory_host_offload=True needs the {HOST_MEMORY_KIND!r} memory kind, but {platform} devices "
        f"offer {sorted(kinds)}; set optimizer_memory_host_offload=False")


def host_offloaded(opt_shardings: optax.OptState, mesh: Mesh) -> optax.OptState:
  """The same shardings in pinned host memory: optimizer state (AdamW's mu and nu, 2x the
  float32 parameters) then lives in host RAM; the step copies it to the device for the update
  and back (`jax.device_put` inside the jitted step, overlapped by XLA with compute)."""
  device = mesh.devices.flat[0]
  try:
    kinds = {memory.kind for memory in device.addressable_memories()}
  except Exception:  # topology-only devices (AOT compile) have no memories to list; XLA checks at compile
    kinds = {HOST_MEMORY_KIND}
  check_host_memory_kinds(kinds, device.platform)
  return jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY_KIND), opt_shardings,
                      is_leaf=lambda x: isinstance(x, NamedSharding))


class Partition(Protocol):
  """Which parameters train: `split` gives (trainable, frozen) nested dicts with the same nesting,
  `combine` is its inverse. The train step differentiates and updates the trainable part only."""

  # Whether every weight trains (then nothing frozen gives back the starting model).
  trains_everything: bool
  # Whether `base_model` of the parameters computes the starting model (LoRA: the adapters off).
  # Otherwise an objective that needs the starting model keeps a copy, and a fine-tune loads
  # every parameter from its checkpoint (none is new).
  frozen_gives_base_model: bool

  def split(self, params: Params) -> tuple[Params, Params]: ...

  def combine(self, trainable: Params, frozen: Params) -> Params: ...

  def optimizer(self, inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` restricted to the trainable parameters."""
    ...

  def base_model(self, params: Params) -> Params:
    """The starting model's function from the frozen part (e.g. LoRA's adapters off); only
    meaningful when not trains_everything."""
    ...


class TrainAll:
  """The identity partition: every parameter trains; split and combine return the tree itself."""

  trains_everything = True
  frozen_gives_base_model = False

  def split(self, params: Params) -> tuple[Params, Params]:
    return params, {}

  def combine(self, trainable: Params, frozen: Params) -> Params:
    return trainable

  def optimizer(self, inner: optax.GradientTransformation) -> optax.GradientTransformation:
    return inner

  def base_model(self, params: Params) -> Params:
    raise ValueError("every parameter trains: the frozen part does not give the starting model")


class FrozenSubtrees:
  """Named top-level parts of the model stay as loaded (e.g. a vision tower, freeze_vision_encoder):
  no gradients, no optimizer state, no weight decay; everything else trains."""

  trains_everything = False
  frozen_gives_base_model = False

  def __init__(self, names: Sequence[str]):
    self.names = frozenset(names)

  def split(self, params: Params) -> tuple[Params, Params]:
    return ({k: v for k, v in params.items() if k not in self.names},
            {k: v for k, v in params.items() if k in self.names})

  def combine(self, trainable: Params, frozen: Params) -> Params:
    return {**trainable, **frozen}

  def optimizer(self, inner: optax.GradientTransformation) -> optax.GradientTransformation:
    def label(path: tuple[Any, ...], _: object) -> str:
      return "frozen" if path and getattr(path[0], "key", None) in self.names else "train"

    return optax.multi_transform({"train": inner, "frozen": optax.set_to_zero()},
                                 lambda params: jax.tree_util.tree_map_with_path(label, params))

  def base_model(self, params: Params) -> Params:
    raise ValueError("frozen parts alone do not give the starting model: keep a copy of it")


class TrainedSubtrees:
  """Only the subtrees under a key in `names`, wherever it sits in the tree, train (DeepSeek-V3.2's
  dense warm-up: every layer's `indexer`); everything else stays as loaded: no gradients, no
  optimizer state, bitwise unchanged. `unread`: the model's function does not read the trained
  part (the warm-up's dense attention ignores its indexers), so the frozen part alone gives the
  starting model and a load takes only it from the checkpoint, the trained part freshly
  initialised (as LoRA's adapters: a DeepSeek-V3 checkpoint has no indexers)."""

  trains_everything = False

  def __init__(self, names: Sequence[str], unread: bool = False):
    self.names = frozenset(names)
    self.frozen_gives_base_model = unread

  def split(self, params: Params) -> tuple[Params, Params]:
    trained: Params = {}
    frozen: Params = {}
    for key, value in params.items():
      if key in self.names:
        trained[key] = value
      elif isinstance(value, dict):
        t, f = self.split(value)
        if t:
          trained[key] = t
        if f:
          frozen[key] = f
      else:
        frozen[key] = value
    return trained, frozen

  def combine(self, trainable: Params, frozen: Params) -> Params:
    out = dict(frozen)
    for key, value in trainable.items():
      out[key] = value if key in self.names else self.combine(value, frozen.get(key, {}))
    return out

  def optimizer(self, inner: optax.GradientTransformation) -> optax.GradientTransformation:
    def label(path: tuple[Any, ...], _: object) -> str:
      return "train" if any(getattr(key, "key", None) in self.names for key in path) else "frozen"

    return optax.multi_transform({"train": inner, "frozen": optax.set_to_zero()},
                                 lambda params: jax.tree_util.tree_map_with_path(label, params))

  def base_model(self, params: Params) -> Params:
    if not self.frozen_gives_base_model:
      raise ValueError("the trained subtrees' starting values are not kept: keep a copy of the starting model")
    return params


@dataclasses.dataclass(frozen=True)
class Updater:
  """The optimizer as the step uses it, the same code for every run: the trainable part's
  gradients in, the whole parameter tree out (frozen leaves back as they were, bitwise)."""

  transform: optax.GradientTransformation  # already restricted by `partition`
  partition: Partition
  # Device-memory shardings of the optimizer state when the state keeps it in host memory
  # (optimizer_memory_host_offload); None when it lives on the device.
  device_shardings: optax.OptState | None = None

  def fetch(self, opt_state: optax.OptState) -> optax.OptState:
    """The optimizer state where the update runs: a host-offloaded one is copied to the device
    (the step's out_shardings store the new one back)."""
    if self.device_shardings is None:
      return opt_state
    return jax.device_put(opt_state, self.device_shardings)

  def apply(self, grads: Params, opt_state: optax.OptState, params: Params) -> tuple[Params, optax.OptState]:
    """(new parameters, new optimizer state) from the trainable part's gradients."""
    frozen = self.partition.split(params)[1]
    # The transform's frozen branch ignores these zeros; the frozen leaves go back as they were.
    grads = self.partition.combine(grads, jax.tree.map(jnp.zeros_like, frozen))
    updates, opt_state = self.transform.update(grads, opt_state, params)
    new_params = self.partition.combine(self.partition.split(optax.apply_updates(params, updates))[0], frozen)
    return new_params, opt_state
