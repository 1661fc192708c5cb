"""gs:// paths without Google Cloud credentials (no GOOGLE_APPLICATION_CREDENTIALS, no gcloud application-default
login, no GCE metadata server), from train.py, decode.py, serve.py and the path layer. A path that is only read goes
anonymous at once, as gsutil and TFDS do: a public bucket is read; a bucket that refuses anonymous reads (401/403), or a
storage that cannot be reached, is one line saying so and that no credentials were found. A path that is written is
refused before any request. Before, the libraries' own credentials chain and retries made the run wait out
storage_timeout_seconds (or storage_retry_seconds) and then blame the network; later every gs:// path was refused,
public reads included.

Google's endpoint is stood in for by tests/anonymous_gcs.py (or a closed port on 127.0.0.1), named through fsspec's
own setting FSSPEC_GCS_ENDPOINT_URL: STORAGE_EMULATOR_HOST would tell the project that no credentials are needed."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from MaxText.errors import UserError
from MaxText.paths import gcs_auth, storage, storage_retry
from tests.anonymous_gcs import AnonymousGcs
from tests.conftest import REPO_ROOT

sys.path.insert(0, str(Path(__file__).parent / "input_pipeline"))
from sft_fixtures import CHATML, WORDS, without_markers, write_tokenizer  # noqa: E402

TINY = ["base_emb_dim=32", "base_num_decoder_layers=1", "base_mlp_dim=64", "head_dim=16", "max_target_length=32",
        "print_config=False"]
WHAT_TO_DO = ("; run `gcloud auth application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS to a "
              "service-account key file (STORAGE_EMULATOR_HOST for a storage emulator)")
NONE_FOUND = "no GOOGLE_APPLICATION_CREDENTIALS, no gcloud application-default login, no GCE metadata server"


def no_credentials(home: Path) -> dict[str, str]:
  """An environment where google-auth finds nothing: no key file, an empty gcloud configuration, and no GCE check
  (so a test machine that is a GCE VM does not lend its service account)."""
  return {"PATH": "/usr/bin:/bin", "HOME": str(home), "CLOUDSDK_CONFIG": str(home / "gcloud"), "NO_GCE_CHECK": "True",
          "PYTHONPATH": str(REPO_ROOT), "JAX_PLATFORMS": "cpu"}


def refused(named: str, bucket: str, code: int) -> str:
  return (f"{named}: no Google Cloud credentials ({NONE_FOUND}), and gs://{bucket} refuses anonymous reads "
          f"(HTTP {code}){WHAT_TO_DO}")


def unreachable(named: str, endpoint: str, why: str) -> str:
  return (f"{named}: no Google Cloud credentials ({NONE_FOUND}), and the storage is unreachable ({endpoint}: {why}); "
          "check the network (or STORAGE_EMULATOR_HOST); a bucket that is not public also needs credentials: "
          "`gcloud auth application-default login` or GOOGLE_APPLICATION_CREDENTIALS")


def closed_port() -> str:
  """http://127.0.0.1:PORT where nothing listens: a storage that refuses connections."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def fake_gcs():
  """Google's endpoint as an anonymous caller sees it: bucket `pub` public, `priv` 401, `priv3` 403, and in `mixed`
  one object kept private (403)."""
  with AnonymousGcs({"pub/corpus.txt": b"First paragraph.\n\nSecond paragraph.\n\nThird one.\n",
                     "pub/tok/a.json": b"{}", "pub/tok/b.txt": b"b", "mixed/open": b"1", "mixed/closed": b"2"},
                    {"priv": 401, "priv3": 403, "mixed/closed": 403}) as server:
    yield server


def run_tool(tmp_path: Path, argv: list[str], endpoint: str, key_file: str = "") -> tuple[int, list[str]]:
  env = {**no_credentials(tmp_path), "FSSPEC_GCS_ENDPOINT_URL": endpoint}
  if key_file:
    env["GOOGLE_APPLICATION_CREDENTIALS"] = key_file
  proc = subprocess.run([sys.executable, "-m", *argv], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                        timeout=300)
  return proc.returncode, (proc.stdout + proc.stderr).strip().splitlines()


# storage_timeout_seconds: the first code waited this long for the bucket, then blamed the network.
@pytest.mark.parametrize("tool, args, key, path, key_file, expected", [
    # written: refused before any request (nothing can be written anonymously)
    ("train", ["run_name=creds", "steps=1", "dataset_type=synthetic"], "base_output_directory", "gs://pub/runs", "",
     "written"),
    # read: anonymous; a storage that refuses connections says so with the missing credentials
    ("train", ["run_name=creds", "steps=1", "dataset_type=hf", "base_output_directory=/tmp/unused"], "hf_data_files",
     "gs://pub/data/train.jsonl", "", "unreachable"),
    # read: anonymous; a private bucket's 401 is the line, not retried
    ("decode", [], "load_parameters_path", "gs://priv/ckpt/0/items", "", "refused"),
    # a GOOGLE_APPLICATION_CREDENTIALS that cannot be used: its user meant to sign in, reads are refused too
    ("serve", ["port=0"], "tokenizer_path", "gs://pub/tok", "/nonexistent/key.json", "written"),
], ids=["train_run_dir", "train_dataset_unreachable", "decode_checkpoint_private", "serve_tokenizer_bad_key_file"])
def test_a_gs_path_without_credentials_is_one_line(tmp_path, fake_gcs, tool, args, key, path, key_file, expected):
  endpoint = closed_port() if expected == "unreachable" else fake_gcs.url
  code, lines = run_tool(tmp_path, [f"MaxText.{tool}", "configs/base.yml", *TINY, *args, f"{key}={path}",
                                    "storage_timeout_seconds=20"], endpoint, key_file)
  problem = f"GOOGLE_APPLICATION_CREDENTIALS={key_file}: File {key_file} was not found." if key_file else NONE_FOUND
  line = {"written": f"{key}={path}: no Google Cloud credentials ({problem}){WHAT_TO_DO}",
          "unreachable": unreachable(f"{key}={path}", endpoint, "connection refused"),
          "refused": refused(f"{key}={path}", "priv", 401)}[expected]
  assert code == 2 and lines == [f"error: {line}"], (code, lines)
  if expected != "refused":
    assert fake_gcs.requests == []  # refused before any request
  else:
    assert fake_gcs.requests == [("GET", "/storage/v1/b/priv/o/ckpt%2F0%2Fitems?fields=name", False)]


def test_a_public_bucket_is_read_without_credentials(tmp_path, fake_gcs):
  """prepare_data reads its corpus from a public bucket on a machine with no credentials, as gsutil would."""
  code, lines = run_tool(tmp_path, ["MaxText.input_pipeline.prepare_data", "data_files=gs://pub/corpus.txt",
                                    f"output_path={tmp_path / 'out'}", "formats=jsonl", "eval_fraction=0.34"],
                         fake_gcs.url)
  assert code == 0 and len(lines) == 1 and lines[0].startswith("prepare_data: train 2, validation 1 documents"), lines
  assert (tmp_path / "out" / "jsonl" / "train.jsonl").read_text().count("paragraph") == 2
  assert fake_gcs.requests and not any(authorized for _, _, authorized in fake_gcs.requests)


@pytest.mark.slow
def test_a_public_dataset_trains_without_credentials(tmp_path, fake_gcs):
  """train.py with hf_data_files in a public bucket (datasets reads it through gcsfs, anonymously)."""
  tokenizer = write_tokenizer(tmp_path / "tok", None)
  fake_gcs.objects["pub/data/train.jsonl"] = "".join(
      json.dumps({"text": " ".join(WORDS[i:] + WORDS[:i])}) + "\n" for i in range(len(WORDS))).encode()
  code, lines = run_tool(tmp_path, ["MaxText.train", "configs/base.yml", *TINY, "run_name=public", "steps=1",
                                    f"base_output_directory={tmp_path / 'runs'}", "dataset_type=hf",
                                    "hf_data_files=gs://pub/data/train.jsonl", "tokenizer_type=huggingface",
                                    f"tokenizer_path={tokenizer}", "vocab_size=320", "data_prefetch_batches=0"],
                         fake_gcs.url)
  assert code == 0 and lines[-1].startswith("done: steps 1..1"), lines
  assert any("train.jsonl?alt=media" in path for _, path, _ in fake_gcs.requests)
  assert not any(authorized for _, _, authorized in fake_gcs.requests)


def test_serve_with_a_lora_adapter_in_a_private_bucket_without_credentials_is_one_line(tmp_path, fake_gcs):
  """serve_lora_adapters is not a path key the start-up checks: the adapter's first read names it."""
  tokenizer = write_tokenizer(tmp_path / "tok", without_markers(CHATML))
  code, lines = run_tool(tmp_path, ["MaxText.serve", "configs/base.yml", *TINY, "port=0", "vocab_size=272",
                                    f"tokenizer_path={tokenizer}", "tokenizer_type=huggingface",
                                    "serve_lora_adapters=[a=gs://priv3/adapter]", "storage_retry_seconds=20"],
                         fake_gcs.url)
  assert code == 2 and lines == [f"error: {refused('gs://priv3/adapter/adapter_config.json', 'priv3', 403)}"], \
      (code, lines)


@pytest.fixture
def laptop(tmp_path, monkeypatch):
  """This process without credentials (and without an emulator), gs:// requests going to `endpoint(url)`."""
  import fsspec

  for name in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "TENSORSTORE_GCS_HTTP_URL",
               "GOOGLE_AUTH_TOKEN_FOR_TESTING"):  # what the session's emulator may have set
    monkeypatch.delenv(name, raising=False)
  for name, value in no_credentials(tmp_path).items():
    if name not in ("PATH", "PYTHONPATH", "JAX_PLATFORMS"):
      monkeypatch.setenv(name, value)
  monkeypatch.setitem(fsspec.config.conf, "gcs", {})
  gcs_auth.forget()

  def endpoint(url: str) -> None:
    fsspec.config.conf["gcs"]["endpoint_url"] = url
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", url)  # Orbax's arrays

  yield endpoint
  gcs_auth.forget()


def test_reads_go_anonymous_and_writes_are_refused_in_process(laptop, fake_gcs, tmp_path):
  """The path layer: a public bucket's files are read (no Authorization header sent); a private bucket's refusal is
  the one line after one request; an object a public bucket keeps private too; writes are refused before asking."""
  laptop(fake_gcs.url)
  assert storage.read_bytes("gs://pub/tok/a.json") == b"{}"
  assert storage.is_dir("gs://pub/tok") and storage.listdir("gs://pub/tok") == ["a.json", "b.txt"]
  assert storage.glob("gs://pub/tok/*.txt") == ["gs://pub/tok/b.txt"]
  with storage.local_copy("gs://pub/tok") as local:
    assert sorted(p.name for p in Path(local).iterdir()) == ["a.json", "b.txt"]
  storage.check_buckets({"tokenizer_path": "gs://pub/tok", "base_output_directory": str(tmp_path)}, 20)
  assert not any(authorized for _, _, authorized in fake_gcs.requests)
  asked = len(fake_gcs.requests)
  for operation, bucket, code in ((storage.read_bytes, "priv", 401), (storage.exists, "priv3", 403)):
    with pytest.raises(UserError) as error:
      operation(f"gs://{bucket}/some/object")
    assert str(error.value) == refused(f"gs://{bucket}/some/object", bucket, code)
  assert len(fake_gcs.requests) == asked + 2  # one request each: a 401/403 is not retried
  assert storage.read_bytes("gs://mixed/open") == b"1"
  with pytest.raises(UserError) as error:
    storage.read_bytes("gs://mixed/closed")
  assert str(error.value) == refused("gs://mixed/closed", "mixed", 403)
  with pytest.raises(UserError) as error:
    storage.check_buckets({"tokenizer_path": "gs://priv/tok"}, 20)
  assert str(error.value) == refused("tokenizer_path=gs://priv/tok", "priv", 401)
  with pytest.raises(UserError) as error:  # named at start-up, as with credentials
    storage.check_buckets({"tokenizer_path": "gs://no-such-bucket/tok"}, 20)
  assert str(error.value) == "tokenizer_path=gs://no-such-bucket/tok: bucket gs://no-such-bucket does not exist; " \
                             "create it or fix the path"
  asked = len(fake_gcs.requests)
  for operation in (lambda p: storage.write_text(p, "x"), storage.makedirs, storage.remove_tree,
                    lambda p: storage.open_file(p, "w")):
    with pytest.raises(UserError) as error:
      operation("gs://pub/runs/r1")
    assert str(error.value) == f"gs://pub/runs/r1: no Google Cloud credentials ({NONE_FOUND}){WHAT_TO_DO}"
  with pytest.raises(UserError) as error:  # a written key in a bucket a read key names before it
    storage.check_buckets({"tokenizer_path": "gs://pub/tok", "output_path": "gs://pub/out"}, 20)
  assert str(error.value) == f"output_path=gs://pub/out: no Google Cloud credentials ({NONE_FOUND}){WHAT_TO_DO}"
  assert len(fake_gcs.requests) == asked


def test_a_checkpoint_in_a_public_bucket_loads_without_credentials(laptop, tmp_path):
  """A parameters-only checkpoint read from a public bucket (Orbax: its metadata through gcsfs, its arrays through
  TensorStore, both anonymous), as decode.py or a fine-tune's load_parameters_path reads one."""
  import jax
  import numpy as np

  from MaxText.training import params_io

  params = {"decoder": {"w": jax.numpy.arange(16.0).reshape(4, 4), "b": jax.numpy.ones(3)}}
  params_io.save_params(str(tmp_path / "ckpt"), params)
  objects = {f"pub/ckpt/{p.relative_to(tmp_path / 'ckpt')}": p.read_bytes()
             for p in (tmp_path / "ckpt").rglob("*") if p.is_file()}
  with AnonymousGcs(objects, {}) as server:
    laptop(server.url)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    one_device = jax.tree.map(lambda x: jax.sharding.SingleDeviceSharding(jax.devices()[0]), params)
    loaded = params_io.load_params("gs://pub/ckpt", abstract, one_device)
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), loaded, params))


def test_unreachable_storage_without_credentials_says_both_and_an_emulator_needs_none(laptop, monkeypatch):
  """No credentials and a storage that refuses connections, or whose name does not resolve: the read says both at once
  (not storage_retry_seconds of retries that end in blaming the network); one that never answers says how long it was
  waited for; with STORAGE_EMULATOR_HOST no credentials are asked for."""
  endpoint = closed_port()
  laptop(endpoint)
  for operation in (storage.exists, storage.read_bytes, storage.listdir):
    with pytest.raises(UserError) as error:
      operation("gs://pub/some/object")
    assert str(error.value) == unreachable("gs://pub/some/object", endpoint, "connection refused")
  gcs_auth.forget()
  laptop("http://storage.invalid")  # a name that never resolves (RFC 6761)
  with pytest.raises(UserError) as error:
    storage.read_bytes("gs://pub/some/object")
  assert str(error.value) == unreachable("gs://pub/some/object", "http://storage.invalid", "cannot resolve storage.invalid")
  with socket.socket() as silent:  # takes connections (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    gcs_auth.forget()
    laptop(f"http://127.0.0.1:{silent.getsockname()[1]}")
    monkeypatch.setattr(storage_retry, "_state", storage_retry._State(budget=5))  # a probe of budget/5 = 1 s
    with pytest.raises(UserError) as error:
      storage.read_bytes("gs://pub/some/object")
    assert str(error.value) == unreachable("gs://pub/some/object", f"http://127.0.0.1:{silent.getsockname()[1]}",
                                           "no answer within 1 s")
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")
  assert storage.credentials_problem() is None


def test_odd_environments_and_a_path_with_no_bucket_are_one_line(laptop, fake_gcs, tmp_path, monkeypatch):
  """gs:// with no bucket is named before any request (it was asked for as bucket ''); a GOOGLE_APPLICATION_CREDENTIALS
  naming a directory is one line (an IsADirectoryError traceback from google-auth before); STORAGE_EMULATOR_HOST set but
  empty names no emulator, as gcsfs reads it (the credentials check was skipped, writes went to Google's endpoint)."""
  laptop(fake_gcs.url)
  for path, named in (("gs://", "gs://"), ("gs:///x", "tokenizer_path=gs:///x")):
    with pytest.raises(UserError) as error:
      if named == path:
        storage.read_bytes(path)
      else:
        storage.check_buckets({"tokenizer_path": path}, 20)
    assert str(error.value) == f"{named}: names no bucket; write gs://BUCKET/OBJECT"
  with pytest.raises(UserError) as error:
    storage.write_text("gs:///x", "x")
  assert str(error.value) == "gs:///x: names no bucket; write gs://BUCKET/OBJECT"
  assert fake_gcs.requests == []
  monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path))
  gcs_auth.forget()
  with pytest.raises(UserError) as error:
    storage.read_bytes("gs://pub/tok/a.json")
  assert str(error.value) == (f"gs://pub/tok/a.json: no Google Cloud credentials (GOOGLE_APPLICATION_CREDENTIALS="
                              f"{tmp_path}: cannot read it (Is a directory)){WHAT_TO_DO}")
  monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS")
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", "")
  gcs_auth.forget()
  assert storage.credentials_problem() == NONE_FOUND
  with pytest.raises(UserError) as error:
    storage.write_text("gs://pub/runs/x", "x")
  assert str(error.value) == f"gs://pub/runs/x: no Google Cloud credentials ({NONE_FOUND}){WHAT_TO_DO}"
  assert storage.read_bytes("gs://pub/tok/a.json") == b"{}"


def test_a_url_holding_a_line_break_is_one_line_before_any_request(laptop: Any, fake_gcs: Any) -> None:
  """A path pasted with its line's end (`gs://pub/a\\n`): no object name holds a line break; it was asked for, and the
  message that named it ran over two lines."""
  laptop(fake_gcs.url)
  fake_gcs.objects.update({"pub/a": b"1"})
  for path in ("gs://pub/a\n", "gs://pub/a\r\n"):
    for operation in (storage.read_bytes, lambda p: storage.write_text(p, "x"), storage.makedirs):
      with pytest.raises(UserError) as error:
        operation(path)
      assert str(error.value) == f"{path!r}: a line break in a URL; remove it"
  assert fake_gcs.requests == []

def test_a_path_that_cannot_mean_what_was_written_is_one_line_before_any_request(laptop, fake_gcs, tmp_path,
                                                                                   monkeypatch):
  """`gs:/b/x` and `gs:b/x` (a slash short) were local paths: a read said a local file was missing, a write created a
  directory named `gs:` beside the run; `GS://`, ` gs://` and `gcs://` were a KeyError traceback from etils.epath (at
  start-up: "cannot reach bucket GS://pub: KeyError"); `gs://PUB/x` was asked for and called a missing bucket. Trailing
  and doubled slashes, spaces and non-ASCII characters in an object's name still read."""
  laptop(fake_gcs.url)
  monkeypatch.chdir(tmp_path)
  for path, line in (("gs:/pub/out", "gs:/pub/out: gs: needs two slashes; write gs://BUCKET/OBJECT"),
                     ("GS:b/x", "GS:b/x: gs: needs two slashes; write gs://BUCKET/OBJECT"),
                     ("gs//pub/out", "gs//pub/out: gs// has no colon; write gs://BUCKET/OBJECT"),  # was local gs/pub/
                     ("GS://pub/out", "GS://pub/out: unknown scheme 'GS'; write gs:// in lowercase, with nothing before it"),
                     (" gs://pub/out", " gs://pub/out: unknown scheme ' gs'; write gs:// in lowercase, with nothing "
                                       "before it"),
                     ("gcs://pub/out", "gcs://pub/out: unknown scheme 'gcs'; a path is local or gs://BUCKET/OBJECT"),
                     ("gs://PUB/out", "gs://PUB/out: 'PUB' is not a bucket name (lowercase letters, digits, '-', '_' and "
                                      "'.'); fix the path"),
                     ("gs://my bucket/out", "gs://my bucket/out: 'my bucket' is not a bucket name (lowercase letters, "
                                            "digits, '-', '_' and '.'); fix the path")):
    for operation in (storage.read_bytes, lambda p: storage.write_text(p, "x"), storage.makedirs):
      with pytest.raises(UserError) as error:
        operation(path)
      assert str(error.value) == line
    if not path.startswith(" "):  # the start-up check strips each of a list's paths
      with pytest.raises(UserError) as error:
        storage.check_buckets({"hf_data_files": path}, 20)
      assert str(error.value) == f"hf_data_files={line}"
  assert fake_gcs.requests == [] and list(tmp_path.iterdir()) == []  # nothing asked, nothing written locally
  fake_gcs.objects.update({"pub/a b": b"1", "pub/\u00e9t\u00e9": b"2"})
  for path, data in (("gs://pub/tok/a.json/", b"{}"), ("gs://pub//tok/a.json", b"{}"), ("gs://pub/a b", b"1"),
                     ("gs://pub/\u00e9t\u00e9", b"2")):
    assert storage.read_bytes(path) == data, path


@pytest.mark.parametrize("text, why", [
    ("[]", re.escape("not a key file (its JSON is not an object: AttributeError)")),
    ("{\"type\": \"service_account\"}", re.escape("Failed to load service account credentials from {key} (Service account "
     "info was not in the expected format, missing fields ") + r"(client_email|token_uri), (client_email|token_uri)\.\)"),
    ("not json{", re.escape("File {key} is not a valid json file. (Expecting value: line 1 column 1 (char 0))")),
], ids=["a_json_list", "a_service_account_missing_fields", "garbage"])
def test_a_key_file_google_auth_cannot_use_is_one_readable_line(laptop, fake_gcs, tmp_path, monkeypatch, text, why):
  """A key file holding a JSON list was an AttributeError traceback from google-auth; its other refusals read as the
  repr of a tuple ("('Failed to load ...', MalformedError('...'))")."""
  laptop(fake_gcs.url)
  key = tmp_path / "key.json"
  key.write_text(text)
  monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
  gcs_auth.forget()
  with pytest.raises(UserError) as error:
    storage.read_bytes("gs://pub/tok/a.json")
  assert re.fullmatch(re.escape(f"gs://pub/tok/a.json: no Google Cloud credentials (GOOGLE_APPLICATION_CREDENTIALS="
                                f"{key}: ") + why.replace(re.escape("{key}"), re.escape(str(key))) +
                      re.escape(f"){WHAT_TO_DO}"), str(error.value)), str(error.value)
  assert fake_gcs.requests == []


def ours(lines: list[str]) -> list[str]:
  """`lines` without gRPC's own log lines: with credentials gcsfs also asks a storage-control gRPC API at the stand-in's
  address, whose TLS handshakes with a plain HTTP server fail and are logged (Google's endpoint would answer them)."""
  return [line for line in lines if not re.match(r"[IWE]\d{4} \d", line)]


@pytest.fixture
def refused_key(tmp_path):
  """A service-account key file whose token endpoint (a stand-in on 127.0.0.1) refuses it as Google refuses a deleted
  or revoked key: 400 invalid_grant. Yields (key file, the token requests answered)."""
  import threading
  from http.server import BaseHTTPRequestHandler, HTTPServer

  from cryptography.hazmat.primitives import serialization
  from cryptography.hazmat.primitives.asymmetric import rsa

  asked: list[str] = []

  class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
      pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
      self.rfile.read(int(self.headers.get("Content-Length", 0)))
      asked.append(self.path)
      body = json.dumps({"error": "invalid_grant", "error_description": "Invalid JWT Signature."}).encode()
      self.send_response(400)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)

  server = HTTPServer(("127.0.0.1", 0), Handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
      serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
  key = tmp_path / "revoked.json"
  key.write_text(json.dumps({"type": "service_account", "client_email": "run@p.iam.gserviceaccount.com", "project_id": "p",
                             "private_key_id": "1", "private_key": pem,
                             "token_uri": f"http://127.0.0.1:{server.server_address[1]}/token"}))
  yield key, asked
  server.shutdown()
  server.server_close()


# (the path's key=value, the wait it would have run out, what the line names, whether it stops before any request)
REFUSED_CASES = {
    # At start-up: the check waited out storage_timeout_seconds and said "no answer from storage ... check the
    # network".
    "start-up": ("load_parameters_path=gs://pub/ckpt", "storage_timeout_seconds=60",
                 "load_parameters_path=gs://pub/ckpt", True),
    # A read after start-up (serve_lora_adapters is not a path key the start-up checks) stops at the first bucket
    # probe of its retry loop (that client's refresh is refused); it waited out storage_retry_seconds and said the
    # storage is unreachable.
    "later read": ("serve_lora_adapters=[a=gs://pub/adapter]", "storage_retry_seconds=60",
                   "gs://pub/adapter/adapter_config.json", False),
}


@pytest.mark.parametrize("case", list(REFUSED_CASES))
def test_credentials_google_refuses_are_one_line_at_once(tmp_path, fake_gcs, refused_key, case):
  """A key file google-auth reads but Google refuses (revoked, deleted: invalid_grant) stops the tool with one line
  naming it (gcsfs retries every RefreshError). A subprocess: a read's own thread, left behind, would keep retrying
  in this one."""
  path, wait, named, before_any_request = REFUSED_CASES[case]
  key, asked = refused_key
  tokenizer = write_tokenizer(tmp_path / "tok", without_markers(CHATML))
  code, lines = run_tool(tmp_path, ["MaxText.serve", "configs/base.yml", *TINY, "port=0", "vocab_size=272",
                                    f"tokenizer_path={tokenizer}", "tokenizer_type=huggingface", path, wait],
                         fake_gcs.url, str(key))
  line = (f"{named}: Google refused GOOGLE_APPLICATION_CREDENTIALS={key} (invalid_grant: "
          f"Invalid JWT Signature.){WHAT_TO_DO}")
  assert code == 2 and ours(lines) == [f"error: {line}"], (code, lines)
  if before_any_request:
    assert asked and fake_gcs.requests == []
