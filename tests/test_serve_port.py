"""`python3 -m MaxText.serve`'s port: bound before the model loads, so a port another program holds
stops the server with one line (a client polling that port would otherwise talk to the other
program), and port=0 takes a free port that the start-up line names."""

from __future__ import annotations

import socket
import types

import pytest

from MaxText import serve
from MaxText.configuration.config import Config
from MaxText.errors import UserError


def _main_with(monkeypatch, port: int, loaded: list[str], served: list[socket.socket]) -> None:
  """serve.main with `port=` and everything heavy stood in: start-up builds a test config, the
  model load records itself, uvicorn records the sockets it was given."""
  config = Config.for_testing(port=port)
  monkeypatch.setattr(serve.startup, "start", lambda tool, argv: types.SimpleNamespace(config=config))

  def build_server(config):
    loaded.append("model")
    return types.SimpleNamespace(limits=types.SimpleNamespace(model_name="default"),
                                 scheduler=types.SimpleNamespace(stop=lambda: None))

  monkeypatch.setattr(serve, "build_server", build_server)
  monkeypatch.setattr(serve, "build_app", lambda server, max_body_bytes, read_timeout_seconds: object())
  import uvicorn

  class Server:  # uvicorn's real Config would set up its loggers on pytest's captured streams
    def __init__(self, config):
      pass

    def run(self, sockets=None):
      served.extend(sockets or [])

  monkeypatch.setattr(uvicorn, "Config", lambda app, **kwargs: None)
  monkeypatch.setattr(uvicorn, "Server", Server)
  monkeypatch.setattr(serve.serve_app, "run", lambda uv, server, sockets: uv.run(sockets=sockets))

  def run(*args, **kwargs):
    raise AssertionError("uvicorn.run binds the port only after the model has loaded")

  monkeypatch.setattr(uvicorn, "run", run)
  serve.main(["serve"])


def test_a_taken_port_stops_the_server_before_the_model_loads(monkeypatch):
  with socket.socket() as other:  # another program on the port
    other.bind(("127.0.0.1", 0))
    other.listen()
    port = other.getsockname()[1]
    loaded: list[str] = []
    with pytest.raises(UserError, match=rf"cannot listen on 127.0.0.1:{port} .*port=0"):
      _main_with(monkeypatch, port, loaded, [])
    assert loaded == []  # failed at once, not after loading a checkpoint


def test_port_zero_serves_on_a_free_port_the_start_up_line_names(monkeypatch, capsys):
  loaded: list[str] = []
  served: list[socket.socket] = []
  _main_with(monkeypatch, 0, loaded, served)
  assert loaded == ["model"] and len(served) == 1
  port = served[0].getsockname()[1]
  served[0].close()
  assert port != 0
  assert f"serve: model 'default' on http://127.0.0.1:{port}/v1 (" in capsys.readouterr().out


def test_an_ipv6_address_is_bracketed():
  sock = types.SimpleNamespace(getsockname=lambda: ("::1", 8123, 0, 0))
  assert serve.address("::1", sock) == "http://[::1]:8123"  # type: ignore[arg-type]
