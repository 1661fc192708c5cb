"""An ASGI app under uvicorn on a free 127.0.0.1 port in a daemon thread, for the server tests: uvicorn configured
as MaxText.serve configures it (serve_app.uvicorn_config)."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import uvicorn

from MaxText.inference import serve_app


class UvicornThread:
  """Started on construction (waits until it listens); `url` is http://127.0.0.1:PORT; `close()` stops it."""

  def __init__(self, app: Any, read_timeout_seconds: float = serve_app.READ_TIMEOUT_SECONDS):
    self.uv = uvicorn.Server(serve_app.uvicorn_config(app, read_timeout_seconds, host="127.0.0.1", port=0))
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


def answers_health_while_held(url: str, monkeypatch: Any, owner: Any, name: str, request: Callable[[], Any]) -> Any:
  """Runs `request` on a thread while `owner.name` (the part of the request's parsing under test) is held until
  the server at `url` has answered /health: the server kept answering other requests while that part ran.
  Returns what `request` returned."""
  try:  # the openai client's own HTTP library (httpx2 in openai 3.x, httpx before)
    import httpx2 as httpx
  except ImportError:
    import httpx

  health_answered = threading.Event()
  original = getattr(owner, name)

  def held(*args: Any, **kwargs: Any) -> Any:
    assert health_answered.wait(30), f"/health did not answer while {name} ran"
    return original(*args, **kwargs)

  monkeypatch.setattr(owner, name, held)
  result: list[Any] = []
  worker = threading.Thread(target=lambda: result.append(request()))
  worker.start()
  time.sleep(0.5)
  assert httpx.get(f"{url}/health", timeout=10).status_code == 200
  health_answered.set()
  worker.join(120)
  assert result, "the held request did not finish"
  return result[0]

