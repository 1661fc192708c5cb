"""GRPO against reward functions and prompt files that misbehave: a function that mutates its
arguments, exits, returns huge values; weights that are not numbers; prompts the tokenizer cannot
render or whose columns clash with the call's own arguments; a function that never returns in the
first rollout. Each ends in the right result or one clear error. The seeded campaign over all of
them through train.py is tests/chaos/test_grpo_chaos.py (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "input_pipeline"))
from sft_fixtures import CHATML, without_markers, write_tokenizer  # noqa: E402

from MaxText.configuration.config import Config  # noqa: E402
from MaxText.errors import ConfigError, UserError  # noqa: E402
from MaxText.rl import prompts, rewards  # noqa: E402
from tests.test_grpo_run import REPO_ROOT, _command, _env, workdir  # noqa: E402,F401 - the run fixture

GRPO = dict(objective="grpo", dataset_type="hf", hf_data_files="prompts.jsonl", tokenizer_type="huggingface",
            tokenizer_path="tokenizer", eval_interval=-1, reward_functions="exact_match", num_generations=4,
            max_prefill_predict_length=8, max_completion_length=6, max_target_length=16)


def _reward_set(tiny_overrides, tmp_path, monkeypatch, source: str, **extra) -> rewards.RewardSet:
  module = f"hostile_{abs(hash(source))}"  # a module of its own per case (imports are cached)
  (tmp_path / f"{module}.py").write_text(source)
  monkeypatch.syspath_prepend(str(tmp_path))
  functions = extra.pop("reward_functions", f"{module}:f").replace("MOD", module)
  config = Config.for_testing(**{**tiny_overrides, **GRPO, "reward_functions": functions, **extra})
  return rewards.RewardSet(config.rl, eos_id=2)


# ---- 1: what a reward function does to its arguments does not reach training --------------------

MUTATE = """
def f(prompts, completions, completion_ids, answer, **kw):
  for ids in completion_ids:
    ids.clear()
  completion_ids.append([99])
  completions[:] = []
  prompts[0]["content"] = "changed"
  answer.clear()
  return [1.0, 0.0]

def g(prompts, completions, completion_ids, answer, **kw):  # sees the arguments as they were
  assert completion_ids == [[5, 2], [6]] and completions == ["ab", "7"] and answer == ["x", "7"], completion_ids
  assert prompts[0] == {"role": "user", "content": "p"}, prompts
  return [0.5, 0.5]
"""


def test_a_reward_function_that_mutates_its_arguments_changes_nothing_else(tiny_overrides, tmp_path, monkeypatch):
  reward_set = _reward_set(tiny_overrides, tmp_path, monkeypatch, MUTATE, reward_functions="MOD:f,MOD:g")
  prompt_values = [{"role": "user", "content": "p"}, {"role": "user", "content": "p"}]
  completions, completion_ids, columns = ["ab", "7"], [[5, 2], [6]], {"answer": ["x", "7"]}
  scores = reward_set.score(prompt_values, completions, completion_ids, columns, [3, 3])
  assert scores.total.tolist() == [1.5, 0.5]
  # The rollout builds the training rows from these after scoring: they are as generated.
  assert completion_ids == [[5, 2], [6]] and completions == ["ab", "7"] and columns == {"answer": ["x", "7"]}
  assert prompt_values[0] == {"role": "user", "content": "p"}


# ---- 2: an exit from the user's code is an error naming the function ------------------------------

@pytest.mark.parametrize("body, kind", [("import sys; sys.exit(0)", "SystemExit"),
                                        ("raise SystemExit('bye')", "SystemExit"),
                                        ("raise GeneratorExit()", "GeneratorExit")])
def test_a_reward_function_that_exits_is_an_error_naming_it(tiny_overrides, tmp_path, monkeypatch, body, kind):
  reward_set = _reward_set(tiny_overrides, tmp_path, monkeypatch, f"def f(**kw):\n  {body}\n")
  with pytest.raises(UserError) as error:
    reward_set.score(["p", "q"], ["a", "b"], [[1], [2]], {}, [9, 7])
  assert f"reward function {reward_set.names[0]} raised {kind}" in str(error.value)
  assert "prompt records 7, 9" in str(error.value)  # in order, not the rollout's shuffled first..last


@pytest.mark.parametrize("body, message", [
    ("return [[1.0], [0.0]]", "returned an array of shape (2, 1) for 2 completions"),
    ("return None", "returned a scalar for 2 completions"),
    ("return {'a': 1}", "returned dict, not a list of floats"),
    ("return [Exits(), Exits()]", "raised SystemExit: 3"),  # the exit comes while the values are read
    # Was "returned nan for completion 1": numpy reads None as nan.
    ("return [1.0, None]", "returned None for completion 1 (prompt record 7); rewards must be finite numbers"),
    # Was taken: float64 dropped the imaginary parts (with only a ComplexWarning).
    ("import numpy; return numpy.array([1 + 2j, 0j])", "returned complex numbers (complex128)"),
])
def test_a_reward_function_that_returns_the_wrong_thing_is_an_error_naming_it(tiny_overrides, tmp_path, monkeypatch,
                                                                               body, message):
  source = f"import sys\nclass Exits:\n  def __float__(self):\n    sys.exit(3)\ndef f(**kw):\n  {body}\n"
  reward_set = _reward_set(tiny_overrides, tmp_path, monkeypatch, source)
  with pytest.raises(UserError) as error:
    reward_set.score(["p", "q"], ["a", "b"], [[1], [2]], {}, [9, 7])
  assert f"reward function {reward_set.names[0]} {message}" in str(error.value), str(error.value)


# ---- 3: huge finite rewards -------------------------------------------------------------------------

@pytest.mark.parametrize("scale", [1.0, 1e150, 1e308])
@pytest.mark.parametrize("scaling", ["group", "batch"])
def test_advantages_do_not_depend_on_the_rewards_scale(scale, scaling):
  base = np.asarray([1.0, -1.0, 1.0, 0.5, 0.25, -1.0, 0.0, 1.0])
  advantages, group_std = rewards.advantages(base * scale, 4, scaling)
  expected, _ = rewards.advantages(base, 4, scaling)
  assert np.all(np.isfinite(advantages)) and np.all(group_std > 0)
  np.testing.assert_allclose(advantages, expected, rtol=1e-3)
  metrics = rewards.reward_metrics(rewards.Scores(base * scale, {"f": base * scale}), group_std, advantages)
  assert metrics["frac_reward_zero_std"] == 0.0 and np.isfinite(metrics["advantage_std"])
  assert all(np.isfinite(v) for v in metrics.values()), metrics


def test_a_weighted_sum_beyond_float_range_is_an_error_naming_the_functions(tiny_overrides, tmp_path, monkeypatch):
  reward_set = _reward_set(tiny_overrides, tmp_path, monkeypatch, "def f(**kw):\n  return [1e308, 0.0]\ng = f\n",
                           reward_functions="MOD:f,MOD:g", reward_weights="1,1")
  with pytest.raises(UserError) as error:
    reward_set.score(["p", "q"], ["a", "b"], [[1], [2]], {}, [7, 9])
  assert "the weighted sum of reward functions" in str(error.value) and "completion 0 (prompt record 7)" \
      in str(error.value), str(error.value)


def test_unscaled_advantages_beyond_the_bound_are_an_error():
  with pytest.raises(UserError) as error:
    rewards.advantages(np.asarray([1e300, -1e300, 0.0, 0.0]), 4, "none", ["mine:f"])
  assert "grpo_scale_rewards=none an advantage (the weighted reward of reward functions mine:f minus its group's " \
         "mean) is 1e+300, beyond the 1e+06" in str(error.value), str(error.value)
  np.testing.assert_array_equal(rewards.advantages(np.asarray([3.0, 1.0, 2.0, 2.0]), 4, "none")[0], [1, -1, 0, 0])


@pytest.mark.parametrize("value", ["float('inf')", "float('-inf')", "float('nan')"])
def test_non_finite_rewards_are_an_error_naming_the_function(tiny_overrides, tmp_path, monkeypatch, value):
  reward_set = _reward_set(tiny_overrides, tmp_path, monkeypatch, f"def f(**kw):\n  return [0.0, {value}]\n")
  with pytest.raises(UserError) as error:
    reward_set.score(["p", "q"], ["a", "b"], [[1], [2]], {}, [7, 9])
  assert f"reward function {reward_set.names[0]} returned" in str(error.value) and "rewards must be finite" \
      in str(error.value)


# ---- 4: weights ------------------------------------------------------------------------------------

def test_a_reward_function_listed_twice_is_a_config_error(tiny_overrides):
  # Its scores are keyed by name: the second listing would vanish with its weight.
  with pytest.raises(ConfigError) as error:
    Config.for_testing(**{**tiny_overrides, **GRPO, "reward_functions": "exact_match,exact_match",
                          "reward_weights": "1,2"})
  assert "reward_functions lists exact_match twice" in str(error.value), str(error.value)


@pytest.mark.parametrize("weights", ["1,nan", "inf,1", "1,-inf", "1,heavy"])
def test_reward_weights_must_be_finite(tiny_overrides, weights):
  with pytest.raises(ConfigError) as error:
    Config.for_testing(**{**tiny_overrides, **GRPO, "reward_functions": "exact_match,length_penalty",
                          "reward_weights": weights})
  assert "reward_weights must be finite numbers" in str(error.value), str(error.value)


# ---- 6, 7: prompt files -------------------------------------------------------------------------------

def _prompt_set(tiny_overrides, tmp_path: Path, records: list[dict], template: str | None, **extra
                ) -> prompts.PromptSet:
  from MaxText.input_pipeline import chat

  tokenizer_dir = write_tokenizer(tmp_path / "tokenizer", template)
  data = tmp_path / "prompts.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in records))
  config = Config.for_testing(**{**tiny_overrides, **GRPO, "hf_data_files": str(data),
                                 "tokenizer_path": str(tokenizer_dir), "vocab_size": 320, "max_target_length": 64,
                                 "max_prefill_predict_length": 48, **extra})
  return prompts.PromptSet(config, chat.load_chat_tokenizer(str(tokenizer_dir), require_template=False))


def test_message_prompts_without_a_chat_template_are_one_error(tiny_overrides, tmp_path):
  records = [{"prompt": "the quick fox"}, {"prompt": [{"role": "user", "content": "the quick fox"}]}]
  with pytest.raises(ConfigError) as error:
    _prompt_set(tiny_overrides, tmp_path, records, template=None)
  message = str(error.value)
  assert message.startswith("prompt record 1 of ") and "has no chat template" in message \
      and "objective=grpo with message-list prompts" in message and "\n" not in message, message
  assert len(_prompt_set(tiny_overrides, tmp_path / "with", records, without_markers(CHATML)).prompts) == 2


@pytest.mark.parametrize("prompt, template, problem", [
    # Content parts, which this template adds to a string (null content is refused before the template: test_sft_data)
    ([{"role": "user", "content": [{"type": "text", "text": "the quick fox"}]}], None,
     "the prompt's messages: TypeError"),
    ("the quick fox", "{{ raise_exception('no system turn') }}", "TemplateError: no system turn"),
], ids=["content-parts", "template-raises"])
def test_a_prompt_the_chat_template_fails_on_is_one_error_naming_the_record(tiny_overrides, tmp_path, prompt,
                                                                             template, problem):
  """Was: the template's TypeError / TemplateError as a traceback (SFT's records already said it in one line)."""
  records = [{"prompt": "the lazy dog"}, {"prompt": prompt}] if template is None else [{"prompt": prompt}]
  with pytest.raises(UserError) as error:
    _prompt_set(tiny_overrides, tmp_path, records, template or without_markers(CHATML))
  message = str(error.value)
  assert message.startswith(f"prompt record {len(records) - 1} of ") and "the chat template cannot render" in message \
      and problem in message and "\n" not in message, message


def test_a_prompt_message_whose_content_is_not_text_is_named_as_a_grpo_field(tiny_overrides, tmp_path):
  """Was: named as an "sft field" (the check is shared with SFT and DPO)."""
  records = [{"prompt": "the lazy dog"}, {"prompt": [{"role": "user", "content": 7}]}]
  with pytest.raises(UserError) as error:
    _prompt_set(tiny_overrides, tmp_path, records, without_markers(CHATML))
  message = str(error.value)
  assert message.startswith("prompt record 1 of ") and "grpo field 'prompt': message 0 (role 'user'): its content is 7" \
      in message and "\n" not in message, message


@pytest.mark.parametrize("column", ["completions", "prompts", "completion_ids"])
def test_a_column_named_like_a_reward_argument_is_one_error_naming_it(tiny_overrides, tmp_path, column):
  records = [{"prompt": "the quick fox", "answer": "dog"}, {"prompt": "the lazy dog", column: [1, 2]}]
  with pytest.raises(UserError) as error:
    _prompt_set(tiny_overrides, tmp_path, records, template=None)
  message = str(error.value)
  assert f"hf json files {tmp_path / 'prompts.jsonl'} has a column named {column!r} (prompt record " in message \
      and "rename the column in the file" in message, message


# ---- 5: a reward function that never returns in the first rollout ------------------------------------

def test_the_watchdog_guards_the_first_batch(capsys):
  from MaxText.training.health import StepWatchdog, activity

  exits: list[int] = []
  watchdog = StepWatchdog(0.5, exit=exits.append)
  with watchdog.guard("the first rollout's reward functions"):
    time.sleep(0.1)  # finished in time
  time.sleep(1.0)  # not armed again until the first step finishes: compiling it is not a hang
  assert not exits
  with watchdog.guard("the first rollout's reward functions"), activity("reward function slow:f"):
    time.sleep(1.5)
  assert exits == [StepWatchdog.EXIT_CODE]
  err = capsys.readouterr().err
  assert "error: the first rollout's reward functions did not finish in step_timeout_seconds=0.5 (in reward " \
         "function slow:f); Python stacks above" in err, err
  watchdog.on_end(None, None)  # type: ignore[arg-type]


def test_the_watchdog_is_armed_once_the_first_step_is_dispatched(capsys):
  """The trainer finishes step 1 (on_step) only after step 2 is dispatched, so step 2's rollout and
  its reward functions run before it: armed at on_step, a hang there went unnoticed for good."""
  from MaxText.training.health import StepWatchdog, activity

  exits: list[int] = []
  watchdog = StepWatchdog(0.5, exit=exits.append)
  assert watchdog.due(13)  # a run resumed at step 12 dispatched (and compiled) its first step
  with activity("reward function slow:f"):
    time.sleep(1.5)  # step 14's rollout
  assert exits == [StepWatchdog.EXIT_CODE]
  assert "error: no step finished in step_timeout_seconds=0.5 after step 12 on this process; every process started " \
         "step 13; this process is in reward function slow:f; Python stacks above" in capsys.readouterr().err


class _SlowFirstBatch:
  """Data whose first batch never comes (a reader that hangs)."""

  def peek(self) -> None:
    time.sleep(30)


class _Rollouts:
  """Rollouts that record the guard the run hands their first batch."""

  def __init__(self, *args: object) -> None:
    self.guards: list[object] = []

  def prime(self, state: object, guard: object = None) -> None:
    self.guards.append(guard)

  def next_for(self, state: object) -> None: ...

  def get_state(self) -> None: ...


def test_the_run_guards_its_first_batch_with_the_watchdog(monkeypatch, capsys):
  from MaxText import train
  from MaxText.training.health import StepWatchdog

  exits: list[int] = []
  watchdog = StepWatchdog(0.5, exit=exits.append)
  start = SimpleNamespace(data_state=None, state=None)
  reader = SimpleNamespace(objective=SimpleNamespace(uses_rollouts=False), data_iterator=_SlowFirstBatch,
                           config=SimpleNamespace(data=SimpleNamespace(reuse_example_batch=False)))  # read once the batch ends
  threading.Thread(target=train.open_data, args=(reader, start, watchdog), daemon=True).start()
  for _ in range(100):
    if exits:
      break
    time.sleep(0.1)
  assert exits == [StepWatchdog.EXIT_CODE]
  assert "error: reading the first batch did not finish in step_timeout_seconds=0.5" in capsys.readouterr().err
  monkeypatch.setattr(train, "RolloutBatches", _Rollouts)
  rollouts = train.open_data(SimpleNamespace(objective=SimpleNamespace(uses_rollouts=True), config=None, mesh=None,
                                             batch_sharding=None), start, watchdog)
  assert rollouts.guards == [watchdog.guard]  # RolloutBatches.prime scores inside it (the slow test below)


HANG = "import time\ndef f(**kw):\n  time.sleep(3600)\n"


@pytest.mark.slow  # a train.py process that compiles the rollout engine
def test_a_reward_function_that_never_returns_in_the_first_rollout_ends_the_run(workdir, tmp_path):
  """Through train.py, with its own hard timeout: the watchdog fires in the first rollout."""
  (workdir / "hang_rewards.py").write_text(HANG)
  command = _command(workdir, tmp_path, "steps=2", "step_timeout_seconds=3", "reward_functions=hang_rewards:f")
  try:
    proc = subprocess.run(command, cwd=REPO_ROOT, env=_env(workdir, 2), capture_output=True, text=True, timeout=300)
  except subprocess.TimeoutExpired:
    pytest.fail("the run hung in the reward function past step_timeout_seconds")
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
  assert proc.returncode == 4 and len(errors) == 1, proc.stderr[-3000:]
  assert "the first rollout's reward functions did not finish in step_timeout_seconds=3 (in reward function " \
         "hang_rewards:f)" in errors[0], errors
  assert "hang_rewards.py" in proc.stderr  # its stack shows the line it is stuck in
  assert not (tmp_path / "grpo" / "config.yml").exists()


@pytest.mark.slow  # a train.py process that compiles the rollout engine, without the compilation cache
def test_compiling_the_engine_in_the_first_environment_rollout_is_no_hang(workdir, tmp_path):
  """An environment's first rollout generates inside the watchdog's guard, and generating first compiles the
  engine: step_timeout_seconds shorter than that compilation ended every start with exit 4, a hang that was
  none. The run's own compilations happen with the deadline passed (the note), and it trains to the end."""
  command = _command(workdir, tmp_path, "steps=2", "step_timeout_seconds=1", "rl_environment=task_envs:TwoTurns",
                     "rl_max_turns=2")
  env = {k: v for k, v in _env(workdir, 2).items() if not k.startswith("JAX_")} | {"JAX_PLATFORMS": "cpu"}
  proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "note: step_timeout_seconds=1 passed while thread MainThread compiles a JAX function" in proc.stderr
