"""Multi-turn GRPO with tools (rl/environments.py, rl/episodes.py, rl/calculator.py): the calculator's
evaluator refuses what is not arithmetic; an environment that raises, hangs, exits or returns
non-messages stops in one line; an episode's token layout is the rollout's context exactly, with
only the model's tokens weighted; the loss equals verl's masking rule; and a 2-turn episode runs on
a random tiny model through the engine on the 8-device mesh (and on a rollout mesh of its own)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "input_pipeline"))
from sft_fixtures import CHATML, without_markers, write_tokenizer  # noqa: E402

from MaxText.configuration.config import Config  # noqa: E402
from MaxText.errors import ConfigError, UserError  # noqa: E402
from MaxText.inference.sampling import RowParams  # noqa: E402
from MaxText.input_pipeline import chat  # noqa: E402
from MaxText.rl import calculator, environments, episodes, rollout_mesh, rollouts  # noqa: E402
from MaxText.training.objectives import grpo_loss  # noqa: E402
from tests.test_grpo import GRPO  # noqa: E402

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "123 * 45"}}</tool_call>'


# ---- the calculator -------------------------------------------------------------------------------

@pytest.mark.parametrize("expression, value", [("123 * 45", 5535), ("(2 + 3) ** 2 - 1", 24), ("7 / 2", 3.5),
                                               ("-7 // 2", -4), ("10 % 4", 2), ("2 ** -1", 0.5), ("1e3 + 1", 1001.0)])
def test_the_calculator_evaluates_arithmetic(expression, value):
  assert calculator.evaluate(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('true')", "not Call"),
    ("os", "not the name 'os'"),
    ("(1).__class__", "not Attribute"),
    ("[1, 2][0]", "not Subscript"),
    ("lambda: 1", "not Lambda"),
    ("9 ** 9 ** 9", "beyond 100"),
    ("10 ** 99", "beyond 1e+30"),
    ("2 ** 0.5 ** -300", "beyond 100"),
    ("99999999999999999 * 99999999999999999", "beyond 1e+30"),
    ("1 / 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("(-8) ** 0.5", "not a real number"),
    ("True + 1", "not the constant True"),
    ("'a' * 3", "not the constant 'a'"),
    ("1 +", "cannot read"),
    ("1" + " + 1" * 100, "at most 200"),
    ("(" * 150 + "1" + ")" * 150, "at most 200"),
])
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(expression, message):
  with pytest.raises(calculator.CalculatorError) as error:
    calculator.evaluate(expression)
  assert message in str(error.value)
  assert calculator.answer_call({"expression": expression}).startswith("error: ")


def test_the_calculator_answers_calls_malformed_calls_and_final_answers():
  episode = calculator.Calculator("what is 123 * 45?", "5535")
  assert episode.start() == [{"role": "user", "content": "what is 123 * 45?"}]
  step = episode.step(environments.model_turn(CALL, True, 1))
  assert step == environments.Step([{"role": "tool", "content": "5535"}], 0.0, False)
  bad = episode.step(environments.model_turn('<tool_call>{"name": calculator}</tool_call>', True, 1))
  assert not bad.done and bad.messages[0]["content"].startswith("error: a tool call must be")
  other = episode.step(environments.model_turn('<tool_call>{"name": "python", "arguments": {}}</tool_call>', True, 1))
  assert other.messages[0]["content"] == "error: no tool named 'python'; the only tool is calculator"
  assert episode.step(environments.model_turn("#### 5535", True, 2)) == environments.Step([], 1.0, True)
  assert episode.step(environments.model_turn("#### 5536", True, 2)) == environments.Step([], 0.0, True)


# ---- an episode's layout with a scripted model ------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> chat.ChatTokenizer:
  directory = write_tokenizer(tmp_path_factory.mktemp("tools") / "tokenizer", without_markers(CHATML))
  return chat.load_chat_tokenizer(str(directory))


def _scripted(tokenizer, replies: list[str], seen: list[list[int]]) -> episodes.Generate:
  """A model that says replies[turn] (with the end token) in every row, recording its contexts."""
  eos = tokenizer.eos_token_id

  def generate(rows, row_params, max_new_tokens):
    turn = len(seen) // len(rows)
    seen.extend(list(r) for r in rows)
    out = list(tokenizer(replies[turn], add_special_tokens=False)["input_ids"]) + [eos]
    return [out[:max_new_tokens] for _ in rows], [[-0.5] * min(len(out), max_new_tokens) for _ in rows]
  return generate


def _limits(**extra) -> episodes.Limits:
  return episodes.Limits(**{**dict(max_turns=4, max_turn_tokens=200, max_context=400, max_episode_tokens=600), **extra})


def _params(turn: int) -> list[RowParams]:
  return [RowParams(1.0, 1.0, 0, turn * 10 + i) for i in range(2)]


def test_a_calculator_episode_keeps_the_rollouts_context_and_weighs_only_the_models_tokens(tokenizer):
  env = environments.Guarded("calculator", calculator.factory("answer"), 5.0)
  seen: list[list[int]] = []
  records = [(3, "what is 123 * 45?", {"answer": "5535"}), (4, "what is 123 * 45?", {"answer": "1"})]
  done = episodes.run(env, tokenizer, tokenizer.eos_token_id, records, _scripted(tokenizer, [CALL, "#### 5535"], seen),
                      _params, _limits())
  assert [e.reward for e in done] == [1.0, 0.0] and [e.turns for e in done] == [2, 2]
  assert [e.end for e in done] == ["done", "done"]
  episode = done[0]
  # The second turn's context is the prompt, the model's first turn, the tool's message: the row's tokens.
  assert seen[2] == episode.prompt_ids + episode.tokens[:len(seen[2]) - len(episode.prompt_ids)]
  messages = [{"role": "user", "content": "what is 123 * 45?"}, {"role": "assistant", "content": CALL},
              {"role": "tool", "content": "5535"}, {"role": "assistant", "content": "#### 5535"}]
  rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
  text = tokenizer.decode(episode.prompt_ids + episode.tokens, skip_special_tokens=False)
  # The fixture's end token is </s> and its template closes turns with <|im_end|>: the context holds both.
  assert text.replace("</s>", "") + "<|im_end|>\n" == rendered
  tool_ids = [t for t, m in zip(episode.tokens, episode.model_mask) if not m]
  assert "5535" in tokenizer.decode(tool_ids, skip_special_tokens=False)
  assert all(m for t, m in zip(episode.tokens, episode.model_mask) if t == tokenizer.eos_token_id)
  metrics = episodes.metrics(done, episodes.Timing())
  assert metrics["episodes/mean_turns"] == 2 and 0 < metrics["episodes/model_token_share"] < 1
  # Training rows: the targets that are the model's tokens weigh 1, the tool's (and the prompt's) 0.
  rows = rollouts.training_rows([e.prompt_ids for e in done], [e.tokens for e in done], 600,
                                [e.logps for e in done], [e.model_mask for e in done])
  start = len(episode.prompt_ids) - 1
  weights = rows["targets_segmentation"][0, start:start + len(episode.tokens)]
  assert weights.tolist() == [int(m) for m in episode.model_mask]
  assert rows["targets_segmentation"][0].sum() == sum(episode.model_mask) < len(episode.tokens)
  assert np.all(rows["sampler_logps"][0, start:start + len(episode.tokens)][~np.asarray(episode.model_mask)] == 0)


def test_limits_end_episodes(tokenizer):
  env = environments.Guarded("calculator", calculator.factory("answer"), 5.0)
  records = [(0, "what is 123 * 45?", {"answer": "5535"})] * 2
  turns = episodes.run(env, tokenizer, tokenizer.eos_token_id, records, _scripted(tokenizer, [CALL] * 4, []),
                       _params, _limits(max_turns=3))
  assert [(e.end, e.turns) for e in turns] == [("turns", 3)] * 2
  short = episodes.run(env, tokenizer, tokenizer.eos_token_id, records, _scripted(tokenizer, [CALL] * 4, []),
                       _params, _limits(max_context=120))
  assert [(e.end, e.turns) for e in short] == [("tokens", 1)] * 2
  assert all(all(e.model_mask) for e in short)  # the tool's answer would pass max_context: not appended


def test_an_opening_that_leaves_no_token_within_the_episode_limit_is_one_line(tokenizer):
  """rl_max_episode_tokens below the opening's length left a negative budget: the turn-batched path trained on
  an empty turn, the interleaved one on a token past the limit; now one line naming the limit."""
  env = environments.Guarded("calculator", calculator.factory("answer"), 5.0)
  records = [(5, "what is 123 * 45?", {"answer": "5535"})] * 2
  with pytest.raises(UserError) as error:
    episodes.run(env, tokenizer, tokenizer.eos_token_id, records, _scripted(tokenizer, [CALL] * 4, []), _params,
                 _limits(max_episode_tokens=8))
  assert "prompt record 5" in str(error.value) and "rl_max_episode_tokens=8" in str(error.value)


# ---- environments that misbehave: one line each -----------------------------------------------------

HOSTILE = '''
import sys, time

class Base:
  def __init__(self, prompt, **columns):
    self.prompt = prompt
  def start(self):
    return [{"role": "user", "content": self.prompt}]

class Raises(Base):
  def step(self, turn):
    raise ValueError("the sandbox is down\\nsecond line")

class Hangs(Base):
  def step(self, turn):
    time.sleep(30)

class Exits(Base):
  def step(self, turn):
    sys.exit(3)

class NotMessages(Base):
  def step(self, turn):
    return (["tool says hi"], 0.0, False)

class NotAStep(Base):
  def step(self, turn):
    return 5

class BadReward(Base):
  def step(self, turn):
    return ([], float("nan"), True)

class BadStart(Base):
  def start(self):
    return "hello"

class BadInit:
  def __init__(self, prompt, **columns):
    raise KeyError("answer")

class NotText(Base):
  def step(self, turn):
    return ([{"role": "tool", "content": b"\\xff".decode("utf-8", "surrogateescape")}], 0.0, False)

class ToolReply(Base):
  def step(self, turn):
    return ([{"role": "tool", "content": "4"}], 0.0, False)

class NotJson(Base):
  def step(self, turn):
    return ([{"role": "tool", "content": "4", "meta": {1, 2}}], 0.0, False)


class ToolsNotJson(Base):
  tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": int}}}]

  def step(self, turn):
    return ([], 0.0, True)


class ToolsRaise(Base):
  @property
  def tools(self):
    raise RuntimeError("the schema registry is down")

  def step(self, turn):
    return ([], 0.0, True)
'''


@pytest.fixture()
def hostile(tmp_path, monkeypatch) -> str:
  (tmp_path / "hostile_envs.py").write_text(HOSTILE)
  monkeypatch.syspath_prepend(str(tmp_path))
  return "hostile_envs"


@pytest.mark.parametrize("name, message", [
    ("Raises", "error: environment hostile_envs:Raises raised ValueError: the sandbox is down (in step, prompt record 7)"),
    ("Hangs", "error: environment hostile_envs:Hangs did not return within rl_environment_timeout_seconds=0.3 (in "
              "step, prompt record 7); make it faster or raise the limit"),
    ("Exits", "error: environment hostile_envs:Exits raised SystemExit: 3 (in step, prompt record 7)"),
    ("NotMessages", "error: environment hostile_envs:NotMessages: step returned a str as message 0 for prompt record 7; "
                    "it must return a list of messages"),
    ("NotAStep", "error: environment hostile_envs:NotAStep: step returned int for prompt record 7; it must return a "
                 "Step (messages, reward, done) or such a tuple"),
    ("BadReward", "error: environment hostile_envs:BadReward: step returned the reward nan for prompt record 7"),
    ("BadStart", "error: environment hostile_envs:BadStart: start returned str for prompt record 7"),
    ("NotText", "error: environment hostile_envs:NotText: step returned a content that is not text in message 0 (it "
                "holds an unpaired surrogate, which no tokenizer takes) for prompt record 7"),
    ("BadInit", "error: environment hostile_envs:BadInit raised KeyError: 'answer' (in creating the episode, prompt "
                "record 7)"),
    # an extra key JSON cannot hold: was taken, and a checkpoint of episodes made ahead failed on it (a traceback)
    ("NotJson", "error: environment hostile_envs:NotJson: step returned a message JSON cannot hold (TypeError: Object "
                "of type set is not JSON serializable) as message 0 for prompt record 7"),
    ("ToolsNotJson", "error: environment hostile_envs:ToolsNotJson: the episode's tools are not JSON (TypeError: "
                     "Object of type type is not JSON serializable) for prompt record 7; give JSON schemas"),
    # a tools property that raises was read outside the guard: a RuntimeError traceback
    ("ToolsRaise", "error: environment hostile_envs:ToolsRaise raised RuntimeError: the schema registry is down (in "
                   "tools, prompt record 7)"),
])
def test_an_environment_that_misbehaves_stops_in_one_line(tokenizer, hostile, name, message):
  path = f"{hostile}:{name}"
  env = environments.Guarded(path, environments.load(path), 0.3)
  with pytest.raises(UserError) as error:
    episodes.run(env, tokenizer, tokenizer.eos_token_id, [(7, "p", {}), (8, "q", {})],
                 _scripted(tokenizer, ["hi"] * 4, []), _params, _limits())
  assert f"error: {error.value}".startswith(message) and "\n" not in str(error.value)


GIL_HANG = """
import re, sys
from MaxText.rl import environments

class Backtracks:
  def step(self, turn):  # exponential backtracking in C, which holds the GIL for as long as it runs
    return re.match(r"(a+)+$", "a" * 60 + "b")

environments.BACKSTOP_GRACE_S = 0.5
guarded = environments.Guarded("gil_env:Backtracks", lambda **_: Backtracks(), 0.5)
guarded.step([Backtracks()], [environments.model_turn("hi", True, 1)], [7])
"""


def test_an_environment_stuck_holding_the_gil_ends_the_process_with_its_stack():
  """A call stuck in C code that holds the GIL stops every Python thread, the guard's timeout too: the run hung for
  good. faulthandler's timer needs no GIL: past the timeout and the grace it prints the stacks and exits (status 1)."""
  import subprocess

  done = subprocess.run([sys.executable, "-c", GIL_HANG], capture_output=True, text=True, timeout=120,
                        cwd=Path(__file__).parent.parent)
  assert done.returncode == 1 and "Timeout" in done.stderr and "in step" in done.stderr, done.stderr[-2000:]


def test_a_call_the_guard_reports_late_leaves_no_backstop_armed(monkeypatch):
  """The backstop is let go once the guard reports a call past its time (its thread may run on, the process too)."""
  monkeypatch.setattr(environments, "BACKSTOP_GRACE_S", 0.2)
  release = threading.Event()

  class Waits:
    def step(self, turn):
      release.wait(10)
      return ([], 0.0, True)

  env = environments.Guarded("waits", lambda **_: Waits(), 0.2)
  with pytest.raises(UserError, match="did not return within"):
    env.step([Waits(), Waits()], [environments.model_turn("hi", True, 1)] * 2, [7, 8])
  assert not environments._BACKSTOP._deadlines
  release.set()
  # The largest timeout the config takes (threading.TIMEOUT_MAX) plus the grace is past faulthandler's timer: capped.
  env = environments.Guarded("slow", lambda **_: Waits(), threading.TIMEOUT_MAX)
  assert env.step([Waits()], [environments.model_turn("hi", True, 1)], [7])[0].done


def test_numpy_scalars_are_a_steps_reward_and_done():
  """An environment scoring with numpy (np.float32, np.int64, np.bool_) was refused: 'the reward 0.5 ... must be a
  finite number'; a numpy nan is still refused."""
  class Episode:
    def __init__(self, reward, done):
      self.answer = ([{"role": "tool", "content": "ok"}], reward, done)

    def step(self, turn):
      return self.answer

  env = environments.Guarded("numpy_env", lambda **_: None, 5.0)
  turn = environments.model_turn("hi", True, 1)
  steps = env.step([Episode(np.float32(0.5), np.bool_(True)), Episode(np.int64(2), np.bool_(False))], [turn] * 2,
                   [7, 8])
  assert [(s.reward, s.done) for s in steps] == [(0.5, True), (2.0, False)]
  assert all(type(s.reward) is float and type(s.done) is bool for s in steps)
  with pytest.raises(UserError, match=r"step returned the reward np.float32\(nan\) for prompt record 7"):
    env.step([Episode(np.float32("nan"), True)], [turn], [7])
  with pytest.raises(UserError, match=r"step returned the reward np.True_ for prompt record 7"):
    env.step([Episode(np.bool_(True), True)], [turn], [7])


def test_a_chat_template_that_refuses_the_environments_messages_stops_in_one_line(hostile, tmp_path):
  """A template without a tool role (it raises, as Llama 2's and Mistral's do) was a TemplateError traceback."""
  refusing = ("{%- for m in messages %}{%- if m['role'] == 'tool' %}{{ raise_exception('no tool role') }}{%- endif %}"
              "{{ m['role'] + ': ' + m['content'] + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}assistant: "
              "{%- endif %}")
  refuses = chat.load_chat_tokenizer(str(write_tokenizer(tmp_path / "refusing", refusing)))
  path = f"{hostile}:ToolReply"
  env = environments.Guarded(path, environments.load(path), 5.0)
  with pytest.raises(UserError) as error:
    episodes.run(env, refuses, refuses.eos_token_id, [(7, "p", {})], _scripted(refuses, ["hi"] * 4, []), _params,
                 _limits())
  assert str(error.value).startswith("the chat template cannot render an episode's messages (roles user, assistant, "
                                     "tool): TemplateError: no tool role") and "\n" not in str(error.value), error.value


@pytest.mark.parametrize("path, message", [
    ("no_such_module_here:Env", "rl_environment no_such_module_here:Env: cannot import no_such_module_here"),
    ("hostile_envs:Missing", "rl_environment hostile_envs:Missing: hostile_envs has no callable 'Missing'"),
    ("calculatr", "rl_environment='calculatr' is neither a built-in (calculator) nor a package.module:Name path"),
])
def test_an_environment_that_cannot_load_is_a_config_error(hostile, path, message):
  with pytest.raises(ConfigError) as error:
    environments.load(path)
  assert message in str(error.value)


@pytest.mark.parametrize("overrides, message", [
    (dict(rl_max_turns=0), "rl_max_turns must be >= 1"),
    (dict(rl_environment_timeout_seconds=0), "rl_environment_timeout_seconds must be > 0"),
    (dict(rl_environment_timeout_seconds=float("inf")), "rl_environment_timeout_seconds must be > 0 and at most "
     f"{threading.TIMEOUT_MAX:.0f} (the most one call of the environment may take; a thread waits no longer), got inf"),
    (dict(rl_max_episode_tokens=40), "rl_max_episode_tokens=40 must be in [0, max_target_length + 1 = 17]"),
])
def test_environment_configuration_errors(tiny_overrides, overrides, message):
  with pytest.raises(ConfigError) as error:
    Config.for_testing(**{**tiny_overrides, **GRPO, "rl_environment": "calculator", **overrides})
  assert message in str(error.value)


def test_an_environment_stands_in_for_reward_functions(tiny_overrides):
  config = Config.for_testing(**{**tiny_overrides, **GRPO, "rl_environment": "calculator", "reward_functions": "[]"})
  assert config.rl.reward_functions == () and config.rl.rl_environment == "calculator"


# ---- the loss sees the model's tokens only ---------------------------------------------------------

def _episode_batch(seed: int = 0):
  """Two rows of prompt, model turn, tool output, model turn; the mask is 1 on the model's targets."""
  rng = np.random.default_rng(seed)
  B, L = 3, 12
  mask = np.zeros((B, L), np.float32)
  mask[0, 2:5] = mask[0, 8:10] = 1  # prompt 0-1, turn 2-4, tool 5-7, turn 8-9
  mask[1, 1:3] = mask[1, 6:11] = 1
  mask[2, 3:7] = 1  # one turn
  logps = rng.normal(-1.0, 0.3, (B, L)).astype(np.float32)
  old = (logps + rng.normal(0, 0.3, (B, L))).astype(np.float32)
  ref = (logps + rng.normal(0, 0.2, (B, L))).astype(np.float32)
  advantages = rng.normal(0, 1, B).astype(np.float32)
  return mask, logps, old, ref, advantages


def _loss(logps, old, ref, advantages, mask, loss_type, beta=0.04, max_completion_length=10):
  sums = grpo_loss.loss_sums(jnp.asarray(logps), jnp.asarray(old), jnp.asarray(ref), jnp.asarray(advantages),
                             jnp.asarray(mask), None, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28,
                             beta=beta, max_completion_length=max_completion_length)
  return sums["loss_sum"] / grpo_loss.divisor(sums, loss_type)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_tool_output_tokens_get_zero_loss_weight(tokenizer, loss_type):
  """Through the rows an episode gives: the loss's gradient is 0 at the tool's tokens, whatever their log-probs."""
  env = environments.Guarded("calculator", calculator.factory("answer"), 5.0)
  done = episodes.run(env, tokenizer, tokenizer.eos_token_id, [(0, "what is 123 * 45?", {"answer": "5535"})] * 2,
                      _scripted(tokenizer, [CALL, "#### 5535"], []), _params, _limits())
  rows = rollouts.training_rows([e.prompt_ids for e in done], [e.tokens for e in done], 600,
                                [e.logps for e in done], [e.model_mask for e in done])
  mask = rows["targets_segmentation"].astype(np.float32)
  rng = np.random.default_rng(1)
  logps = rng.normal(-1, 0.3, mask.shape).astype(np.float32)
  gradient = jax.grad(lambda lp: _loss(lp, logps + 0.1, logps - 0.1, np.asarray([1.0, -0.5], np.float32), mask,
                                       loss_type))(jnp.asarray(logps))
  start = len(done[0].prompt_ids) - 1
  tool = start + np.flatnonzero(~np.asarray(done[0].model_mask))
  model = start + np.flatnonzero(np.asarray(done[0].model_mask))
  assert tool.size and np.all(np.asarray(gradient)[0, tool] == 0) and np.all(np.asarray(gradient)[0, model] != 0)


def _verl_reference(logps, old, ref, advantages, response_mask, mode, beta, eps_low=0.2, eps_high=0.28,
                    max_len=10):
  """verl's agent loop rule (verl/trainer/ppo/core_algos.py: compute_policy_loss and agg_loss with the
  agent loop's response_mask, 0 on tool responses; the k3 "low_var_kl" KL aggregated with the same
  mask), written here in numpy: token-mean is DAPO's, seq-mean-token-mean GRPO's; Dr. GRPO divides
  the masked sum by sequences x max_completion_length."""
  a = advantages[:, None]
  ratio = np.exp(logps - old)
  pg = np.maximum(-a * ratio, -a * np.clip(ratio, 1 - eps_low, 1 + eps_high))
  kl = np.exp(ref - logps) - (ref - logps) - 1
  per_token = pg + beta * kl
  masked = per_token * response_mask
  if mode == "token-mean":
    return masked.sum() / response_mask.sum()
  if mode == "seq-mean-token-mean":
    return np.mean(masked.sum(-1) / response_mask.sum(-1))
  return masked.sum() / (len(logps) * max_len)


@pytest.mark.parametrize("loss_type, mode", [("dapo", "token-mean"), ("grpo", "seq-mean-token-mean"),
                                             ("dr_grpo", "seq-sum-max-length")])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_the_loss_equals_verls_masking_rule_on_fixed_inputs(loss_type, mode, beta):
  mask, logps, old, ref, advantages = _episode_batch()
  ours = float(_loss(logps, old, ref, advantages, mask, loss_type, beta))
  reference = _verl_reference(logps.astype(np.float64), old, ref, advantages, mask, mode, beta)
  assert ours == pytest.approx(reference, rel=1e-5)
  # Changing what the tool's tokens score changes nothing.
  noisy = np.where(mask == 0, logps + 5.0, logps)
  assert float(_loss(noisy, old, ref, advantages, mask, loss_type, beta)) == pytest.approx(ours, rel=1e-6)


# ---- a 2-turn episode on a random tiny model, end to end ---------------------------------------------

TWO_TURNS = '''
class TwoTurns:
  """Turn 1 gets a tool message; turn 2 ends the episode, rewarded by its length."""
  def __init__(self, prompt, **columns):
    self.prompt = prompt
  def start(self):
    return [{"role": "user", "content": self.prompt}]
  def step(self, turn):
    if turn.turn == 1:
      return ([{"role": "tool", "content": "lazy dog"}], 0.0, False)
    return ([], float(len(turn.text) % 3), True)
'''


@pytest.mark.parametrize("layout, train", [("same_mesh", False), pytest.param("same_mesh", True, marks=pytest.mark.slow),
                                           pytest.param("rollout_mesh", True, marks=pytest.mark.slow),
                                           pytest.param("paged", True, marks=pytest.mark.slow)])
def test_a_two_turn_episode_on_a_random_model(tiny_overrides, tmp_path, monkeypatch, layout, train):
  """The rollout (default suite); with `train`, the step on its batch, where the trainer's log-probs of
  the sampled tokens must be the engine's: the recorded layout is the rollout's context."""
  from MaxText.training import run_assembly  # noqa: PLC0415 - heavy, this test only
  write_tokenizer(tmp_path / "tokenizer", without_markers(CHATML))
  (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": w}) + "\n"
                                                  for w in ("the quick", "brown fox")))
  (tmp_path / "two_turns.py").write_text(TWO_TURNS)
  monkeypatch.syspath_prepend(str(tmp_path))
  # paged: the interleaved episodes' slots continue their contexts (rl/interleaved_episodes.py)
  extra = {"rollout_mesh": dict(rl_rollout_devices=4), "paged": dict(kv_cache_layout="paged")}.get(layout, {})
  config = Config.for_testing(**{
      **tiny_overrides, **GRPO, "vocab_size": 256, "tokenizer_path": str(tmp_path / "tokenizer"),
      "hf_data_files": str(tmp_path / "prompts.jsonl"), "reward_functions": "[]", "rl_environment": "two_turns:TwoTurns",
      "max_prefill_predict_length": 64, "max_completion_length": 6, "max_target_length": 72, "dtype": "float32",
      "rl_importance_sampling": "token_truncate", **extra})
  run = run_assembly.build_run(config, devices=rollout_mesh.training_devices(config))
  state = run.init_state()
  data = rollouts.RolloutBatches(config, run.mesh, run.batch_sharding)
  batch, scalars = data.next_for(state)
  assert scalars["episodes/mean_turns"] == 2.0 and scalars["episodes/done_ratio"] == 1.0, {k: v for k, v in scalars.items() if "episodes" in k}
  assert 0 < scalars["episodes/model_token_share"] < 1
  weights = np.asarray(batch["targets_segmentation"])
  rows = config.data.global_batch_size
  assert weights.sum(axis=1).tolist() == [12] * rows  # two turns of 6 sampled tokens each (a random model never ends)
  if not train:
    return
  state, metrics = run.train_step(state, batch, jax.random.key(0))
  assert np.isfinite(float(metrics["loss"])) and float(metrics["num_tokens"]) == 12 * rows
  # The trainer's recompute sees the rollout's context: its log-probs of the sampled tokens are the engine's.
  assert float(metrics["sampling/sampling_logp_difference/max"]) < 2e-3
