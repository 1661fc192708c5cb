"""The jitted train and eval steps: the same code for every objective (objectives/) and every
partition of the parameters into trained and frozen (optimizers.Updater).

One step: loss and gradients of the trainable parameters (accumulated over micro-batches) →
divided by the objective's divisor (with float16 parameters, each micro-batch's loss before it is
differentiated) → the optimizer's update and the model's own post-update rule, kept only if the step is
finite and under the spike limit → metrics.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from MaxText.configuration.config import Config
from MaxText.training import microbatches, optimizers
from MaxText.platform import sharding
from MaxText.input_pipeline.synthetic import Batch
from MaxText.input_pipeline.batch_spec import batch_spec
from MaxText.layers import context_parallel
from MaxText.training.objectives import Objective
from MaxText.training.objectives.base import Params
from MaxText.training.train_state import StateSetup, TrainState

Metrics = dict[str, jax.Array]


def _balanced(config: Config) -> Callable[[Batch], Batch]:
  # Load-balanced context parallelism reorders the batch here, once, before the model: every
  # objective's loss is a sum over tokens or sequences, so it needs no undoing.
  return lambda batch: context_parallel.balance_batch(batch, config.model.attn, config.model.max_target_length)


def _grads_and_sums(setup: StateSetup, objective: Objective, config: Config, params: Params, context: Params | None,
                    batch: Batch, dropout_rng: jax.Array | None) -> tuple[Params, Metrics]:
  """Gradients of the objective's mean loss (its sum over its divisor) for the trainable parameters (the
  partition's: all of them, or with LoRA only the adapters, whose base weights' gradients are never computed)
  and the objective's summed metrics.

  With float16 parameters each micro-batch's summed loss is divided by its own divisor before it is
  differentiated, and the accumulated gradients by the batch's in float32: the gradient of a sum over many
  tokens passes float16's largest value (65504) long before the mean's does. Other dtypes keep the sum's
  gradient (their range holds it), so their results are unchanged."""
  partition = setup.updater.partition
  params, frozen = partition.split(params)
  balance = _balanced(config)
  per_token = any(p.dtype == jnp.float16 for p in jax.tree.leaves(params))

  def loss_and_sums(p: Params, b: Batch, r: jax.Array | None) -> tuple[jax.Array, Metrics]:
    loss, sums = objective.loss_sums(partition.combine(p, frozen), context, balance(b), r)
    return (loss / jax.lax.stop_gradient(objective.divisor(sums)) if per_token else loss), sums

  grad_fn = jax.grad(loss_and_sums, has_aux=True)
  num_micro = config.optim.gradient_accumulation_steps
  if num_micro == 1:
    grads, sums = grad_fn(params, batch, dropout_rng)
    if per_token:  # already the mean's; float32 as the division below gives the other dtypes
      return jax.tree.map(lambda g: g.astype(jnp.float32), grads), sums
    return _divided(grads, objective.divisor(sums)), sums

  micro_batches = microbatches.split(batch, num_micro)
  rngs = jax.random.split(dropout_rng, num_micro) if dropout_rng is not None else None

  def accumulate(carry: tuple[Any, Metrics], xs: tuple[Batch, Any]) -> tuple[tuple[Any, Metrics], None]:
    grads_acc, sums_acc = carry
    micro_batch, rng = xs
    grads, sums = grad_fn(params, micro_batch, rng)
    weight = objective.divisor(sums) if per_token else None  # back to the micro-batch's sum, in float32
    grads_acc = jax.tree.map(lambda a, g: a + (g.astype(jnp.float32) if weight is None else
                                               g.astype(jnp.float32) * weight), grads_acc, grads)
    return (grads_acc, jax.tree.map(jnp.add, sums_acc, sums)), None

  zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  first = jax.tree.map(lambda x: x[0], (micro_batches, rngs))
  zero_sums = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(grad_fn, params, *first)[1])
  (grads, sums), _ = jax.lax.scan(accumulate, (zero_grads, zero_sums), (micro_batches, rngs))
  if per_token:  # divided before any float16 cast: the sum itself may be past float16's range
    return _divided(grads, objective.divisor(sums)), sums
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
  return _divided(grads, objective.divisor(sums)), sums


def _divided(grads: Params, divisor: jax.Array) -> Params:
  """The gradients of a summed loss made the mean's: per target token, per preference pair, ..."""
  return jax.tree.map(lambda g: g / divisor, grads)


def _updates_done(opt_state: optax.OptState, otherwise: jax.Array) -> jax.Array:
  """The optimizer's own update count, which its schedule reads (the step's first update runs at it): a
  skipped step keeps the old state, so after one it is behind the step counter. `otherwise` for a state
  without one."""
  counts = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
  return counts[0][1] if counts else otherwise


def make_train_step(setup: StateSetup, objective: Objective, config: Config
                    ) -> Callable[[TrainState, Batch, jax.Array], tuple[TrainState, Metrics]]:
  """The pure step (state, batch, rng) -> (new state, metrics); jit it with `jit_train_step`."""
  schedule = optimizers.learning_rate_schedule(config.optim)
  use_dropout = config.model.dropout_rate > 0
  skip_nonfinite = config.run.skip_nonfinite_steps
  num_micro = config.optim.gradient_accumulation_steps
  updater = setup.updater

  def update(params: Params, opt_state: optax.OptState, context: Params | None, batch: Batch, dropout_rng: jax.Array | None
             ) -> tuple[Params, Any, Metrics, jax.Array]:
    """One optimizer update: (new params, new optimizer state, the objective's sums, gradient norm)."""
    with sharding.activation_sharding(setup.on_mesh.mesh, config.mesh.logical_axis_rules):
      grads, sums = _grads_and_sums(setup, objective, config, params, context, batch, dropout_rng)
    grad_norm = optax.tree.norm(grads)
    new_params, opt_state = updater.apply(grads, opt_state, params)
    return setup.on_mesh.spec.after_update(new_params, params, sums, num_micro), opt_state, sums, grad_norm

  def updates(params: Params, opt_state: optax.OptState, context: Params | None, batch: Batch, dropout_rng: jax.Array | None
              ) -> tuple[Params, Any, Metrics, jax.Array, jax.Array]:
    """The objective's updates_per_batch updates on one batch: (params, optimizer state, its metrics
    averaged over the updates, mean gradient norm, tokens trained)."""
    with sharding.activation_sharding(setup.on_mesh.mesh, config.mesh.logical_axis_rules):
      batch = objective.prepare_batch(params, context, batch)
    if objective.updates_per_batch == 1:
      params, opt_state, sums, grad_norm = update(params, opt_state, context, batch, dropout_rng)
      return params, opt_state, objective.train_metrics(sums), grad_norm, sums["weight_sum"]

    def one(carry: tuple[Params, Any], index: jax.Array) -> tuple[tuple[Params, Any], tuple[Metrics, jax.Array, jax.Array]]:
      rng = jax.random.fold_in(dropout_rng, index) if dropout_rng is not None else None
      new_params, new_opt_state, sums, grad_norm = update(*carry, context, batch, rng)
      return (new_params, new_opt_state), (objective.train_metrics(sums), grad_norm, sums["weight_sum"])

    (params, opt_state), (metrics, grad_norms, tokens) = jax.lax.scan(
        one, (params, opt_state), jnp.arange(objective.updates_per_batch))
    return params, opt_state, jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics), jnp.mean(grad_norms), jnp.sum(tokens)

  def train_step(state: TrainState, batch: Batch, rng: jax.Array,
                 loss_limit: jax.Array | None = None) -> tuple[TrainState, Metrics]:
    """`loss_limit` (with loss_spike_threshold): a step whose loss is above it is not applied."""
    dropout_rng = jax.random.fold_in(rng, state.step) if use_dropout else None
    old_opt_state = updater.fetch(state.opt_state)
    params, opt_state, loss_metrics, grad_norm, num_tokens = updates(state.params, old_opt_state,
                                                                     objective.context(state), batch, dropout_rng)
    loss = loss_metrics["loss"]
    guarded = skip_nonfinite or loss_limit is not None
    if guarded:
      # A skipped step keeps the old parameters and optimizer state (whose own count drives the
      # learning-rate schedule, so later steps are those of a run that never saw this batch);
      # `step` still counts the batch, which keeps checkpoints and data positions in order.
      finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      applied = finite if skip_nonfinite else jnp.bool_(True)
      if loss_limit is not None:  # a non-finite loss is left to skip_nonfinite_steps
        applied &= (loss <= loss_limit) | ~finite
      params, opt_state = jax.tree.map(lambda new, old: jnp.where(applied, new, old), (params, opt_state),
                                       (state.params, old_opt_state))
    metrics = {
        **loss_metrics,
        "grad_norm": grad_norm,
        "param_norm": optax.tree.norm(params),
        "learning_rate": schedule(_updates_done(old_opt_state, state.step * objective.updates_per_batch)),
        "num_tokens": num_tokens,
    }
    if guarded:
      metrics["skipped"] = 1.0 - applied.astype(jnp.float32)
    if loss_limit is not None:
      metrics["loss_limit"] = loss_limit
    # dataclasses.replace keeps the state's class, and with it the objective's extra state, untouched.
    return dataclasses.replace(state, step=state.step + 1, params=params, opt_state=opt_state), metrics

  return train_step


def _field_shardings(config: Config, batch_sharding: NamedSharding) -> dict[str, NamedSharding]:
  """Each batch field's sharding: rows split like `batch_sharding` whatever the field's rank."""
  spec = batch_spec(config.data, config.distill.top_k_from_files)
  return {name: sharding.for_rank(batch_sharding, x.ndim) for name, x in spec.items()}


def jit_train_step(setup: StateSetup, objective: Objective, config: Config, batch_sharding: NamedSharding
                   ) -> Callable[..., tuple[TrainState, Metrics]]:
  """jit with explicit shardings; the old state is donated so its buffers are reused."""
  replicated = sharding.replicated(setup.on_mesh.mesh)
  limit = (replicated,) if config.run.loss_spike_threshold > 0 else ()  # the step's loss_limit argument
  return jax.jit(
      make_train_step(setup, objective, config),
      in_shardings=(setup.state_shardings, _field_shardings(config, batch_sharding), replicated, *limit),
      out_shardings=(setup.state_shardings, replicated),
      donate_argnums=(0,),
  )


def make_eval_step(setup: StateSetup, objective: Objective, config: Config) -> Callable[[TrainState, Batch], Metrics]:
  """(state, batch) -> the objective's sums for the batch (no dropout); the whole state, not only
  its parameters, because the objective may read more of it (e.g. DPO's reference). With
  gradient_accumulation_steps the batch goes through in the training step's micro-batches, summed: a
  batch sized to fit only as micro-batches (the logits of the whole batch at once) would otherwise
  run out of memory at the first evaluation."""
  balance = _balanced(config)
  num_micro = config.optim.gradient_accumulation_steps

  def eval_step(state: TrainState, batch: Batch) -> Metrics:
    params, context = state.params, objective.context(state)
    sums_of = lambda b: objective.eval_sums(params, context, balance(b))  # noqa: E731
    with sharding.activation_sharding(setup.on_mesh.mesh, config.mesh.logical_axis_rules):
      batch = objective.prepare_batch(params, context, batch)  # on the whole batch, as the train step's
      if num_micro == 1:
        return sums_of(batch)
      micro_batches = microbatches.split(batch, num_micro)
      first = jax.tree.map(lambda x: x[0], micro_batches)
      zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(sums_of, first))
      sums, _ = jax.lax.scan(lambda acc, b: (jax.tree.map(jnp.add, acc, sums_of(b)), None), zero, micro_batches)
      return sums

  return jax.jit(eval_step)
