"""Multi-turn episodes interleaved in the engine (rl/interleaved_episodes.py) on a random tiny model:
while one episode's environment sleeps the other slots keep decoding; greedy episodes equal the
turn-batched path's (rl/episodes.py) token for token, on the dense cache (whole context prefilled
again) and the paged one (only the appended tokens prefilled into the held slot); sampled episodes
do not depend on which environment was slow; and a misbehaving environment still stops in one line."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "input_pipeline"))
from sft_fixtures import CHATML, without_markers, write_tokenizer  # noqa: E402

from MaxText.configuration.config import Config  # noqa: E402
from MaxText.errors import UserError  # noqa: E402
from MaxText.inference.engine import Engine  # noqa: E402
from MaxText.inference.sampling import RowParams  # noqa: E402
from MaxText.input_pipeline import chat  # noqa: E402
from MaxText.rl import environments, episodes, interleaved_episodes, rollouts  # noqa: E402

ROWS = 4
LIMITS = episodes.Limits(max_turns=3, max_turn_tokens=5, max_context=88, max_episode_tokens=96)


class Sleepy:
  """Two tool messages, then done; episode `slow` sleeps in its first step. The reward reads the turns."""

  slow = 0
  seconds = 0.0

  def __init__(self, prompt: str, index: int, **columns):
    self.prompt, self.index = prompt, index

  def start(self):
    return [{"role": "user", "content": self.prompt}]

  def step(self, turn: environments.ModelTurn) -> environments.Step:
    if turn.turn == 1 and self.index == Sleepy.slow:
      time.sleep(Sleepy.seconds)
    if turn.turn < 3:
      return environments.Step([{"role": "tool", "content": str(turn.turn)}], 0.0, False)
    return environments.Step([], float(len(turn.text) % 5), True)


class Raises(Sleepy):
  def step(self, turn):
    if self.index == 2:
      raise ValueError("the tool broke")
    return super().step(turn)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> chat.ChatTokenizer:
  directory = write_tokenizer(tmp_path_factory.mktemp("interleaved") / "tokenizer", without_markers(CHATML))
  return chat.load_chat_tokenizer(str(directory))


def _engine(tiny_overrides: dict, **extra) -> tuple[Engine, object]:
  config = Config.for_testing(**{**tiny_overrides, "vocab_size": 256, "max_target_length": 96,
                                 "max_prefill_predict_length": 88, "dtype": "float32", **extra})
  engine = Engine(config, num_slots=ROWS)
  return engine, engine.load_params()


def _records() -> list:
  return [(i, ["fox", "dog", "cat", "owl"][i], {"index": i}) for i in range(ROWS)]


def _row_params(temperature: float):
  def params(turn: int) -> list[RowParams]:
    return [RowParams(temperature, 1.0, 0, 1000 * turn + row) for row in range(ROWS)]
  return params


def _run(engine, params, tokenizer, interleaved: bool, temperature: float = 0.0, slow: int = 0, seconds: float = 0.0,
         factory=Sleepy) -> tuple[list[episodes.Episode], episodes.Timing]:
  Sleepy.slow, Sleepy.seconds = slow, seconds
  env = environments.Guarded("sleepy", factory, 30.0)
  timing = episodes.Timing()
  eos = tokenizer.eos_token_id
  if interleaved:
    done = interleaved_episodes.run(env, tokenizer, eos, _records(), engine, params, _row_params(temperature), LIMITS,
                                    timing)
  else:
    done = episodes.run(env, tokenizer, eos, _records(), rollouts.padded_generate(engine, params, eos),
                        _row_params(temperature), LIMITS, timing)
  return done, timing


def _layout(done: list[episodes.Episode]) -> list:
  return [(e.tokens, e.model_mask, e.turns, e.end, e.reward) for e in done]


@pytest.mark.parametrize("layout", [pytest.param("dense", marks=pytest.mark.slow), "paged"])
def test_other_slots_decode_while_an_environment_sleeps_and_greedy_equals_turn_batches(tiny_overrides, tokenizer,
                                                                                        layout):
  engine, params = _engine(tiny_overrides, kv_cache_layout=layout, kv_page_size=8)
  assert engine.continues_slots == (layout == "paged")
  batched, _ = _run(engine, params, tokenizer, interleaved=False)
  assert [e.turns for e in batched] == [3] * ROWS and {e.end for e in batched} == {"done"}
  for seconds in (0.0, 1.0):  # the first run compiles the continuation's prefill, which would hide the sleep
    interleaved, timing = _run(engine, params, tokenizer, interleaved=True, slow=1, seconds=seconds)
    assert _layout(interleaved) == _layout(batched)
    np.testing.assert_allclose(np.concatenate([e.logps for e in interleaved]),
                               np.concatenate([e.logps for e in batched]), atol=1e-4)
  # Slot 1 slept after its first turn; the others decoded their second and third turns meanwhile.
  assert timing.overlapped_steps >= 2 * (LIMITS.max_turn_tokens - 1), timing


@pytest.mark.slow  # two more rollouts' compilations
@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_sampled_episodes_do_not_depend_on_which_environment_is_slow(tiny_overrides, tokenizer, layout):
  """Dense: the grown contexts answered together are prefilled in one call, whose rows must not change
  each other's numbers."""
  engine, params = _engine(tiny_overrides, kv_cache_layout=layout, kv_page_size=8)
  first, _ = _run(engine, params, tokenizer, interleaved=True, temperature=1.0, slow=0, seconds=0.5)
  second, timing = _run(engine, params, tokenizer, interleaved=True, temperature=1.0, slow=3, seconds=0.5)
  assert timing.overlapped_steps > 0 and len({len(e.tokens) for e in first}) > 1  # the slots' turns differ
  assert _layout(first) == _layout(second)
  assert [e.logps for e in first] == [e.logps for e in second]


@pytest.mark.slow  # a rollout's compilations
def test_an_environment_that_raises_while_others_decode_stops_in_one_line(tiny_overrides, tokenizer):
  engine, params = _engine(tiny_overrides)
  with pytest.raises(UserError, match=r"^environment sleepy raised ValueError: the tool broke \(in step, prompt "
                                      r"record 2\)$"):
    _run(engine, params, tokenizer, interleaved=True, factory=Raises)
