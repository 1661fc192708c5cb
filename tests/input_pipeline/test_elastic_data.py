"""File datasets in an elastic run: virtual data shards (pipeline.data_shards) keep the global batch
of every step, and the saved data position, the same when the job's process count changes."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from MaxText.platform import loopback_launch
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from MaxText.input_pipeline import create_data_iterator, pipeline, real_data_iterator
from MaxText.platform import sharding

LENGTH = 16


def _config(spm_model: str, prepared: Path, kind: str, accumulation: int, elastic: bool = True,
            per_device: int = 2) -> Config:
  """`per_device` rows on each of the 8 test devices: the resized configs of one job keep it (a
  device's rows split into whole micro-batches)."""
  files = {"grain": dict(grain_train_files=str(prepared / "arrayrecord" / "train.array_record")),
           "hf": dict(hf_data_files=str(prepared / "jsonl" / "train.jsonl")),
           "stream": dict(stream_train_files=str(prepared / "shards" / "*.jsonl")),
           "mixture": dict(data_mixture=[
               dict(name="web", weight=1, dataset_type="grain",
                    grain_train_files=str(prepared / "arrayrecord" / "train.array_record")),
               dict(name="code", weight=1, dataset_type="stream", stream_train_files=str(prepared / "shards" / "*.jsonl"))
           ])}[kind]
  return Config.for_testing(dataset_type="grain" if kind == "mixture" else kind, tokenizer_path=spm_model, vocab_size=512, max_target_length=LENGTH,
                            per_device_batch_size=per_device, print_config=False, data_prefetch_batches=0,
                            gradient_accumulation_steps=accumulation, elastic_min_slices=int(elastic), **files)


class SimulatedJob:
  """`processes` processes of an elastic job, simulated in this one: each builds its own rows
  (its virtual shards); a step's global batch is their rows in process order."""

  def __init__(self, config: Config, processes: int, state: dict | None = None):
    mesh = sharding.create_mesh(config.mesh)
    rows = config.data.global_batch_size // processes
    self.iterators = [real_data_iterator(config, mesh, True, pipeline.HostShard(p, processes, rows))
                      for p in range(processes)]
    for iterator in self.iterators:
      assert isinstance(iterator, pipeline.BatchIterator)
      if state is not None:
        iterator.set_state(json.loads(json.dumps(state)))  # as a checkpoint stores it

  def step(self) -> dict[str, np.ndarray]:
    parts = [iterator.next_host_rows() for iterator in self.iterators]
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}

  def state(self) -> dict:
    """The job's saved position: every process's shards, as get_state's gather joins them."""
    states = [iterator.get_state() for iterator in self.iterators]
    return {**states[0], "shards": {k: v for s in states for k, v in s["shards"].items()}}

  def close(self) -> None:
    for iterator in self.iterators:
      iterator.close()


@pytest.fixture(scope="module")
def stream_prepared(prepared: Path) -> Path:
  """The train documents as 8 JSONL shard files for dataset_type=stream (at least one per virtual shard)."""
  lines = (prepared / "jsonl" / "train.jsonl").read_text().splitlines()
  shards = prepared / "shards"
  shards.mkdir(exist_ok=True)
  for i in range(8):
    (shards / f"part-{i}.jsonl").write_text("\n".join(lines[i::8]) + "\n")
  return prepared


# hf opens its files once per simulated process (14 times): seconds, so it runs with the slow tests.
@pytest.mark.parametrize("kind, accumulation", [("grain", 2), ("stream", 1), ("mixture", 1),
                                                pytest.param("hf", 1, marks=pytest.mark.slow)])
def test_a_resize_4_2_4_feeds_the_global_batches_of_an_unresized_run(spm_model, stream_prepared, kind, accumulation):
  # 4 processes with `accumulation` micro-batches; shrunk to 2 the accumulation doubles (elastic_config.resize).
  full, half = (_config(spm_model, stream_prepared, kind, a, per_device=4) for a in (accumulation, 2 * accumulation))
  steps = [2, 3, 2]  # per phase: 4 processes, 2, 4 again; each phase starts from the last one's saved position
  reference = SimulatedJob(full, 4)
  expected = [reference.step() for _ in range(sum(steps))]
  reference_state = reference.state()
  reference.close()

  got, state = [], None
  for (config, processes), count in zip([(full, 4), (half, 2), (full, 4)], steps):
    job = SimulatedJob(config, processes, state)
    assert {len(i.data_shards) for i in job.iterators} == {4 * accumulation // processes}
    got += [job.step() for _ in range(count)]
    state = job.state()
    job.close()

  assert state == reference_state and state["num_shards"] == 4 * accumulation
  for number, (a, b) in enumerate(zip(got, expected)):
    assert a.keys() == b.keys()
    for name in a:
      np.testing.assert_array_equal(a[name], b[name], err_msg=f"step {number} {name}")
  assert any((batch["inputs"] != expected[0]["inputs"]).any() for batch in expected[1:])  # the data moves on


def test_an_elastic_run_at_full_size_reads_what_a_plain_run_reads(spm_model, prepared):
  # One accumulation step per process: one virtual shard each, the plain layout (bitwise the same).
  mesh = sharding.create_mesh(_config(spm_model, prepared, "grain", 1).mesh)
  plain, elastic = (create_data_iterator(_config(spm_model, prepared, "grain", 1, elastic=e), mesh)
                    for e in (False, True))
  for _ in range(2):
    a, b = next(plain), next(elastic)
    np.testing.assert_array_equal(jax.device_get(a["inputs"]), jax.device_get(b["inputs"]))
  assert plain.get_state() == elastic.get_state()
  assert pipeline.data_shards(pipeline.HostShard(1, 4, 2), 1) == [pipeline.HostShard(1, 4, 2)]
  assert pipeline.data_shards(pipeline.HostShard(1, 2, 4), 2) == [pipeline.HostShard(2, 4, 2), pipeline.HostShard(3, 4, 2)]
  with pytest.raises(ConfigError, match=r"^process 1 holds 3 rows of the global batch, which gradient_accumulation_"
                                        r"steps=2 does not split into micro-batches of whole rows; set "):
    pipeline.data_shards(pipeline.HostShard(1, 2, 3), 2)


def test_one_process_with_accumulation_reads_the_virtual_shards_of_the_whole_job(spm_model, prepared):
  config = _config(spm_model, prepared, "grain", 2)
  iterator = create_data_iterator(config, sharding.create_mesh(config.mesh))
  batch = jax.device_get(next(iterator)["inputs"])
  as_two = SimulatedJob(_config(spm_model, prepared, "grain", 1), 2)  # 2 processes, one micro-batch: the same shards
  np.testing.assert_array_equal(batch, as_two.step()["inputs"])
  assert sorted(iterator.get_state()["shards"]) == ["0", "1"]
  as_two.close()


def _saved(spm_model, prepared) -> tuple[pipeline.BatchIterator, dict]:
  config = _config(spm_model, prepared, "grain", 2)
  iterator = create_data_iterator(config, sharding.create_mesh(config.mesh))
  assert isinstance(iterator, pipeline.BatchIterator)
  next(iterator)
  return iterator, iterator.get_state()


def test_a_damaged_or_mismatched_data_position_is_one_line(spm_model, prepared):
  iterator, state = _saved(spm_model, prepared)
  missing = {**state, "shards": {"0": state["shards"]["0"]}}
  with pytest.raises(ConfigError, match=r"^the checkpoint's data position is damaged: it holds data shard\(s\) \[0\] "
                                        r"instead of 0..1; resume from another checkpoint step or delete this one$"):
    iterator.set_state(missing)
  for bad in ({"index": "x", "offset": 0}, {"index": -1, "offset": 0}, {"offset": 3}, [1, 2]):
    with pytest.raises(ConfigError, match=r"^the checkpoint's data position of data shard 1 is damaged \(.*\); "
                                          "resume from another checkpoint step or delete this one$"):
      iterator.set_state({**state, "shards": {**state["shards"], "1": bad}})
  # Saved by a plain run of one process (one data shard): this elastic run reads 2 virtual shards.
  with pytest.raises(ConfigError, match=r"over 1 data shard\(s\); this run has 16 x 16 over 2 \(1 process\(es\) x 2 "
                                        r"micro-batches: an elastic run's virtual data shards\): the same position"):
    iterator.set_state({**state, "num_shards": 1, "shards": {"0": state["shards"]["0"]}})
  iterator.set_state(state)  # the saved position itself is taken


def test_a_mixtures_virtual_shards_at_different_batches_are_one_line(spm_model, stream_prepared):
  config = _config(spm_model, stream_prepared, "mixture", 2)
  iterator = create_data_iterator(config, sharding.create_mesh(config.mesh))
  next(iterator)
  state = iterator.get_state()
  assert sorted(state["shards"]) == ["0", "1"] and state["shards"]["1"]["batches"] == 1
  state["shards"]["1"]["batches"] = 2
  with pytest.raises(ConfigError, match=r"^the checkpoint's data position is damaged: data shards \[0, 1\] are at "
                                        r"different batches \[1, 2\]; resume from another checkpoint step$"):
    iterator.set_state(state)


@pytest.mark.slow  # a reference run and three generations of a 4-process job compile: minutes on a 2-core machine
def test_a_loopback_job_on_a_text_file_shrinks_and_grows_on_the_uninterrupted_runs_batches(tmp_path, spm_model):
  """`python3 -m MaxText.elastic` on tinyshakespeare (dataset_type=hf): 4 processes as 4 slices of 2
  CPU devices, one SIGKILLed after step 4 (the job goes on on 2 slices), its slice back after the
  shrunk job's first step. Its losses equal those of one uninterrupted process that reads the same
  4 virtual data shards (one slice's devices, 4 micro-batches), and its last saved data position is that run's."""
  import sys

  from MaxText import elastic
  from MaxText.configuration import elastic_config
  from MaxText.configuration.elastic_config import SliceLayout
  from tests.compile_settings import FAST_COMPILE_FLAG, jax_cache_env
  from tests.conftest import REPO_ROOT, SHAKESPEARE
  from tests.test_elastic import _LOOPBACK_MODEL, _LOOPBACK_STEPS, _logged, shrink_and_grow_back

  env = loopback_launch.loopback_env({"PYTHONPATH": str(REPO_ROOT), "XLA_FLAGS": FAST_COMPILE_FLAG,
                              "HF_DATASETS_CACHE": str(tmp_path / "hf_cache"), **jax_cache_env()})
  data = ["dataset_type=hf", f"hf_data_files={SHAKESPEARE}", f"tokenizer_path={spm_model}", "vocab_size=512",
          "elastic_min_slices=1"]
  model = [a for a in _LOOPBACK_MODEL if not a.startswith("dataset_type=")]
  command = [sys.executable, "-m", "MaxText.train", "configs/base.yml", f"base_output_directory={tmp_path}", *model,
             *data]
  layout = SliceLayout(num_slices=4, devices_per_slice=2, batch_shards_per_slice=2, global_batch_size=8,
                       gradient_accumulation_steps=1, min_slices=1)
  reference = loopback_launch.LoopbackLauncher([*command, "run_name=reference"], 1, 1, 2, tmp_path / "ref_state", env,
                                       tmp_path / "reference_logs")
  ((_, proc),) = reference.start([0], elastic_config.resize(layout, 1).overrides()).procs
  assert proc.wait(timeout=900) == 0, [p.read_text()[-3000:] for p in (tmp_path / "reference_logs").iterdir()]
  want = _logged(tmp_path / "reference")

  run_dir, logs = tmp_path / "elastic", tmp_path / "logs"
  out = shrink_and_grow_back(command, tmp_path, env, victim=2)
  assert out.returncode == 0, f"the supervisor ended with {out.returncode}: {out.stdout[-3000:]}; logs in {logs}"

  records = [json.loads(line) for line in (run_dir / elastic.EVENTS_FILE).read_text().splitlines()]
  assert [(r["from_slices"], r["to_slices"]) for r in records if "seconds_to_resume" in r] == [(4, 2), (2, 4)]
  got = _logged(run_dir)
  assert sorted(got) == sorted(want) == list(range(1, _LOOPBACK_STEPS + 1))
  # The order of the float32 gradient sums differs (4 micro-batches against 1), as for synthetic data.
  np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=2e-5)
  saved = [json.loads((d / "checkpoints" / str(_LOOPBACK_STEPS) / "data" / "metadata").read_text())
           for d in (tmp_path / "reference", run_dir)]
  assert saved[0] == saved[1] and saved[0]["num_shards"] == 4, saved
