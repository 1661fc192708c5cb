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


class _Counting:
  """The fixture's tokenizer, recording the longest text it is asked to tokenise."""

  def __init__(self, inner):
    self._inner, self.longest = inner, 0

  def __call__(self, text, **kw):
    self.longest = max(self.longest, len(text))
    return self._inner(text, **kw)

  def __getattr__(self, name):
    return getattr(self._inner, name)


HUGE = "word " * 800_000  # 4 MB


def test_a_tool_that_returns_megabytes_ends_the_episode_without_tokenising_them(tokenizer):
  """A step's 4 MB message went to the tokenizer whole, on the trainer's thread, only to end the episode."""
  class Env(Base):
    def step(self, turn):
      return ([{"role": "tool", "content": HUGE}], 0.5, False)

  counting = _Counting(tokenizer)
  done = episodes.run(environments.Guarded("my_env:Env", Env, 5.0), counting, tokenizer.eos_token_id,
                      [(7, "p", {}), (8, "q", {})], _scripted(tokenizer, ["hi"] * 4, []), _params, _limits())
  assert [(e.end, e.turns, e.reward) for e in done] == [("tokens", 1, 0.5)] * 2
  assert all(all(e.model_mask) for e in done)  # nothing of the tool's was appended
  assert counting.longest < 50_000


def test_an_opening_of_megabytes_is_one_line_without_tokenising_it(tokenizer):
  class Env(Base):
    def start(self):
      return [{"role": "user", "content": HUGE}]

  counting = _Counting(tokenizer)
  with pytest.raises(UserError) as error:
    episodes.run(environments.Guarded("my_env:Env", Env, 5.0), counting, tokenizer.eos_token_id, [(7, "p", {})],
                 _scripted(tokenizer, ["hi"] * 4, []), _params, _limits())
  assert str(error.value).startswith("prompt record 7: the environment's opening messages are over 400 tokens; ")
  assert counting.longest < 50_000


def test_a_cut_message_says_so_where_it_still_fits(tokenizer):
  """Only a template or tokenizer that drops text lets a cut message fit: the cut is then in its content."""
  renderer = episodes.Renderer(tokenizer, tokenizer.eos_token_id)
  longest = episodes.longest_token(tokenizer)
  kept, cut = renderer.within([{"role": "tool", "content": "ok"}], 3)
  assert kept == [{"role": "tool", "content": "ok"}] and not cut
  messages, cut = renderer.within([{"role": "tool", "content": "x" * 10_000, "name": "f"},
                                   {"role": "user", "content": "more"}], 3)
  assert cut and messages[0]["name"] == "f"
  assert messages[0]["content"] == "x" * (4 * longest) + f" [{10_000 - 4 * longest} characters cut: past the " \
                                                         "episode's token limit]"
  assert messages[1]["content"] == " [4 characters cut: past the episode's token limit]"


class Unreadable(Exception):
  def __str__(self):
    raise RuntimeError("its __str__ fails too")


@pytest.mark.parametrize("error, shown", [
    (Unreadable(), "Unreadable: (its message could not be read)"),  # was the RuntimeError's traceback
    (ValueError("\n\n  the real reason\nmore"), "ValueError: the real reason"),  # was an empty reason
    (ValueError("y" * 100_000), "ValueError: " + "y" * 297 + "..."),  # was a 100 kB line
], ids=["str-raises", "blank-first-line", "huge"])
def test_an_exception_from_the_environment_is_one_readable_line(tokenizer, error, shown):
  class Env(Base):
    def step(self, turn):
      raise error

  assert _one_line(tokenizer, Env) == f"environment my_env:Env raised {shown} (in step, prompt record 7)"


def test_a_reward_function_whose_exception_cannot_be_read_is_one_line(tiny_overrides, tmp_path, monkeypatch):
  from tests.test_grpo_hostile import _reward_set

  source = ("class Unreadable(Exception):\n  def __str__(self):\n    raise RuntimeError('no')\n\n"
            "def f(**kw):\n  raise Unreadable()\n")
  scorer = _reward_set(tiny_overrides, tmp_path, monkeypatch, source)
  with pytest.raises(UserError) as raised:
    scorer.score(["p", "p"], ["a", "b"], [[5], [6]], {"answer": ["x", "y"]}, [3, 3])
  assert str(raised.value).endswith("raised Unreadable: (its message could not be read) (on the completions of prompt "
                                    "records 3)")


def test_a_prompt_column_beside_another_rl_prompt_column_is_one_line(tiny_overrides, tmp_path):
  """The environment is called with `prompt` and every other column: a file's own 'prompt' column silently
  replaced the rl_prompt_column prompt the episode was meant to start from."""
  from tests.test_grpo_hostile import _prompt_set

  records = [{"question": "what is 1 + 1?", "prompt": "an unrelated column", "answer": "2"},
             {"question": "what is 2 + 2?", "prompt": "an unrelated column", "answer": "4"}]
  with pytest.raises(UserError) as raised:
    _prompt_set(tiny_overrides, tmp_path, records, None, rl_prompt_column="question", rl_environment="calculator")
  message = str(raised.value)
  assert "has a column named 'prompt' (prompt record 0) beside rl_prompt_column='question'; " in message and \
      message.endswith("rl_environment=calculator gets the prompt as its `prompt` argument, so rename that column in "
                       "the file")
  # Without an environment nothing reads that column as the prompt.
  assert len(_prompt_set(tiny_overrides, tmp_path / "single", records, None, rl_prompt_column="question").prompts) == 2


def test_the_environment_gets_the_prompt_whatever_the_columns_hold(tokenizer):
  seen = []

  class Env(Base):
    def __init__(self, prompt, **columns):
      seen.append(prompt)
      super().__init__(prompt)

  _run(tokenizer, Env, records=[(7, "the real prompt", {"prompt": "a column"})])
  assert seen == ["the real prompt"]


@pytest.mark.parametrize("answer, shown, extra, readers", [
    (None, "null or missing", {}, "exact_match compares"),
    ("  ", "blank", {"rl_environment": "calculator", "reward_functions": "[]"}, "the calculator compares"),
    (None, "null or missing", {"rl_environment": "calculator"}, "exact_match and the calculator compare"),
], ids=["null-exact-match", "blank-calculator", "both"])
def test_a_record_without_an_answer_is_one_line_when_the_answer_is_read(tiny_overrides, tmp_path, answer, shown, extra,
                                                                       readers):
  """A null answer was compared as the text "none" (a model answering "None" scored 1) and a blank one matched
  nothing: that record's episodes trained on a reward that meant nothing, silently."""
  from tests.test_grpo_hostile import _prompt_set

  records = [{"prompt": "what is 1 + 1?", "answer": "2"}, {"prompt": "what is 2 + 2?", "answer": answer}]
  with pytest.raises(UserError) as raised:
    _prompt_set(tiny_overrides, tmp_path, records, None, **extra)
  assert str(raised.value).endswith(f"has a {shown} answer in rl_answer_column='answer', which {readers} the "
                                    "completions with; give it an answer or drop the record")
  assert "prompt record 1 of " in str(raised.value)
  # Nothing reads the answer: the records load.
  plain = _prompt_set(tiny_overrides, tmp_path / "format", records, None, reward_functions="format")
  assert len(plain.prompts) == 2
