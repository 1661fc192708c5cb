"""Loss, gradients (with accumulation) and the jitted train/eval step factories."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from MaxText import dpo, lora, optimizers, sharding
from MaxText.input_pipeline import Batch
from MaxText.layers import context_parallel
from MaxText.layers.moe import ROUTING_STATS, update_correction_biases
from MaxText.models import ModelSpec, token_loss_sums
from MaxText.train_state import StateSetup, TrainState, reference_of

Metrics = dict[str, jax.Array]


def loss_sums(model: ModelSpec, params: Any, batch: Batch, dropout_rng: jax.Array | None,
              z_loss_multiplier: float, load_balance_loss_weight: float = 0.0,
              for_gradients: bool = False) -> tuple[jax.Array, Metrics]:
  """Summed (not averaged) loss over non-padding targets, so micro-batches add up exactly.

  Returns (cross-entropy sum + z_loss_multiplier * z-loss sum + load_balance_loss_weight * MoE
  load-balancing sum, {xent_sum, z_loss_sum, moe_lb_loss_sum, weight_sum}). The load-balancing loss
  is a per-batch mean, so it enters weighted by the batch's target count (0 for dense models).
  `for_gradients`: the value is about to be differentiated; the 1F1B pipeline schedule then
  computes loss and gradients in its own loop (evaluation runs the plain forward pass).
  """
  cfg = model.cfg
  if for_gradients and cfg.num_pipeline_stages > 1 and cfg.pipeline_schedule == "1f1b":
    return model.apply_pipelined_loss(params, batch, dropout_rng, z_loss_multiplier, load_balance_loss_weight)
  weights_BL = (batch["targets_segmentation"] != 0).astype(jnp.float32)
  # Multi-token prediction is a training objective: evaluation reports the next-token loss only.
  mtp_targets = (batch["targets"], weights_BL) if for_gradients and cfg.mtp_num_layers > 0 else None
  logits_BLV, aux = model.apply_with_aux(params, batch["inputs"], batch["inputs_position"],
                                         batch["inputs_segmentation"], dropout_rng, mtp_targets)
  _, sums = token_loss_sums(logits_BLV, batch["targets"], weights_BL, z_loss_multiplier)
  xent_sum, z_sum = sums["xent_sum"], sums["z_loss_sum"]
  weight_sum = jnp.sum(weights_BL)
  lb_sum = aux.get("moe_lb_loss", jnp.zeros((), jnp.float32)) * weight_sum
  total = xent_sum + z_loss_multiplier * z_sum + load_balance_loss_weight * lb_sum
  stats = {name: aux[name] for name in ROUTING_STATS if name in aux}  # summed over microbatches too
  if mtp_targets is not None:
    # A sum like the others (micro-batches add up); divided by the step's target count, it is
    # λ times the mean over depths of each depth's per-token loss.
    total = total + cfg.mtp_loss_scaling_factor / cfg.mtp_num_layers * aux["mtp_xent_sum"]
    stats.update(mtp_xent_sum=aux["mtp_xent_sum"], mtp_weight_sum=aux["mtp_weight_sum"])
  return total, {"xent_sum": xent_sum, "z_loss_sum": z_sum, "moe_lb_loss_sum": lb_sum, "weight_sum": weight_sum,
                 **stats}


def routing_metrics(sums: Metrics, num_micro: int) -> Metrics:
  """Per-layer routing health from the summed statistics: each a [num_layers] vector (the metric
  writers name its entries per layer). Load = fraction of tokens routed to an expert."""
  if "moe_load" not in sums:
    return {}
  load_NE = sums["moe_load"] / num_micro
  mean_N = jnp.mean(load_NE, axis=-1)
  return {"moe_load_min": jnp.min(load_NE, axis=-1), "moe_load_max": jnp.max(load_NE, axis=-1),
          "moe_load_cv": jnp.std(load_NE, axis=-1) / jnp.maximum(mean_N, 1e-30),
          "moe_dropped_fraction": sums["moe_dropped_fraction"] / num_micro,
          "moe_router_entropy": sums["moe_router_entropy"] / num_micro}


def _split_microbatches(batch: Batch, num_micro: int) -> Batch:
  """[B, ...] → [num_micro, B / num_micro, ...], taking every num_micro-th row so each
  device keeps its own rows (no data movement under batch sharding)."""
  def split(x: jax.Array) -> jax.Array:
    per_micro = x.shape[0] // num_micro
    return jnp.swapaxes(x.reshape((per_micro, num_micro) + x.shape[1:]), 0, 1)
  return jax.tree.map(split, batch)


def step_loss_sums(setup: StateSetup, config, reference: Any, for_gradients: bool = False
                   ) -> Callable[[Any, Batch, jax.Array | None], tuple[jax.Array, Metrics]]:
  """(params, batch, dropout rng) -> (summed loss, sums): next-token cross-entropy, or with use_dpo
  the DPO loss against `reference` (dpo.py)."""
  optim = config.optim
  # Load-balanced context parallelism reorders the batch here, once, before the model: the loss is
  # a sum over tokens (DPO's over each sequence), so it needs no undoing.
  balance = lambda b: context_parallel.balance_batch(b, config.model)  # noqa: E731
  if config.data.use_dpo:
    return lambda p, b, r: dpo.dpo_loss_sums(setup.model, p, reference, balance(b), r, optim.dpo_beta,
                                             optim.dpo_label_smoothing)
  return lambda p, b, r: loss_sums(setup.model, p, balance(b), r, optim.z_loss_multiplier,
                                   config.model.load_balance_loss_weight, for_gradients=for_gradients)


def dpo_reference(config, state: TrainState) -> Any:
  """DPO's frozen reference: the starting weights the state holds, or with LoRA the policy with
  its adapters off (the frozen base, which is the starting model: adapters start with B = 0).
  None outside DPO."""
  if config.data.use_dpo and config.model.lora_rank > 0:
    return lora.adapters_off(state.params)
  return reference_of(state)


def _grads_and_sums(setup: StateSetup, config, params: Any, reference: Any, batch: Batch,
                    dropout_rng: jax.Array | None) -> tuple[Any, Metrics]:
  """Gradients of the trainable parameters (all of them, or with LoRA only the adapters: the
  base weights' gradients are never computed) and the summed metrics."""
  params, frozen = lora.split(params) if config.model.lora_rank > 0 else (params, None)
  full = (lambda p: p) if frozen is None else (lambda p: lora.combine(p, frozen))
  loss_fn = step_loss_sums(setup, config, reference, for_gradients=True)
  grad_fn = jax.grad(lambda p, b, r: loss_fn(full(p), b, r), has_aux=True)
  num_micro = config.optim.gradient_accumulation_steps
  if num_micro == 1:
    return grad_fn(params, batch, dropout_rng)

  micro_batches = _split_microbatches(batch, num_micro)
  rngs = jax.random.split(dropout_rng, num_micro) if dropout_rng is not None else None

  def accumulate(carry: tuple[Any, Metrics], xs: tuple[Batch, Any]) -> tuple[tuple[Any, Metrics], None]:
    grads_acc, sums_acc = carry
    micro_batch, rng = xs
    grads, sums = grad_fn(params, micro_batch, rng)
    grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
    return (grads_acc, jax.tree.map(jnp.add, sums_acc, sums)), None

  zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  first = jax.tree.map(lambda x: x[0], (micro_batches, rngs))
  zero_sums = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(grad_fn, params, *first)[1])
  (grads, sums), _ = jax.lax.scan(accumulate, (zero_grads, zero_sums), (micro_batches, rngs))
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
  return grads, sums


def make_train_step(setup: StateSetup, config) -> Callable[[TrainState, Batch, jax.Array], tuple[TrainState, Metrics]]:
  """The pure step (state, batch, rng) -> (new state, metrics); jit it with `jit_train_step`."""
  schedule = optimizers.learning_rate_schedule(config.optim)
  use_dropout = config.model.dropout_rate > 0
  skip_nonfinite = config.run.skip_nonfinite_steps
  use_dpo = config.data.use_dpo

  def train_step(state: TrainState, batch: Batch, rng: jax.Array,
                 loss_limit: jax.Array | None = None) -> tuple[TrainState, Metrics]:
    """`loss_limit` (with loss_spike_threshold): a step whose loss is above it is not applied."""
    dropout_rng = jax.random.fold_in(rng, state.step) if use_dropout else None
    with sharding.activation_sharding(setup.mesh, config.mesh.logical_axis_rules):
      grads, sums = _grads_and_sums(setup, config, state.params, dpo_reference(config, state), batch, dropout_rng)
    num_tokens = jnp.maximum(sums["weight_sum"], 1.0)
    # The loss is a mean per target token, or with DPO per preference pair.
    divisor = jnp.maximum(sums["pair_count"], 1.0) if use_dpo else num_tokens
    grads = jax.tree.map(lambda g: g / divisor, grads)
    grad_norm = optax.tree.norm(grads)
    opt_state = state.opt_state
    if setup.opt_device_shardings is not None:  # host-offloaded: update on the device, out_shardings store it back
      opt_state = jax.device_put(opt_state, setup.opt_device_shardings)
    old_opt_state = opt_state
    if config.model.lora_rank > 0:
      frozen = lora.split(state.params)[1]
      # The optimizer's frozen branch ignores these zeros; the base weights go back as they were.
      grads = lora.combine(grads, jax.tree.map(jnp.zeros_like, frozen))
      updates, opt_state = setup.optimizer.update(grads, opt_state, state.params)
      params = lora.combine(lora.split(optax.apply_updates(state.params, updates))[0], frozen)
    else:
      updates, opt_state = setup.optimizer.update(grads, opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
    if config.model.moe_score_correction_bias:  # set from the expert load, not by the optimizer (before the
      # non-finite check, which then keeps the old bias too)
      load_NE = sums["moe_load"] / config.optim.gradient_accumulation_steps if "moe_load" in sums else None
      params = update_correction_biases(params, state.params, load_NE, config.model.moe_bias_update_rate)
    loss_sum = sums["dpo_loss_sum" if use_dpo else "xent_sum"]
    loss_metrics = dpo.dpo_metrics(sums) if use_dpo else {"loss": loss_sum / num_tokens,
                                                           "z_loss": sums["z_loss_sum"] / num_tokens}
    loss = loss_metrics["loss"]
    guarded = skip_nonfinite or loss_limit is not None
    if guarded:
      # A skipped step keeps the old parameters and optimizer state (whose own count drives the
      # learning-rate schedule, so later steps are those of a run that never saw this batch);
      # `step` still counts the batch, which keeps checkpoints and data positions in order.
      finite = jnp.isfinite(loss_sum) & jnp.isfinite(grad_norm)
      applied = finite if skip_nonfinite else jnp.bool_(True)
      if loss_limit is not None:  # a non-finite loss is left to skip_nonfinite_steps
        applied &= (loss <= loss_limit) | ~finite
      params, opt_state = jax.tree.map(lambda new, old: jnp.where(applied, new, old), (params, opt_state),
                                       (state.params, old_opt_state))
    metrics = {
        **loss_metrics,
        "grad_norm": grad_norm,
        "param_norm": optax.tree.norm(params),
        "learning_rate": schedule(state.step),
        "num_tokens": sums["weight_sum"],
    }
    if guarded:
      metrics["skipped"] = 1.0 - applied.astype(jnp.float32)
    if loss_limit is not None:
      metrics["loss_limit"] = loss_limit
    if "mtp_xent_sum" in sums:
      metrics["mtp_loss"] = sums["mtp_xent_sum"] / jnp.maximum(sums["mtp_weight_sum"], 1.0)
    if config.model.num_experts > 1 and not use_dpo:  # DPO's loss has no load-balancing term
      metrics["moe_lb_loss"] = sums["moe_lb_loss_sum"] / num_tokens
      metrics.update(routing_metrics(sums, config.optim.gradient_accumulation_steps))
    # dataclasses.replace keeps the state's class, and with it a DPO run's reference, untouched.
    return dataclasses.replace(state, step=state.step + 1, params=params, opt_state=opt_state), metrics

  return train_step


def jit_train_step(setup: StateSetup, config, batch_sharding: Any) -> Callable:
  """jit with explicit shardings; the old state is donated so its buffers are reused."""
  replicated = sharding.replicated(setup.mesh)
  limit = (replicated,) if config.run.loss_spike_threshold > 0 else ()  # the step's loss_limit argument
  return jax.jit(
      make_train_step(setup, config),
      in_shardings=(setup.state_shardings, batch_sharding, replicated, *limit),
      out_shardings=(setup.state_shardings, replicated),
      donate_argnums=(0,),
  )


def make_eval_step(setup: StateSetup, config) -> Callable[[TrainState, Batch], Metrics]:
  """(state, batch) -> the loss sums of the batch (no dropout); the whole state, not only its
  parameters, because DPO also reads the reference."""
  loss_fn = lambda state: step_loss_sums(setup, config, dpo_reference(config, state))

  def eval_step(state: TrainState, batch: Batch) -> Metrics:
    with sharding.activation_sharding(setup.mesh, config.mesh.logical_axis_rules):
      _, sums = loss_fn(state)(state.params, batch, None)
    return sums

  return jax.jit(eval_step)
