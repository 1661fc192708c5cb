"""An HTTP proxy in front of the GCS emulator that injects storage faults on command.

Modes (`set_mode`), each for every request or for a seeded fraction of them:
  pass    forward as is
  forbid_writes  answer every write (POST/PUT/PATCH/DELETE) 403, reads pass (what GCS answers
          when a permission or a retention policy forbids the write)
  5xx     answer 503 with a GCS-style JSON error (what GCS sends when it is overloaded)
  reset   close the connection with a TCP reset before answering
  stall   hold the request `stall_seconds`, then forward it (a slow or hung endpoint)
  down    stop listening: new connections are refused, open ones are reset (a stopped endpoint)

`on_request(predicate, action)` runs `action` once, on the proxy thread, when a request
matching `predicate(method, path)` arrives, before it is forwarded; the request then waits
`hold_seconds` so that the action (a SIGKILL, say) lands while the write is in flight.
"""

from __future__ import annotations

import collections
import http.client
import http.server
import json
import random
import socket
import struct
import threading
import time
from typing import Callable

MODES = ("pass", "forbid_writes", "5xx", "reset", "stall", "down")


class FaultProxy:
  def __init__(self, upstream: str, seed: int = 0):
    self.host, port = upstream.split("://", 1)[1].split(":")
    self.upstream_port = int(port)
    self.mode, self.fraction, self.stall_seconds = "pass", 1.0, 0.0
    self.counts: collections.Counter[str] = collections.Counter()  # requests by what was done to them
    self._random = random.Random(seed)
    self._lock = threading.Lock()
    self._hooks: list[tuple[Callable[[str, str], bool], Callable[[], None], float]] = []
    self._server: http.server.ThreadingHTTPServer | None = None
    self.port = 0
    self._listen()
    self.url = f"http://127.0.0.1:{self.port}"

  # ------------------------------------------------------------------ control
  def set_mode(self, mode: str, fraction: float = 1.0, stall_seconds: float = 0.0) -> None:
    assert mode in MODES, mode
    with self._lock:
      was_down = self.mode == "down"
      self.mode, self.fraction, self.stall_seconds = mode, fraction, stall_seconds
    if mode == "down" and not was_down:
      self._close_listener()
    elif mode != "down" and was_down:
      self._listen()

  def on_request(self, predicate: Callable[[str, str], bool], action: Callable[[], None],
                 hold_seconds: float = 2.0) -> None:
    with self._lock:
      self._hooks.append((predicate, action, hold_seconds))

  def clear_hooks(self) -> None:
    with self._lock:
      self._hooks.clear()

  def env(self) -> dict[str, str]:
    return {"STORAGE_EMULATOR_HOST": self.url}

  def close(self) -> None:
    self._close_listener()

  # ------------------------------------------------------------------ internals
  def _decide(self, method: str, path: str) -> tuple[str, float, Callable[[], None] | None, float]:
    with self._lock:
      hook = next((h for h in self._hooks if h[0](method, path)), None)
      if hook is not None:
        self._hooks.remove(hook)
      mode = self.mode if self._random.random() < self.fraction else "pass"
      self.counts[mode] += 1
      return mode, self.stall_seconds, (hook[1] if hook else None), (hook[2] if hook else 0.0)

  def _listen(self) -> None:
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

      def _reset(self) -> None:
        # SO_LINGER 0: close() sends RST instead of FIN, what a crashed peer or a middlebox does.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()

      def _reply(self, status: int, payload: bytes, headers: list[tuple[str, str]]) -> None:
        self.send_response(status)
        for key, value in headers:
          self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

      def _forward(self) -> None:
        body = self._body()
        mode, stall, action, hold = proxy._decide(self.command, self.path)
        if action is not None:
          action()
          time.sleep(hold)
        if mode == "stall":
          time.sleep(stall)
        if mode == "reset" or proxy.mode == "down":
          return self._reset()
        if mode == "5xx" or (mode == "forbid_writes" and self.command != "GET"):
          status, message = (503, "service unavailable") if mode == "5xx" else (403, "writes refused")
          payload = json.dumps({"error": {"code": status, "message": f"injected: {message}"}}).encode()
          return self._reply(status, payload, [("Content-Type", "application/json")])
        conn = http.client.HTTPConnection(proxy.host, proxy.upstream_port, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "host")}
        headers["Content-Length"] = str(len(body))
        try:
          conn.request(self.command, self.path, body=body, headers=headers)
          response = conn.getresponse()
          data = response.read()
        except OSError:
          return self._reset()
        finally:
          conn.close()
        self._reply(response.status, data, [(k, v) for k, v in response.getheaders()
                                            if k.lower() not in ("transfer-encoding", "content-length", "connection")])

      def handle_one_request(self) -> None:
        try:
          super().handle_one_request()
        except OSError:  # the client went away, or we reset it
          self.close_connection = True

      do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _forward

    class Server(http.server.ThreadingHTTPServer):
      allow_reuse_address = True
      daemon_threads = True

    self._server = Server(("127.0.0.1", self.port), Handler)
    self.port = self._server.server_address[1]
    threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True).start()

  def _close_listener(self) -> None:
    if self._server is not None:
      self._server.shutdown()
      self._server.server_close()
      self._server = None
