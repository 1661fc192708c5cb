"""Experiment trackers (training/trackers.py): W&B in offline mode and Vertex AI TensorBoard's
event files receive the config and what metrics.jsonl holds; a failing tracker is named once,
turned off, and training goes on."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from MaxText import train
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from MaxText.paths import storage
from MaxText.training import trackers
from tests.conftest import REPO_ROOT

BASE = str(REPO_ROOT / "configs" / "base.yml")
TINY = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=128,
            base_num_decoder_layers=1, vocab_size=128, max_target_length=32, per_device_batch_size=1,
            print_config=False, steps=3, enable_checkpointing=False, enable_tensorboard=False, cpu_peak_tflops=1.0)


class _Recording:
  def __init__(self) -> None:
    self.logged: list[tuple[int, dict]] = []
    self.closed = False

  def log(self, step: int, scalars) -> None:
    self.logged.append((step, dict(scalars)))

  def close(self) -> None:
    self.closed = True


class _Raising:
  calls = 0

  def log(self, step: int, scalars) -> None:
    _Raising.calls += 1
    raise RuntimeError("service unreachable")

  def close(self) -> None:
    raise AssertionError("a tracker turned off is never called again")


def test_a_raising_tracker_warns_once_by_name_and_the_others_keep_logging(capsys):
  good = _Recording()
  _Raising.calls = 0
  guarded = trackers.Trackers({"flaky": _Raising(), "good": good})
  for step in (1, 2, 3):
    guarded.log(step, {"loss": 2.0 / step, "label": "not a number"})
  guarded.close()
  warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
  assert warnings == ["warning: metric tracker flaky failed to log (RuntimeError: service unreachable); "
                      "it is turned off and training goes on"]
  assert _Raising.calls == 1
  assert good.logged == [(1, {"loss": 2.0}), (2, {"loss": 1.0}), (3, {"loss": 2.0 / 3})] and good.closed


def test_a_tracker_that_cannot_start_is_skipped_with_a_warning(tmp_path, capsys):
  config = Config.for_testing(run_name="t", base_output_directory=str(tmp_path),
                              metric_trackers="wandb,vertex_tensorboard")

  def refuse(config: Config) -> trackers.Tracker:
    raise PermissionError("no credentials")

  opened = trackers.Trackers.open(config, {"wandb": refuse, "vertex_tensorboard": lambda c: _Recording()})
  assert opened.names == ("vertex_tensorboard",)
  assert "warning: metric tracker wandb failed to start (PermissionError: no credentials)" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, message", [
    ({"metric_trackers": "mlflow"}, "metric_trackers must be a list of wandb, vertex_tensorboard"),
    ({"metric_trackers": "wandb,wandb"}, "metric_trackers names a tracker twice"),
    ({"wandb_mode": "sometimes"}, "wandb_mode"),
    ({"metric_trackers": "wandb", "wandb_project": ""}, "wandb_project is empty"),
])
def test_bad_tracker_keys_are_one_line_errors(overrides, message):
  with pytest.raises(ConfigError, match=message):
    Config.for_testing(**overrides)


def _event_records(path: Path) -> list:
  return _event_records_of(path.read_bytes())


def _event_records_of(data: bytes) -> list:
  """Event protos of a TFRecord file (length, crc, payload, crc per record)."""
  from tensorboardX.proto import event_pb2

  offset, events = 0, []
  while offset < len(data):
    (length,) = struct.unpack("<Q", data[offset:offset + 8])
    events.append(event_pb2.Event.FromString(data[offset + 12:offset + 12 + length]))
    offset += 12 + length + 4
  return events


def test_vertex_tensorboard_writes_one_folder_per_run_under_the_vertex_log_dir(tmp_path, monkeypatch):
  monkeypatch.setenv(trackers.VERTEX_LOG_DIR_ENV, str(tmp_path / "logs"))
  config = Config.for_testing(run_name="vrun", base_output_directory=str(tmp_path / "out"))
  tracker = trackers.VertexTensorboardTracker(config)
  assert tracker.log_dir == str(tmp_path / "logs" / "vrun")
  tracker.log(1, {"loss": 3.5})
  tracker.log(2, {"loss": 3.0})
  tracker.close()
  (events_file,) = (tmp_path / "logs" / "vrun").glob("events.out.tfevents.*")
  values = [(e.step, v.tag, v) for e in _event_records(events_file) for v in e.summary.value]
  assert [(step, v.simple_value) for step, tag, v in values if tag == "loss"] == [(1, 3.5), (2, 3.0)]
  (config_text,) = [v.tensor.string_val[0].decode() for _, tag, v in values if tag.startswith("config")]
  assert "    run_name: vrun" in config_text.splitlines()


def test_vertex_tensorboard_writes_to_a_bucket_through_the_storage_layer(gcs_bucket):
  config = Config.for_testing(run_name="remote", base_output_directory=f"{gcs_bucket}/out",
                              vertex_tensorboard_dir=f"{gcs_bucket}/tb-logs")
  tracker = trackers.VertexTensorboardTracker(config)
  tracker.log(1, {"loss": 2.5})
  tracker.close()
  (events,) = storage.glob(f"{gcs_bucket}/tb-logs/remote/events.out.tfevents.*")
  assert not (REPO_ROOT / "gs:").exists()  # nothing landed on local disk under a mangled 'gs:' folder
  tags = {v.tag for e in _event_records_of(storage.read_bytes(events)) for v in e.summary.value}
  assert "loss" in tags


def test_wandb_without_its_package_is_a_one_line_setup_error(tmp_path, monkeypatch):
  monkeypatch.setattr(trackers, "WANDB_MODULE", "wandb_not_installed_here")
  config = Config.for_testing(run_name="t", base_output_directory=str(tmp_path), metric_trackers="wandb")
  for check in (lambda: trackers.check_installed(config.run), lambda: trackers.Trackers.open(config)):
    with pytest.raises(ConfigError, match="metric_trackers=wandb needs the wandb package: pip install wandb"):
      check()


def _wandb_records(path: Path) -> list:
  """The protobuf records of an offline run's .wandb file. wandb 0.31 ships no Python reader
  (its core moved to Go), so this reads the documented framing: a 7-byte header, then LevelDB
  log blocks of 32 KiB whose chunks are (crc32c, length, type) + payload; types 1 = full,
  2 = first, 3 = middle, 4 = last piece of one record."""
  from wandb.proto import wandb_internal_pb2

  data, block, records, pending = path.read_bytes(), 32768, [], b""
  assert data[:4] == b":W&B"
  offset = 7
  while offset + 7 <= len(data):
    room = block - offset % block
    if room < 7:  # a block's tail too short for a chunk header is padding
      offset += room
      continue
    length, kind = struct.unpack("<HB", data[offset + 4:offset + 7])
    if length == 0 and kind == 0:
      offset += room
      continue
    pending += data[offset + 7:offset + 7 + length]
    offset += 7 + length
    if kind in (1, 4):
      records.append(wandb_internal_pb2.Record.FromString(pending))
      pending = b""
  return records


def _closed_wandb_records(path: Path, timeout_s: float = 60.0) -> list:
  """The records once the run's exit record is in: W&B's service process writes the file and may
  still be flushing it when `finish()` returns."""
  deadline = time.monotonic() + timeout_s
  while True:
    records = _wandb_records(path)
    if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
      return records
    time.sleep(0.2)


def _offline_wandb(tmp_path: Path, monkeypatch) -> None:
  pytest.importorskip("wandb")
  for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
    monkeypatch.setenv(name, str(tmp_path / "wandb_home"))
  monkeypatch.setenv("WANDB_MODE", "offline")  # no network: nothing leaves the machine


def _history(records: list) -> dict[int, dict]:
  rows: dict[int, dict] = {}
  for r in records:
    if r.WhichOneof("record_type") == "history":
      items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
      rows.setdefault(items.pop("_step"), {}).update({k: v for k, v in items.items() if not k.startswith("_")})
  return rows


def _config(records: list) -> dict:
  """The config travels in the run record (and in config records for later updates)."""
  config = {}
  for r in records:
    kind = r.WhichOneof("record_type")
    if kind in ("run", "config"):
      config.update({item.key: json.loads(item.value_json)
                     for item in (r.run.config.update if kind == "run" else r.config.update)})
  return config


def test_wandb_offline_files_hold_the_config_and_each_step(tmp_path, monkeypatch):
  _offline_wandb(tmp_path, monkeypatch)
  config = Config.for_testing(run_name="direct", base_output_directory=str(tmp_path), metric_trackers="wandb",
                              wandb_mode="offline")
  guarded = trackers.Trackers.open(config)
  assert guarded.names == ("wandb",)
  for step, loss in ((1, 4.5), (2, 4.25)):
    guarded.log(step, {"loss": loss, "moe_load_cv/layer_0": 0.5})
  guarded.close()
  (wandb_file,) = (tmp_path / "direct").glob("wandb/offline-run-*-direct/run-direct.wandb")
  records = _closed_wandb_records(wandb_file)
  assert _history(records) == {1: {"loss": 4.5, "moe_load_cv/layer_0": 0.5}, 2: {"loss": 4.25, "moe_load_cv/layer_0": 0.5}}
  assert _config(records)["run_name"] == "direct"


@pytest.mark.slow  # a training run with W&B's service process: about half a minute here
def test_train_with_wandb_offline_logs_the_config_and_the_losses_of_metrics_jsonl(tmp_path, monkeypatch):
  _offline_wandb(tmp_path, monkeypatch)
  args = {**TINY, "run_name": "tracked", "base_output_directory": tmp_path, "metric_trackers": "wandb,vertex_tensorboard",
          "wandb_mode": "offline", "wandb_project": "maxtext-test"}
  assert train.main(["train", BASE] + [f"{k}={v}" for k, v in args.items()]) == 0
  run_dir = tmp_path / "tracked"
  jsonl = {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
  (wandb_file,) = run_dir.glob("wandb/offline-run-*-tracked/run-tracked.wandb")
  records = _closed_wandb_records(wandb_file)
  logged = {step: row["loss"] for step, row in _history(records).items() if "loss" in row}
  assert logged == jsonl and len(logged) == 3
  config = _config(records)
  assert config["run_name"] == "tracked" and config["base_emb_dim"] == 64
  assert list((run_dir / "vertex_tensorboard" / "tracked").glob("events.out.tfevents.*"))
