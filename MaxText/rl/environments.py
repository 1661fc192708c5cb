"""Environments of multi-turn GRPO episodes (`rl_environment`): what answers the model between its
turns. Named as reward functions are, `package.module:Name` on PYTHONPATH, or the built-in
`calculator` (rl/calculator.py). `Name` is called once per episode with the prompt record as
keyword arguments (`prompt` and every other column) and returns an episode object with

    tools: list[dict]                   optional: the tools' JSON schemas, given to the chat template
    start() -> list[message]            the messages that open the episode (e.g. the prompt as a user turn)
    step(turn: ModelTurn) -> Step       after each model turn: the messages to append (tool results as
                                        role "tool", or user turns), a reward contribution, whether it ended

`step` may also return a (messages, reward, done) tuple. A message is a dict with a "role" (tool,
user or system) and a string "content". Every call runs guarded (`Guarded`): one that raises (an
exit included), does not return within rl_environment_timeout_seconds or returns anything else
stops the run with one `error:` line naming the environment, the call and the prompt record (one stuck in C code that
holds the GIL stops every Python thread, that timeout's too: `_Backstop` then ends the process with every thread's
stack). Each
episode gets a deep copy of its record, and what the calls return is copied (as JSON): later changes
to either reach nothing the run keeps. A tool call the model wrote badly is not an error: the
episode's `step` gets it (`malformed`) and answers the model, as the calculator does.
"""

from __future__ import annotations

import copy
import dataclasses
import faulthandler
import json
import math
import numbers
import queue
import threading
import time
from typing import Any, Callable, Generic, Mapping, Sequence, TypeVar

import numpy as np

from MaxText.errors import ConfigError, UserError
from MaxText.inference import tool_calls
from MaxText import json_text
from MaxText.rl import rewards

T = TypeVar("T")
Message = dict[str, Any]
ROLES = ("tool", "user", "system")  # what an environment may append (the assistant's turns are the model's)
BUILTINS = ("calculator",)


@dataclasses.dataclass(frozen=True)
class ModelTurn:
  """What the model said in one turn, as its environment's `step` gets it."""

  text: str  # the reply decoded (special tokens and the end-of-sequence token left out)
  calls: list[tool_calls.ToolCall]  # the tool calls parsed from it (inference/tool_calls.py's formats)
  malformed: bool  # it opened a tool call that does not parse (bad JSON, no name): answer with an error message
  ended: bool  # it ended with the end-of-sequence token (False: cut at the turn's token limit)
  turn: int  # 1 for the episode's first model turn


@dataclasses.dataclass(frozen=True)
class Step:
  """An environment's answer to a model turn."""

  messages: list[Message]  # appended to the episode, rendered by the chat template, not trained on
  reward: float = 0.0  # added to the episode's reward
  done: bool = False  # the episode ends here (its messages are then not appended)


def model_turn(text: str, ended: bool, turn: int) -> ModelTurn:
  parsed = tool_calls.parse(text)
  # An opening tag left in the content is a call that did not parse; one inside a parsed call's arguments is not.
  malformed = tool_calls.TAG_OPEN in parsed.content or (
      not parsed.calls and text.lstrip().startswith((tool_calls.PYTHON_TAG, '{"name"')))
  return ModelTurn(text, parsed.calls, malformed, ended, turn)


def load(path: str) -> Callable[..., Any]:
  """The episode factory a `package.module:Name` path names (the built-ins are episodes.py's)."""
  return rewards.load_dotted(path, "rl_environment", BUILTINS, "Name", is_key=True)


BACKSTOP_GRACE_S = 30.0


class _Backstop:
  """A call stuck in C code that holds the GIL (a regular expression backtracking without end over the model's text)
  stops every Python thread: the guard's timeout never fires and the run hung for good. faulthandler's timer thread
  needs no GIL: armed for the earliest running call's deadline plus BACKSTOP_GRACE_S, it prints every thread's stack
  and ends the process (status 1). A call that returns, or that the guard reports past its time, is let go."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._deadlines: dict[Any, float] = {}

  def arm(self, call: Any, deadline: float) -> None:
    with self._lock:
      self._deadlines[call] = deadline
      self._set()

  def release(self, call: Any) -> None:
    with self._lock:
      if self._deadlines.pop(call, None) is not None:
        self._set()

  def _set(self) -> None:
    if self._deadlines:
      wait = min(self._deadlines.values()) + BACKSTOP_GRACE_S - time.monotonic()
      # fd 2: sys.stderr may have none; a timeout near threading.TIMEOUT_MAX is past what the timer takes
      faulthandler.dump_traceback_later(min(max(wait, 1e-3), threading.TIMEOUT_MAX), exit=True, file=2)
    else:
      faulthandler.cancel_dump_traceback_later()


_BACKSTOP = _Backstop()


class _Call(Generic[T]):
  """One call on a daemon thread of its own: one that never returns is left behind, not joined.
  `finished` (a queue) is told `key` when the call returns or raises; past `deadline` (time.monotonic) the
  backstop may end the process."""

  def __init__(self, fn: Callable[[], T], deadline: float, finished: queue.SimpleQueue[Any] | None = None,
               key: Any = None):
    self.fn, self.finished, self.key = fn, finished, key
    self.value: T | None = None
    self.error: BaseException | None = None
    self.thread = threading.Thread(target=self._run, name="rl-environment", daemon=True)
    _BACKSTOP.arm(self, deadline)
    self.thread.start()

  def _run(self) -> None:
    try:
      self.value = self.fn()
    except BaseException as e:  # noqa: BLE001 - the user's code (an exit too): reported by the caller
      self.error = e
    finally:
      _BACKSTOP.release(self)
    if self.finished is not None:
      self.finished.put(self.key)


class PendingStep:
  """One episode's `step` running on its thread while the caller does other work (episodes interleaved
  in the engine, rl/interleaved_episodes.py): `result()` once it has finished or its time is up."""

  def __init__(self, guarded: "Guarded", episode: Any, turn: ModelTurn, index: int,
               finished: queue.SimpleQueue[Any], key: Any):
    self.guarded, self.index = guarded, index
    self.deadline = time.monotonic() + guarded.timeout_s
    self.call: _Call[Any] = _Call(_calling(episode, "step", turn), self.deadline, finished, key)

  def ready(self) -> bool:
    """It returned, raised, or ran past rl_environment_timeout_seconds."""
    return not self.call.thread.is_alive() or time.monotonic() >= self.deadline

  def result(self) -> Step:
    """The checked Step; a call that raised, is still running or returned anything else raises one line."""
    self.guarded.check(self.call, "step", self.index)
    return self.guarded._step(self.call.value, self.index)


class Guarded:
  """The run's environment: its episode factory and the guard every call to it runs under."""

  def __init__(self, name: str, factory: Callable[..., Any], timeout_s: float):
    self.name, self.factory, self.timeout_s = name, factory, timeout_s

  def call_all(self, method: str, calls: Sequence[Callable[[], T]], records: Sequence[int]) -> list[T]:
    """Each call's result, the calls run at once (one thread each), all within timeout_s of the start.
    `method` names the call and `records` each call's prompt record for the error."""
    deadline = time.monotonic() + self.timeout_s
    running = [_Call(fn, deadline) for fn in calls]
    for call in running:
      call.thread.join(max(0.0, deadline - time.monotonic()))
    try:
      for call, record in zip(running, records):
        self.check(call, method, record)
    except BaseException:
      for call in running:  # the run stops with this error: the calls left running are waited for no more
        _BACKSTOP.release(call)
      raise
    return [call.value for call in running]  # type: ignore[misc]

  def check(self, call: _Call[Any], method: str, record: int) -> None:
    """One line for a call still running (past its time) or one that raised."""
    where = f"(in {method}, prompt record {record})"
    if call.thread.is_alive():
      _BACKSTOP.release(call)  # this thread runs: the call holds no GIL, and its error follows
      raise UserError(f"environment {self.name} did not return within rl_environment_timeout_seconds="
                      f"{self.timeout_s:g} {where}; make it faster or raise the limit")
    if call.error is not None:
      if isinstance(call.error, UserError):
        raise UserError(f"environment {self.name} {where}: {rewards.error_text(call.error, 1000)}") from None
      raise UserError(f"environment {self.name} raised {type(call.error).__name__}: {rewards.error_text(call.error)} "
                      f"{where}") from None

  def episodes(self, records: Sequence[Mapping[str, Any]], indices: Sequence[int]) -> list[Any]:
    """One episode object per record (the factory called with the record's fields as keywords)."""
    def make(record: Mapping[str, Any]) -> Callable[[], Any]:
      # A copy each: the records are the prompt set's own, and a group's episodes share one.
      return lambda: self.factory(**copy.deepcopy(dict(record)))
    return self.call_all("creating the episode", [make(r) for r in records], indices)

  def opening(self, episodes: Sequence[Any], indices: Sequence[int]) -> list[list[Message]]:
    values = self.call_all("start", [_calling(e, "start") for e in episodes], indices)
    return [self.messages(v, "start", i, allow_assistant=True) for v, i in zip(values, indices)]

  def step(self, episodes: Sequence[Any], turns: Sequence[ModelTurn], indices: Sequence[int]) -> list[Step]:
    values = self.call_all("step", [_calling(e, "step", t) for e, t in zip(episodes, turns)], indices)
    return [self._step(v, i) for v, i in zip(values, indices)]

  def step_later(self, episode: Any, turn: ModelTurn, index: int, finished: queue.SimpleQueue[Any], key: Any
                 ) -> PendingStep:
    """`step` of one episode started on its thread; `finished` is told `key` when it returns."""
    return PendingStep(self, episode, turn, index, finished, key)

  def tools(self, episode: Any, index: int) -> list[dict[str, Any]] | None:
    # Guarded as the methods are: `tools` may be a property, the user's code.
    tools = self.call_all("tools", [lambda: getattr(episode, "tools", None)], [index])[0]
    if tools is None:
      return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
      raise UserError(f"environment {self.name}: the episode's tools is {type(tools).__name__} for prompt record "
                      f"{index}; it must be a list of JSON schemas (dicts), or absent")
    try:  # as a message: a checkpoint holds the episodes made ahead as JSON
      copied = _json_copy(tools)
    except (TypeError, ValueError, RecursionError) as e:
      raise UserError(f"environment {self.name}: the episode's tools are not JSON ({type(e).__name__}: "
                      f"{str(e)[:100]}) for prompt record {index}; give JSON schemas") from None
    if json_text.has_unpaired_surrogate(copied):
      raise UserError(f"environment {self.name}: the episode's tools hold a string that is not text (an unpaired "
                      f"surrogate, which no tokenizer takes) for prompt record {index}")
    return copied

  def _step(self, value: object, index: int) -> Step:
    if isinstance(value, tuple) and len(value) == 3:
      value = Step(*value)
    if not isinstance(value, Step):
      raise UserError(f"environment {self.name}: step returned {type(value).__name__} for prompt record {index}; it "
                      "must return a Step (messages, reward, done) or such a tuple")
    reward = _reward(value.reward)
    if reward is None:
      raise UserError(f"environment {self.name}: step returned the reward {_shown(value.reward)} for prompt record "
                      f"{index}; it must be a finite number")
    if not isinstance(value.done, (bool, np.bool_)):
      raise UserError(f"environment {self.name}: step returned done={_shown(value.done)} for prompt record {index}; it "
                      "must be True or False")
    return Step(self.messages(value.messages, "step", index), reward, bool(value.done))

  def messages(self, value: object, method: str, index: int, allow_assistant: bool = False) -> list[Message]:
    roles = ROLES + (("assistant",) if allow_assistant else ())
    problem = _message_problem(value, roles, empty_ok=not allow_assistant)
    if problem:
      raise UserError(f"environment {self.name}: {method} returned {problem} for prompt record {index}; it must "
                      f"return a list of messages, dicts with a role ({', '.join(roles)}) and a string content")
    assert isinstance(value, list)
    # Deep copies, as a checkpoint restores them: what the environment changes later (a list it keeps
    # appending to, a nested field) reaches neither the episode nor its token layout.
    return _json_copy(value)


def _message_problem(value: object, roles: Sequence[str], empty_ok: bool) -> str | None:
  if not isinstance(value, list):
    return type(value).__name__
  if not value and not empty_ok:
    return "no messages"
  for i, message in enumerate(value):
    if not isinstance(message, dict):
      return f"a {type(message).__name__} as message {i}"
    if message.get("role") not in roles:
      return f"the role {message.get('role')!r} in message {i}"
    if not isinstance(message.get("content"), str):
      return f"a {type(message.get('content')).__name__} content in message {i}"
    if json_text.has_unpaired_surrogate(message["content"]):  # e.g. a tool's output decoded with surrogateescape
      return f"a content that is not text in message {i} (it holds an unpaired surrogate, which no tokenizer takes)"
    if json_text.has_unpaired_surrogate(message):  # a field a template may render (a tool message's name)
      return f"a field that is not text in message {i} (it holds an unpaired surrogate, which no tokenizer takes)"
    try:  # a checkpoint holds the episodes made ahead as JSON (rollouts.py)
      json.dumps(message)
    except (TypeError, ValueError, RecursionError) as e:
      return f"a message JSON cannot hold ({type(e).__name__}: {str(e)[:100]}) as message {i}"
  return None


def _json_copy(value: T) -> T:
  return json.loads(json.dumps(value))


def _reward(value: object) -> float | None:
  """A step's reward as a float, None where it is not a finite number. numpy's scalars (np.float32, np.int64)
  and 0-d arrays (a jnp.mean) are numbers; bools are not rewards."""
  if isinstance(value, (bool, np.bool_)):
    return None
  try:
    if not isinstance(value, numbers.Real):
      if getattr(value, "shape", None) != ():
        return None
      array = np.asarray(value)
      if array.dtype.kind not in "iuf":
        return None
      value = array.item()
    number = float(value)  # type: ignore[arg-type]
  except Exception:  # noqa: BLE001 - an int beyond float's range, a user's type whose __float__ fails
    return None
  return number if math.isfinite(number) else None


def _shown(value: object, limit: int = 80) -> str:
  """A value's repr for an error line: one line, at most `limit` characters."""
  try:
    text = " ".join(repr(value).split())
  except Exception:  # noqa: BLE001 - a user's __repr__
    text = f"<a {type(value).__name__}>"
  return text if len(text) <= limit else f"{text[:limit - 3]}..."


def _calling(episode: Any, name: str, *args: Any) -> Callable[[], Any]:
  """The episode's method called, looked up in the call too: a property or __getattr__ is the user's code."""
  return lambda: _method(episode, name)(*args)


def _method(episode: Any, name: str) -> Callable[..., Any]:
  fn = getattr(episode, name, None)
  if not callable(fn):
    raise UserError(f"its episode object ({type(episode).__name__}) has no {name}() method; an environment's "
                    "episodes need start() and step(turn) (getting_started/RL.md, Agentic RL)")
  return fn


__all__ = ["BUILTINS", "Guarded", "Message", "ModelTurn", "PendingStep", "ROLES", "Step", "load", "model_turn"]
