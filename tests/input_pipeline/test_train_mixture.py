"""train.py processes killed with SIGKILL and rerun: a mixture of two sources, and a stream of
shards read from the GCS server on 127.0.0.1 killed mid-shard, each continuing bit for bit like
an uninterrupted run (the checkpoint holds every source's position)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from MaxText.paths import storage
from tests.input_pipeline.data_fixtures import numbered_documents
from tests.input_pipeline.test_streaming import write_shards
from tests.test_gcs_run import MODEL, command, committed_steps, env, losses, run, start_and_signal

STEPS = 8
EXTRA = ["checkpoint_period=4", "vocab_size=512", "async_checkpointing=False", "data_prefetch_batches=2"]


def _command(out: Path, run_name: str, *extra: str) -> list[str]:
  model = [k for k in MODEL if not k.startswith(("steps=", "learning_rate_schedule_steps="))]
  return [*command(str(out), run_name)[:6], *model, f"steps={STEPS}", f"learning_rate_schedule_steps={STEPS}", *extra]


def _killed_and_rerun(out: Path, data: list[str], environment: dict) -> tuple[dict[int, float], dict]:
  """Kills the run once step 4 is committed, reruns it; (its losses, step 4's saved data state)."""
  command = _command(out, "killed", *EXTRA, *data)
  run_dir = str(out / "killed")
  proc = start_and_signal(command, environment, 5, lambda: 4 in committed_steps(run_dir), signal.SIGKILL)
  proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  assert committed_steps(run_dir)[0] == 4
  state = json.loads(storage.read_text(f"{run_dir}/checkpoints/4/data/metadata"))
  rerun = run(command, environment)
  assert "resumed from step" in rerun.stdout
  return losses(run_dir), state


@pytest.mark.slow  # three train.py processes
def test_a_killed_mixture_reruns_bitwise(tmp_path, spm_model, prepared):
  code = tmp_path / "code.jsonl"
  code.write_text("".join(json.dumps({"text": t.replace("doc", "code")}) + "\n" for t in numbered_documents(30)))
  mix = ("data_mixture=[{name: web, weight: 3, grain_train_files: %s}, {name: code, weight: 1, dataset_type: hf, "
         "hf_data_files: %s}]" % (prepared / "arrayrecord" / "train.array_record", code))
  data = ["dataset_type=grain", f"tokenizer_path={spm_model}", mix, "data_mixture_schedule=[{step: 6, code: 1}]"]
  reference = _command(tmp_path, "ref", *EXTRA, *data)
  run(reference, env(None))
  killed, state = _killed_and_rerun(tmp_path, data, env(None))
  assert killed == losses(str(tmp_path / "ref")) and sorted(killed) == list(range(1, STEPS + 1))
  assert state["shards"]["0"]["batches"] == 4 and set(state["shards"]["0"]["sources"]) == {"web", "code"}
  records = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
  last = [r for r in records if "loss" in r][-1]
  assert last["data/tokens/web"] == 0 < last["data/tokens/code"]  # the schedule's step 6 on: code only
  assert last["data/total_tokens/web"] > last["data/total_tokens/code"] > 0


@pytest.mark.slow  # three train.py processes
def test_a_stream_from_gcs_killed_mid_shard_reruns_bitwise(tmp_path, spm_model, gcs, gcs_bucket):
  shards = tmp_path / "shards"
  write_shards(shards, numbered_documents(48), per_shard=6)
  for path in sorted(shards.glob("*.parquet")):
    storage.write_bytes(f"{gcs_bucket}/corpus/{path.name}", path.read_bytes())
  common = ["dataset_type=stream", f"tokenizer_path={spm_model}"]
  run(_command(tmp_path, "ref", *EXTRA, *common, f"stream_train_files={shards}/*.parquet"), env(None))
  killed, state = _killed_and_rerun(tmp_path, [*common, f"stream_train_files={gcs_bucket}/corpus/*.parquet"],
                                    env(gcs))
  assert killed == losses(str(tmp_path / "ref"))  # the local files and the bucket's give the same batches
  position = state["shards"]["0"]
  visit, row = divmod(position["index"], 1 << 32)
  assert visit >= 1 and (row or position["offset"]), position  # past the first shard, inside another


@pytest.mark.slow  # two train.py processes that stop at start-up
def test_bad_mixtures_stop_train_py_with_one_error_line(tmp_path, spm_model, prepared):
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  train_file = prepared / "arrayrecord" / "train.array_record"
  for mix, message in [
      (f"[{{name: web, weight: 0, grain_train_files: {train_file}}}]", "data_mixture's weights sum to 0"),
      (f"[{{name: web, weight: 1, grain_train_files: {train_file}}}, {{name: code, weight: 1, dataset_type: stream, "
       f"stream_train_files: {empty}}}]", "data_mixture source 'code' (stream"),
  ]:
    proc = run(_command(tmp_path, "bad", "dataset_type=grain", f"tokenizer_path={spm_model}", "vocab_size=512",
                        f"data_mixture={mix}"), env(None), expect=2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert committed_steps(str(tmp_path / "bad")) == []
