"""Who a gs:// request is made as: Google's default credentials when they are found, else nobody.

Without credentials, a path that is only read (a dataset, a tokenizer, a checkpoint or adapter being
loaded) is read anonymously, as gsutil and TFDS do: a public bucket answers. gcsfs (etils.epath, datasets)
and the google-cloud-storage client are then made anonymous outright, so that neither walks its own
credentials chain (google-auth, then the metadata server, then retries) per request. Before the first
read of a bucket one anonymous request, not retried, tells apart a bucket that refuses anonymous reads
(401/403: one line, no credentials found, what to do) and a storage that cannot be reached (one line
saying both) from one that answers. A path that is written (a run directory, a checkpoint being saved,
an export) is refused before any request: nothing can be written anonymously. A
GOOGLE_APPLICATION_CREDENTIALS that cannot be used is refused for reads too: its user meant to sign in.
"""

from __future__ import annotations

import functools
import os
import re
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from MaxText.errors import UserError

WHAT_TO_DO = ("run `gcloud auth application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS to a "
              "service-account key file (STORAGE_EMULATOR_HOST for a storage emulator)")
DEFAULT_ENDPOINT = "https://storage.googleapis.com"

_answered: set[str] = set()  # buckets that answered an anonymous request in this process
_lock = threading.Lock()
_made_anonymous: dict[str, Any] = {}  # what _go_anonymous replaced, for forget()


def credentials_problem() -> str | None:
  """Why gs:// requests cannot be authenticated, or None: Google's default credentials are found (or
  STORAGE_EMULATOR_HOST names an emulator, which takes requests without them)."""
  if os.environ.get("STORAGE_EMULATOR_HOST", "") not in ("", "default"):  # as gcsfs: empty names no emulator
    return None
  return _default_credentials_problem()


@functools.cache
def _default_credentials_problem() -> str | None:
  """credentials_problem without an emulator, asked once per process (google-auth may ask a metadata server)."""
  import google.auth  # noqa: PLC0415 - only for gs:// paths
  from google.auth import exceptions  # noqa: PLC0415

  given = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
  try:
    google.auth.default()
  except (exceptions.DefaultCredentialsError, OSError) as e:  # OSError: a key file that is a directory, unreadable
    return (f"GOOGLE_APPLICATION_CREDENTIALS={given}: {_why_unusable(e)}"[:600] if given else
            "no GOOGLE_APPLICATION_CREDENTIALS, no gcloud application-default login, no GCE metadata server")
  except (AttributeError, TypeError) as e:  # google-auth reads a key file's JSON as an object without checking
    if not given:
      raise
    return f"GOOGLE_APPLICATION_CREDENTIALS={given}: not a key file (its JSON is not an object: {type(e).__name__})"
  return None


def _why_unusable(error: BaseException) -> str:
  """google-auth's reason on one line: its message, then the error it wraps in parentheses (it raises
  DefaultCredentialsError(message, cause), whose text is the tuple's repr)."""
  if isinstance(error, OSError) and error.strerror:
    return f"cannot read it ({error.strerror})"
  parts = [str(a).strip().splitlines()[0] for a in error.args if isinstance(a, (str, BaseException)) and str(a).strip()]
  if not parts:
    return type(error).__name__
  return parts[0] + "".join(f" ({part})" for part in parts[1:])


def anonymous() -> bool:
  """Whether this process's gs:// reads go without credentials: none are found and none are configured."""
  return credentials_problem() is not None and not os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")


def _named(path: str, key: str) -> str:
  return f"{key}={path}" if key else path


# Google's bucket names: lowercase letters, digits, '-', '_' and '.' (3 to 63 of them, 222 with dots; the length is
# left to Google). Another name (`gs://My Bucket/x`) is refused before it is asked for, where it read as a missing bucket.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{0,221}")


def _require_bucket(path: str, key: str) -> None:
  """A gs:// path with no bucket (`gs://`, `gs:///x`), or with a name no bucket can have, is one line before any
  request or credentials look-up."""
  if "\n" in str(path) or "\r" in str(path):  # no object name holds one (Google refuses them): a pasted line's end
    raise UserError(f"{key + '=' if key else ''}{str(path)!r}: a line break in a URL; remove it")
  bucket = str(path)[len("gs://"):].partition("/")[0]
  if not bucket:
    raise UserError(f"{_named(path, key)}: names no bucket; write gs://BUCKET/OBJECT")
  if not _BUCKET.fullmatch(bucket):
    raise UserError(f"{_named(path, key)}: {bucket!r} is not a bucket name (lowercase letters, digits, '-', '_' "
                    "and '.'); fix the path")


def require_credentials(path: str, key: str = "") -> None:
  """For a path about to be written: one UserError naming `path` (and the config `key` that gave it) when
  it is on gs:// and no credentials are found."""
  if not str(path).startswith("gs://"):
    return
  _require_bucket(path, key)
  problem = credentials_problem()
  if problem is not None:
    raise UserError(f"{_named(path, key)}: no Google Cloud credentials ({problem}); {WHAT_TO_DO}")


def prepare_read(path: str, key: str = "", timeout_seconds: float = 10.0) -> None:
  """Before `path` is read: nothing with credentials (or off gs://); without them, anonymous access, and
  on the first read of its bucket the one anonymous request (within `timeout_seconds`) that stops a
  refused or unreachable read with one line."""
  if not str(path).startswith("gs://"):
    return
  _require_bucket(path, key)
  problem = credentials_problem()
  if problem is None:
    return
  if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
    require_credentials(path, key)
  _go_anonymous()
  bucket, _, name = str(path)[len("gs://"):].partition("/")
  if bucket in _answered:
    return
  _ask(path, key, problem, bucket, name.rstrip("/"), timeout_seconds)
  _answered.add(bucket)


def raise_if_refused(path: str, error: BaseException) -> None:
  """A read refused anonymously (an object a bucket that answered keeps private) as the one line."""
  if str(path).startswith("gs://") and anonymous():
    code = refusal_code(error)
    if code is not None:
      raise UserError(_refused(path, "", credentials_problem() or "", code)) from None


def credentials_refused(error: BaseException) -> str | None:
  """google-auth's reason when `error` (or one it came from) is Google's token endpoint refusing the credentials
  for good (a revoked or deleted key, an expired login: an OAuth error such as invalid_grant, which google-auth
  marks not retryable), else None. gcsfs retries every RefreshError, so such a key made each read wait out
  storage_retry_seconds and then blame the network; a refresh that failed another way (a metadata server's
  hiccup) is not this and is retried."""
  from google.auth import exceptions  # noqa: PLC0415 - only for gs:// paths

  for current in error_chain(error):
    if isinstance(current, exceptions.RefreshError) and not current.retryable and len(current.args) > 1 and \
        isinstance(current.args[1], dict) and "error" in current.args[1]:
      return _why_unusable(current)
  return None


def raise_if_credentials_refused(path: str, error: BaseException, key: str = "") -> None:
  """A request whose credentials Google refused (credentials_refused) as one line naming them."""
  why = credentials_refused(error)
  if why is not None:
    given = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    whose = f"GOOGLE_APPLICATION_CREDENTIALS={given}" if given else "the application-default credentials"
    raise UserError(f"{_named(path, key)}: Google refused {whose} ({why}); {WHAT_TO_DO}") from None


def error_chain(error: BaseException) -> list[BaseException]:
  """`error` and every error it was raised from or during, each once (a cycle ends the walk)."""
  seen: list[BaseException] = []
  current: BaseException | None = error
  while current is not None and current not in seen:
    seen.append(current)
    current = current.__cause__ or current.__context__
  return seen


def refusal_code(error: BaseException) -> int | None:
  """401 or 403 when `error` (or one it came from) is an authorization refusal, as gcsfs, the Google
  client or TensorStore report one."""
  for current in error_chain(error):
    code = getattr(current, "code", None)
    if code in (401, 403):
      return int(code)
    text = str(current)
    if text.startswith("Forbidden:"):  # gcsfs's 403
      return 403
    if "PERMISSION_DENIED" in text or "UNAUTHENTICATED" in text:  # TensorStore's status, through Orbax
      given = re.search(r"http_response_code='(40[13])'", text)
      return int(given.group(1)) if given else 403 if "PERMISSION_DENIED" in text else 401
  return None


def forget() -> None:
  """Forgets what this process looked up and made anonymous (a test that changes the environment)."""
  _default_credentials_problem.cache_clear()
  _answered.clear()
  if _made_anonymous:
    import fsspec  # noqa: PLC0415

    conf = fsspec.config.conf.setdefault("gcs", {})
    if _made_anonymous.pop("token", None) is None:
      conf.pop("token", None)
    for protocol, cls in _made_anonymous.pop("classes").items():
      fsspec.register_implementation(protocol, cls, clobber=True)
    _made_anonymous.clear()
    _drop_cached_filesystems()


def _drop_cached_filesystems() -> None:
  """etils.epath keeps the first gcsfs instance it made: the next one must take fsspec's config as it is now."""
  try:
    from etils.epath import backend  # noqa: PLC0415

    backend._FileSystemSpecBackend._get_filesystem.cache_clear()
  except (ImportError, AttributeError):  # another etils layout: its cache, if any, is left
    pass


def _go_anonymous() -> None:
  """gcsfs without credentials from here on (fsspec's config reaches etils.epath's and datasets' instances
  alike). gcsfs's default class first asks a storage-control gRPC API for each bucket's layout, which takes
  no anonymous request and answers only after its own retries: the plain class reads instead."""
  with _lock:
    if _made_anonymous:
      return
    import fsspec  # noqa: PLC0415 - only for gs:// paths
    from gcsfs import core  # noqa: PLC0415

    conf = fsspec.config.conf.setdefault("gcs", {})
    _made_anonymous["token"] = conf.get("token")
    conf.setdefault("token", "anon")  # a token the user set in fsspec's config is theirs
    _made_anonymous["classes"] = {p: fsspec.get_filesystem_class(p) for p in ("gs", "gcs")}
    for protocol in ("gs", "gcs"):
      fsspec.register_implementation(protocol, core.GCSFileSystem, clobber=True)
    _drop_cached_filesystems()


def _endpoint() -> str:
  """Where gcsfs sends its requests (fsspec's endpoint_url, STORAGE_EMULATOR_HOST, or Google's)."""
  import fsspec  # noqa: PLC0415

  return str(getattr(fsspec.filesystem("gcs", finalize_on_close=True), "_location", DEFAULT_ENDPOINT))


def _ask(path: str, key: str, problem: str, bucket: str, name: str, timeout: float) -> None:
  """One anonymous request for the object (or for a listing of the bucket): any answer but a refusal or
  a missing bucket lets the read go on (a missing object is the reader's to name); those, or no answer,
  are the one line."""
  endpoint = _endpoint().rstrip("/")
  url = (f"{endpoint}/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o/{urllib.parse.quote(name, safe='')}"
         "?fields=name" if name else f"{endpoint}/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o?maxResults=1")
  opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # as gcsfs: no proxy from the environment
  statuses: list[int] = []
  errors: list[BaseException] = []
  missing_bucket: list[bool] = []

  def request() -> None:
    try:
      with opener.open(url, timeout=timeout) as answer:
        statuses.append(int(answer.status))
    except urllib.error.HTTPError as e:
      statuses.append(int(e.code))
      missing_bucket.append(e.code == 404 and b"bucket does not exist" in e.read(4096))
    except (OSError, ValueError) as e:  # URLError (DNS, refused, reset), a timeout, a malformed endpoint
      errors.append(e)

  worker = threading.Thread(target=request, daemon=True, name=f"storage-anonymous {bucket}"[:60])
  worker.start()
  worker.join(timeout)  # getaddrinfo has no timeout of its own
  if statuses and statuses[0] in (401, 403):
    raise UserError(_refused(path, key, problem, statuses[0]))
  if any(missing_bucket):
    raise UserError(f"{_named(path, key)}: bucket gs://{bucket} does not exist; create it or fix the path")
  if statuses:
    return
  why = _why(errors[0] if errors else None, endpoint, timeout)
  raise UserError(f"{_named(path, key)}: no Google Cloud credentials ({problem}), and the storage is unreachable "
                  f"({endpoint}: {why}); check the network (or STORAGE_EMULATOR_HOST); a bucket that is not public "
                  "also needs credentials: `gcloud auth application-default login` or GOOGLE_APPLICATION_CREDENTIALS")


def _refused(path: str, key: str, problem: str, code: int) -> str:
  return (f"{_named(path, key)}: no Google Cloud credentials ({problem}), and gs://{str(path)[5:].split('/')[0]} "
          f"refuses anonymous reads (HTTP {code}); {WHAT_TO_DO}")


def _why(error: BaseException | None, endpoint: str, timeout: float) -> str:
  if error is None or isinstance(error, (TimeoutError, socket.timeout)) or \
      isinstance(getattr(error, "reason", None), (TimeoutError, socket.timeout)):
    return f"no answer within {timeout:g} s"
  reason = getattr(error, "reason", error)
  if isinstance(reason, socket.gaierror):
    return f"cannot resolve {urllib.parse.urlsplit(endpoint).hostname}"
  if isinstance(reason, ConnectionRefusedError):
    return "connection refused"
  text = str(reason).strip().splitlines()
  return f"{type(reason).__name__}: {text[0] if text else ''}"[:160]
