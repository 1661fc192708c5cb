"""An ASGI app under uvicorn on a free 127.0.0.1 port in a daemon thread, for the server tests."""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn


class UvicornThread:
  """Started on construction (waits until it listens); `url` is http://127.0.0.1:PORT; `close()` stops it."""

  def __init__(self, app: Any):
    self.uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    self.thread = threading.Thread(target=self.uv.run, daemon=True)
    self.thread.start()
    deadline = time.monotonic() + 60
    while not self.uv.started:
      assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
      time.sleep(0.05)
    self.port = self.uv.servers[0].sockets[0].getsockname()[1]
    self.url = f"http://127.0.0.1:{self.port}"

  def close(self) -> None:
    self.uv.should_exit = True
    self.thread.join(30)
