"""Weighted mixtures of data sources (data_mixture): proportions within sampling error, the weight
schedule, every process drawing the same rows and reading its own shard of each source, exact
resumption, per-source token counts, and one line for each bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from MaxText.configuration.config import Config
from MaxText.configuration.data_mixture import MixtureStage
from MaxText.errors import ConfigError
from MaxText.input_pipeline import check_sources, create_data_iterator, mixture, pipeline
from MaxText.platform import sharding
from tests.input_pipeline.data_fixtures import doc_id_encoder, numbered_documents

LENGTH = 16


@pytest.fixture(scope="module")
def second_corpus(tmp_path_factory) -> Path:
  """Another source: 30 documents as JSONL for dataset_type=hf."""
  path = tmp_path_factory.mktemp("code") / "code.jsonl"
  path.write_text("".join(json.dumps({"text": t.replace("doc", "code")}) + "\n" for t in numbered_documents(30)))
  return path


def _sources(prepared: Path, second: Path, a: float = 3, b: float = 1) -> list[dict]:
  return [dict(name="web", weight=a, grain_train_files=str(prepared / "arrayrecord" / "train.array_record")),
          dict(name="code", weight=b, dataset_type="hf", hf_data_files=str(second))]


def _values(spm_model: str, prepared: Path, second: Path, **overrides) -> dict:
  values = dict(dataset_type="grain", tokenizer_path=spm_model, vocab_size=512, max_target_length=LENGTH,
                per_device_batch_size=1, print_config=False, data_prefetch_batches=0,
                data_mixture=_sources(prepared, second))
  values.update(overrides)
  return values


def _iterator(values: dict):
  config = Config.for_testing(**values)
  return create_data_iterator(config, sharding.create_mesh(config.mesh))


def _host(batch: dict) -> dict[str, np.ndarray]:
  return {k: np.asarray(jax.device_get(v)) for k, v in batch.items()}


# ---------------------------------------------------------------- proportions and schedule

def test_rows_follow_the_weights_within_sampling_error_and_tokens_are_counted_per_source(spm_model, prepared,
                                                                                          second_corpus):
  data = _iterator(_values(spm_model, prepared, second_corpus))
  rows_of_web, num_rows, totals = 0, 0, {"web": 0, "code": 0}
  for _ in range(150):
    batch = _host(next(data))
    source_of_row = data.extras["_source_of_row"]
    counts = data.host_metrics()
    for k, name in enumerate(("web", "code")):
      real = int(np.count_nonzero(batch["targets_segmentation"][source_of_row == k]))
      assert counts[f"data/tokens/{name}"] == real
      totals[name] += real
    rows_of_web += int(np.sum(source_of_row == 0))
    num_rows += len(source_of_row)
  # Binomial(n, 3/4): four standard deviations either side.
  expected, sd = 0.75 * num_rows, math.sqrt(num_rows * 0.75 * 0.25)
  assert abs(rows_of_web - expected) < 4 * sd, (rows_of_web, expected)
  metrics = data.host_metrics()
  assert all(metrics[f"data/total_tokens/{n}"] == t for n, t in totals.items())
  assert data.get_state()["total_tokens"] == totals


def test_the_schedule_changes_the_weights_from_its_step(spm_model, prepared, second_corpus):
  data = _iterator(_values(spm_model, prepared, second_corpus,
                           data_mixture_schedule=[{"step": 5, "code": 1}, {"step": 10, "web": 1}]))
  drawn = []
  for _ in range(15):
    next(data)
    drawn.append(set(data.extras["_source_of_row"].tolist()))
  assert all(d == {1} for d in drawn[5:10]) and all(d == {0} for d in drawn[10:])
  assert set().union(*drawn[:5]) == {0, 1}


def test_weights_at_takes_the_last_stage_begun():
  stages = [MixtureStage(10, (0.0, 1.0)), MixtureStage(20, (1.0, 1.0))]
  np.testing.assert_allclose(mixture.weights_at(9, (3, 1), stages), [0.75, 0.25])
  np.testing.assert_allclose(mixture.weights_at(10, (3, 1), stages), [0, 1])
  np.testing.assert_allclose(mixture.weights_at(25, (3, 1), stages), [0.5, 0.5])


# ---------------------------------------------------------------- hosts

def test_every_process_draws_the_same_rows_and_reads_its_own_shard_of_each_source():
  web = numbered_documents()  # "doc 7 ..." -> token ids 17
  code = [f"doc {100 + int(t.split()[1])} " + t.split(" ", 2)[2] for t in numbered_documents(30)]  # ids 110..

  def host(index: int) -> mixture.MixtureBatchIterator:
    shard = pipeline.HostShard(index, 2, 4)
    opened = [mixture.OpenedSource(name, pipeline.reader(pipeline.document_dataset(
        docs, shard, doc_id_encoder, "text", shuffle_seed=5, repeat=True, what=name), 0), len(docs), name)
        for name, docs in (("web", web), ("code", code))]
    return mixture.MixtureBatchIterator(opened, (1, 1), (), 7, shard, None, 8, LENGTH, True, 0)  # type: ignore[arg-type]

  hosts = [host(0), host(1)]
  seen: list[dict[int, set[int]]] = [{0: set(), 1: set()}, {0: set(), 1: set()}]
  for b in range(6):
    made = [h._produce()[0] for h in hosts]
    both = np.concatenate([m["_source_of_row"] for m in made])
    np.testing.assert_array_equal(both, mixture.draw_sources(7, b, 8, mixture.weights_at(b, (1, 1), ())))
    for i, m in enumerate(made):
      for k in (0, 1):
        rows = m["inputs"][m["_source_of_row"] == k]
        ids = {int(t) - 10 for t in rows[rows > 0]}
        assert all((d >= 100) == (k == 1) for d in ids), f"host {i} source {k} rows hold {ids}"
        seen[i][k] |= {d % 100 for d in ids}
  for k in (0, 1):
    assert seen[0][k] and seen[1][k] and not seen[0][k] & seen[1][k]
    assert all(d % 2 == i for i in (0, 1) for d in seen[i][k])  # host i reads records i, i+2, ... of each


# ---------------------------------------------------------------- resumption

@pytest.mark.parametrize("prefetch", [0, 3])
def test_a_restored_mixture_gives_the_same_batches(spm_model, prepared, second_corpus, prefetch):
  values = _values(spm_model, prepared, second_corpus, data_prefetch_batches=prefetch, grain_worker_count=2)
  data = _iterator(values)
  for _ in range(4):
    next(data)
  state = json.loads(json.dumps(data.get_state()))  # as the checkpoint stores it
  expected = [_host(next(data)) for _ in range(20)]  # past the end of both sources' first epoch
  data.close()
  resumed = _iterator(values)
  resumed.set_state(state)
  assert resumed.total_tokens == state["total_tokens"]
  for i, want in enumerate(expected):
    got = _host(next(resumed))
    for name in want:
      np.testing.assert_array_equal(got[name], want[name], err_msg=f"batch {i} {name}")
  resumed.close()


def test_tfds_grain_and_hf_sources_mix_and_resume(spm_model, prepared, second_corpus):
  sources = [*_sources(prepared, second_corpus),
             dict(name="books", weight=2, dataset_type="tfds", dataset_path=str(prepared / "tfds"),
                  dataset_name="local_text/corpus")]
  values = _values(spm_model, prepared, second_corpus, data_mixture=sources)
  data = _iterator(values)
  for _ in range(3):
    next(data)
  state = data.get_state()
  expected = [_host(next(data)) for _ in range(5)]
  assert set(data.total_tokens) == {"web", "code", "books"} and all(data.total_tokens.values())
  resumed = _iterator(values)
  resumed.set_state(state)
  for want in expected:
    got = _host(next(resumed))
    for name in want:
      np.testing.assert_array_equal(got[name], want[name])


def test_a_single_source_state_and_a_mixture_state_refuse_each_other(spm_model, prepared, second_corpus):
  mixed = _iterator(_values(spm_model, prepared, second_corpus))
  single = _iterator(_values(spm_model, prepared, second_corpus, data_mixture=[],
                             grain_train_files=str(prepared / "arrayrecord" / "train.array_record")))
  with pytest.raises(ConfigError, match="this run mixes"):
    mixed.set_state(single.get_state())
  with pytest.raises(ConfigError, match="this run reads one source"):
    single.set_state(mixed.get_state())
  other = _iterator(_values(spm_model, prepared, second_corpus,
                            data_mixture=[{**s, "name": s["name"] + "2"} for s in _sources(prepared, second_corpus)]))
  with pytest.raises(ConfigError, match=r"is for \['code', 'web'\]; this run mixes \['code2', 'web2'\]"):
    other.set_state(mixed.get_state())


# ---------------------------------------------------------------- bad input: one line each

@pytest.mark.parametrize("mix, schedule, message", [
    ([{"name": "a", "weight": 0}, {"name": "b", "weight": 0}], [], "data_mixture's weights sum to 0; give at least"),
    ([{"name": "a", "weight": -1}], [], "data_mixture source 'a''s weight must be a number >= 0, got -1"),
    ([{"name": "a"}], [], "data_mixture source 'a' has no weight"),
    ([{"name": "a", "weight": 1}, {"name": "a", "weight": 1}], [], "names source 'a' twice"),
    ([{"weight": 1}], [], "data_mixture source 1 needs a name"),
    ([{"name": "a", "weight": 1, "tokenizer_path": "other.model"}], [],
     "data_mixture source 'a' sets tokenizer_path='other.model' but the run uses"),
    ([{"name": "a", "weight": 1, "packing": False}], [], "data_mixture source 'a' sets 'packing', which a source"),
    ([{"name": "a", "weight": 1, "dataset_type": "hf"}], [], "data_mixture source 'a': dataset_type=hf needs"),
    ([{"name": "a", "weight": 1}], [{"step": 5, "b": 1}], "data_mixture_schedule step 5 names ['b']"),
    ([{"name": "a", "weight": 1}], [{"step": 5, "a": 0}], "data_mixture_schedule step 5's weights sum to 0"),
    ([], [{"step": 5, "a": 1}], "data_mixture_schedule changes the weights of data_mixture's sources"),
])
def test_bad_mixtures_are_one_line_each(spm_model, prepared, second_corpus, mix, schedule, message):
  files = {"grain_train_files": str(prepared / "arrayrecord" / "train.array_record")}
  mix = [{**files, **s} if "dataset_type" not in s else s for s in mix]
  with pytest.raises(ConfigError) as error:
    Config.for_testing(**_values(spm_model, prepared, second_corpus, data_mixture=mix, data_mixture_schedule=schedule,
                                 **files))
  assert message in str(error.value) and "\n" not in str(error.value)


def test_an_empty_or_missing_source_is_named(spm_model, prepared, second_corpus, tmp_path):
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  sources = _sources(prepared, second_corpus)
  sources[1]["hf_data_files"] = str(tmp_path / "missing*.jsonl")
  with pytest.raises(ConfigError, match="data_mixture source 'code': hf_data_files: no file matches"):
    check_sources(Config.for_testing(**_values(spm_model, prepared, second_corpus, data_mixture=sources)).data)
  ArrayRecordWriter(str(tmp_path / "empty.array_record"), "group_size:1").close()
  sources[1] = dict(name="code", weight=1, grain_train_files=str(tmp_path / "empty.array_record"))
  with pytest.raises(ConfigError, match=r"data_mixture source 'code' \(grain .*\) is empty"):
    _iterator(_values(spm_model, prepared, second_corpus, data_mixture=sources))


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_an_empty_json_source_is_named_as_empty(spm_model, prepared, second_corpus, tmp_path, content):
  empty = tmp_path / "empty.jsonl"
  empty.write_text(content)
  sources = _sources(prepared, second_corpus)
  sources[1]["hf_data_files"] = str(empty)
  with pytest.raises(ConfigError) as error:
    _iterator(_values(spm_model, prepared, second_corpus, data_mixture=sources))
  assert f"data_mixture source 'code' (hf json files {empty}) is empty" in str(error.value), str(error.value)
