"""How long a run keeps trying a `gs://` storage that fails, and how it stops when it gives up.

`storage_retry_seconds` (B) bounds every remote storage operation of a run: a small object
written or read (`config.yml`, `metrics.jsonl`, `goodput.json`, TensorBoard events), a listing,
a checkpoint save or restore. `call` runs one in a worker thread and watches it:

- a transient failure (connection refused or reset, timeout, HTTP 5xx/429, as the client
  libraries' own predicates classify them) is retried with backoff, for idempotent operations;
- an operation still running after a few seconds makes the watcher ask the bucket whether it
  answers (one cheap metadata request); a slow upload to a live bucket is left alone, however
  long it takes;
- once the operation has been failing, or the bucket silent, for B seconds, the run gives up:
  `StorageUnavailable`, one line naming the bucket, what failed, why and which checkpoint a
  rerun resumes from. Every later storage call of the process fails at once (`raise_if_down`),
  so the loop's end hooks and the lease release do not each wait another B. Inside `one_request()`
  (a server reading a path one request names) giving up fails that request only.

Errors that retrying cannot fix (403, 404, a damaged object) are raised at once, unchanged.
Libraries with their own retries get settings derived from B, so that they too keep trying that
long: TensorStore (Orbax's arrays), whose GCS retries Orbax exposes no option for, through the
context Orbax builds; gcsfs (Orbax's small files, and every other `gs://` path) through its own
retry decorator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
import time
from typing import Any, Callable, Iterator, TypeVar

from MaxText.errors import TrainingError
from MaxText.paths import gcs_auth

_T = TypeVar("_T")
DEFAULT_SECONDS = 300.0


class StorageUnavailable(TrainingError):
  """The storage did not work for storage_retry_seconds: the run stops (exit code 3)."""

  # The storage libraries' own threads (Orbax's save finalizer, TensorStore, gcsfs) may still be
  # blocked on the dead endpoint; run_cli ends the process at once after the error line.
  exit_at_once = True


@dataclasses.dataclass
class _State:
  budget: float = DEFAULT_SECONDS
  down: str | None = None  # the message, once the run gave up on the storage
  saved: str = ""  # what a rerun resumes from, for the message


_state = _State()
_inside = threading.local()  # a call running inside another call is bounded by the outer one


@contextlib.contextmanager
def one_request() -> Iterator[None]:
  """Storage calls on this thread that give up fail alone, leaving the process's storage usable: a
  long-lived server reading what one request names (a LoRA adapter's path) must not stop every later
  read over one dead bucket, as a run that gave up does."""
  previous = getattr(_inside, "one_request", False)
  _inside.one_request = True
  try:
    yield
  finally:
    _inside.one_request = previous


def configure(budget_seconds: float) -> None:
  """Sets B for this process and the libraries' own retries (before any checkpoint is opened)."""
  _state.budget = float(budget_seconds)
  _configure_tensorstore(_state.budget)
  _configure_gcsfs(_state.budget)


def is_down() -> bool:
  return _state.down is not None


def raise_if_down() -> None:
  if _state.down is not None:
    raise StorageUnavailable(_state.down)


def note_saved(directory: str, step: int | None, pending: int | None = None) -> None:
  """The newest checkpoint known to be complete, and the one being saved, for the message if the
  storage goes (the pending one may be complete too: its commit marker may have landed)."""
  saved = f"checkpoint steps up to {step} are saved in {directory}" if step is not None else \
      f"no checkpoint is known complete in {directory}"
  _state.saved = saved + (f" (step {pending} was being saved)" if pending is not None and pending != step else "")


def tensorstore_retries(budget_seconds: float) -> dict[str, Any]:
  """TensorStore's `gcs_request_retries` whose backoff adds up to at least B: a request keeps
  trying for as long as the run would, and no longer by much."""
  initial = min(1.0, budget_seconds / 10)
  maximum = min(32.0, max(initial, budget_seconds / 8))
  retries, total, delay = 0, 0.0, initial
  while total < budget_seconds and delay < maximum:
    total, delay, retries = total + delay, min(delay * 2, maximum), retries + 1
  if total < budget_seconds:  # the rest at the capped delay, counted at once (a long budget made this loop hang)
    retries += math.ceil((budget_seconds - total) / maximum)
  return {"max_retries": retries, "initial_delay": f"{initial:g}s", "max_delay": f"{maximum:g}s"}


def _configure_tensorstore(budget_seconds: float) -> None:
  """Orbax builds every TensorStore context from these module defaults (copied per use)."""
  try:
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils  # noqa: PLC0415
    contexts = [ts_utils._BASE_TS_CONTEXT, ts_utils._DEFAULT_OCDBT_TS_CONTEXT]
  except (ImportError, AttributeError):  # another Orbax layout: TensorStore's defaults, `call` still bounds
    return
  for context in contexts:
    context["gcs_request_retries"] = tensorstore_retries(budget_seconds)


def gcsfs_retries(budget_seconds: float) -> int:
  """Attempts of gcsfs's own backoff (1, 2, 4, ... capped at 32 s between them) that add up to at
  least B, and never fewer than its default 6."""
  attempts, total = 1, 0.0
  while total < budget_seconds and attempts <= 6:  # 1 + 2 + ... + 32: past that every wait is 32 s
    total, attempts = total + 2.0 ** (attempts - 1), attempts + 1
  if total < budget_seconds:
    attempts += math.ceil((budget_seconds - total) / 32.0)
  return max(6, attempts)


def _configure_gcsfs(budget_seconds: float) -> None:
  """gcsfs (etils.epath's gs://, so Orbax's metadata and commit files too) retries each request
  through its `retry_request` decorator, whose count the class fixed when it was defined (its
  `retries` attribute is read then, not per instance): the same decorator is applied again, to
  the undecorated methods, with a count from B."""
  try:
    from gcsfs import core, retry  # noqa: PLC0415
  except ImportError:
    return
  if not getattr(retry.is_retriable, "skips_refused_credentials", False):
    library_predicate = retry.is_retriable  # retry_request reads this module global at each failure

    def is_retriable(error: BaseException) -> bool:
      return gcs_auth.credentials_refused(error) is None and bool(library_predicate(error))

    is_retriable.skips_refused_credentials = True  # type: ignore[attr-defined]
    retry.is_retriable = is_retriable
  for name in ("_request", "_get_file_request", "_get_file_concurrent"):
    method = getattr(core.GCSFileSystem, name, None)
    undecorated = getattr(method, "__wrapped__", None)
    if undecorated is not None:  # another gcsfs layout: its defaults, and `call` still bounds
      setattr(core.GCSFileSystem, name, retry.retry_request(retries=gcsfs_retries(budget_seconds))(undecorated))


# ------------------------------------------------------------------ what a failure is


_TRANSIENT_TEXT = ("retry attempts failed", "CURL error", "UNAVAILABLE:", "DEADLINE_EXCEEDED:", "Connection refused",
                   "Connection reset")


def is_transient(error: BaseException) -> bool:
  """Whether retrying may help: the libraries' own predicates, plus TensorStore's status text; never credentials
  that Google refused (gcs_auth.credentials_refused), which gcsfs's predicate takes for transient."""
  if gcs_auth.credentials_refused(error) is not None:
    return False
  predicates = _library_predicates()
  return any(isinstance(e, (ConnectionError, TimeoutError)) or any(p(e) for p in predicates)
             or any(text in str(e) for text in _TRANSIENT_TEXT)  # TensorStore's status, through Orbax's wrappers
             for e in gcs_auth.error_chain(error))


@functools.cache
def _library_predicates() -> tuple[Callable[[BaseException], bool], ...]:
  """gcsfs's (etils.epath's gs://) and google-api-core's (the lease's client) own retry predicates."""
  found: list[Callable[[BaseException], bool]] = []
  try:
    from gcsfs.retry import is_retriable  # noqa: PLC0415
    found.append(is_retriable)
  except ImportError:
    pass
  try:
    from google.api_core import exceptions, retry  # noqa: PLC0415
    found.append(lambda e: isinstance(e, exceptions.RetryError) or
                 (isinstance(e, Exception) and bool(retry.if_transient_error(e))))
  except ImportError:
    pass
  return tuple(found)


def reason(error: BaseException | None) -> str:
  """A few words for the message: 'connection refused', 'HTTP 503', ..., or the error's first line."""
  if error is None:
    return "no answer"
  chain = gcs_auth.error_chain(error)
  text = " ".join(f"{type(e).__name__}: {e}" for e in chain)
  if any(isinstance(e, ConnectionRefusedError) for e in chain) or \
      any(t in text for t in ("Connection refused", "Connect call failed", "Could not connect")):
    return "connection refused"
  if any(isinstance(e, ConnectionResetError) for e in chain) or "reset by peer" in text or "Connection reset" in text:
    return "connection reset"
  if any(isinstance(e, TimeoutError) for e in chain) or "imed out" in text:
    return "no answer"
  codes = [e.code for e in chain if isinstance(getattr(e, "code", None), int) and e.code >= 400]  # type: ignore[attr-defined]
  if codes:
    return f"HTTP {codes[0]}"
  first = str(error).strip().splitlines()
  return f"{type(error).__name__}: {first[0] if first else ''}"[:160]


# ------------------------------------------------------------------ the watched call


def bucket_of(path: str) -> str:
  """`gs://bucket/a/b` -> `gs://bucket`."""
  scheme, rest = str(path).split("://", 1)
  return f"{scheme}://{rest.split('/', 1)[0]}"


def within(seconds: float, fn: Callable[[], _T], name: str) -> tuple[bool, _T | None, BaseException | None]:
  """(finished, value, error) of `fn` run in a daemon thread for at most `seconds`: a client that
  keeps retrying inside must not hold the caller up; an unfinished thread is left behind."""
  outcome: dict[str, Any] = {}

  def target() -> None:
    try:
      outcome["value"] = fn()
    except BaseException as e:  # noqa: BLE001 - handed to the caller
      outcome["error"] = e

  thread = threading.Thread(target=target, daemon=True, name=name[:60])
  thread.start()
  thread.join(seconds)
  return not thread.is_alive(), outcome.get("value"), outcome.get("error")


def gcs_client() -> Any:
  """The one google-cloud-storage client (it honours STORAGE_EMULATOR_HOST); an anonymous one without
  credentials (gcs_auth), which a bucket probe needs as much as the reads it watches."""
  return _gcs_client(gcs_auth.anonymous())


@functools.cache
def _gcs_client(anonymous: bool) -> Any:
  from google.cloud import storage as gcs  # noqa: PLC0415

  return gcs.Client.create_anonymous_client() if anonymous else gcs.Client()


def probe_seconds() -> float:
  """How long one request that asks whether a bucket answers may take."""
  return min(10.0, max(1.0, _state.budget / 5))


def _probe(bucket: str, timeout: float) -> BaseException | None:
  """None when the bucket answers (any HTTP answer but a 5xx: a 403 is an answer), else the error.
  Only gs:// is asked; other schemes are judged by their operations' errors alone."""
  if not bucket.startswith("gs://"):
    return None
  from google.api_core import exceptions  # noqa: PLC0415

  def ask() -> BaseException | None:
    try:
      gcs_client().bucket(bucket.split("://", 1)[1]).exists(timeout=timeout, retry=None)
    except exceptions.GoogleAPICallError as e:
      return e if isinstance(e, exceptions.ServerError) else None
    return None  # any other error (transport, credentials) is raised: the bucket cannot be reached

  finished, answer, error = within(timeout, ask, f"storage-probe {bucket}")
  if not finished:
    return TimeoutError(f"no answer within {timeout:g} s")
  return error if error is not None else answer


class _Attempts:
  """What the worker thread reports to the watcher."""

  def __init__(self) -> None:
    self.done = threading.Event()
    self.stop = threading.Event()
    self.value: Any = None
    self.error: BaseException | None = None
    self.failing_since: float | None = None  # the first transient failure
    self.last_error: BaseException | None = None


def call(what: str, path: str, fn: Callable[[], _T], *, retry: bool = True) -> _T:
  """Runs `fn`, a storage operation on remote `path`, within the retry budget (see the module
  docstring). `retry`: whether `fn` may simply run again after a transient failure (False for
  Orbax saves and restores, which TensorStore retries inside)."""
  if "://" not in str(path) or getattr(_inside, "active", False):
    return fn()  # local disk (not this module's concern), or bounded by the call it runs in
  raise_if_down()
  budget_s = _state.budget
  attempts = _Attempts()

  def work() -> None:
    _inside.active = True
    delay = min(1.0, budget_s / 10)
    while True:
      try:
        attempts.value = fn()
        attempts.done.set()
        return
      except BaseException as e:  # noqa: BLE001 - handed to the watcher
        if not (retry and is_transient(e)) or attempts.stop.is_set():
          attempts.error = e
          attempts.done.set()
          return
        attempts.last_error = e
        attempts.failing_since = attempts.failing_since or time.monotonic()
      if attempts.stop.wait(delay):
        return
      delay = min(delay * 2, max(1.0, budget_s / 8))

  started = time.monotonic()
  worker = threading.Thread(target=work, daemon=True, name=f"storage {what}"[:60])
  worker.start()
  tick = min(5.0, max(0.2, budget_s / 20))
  probe_timeout = probe_seconds()
  silent_since: float | None = None  # the first failed probe of a series
  probe_error: BaseException | None = None
  while not attempts.done.wait(tick):
    if _state.down is not None:  # another operation gave up meanwhile
      attempts.stop.set()
      raise StorageUnavailable(_state.down)
    asked = time.monotonic()
    probe_error = _probe(bucket_of(path), probe_timeout)
    if probe_error is not None and gcs_auth.credentials_refused(probe_error) is not None:
      attempts.stop.set()  # no later attempt can succeed: the line names the credentials, not the network
      gcs_auth.raise_if_credentials_refused(path, probe_error)
    silent_since = (silent_since or asked) if probe_error is not None else None
    failing = [t for t in (attempts.failing_since, silent_since) if t is not None]
    if failing and time.monotonic() - min(failing) >= budget_s and not attempts.done.is_set():
      attempts.stop.set()
      _give_up(what, path, time.monotonic() - min(failing), attempts.last_error or probe_error)
  if attempts.error is not None:
    if is_transient(attempts.error):  # retried to the end already (here or inside the library)
      _give_up(what, path, time.monotonic() - (attempts.failing_since or started), attempts.error)
    raise attempts.error
  return attempts.value


def _give_up(what: str, path: str, seconds: float, error: BaseException | None) -> None:
  if getattr(_inside, "one_request", False):
    raise StorageUnavailable(f"{bucket_of(path)}: {what} failed for {seconds:.0f} s ({reason(error)}); the storage "
                             f"is unreachable (storage_retry_seconds={_state.budget:g}): try again once it is back")
  saved = f"; {_state.saved}" if _state.saved else ""
  _state.down = (f"{bucket_of(path)}: {what} failed for {seconds:.0f} s ({reason(error)}); the storage is unreachable "
                 f"(storage_retry_seconds={_state.budget:g}): rerun the same command once it is back{saved}")
  raise StorageUnavailable(_state.down)
