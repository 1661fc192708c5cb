"""What an elastic supervisor reads of its run's progress while the run goes on: the newest logged step
(metrics.jsonl), the newest whole checkpoint and where process 0 resumed from (its `state:` line). The
supervisor polls them for the run's whole life, so the growing files are read a piece at a time."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from MaxText.paths import storage, storage_retry


class GrowingFile:
  """A file another process appends lines to (metrics.jsonl, a process's log), read a piece at a time: each
  read fetches what follows the last whole line read, with that line again to check it is still there, so a
  poll costs what was appended, not the file's size (on gs:// every read is a download). A file that shrank,
  was replaced (a relaunched run writes metrics.jsonl anew, locally a new file) or is gone is read again from
  its start. A gs:// object is rewritten whole at every upload, so there the check of the last line is what
  tells a rewrite by a new run from an append (storage.LineLog)."""

  CHECK_BYTES = 4096  # at most this much of the last whole line is read again

  def __init__(self, path: str):
    self.path = path
    self.offset = 0  # where the last whole line read ends
    self.last_line = b""  # that line (its last CHECK_BYTES)
    self.tail = b""  # what followed it at the last read: a line being written, or one a killed process cut
    self._identity: tuple[int, int] | None = None  # a local file's (device, inode)

  def read(self) -> tuple[bool, bytes]:
    """(restarted, the whole lines read now). `restarted`: what was read before no longer holds (the file
    shrank, was replaced or is gone); the lines are then the file's from its start."""
    start = self.offset - len(self.last_line)
    identity, data = self._read(start)
    restarted = data is None or identity != self._identity or not data.startswith(self.last_line)
    if restarted:
      self.offset, self.last_line, self.tail = 0, b"", b""
      if data is not None and start > 0:
        identity, data = self._read(0)
    self._identity = identity
    if data is None:
      return restarted, b""
    data = data[len(self.last_line):]
    end = data.rfind(b"\n") + 1
    whole, self.tail = data[:end], data[end:]
    if whole:
      self.offset += len(whole)
      self.last_line = whole[whole.rfind(b"\n", 0, len(whole) - 1) + 1:][-self.CHECK_BYTES:]
    return restarted, whole

  def _read(self, start: int) -> tuple[tuple[int, int] | None, bytes | None]:
    """(the local file's identity, its bytes from `start` on); None for bytes when there is no file."""
    if storage.is_remote(self.path):
      def fetch() -> bytes | None:
        storage.forget_listings(self.path)  # else gcsfs's cached size cuts the read short
        try:
          with storage.open_file(self.path, "rb") as f:  # gcsfs: the seek makes the read a ranged request
            f.seek(start)
            return bytes(f.read())
        except FileNotFoundError:
          return None

      return None, storage_retry.call(f"reading {self.path}", self.path, fetch)
    try:
      with storage.open_file(self.path, "rb") as f:
        stat = os.fstat(f.fileno())
        f.seek(start)
        return (stat.st_dev, stat.st_ino), f.read()
    except FileNotFoundError:
      return None, None


class MetricsReader:
  """The newest step of <run_dir>/metrics.jsonl, read incrementally (GrowingFile): what `logged_step` says
  of the whole file, at the cost of what the run appended since the last look."""

  def __init__(self, run_dir: str | Path):
    self.file = GrowingFile(storage.join(str(run_dir), "metrics.jsonl"))
    self._newest = 0  # among the whole lines read
    self._digest = hashlib.sha256()  # of the whole lines read: what the file reads, for `stale`

  def snapshot(self) -> str:
    """The file as it reads now, as a token for `step(stale=...)`."""
    self._update()
    return self._token()

  def step(self, stale: str | None = None) -> int:
    """The newest step (0: none; also 0 while the file still reads as the `stale` snapshot said)."""
    self._update()
    if stale is not None and self._token() == stale:
      return 0
    return max([self._newest, *_steps(self.file.tail.decode("utf-8", errors="replace"))])

  def _update(self) -> None:
    restarted, lines = self.file.read()
    if restarted:
      self._newest, self._digest = 0, hashlib.sha256()
    if lines:  # split where a line ends, so decoding a piece at a time reads as decoding the whole
      self._newest = max([self._newest, *_steps(lines.decode("utf-8", errors="replace"))])
      self._digest.update(lines)

  def _token(self) -> str:
    digest = self._digest.copy()
    digest.update(self.file.tail)
    return f"{self.file.offset + len(self.file.tail)}:{digest.hexdigest()}"


def metrics_text(run_dir: str | Path) -> str:
  """<run_dir>/metrics.jsonl as it reads now, local or gs:// ("" before the run writes it); a supervisor
  polling it reads it incrementally instead (MetricsReader)."""
  path = storage.join(str(run_dir), "metrics.jsonl")
  storage.forget_listings(path)
  # Bytes that are not UTF-8 (a damaged disk) fail to parse as a step below, like a cut line.
  return storage.read_bytes(path).decode("utf-8", errors="replace") if storage.exists(path) else ""


def logged_step(run_dir: str | Path, stale: str | None = None) -> int:
  """The newest step in <run_dir>/metrics.jsonl (0: none; also 0 while the file still reads `stale`,
  as it did when the generation was launched: a relaunched run rewrites it from the step it resumed from)."""
  text = metrics_text(run_dir)
  if stale is not None and text == stale:
    return 0
  return max(_steps(text), default=0)


def _steps(text: str) -> list[int]:
  """The steps of the records in a metrics.jsonl text. A line that is no step record is skipped: the
  line the run is appending now, or the one a killed process left cut short."""
  steps = []
  for line in text.splitlines():
    try:
      record = json.loads(line)
    except ValueError:
      continue
    step = record.get("step") if isinstance(record, dict) else None
    if isinstance(step, int) and not isinstance(step, bool):
      steps.append(step)
  return steps


def checkpoint_step(run_dir: str | Path) -> int:
  """The newest whole step in <run_dir>/checkpoints (0: none)."""
  folder = storage.join(str(run_dir), "checkpoints")
  storage.forget_listings(folder)
  # ASCII digits only: str.isdigit also takes names such as "²", which int() refuses.
  steps = [int(name) for name in storage.listdir(folder) if re.fullmatch(r"[0-9]+", name)] \
      if storage.is_dir(folder) else []
  return max(steps, default=0)


_RESUMED = re.compile(r"^state: resumed from step (\d+) of (.+)$", re.M)


_SEED = "state: initialised from seed"


class ResumedLine:
  """Where process 0's run resumed from, from its `state:` line (train.py), its log read incrementally
  (GrowingFile): the supervisor asks at every look while the generation runs."""

  def __init__(self, log: str | Path):
    self.file = GrowingFile(str(log))
    self._seed = False  # among the whole lines read
    self._found: tuple[int, str] | None = None  # the first resumed line among them

  def read(self) -> tuple[int, str] | None:
    restarted, lines = self.file.read()
    if restarted:
      self._seed, self._found = False, None
    text = lines.decode("utf-8", errors="replace")
    self._seed = self._seed or _SEED in text
    if self._found is None and (found := _RESUMED.search(text)):
      self._found = int(found.group(1)), found.group(2)
    tail = self.file.tail.decode("utf-8", errors="replace")
    if self._seed or _SEED in tail:
      return 0, "a fresh start"
    if self._found is not None:
      return self._found
    found = _RESUMED.search(tail)
    return (int(found.group(1)), found.group(2)) if found else None
