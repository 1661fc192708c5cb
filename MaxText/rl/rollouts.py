"""On-policy batches for GRPO: each step's prompts, completions sampled from the current
parameters by the project's decode engine, their rewards and group-normalised advantages.

    prompts (rl/prompts.py) ─► Engine.prefill_insert + generate, on the run's mesh, from
    state.params (no copy, no host round trip) ─► completions ─► rewards (rl/rewards.py) ─►
    advantages ─► rows [prompt + completion] with the completion's targets weighted

The engine is built once on the train mesh with the train logical-axis rules, so the parameters
the step just wrote are the engine's input as they are: no weights move between the two phases;
only the KV cache (slots = the global batch, max_target_length positions) is allocated per
rollout. Completions end at the tokenizer's end-of-sequence token (kept, as decode keeps it) or
at max_completion_length (counted as truncated).

Every process samples the whole batch (the same prompts, seeds and parameters give the same
tokens) and scores it, so the rewards need no gathering; each then hands its devices their rows.
A resumed run samples exactly as the uninterrupted one: the prompt position is the checkpointed
data state, and every row's sampler seed comes from decode_sampling_seed, the step and the row.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from MaxText.configuration.config import Config
from MaxText.errors import UserError
from MaxText.inference import engine_api, quantized_weights, sampling
from MaxText.inference.engine import Engine
from MaxText.inference.engine_api import DecodeEngine
from MaxText.input_pipeline import chat
from MaxText.input_pipeline.batch_spec import ADVANTAGES, FIELDS, SAMPLER_LOGPS
from MaxText.platform import sharding
from MaxText.rl import episodes as episodes_lib
from MaxText.rl import interleaved_episodes
from MaxText.rl import prompts as prompts_lib
from MaxText.rl import rewards as rewards_lib
from MaxText.rl import rollout_mesh
from MaxText.training import health, lora
from MaxText.training.train_state import TrainState

Batch = dict[str, jax.Array]


def _global(value: np.ndarray, where: NamedSharding) -> jax.Array:
  """A global array from the whole value, which every process holds."""
  return jax.make_array_from_callback(value.shape, where, lambda index: value[index])


def generate(engine: DecodeEngine, params: Any, rows: list[list[int]], row_params: list[sampling.RowParams],
             max_new_tokens: int, eos_id: int | None) -> list[list[int]]:
  """Each row's completion: sampled tokens up to and including eos_id, at most max_new_tokens."""
  return generate_scored(engine, params, rows, row_params, max_new_tokens, eos_id)[0]


def generate_scored(engine: DecodeEngine, params: Any, rows: list[list[int]], row_params: list[sampling.RowParams],
                    max_new_tokens: int, eos_id: int | None) -> tuple[list[list[int]], list[list[float]]]:
  """(each row's completion as `generate` gives it, the engine's log-probability of each of its
  tokens: TokenLogprobs.chosen_B, the model's distribution at temperature 1 as the engine computes
  it). All rows share one decode state (one slot per row) and stop together when every row is done; a
  row whose cache fills first ends there, with fewer than max_new_tokens."""
  # A row ends where its slot's cache does (max_target_length + 1 tokens: the last needs no entry), as a
  # served request ends by length: a slot whose cache is full emits nothing more, so waiting for it would
  # never end (several steps per call), or would read tokens past its cache (one step per call).
  caps = [min(max_new_tokens, engine.cfg.max_target_length + 1 - len(prompt)) for prompt in rows]
  state = engine.init_decode_state(row_params[0].seed if row_params else 0)
  # Row i into slot i: one device call where the engine prefills into slots, else prefill then insert.
  state, prefix = engine_api.prefill_into_slots(engine, params, state, rows, list(range(len(rows))), row_params)
  outputs = [[int(t)] for t in sharding.on_host(prefix.first_tokens_B)]
  logps = [[float(p)] for p in sharding.on_host(prefix.first_logprobs.chosen_B)]
  done = [cap <= 1 or out[-1] == eos_id for cap, out in zip(caps, outputs)]
  while not all(done):
    state, emitted = engine.decode_step(params, state)
    emitted = dataclasses.replace(emitted, tokens=sharding.on_host(emitted.tokens),
                                  counts=None if emitted.counts is None else sharding.on_host(emitted.counts))
    chosen = sharding.on_host(emitted.logprobs.chosen_B)
    for row, out in enumerate(outputs):
      for i in range(emitted.count(row)):
        if done[row]:
          break
        out.append(emitted.token(row, i))
        logps[row].append(float(chosen[row] if emitted.counts is None else chosen[row, i]))
        done[row] = len(out) >= caps[row] or out[-1] == eos_id
  return outputs, logps


def padded_generate(engine: DecodeEngine, params: Any, eos_id: int | None) -> episodes_lib.Generate:
  """`generate_scored` on every slot of `engine` (the rows given, then copies of the first): one
  prefill shape whatever the number of open episodes, so one compilation."""
  def run(rows: list[list[int]], row_params: list[sampling.RowParams], max_new_tokens: int
          ) -> tuple[list[list[int]], list[list[float]]]:
    pad = engine.num_slots - len(rows)
    out, logps = generate_scored(engine, params, rows + [rows[0]] * pad, row_params + [row_params[0]] * pad,
                                 max_new_tokens, eos_id)
    return out[:len(rows)], logps[:len(rows)]
  return run


def training_rows(prompt_ids: list[list[int]], completions: list[list[int]], length: int,
                  logps: list[list[float]] | None = None,
                  model_masks: list[list[bool]] | None = None) -> dict[str, np.ndarray]:
  """[rows, length] int32 fields of batch_spec.FIELDS: each row is one prompt + completion; the
  targets that are completion tokens carry weight (targets_segmentation 1), the prompt's none.
  float32 SAMPLER_LOGPS: `logps` (the engine's, per completion token) at those targets, NaN there
  without them (not known: weight 1, as TRL treats a token vLLM could not score), 0 elsewhere.
  `model_masks` (an episode's, per completion token): only the tokens the model sampled carry
  weight; the environment's are context alone, out of the loss and the KL (SAMPLER_LOGPS 0)."""
  num_rows = len(prompt_ids)
  out = {name: np.zeros((num_rows, length), np.int32) for name in FIELDS}
  out[SAMPLER_LOGPS] = np.zeros((num_rows, length), np.float32)
  for row, (prompt, completion) in enumerate(zip(prompt_ids, completions)):
    sequence = prompt + completion
    n = len(sequence) - 1  # (input, target) pairs
    assert n <= length, f"row {row}: {len(sequence)} tokens exceed max_target_length + 1"
    out["inputs"][row, :n] = sequence[:-1]
    out["targets"][row, :n] = sequence[1:]
    out["inputs_position"][row, :n] = np.arange(n)
    out["inputs_segmentation"][row, :n] = 1
    out["targets_segmentation"][row, len(prompt) - 1:n] = 1
    out[SAMPLER_LOGPS][row, len(prompt) - 1:n] = np.nan if logps is None else logps[row]
    if model_masks is not None:
      sampled = np.asarray(model_masks[row], bool)
      out["targets_segmentation"][row, len(prompt) - 1:n] = sampled
      out[SAMPLER_LOGPS][row, len(prompt) - 1:n] *= sampled
  return out


class RolloutBatches:
  """The train data of a GRPO run: `next_for(state)` samples a batch from `state`'s parameters and
  returns it with the rollout's host-side metrics; get_state/set_state hold the prompt position."""

  def __init__(self, config: Config, mesh: Mesh, batch_sharding: NamedSharding):
    self.config, self.rl = config, config.rl
    self.num_rows = config.data.global_batch_size
    self.group = self.rl.num_generations
    self.tokenizer = chat.load_chat_tokenizer(config.data.tokenizer_path, require_template=False)
    self.eos_id = self.tokenizer.eos_token_id
    self.rewards = rewards_lib.RewardSet(self.rl, self.eos_id)
    # Multi-turn episodes (rl/episodes.py) with rl_environment.
    self.environment = episodes_lib.environment_for(self.rl) if self.rl.rl_environment else None
    if self.environment is not None and not self.tokenizer.chat_template:
      raise chat.no_template(config.data.tokenizer_path, f"rl_environment={self.rl.rl_environment}")
    self.limits = episodes_lib.Limits.of(self.rl, config.decode.max_prefill_predict_length,
                                         config.data.max_target_length)
    self.prompts = prompts_lib.PromptSet(config, self.tokenizer)
    self.sharding = batch_sharding
    rollout_devices = rollout_mesh.split_devices(config)[1]
    on_own_mesh = bool(rollout_devices)
    self.engine = Engine(config, num_slots=self.num_rows,
                         mesh=rollout_mesh.rollout_mesh(config, rollout_devices) if on_own_mesh else mesh)
    # LoRA: the base model never changes, so it moves (and is converted) once; the adapters at every copy.
    self.weights = rollout_mesh.WeightSync(self.engine.param_shardings if on_own_mesh else None,
                                           self.rl.rl_weight_sync_interval,
                                           prepare=quantized_weights.rollout_preparer(config, self.engine.param_shardings),
                                           frozen=lora.AdapterPartition() if config.model.lora.lora_rank else None)
    self._primed: tuple[int, Batch, dict[str, float]] | None = None
    self.clock = rollout_mesh.IdleClock()  # each side's idle share, a metric of every step
    # rl_weight_sync_interval > 1 on a rollout mesh: each copy's batches are made ahead (rollout_mesh.py)
    self.ahead: rollout_mesh.RunAhead[tuple[Batch, dict[str, float]]] | None = \
        rollout_mesh.RunAhead(clock=self.clock) if on_own_mesh and self.rl.rl_weight_sync_interval > 1 else None
    # Made ahead, not trained on yet (step -> {"completions", "sampler_logps"} or, with an environment,
    # {"episodes"}, and "policy_lag"): a checkpoint keeps them (JSON), since the weight copy they sampled
    # from is not in it; `_replay` holds those a resume read back.
    self._made: dict[int, dict[str, Any]] = {}
    self._replay: dict[int, dict[str, Any]] = {}

  # ---------------------------------------------------------------- the data-iterator surface
  def next_for(self, state: TrainState) -> tuple[Batch, dict[str, float]]:
    started = time.perf_counter()
    batch, scalars = self._next_batch(state)
    return batch, {**scalars, **self.clock.handed(time.perf_counter() - started)}

  def _next_batch(self, state: TrainState) -> tuple[Batch, dict[str, float]]:
    step = int(state.step)
    if self._primed is not None and self._primed[0] == step:
      _, batch, scalars = self._primed
      self._primed = None
      return batch, scalars
    if self.ahead is not None:
      return self._from_ahead(state.params, step, health.unguarded)
    batch, scalars = self._rollout(state.params, step, health.unguarded)
    self.clock.add(scalars.get("rollout_s", 0.0) + scalars.get("reward_s", 0.0))
    return batch, scalars

  def prime(self, state: TrainState, guard: health.Guard | None = None) -> None:
    """Samples the first batch now, so a reward function that fails or a prompt the engine refuses
    stops the run before it writes anything; `next_for` at the same step returns it. Its scoring
    runs inside `guard` (the hang watchdog's): generating compiles the engine, which is no hang."""
    step = int(state.step)
    batch, scalars = (self._rollout if self.ahead is None else self._from_ahead)(state.params, step,
                                                                                  guard or health.unguarded)
    self._primed = (step, batch, scalars)

  def get_state(self) -> dict[str, Any]:
    ahead = int(self._primed is not None) + (len(self.ahead.pending) if self.ahead is not None else 0)
    if not ahead:
      return self.prompts.get_state()
    # Sampled (or queued) ahead, not trained on yet: a resume takes their prompts again.
    state: dict[str, Any] = {"prompts_taken": self.prompts.position - ahead * (self.num_rows // self.group)}
    if self.ahead is not None:  # ... and trains on these completions: their weight copy is gone
      for future in list(self.ahead.pending.values()):
        future.exception()  # made to the end (a failure is raised when its step takes it)
      state["queued"] = {str(t): made for t, made in sorted(self._made.items())}
    return state

  def set_state(self, state: Mapping[str, Any]) -> None:
    self.prompts.set_state(state)
    self._primed = None
    if self.ahead is not None:
      self.ahead.clear()
      self._made.clear()
    self._replay = {int(t): dict(q) for t, q in state.get("queued", {}).items()}

  def _from_ahead(self, params: Any, step: int, guard: health.Guard) -> tuple[Batch, dict[str, float]]:
    """The batch of `step` from the worker. At a copy step (or a process's first rollout) the copy is
    made here and every batch up to the next copy queued: they sample from that copy alone."""
    assert self.ahead is not None
    if not self.ahead.has(step) and step in self._replay:  # a resume's queued batches, as they were made
      for t in sorted(t for t in self._replay if t >= step):
        made = self._replay.pop(t)
        self.ahead.submit(t, functools.partial(self._rollout, None, t, guard if t == step else health.unguarded,
                                               self.prompts.take(self.num_rows // self.group),
                                               {**rollout_mesh.NO_COPY, "policy_lag": float(made["policy_lag"])}, made))
    if not self.ahead.has(step):
      interval = self.rl.rl_weight_sync_interval
      if step % interval:
        print(f"warning: resumed at step {step}, between two weight copies (rl_weight_sync_interval={interval}) with "
              f"no batch made ahead in the checkpoint: until step {self.weights.next_copy(step)} the rollouts sample "
              "from this step's weights, not the last copy's", file=sys.stderr, flush=True)
      copy, synced = self.weights.for_step(params, step)
      for t in range(step, max(step + 1, min(self.weights.next_copy(step), self.config.run.steps))):
        group = self.prompts.take(self.num_rows // self.group)
        scalars = synced if t == step else {**rollout_mesh.NO_COPY, "policy_lag": float(t - step)}
        self.ahead.submit(t, functools.partial(self._rollout, copy, t, guard if t == step else health.unguarded,
                                               group, scalars))
    batch = self.ahead.result(step)
    self._made.pop(step, None)
    return batch

  # ---------------------------------------------------------------- one rollout
  def _row_params(self, step: int, turn: int = 0) -> list[sampling.RowParams]:
    """Every row's sampler at `step` (and an episode's later `turn`: seeds of their own)."""
    entropy = [self.config.decode.decode_sampling_seed, step] + ([turn] if turn else [])
    seeds = np.random.SeedSequence(entropy).generate_state(self.num_rows)
    rl = self.rl
    return [sampling.RowParams(rl.rl_sampling_temperature, rl.rl_sampling_top_p, rl.rl_sampling_top_k, int(seed))
            for seed in seeds]

  def _rollout(self, params: Any, step: int, guard: health.Guard, group: list[prompts_lib.Prompt] | None = None,
               sync_scalars: dict[str, float] | None = None,
               replay: dict[str, Any] | None = None) -> tuple[Batch, dict[str, float]]:
    jax.block_until_ready(params)  # the previous step's update is not the rollout's time
    if sync_scalars is None:  # else `params` is the rollout mesh's copy, made by _from_ahead
      params, sync_scalars = self.weights.for_step(params, step)
    started = time.perf_counter()
    group = self.prompts.take(self.num_rows // self.group) if group is None else group
    row_prompts = [p for p in group for _ in range(self.group)]
    if self.environment is not None:
      return self._episodes(params, step, guard, group, row_prompts, sync_scalars, started, replay)
    if replay is None:
      completions, sampler_logps = generate_scored(self.engine, params, [p.ids for p in row_prompts],
                                                   self._row_params(step), self.rl.max_completion_length, self.eos_id)
    else:  # made before a resume, from a weight copy the checkpoint does not hold
      completions, sampler_logps = replay["completions"], replay["sampler_logps"]
    if self.ahead is not None:
      self._made[step] = {"completions": completions, "sampler_logps": sampler_logps,
                          "policy_lag": sync_scalars.get("policy_lag", 0.0)}
    rollout_s = time.perf_counter() - started
    texts = [self.tokenizer.decode(c[:-1] if c and c[-1] == self.eos_id else c, skip_special_tokens=True)
             for c in completions]
    # The rows first: nothing the reward functions do reaches what is trained (they get copies too).
    rows = training_rows([p.ids for p in row_prompts], completions, self.config.data.max_target_length,
                         sampler_logps)
    with guard("the first rollout's reward functions"):
      scores = self.rewards.score([p.prompt for p in row_prompts], texts, completions,
                                  prompts_lib.columns_of(group, self.group), [p.index for p in row_prompts])
    advantages, group_std = rewards_lib.advantages(scores.total, self.group, self.rl.grpo_scale_rewards,
                                                   self.rewards.names)
    rows[ADVANTAGES] = advantages.astype(np.float32)
    batch: Batch = {name: _global(value, sharding.for_rank(self.sharding, value.ndim)) for name, value in rows.items()}
    lengths = np.asarray([len(c) for c in completions])
    ended = np.asarray([bool(c) and c[-1] == self.eos_id for c in completions])
    scalars = {**rewards_lib.reward_metrics(scores, group_std, advantages),
               "completions/mean_length": float(lengths.mean()), "completions/max_length": float(lengths.max()),
               "completions/min_length": float(lengths.min()), "completions/clipped_ratio": float(1 - ended.mean()),
               "rollout_s": rollout_s, "rollout_tokens_per_s": float(lengths.sum() / max(rollout_s, 1e-9)),
               "reward_s": time.perf_counter() - started - rollout_s, **sync_scalars}
    return batch, scalars

  def _episodes(self, params: Any, step: int, guard: health.Guard, group: list[prompts_lib.Prompt],
                row_prompts: list[prompts_lib.Prompt], sync_scalars: dict[str, float], started: float,
                replay: dict[str, Any] | None = None) -> tuple[Batch, dict[str, float]]:
    """`_rollout` with an environment: one multi-turn episode per row, rewarded by the environment
    (and the reward functions, which see each episode's last model turn as its completion)."""
    assert self.environment is not None
    timing = episodes_lib.Timing()
    records = [(p.index, p.prompt, p.columns) for p in row_prompts]
    with guard("the first rollout's environment"):
      if replay is not None:  # made before a resume, from a weight copy the checkpoint does not hold
        episodes = [episodes_lib.Episode(**e) for e in replay["episodes"]]
      elif self.rl.rl_interleave_episodes:
        episodes = interleaved_episodes.run(self.environment, self.tokenizer, self.eos_id, records, self.engine,
                                            params, functools.partial(self._row_params, step), self.limits, timing)
      else:
        episodes = episodes_lib.run(self.environment, self.tokenizer, self.eos_id, records,
                                    padded_generate(self.engine, params, self.eos_id),
                                    functools.partial(self._row_params, step), self.limits, timing)
    rollout_s = time.perf_counter() - started
    if self.ahead is not None:
      self._made[step] = {"episodes": [dataclasses.asdict(e) for e in episodes],
                          "policy_lag": sync_scalars.get("policy_lag", 0.0)}
    rows = training_rows([e.prompt_ids for e in episodes], [e.tokens for e in episodes],
                         self.config.data.max_target_length, [e.logps for e in episodes],
                         [e.model_mask for e in episodes])
    environment = np.asarray([e.reward for e in episodes], np.float64)
    scores = rewards_lib.Scores(environment, {"environment": environment})
    if self.rewards.names:
      with guard("the first rollout's reward functions"):
        scored = self.rewards.score([p.prompt for p in row_prompts], [e.last_text for e in episodes],
                                    [e.last_ids for e in episodes], prompts_lib.columns_of(group, self.group),
                                    [p.index for p in row_prompts])
      with np.errstate(over="ignore", invalid="ignore"):
        scores = rewards_lib.Scores(scored.total + environment, {"environment": environment, **scored.per_function})
    if not np.all(np.isfinite(scores.total)):
      i = int(np.flatnonzero(~np.isfinite(scores.total))[0])
      raise UserError(f"the reward of environment {self.rl.rl_environment} plus the reward functions' overflows "
                      f"float64 (episode {i}, prompt record {episodes[i].index}); scale the rewards down")
    advantages, group_std = rewards_lib.advantages(scores.total, self.group, self.rl.grpo_scale_rewards,
                                                   ["environment", *self.rewards.names])
    rows[ADVANTAGES] = advantages.astype(np.float32)
    batch: Batch = {name: _global(value, sharding.for_rank(self.sharding, value.ndim)) for name, value in rows.items()}
    lengths = np.asarray([e.model_tokens for e in episodes])
    scalars = {**rewards_lib.reward_metrics(scores, group_std, advantages),
               "completions/mean_length": float(lengths.mean()), "completions/max_length": float(lengths.max()),
               "completions/min_length": float(lengths.min()),
               "completions/clipped_ratio": float(np.mean([not e.last_ended for e in episodes])),
               **episodes_lib.metrics(episodes, timing),
               "rollout_s": rollout_s, "rollout_tokens_per_s": float(lengths.sum() / max(rollout_s, 1e-9)),
               "reward_s": time.perf_counter() - started - rollout_s, **sync_scalars}
    return batch, scalars


def compile_rollout_step(config: Config, mesh: Mesh, abstract_params: Any) -> Any:
  """The rollout's decode step (one token for every completion of a batch) compiled ahead of time
  on `mesh` for parameters laid out as the train state holds them (`abstract_params`: shapes with
  shardings), as train_compile checks it for a topology."""
  return Engine(config, num_slots=config.data.global_batch_size, mesh=mesh).compile_step(abstract_params)
