"""A hurried or hostile user's `rl_environment` (rl/environments.py, rl/episodes.py): each case ends in the
right episodes or one line naming the environment and the prompt record, never a hang, a traceback or a
silent change to what the run trains on or samples next (tests/test_grpo_tools.py has the basic cases)."""

from __future__ import annotations

import queue
import time

import numpy as np
import pytest

pytest.importorskip("transformers", reason="episodes render through a chat template")

from MaxText.errors import ConfigError, UserError  # noqa: E402
from MaxText.rl import calculator, environments, episodes  # noqa: E402
from tests.test_grpo_tools import _limits, _params, _scripted, tokenizer  # noqa: E402,F401 - the fixture

TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


class Base:
  def __init__(self, prompt, **columns):
    self.prompt = prompt

  def start(self):
    return [{"role": "user", "content": self.prompt}]

  def step(self, turn):
    return ([{"role": "tool", "content": "ok"}], 0.0, turn.turn >= 2)


def _run(tokenizer, factory, records=None, timeout=0.3, name="my_env:Env"):
  env = environments.Guarded(name, factory, timeout)
  return episodes.run(env, tokenizer, tokenizer.eos_token_id, records or [(7, "p", {}), (8, "q", {})],
                      _scripted(tokenizer, ["hi"] * 4, []), _params, _limits())


def _one_line(tokenizer, factory, **kw) -> str:
  with pytest.raises(UserError) as error:
    _run(tokenizer, factory, **kw)
  text = str(error.value)
  assert "\n" not in text and len(text) < 400, text
  return text


class SlowStepProperty(Base):
  @property
  def step(self):  # the lookup itself is the user's code: it was made outside the guard
    time.sleep(2)
    return lambda turn: ([], 0.0, True)


def test_a_step_lookup_that_hangs_is_guarded_by_the_timeout(tokenizer):
  """Was looked up on the caller's thread: each episode's lookup blocked the rollout (for ever, for one that
  never returns) and the timeout never fired."""
  started = time.monotonic()
  message = _one_line(tokenizer, SlowStepProperty)
  assert time.monotonic() - started < 1.5
  assert message == ("environment my_env:Env did not return within rl_environment_timeout_seconds=0.3 (in step, prompt "
                     "record 7); make it faster or raise the limit")


def test_an_interleaved_step_lookup_that_hangs_does_not_block_the_caller():
  env = environments.Guarded("my_env:Env", SlowStepProperty, 0.3)
  started = time.monotonic()
  pending = env.step_later(SlowStepProperty("p"), environments.model_turn("hi", True, 1), 7, queue.SimpleQueue(), 0)
  assert time.monotonic() - started < 0.2
  while not pending.ready():
    time.sleep(0.01)
  with pytest.raises(UserError, match=r"did not return within rl_environment_timeout_seconds=0.3 \(in step, prompt "
                                      r"record 7\)"):
    pending.result()


def test_a_factory_that_returns_no_episode_names_the_environment_and_record(tokenizer):
  assert _one_line(tokenizer, lambda **_: None).startswith(
      "environment my_env:Env (in start, prompt record 7): its episode object (NoneType) has no start() method")


def _rewarding(reward=0.0, done=True):
  class Env(Base):
    def step(self, turn):
      return ([], reward, done)
  return Env


@pytest.mark.parametrize("reward, shown", [
    (10 ** 400, "the reward 1000000000"),  # was an OverflowError traceback (math.isfinite of a huge int)
    (np.ones((3, 40)), "the reward array([[1., 1.,"),  # was a 9-line repr
    ("x" * 100_000, "the reward 'xxxx"),  # was a 100 kB line
    (None, "the reward None"), (np.nan, "the reward nan"), (np.array([1.0, 2.0]), "the reward array([1., 2.])"),
], ids=["huge_int", "2d_array", "long_str", "none", "nan", "1d_array"])
def test_a_reward_that_is_not_a_finite_number_is_one_short_line(tokenizer, reward, shown):
  message = _one_line(tokenizer, _rewarding(reward))
  assert message.startswith(f"environment my_env:Env: step returned {shown}") and "prompt record 7" in message


def test_a_done_that_is_not_a_bool_is_one_short_line(tokenizer):
  message = _one_line(tokenizer, _rewarding(done=np.ones((3, 40))))
  assert message.startswith("environment my_env:Env: step returned done=array([[1., 1.,") and message.endswith(
      "for prompt record 7; it must be True or False")


def test_a_zero_dimensional_array_is_a_reward(tokenizer):
  """A reward computed with numpy or jax.numpy (np.mean(...) as a 0-d array) was refused."""
  done = _run(tokenizer, _rewarding(np.array(0.5, np.float32)))
  assert [(e.reward, type(e.reward)) for e in done] == [(0.5, float)] * 2


def test_rewards_whose_sum_overflows_are_one_line(tokenizer):
  """Each finite (1e308), their sum over the turns was an inf reward, caught only later without the record."""
  class Env(Base):
    def step(self, turn):
      return ([{"role": "tool", "content": "ok"}], 1e308, turn.turn >= 3)
  assert _one_line(tokenizer, Env) == ("environment my_env:Env: its rewards summed over 2 turns overflow float64 (the "
                                       "last 1e+308, prompt record 7); scale them down")


class KeepsThePrompt:
  """Keeps the conversation in the prompt list it was given, and the list it returned from start()."""

  def __init__(self, prompt, **columns):
    self.messages = prompt

  def start(self):
    self.messages[0]["content"] += " (seen)"
    return self.messages

  def step(self, turn):
    self.messages.append({"role": "assistant", "content": turn.text})
    self.messages.append({"role": "tool", "content": "t"})
    self.messages[0]["nested"] = {"turn": turn.turn}
    return (self.messages[-1:], 0.0, turn.turn >= 2)


def test_an_environment_that_mutates_its_prompt_or_messages_changes_nothing_else(tokenizer):
  """The records are the prompt set's own (a group's episodes share one): an environment appending to its
  prompt grew it for the group's other episodes and for every later epoch; and what it changed in a list it
  returned reached the episode's messages (which a checkpoint holds)."""
  prompt = [{"role": "user", "content": "hello"}]
  done = _run(tokenizer, KeepsThePrompt, records=[(7, prompt, {}), (7, prompt, {})])
  assert prompt == [{"role": "user", "content": "hello"}]
  for episode in done:
    assert episode.messages == [{"role": "user", "content": "hello (seen)"}, {"role": "assistant", "content": "hi"},
                                {"role": "tool", "content": "t"}, {"role": "assistant", "content": "hi"}]


def test_an_environment_that_mutates_its_tools_changes_no_episode():
  class Env(Base):
    tools = TOOL

    def step(self, turn):
      self.tools.append({"type": "function", "function": {"name": f"g{turn.turn}", "parameters": {}}})
      return ([], 0.0, True)

  env = environments.Guarded("my_env:Env", Env, 1.0)
  episode = Env("p")
  tools = env.tools(episode, 7)
  env.step([episode], [environments.model_turn("hi", True, 1)], [7])
  assert tools == [TOOL[0]] and len(Env.tools) == 2


@pytest.mark.parametrize("where", ["tools", "name"])
def test_a_lone_surrogate_outside_the_content_is_one_line(tokenizer, where):
  """A template renders a tool message's name and the tools: a lone surrogate there reached the tokenizer."""
  class Env(Base):
    tools = [{"type": "function", "function": {"name": "f\ud800", "parameters": {}}}] if where == "tools" else None

    def step(self, turn):
      return ([{"role": "tool", "content": "ok", "name": "x\udc80"}], 0.0, False)

  message = _one_line(tokenizer, Env)
  assert "unpaired surrogate" in message and "prompt record 7" in message and message.startswith(
      "environment my_env:Env: ")


def test_the_calculator_answers_a_malformed_call_beside_a_good_one():
  """The malformed one was dropped without a word: one tool message for two calls."""
  text = ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
          '<tool_call>{"name": calculator}</tool_call>')
  step = calculator.Calculator("p", "2").step(environments.model_turn(text, True, 1))
  assert [m["content"][:27] for m in step.messages] == ["2", "error: a tool call must be "] and not step.done


def test_a_module_that_exits_at_import_is_a_config_error(tmp_path, monkeypatch):
  (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit('no GPU here')\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(ConfigError, match=r"^rl_environment exits_at_import:Env: cannot import exits_at_import "
                                        r"\(SystemExit: no GPU here\)"):
    environments.load("exits_at_import:Env")
