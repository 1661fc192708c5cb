"""Reward functions: the built-ins and users' own, named in `reward_functions`, weighted by
`reward_weights`.

A reward function is called once per rollout batch with keyword arguments

    prompts: list[str]            the prompt of each completion (its text as the model saw it)
    completions: list[str]        the decoded completions (up to and without the end-of-sequence token)
    completion_ids: list[list[int]]  their token ids (with the end-of-sequence token when there was one)
    <column>: list                every other column of the prompt records, one value per completion

and returns one finite float per completion. A user's function is named `package.module:function`
and imported from the Python path; functions should accept **kwargs so new columns do not break them.
Each function gets its own copy of the arguments: what it does to them reaches neither the other
functions nor the training rows.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import re
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from MaxText.configuration.rl_config import RLConfig
from MaxText.errors import ConfigError, UserError
from MaxText.training import health

RewardFn = Callable[..., Sequence[float]]
ARGUMENTS = ("prompts", "completions", "completion_ids")  # a prompt record's columns may not reuse these
# With grpo_scale_rewards=none the advantages are reward differences as they are; larger ones
# overflow the gradient's norm long before float32 itself does.
MAX_UNSCALED_ADVANTAGE = 1e6

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_answer(text: str) -> str | None:
  """The final answer a completion states: the last \\boxed{...}, else what follows the last '####'
  (GSM8K's convention), else the last <answer>...</answer>, else the last number, else the whole
  text (a one-word answer); None for an empty completion."""
  boxed = _BOXED.findall(text)
  if boxed:
    return boxed[-1]
  if "####" in text:
    after = text.rsplit("####", 1)[1].strip()
    return after.splitlines()[0] if after else None
  tagged = _ANSWER_TAG.findall(text)
  if tagged:
    return tagged[-1]
  numbers = _NUMBER.findall(text)
  if numbers:
    return numbers[-1]
  return text.strip() or None


def _normalise(answer: object) -> str:
  text = str(answer).strip().lower().replace(",", "").replace("$", "").rstrip(".")
  try:
    number = float(text)
  except ValueError:
    return " ".join(text.split())
  return repr(int(number)) if number.is_integer() else repr(number)


@dataclasses.dataclass(frozen=True)
class ExactMatch:
  """1 when the completion's final answer (extract_answer) equals the record's answer column
  (numbers compared as numbers, text without case, commas, dollar signs or extra spaces), else 0."""

  column: str
  __name__ = "exact_match"

  def __call__(self, completions: list[str], **columns: Sequence[object]) -> list[float]:
    if self.column not in columns:
      raise UserError(f"reward exact_match reads the column rl_answer_column={self.column!r}, which the prompt "
                      f"records do not have (their columns: {', '.join(sorted(columns)) or 'none'})")
    out = []
    for completion, answer in zip(completions, columns[self.column]):
      found = extract_answer(completion)
      out.append(float(found is not None and _normalise(found) == _normalise(answer)))
    return out


@dataclasses.dataclass(frozen=True)
class FormatMatch:
  """1 when rl_format_regex matches the completion (re.search, DOTALL), else 0."""

  pattern: re.Pattern[str]
  __name__ = "format"

  def __call__(self, completions: list[str], **_: object) -> list[float]:
    return [float(self.pattern.search(c) is not None) for c in completions]


@dataclasses.dataclass(frozen=True)
class LengthPenalty:
  """DAPO's overlong shaping: 0 up to max_completion_length - window tokens, then down linearly to
  -1 at max_completion_length; a truncated completion (no end-of-sequence token) gets -1."""

  max_length: int
  window: int
  eos_id: int | None
  __name__ = "length_penalty"

  def __call__(self, completion_ids: list[list[int]], **_: object) -> list[float]:
    out = []
    for ids in completion_ids:
      ended = bool(ids) and self.eos_id is not None and ids[-1] == self.eos_id
      if not ended and len(ids) >= self.max_length:
        out.append(-1.0)
        continue
      start = self.max_length - self.window
      out.append(0.0 if len(ids) <= start else (start - len(ids)) / self.window)
    return out


BUILTINS = ("exact_match", "format", "length_penalty")


def _builtin(name: str, rl: RLConfig, eos_id: int | None) -> RewardFn:
  if name == "exact_match":
    return ExactMatch(rl.rl_answer_column)
  if name == "format":
    if not rl.rl_format_regex:
      raise ConfigError("reward format needs rl_format_regex, the pattern a well-formatted completion matches")
    try:
      return FormatMatch(re.compile(rl.rl_format_regex, re.DOTALL))
    except re.error as e:
      raise ConfigError(f"rl_format_regex={rl.rl_format_regex!r} is not a regular expression: {e}") from None
  return LengthPenalty(rl.max_completion_length, rl.rl_length_penalty_window, eos_id)


def error_text(error: BaseException, limit: int = 300) -> str:
  """A user's exception as one line of an error: its first non-empty line, at most `limit` characters; an
  exception whose own str() fails (a user's __str__) is named by its type alone."""
  try:
    text = str(error)
  except Exception:  # noqa: BLE001 - a user's __str__: the error line must still come out
    return "(its message could not be read)"
  line = next((line.strip() for line in text.splitlines() if line.strip()), "")
  return line if len(line) <= limit else f"{line[:limit - 3]}..."


def load_dotted(path: str, what: str, builtins: Sequence[str], kind: str,
                *, is_key: bool = False) -> Callable[..., Any]:
  """The callable `package.module:<kind>` imported for a user's hook (a reward function, an environment),
  or one ConfigError line starting with `what` (a config key's name when `is_key`)."""
  module_name, sep, attribute = path.partition(":")
  if not sep or not module_name or not attribute:
    named = f"{what}={path!r}" if is_key else f"{what} {path!r}"
    raise ConfigError(f"{named} is neither a built-in ({', '.join(builtins)}) nor a package.module:{kind} path")
  try:
    module = importlib.import_module(module_name)
  except KeyboardInterrupt:
    raise
  except BaseException as e:  # noqa: BLE001 - any failure to import (an exit at import too) is the user's to fix
    raise ConfigError(f"{what} {path}: cannot import {module_name} ({type(e).__name__}: "
                      f"{error_text(e)}); is it on PYTHONPATH?") from None
  found = getattr(module, attribute, None)
  if not callable(found):
    raise ConfigError(f"{what} {path}: {module_name} has no callable {attribute!r}")
  return found


def load_function(path: str) -> RewardFn:
  """`package.module:function` imported; a clear ConfigError when it is not importable or callable."""
  return load_dotted(path, "reward function", BUILTINS, "function")


@dataclasses.dataclass
class Scores:
  total: np.ndarray  # [R] the weighted sum
  per_function: dict[str, np.ndarray]  # name -> [R]


class RewardSet:
  """The run's reward functions and weights; `score` checks what each returns."""

  def __init__(self, rl: RLConfig, eos_id: int | None):
    self.names = list(rl.reward_functions)
    self.functions = [_builtin(n, rl, eos_id) if n in BUILTINS else load_function(n) for n in self.names]
    self.weights = np.asarray(rl.reward_weights or [1.0] * len(self.names), np.float64)

  def score(self, prompts: list[Any], completions: list[str], completion_ids: list[list[int]],
            columns: Mapping[str, list[Any]], prompt_indices: Sequence[int]) -> Scores:
    """`prompt_indices`: each completion's prompt record index (for the error that names one)."""
    per_function = {}
    for name, fn in zip(self.names, self.functions):
      # Token ids, the bulk, copied as lists of ints; the rest (message lists, columns) deeply.
      arguments = {"prompts": copy.deepcopy(prompts), "completions": list(completions),
                   "completion_ids": [list(ids) for ids in completion_ids], **copy.deepcopy(dict(columns))}
      try:
        with health.activity(f"reward function {name}"):
          values = fn(**arguments)
          array = self._floats(name, values)  # may call the user's code too (an iterator, __float__)
      except UserError:
        raise
      except KeyboardInterrupt:  # Ctrl-C is the person's, not the function's
        raise
      except BaseException as e:  # noqa: BLE001 - the user's code (an exit too): name it and stop
        raise UserError(f"reward function {name} raised {type(e).__name__}: {error_text(e)}"
                        f" (on the completions of prompt records {_records(prompt_indices)})") from None
      if isinstance(values, (list, tuple)) and any(v is None for v in values):  # numpy reads None as nan
        i = next(k for k, v in enumerate(values) if v is None)
        raise UserError(f"reward function {name} returned None for completion {i} (prompt record "
                        f"{prompt_indices[i] if i < len(prompt_indices) else '?'}); rewards must be finite numbers: "
                        "score a completion the function does not apply to with 0, or leave the function out")
      per_function[name] = self._checked(name, array, len(completions), prompt_indices)
    with np.errstate(over="ignore", invalid="ignore"):
      total = np.asarray(sum(w * v for w, v in zip(self.weights, per_function.values())), np.float64)
    bad = np.flatnonzero(~np.isfinite(total))
    if bad.size:
      i = int(bad[0])
      terms = ", ".join(f"{w:g} x {v[i]:g}" for w, v in zip(self.weights, per_function.values()))
      raise UserError(f"the weighted sum of reward functions {', '.join(self.names)} is {total[i]} for completion {i} "
                      f"(prompt record {prompt_indices[i]}): {terms} overflows float64; scale the rewards or "
                      "reward_weights down")
    return Scores(total, per_function)

  @staticmethod
  def _floats(name: str, values: object) -> np.ndarray:
    if isinstance(values, np.ndarray) and np.iscomplexobj(values):  # float64 would drop the imaginary parts
      raise UserError(f"reward function {name} returned complex numbers ({values.dtype}); rewards must be real")
    try:
      return np.asarray(values, np.float64)
    except (TypeError, ValueError):
      raise UserError(f"reward function {name} returned {type(values).__name__}, not a list of floats") from None

  @staticmethod
  def _checked(name: str, array: np.ndarray, count: int, prompt_indices: Sequence[int]) -> np.ndarray:
    if array.shape != (count,):
      got = "a scalar" if array.ndim == 0 else f"{array.size} value(s)" if array.ndim == 1 \
          else f"an array of shape {array.shape}"
      raise UserError(f"reward function {name} returned {got} for {count} completions; it must return one float "
                      "per completion")
    bad = np.flatnonzero(~np.isfinite(array))
    if bad.size:
      i = int(bad[0])
      raise UserError(f"reward function {name} returned {array[i]} for completion {i} (prompt record "
                      f"{prompt_indices[i]}); rewards must be finite")
    return array


def _records(indices: Sequence[int]) -> str:
  """Prompt record indices for a message: distinct, in order, the first few."""
  distinct = sorted(set(int(i) for i in indices))
  shown = ", ".join(map(str, distinct[:6]))
  return shown if len(distinct) <= 6 else f"{shown} and {len(distinct) - 6} more"


def _scaled(values: np.ndarray, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
  """(values / scale, scale): scale is the largest |value| along `axis` (1 where all are 0), so
  sums of squares cannot overflow however large the finite values are."""
  scale = np.max(np.abs(values), axis=axis, keepdims=True)
  scale = np.where(scale > 0, scale, 1.0)
  return values / scale, scale


def _std(values: np.ndarray, axis: int | None = None) -> np.ndarray:
  """The sample standard deviation (ddof=1), without overflow for huge finite values (inf only
  when the std itself exceeds float64's range)."""
  unit, scale = _scaled(values, axis)
  with np.errstate(over="ignore"):
    return np.squeeze(unit.std(axis=axis, ddof=1, keepdims=True) * scale, axis=axis)


def advantages(rewards: np.ndarray, group_size: int, scaling: str,
               names: Sequence[str] = ()) -> tuple[np.ndarray, np.ndarray]:
  """(advantages [R], each completion's group reward std [R]): the reward minus its group's mean,
  divided by the group's (scaling=group) or the batch's (batch) sample standard deviation + 1e-4,
  or not divided (none). Rows are grouped in order: completions i*G .. i*G + G - 1 share a prompt.
  `names`: the reward functions, for the error about unscaled advantages that are too large.

  Computed on the rewards divided by their group's (batch's) largest |r|, which leaves the result
  as it is (the + 1e-4 is divided too) but keeps any finite rewards from overflowing."""
  grouped = np.asarray(rewards, np.float64).reshape(-1, group_size)
  group_std = np.repeat(_std(grouped, axis=1), group_size)
  if scaling == "none":
    unit, scale = _scaled(grouped, axis=1)
    with np.errstate(over="ignore"):
      centred = ((unit - unit.mean(axis=1, keepdims=True)) * scale).reshape(-1)
    worst = float(np.max(np.abs(centred))) if centred.size else 0.0
    if not worst <= MAX_UNSCALED_ADVANTAGE:
      of = f" of reward functions {', '.join(names)}" if names else ""
      raise UserError(f"with grpo_scale_rewards=none an advantage (the weighted reward{of} minus its group's mean) is "
                      f"{worst:.3g}, beyond the {MAX_UNSCALED_ADVANTAGE:g} the loss's gradient can take; scale the "
                      "rewards or reward_weights down, or set grpo_scale_rewards=group")
    return centred, group_std
  if scaling == "group":
    unit, scale = _scaled(grouped, axis=1)
  else:
    unit, scale = _scaled(grouped, axis=None)
  centred = unit - unit.mean(axis=1, keepdims=True)
  unit_std = unit.std(axis=1, ddof=1, keepdims=True) if scaling == "group" \
      else np.full_like(grouped[:, :1], unit.std(ddof=1) if unit.size > 1 else 0.0)
  return (centred / (unit_std + 1e-4 / scale)).reshape(-1), group_std


def reward_metrics(scores: Scores, group_std: np.ndarray, advantage: np.ndarray) -> dict[str, float]:
  """The per-batch figures TRL logs: reward (and per function) mean and std, the fraction of groups
  whose rewards are all equal (they train nothing), and the advantages' spread."""
  def mean(values: np.ndarray) -> float:
    unit, scale = _scaled(values, axis=None)
    return float(unit.mean() * scale.item())

  def std(values: np.ndarray) -> float:
    return float(_std(values)) if values.size > 1 else 0.0

  out = {"reward": mean(scores.total), "reward_std": std(scores.total)}
  for name, values in scores.per_function.items():
    short = name.rsplit(":", 1)[-1]
    out[f"rewards/{short}/mean"] = mean(values)
    out[f"rewards/{short}/std"] = std(values)
  out["frac_reward_zero_std"] = float(np.mean(np.isclose(group_std, 0.0)))
  out["advantage_std"] = float(advantage.std())
  out["advantage_abs_max"] = float(np.abs(advantage).max())
  return out


__all__ = ["ARGUMENTS", "BUILTINS", "RewardSet", "Scores", "advantages", "error_text", "extract_answer", "load_function",
           "reward_metrics"]
