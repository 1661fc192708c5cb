"""The server split over processes (serve_http_processes = N >= 1), the engine's side: this process
keeps JAX, the parameters, the scheduler thread and the grammar compiler, and starts N HTTP front-end
processes (serve_frontend.py, without JAX) that all serve the listening socket it bound. HTTP, JSON,
tokenising and detokenising then run beside the scheduler instead of sharing its interpreter lock.

Per front end, over one Unix socket pair: a reader thread turns its submits into `sched.Job`s (a
grammar's constraint built here) and its cancels into `Job.cancel`; the jobs' events gather during a
scheduler loop and, at its end (`Scheduler.after_loop`), go to a writer thread as one message, which
it sends (with the admissions and load figures the reader answers) without holding up the scheduler.

/metrics: each front end counts the requests it answers and sends what it observes here, from where it
goes on to every other front end (nothing is counted here), so each front end's counts are the whole server's.

LoRA adapters (lora_adapters.Registry): a submit naming one holds it, as serve.Server does, until each
job's Done; an add or remove asked by any front end runs on a thread of its own, and the new name list
goes to every front end before the answer goes to the one that asked.

Lifecycle: a front end that exits while the server is not stopping stops the server with one line
and a non-zero exit; the front ends stop at the end of file of their channel when this process ends
(however it ends); SIGINT or SIGTERM here stops them first (they run in their own session, so a
terminal's Ctrl-C reaches this process only), then the scheduler.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from MaxText.errors import UserError
from MaxText.inference import grammar, job_events, lora_admin
from MaxText.inference import scheduler as sched
from MaxText.inference.serve_frontend import FrontSpec, frame, read_payload

if TYPE_CHECKING:
  from MaxText.inference.lora_adapters import Registry

_STOP_SECONDS = 10.0  # a front end's graceful stop before it is killed
_REPO = str(Path(__file__).resolve().parents[2])
# The grammar compiler is built lazily (serve_codec.grammars, importing transformers' tokenizer) and not
# thread-safe: the reader threads of several front ends take it one at a time.
_GRAMMARS_LOCK = threading.Lock()


def _portable(e: Exception) -> Exception:
  """`e` as a front end unpickles it (it has no JAX): the registry's refusals as they are, any other
  UserError as one, the rest as a RuntimeError naming its type."""
  if isinstance(e, (lora_admin.NameTaken, lora_admin.SlotsFull, lora_admin.UnknownAdapter, lora_admin.AdapterBusy)):
    return e
  if isinstance(e, UserError):
    return UserError(str(e))
  return RuntimeError(f"{type(e).__name__}: {e}")


class _Adapters:
  """The LoRA adapter registry as every front end reaches it."""

  def __init__(self, registry: Registry):
    self.registry = registry
    self.links: list[_Link] = []
    self._announcing = threading.Lock()  # name lists reach each front end in the order they were read

  def ask(self, link: _Link, ask_id: int, op: str, args: tuple[Any, ...]) -> None:
    """Runs `op` on a thread of its own (an add reads weights and writes the tables: the reader goes on)."""
    threading.Thread(target=self._run, args=(link, ask_id, op, args), name="maxtext-lora-admin", daemon=True).start()

  def _run(self, link: _Link, ask_id: int, op: str, args: tuple[Any, ...]) -> None:
    answer: Any
    try:
      if op == "list":
        answer = self.registry.adapters()
      elif op in ("add", "remove"):
        answer = self.registry.add(*args) if op == "add" else self.registry.remove(*args)
        with self._announcing:
          names = ("adapter_names", tuple(self.registry.names()))
          for other in self.links:
            other.send([names])
      else:
        raise ValueError(f"unknown adapter operation {op!r}")
    except Exception as e:  # noqa: BLE001 - the answer of the route that asked
      answer = _portable(e)
    link.send([("adapters", ask_id, answer)])


class _Link:
  """One front end's channel, on the engine's side."""

  def __init__(self, index: int, channel: socket.socket, scheduler: sched.Scheduler,
               grammars: Callable[[], grammar.Compiler] | None, lost: threading.Event,
               adapters: _Adapters | None = None):
    self.index, self.channel, self.scheduler, self.grammars, self.lost = index, channel, scheduler, grammars, lost
    self.adapters = adapters
    self.peers: list[_Link] = []  # the other front ends' links (their /metrics observations are shared)
    self._events: list[tuple[Any, ...]] = []  # this scheduler loop's, gathered on the scheduler thread
    self._lock = threading.Lock()  # guards _events, _jobs and _open
    self._sending: queue.SimpleQueue[list[tuple[Any, ...]] | None] = queue.SimpleQueue()  # None: stop
    self._jobs: dict[int, list[sched.Job]] = {}  # request id -> its jobs until every one is done
    self._open: dict[int, int] = {}
    self._threads = [threading.Thread(target=self._read, name=f"maxtext-frontend-{index}-read", daemon=True),
                     threading.Thread(target=self._write, name=f"maxtext-frontend-{index}-write", daemon=True)]

  def start(self) -> _Link:
    for thread in self._threads:
      thread.start()
    return self

  def flush(self) -> None:
    """The loop's events to the writer, as one message (a Scheduler.after_loop hook)."""
    if self._events:
      with self._lock:
        events, self._events = self._events, []
      self._sending.put(events)

  def send(self, items: list[tuple[Any, ...]]) -> None:
    """`items` to the front end as (part of) one message, after what was queued before."""
    self._sending.put(items)

  def close(self) -> None:
    self._sending.put(None)
    try:
      self.channel.shutdown(socket.SHUT_RDWR)
    except OSError:
      pass
    self.channel.close()

  def _write(self) -> None:
    while True:
      items = self._sending.get()
      while items is not None and not self._sending.empty():  # what queued meanwhile goes in the same message
        more = self._sending.get()
        items = None if more is None else items + more
      if items is None:
        return
      try:
        self.channel.sendall(frame(items))
      except OSError:  # the front end is gone: its reader sees the end of file
        return

  def _read(self) -> None:
    try:
      while True:
        payload, message = read_payload(self.channel), None
        try:
          message = pickle.loads(payload)
          self._handle(message)
        except Exception as e:  # noqa: BLE001 - one message is lost, not the channel (its requests would hang)
          print(f"serve: error: a message from HTTP front-end process {self.index} failed here "
                f"({type(e).__name__}: {e}); ignored", file=sys.stderr, flush=True)
          if isinstance(message, tuple) and len(message) > 1 and message[0] == "submit":  # its request fails
            self._sending.put([("admit", message[1], ("error", f"{type(e).__name__}: {e}"))])
          elif isinstance(message, tuple) and len(message) > 1 and message[0] == "adapters":  # so does its route
            self._sending.put([("adapters", message[1], _portable(e))])
    except (EOFError, OSError):
      pass
    with self._lock:
      jobs = [job for request in self._jobs.values() for job in request]
    for job in jobs:
      job.cancel()
    self.lost.set()

  def _handle(self, message: tuple[Any, ...]) -> None:
    if message[0] == "submit":
      self._submit(*message[1:])
    elif message[0] == "cancel":
      with self._lock:
        jobs = self._jobs.get(message[1])
      if jobs is not None:
        jobs[message[2]].cancel()
    elif message[0] == "load":
      self._sending.put([("load", self.scheduler.load())])
    elif message[0] == "observe":  # passed on as it came: the front ends count, not this process
      for peer in self.peers:
        peer.send([("observe", message[1])])
    elif message[0] == "adapters":
      if self.adapters is None:
        raise ValueError("this server serves no LoRA adapters")
      self.adapters.ask(self, message[1], message[2], tuple(message[3]))
    else:
      raise ValueError(f"unknown message {message[0]!r}")

  def _submit(self, request_id: int, choices: list[tuple[Any, ...]], score_prompt: bool, grammar_text: str | None,
              top_logprobs: bool = True, adapter: str | None = None) -> None:
    """`adapter`: the LoRA adapter the request names, held (as serve.Server holds it) until each job's Done."""
    def emit(event: sched.Event) -> None:  # on the scheduler thread; sent at the end of its loop
      with self._lock:
        self._events.append(("event", request_id, event))
        if isinstance(event, sched.Done):
          self._open[request_id] -= 1
          if not self._open[request_id]:
            del self._open[request_id], self._jobs[request_id]

    registry, row_of, key = None, 0, b""
    if adapter is not None:
      try:
        if self.adapters is None:
          raise ValueError("this server serves no LoRA adapters")
        registry = self.adapters.registry
        row_of, key = registry.hold(adapter, len(choices))
      except Exception as e:  # noqa: BLE001 - the request's answer: an adapter removed since it was read is a 404
        refusal = ("unknown", adapter) if isinstance(e, lora_admin.UnknownAdapter) else (
            "error", f"{type(e).__name__}: {e}")
        self._sending.put([("admit", request_id, refusal)])
        return

    def release() -> None:
      if registry is not None and adapter is not None:
        for _ in choices:
          registry.release(adapter)

    try:
      compiler = None
      if grammar_text is not None and self.grammars is not None:
        with _GRAMMARS_LOCK:
          compiler = self.grammars()
      jobs = []
      scoring = job_events.scoring([(c[0], c[1]) for c in choices], score_prompt)  # one job per prompt scores it
      for (index, prompt, max_tokens, row, images), scores in zip(choices, scoring):
        constraint = None
        if compiler is not None and grammar_text is not None:
          constraint = grammar.Grammar(grammar_text, compiler.tokenizer, compiler.vocab_size).constraint()
        if registry is None or adapter is None:
          jobs.append(sched.Job(index, prompt, max_tokens, row, emit, scores, images=images,
                                constraint=constraint, top_logprobs=top_logprobs))
        else:
          jobs.append(sched.Job(index, prompt, max_tokens, dataclasses.replace(row, adapter=row_of),
                                registry.releasing(adapter, emit), scores, images=images,
                                constraint=constraint, cache_key=key, top_logprobs=top_logprobs))
    except Exception as e:  # noqa: BLE001 - the request fails (a 500), not the front end's channel
      release()
      traceback.print_exc()
      self._sending.put([("admit", request_id, ("error", f"{type(e).__name__}: {e}"))])
      return
    with self._lock:
      self._jobs[request_id], self._open[request_id] = jobs, len(jobs)
    try:
      self.scheduler.submit(jobs)
    except Exception as e:  # noqa: BLE001 - QueueFull and TooLarge are the client's answers, others a 500
      with self._lock:
        del self._jobs[request_id], self._open[request_id]
      release()
      kind = "full" if isinstance(e, sched.QueueFull) else "large" if isinstance(e, sched.TooLarge) else "error"
      self._sending.put([("admit", request_id, (kind, str(e) if kind != "error" else f"{type(e).__name__}: {e}"))])
      return
    self._sending.put([("admit", request_id, None)])


def check_count(processes: int) -> None:
  """UserError for more front ends than the cores this process may run on: each is a Python process of its own,
  and past the cores they only wait for one (a count far past them would use up the machine's memory)."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
  if processes > cores:
    raise UserError(f"serve_http_processes={processes} is more than the {cores} CPU cores this server may use, and "
                    f"each HTTP front end is a process of its own: set serve_http_processes to at most {cores}")


class FrontEnds:
  """N front-end processes on `sock` (bound and listening), their jobs submitted to `scheduler`."""

  def __init__(self, scheduler: sched.Scheduler, grammars: Callable[[], grammar.Compiler] | None,
               sock: socket.socket, spec: FrontSpec, processes: int, registry: Registry | None = None):
    self.lost = threading.Event()  # a channel ended: its front end is gone
    self.stopping = False
    self.processes: list[subprocess.Popen[bytes]] = []
    self.links: list[_Link] = []
    adapters = None if registry is None else _Adapters(registry)
    if adapters is not None:  # read before any front end can ask for a change: their threads start below
      spec = dataclasses.replace(spec, adapter_names=tuple(adapters.registry.names()))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH", "")) if p)}
    for index in range(processes):
      ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
      process = subprocess.Popen([sys.executable, "-m", "MaxText.inference.serve_frontend", str(sock.fileno()),
                                  str(theirs.fileno()), str(index)], pass_fds=(sock.fileno(), theirs.fileno()),
                                 env=env, start_new_session=True)
      theirs.close()
      ours.sendall(frame(dataclasses.replace(spec, index=index, front_ends=processes)))
      self.processes.append(process)
      self.links.append(_Link(index, ours, scheduler, grammars, self.lost, adapters))
      scheduler.after_loop.append(self.links[-1].flush)
    if adapters is not None:
      adapters.links = list(self.links)
    for link in self.links:
      link.peers = [other for other in self.links if other is not link]
      link.start()
    self.scheduler = scheduler

  def wait(self, stop: threading.Event) -> int:
    """Until `stop` is set (0) or a front end exits on its own (1, after one line naming it)."""
    while not stop.is_set():
      if self.lost.wait(0.2) or any(p.poll() is not None for p in self.processes):
        if stop.is_set() or self.stopping:
          break
        for index, process in enumerate(self.processes):
          try:
            code = process.wait(2.0)
          except subprocess.TimeoutExpired:
            continue
          print(f"serve: error: HTTP front-end process {index} (pid {process.pid}) exited with code {code}; "
                "stopping the server", file=sys.stderr, flush=True)
          return 1
        print("serve: error: an HTTP front-end process closed its channel; stopping the server", file=sys.stderr,
              flush=True)
        return 1
    return 0

  def stop(self) -> None:
    """Front ends first (a graceful stop, then killed), then their channels."""
    self.stopping = True
    for process in self.processes:
      if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _STOP_SECONDS
    for process in self.processes:
      try:
        process.wait(max(deadline - time.monotonic(), 0.1))
      except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    for link in self.links:
      self.scheduler.after_loop.remove(link.flush)
      link.close()


def serve(scheduler: sched.Scheduler, grammars: Callable[[], grammar.Compiler] | None, sock: socket.socket,
          spec: FrontSpec, processes: int, registry: Registry | None = None) -> int:
  """Runs the front ends until SIGINT / SIGTERM (0) or one of them exits on its own (1)."""
  stop = threading.Event()
  previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
  front_ends = FrontEnds(scheduler, grammars, sock, spec, processes, registry)
  try:
    return front_ends.wait(stop)
  finally:
    front_ends.stop()
    for s, handler in previous.items():
      signal.signal(s, handler)
