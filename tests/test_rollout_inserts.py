"""A rollout puts its prompts into their slots with one insert_rows call (one insert per prompt before),
and its completions and log-probabilities are those of an insert each."""

from __future__ import annotations

from MaxText.configuration.config import Config
from MaxText.inference.engine import Engine
from MaxText.inference.engine_api import InsertsRowsTogether
from MaxText.inference.sampling import RowParams
from MaxText.rl import rollouts
from tests.inference.decode_test_utils import count_calls, one_device_mesh

TINY = dict(base_emb_dim=32, base_num_query_heads=2, base_num_kv_heads=2, head_dim=16, base_mlp_dim=64,
            base_num_decoder_layers=1, vocab_size=64, max_target_length=32, max_prefill_predict_length=8,
            per_device_batch_size=1, print_config=False, dtype="float32", decode_steps_per_call=4)
PROMPTS = [[5, 9, 2], [7, 1, 3, 3, 8, 4, 4, 1], [11, 4], [2, 2, 6, 1, 9]]
ROWS = [RowParams(seed=0), RowParams(temperature=1.0, seed=7), RowParams(seed=1), RowParams(temperature=0.8, seed=3)]


class _OneByOne:
  """The engine without insert_rows: what a rollout did before (an insert per prompt)."""

  def __init__(self, engine: Engine):
    self._engine = engine

  def __getattr__(self, name):
    if name == "insert_rows":
      raise AttributeError(name)
    return getattr(self._engine, name)


def test_a_rollout_inserts_its_prompts_in_one_call_with_the_same_completions():
  engine = Engine(Config.for_testing(**TINY), num_slots=4, mesh=one_device_mesh())
  params = engine.load_params()
  calls = count_calls(engine, ["insert", "insert_rows"])
  plain = _OneByOne(engine)
  assert not isinstance(plain, InsertsRowsTogether)
  expected = rollouts.generate_scored(plain, params, PROMPTS, ROWS, max_new_tokens=7, eos_id=None)
  assert calls == {"insert": 4, "insert_rows": 0}
  calls.update(insert=0, insert_rows=0)
  assert rollouts.generate_scored(engine, params, PROMPTS, ROWS, max_new_tokens=7, eos_id=None) == expected
  assert calls == {"insert": 0, "insert_rows": 1}
