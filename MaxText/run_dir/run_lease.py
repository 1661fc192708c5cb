"""One writer per run directory: a lease file (`<run_dir>/lease.json`) taken before any write.

The lease names its holder (host, process id, start time) and carries a heartbeat that
process 0 refreshes in a background thread every `run_lease_timeout_seconds / 6`. Every
change is a conditional write (storage.write_if: GCS's generation precondition on gs://, an
flock'ed compare-and-write locally), so of two runs that start together exactly one gets
the lease; the other stops with one line naming the holder.

A lease whose heartbeat is older than the timeout belongs to a run that died without
releasing it (SIGKILL, a lost host); the next run takes it over with a warning. So does a
run on the same machine (same host name and pid namespace) whose holder process is gone:
`kill -9` and rerun works at once there, while a rescheduled pod waits out the timeout. A run that
ends (done, error, SIGTERM, Ctrl-C) releases it. A multi-process run is one writer:
process 0 holds the lease for all of them. Ages are read from the holder's clock, so hosts'
clocks must agree to well within the timeout (NTP does). A lease that cannot be judged (not
readable as a lease, or a heartbeat more than the timeout in the future: a wrong clock) is never
taken over: the run stops, saying to delete it once no other run writes there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time

from MaxText.paths import storage, storage_retry
from MaxText.errors import TrainingError, UserError

LEASE_FILE = "lease.json"


@dataclasses.dataclass(frozen=True)
class Holder:
  host: str
  pid: int
  run_name: str
  started: float  # epoch seconds
  heartbeat: float  # epoch seconds of the last refresh
  processes: int
  pid_namespace: str = ""  # with host: where `pid` means this process (containers share host names)

  def describe(self, now: float | None = None) -> str:
    age = (now or time.time()) - self.heartbeat
    return (f"host {self.host} pid {self.pid} (started {time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime(self.started))}"
            f", {self.processes} process(es), last heartbeat {age:.0f} s ago)")

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=1)

  @classmethod
  def from_json(cls, text: str) -> "Holder | None":
    try:
      fields = json.loads(text)
      return cls(str(fields["host"]), int(fields["pid"]), str(fields.get("run_name", "")), float(fields["started"]),
                 float(fields["heartbeat"]), int(fields.get("processes", 1)), str(fields.get("pid_namespace", "")))
    except (ValueError, KeyError, TypeError):
      return None  # not a lease this code wrote (its writes are atomic): damaged or edited by hand


class Lease:
  """The lease this process holds; `lost` is set when another run took it over."""

  def __init__(self, path: str, holder: Holder, version: storage.Version, timeout_seconds: float):
    self.path, self.holder, self._version, self.timeout = path, holder, version, timeout_seconds
    self.lost: str | None = None
    self._stop = threading.Event()
    self._lock = threading.Lock()
    self._thread = threading.Thread(target=self._heartbeat_loop, name="run-lease-heartbeat", daemon=True)
    self._thread.start()

  def _heartbeat_loop(self) -> None:
    interval = max(self.timeout / 6, 0.5)
    warned = False
    while not self._stop.wait(interval):
      try:
        self.refresh()
        warned = False
      except storage_retry.StorageUnavailable:
        return  # the run stops with its own line
      except Exception as e:  # noqa: BLE001 - a storage hiccup: try again next interval
        if not warned:
          print(f"warning: cannot refresh the run lease {self.path}: {storage_retry.reason(e)}; retrying", flush=True)
          warned = True

  def refresh(self) -> None:
    with self._lock:
      if self.lost is not None or self._stop.is_set():
        return
      holder = dataclasses.replace(self.holder, heartbeat=time.time())
      version = storage.write_if(self.path, holder.to_json(), self._version)
      if version is None:
        current = storage.read_versioned(self.path)
        other = Holder.from_json(current[0]) if current else None
        self.lost = (f"the run directory's lease {self.path} was taken over by "
                     f"{other.describe() if other else 'another run'} (this run's heartbeat was late by more than "
                     f"run_lease_timeout_seconds={self.timeout:g})")
        return
      self.holder, self._version = holder, version

  def check(self) -> None:
    """Raises TrainingError when another run took the lease over (before this run writes again)."""
    if self.lost is not None:
      raise TrainingError(f"{self.lost}; this run stops without writing: two runs must not share a run directory")

  def release(self) -> None:
    self._stop.set()
    if storage_retry.is_down():
      return  # a refresh may hang on the unreachable storage; the lease expires (or its pid is seen gone)
    self._thread.join()
    with self._lock:
      if self.lost is None:
        try:
          storage.remove_if(self.path, self._version)
        except Exception as e:  # noqa: BLE001 - the next run takes a stale lease over anyway
          print(f"warning: cannot release the run lease {self.path}: {type(e).__name__}", flush=True)


def _pid_namespace() -> str:
  try:
    return os.readlink("/proc/self/ns/pid")  # e.g. 'pid:[4026531836]'; unique per container
  except OSError:
    return ""


def _gone(holder: Holder, me: Holder) -> bool:
  """True when the holder ran on this machine, in this pid namespace, and its process no longer
  exists (killed with SIGKILL, crashed): no need to wait for its lease to time out. A reused pid
  only makes this answer False, which waits for the timeout: the safe side."""
  if not me.pid_namespace or (holder.host, holder.pid_namespace) != (me.host, me.pid_namespace):
    return False
  try:
    os.kill(holder.pid, 0)
  except ProcessLookupError:
    return True
  except PermissionError:  # alive, another user's
    return False
  return False


def _clear_by_hand(path: str, run_dir: str) -> str:
  return (f"make sure no run is writing run directory {run_dir} (no training process with this run_name on any "
          f"host), then delete {path} and rerun")


def acquire(run_dir: str, run_name: str, timeout_seconds: float, processes: int) -> Lease:
  """Takes the run directory's lease (process 0 only), or raises UserError naming its live holder."""
  path = storage.join(run_dir, LEASE_FILE)
  storage.makedirs(run_dir)
  me = Holder(socket.gethostname(), os.getpid(), run_name, time.time(), time.time(), processes, _pid_namespace())
  for _ in range(5):  # each retry follows another run's move; five in a row means something is wrong
    current: tuple[str, storage.Version | None] | None
    try:
      version = storage.write_if(path, me.to_json(), None)
      current = None if version is not None else storage.read_versioned(path)
    except UnicodeDecodeError:  # a local lease.json that is not even text
      version, current = None, ("", None)
    if version is not None:
      return Lease(path, me, version, timeout_seconds)
    if current is None:
      continue  # released between our two calls
    text, current_version = current
    holder = Holder.from_json(text)
    # A lease whose holder or age cannot be read is never taken over: a live run may be behind it.
    if holder is None:
      raise UserError(f"the run lease {path} is unreadable (not a lease this program wrote: damaged, cut short by "
                      f"a copy, or edited by hand), so whether another run holds it cannot be told; "
                      f"{_clear_by_hand(path, run_dir)}")
    now = time.time()
    gone = _gone(holder, me)
    # Clocks are assumed to agree to well within the timeout (NTP); beyond that the age means nothing.
    if holder.heartbeat - now > timeout_seconds and not gone:
      raise UserError(f"the run lease {path} has a heartbeat {holder.heartbeat - now:,.0f} s in the future (from "
                      f"host {holder.host} pid {holder.pid}): that host's clock or this one's is wrong, so the "
                      f"lease's age cannot be told; {_clear_by_hand(path, run_dir)}, and set both clocks right (NTP)")
    if now - holder.heartbeat <= timeout_seconds and not gone:
      raise UserError(
          f"run directory {run_dir} is in use by another run: {holder.describe(now)}. Two runs must not "
          f"write one run directory: stop that run, or choose another run_name. If it was killed, its lease "
          f"expires {timeout_seconds - (now - holder.heartbeat):.0f} s from now (run_lease_timeout_seconds="
          f"{timeout_seconds:g}); rerun then")
    me = dataclasses.replace(me, heartbeat=time.time())
    version = storage.write_if(path, me.to_json(), current_version)
    if version is not None:
      what = holder.describe(now)
      why = "its process no longer exists on this host" if gone else \
          f"its heartbeat is older than run_lease_timeout_seconds={timeout_seconds:g}, so that run is gone"
      print(f"warning: taking over the run lease of {run_dir} from {what}: {why}", flush=True)
      return Lease(path, me, version, timeout_seconds)
  raise UserError(f"cannot take the lease {path}: other runs keep changing it; make sure only one run uses "
                  f"run directory {run_dir}")
