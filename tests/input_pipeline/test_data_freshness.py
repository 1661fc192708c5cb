"""Data that changed under a reader: a local file datasets cached, rewritten with its mtime kept; a prepare_data
output stopped while its files were moved (or uploaded) into place, written over by another run, or written by two
runs at once. Each reads the new data or stops with one line naming the folder and what to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from MaxText.errors import ConfigError, UserError
from MaxText.input_pipeline import files as files_lib
from MaxText.input_pipeline import hf, prepare_data


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
  datasets = hf._offline_datasets()
  monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def _write(path: Path, texts: list[str]) -> None:
  if path.suffix == ".parquet":
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts}), path)
  else:
    path.write_text("".join((json.dumps({"text": t}) if path.suffix == ".jsonl" else t) + "\n" for t in texts))


@pytest.mark.parametrize("suffix", [".jsonl", ".txt", ".parquet"])
def test_an_hf_file_rewritten_with_its_mtime_kept_is_read_anew(tmp_path, hf_cache, suffix):
  """Was: datasets keys its cache of local files by path and mtime, so a file rewritten with its mtime kept (rsync -a,
  cp -p, tar), of the same size or not, trained on the old cached table without a word."""
  path = tmp_path / f"data{suffix}"
  _write(path, ["aaaa", "bbbb"])
  assert hf.open_split("", str(path), "train", "hf_data_files", "text")[0]["text"] == ["aaaa", "bbbb"]
  kept = os.stat(path)
  for texts in (["cccc", "dddd"], ["eeeeee", "f", "g"]):  # the same size, another size
    _write(path, texts)
    os.utime(path, ns=(kept.st_atime_ns, kept.st_mtime_ns))
    assert hf.open_split("", str(path), "train", "hf_data_files", "text")[0]["text"] == texts
  assert hf.open_split("", str(path), "train", "hf_data_files", "text")[0]["text"] == ["eeeeee", "f", "g"]


def test_content_key_sees_both_ends_of_a_large_file(tmp_path):
  path = tmp_path / "big.bin"
  data = bytearray(os.urandom(3 << 20))
  path.write_bytes(bytes(data))
  key = files_lib.content_key(str(path))
  data[-1] ^= 1
  path.write_bytes(bytes(data))
  assert files_lib.content_key(str(path)) != key


# ---- prepare_data's output ---------------------------------------------------------------------------------------


def _corpus(path: Path, prefix: str, count: int) -> Path:
  path.write_text("\n\n".join(f"{prefix} document {i} with a few words." for i in range(count)) + "\n")
  return path


def _prepare(*args: str) -> int:
  return prepare_data.main(["prepare_data", *args])


def _refused(key: str, path: str) -> str:
  with pytest.raises(ConfigError) as raised:
    files_lib.expand_files(key, path)
  assert "\n" not in str(raised.value)
  return str(raised.value)


def test_a_run_stopped_while_moving_its_files_into_place_is_refused_until_rerun(tmp_path, monkeypatch):
  """Was: a run stopped between moving train.jsonl and validation.jsonl (or during a gs:// upload, file by file)
  left corpus B's train split beside corpus A's validation split, read as a complete output."""
  out = tmp_path / "out"
  assert _prepare(f"data_files={_corpus(tmp_path / 'A.txt', 'A', 12)}", f"output_path={out}",
                  "formats=jsonl,arrayrecord") == 0
  assert sorted(p.name for p in out.iterdir()) == ["arrayrecord", "jsonl", "prepare_data.json"]
  publish = prepare_data._publish

  def stopped(staging: str, target: str, tfds_name: str | None) -> None:
    os.replace(os.path.join(staging, "jsonl", "train.jsonl"), out / "jsonl" / "train.jsonl")
    raise KeyboardInterrupt

  monkeypatch.setattr(prepare_data, "_publish", stopped)
  with pytest.raises(KeyboardInterrupt):
    _prepare(f"data_files={_corpus(tmp_path / 'B.txt', 'B', 8)}", f"output_path={out}", "formats=jsonl,arrayrecord")
  marker = next(out.glob("prepare_data.incomplete-*"))
  for key, path in (("hf_data_files", out / "jsonl" / "validation.jsonl"),
                    ("grain_train_files", out / "arrayrecord" / "train.array_record")):
    assert _refused(key, str(path)) == (
        f"{key}: {out} is incomplete: a prepare_data run is writing it or was stopped before it finished ({marker}); "
        f"wait for that run, or rerun prepare_data with output_path={out}")
  monkeypatch.setattr(prepare_data, "_publish", publish)
  assert _prepare(f"data_files={tmp_path / 'B.txt'}", f"output_path={out}", "formats=jsonl,arrayrecord") == 0
  assert sorted(p.name for p in out.iterdir()) == ["arrayrecord", "jsonl", "prepare_data.json"]
  assert files_lib.expand_files("hf_data_files", str(out / "jsonl" / "*.jsonl")) == [
      str(out / "jsonl" / "train.jsonl"), str(out / "jsonl" / "validation.jsonl")]


def test_a_file_written_over_after_the_manifest_is_refused(tmp_path):
  """Was: another run's (or a hand-edited) train split beside this run's validation split read as one output."""
  out = tmp_path / "out"
  assert _prepare(f"data_files={_corpus(tmp_path / 'A.txt', 'A', 12)}", f"output_path={out}", "formats=jsonl") == 0
  train = out / "jsonl" / "train.jsonl"
  train.write_text(train.read_text().replace("A document", "B document"))  # the same size
  assert _refused("hf_data_files", f"{out}/jsonl/*.jsonl") == (
      f"hf_data_files: {train} is not the file prepare_data wrote (it differs from {out / 'prepare_data.json'}: "
      f"another run wrote over it, or it was edited); rerun prepare_data with output_path={out}, or remove "
      f"{out / 'prepare_data.json'} to use the files as they are")
  (out / "prepare_data.json").unlink()  # the user's way to keep an edit
  assert len(files_lib.expand_files("hf_data_files", f"{out}/jsonl/*.jsonl")) == 2


def test_a_tfds_output_stopped_half_way_is_refused(tmp_path):
  from MaxText.input_pipeline import tfds

  out = tmp_path / "out"
  (out / f"prepare_data.incomplete-{prepare_data._HOST}-999999999").parent.mkdir(parents=True)
  (out / f"prepare_data.incomplete-{prepare_data._HOST}-999999999").write_text("")
  with pytest.raises(ConfigError, match=rf"^dataset_path: {out} is incomplete: a prepare_data run is writing it"):
    tfds.open_split("local_text/corpus", str(out / "tfds"), "train")


def test_a_second_run_on_the_same_output_is_refused_while_the_first_writes(tmp_path):
  """Was: two runs publishing into one folder at once could leave one's train split beside the other's validation."""
  out = tmp_path / "out"
  writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    (out / f"{prepare_data._STAGING}{writer.pid}").mkdir(parents=True)
    with pytest.raises(UserError) as raised:
      _prepare(f"data_files={_corpus(tmp_path / 'A.txt', 'A', 12)}", f"output_path={out}", "formats=jsonl")
    assert str(raised.value) == (f"output_path={out}: another prepare_data (process {writer.pid}) is writing there "
                                 "now; wait for it to finish, or give another output_path")
    (out / f"{prepare_data._STAGING}{writer.pid}").rmdir()
    (out / f"prepare_data.incomplete-{prepare_data._HOST}-{writer.pid}").write_text("")  # publishing, on this host
    with pytest.raises(UserError, match=f"another prepare_data \\(process {writer.pid}\\) is writing there now"):
      _prepare(f"data_files={tmp_path / 'A.txt'}", f"output_path={out}", "formats=jsonl")
    assert not (out / "jsonl").exists()
  finally:
    writer.kill()
    writer.wait()
  # its writer gone, a rerun replaces the output and clears the marker
  assert _prepare(f"data_files={tmp_path / 'A.txt'}", f"output_path={out}", "formats=jsonl") == 0
  assert sorted(p.name for p in out.iterdir()) == ["jsonl", "prepare_data.json"]


def test_a_gs_upload_stopped_half_way_is_refused_until_rerun(tmp_path, gcs_bucket, monkeypatch):
  """Was: the upload to gs:// copies object by object; stopped half way, the bucket held the new train split beside
  the old validation split (or no validation split), read as complete."""
  from MaxText.paths import storage

  out = f"{gcs_bucket}/prepared"
  assert _prepare(f"data_files={_corpus(tmp_path / 'A.txt', 'A', 12)}", f"output_path={out}", "formats=jsonl") == 0
  assert storage.listdir(out) == ["jsonl", "prepare_data.json"]
  assert len(files_lib.expand_files("hf_data_files", f"{out}/jsonl/*.jsonl")) == 2
  copy_tree = storage.copy_tree

  def stopped(source: str, target: str) -> None:
    storage.write_text(f"{target}/jsonl/train.jsonl", Path(source, "jsonl", "train.jsonl").read_text())
    raise KeyboardInterrupt

  monkeypatch.setattr(storage, "copy_tree", stopped)
  with pytest.raises(KeyboardInterrupt):
    _prepare(f"data_files={_corpus(tmp_path / 'B.txt', 'B', 8)}", f"output_path={out}", "formats=jsonl")
  assert "is incomplete: a prepare_data run is writing it or was stopped" in _refused(
      "hf_data_files", f"{out}/jsonl/validation.jsonl")
  monkeypatch.setattr(storage, "copy_tree", copy_tree)
  assert _prepare(f"data_files={tmp_path / 'B.txt'}", f"output_path={out}", "formats=jsonl") == 0
  storage.forget_listings(out)
  assert storage.listdir(out) == ["jsonl", "prepare_data.json"]
  assert len(files_lib.expand_files("hf_data_files", f"{out}/jsonl/*.jsonl")) == 2
