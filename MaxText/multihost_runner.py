"""Run one command on every worker of one or more existing TPU VM slices, for development.

  python3 -m MaxText.multihost_runner tpu_prefix=my-v5e \
      command="bash setup.sh && python3 -m MaxText.train configs/base.yml run_name=r1"
  python3 -m MaxText.multihost_runner tpu_prefix=my-v5e num_slices=2 command="..." dry_run=true

Finds the workers (`gcloud compute tpus tpu-vm describe`), copies SCRIPT_DIR to each of them as a
tarball, starts the command on all of them at once over `gcloud compute tpus tpu-vm ssh`, prints
slice 0 worker 0's output as it comes and keeps every worker's output in LOG_DIR. The exit code is
0 only when every worker succeeded. Ctrl-C (or SIGTERM) stops the command on every worker: the
remote command runs in its own process group whose id is kept in a file, so it can be killed even
after the ssh session that started it is gone. Production jobs: see multihost_job.py. An elastic
run (a lost slice shrinks the job, its return grows it back) is started by MaxText/elastic.py with
these keys' names (tpu_prefix, num_slices, project, zone, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Callable, Iterator, Mapping, Sequence

if __package__ in (None, ""):  # `python3 MaxText/multihost_runner.py`: import the package, not sibling files.
  sys.path[0] = str(Path(__file__).resolve().parent.parent)

from MaxText import startup
from MaxText.platform import tpu_launch
from MaxText.configuration import tool_args
from MaxText.errors import UserError, run_cli
from MaxText.platform.generations import LOST_EXIT, Exit, logged_generations
from MaxText.platform.run_progress import ResumedLine
from MaxText.platform.tpu_launch import Gcloud, log_to_stderr

PID_FILE = ".multihost_runner.pid"
KILL_GRACE_S = 10  # SIGTERM first, so a training run can finish an emergency checkpoint


@dataclasses.dataclass(frozen=True)
class Worker:
  slice_name: str
  slice_id: int
  index: int
  ip: str

  @property
  def label(self) -> str:
    return f"slice-{self.slice_id}-worker-{self.index}"


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python3 -m MaxText.multihost_runner", description=__doc__.split("\n")[0])
  parser.add_argument("--tpu_prefix", required=True,
                      help="the slice's name; with num_slices=N the slices are TPU_PREFIX-0 .. TPU_PREFIX-(N-1)")
  tpu_launch.add_common_arguments(parser)
  parser.add_argument("--use_existing_folder", action="store_true",
                      help="skip the copy and run in the workers' existing ~/RUN_NAME folder (needs run_name)")
  parser.add_argument("--log_dir", default=None, help="local folder for every worker's log (default: a temp folder)")
  parser.add_argument("--internal_ip", action="store_true", help="reach the workers by internal IP (from inside GCP)")
  parser.add_argument("--megascale_port", type=int, default=8080, help="multislice coordinator port")
  parser.add_argument("--fail_fast", action="store_true",
                      help="stop every worker as soon as one fails (default: wait for all of them)")
  parser.add_argument("--num_workers", type=int, default=1,
                      help="with dry_run=true only: workers per slice to print commands for (a real run asks gcloud)")
  args = tool_args.parse_args(parser, argv)
  if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", args.tpu_prefix):  # '' made `gcloud ... ssh ''`
    raise UserError(f"tpu_prefix {args.tpu_prefix!r} must be a TPU VM's name: lower-case letters, digits and '-', "
                    "starting with a letter (the slice is TPU_PREFIX; with num_slices=N, TPU_PREFIX-0 .. -(N-1))")
  if args.use_existing_folder and not args.run_name:
    raise UserError("use_existing_folder=true needs run_name=NAME: the folder ~/NAME on the workers is reused")
  tpu_launch.check_common_arguments(args)
  args.log_dir = Path(args.log_dir or Path(tempfile.gettempdir(), "multihost_runner", args.run_name))
  return args


# ----------------------------------------------------------------------------------------- discovery
def describe_command(gcloud: Gcloud, name: str) -> list[str]:
  return gcloud.command("compute", "tpus", "tpu-vm", "describe", name, "--format=json")


def describe_slice(gcloud: Gcloud, name: str, slice_id: int) -> list[Worker]:
  argv = describe_command(gcloud, name)
  try:
    info = json.loads(gcloud.read(argv, f"describing TPU '{name}'"))
  except json.JSONDecodeError as e:
    raise UserError(f"could not read the description of TPU '{name}': {e}") from None
  if not isinstance(info, dict):
    raise UserError(f"could not read the description of TPU '{name}': gcloud printed {type(info).__name__}, "
                    "not a JSON object")
  state = info.get("state", "UNKNOWN")
  if state != "READY":
    raise UserError(f"TPU '{name}' is {state}, not READY; wait for it or recreate it")
  endpoints = info.get("networkEndpoints") or []
  if not endpoints:
    raise UserError(f"TPU '{name}' lists no workers (networkEndpoints is empty)")
  if not isinstance(endpoints, list) or not all(isinstance(e, dict) for e in endpoints):
    raise UserError(f"could not read the description of TPU '{name}': networkEndpoints is not a list of objects")
  return [Worker(name, slice_id, i, e.get("ipAddress", "")) for i, e in enumerate(endpoints)]


def discover_workers(gcloud: Gcloud, args: argparse.Namespace) -> list[Worker]:
  names = tpu_launch.slice_names(args.tpu_prefix, args.num_slices)
  if gcloud.dry_run:
    # No gcloud call at all in a dry run: the worker count comes from num_workers.
    print(f"# dry run: {len(names)} slice(s) x {args.num_workers} worker(s) assumed (num_workers); "
          f"a real run reads the workers with: {tpu_launch.quote(describe_command(gcloud, names[0]))}")
    return [Worker(n, s, w, f"<{n}-worker-{w}-ip>") for s, n in enumerate(names) for w in range(args.num_workers)]
  listed = gcloud.read(gcloud.command("compute", "tpus", "tpu-vm", "list", "--format=value(name.basename())"),
                       "listing TPU VMs").split()
  missing = [n for n in names if n not in listed]
  if missing:
    near = sorted(n for n in listed if n.startswith(args.tpu_prefix))
    hint = f"; TPUs with that prefix: {', '.join(near)}" if near else ""
    raise UserError(f"no TPU VM named {', '.join(missing)} in this project/zone{hint}")
  workers = [w for s, n in enumerate(names) for w in describe_slice(gcloud, n, s)]
  counts = {w.slice_name: w.index + 1 for w in workers}
  if len(set(counts.values())) > 1:
    raise UserError(f"the slices have different numbers of workers ({counts}); multislice needs equal slices")
  return workers


# ------------------------------------------------------------------------------ what runs remotely
def worker_env(worker: Worker, coordinator_ip: str, num_slices: int, port: int) -> dict[str, str]:
  """The variables that join several slices into one job (the TPU runtime's multislice contract)."""
  if num_slices == 1:
    return {}
  return {"MEGASCALE_COORDINATOR_ADDRESS": f"{coordinator_ip}:{port}", "MEGASCALE_PORT": str(port),
          "MEGASCALE_NUM_SLICES": str(num_slices), "MEGASCALE_SLICE_ID": str(worker.slice_id)}


def remote_script(run_name: str, command: str, env: dict[str, str], unpack: bool) -> str:
  """The shell text one worker runs over ssh."""
  folder = f'"$HOME"/{run_name}'  # run names are [-a-z0-9] only, so no further quoting is needed
  if unpack:
    prepare = unpack_script(run_name)
  else:
    prepare = f"test -d {folder} || {{ echo \"error: $(hostname) has no folder ~/{run_name}\" >&2; exit 2; }}"
  exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in env.items())
  # `echo $$` in the new session leader records the process-group id for the kill command.
  inner = f"echo $$ > {PID_FILE}; {exports}exec bash -c {shlex.quote(command)}"
  return f"{prepare} && cd {folder} && exec setsid -w bash -c {shlex.quote(inner)}"


def unpack_script(run_name: str) -> str:
  """Unpacks the code `copy_commands` put beside the worker's ~/RUN_NAME folder into it."""
  folder = f'"$HOME"/{run_name}'
  return f"mkdir -p {folder} && tar -xzf {folder}.tar.gz -C {folder} && rm -f {folder}.tar.gz"


def kill_script(run_name: str) -> str:
  """Stops the process group recorded by `remote_script`: SIGTERM, then SIGKILL after a grace period."""
  pid_file = f'"$HOME"/{run_name}/{PID_FILE}'
  return (f"if [ -s {pid_file} ]; then pg=$(cat {pid_file}); kill -TERM -- -$pg 2>/dev/null; "
          f"for _ in $(seq {KILL_GRACE_S}); do kill -0 -- -$pg 2>/dev/null || break; sleep 1; done; "
          f"kill -KILL -- -$pg 2>/dev/null; rm -f {pid_file}; fi; true")


def ssh_command(gcloud: Gcloud, slice_name: str, worker: str, script: str, internal_ip: bool) -> list[str]:
  argv = gcloud.command("compute", "tpus", "tpu-vm", "ssh", slice_name, f"--worker={worker}", "--quiet",
                        "--strict-host-key-checking=no", f"--command={script}")
  return argv + (["--internal-ip"] if internal_ip else [])


def copy_commands(gcloud: Gcloud, names: list[str], tarball: Path, run_name: str, internal_ip: bool) -> list[list[str]]:
  return [gcloud.command("compute", "tpus", "tpu-vm", "scp", str(tarball), f"{name}:{run_name}.tar.gz",
                         "--worker=all", "--quiet", "--strict-host-key-checking=no",
                         *(["--internal-ip"] if internal_ip else [])) for name in names]


def copy_code(gcloud: Gcloud, names: list[str], script_dir: Path, run_name: str, log_dir: Path,
               internal_ip: bool, setup_command: str = "") -> None:
  """Copies script_dir to every worker's ~/RUN_NAME (then runs `setup_command` there): the elastic
  supervisor copies once, and each generation runs there."""
  if not script_dir.is_dir():
    raise UserError(f"script_dir {script_dir} is not a directory")
  log_dir.mkdir(parents=True, exist_ok=True)
  tarball = log_dir / "code.tar.gz"
  tpu_launch.package_directory(str(script_dir), tarball)
  run_parallel(copy_commands(gcloud, names, tarball, run_name, internal_ip), "copying the code to the workers")
  run_parallel([ssh_command(gcloud, n, "all", unpack_script(run_name), internal_ip) for n in names],
               "unpacking the code on the workers")
  if setup_command.strip():
    setup = f'cd "$HOME"/{run_name} && {setup_command}'
    run_parallel([ssh_command(gcloud, n, "all", setup, internal_ip) for n in names],
                 f"running {setup_command!r} on the workers")


# ------------------------------------------------------------------------------- local processes
@dataclasses.dataclass
class HostProcess:
  worker: Worker
  proc: subprocess.Popen[bytes]
  log_path: Path
  log: IO[bytes]
  tee: threading.Thread | None = None

  def close(self) -> None:
    if self.tee is not None:
      self.tee.join(timeout=5)
    self.log.close()


def _tee(source: IO[bytes], log: IO[bytes]) -> None:
  for line in iter(source.readline, b""):
    sys.stdout.buffer.write(line)
    sys.stdout.buffer.flush()
    log.write(line)
    log.flush()


def start_host(argv: list[str], worker: Worker, log_dir: Path, stream: bool) -> HostProcess:
  log_path = log_dir / f"{worker.label}.log"
  log = open(log_path, "wb")  # noqa: SIM115 - closed by HostProcess.close
  # A session of its own: a terminal's Ctrl-C reaches only this runner, which then stops the
  # remote side first instead of leaving ssh to die and the remote command running on.
  proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE if stream else log,
                          stderr=subprocess.STDOUT, start_new_session=True)
  host = HostProcess(worker, proc, log_path, log)
  if stream:
    host.tee = threading.Thread(target=_tee, args=(proc.stdout, log), daemon=True)
    host.tee.start()
  return host


def run_parallel(commands: list[list[str]], what: str) -> None:
  """Runs a few short gcloud commands at once (one per slice); all must succeed."""
  procs = [subprocess.Popen(c, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True) for c in commands]
  try:
    outputs = [p.communicate(timeout=900)[0].decode(errors="replace") for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  failed = [(c, p.returncode, o) for c, p, o in zip(commands, procs, outputs) if p.returncode != 0]
  if failed:
    command, code, output = failed[0]
    last = (output.strip().splitlines() or ["no output"])[-1]
    raise UserError(f"{what} failed (exit {code}): {last}; command: {tpu_launch.quote(command)}")


def stop_everything(hosts: list[HostProcess], kill_commands: list[list[str]]) -> None:
  """Stops the remote commands (by process group, see kill_script), then the local ssh processes."""
  log_to_stderr(f"stopping the command on {len(hosts)} worker(s) ...")
  try:
    run_parallel(kill_commands, "stopping the remote commands")
  except UserError as e:
    log_to_stderr(f"warning: {e}; check the workers for leftover processes")
  for host in hosts:
    if host.proc.poll() is None:
      os.killpg(host.proc.pid, signal.SIGTERM)
  deadline = time.monotonic() + 5
  for host in hosts:
    try:
      host.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      os.killpg(host.proc.pid, signal.SIGKILL)
      host.proc.wait()


class _FailFast(Exception):
  pass


def wait_for_hosts(hosts: list[HostProcess], fail_fast: bool) -> dict[str, int]:
  codes: dict[str, int] = {}
  pending = list(hosts)
  while pending:
    for host in list(pending):
      code = host.proc.poll()
      if code is None:
        continue
      pending.remove(host)
      host.close()
      codes[host.worker.label] = code
      if code != 0:
        log_to_stderr(f"{host.worker.label} exited with code {code}; its log: {host.log_path}")
        if fail_fast and pending:
          raise _FailFast()
    time.sleep(0.1)
  return codes


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
  """A scheduler's SIGTERM takes the same clean-up path as Ctrl-C."""
  def handler(signum: int, frame: object) -> None:
    raise KeyboardInterrupt()
  previous = signal.signal(signal.SIGTERM, handler)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)


def summarize(codes: list[tuple[str, int]], log_dir: Path) -> int:
  """One closing line; the exit code is the first failed worker's (in worker order), else 0."""
  failed = [(label, code) for label, code in codes if code != 0]
  if not failed:
    print(f"multihost_runner: all {len(codes)} worker(s) succeeded; logs in {log_dir}", flush=True)
    return 0
  listing = ", ".join(f"{label} (exit {code})" for label, code in failed)
  log_to_stderr(f"multihost_runner: {len(failed)} of {len(codes)} worker(s) failed: {listing}; logs in {log_dir}")
  return failed[0][1]


# ------------------------------------------------------- elastic training's launcher (MaxText/elastic.py)
class _SshGeneration:
  """The command on every worker of the chosen slices, one local `gcloud ... ssh` each."""

  def __init__(self, hosts: list[HostProcess], slice_of: dict[str, int], signal_commands:
               Callable[[int], list[list[str]]]):
    self.hosts, self.slice_of, self.signal_commands = hosts, slice_of, signal_commands
    self._resumed = ResumedLine(hosts[0].log_path) if hosts else None

  def exits(self) -> list[Exit]:
    ended = [(i, h, code) for i, h in enumerate(self.hosts) if (code := h.proc.poll()) is not None]
    for _, host, _ in ended:
      host.close()
    return [Exit(self.slice_of[h.worker.slice_name], i, code) for i, h, code in ended]

  def running(self) -> int:
    return sum(h.proc.poll() is None for h in self.hosts)

  def signal_all(self, signum: int) -> None:
    try:
      run_parallel(self.signal_commands(signum), f"sending signal {signum} to the workers")
    except UserError as e:
      print(f"warning: {e}", file=sys.stderr, flush=True)
    if signum == signal.SIGKILL:  # the remote groups are gone: end the local ssh processes too
      for host in self.hosts:
        if host.proc.poll() is None:
          os.killpg(host.proc.pid, signal.SIGKILL)

  def resumed_from(self) -> tuple[int, str] | None:
    return self._resumed.read() if self._resumed is not None else None


class _Unstarted:
  """A generation not started because slices were lost between the supervisor's look and the start: each
  reads as a process lost with its host, so the supervisor goes on on the slices still up (or stops with its
  line when too few are left)."""

  def __init__(self, lost: list[Exit]):
    self.lost = lost

  def exits(self) -> list[Exit]:
    return list(self.lost)

  def running(self) -> int:
    return 0

  def signal_all(self, signum: int) -> None:
    pass

  def resumed_from(self) -> tuple[int, str] | None:
    return None


def signal_script(run_name: str, signum: int) -> str:
  """Sends `signum` to the process group multihost_runner's remote script recorded (SIGKILL: its kill script)."""
  if signum == signal.SIGKILL:
    return kill_script(run_name)
  pid_file = f'"$HOME"/{run_name}/{PID_FILE}'
  return f"if [ -s {pid_file} ]; then kill -{signum} -- -$(cat {pid_file}) 2>/dev/null; fi; true"


class TpuVmLauncher:
  """Slices of TPU VMs named like multihost_runner's (PREFIX-0 .. PREFIX-(N-1)), each worker reached
  over `gcloud compute tpus tpu-vm ssh` running `command` in its existing ~/RUN_NAME folder. A
  slice is up while its TPU is READY; the chosen slices are renumbered 0.. for the multislice
  variables, with slice 0 worker 0 the coordinator."""

  def __init__(self, gcloud: Gcloud, names: Sequence[str], command: str, run_name: str, log_dir: Path,
               internal_ip: bool = False, megascale_port: int = 8080):
    self.gcloud, self.names, self.command, self.run_name = gcloud, list(names), command, run_name
    self.log_dir, self.internal_ip, self.port = log_dir, internal_ip, megascale_port
    log_dir.mkdir(parents=True, exist_ok=True)
    self.generations = logged_generations(log_dir)  # a rerun's logs go beside the last run's

  def available(self) -> set[int]:
    up = set()
    for i, name in enumerate(self.names):
      try:
        describe_slice(self.gcloud, name, i)
        up.add(i)
      except UserError:
        pass  # not READY (preempted, repairing) or not listed: down
    return up

  def mark_lost(self, slice_id: int) -> None:
    pass  # the TPU's own state says when it is back

  def start(self, slices: Sequence[int], overrides: Sequence[str], env: Mapping[str, str] | None = None
            ) -> _SshGeneration | _Unstarted:
    self.generations += 1
    workers, lost = [], []
    for new, s in enumerate(slices):
      try:
        workers += [dataclasses.replace(w, slice_id=new) for w in
                    describe_slice(self.gcloud, self.names[s], s)]
      except UserError as e:  # lost since the supervisor's look (PREEMPTED, say): a lost slice, like any other
        lost.append(Exit(s, len(workers), LOST_EXIT,
                         f"could not be started: {str(e).removesuffix('; wait for it or recreate it')}"))
    if lost:  # nothing is started: the supervisor relaunches on the slices still up
      return _Unstarted(lost)
    command = " ".join([self.command, *map(shlex.quote, overrides)])
    folder = self.log_dir / f"generation_{self.generations}"
    folder.mkdir(parents=True, exist_ok=True)
    hosts = []
    for i, worker in enumerate(workers):
      exports = {**worker_env(worker, workers[0].ip, len(slices), self.port), **(env or {})}
      script = remote_script(self.run_name, command, exports, unpack=False)
      argv = ssh_command(self.gcloud, worker.slice_name, str(worker.index), script, self.internal_ip)
      hosts.append(start_host(argv, worker, folder, stream=False))
    chosen = [self.names[s] for s in slices]

    def signal_commands(signum: int) -> list[list[str]]:
      return [ssh_command(self.gcloud, name, "all", signal_script(self.run_name, signum),
                                           self.internal_ip) for name in chosen]

    return _SshGeneration(hosts, {self.names[s]: s for s in slices}, signal_commands)


TOOL = startup.Tool("multihost_runner", builds_config=False)


def main(argv: list[str]) -> int:
  startup.start(TOOL, argv)
  args = parse_args(argv[1:])
  gcloud = Gcloud(args.project, args.zone, args.dry_run)
  workers = discover_workers(gcloud, args)
  names = tpu_launch.slice_names(args.tpu_prefix, args.num_slices)
  tarball = args.log_dir / "code.tar.gz"
  copies = [] if args.use_existing_folder else copy_commands(gcloud, names, tarball, args.run_name, args.internal_ip)
  runs = [ssh_command(gcloud, w.slice_name, str(w.index),
                      remote_script(args.run_name, args.command,
                                    worker_env(w, workers[0].ip, args.num_slices, args.megascale_port),
                                    unpack=not args.use_existing_folder), args.internal_ip) for w in workers]
  kills = [ssh_command(gcloud, n, "all", kill_script(args.run_name), args.internal_ip) for n in names]
  if args.dry_run:
    if copies:
      print(f"# package {args.script_dir} into {tarball}, then copy it to every worker:")
    for argv_ in copies + runs:
      gcloud.show(argv_)
    print("# on Ctrl-C:")
    for argv_ in kills:
      gcloud.show(argv_)
    return 0

  args.log_dir.mkdir(parents=True, exist_ok=True)
  hosts: list[HostProcess] = []
  with sigterm_as_interrupt():
    try:
      if copies:
        log_to_stderr(f"copying {args.script_dir} to {len(workers)} worker(s) of {len(names)} slice(s) ...")
        tpu_launch.package_directory(args.script_dir, tarball)
        run_parallel(copies, "copying the code to the workers")
      log_to_stderr(f"running on {len(workers)} worker(s); showing {workers[0].label}, "
                    f"every worker's log in {args.log_dir}")
      for i, (argv_, worker) in enumerate(zip(runs, workers)):
        hosts.append(start_host(argv_, worker, args.log_dir, stream=(i == 0)))
      codes = wait_for_hosts(hosts, args.fail_fast)
      return summarize([(w.label, codes[w.label]) for w in workers], args.log_dir)
    except (KeyboardInterrupt, _FailFast) as stop:
      with contextlib.suppress(KeyboardInterrupt):
        stop_everything(hosts, kills)
      for host in hosts:
        host.close()
      if isinstance(stop, _FailFast):
        log_to_stderr(f"multihost_runner: stopped every worker after the first failure; logs in {args.log_dir}")
        return 1
      log_to_stderr(f"multihost_runner: interrupted; every worker's command was stopped; logs in {args.log_dir}")
      return 130


if __name__ == "__main__":
  run_cli(main)
