"""The one path layer: every file the project reads or writes on a user's behalf goes through here.

A path is a plain string: a local path (relative, absolute or `~/...`) or a URL that
`etils.epath` understands (`gs://bucket/dir`, and the other schemes it registers). Orbax
and TensorStore take the same strings, so a run directory on `gs://` holds checkpoints,
`config.yml`, `metrics.jsonl`, TensorBoard events and profiles side by side.

Pointing a whole run at a GCS emulator or any GCS-compatible endpoint takes one standard
variable, `STORAGE_EMULATOR_HOST`; `cloud_env.configure_cloud_env` hands it on to the libraries that
have their own setting. Object stores have no rename and no append: `set_aside` copies then
deletes, and writers that append (metrics.jsonl) rewrite whole objects (see metrics.py).
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib.util
import os
import posixpath
import re
import shutil
import tempfile
import time
from typing import IO, Any, Callable, Iterator, TypeVar

from etils import epath

from MaxText.paths import gcs_auth, storage_retry
from MaxText.errors import TrainingError, UserError

_T = TypeVar("_T")


def is_remote(path: str) -> bool:
  """True for URLs (`gs://...`), False for local paths."""
  return "://" in str(path)


# etils.epath's schemes (gpath._URI_PREFIXES); any other `x://` is a KeyError traceback inside it.
SCHEMES = ("gs", "s3", "az", "hf")
# The fsspec packages etils reaches s3:// and az:// through: not installed with this project (gs:// is its storage),
# and without one the first read was a raw ImportError from deep inside a library.
_SCHEME_PACKAGES = {"s3": "s3fs", "az": "adlfs"}
_GS_TYPO = re.compile(r"\s*gs:(?!//)", re.IGNORECASE)  # gs:/b/x, gs:b/x: else a local directory named `gs:`
_GS_NO_COLON = re.compile(r"\s*gs//", re.IGNORECASE)  # gs//b/x: else local directories gs/b


def check_form(path: str, key: str = "") -> None:
  """A path that cannot mean what its user wrote is one UserError naming it (and the config `key` that gave
  it): an unknown or miscased scheme (`GS://`, ` gs://`, `gcs://`) or gs: without its two slashes, which
  would be read from (and written to) a local directory named `gs:`."""
  text = str(path)
  named = f"{key}={text}" if key else text
  if is_remote(text):
    scheme = text.split("://", 1)[0]
    if scheme not in SCHEMES:
      fix = ("write gs:// in lowercase, with nothing before it" if scheme.strip().lower() == "gs" else
             "a path is local or gs://BUCKET/OBJECT")
      raise UserError(f"{named}: unknown scheme {scheme!r}; {fix}")
    package = _SCHEME_PACKAGES.get(scheme)
    if package is not None and importlib.util.find_spec(package) is None:
      raise UserError(f"{named}: {scheme}:// needs the {package} package, which this install does not have: "
                      f"`pip install {package}`, or copy the files to gs:// or a local folder")
  elif _GS_TYPO.match(text):
    raise UserError(f"{named}: gs: needs two slashes; write gs://BUCKET/OBJECT")
  elif _GS_NO_COLON.match(text):
    raise UserError(f"{named}: gs// has no colon; write gs://BUCKET/OBJECT")


def resolve(path: str) -> str:
  """Local paths become absolute (with `~` expanded); URLs are kept, without a trailing slash."""
  path = str(path)
  check_form(path)
  if is_remote(path):
    return path.rstrip("/") if not path.endswith("://") else path
  return os.path.abspath(os.path.expanduser(path))


def join(base: str, *parts: str) -> str:
  if is_remote(base):
    return posixpath.join(base.rstrip("/"), *parts)
  return os.path.join(base, *parts)


def name(path: str) -> str:
  """The last component (`gs://b/run/ckpt` -> `ckpt`)."""
  return posixpath.basename(str(path).rstrip("/")) if is_remote(path) else os.path.basename(os.path.normpath(path))


def parent(path: str) -> str:
  if is_remote(path):
    return posixpath.dirname(str(path).rstrip("/"))
  return os.path.dirname(os.path.abspath(os.path.expanduser(path)))


def same_file(a: str, b: str) -> bool:
  """Whether two paths name one file: for local paths through symlinks and relative forms
  (os.path.samefile), for URLs by their resolved text."""
  if is_remote(a) or is_remote(b):
    return resolve(a) == resolve(b)
  try:
    return os.path.samefile(resolve(a), resolve(b))
  except OSError:  # one of them does not exist
    return resolve(a) == resolve(b)


# Who gs:// requests are made as (gcs_auth): reads go anonymous without credentials, writes are refused.
credentials_problem = gcs_auth.credentials_problem
require_credentials = gcs_auth.require_credentials


def as_path(path: str) -> epath.Path:
  """An `epath.Path` for libraries that take one (Orbax). Once the run gave up on an unreachable
  storage, a remote path fails at once (storage_retry). Without credentials a gs:// path is read
  anonymously (gcs_auth.prepare_read); the operations that write ask for credentials first."""
  if is_remote(path):
    storage_retry.raise_if_down()
    gcs_auth.prepare_read(path, timeout_seconds=storage_retry.probe_seconds())
  return epath.Path(resolve(path))


def _bounded(verb: str, path: str, fn: Callable[[], _T]) -> _T:
  """A remote operation runs within storage_retry_seconds (retried while it fails transiently); without
  credentials, a read an object's own permissions refuse is the one line (gcs_auth)."""
  if not is_remote(path):
    return fn()
  _raise_if_hub_unreachable(path, None)
  key = str(path).split("://", 1)[1].partition("/")[2]
  try:
    return storage_retry.call(f"{verb} {key or path}", path, fn)
  except Exception as e:
    _raise_if_hub_unreachable(path, e)
    gcs_auth.raise_if_credentials_refused(path, e)
    gcs_auth.raise_if_refused(path, e)  # only reads get here without credentials: writes asked for them first
    raise


# The transport errors huggingface_hub's HTTP clients raise (httpx's, requests'), by class name: neither is an
# OSError, and an hf:// path read offline was their traceback ("Name or service not known").
_NETWORK_ERRORS = ("ConnectError", "ConnectionError", "ConnectTimeout", "ReadTimeout", "TimeoutException",
                   "NetworkError", "ProxyError")


def _raise_if_hub_unreachable(path: str, error: BaseException | None) -> None:
  """An hf:// path whose Hub cannot be asked is one line: offline (HF_HUB_OFFLINE, where huggingface_hub answers
  "does not exist" for every path) or a network error."""
  if not str(path).startswith("hf://"):
    return
  if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
    raise UserError(f"{path}: hf:// paths are read from the Hugging Face Hub, and HF_HUB_OFFLINE is set; "
                    "download the files (`hf download REPO --local-dir DIR`) and give DIR") from None
  if error is None:
    return
  if any(type(c).__name__ in _NETWORK_ERRORS for c in gcs_auth.error_chain(error)):
    raise UserError(f"{path}: cannot reach the Hugging Face Hub ({type(error).__name__}: {error}); check the "
                    "network, or download the files (`hf download REPO --local-dir DIR`) and give DIR") from None



def exists(path: str) -> bool:
  return _bounded("checking", path, lambda: as_path(path).exists())


def is_dir(path: str) -> bool:
  return _bounded("checking", path, lambda: as_path(path).is_dir())


def is_file(path: str) -> bool:
  p = as_path(path)
  return p.is_file() if not is_remote(path) else _bounded("checking", path, lambda: p.exists() and not p.is_dir())


def makedirs(path: str) -> None:
  """Creates a directory and its parents (on an object store: nothing to create)."""
  require_credentials(path)
  if is_remote(path):
    _bounded("creating", path, lambda: as_path(path).mkdir(parents=True, exist_ok=True))
    return
  path = resolve(path)
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:  # a parent that is a file, no permission, a read-only disk: the path, not a traceback
    if isinstance(e, (FileExistsError, NotADirectoryError)):
      culprit = path if os.path.lexists(path) else _file_among_parents(path)
      raise UserError(f"cannot create folder {path}: {culprit} is a file, not a folder") from None
    raise UserError(f"cannot create folder {path}: {e.strerror or type(e).__name__}") from None


def listdir(path: str) -> list[str]:
  """Names of the entries directly in `path` (sorted)."""
  return sorted(name(str(p)) for p in _bounded("listing", path, lambda: list(as_path(path).iterdir())))


def read_text(path: str) -> str:
  return _bounded("reading", path, lambda: as_path(path).read_text())


def read_bytes(path: str) -> bytes:
  return _bounded("reading", path, lambda: as_path(path).read_bytes())


def write_text(path: str, text: str) -> None:
  """Writes a whole file; local writes go through a temporary file and a rename, so a reader
  never sees half a file (an object store's upload is atomic by itself)."""
  write_bytes(path, text.encode("utf-8"))


def write_bytes(path: str, data: bytes) -> None:
  if is_remote(path):
    require_credentials(path)
    _bounded("writing", path, lambda: as_path(path).write_bytes(data))
    return
  path = resolve(path)
  if os.path.isdir(path):
    raise UserError(f"cannot write {path}: it is a folder; name a file there instead")
  partial = f"{path}.partial-{os.getpid()}"
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(partial, "wb") as f:
      f.write(data)
    os.replace(partial, path)
  except OSError as e:  # a folder that is a file, no permission, a full disk: the path, not a traceback
    with contextlib.suppress(OSError):
      os.remove(partial)
    if isinstance(e, (FileExistsError, NotADirectoryError)):
      raise UserError(f"cannot write {path}: {_file_among_parents(path)} is a file, not a folder") from None
    raise UserError(f"cannot write {path}: {e.strerror or type(e).__name__}") from None


def _file_among_parents(path: str) -> str:
  parent = os.path.dirname(path)
  while parent and not os.path.exists(parent):
    parent = os.path.dirname(parent)
  return parent


def open_file(path: str, mode: str = "r") -> IO[Any]:
  """A file object for streaming reads or writes (an object is uploaded when it is closed)."""
  if "r" not in mode:
    require_credentials(path)
  return as_path(path).open(mode)


def size(path: str) -> int:
  return _bounded("reading", path, lambda: int(as_path(path).stat().length)) if is_remote(path) \
      else os.path.getsize(resolve(path))


def glob(pattern: str) -> list[str]:
  """Files matching a glob (`*`, `?`, `[...]` in the last components), sorted."""
  if not is_remote(pattern):
    import glob as glob_lib

    return sorted(p for p in glob_lib.glob(os.path.expanduser(pattern)) if os.path.isfile(p))
  head, tail = pattern, list[str]()
  while any(c in name(head) for c in "*?["):
    tail.insert(0, name(head))
    head = parent(head)
  if not tail:
    return [pattern] if is_file(pattern) else []
  matches = _bounded("listing", head, lambda: [str(p) for p in as_path(head).glob("/".join(tail))])
  return sorted(m for m in matches if fnmatch.fnmatch(m, pattern) and is_file(m))


def forget_listings(path: str) -> None:
  """Drops what this process cached of the gs:// listings of `path` and its parents (gcsfs keeps them),
  so its next exists/is_dir/listdir sees what other processes wrote since (a supervisor polling a run)."""
  if is_remote(path):
    import fsspec  # etils.epath's gs:// filesystem: fsspec hands back the same cached instance

    fsspec.filesystem("gcs", finalize_on_close=True).invalidate_cache(resolve(path))


def remove_tree(path: str) -> None:
  require_credentials(path)
  p = as_path(path)

  def remove() -> None:
    if p.is_dir():
      p.rmtree()
    elif p.exists():
      p.unlink()

  _bounded("removing", path, remove)


def set_aside(path: str, new_name: str) -> str:
  """Moves a directory beside itself under `new_name`; returns the new path.

  On local disk this is one atomic rename. An object store has no rename: every object is
  copied (server-side) and the originals are deleted only after the whole copy exists, so an
  interruption leaves at worst both copies, never neither."""
  target = join(parent(path), new_name)
  if not is_remote(path):
    os.rename(resolve(path), target)
    return target
  copy_tree(path, target)
  remove_tree(path)
  return target


def move(source: str, target: str) -> None:
  """Puts the file or directory `source` at `target` (replacing a file there): one atomic rename on local
  disk; on an object store a copy, then the original's removal."""
  if not is_remote(source) and not is_remote(target):
    os.replace(resolve(source), resolve(target))
    return
  copy_tree(source, target)
  remove_tree(source)


def copy_tree(source: str, target: str) -> None:
  """Copies a file or a directory tree between any two locations (local or remote)."""
  src = as_path(source)
  if not is_dir(source):
    makedirs(parent(target))
    if is_remote(source) and is_remote(target):  # the store copies it; no bytes through this host
      require_credentials(target)
      _bounded("copying", source, lambda: src.copy(as_path(target), overwrite=True))
    elif is_remote(source) or is_remote(target):
      write_bytes(target, read_bytes(source))
    else:
      shutil.copyfile(resolve(source), resolve(target))
    return
  for child in _bounded("listing", source, lambda: list(src.iterdir())):
    copy_tree(str(child), join(target, name(str(child))))
  if not is_remote(target):
    makedirs(target)


# ---------------------------------------------------------------- conditional writes (the run lease)
# A small object written only if it is still what the caller last read: how one writer claims
# a run directory. `version` is opaque: the object's generation on GCS, the text itself locally.


# A small file's version for conditional writes: a GCS object's generation, or a local file's text.
Version = int | str


def read_versioned(path: str) -> tuple[str, Version] | None:
  """(text, version) of a small file, or None when it does not exist."""
  if is_remote(path):
    blob = _gcs_blob(path, existing=True)
    return None if blob is None else (blob.download_as_text(), blob.generation)
  with _local_lock(path):
    return _read_local(path)


def write_if(path: str, text: str, version: Version | None) -> Version | None:
  """Writes `text` only if the file is at `version` (None: only if it does not exist); returns
  the new version, or None when another writer got there first."""
  if is_remote(path):
    from google.api_core import exceptions  # noqa: PLC0415 - google-cloud-storage, through gcsfs

    blob = _gcs_blob(path)
    try:  # GCS's own precondition: one of two racing writers gets 412 Precondition Failed
      blob.upload_from_string(text.encode(), if_generation_match=0 if version is None else version)
    except exceptions.PreconditionFailed:
      return None
    return blob.generation
  with _local_lock(path):
    current = _read_local(path)
    if (current is None) != (version is None) or (current is not None and current[1] != version):
      return None
    write_text(path, text)
    return text


def remove_if(path: str, version: Version | None) -> bool:
  """Deletes the file only if it is still at `version`; False when it changed or is gone."""
  if is_remote(path):
    from google.api_core import exceptions  # noqa: PLC0415

    try:
      _gcs_blob(path).delete(if_generation_match=version)
    except (exceptions.PreconditionFailed, exceptions.NotFound):
      return False
    return True
  with _local_lock(path):
    current = _read_local(path)
    if current is None or current[1] != version:
      return False
    os.remove(resolve(path))
    return True


def _read_local(path: str) -> tuple[str, str] | None:
  try:
    with open(resolve(path), encoding="utf-8") as f:
      text = f.read()
  except FileNotFoundError:
    return None
  return text, text


@contextlib.contextmanager
def _local_lock(path: str) -> Iterator[None]:
  """An exclusive flock on the file's directory: read-compare-write is atomic between processes."""
  import fcntl  # noqa: PLC0415 - POSIX only, like the rest of the local tier

  directory = parent(path)
  os.makedirs(directory, exist_ok=True)
  fd = os.open(directory, os.O_RDONLY)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)  # closing releases the lock


def _gcs_blob(path: str, existing: bool = False) -> Any:
  """A google-cloud-storage Blob (the client honours STORAGE_EMULATOR_HOST); with `existing`,
  the blob with its metadata loaded, or None when there is none."""
  storage_retry.raise_if_down()
  require_credentials(path)
  try:
    client = storage_retry.gcs_client()
  except Exception as e:  # noqa: BLE001 - google.auth's DefaultCredentialsError and kin
    raise UserError(f"cannot reach Google Cloud Storage for {path}: {type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''}; run `gcloud auth application-default login` "
                    "or use a service account") from None
  bucket_name, _, key = path[len("gs://"):].partition("/") if path.startswith("gs://") else ("", "", "")
  if not bucket_name or not key:
    raise UserError(f"{path}: conditional writes need a gs://bucket/object path")
  bucket = client.bucket(bucket_name)
  return bucket.get_blob(key) if existing else bucket.blob(key)


class LineLog:
  """A text file that grows by whole lines (metrics.jsonl).

  Locally: an open file in append mode, flushed after each line. On an object store, which
  cannot append, the lines are kept in memory and the whole object is rewritten at most every
  `upload_interval_seconds`, on `sync()` (before each checkpoint) and on close; a kill loses
  only lines after the last checkpoint, which the resumed run logs again anyway."""

  def __init__(self, path: str, initial_lines: list[str], upload_interval_seconds: float = 10.0):
    self.path, self.interval = path, upload_interval_seconds
    self._remote = is_remote(path)
    self._lines = list(initial_lines)
    self._uploaded_at = 0.0
    if self._remote:
      self._upload()
      self._file = None
    else:
      write_text(path, "".join(initial_lines))
      self._file = open(resolve(path), "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

  def write_line(self, line: str) -> None:
    if self._file is not None:
      self._file.write(line + "\n")
      self._file.flush()
      return
    self._lines.append(line + "\n")
    if time.monotonic() - self._uploaded_at >= self.interval:
      self._upload()

  def _upload(self) -> None:
    try:
      write_text(self.path, "".join(self._lines))
    except storage_retry.StorageUnavailable:
      raise
    except Exception as e:  # noqa: BLE001 - any client's transport or permission error
      text = str(e).strip().splitlines()
      raise TrainingError(f"writing {self.path} failed: {type(e).__name__}: {text[0] if text else ''}"[:400] +
                          "; checkpoints already saved are untouched: fix the storage, then rerun the same command "
                          "to resume") from None
    self._uploaded_at = time.monotonic()

  def sync(self) -> None:
    """Makes every line written so far durable now (called before each checkpoint save, so a
    resumed run, which keeps lines up to its checkpoint, never misses one)."""
    if self._file is not None:
      os.fsync(self._file.fileno())
    elif self._remote:
      self._upload()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None
    elif self._remote:
      self._upload()


@contextlib.contextmanager
def local_copy(path: str) -> Iterator[str]:
  """A local path holding `path`'s content: the path itself when local, else a temporary
  download (file or directory) removed afterwards. For readers that need a real file
  (safetensors' memory map, sentencepiece, the HF tokenizer files)."""
  if not is_remote(path):
    yield resolve(path)
    return
  with tempfile.TemporaryDirectory(prefix="maxtext-download-") as tmp:
    local = os.path.join(tmp, name(path))
    copy_tree(path, local)
    yield local


@contextlib.contextmanager
def local_output(path: str) -> Iterator[str]:
  """A local directory to write into, published to `path` when the block ends without an error:
  for writers that need a real directory (safetensors, sentencepiece's trainer)."""
  if not is_remote(path):
    yield resolve(path)
    return
  with tempfile.TemporaryDirectory(prefix="maxtext-upload-") as tmp:
    local = os.path.join(tmp, name(path))
    yield local
    if os.path.exists(local):
      copy_tree(local, path)


# ------------------------------------------------------------------ cloud endpoints



bucket_of = storage_retry.bucket_of


def _with_deadline(fn: Callable[[], _T], seconds: float, what: str) -> _T:
  """`fn`'s value, or a UserError when it has not answered within `seconds` (start-up checks)."""
  finished, value, error = storage_retry.within(seconds, fn, f"storage-check {what}")
  if not finished:
    endpoint = os.environ.get("STORAGE_EMULATOR_HOST") or "the default endpoint"
    raise UserError(f"{what}: no answer from storage ({endpoint}) within {seconds:g} s; check the network, "
                    "the credentials (gcloud auth application-default login) and STORAGE_EMULATOR_HOST")
  if error is not None:
    raise error
  return value  # type: ignore[return-value]  # finished without an error: fn's value


def check_reachable(path: str, key: str, timeout_seconds: float, written: bool = True) -> None:
  """For a remote path: its bucket exists and answers within `timeout_seconds`, else one
  UserError naming the bucket. Local paths are not checked here (they are created on use). A path
  that is `written` needs credentials; one only read goes without them (gcs_auth.prepare_read)."""
  if not is_remote(path):
    return
  bucket = bucket_of(path)
  if written:
    _with_deadline(lambda: require_credentials(path, key), timeout_seconds, f"{key}={path}")
  else:
    _with_deadline(gcs_auth.credentials_problem, timeout_seconds, f"{key}={path}")  # google-auth's look-up
    gcs_auth.prepare_read(path, key, timeout_seconds)
    if gcs_auth.anonymous() and path.startswith("gs://"):
      return  # its anonymous request stood for the probe: a public bucket seldom lets anyone ask for itself

  def probe() -> bool:
    return epath.Path(bucket + "/").exists() or epath.Path(bucket).is_dir()

  try:
    found = _with_deadline(probe, timeout_seconds, f"{key}={path}")
  except UserError:
    raise
  except Exception as e:  # noqa: BLE001 - auth and transport errors of any client library
    gcs_auth.raise_if_credentials_refused(path, e, key)
    text = str(e).strip().splitlines()
    raise UserError(f"{key}={path}: cannot reach bucket {bucket}: {type(e).__name__}: "
                    f"{text[0] if text else ''}"[:400] + "; check the credentials and STORAGE_EMULATOR_HOST") from None
  if not found:
    raise UserError(f"{key}={path}: bucket {bucket} does not exist (or these credentials cannot see it); "
                    "create it or fix the path")


# Path keys a tool writes under (train_compile writes compiled_trainstep_file; the converters their
# output_path): they need credentials, where the others are read anonymously without them.
WRITTEN_PATH_KEYS = frozenset({"base_output_directory", "compiled_trainstep_file", "output_path"})


def check_buckets(paths: dict[str, str], timeout_seconds: float, written: frozenset[str] = WRITTEN_PATH_KEYS) -> None:
  """`check_reachable` once per bucket among `paths` ({key or flag: path or comma-separated paths});
  the paths of the `written` keys first, each (a bucket read anonymously still needs credentials there)."""
  each = [(key, p.strip()) for key, value in paths.items() for p in str(value).split(",")]
  for key, path in each:
    check_form(path, key)
  for key, path in each:
    if key in written and path.startswith("gs://"):
      _with_deadline(lambda: require_credentials(path, key), timeout_seconds, f"{key}={path}")  # noqa: B023 - run here
  seen: set[str] = set()
  for key, path in each:
    if is_remote(path) and bucket_of(path) not in seen:
      seen.add(bucket_of(path))
      check_reachable(path, key, timeout_seconds, written=key in written)
