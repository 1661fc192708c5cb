"""Downstream tasks scored inside training: `eval_tasks=` names lm-eval tasks (its registry, or
YAML files under `eval_tasks_path`) that lm-eval itself runs against the model being trained,
every `eval_tasks_interval` steps (or `eval_interval`'s), logged as `tasks/<task>/<metric>`.

lm-eval is driven in-process: `ModelLM` is an lm-eval `TemplateLM`, so lm-eval's own prompt
building, tokenisation of context/continuation pairs, few-shot sampling and metrics apply, and an
exported checkpoint served by MaxText.serve scores the same under lm-eval's `local-completions`.
Scoring runs the train state's parameters on the training mesh in rows of a training micro-batch
(the global batch over gradient_accumulation_steps: what a training step holds at once) at
max_target_length (the eval step's shapes, so no new sharding rules): log-likelihoods from one
forward pass per row; generation greedily, one forward pass per new token (no KV cache: tasks
are small and this keeps one compiled program per shape). Every process runs the same requests in
the same order, as multi-host jitted calls need; the primary one prints and writes.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from MaxText.errors import ConfigError
from MaxText.input_pipeline.tokenizer import Tokenizer
from MaxText.platform import sharding

if TYPE_CHECKING:
  from MaxText.training import metrics as metrics_lib
  from MaxText.training.run_assembly import Run
  from MaxText.training.train_state import TrainState
  from MaxText.training.trainer import StepRecord, Trainer

Params = Any
# What one generation asks for: (context tokens, stop strings, most new tokens).
GenerationRequest = tuple[list[int], list[str], int]


def _lm_eval() -> Any:
  try:
    import lm_eval  # lm-eval pulls in torch and datasets: loaded only when a run asks for tasks
  except ImportError:
    raise ConfigError("eval_tasks needs lm-eval, which is not installed: EXTRAS=eval bash setup.sh "
                      "(or pip install -r requirements-eval.txt)") from None
  return lm_eval


class Scorer:
  """Jitted forward passes over rows of tokens: per-token log-likelihoods and greedy next tokens."""

  def __init__(self, run: "Run"):
    config = run.config
    self.rows = config.data.global_batch_size // config.optim.gradient_accumulation_steps
    self.length = config.data.max_target_length
    self.sharding = run.batch_sharding
    model, mesh, rules = run.setup.on_mesh.spec, run.mesh, config.mesh.logical_axis_rules
    replicated = NamedSharding(mesh, PartitionSpec())

    def logits(params: Params, tokens_BL: jax.Array, segments_BL: jax.Array) -> jax.Array:
      positions_BL = jnp.broadcast_to(jnp.arange(tokens_BL.shape[1], dtype=jnp.int32), tokens_BL.shape)
      with sharding.activation_sharding(mesh, rules):
        return model.apply(params, tokens_BL, positions_BL, segments_BL)

    def token_logprobs(params: Params, tokens_BL: jax.Array, targets_BL: jax.Array, segments_BL: jax.Array
                       ) -> tuple[jax.Array, jax.Array]:
      logp_BLV = jax.nn.log_softmax(logits(params, tokens_BL, segments_BL).astype(jnp.float32), axis=-1)
      picked_BL = jnp.take_along_axis(logp_BLV, targets_BL[..., None], axis=-1)[..., 0]
      return picked_BL, jnp.argmax(logp_BLV, axis=-1) == targets_BL

    def next_tokens(params: Params, tokens_BL: jax.Array, segments_BL: jax.Array, last_B: jax.Array) -> jax.Array:
      last_BV = jnp.take_along_axis(logits(params, tokens_BL, segments_BL), last_B[:, None, None], axis=1)[:, 0]
      return jnp.argmax(last_BV, axis=-1).astype(jnp.int32)

    self._logprobs = jax.jit(token_logprobs, out_shardings=(replicated, replicated))
    self._next = jax.jit(next_tokens, out_shardings=replicated)
    self.params: Params = None  # set before each evaluation
    # Around the first call of each jitted pass, which compiles it (Trainer.compiling: no hang for the watchdog).
    self.compiling: Callable[[], ContextManager[None]] = contextlib.nullcontext
    self._compiled: set[str] = set()

  def _run(self, name: str, step: Callable[..., Any], *args: Any) -> Any:
    with contextlib.nullcontext() if name in self._compiled else self.compiling():
      out = step(*args)
    self._compiled.add(name)
    return out

  def _global(self, rows_BL: np.ndarray) -> jax.Array:
    # Every process holds the whole array (same requests everywhere) and gives its own shards.
    return jax.make_array_from_callback(rows_BL.shape, self.sharding, lambda index: rows_BL[index])

  def _row_arrays(self, sequences: Sequence[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    tokens, segments = np.zeros((self.rows, self.length), np.int32), np.zeros((self.rows, self.length), np.int32)
    for i, seq in enumerate(sequences):
      tokens[i, :len(seq)], segments[i, :len(seq)] = seq, 1
    return tokens, segments

  def loglikelihoods(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """(sum of the continuation's log-probabilities, whether greedy decoding gives it) per (context,
    continuation) pair; a pair longer than max_target_length + 1 keeps its last tokens (as lm-eval's
    API models do)."""
    out: list[tuple[float, bool]] = []
    for start in range(0, len(pairs), self.rows):
      chunk = pairs[start:start + self.rows]
      wholes = [(ctx + cont)[-(self.length + 1):] for ctx, cont in chunk]
      tokens, segments = self._row_arrays([w[:-1] for w in wholes])
      targets, _ = self._row_arrays([w[1:] for w in wholes])
      picked, greedy = jax.device_get(self._run("logprobs", self._logprobs, self.params, self._global(tokens),
                                                self._global(targets), self._global(segments)))
      for i, ((_, cont), whole) in enumerate(zip(chunk, wholes)):
        end = max(len(whole) - 1, 0)  # an empty pair has no target: its score is 0, not the row's padding
        span = slice(end - min(len(cont), end), end)
        out.append((float(np.sum(picked[i, span], dtype=np.float64)), bool(np.all(greedy[i, span]))))
    return out

  def generate(self, requests: Sequence[GenerationRequest], decode: Callable[[list[int]], str],
               eos_id: int | None, stop_token: Callable[[str], int | None] | None = None) -> list[str]:
    """Greedy continuations, each cut before its first stop string, at eos, or after its token budget.
    `stop_token`: a stop string's id when it is a special token, which `decode` does not write."""
    out: list[str] = []
    for start in range(0, len(requests), self.rows):
      chunk = requests[start:start + self.rows]
      stop_ids = [{t for t in map(stop_token, stops) if t is not None} if stop_token else set() for _, stops, _ in chunk]
      budgets = [max(1, min(most, self.length - 1)) for _, _, most in chunk]
      seqs = [ctx[-(self.length - budget):] for (ctx, _, _), budget in zip(chunk, budgets)]
      new: list[list[int]] = [[] for _ in chunk]
      done = [False] * len(chunk)
      while not all(done):
        tokens, segments = self._row_arrays([s + n for s, n in zip(seqs, new)])
        last = np.zeros(self.rows, np.int32)
        last[:len(chunk)] = [len(s) + len(n) - 1 for s, n in zip(seqs, new)]
        picked = jax.device_get(self._run("next", self._next, self.params, self._global(tokens), self._global(segments),
                                          jax.device_put(last, NamedSharding(self.sharding.mesh, PartitionSpec()))))
        for i, (_, stops, _) in enumerate(chunk):
          if done[i]:
            continue
          token = int(picked[i])
          if token == eos_id or token in stop_ids[i]:
            done[i] = True
            continue
          new[i].append(token)
          text = decode(new[i])
          done[i] = len(new[i]) >= budgets[i] or any(stop and stop in text for stop in stops)
      for (_, stops, _), tokens_i in zip(chunk, new):
        text = decode(tokens_i)
        cut = min((text.index(s) for s in stops if s and s in text), default=len(text))
        out.append(text[:cut])
    return out


def model_lm(scorer: Scorer, tokenizer: Tokenizer) -> Any:
  """An lm-eval LM over `scorer` (its params set by the caller before each evaluation)."""
  lm_eval = _lm_eval()
  from lm_eval.api.model import TemplateLM  # lm_eval's own base: its pair encoding and request handling
  from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

  eot = tokenizer.eos_id if tokenizer.eos_id is not None else tokenizer.bos_id
  if eot is None:
    raise ConfigError("eval_tasks needs a tokenizer with an eos (or bos) token: lm-eval conditions empty "
                      "contexts on it")
  eot_id: int = eot

  class ModelLM(TemplateLM):  # type: ignore[misc]
    max_length = scorer.length

    @property
    def eot_token_id(self) -> int:
      return eot_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
      return tokenizer.encode(string)

    def _loglikelihood_tokens(self, requests: list[Any], **kwargs: Any) -> list[tuple[float, bool]]:
      return scorer.loglikelihoods([(list(ctx), list(cont)) for _, ctx, cont in requests])

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
      out = []
      for request in requests:
        windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
            token_list=self.tok_encode(request.args[0]), prefix_token=self.prefix_token_id,
            max_seq_len=scorer.length, context_len=1)]
        out.append(sum(score for score, _ in scorer.loglikelihoods(windows)))
      return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
      asks: list[GenerationRequest] = []
      for request in requests:
        context, kwargs = request.args
        until = kwargs.get("until") or []
        # An empty context is conditioned on eot, as lm-eval's log-likelihoods are (no row reads a padding position).
        asks.append((self.tok_encode(context) or [eot_id], [until] if isinstance(until, str) else list(until),
                     int(kwargs.get("max_gen_toks", 256))))
      return scorer.generate(asks, tokenizer.decode, tokenizer.eos_id, getattr(tokenizer, "special_id", None))

  del lm_eval
  return ModelLM()


def task_scalars(results: Mapping[str, Any]) -> dict[str, float]:
  """lm-eval's `results` as flat scalars: tasks/<task>/<metric>[_<filter>] (stderr left out)."""
  out = {}
  for task, metrics in results.get("results", {}).items():
    for name, value in metrics.items():
      metric, _, filt = name.partition(",")
      if "_stderr" in metric or metric == "sample_len" or not isinstance(value, (int, float)) or isinstance(value, bool):
        continue
      if isinstance(value, float) and not math.isfinite(value):
        continue
      suffix = "" if filt in ("", "none") else f"_{filt}"
      out[f"tasks/{task}/{metric}{suffix}"] = float(value)
  return out


class TaskEvalHook:
  """Runs the `eval_tasks` through lm-eval at each due step with the state's parameters."""

  activity = "the eval_tasks scoring"

  def __init__(self, run: "Run", tokenizer: Tokenizer, writer: "metrics_lib.MetricWriter | None", is_primary: bool):
    settings = run.config.tasks
    self.lm_eval = _lm_eval()
    from lm_eval.tasks import TaskManager

    self.tasks = list(settings.eval_tasks)
    # Indexing lm-eval's whole registry takes seconds: skipped when the folder holds every task.
    self.manager = TaskManager(include_path=settings.eval_tasks_path, include_defaults=False) \
        if settings.eval_tasks_path else None
    if self.manager is None or any(t not in self.manager.all_tasks for t in self.tasks):
      self.manager = TaskManager(include_path=settings.eval_tasks_path or None)
    missing = [t for t in self.tasks if t not in self.manager.all_tasks]
    if missing:
      where = f" or under eval_tasks_path {settings.eval_tasks_path}" if settings.eval_tasks_path else \
          " (set eval_tasks_path to a folder of task YAMLs for your own)"
      raise ConfigError(f"eval_tasks: {', '.join(missing)} is not an lm-eval task in its registry{where}")
    self.limit = settings.eval_tasks_limit or None
    self.num_fewshot = settings.eval_tasks_num_fewshot if settings.eval_tasks_num_fewshot >= 0 else None
    self.scorer = Scorer(run)
    self.lm = model_lm(self.scorer, tokenizer)
    self.writer, self.is_primary = writer, is_primary

  def evaluate(self, params: Params) -> dict[str, float]:
    self.scorer.params = params
    results = self.lm_eval.simple_evaluate(
        model=self.lm, tasks=self.tasks, task_manager=self.manager, limit=self.limit, num_fewshot=self.num_fewshot,
        log_samples=False, bootstrap_iters=0, verbosity="ERROR")
    self.scorer.params = None
    return task_scalars(results or {})

  def on_step(self, trainer: "Trainer", record: "StepRecord", state: "TrainState | None") -> None:
    assert state is not None, "add TaskEvalHook with needs_state=True"
    # Each pass's first call compiles it: no hang for the watchdog (a bare call, in tests, has no trainer).
    self.scorer.compiling = getattr(trainer, "compiling", contextlib.nullcontext)
    start = time.monotonic()
    scalars = self.evaluate(state.params)
    if self.is_primary:
      shown = " ".join(f"{name.removeprefix('tasks/')} {value:.4f}" for name, value in scalars.items())
      print(f"tasks  {record.step:>6d} | {shown} | {time.monotonic() - start:.1f}s", file=sys.stdout, flush=True)
      if self.writer is not None:
        self.writer.write(record.step, scalars)

  def on_end(self, trainer: "Trainer", state: "TrainState | None") -> None:
    pass
