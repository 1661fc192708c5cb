"""What `multihost_runner.py` and `multihost_job.py` share: gcloud invocations, the code tarball,
run names and the arguments both take.

Every cloud action goes through `Gcloud`, so a dry run prints exactly the commands a real run
executes, and tests can put a fake `gcloud` first on PATH.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import re
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Sequence

from MaxText.errors import UserError

# Never shipped to the workers: version control, caches and local run outputs can be large
# and are useless (or harmful: stale .pyc files) on the other side.
EXCLUDED_NAMES = frozenset({".git", "__pycache__", ".pytest_cache", ".venv", "outputs", ".benchmarks"})
EXCLUDED_SUFFIXES = (".pyc", ".egg-info")
_RUN_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def quote(words: Sequence[str]) -> str:
  return " ".join(shlex.quote(w) for w in words)


@dataclasses.dataclass(frozen=True)
class Gcloud:
  """Runs (or, in a dry run, prints) gcloud commands for one project and zone."""

  project: str | None
  zone: str | None
  dry_run: bool
  executable: str = "gcloud"

  def command(self, *args: str, zonal: bool = True) -> list[str]:
    """A full argv; `zonal=False` for commands that take no --zone (gcloud storage)."""
    words = [self.executable, *args]
    if zonal and self.zone:
      words.append(f"--zone={self.zone}")
    if self.project:
      words.append(f"--project={self.project}")
    return words

  def show(self, argv: Sequence[str]) -> None:
    print(quote(argv), flush=True)

  def read(self, argv: Sequence[str], what: str) -> str:
    """Runs a read-only command and returns its stdout; a failure names what was being done."""
    try:
      done = subprocess.run(list(argv), capture_output=True, text=True, check=False, timeout=300)
    except FileNotFoundError:
      raise UserError(f"'{argv[0]}' was not found on PATH: install the Google Cloud CLI "
                      "(https://cloud.google.com/sdk/docs/install) or use dry_run=true") from None
    except subprocess.TimeoutExpired:
      raise UserError(f"{what} did not finish within 300 s; command: {quote(argv)}") from None
    if done.returncode != 0:
      last = (done.stderr.strip().splitlines() or ["no error output"])[-1]
      raise UserError(f"{what} failed (exit {done.returncode}): {last}; command: {quote(argv)}")
    return done.stdout

  def act(self, argv: Sequence[str], what: str) -> None:
    """Runs a command that changes something, or prints it in a dry run."""
    if self.dry_run:
      self.show(argv)
      return
    self.read(argv, what)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--command", required=True, help="shell command every worker runs, from the copied directory")
  parser.add_argument("--script_dir", default=os.getcwd(),
                      help="directory copied to the workers (default: the current directory)")
  parser.add_argument("--run_name", default=None,
                      help="names the job, its folder on the workers and its logs (default: user-date-time)")
  parser.add_argument("--num_slices", type=int, default=1, help="number of TPU slices (multislice when > 1)")
  parser.add_argument("--project", default=None, help="GCP project (default: gcloud's configured project)")
  parser.add_argument("--zone", default=None, help="GCP zone (default: gcloud's configured compute/zone)")
  parser.add_argument("--dry_run", action="store_true",
                      help="print every gcloud command instead of running it")


def check_common_arguments(args: argparse.Namespace) -> None:
  if args.num_slices < 1:
    raise UserError(f"num_slices must be at least 1, got {args.num_slices}")
  if not Path(args.script_dir).is_dir():
    raise UserError(f"script_dir {args.script_dir} is not a directory")
  if not args.command.strip():
    raise UserError("command is empty")
  args.run_name = args.run_name or default_run_name()
  check_run_name(args.run_name)


def check_run_name(run_name: str) -> None:
  if not _RUN_NAME.match(run_name):
    # Queued-resource and node names, and folder names on the workers, must all accept it.
    raise UserError(f"run_name '{run_name}' must be lower-case letters, digits and '-', "
                    "starting with a letter and not ending with '-'")


def default_run_name() -> str:
  user = re.sub(r"[^a-z0-9]+", "-", os.environ.get("USER", "user").lower()).strip("-") or "user"
  return f"{user}-{datetime.datetime.now().strftime('%Y-%m-%d-%H-%M-%S')}"


QUEUED_RESOURCES = ("alpha", "compute", "tpus", "queued-resources")


def queued_resource_create(gcloud: Gcloud, name: str, tpu_type: str, version: str, num_slices: int,
                           extra: Sequence[str] = ()) -> list[str]:
  """The request for `num_slices` slices as queued resource `name`: one slice's node is NAME, several
  are NAME-0 .. NAME-(N-1) (--node-prefix), as multihost_runner and the elastic supervisor expect."""
  nodes = [f"--node-id={name}"] if num_slices == 1 else [f"--node-count={num_slices}", f"--node-prefix={name}"]
  return gcloud.command(*QUEUED_RESOURCES, "create", name, f"--accelerator-type={tpu_type}",
                        f"--runtime-version={version}", *nodes, *extra)


def slice_names(tpu_prefix: str, num_slices: int) -> list[str]:
  """One slice is named TPU_PREFIX; several are TPU_PREFIX-0, -1, ... as queued resources
  created with --node-prefix name them."""
  return [tpu_prefix] if num_slices == 1 else [f"{tpu_prefix}-{i}" for i in range(num_slices)]


def _keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
  name = Path(info.name).name
  if name in EXCLUDED_NAMES or name.endswith(EXCLUDED_SUFFIXES):
    return None
  return info


def package_directory(source: str | Path, tarball: str | Path) -> Path:
  """Writes SOURCE's contents (without caches and VCS data) to a gzip tarball, paths relative."""
  tarball = Path(tarball)
  tarball.parent.mkdir(parents=True, exist_ok=True)
  with tarfile.open(tarball, "w:gz") as tar:
    for entry in sorted(Path(source).iterdir()):
      if entry.resolve() == tarball.resolve():
        continue
      tar.add(entry, arcname=entry.name, filter=_keep)
  return tarball


def log_to_stderr(message: str) -> None:
  print(message, file=sys.stderr, flush=True)
