"""A rollout puts its prompts into their slots in one device call where the engine prefills into slots
(engine_api.PrefillsIntoSlots.prefill_insert; a prefill then one insert_rows before), and its completions,
log-probabilities and rewards are those of the two-call paths (prefill + insert_rows, prefill + an insert
per prompt): greedy and seeded rows, dense and paged caches, LoRA, and interleaved multi-turn episodes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "input_pipeline"))
from sft_fixtures import CHATML, without_markers, write_tokenizer  # noqa: E402

from MaxText.configuration.config import Config  # noqa: E402
from MaxText.inference.engine import Engine  # noqa: E402
from MaxText.inference.engine_api import InsertsRowsTogether, PrefillsIntoSlots  # noqa: E402
from MaxText.inference.sampling import RowParams  # noqa: E402
from MaxText.rl import rollouts  # noqa: E402
from tests.inference.decode_test_utils import Hiding, count_calls, one_device_mesh  # noqa: E402
from tests.test_grpo_tools import TWO_TURNS  # noqa: E402  (the 2-turn episode of the GRPO tool runs)

TINY = dict(base_emb_dim=32, base_num_query_heads=2, base_num_kv_heads=2, head_dim=16, base_mlp_dim=64,
            base_num_decoder_layers=1, vocab_size=64, max_target_length=32, max_prefill_predict_length=8,
            per_device_batch_size=1, print_config=False, dtype="float32", decode_steps_per_call=4)
PROMPTS = [[5, 9, 2], [7, 1, 3, 3, 8, 4, 4, 1], [11, 4], [2, 2, 6, 1, 9]]
ROWS = [RowParams(seed=0), RowParams(temperature=1.0, seed=7), RowParams(seed=1), RowParams(temperature=0.8, seed=3)]
LORA = dict(lora_rank=4, lora_target_modules="q_proj,v_proj")
# The engine's fresh state and decode calls; every other jitted call a rollout makes is an admission's.
NOT_ADMISSIONS = ("_init_state", "_generate", "_block")
# What each way of admitting calls on the device: one call now; two, or one plus an insert per prompt, before.
PATHS = {"prefill_insert": (), "insert_rows": ("prefill_insert",), "insert_each": ("prefill_insert", "insert_rows")}


def admissions(engine: Engine) -> dict[str, int]:
  """Live counts of the engine's jitted calls but NOT_ADMISSIONS."""
  return count_calls(engine, [name for name, value in vars(engine).items()
                              if hasattr(value, "lower") and name not in NOT_ADMISSIONS])


def with_adapters(params: Any) -> Any:
  """`params` with every LoRA leaf random: adapters that change the tokens (lora_b starts at zero)."""
  key = iter(jax.random.split(jax.random.key(3), 64))
  return jax.tree_util.tree_map_with_path(
      lambda path, x: 0.5 * jax.random.normal(next(key), x.shape, x.dtype)
      if getattr(path[-1], "key", None) in ("lora_a", "lora_b") else x, params)


@pytest.mark.parametrize("case", ["dense", "paged", pytest.param("lora", marks=pytest.mark.slow)])
def test_a_rollout_admits_its_prompts_in_one_device_call_with_the_same_completions(case):
  keys = {"dense": {}, "paged": dict(kv_cache_layout="paged", kv_page_size=4, prefix_caching="false"),
          "lora": LORA}[case]
  engine = Engine(Config.for_testing(**TINY, **keys), num_slots=4, mesh=one_device_mesh())
  params = engine.load_params(seed=1)
  if case == "lora":
    params = with_adapters(params)
  calls = admissions(engine)
  got = {}
  for path, hidden in PATHS.items():
    view = Hiding(engine, *hidden) if hidden else engine
    assert isinstance(view, PrefillsIntoSlots) == (path == "prefill_insert")
    assert isinstance(view, InsertsRowsTogether) == (path != "insert_each")
    got[path] = rollouts.generate_scored(view, params, PROMPTS, ROWS, max_new_tokens=7, eos_id=None)
    made = {name: n for name, n in calls.items() if n}
    calls.update({name: 0 for name in calls})
    assert made == {"prefill_insert": {"_prefill_insert": 1}, "insert_rows": {"_prefill": 1, "_insert_rows": 1},
                    "insert_each": {"_prefill": 1, "_insert": 4}}[path], (path, made)
  assert got["prefill_insert"] == got["insert_rows"] == got["insert_each"]  # tokens and log-probs, exactly
  completions = got["prefill_insert"][0]
  assert completions[1] != completions[3]  # seeded rows sampled (the greedy ones may agree)
  if case == "lora":  # the adapters took part
    assert rollouts.generate(engine, engine.load_params(seed=1), PROMPTS, ROWS, 7, None) != completions


IDS_REWARD = "def by_ids(completion_ids, **kwargs):\n  return [float(sum(c) % 7) for c in completion_ids]\n"


def untimed(scalars: dict[str, float]) -> dict[str, float]:
  """The metrics that do not depend on timing."""
  return {k: v for k, v in scalars.items() if not k.endswith("_s") and "idle" not in k and "overlapped" not in k}


@pytest.mark.slow  # a train run's rollouts, three ways
@pytest.mark.parametrize("case", ["completions", "lora", "interleaved_episodes"])
def test_a_grpo_batch_and_its_rewards_are_those_of_the_two_call_path(tiny_overrides, tmp_path, monkeypatch, case):
  """RolloutBatches (seeded sampling) with the engine as it is and without prefill_insert: the same batch
  (tokens, weights, sampler log-probs, advantages) and reward metrics; one device call per admission."""
  from MaxText.training import run_assembly  # noqa: PLC0415 - heavy, this test only
  from tests.test_grpo import GRPO  # noqa: PLC0415
  write_tokenizer(tmp_path / "tokenizer", without_markers(CHATML))
  (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": w}) + "\n"
                                                  for w in ("the quick", "brown fox", "jumps over", "a lazy dog")))
  (tmp_path / f"ids_reward_{case}.py").write_text(IDS_REWARD)
  (tmp_path / f"two_turns_{case}.py").write_text(TWO_TURNS)
  monkeypatch.syspath_prepend(str(tmp_path))
  extra = {"lora": LORA, "interleaved_episodes": dict(rl_environment=f"two_turns_{case}:TwoTurns",
                                                        rl_interleave_episodes=True)}.get(case, {})
  config = Config.for_testing(**{
      **tiny_overrides, **GRPO, "vocab_size": 256, "tokenizer_path": str(tmp_path / "tokenizer"),
      "hf_data_files": str(tmp_path / "prompts.jsonl"), "reward_functions": f"ids_reward_{case}:by_ids",
      "max_prefill_predict_length": 64, "max_completion_length": 6, "max_target_length": 72, "dtype": "float32",
      **extra})
  run = run_assembly.build_run(config)
  state = run.init_state()
  if case == "lora":
    state = state.replace(params=with_adapters(state.params))
  data = rollouts.RolloutBatches(config, run.mesh, run.batch_sharding)
  engine = data.engine
  calls = admissions(engine)
  start = data.get_state()
  batches = {}
  for path in ("prefill_insert", "insert_rows"):
    data.engine = Hiding(engine, *PATHS[path]) if PATHS[path] else engine
    data.set_state(start)
    batches[path] = data.next_for(state)
    made = {name for name, n in calls.items() if n}
    assert made == ({"_prefill_insert"} if path == "prefill_insert" else {"_prefill", "_insert_rows"}), (path, made)
    assert len(set(n for n in calls.values() if n)) == 1  # as many of each: per admission
    calls.update({name: 0 for name in calls})
  (ours, ours_scalars), (theirs, theirs_scalars) = batches.values()
  assert ours.keys() == theirs.keys()
  for name in ours:
    np.testing.assert_array_equal(np.asarray(ours[name]), np.asarray(theirs[name]), err_msg=name)
  assert untimed(ours_scalars) == untimed(theirs_scalars)
  assert ours_scalars["reward_std"] > 0  # the rewards differ between completions: they were compared


@pytest.mark.parametrize("steps_per_call", [1, 4])
def test_a_row_whose_cache_fills_first_ends_there(steps_per_call):
  """A row ends by length where its slot's cache does (an episode's turn asks every row for the largest
  budget): with several steps per call such a slot stopped on the device and the rollout waited for it
  for ever; with one, it read tokens from past its cache."""
  engine = Engine(Config.for_testing(**{**TINY, "max_target_length": 12, "decode_steps_per_call": steps_per_call}),
                  num_slots=4, mesh=one_device_mesh())
  params = engine.load_params(seed=1)
  decode_step, calls = engine.decode_step, [0]

  def bounded(*args, **kwargs):
    calls[0] += 1
    if calls[0] > 40:
      raise RuntimeError("40 decode calls: the rollout does not end")
    return decode_step(*args, **kwargs)

  engine.decode_step = bounded
  out, logps = rollouts.generate_scored(engine, params, PROMPTS, ROWS, max_new_tokens=20, eos_id=None)
  assert [len(o) for o in out] == [len(lp) for lp in logps] == [12 + 1 - len(p) for p in PROMPTS]
  short, _ = rollouts.generate_scored(engine, params, PROMPTS, ROWS, max_new_tokens=5, eos_id=None)
  assert [o[:5] for o in out] == short
