"""MaxText/paths/storage.py, the one path layer: the same calls on local disk and on gs:// (a real GCS
JSON API on 127.0.0.1), and a scan that keeps every other module off os.path/pathlib/open()."""

from __future__ import annotations

import os
import pathlib
import re

import pytest

from MaxText.errors import UserError
from MaxText.paths import cloud_env, storage
from tests.conftest import REPO_ROOT

# Modules allowed to touch the file system directly, and why.
ALLOWED = {
    "MaxText/paths/storage.py": "the path layer itself",
    "MaxText/run_dir/local_checkpoints.py": "the per-host checkpoint tier lives on local disk by definition: fsync and an "
                                    "atomic rename are what make it safe",
    "MaxText/platform/accelerators.py": "probes device files (/dev/accel*), not user paths",
    "MaxText/multihost_runner.py": "a launcher on the user's workstation: local logs it hands to ssh/scp",
    "MaxText/multihost_job.py": "a launcher on the user's workstation: local staging it hands to gcloud",
    "MaxText/platform/tpu_launch.py": "packs the user's local script folder into a tarball for gcloud scp",
    "MaxText/plan.py": "a planner on the user's workstation: its compile cache and the recipe it writes (run from a "
                       "local checkout, relative to configs/recipe_lib.sh) are local files; a URL is refused",
    "MaxText/elastic.py": "the elastic supervisor, a launcher: its processes' logs and elastic.jsonl in the local "
                          "run folder it watches (a gs:// run folder is not supported by it yet)",
    "MaxText/platform/loopback_launch.py": "elastic.py's loopback launcher (split out): the local processes' log "
                                           "files in the run folder elastic.py watches",
    "MaxText/input_pipeline/teacher_top_k.py": "a distillation teacher's top-k files are memory-mapped (np.load with "
                                               "mmap_mode), so they are local files by design: a gs:// path is refused "
                                               "in one line; a part is written to .tmp and renamed, whole or absent",
    "MaxText/aot/plan_recipe.py": "the planner's recipe file (plan.py's, split out): a local script beside the "
                                  "checkout's configs/recipe_lib.sh, which it sources by a relative path",
}
FORBIDDEN = re.compile(r"os\.path\.|(?<![\w.])Path\(|(?<![\w.])open\(|os\.(makedirs|listdir|rename|replace|remove|"
                       r"scandir|stat|mkdir|walk)\(|shutil\.|glob\.glob\(")


def _violations(source: str) -> list[str]:
  found = []
  for number, line in enumerate(source.splitlines(), 1):
    code = line.split("#", 1)[0]
    if "__file__" in code or code.strip().startswith("def open("):  # the program's own files; a method name
      continue
    if FORBIDDEN.search(code):
      found.append(f"{number}: {line.strip()}")
  return found


def test_no_module_opens_a_user_path_outside_the_storage_layer():
  offenders = {}
  for path in sorted((REPO_ROOT / "MaxText").rglob("*.py")):
    relative = str(path.relative_to(REPO_ROOT))
    if relative in ALLOWED:
      continue
    found = _violations(path.read_text())
    if found:
      offenders[relative] = found
  assert not offenders, ("use MaxText/paths/storage.py (local and gs:// paths) instead of os.path/pathlib/open(): "
                         f"{offenders}")


def test_the_scan_catches_each_forbidden_call():
  for line in ("x = os.path.join(a, b)", "p = Path(user)", "with open(p) as f:", "os.makedirs(d)", "shutil.copy(a, b)"):
    assert _violations(line), line
  assert not _violations("ROOT = Path(__file__).parent\nstorage.open_file(p)\n  def open(self, path):")


@pytest.fixture(params=["local", "gs"])
def root(request, tmp_path) -> str:
  if request.param == "local":
    return str(tmp_path / "root")
  return request.getfixturevalue("gcs_bucket") + "/root"


def test_the_same_calls_work_locally_and_on_gcs(root):
  storage.makedirs(root)
  storage.write_text(storage.join(root, "a", "one.json"), "1")
  storage.write_bytes(storage.join(root, "a", "two.json"), b"2")
  storage.write_text(storage.join(root, "b.txt"), "hello")
  assert storage.read_text(storage.join(root, "b.txt")) == "hello"
  assert storage.read_bytes(storage.join(root, "a", "two.json")) == b"2"
  assert storage.listdir(root) == ["a", "b.txt"]
  assert storage.is_dir(storage.join(root, "a")) and not storage.is_dir(storage.join(root, "b.txt"))
  assert storage.is_file(storage.join(root, "b.txt")) and not storage.is_file(storage.join(root, "a"))
  assert storage.size(storage.join(root, "b.txt")) == 5
  assert [storage.name(p) for p in storage.glob(storage.join(root, "a", "*.json"))] == ["one.json", "two.json"]
  assert storage.glob(storage.join(root, "a", "*.txt")) == []

  moved = storage.set_aside(storage.join(root, "a"), "a.corrupt-1")
  assert storage.listdir(root) == ["a.corrupt-1", "b.txt"] and storage.listdir(moved) == ["one.json", "two.json"]
  storage.copy_tree(moved, storage.join(root, "copy"))
  assert storage.listdir(storage.join(root, "copy")) == ["one.json", "two.json"]
  storage.remove_tree(storage.join(root, "copy"))
  assert not storage.exists(storage.join(root, "copy"))

  with storage.local_copy(moved) as local:  # a real local directory for readers that need one
    assert sorted(p.name for p in pathlib.Path(local).iterdir()) == ["one.json", "two.json"]
  with storage.local_output(storage.join(root, "out")) as local:
    pathlib.Path(local).mkdir(parents=True)
    (pathlib.Path(local) / "f.bin").write_bytes(b"x")
  assert storage.read_bytes(storage.join(root, "out", "f.bin")) == b"x"


def test_a_local_write_that_cannot_happen_is_one_line_and_leaves_nothing(tmp_path):
  (tmp_path / "corpus.txt").write_text("x")
  (tmp_path / "out").mkdir()
  cases = {str(tmp_path / "out"): "it is a folder; name a file there instead",
           str(tmp_path / "corpus.txt" / "a" / "tok.model"): f"{tmp_path / 'corpus.txt'} is a file, not a folder"}
  for path, why in cases.items():
    with pytest.raises(UserError) as raised:
      storage.write_bytes(path, b"model")
    assert str(raised.value) == f"cannot write {path}: {why}"
  os.chmod(tmp_path / "out", 0o500)
  try:
    if not os.access(tmp_path / "out", os.W_OK):  # root writes a read-only folder anyway
      with pytest.raises(UserError, match="cannot write .*tok.model: Permission denied"):
        storage.write_text(str(tmp_path / "out" / "tok.model"), "model")
  finally:
    os.chmod(tmp_path / "out", 0o700)
  assert sorted(p.name for p in tmp_path.rglob("*")) == ["corpus.txt", "out"]


def test_a_local_folder_that_cannot_be_made_is_one_line(tmp_path):
  """base_output_directory under a file was a NotADirectoryError traceback from the run lease's makedirs."""
  (tmp_path / "corpus.txt").write_text("x")
  for path in (tmp_path / "corpus.txt", tmp_path / "corpus.txt" / "a" / "run"):
    with pytest.raises(UserError) as raised:
      storage.makedirs(str(path))
    assert str(raised.value) == f"cannot create folder {path}: {tmp_path / 'corpus.txt'} is a file, not a folder"
  storage.makedirs(str(tmp_path / "a" / "b"))
  storage.makedirs(str(tmp_path / "a" / "b"))  # already there: nothing to do
  assert (tmp_path / "a" / "b").is_dir()


def test_line_log_keeps_every_line_across_syncs_and_a_reopen(root):
  path = storage.join(root, "metrics.jsonl")
  log = storage.LineLog(path, [], upload_interval_seconds=3600)
  log.write_line('{"step": 1}')
  log.sync()
  log.write_line('{"step": 2}')
  log.close()
  assert storage.read_text(path) == '{"step": 1}\n{"step": 2}\n'
  again = storage.LineLog(path, ['{"step": 1}\n'])
  again.close()
  assert storage.read_text(path) == '{"step": 1}\n'


def test_paths_resolve_and_join_without_mangling_urls():
  assert storage.join("gs://b/runs/", "x", "checkpoints") == "gs://b/runs/x/checkpoints"
  assert storage.resolve("gs://b/runs/") == "gs://b/runs"
  assert storage.resolve("outputs").startswith("/") and storage.resolve("~/x").startswith("/")
  assert storage.parent("gs://b/runs/x") == "gs://b/runs" and storage.name("gs://b/runs/x/") == "x"
  assert storage.bucket_of("gs://bucket/a/b") == "gs://bucket"


def test_emulator_host_is_handed_on_to_every_library():
  env = {"STORAGE_EMULATOR_HOST": "127.0.0.1:4443"}
  cloud_env.configure_cloud_env(env)
  assert env["TENSORSTORE_GCS_HTTP_URL"] == "http://127.0.0.1:4443" and env["GOOGLE_AUTH_TOKEN_FOR_TESTING"]
  kept = {"STORAGE_EMULATOR_HOST": "http://h:1", "TENSORSTORE_GCS_HTTP_URL": "http://mine:2"}
  cloud_env.configure_cloud_env(kept)
  assert kept["TENSORSTORE_GCS_HTTP_URL"] == "http://mine:2"  # what the user set wins
  untouched: dict = {}
  cloud_env.configure_cloud_env(untouched)
  assert untouched == {}


@pytest.mark.parametrize("path, package", [("s3://bucket/tokenizer.model", "s3fs"), ("az://box/data.jsonl", "adlfs")])
def test_a_scheme_whose_package_is_not_installed_is_one_line(path, package, monkeypatch):
  """s3:// and az:// paths are etils' (through fsspec packages this project does not install): a tokenizer_path or a
  data file there was a raw ImportError ("Install s3fs to access S3") from deep inside a library."""
  import importlib.util

  find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else find_spec(name, *a))
  line = (f"{path}: {path.split(':')[0]}:// needs the {package} package, which this install does not have: `pip install "
          f"{package}`, or copy the files to gs:// or a local folder")
  for operation in (storage.read_bytes, storage.exists, lambda p: storage.write_text(p, "x")):
    with pytest.raises(UserError) as error:
      operation(path)
    assert str(error.value) == line
  with pytest.raises(UserError) as error:
    storage.check_buckets({"tokenizer_path": path}, 20)
  assert str(error.value) == f"tokenizer_path={line}"


def test_an_hf_path_whose_hub_cannot_be_reached_is_one_line(monkeypatch):
  """hf:// paths are etils' (huggingface_hub's file system): offline, a tokenizer_path there was the HTTP client's
  traceback ("ConnectError: Name or service not known"), and with HF_HUB_OFFLINE set it "did not exist"."""
  from MaxText.input_pipeline.tokenizer import load_tokenizer

  path = "hf://meta-llama/Llama-3.1-8B"
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  with pytest.raises(UserError, match=re.escape(f"{path}: hf:// paths are read from the Hugging Face Hub, and "
                                                "HF_HUB_OFFLINE is set; download the files")):
    load_tokenizer("huggingface", path)
  monkeypatch.delenv("HF_HUB_OFFLINE")

  class ConnectError(Exception):  # httpx's, by name: what a failed name lookup raises inside huggingface_hub
    pass

  def unreachable(*_):
    raise ConnectError("[Errno -2] Name or service not known")

  for operation in (storage.exists, storage.read_bytes):
    monkeypatch.setattr(storage, "as_path", lambda p: type("P", (), {"exists": unreachable,
                                                                       "read_bytes": unreachable})())
    with pytest.raises(UserError) as error:
      operation(f"{path}/tokenizer.json")
    assert str(error.value).startswith(f"{path}/tokenizer.json: cannot reach the Hugging Face Hub (ConnectError: "
                                       "[Errno -2] Name or service not known); check the network, or download")
