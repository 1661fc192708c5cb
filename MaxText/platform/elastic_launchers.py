"""The elastic supervisor's launchers (elastic.py's `Launcher`s): one starts a generation of the job's
processes on the slices it is given and says which slices are up.

`LoopbackLauncher`: CPU processes on this machine joined on 127.0.0.1, a slice down while its marker
file exists. `TpuVmLauncher`: TPU VMs named like multihost_runner's, reached over `gcloud ... ssh`, a
slice up while its TPU is READY. (GKE's is platform/gke_launch.py's `GkeLauncher`.)
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable, Mapping, Sequence

from MaxText import multihost_runner
from MaxText.errors import UserError
from MaxText.platform.generations import LOST_EXIT, Exit, logged_generations
from MaxText.platform.run_progress import ResumedLine
from MaxText.platform.tpu_launch import Gcloud


# ----------------------------------------------------------------------------- CPU loopback launcher
class _ProcessGeneration:
  def __init__(self, procs: list[tuple[int, subprocess.Popen[bytes]]], first_log: Path):
    self.procs, self.first_log = procs, first_log
    self._resumed = ResumedLine(first_log)

  def resumed_from(self) -> tuple[int, str] | None:
    """From process 0's `state:` line (train.py)."""
    return self._resumed.read()

  def exits(self) -> list[Exit]:
    return [Exit(slice_id, i, code) for i, (slice_id, p) in enumerate(self.procs)
            if (code := p.poll()) is not None]

  def running(self) -> int:
    return sum(p.poll() is None for _, p in self.procs)

  def signal_all(self, signum: int) -> None:
    for _, p in self.procs:
      if p.poll() is None:
        p.send_signal(signum)


class LoopbackLauncher:
  """The job's processes on this machine (CPU): `processes_per_slice` per slice, each with
  `devices_per_process` simulated devices, joined on 127.0.0.1. A slice is down while
  `<state_dir>/slice_<i>.down` exists (the supervisor writes it when the slice's process dies;
  deleting it brings the slice back). Each simulated host keeps its own local checkpoint folder
  (`host_local_directory`), whatever process index a generation gives it."""

  def __init__(self, command: Sequence[str], num_slices: int, processes_per_slice: int, devices_per_process: int,
               state_dir: Path, env: Mapping[str, str], log_dir: Path):
    self.command, self.num_slices = list(command), num_slices
    self.processes_per_slice, self.devices_per_process = processes_per_slice, devices_per_process
    self.state_dir, self.env, self.log_dir = state_dir, dict(env), log_dir
    self.current: _ProcessGeneration | None = None  # the processes running now (a fault test kills one)
    state_dir.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    self.generations = logged_generations(log_dir)  # a rerun's logs go beside the last run's

  def marker(self, slice_id: int) -> Path:
    return self.state_dir / f"slice_{slice_id}.down"

  def available(self) -> set[int]:
    return {s for s in range(self.num_slices) if not self.marker(s).exists()}

  def down_markers(self) -> list[Path]:
    return [self.marker(s) for s in range(self.num_slices) if self.marker(s).exists()]

  def mark_lost(self, slice_id: int) -> None:
    if not self.marker(slice_id).exists():  # one already there (even a folder) says the same
      self.marker(slice_id).write_text("lost\n")

  def start(self, slices: Sequence[int], overrides: Sequence[str], env: Mapping[str, str] | None = None
            ) -> _ProcessGeneration:
    self.generations += 1
    count = len(slices) * self.processes_per_slice
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      address = f"127.0.0.1:{s.getsockname()[1]}"
    flags = f"--xla_force_host_platform_device_count={self.devices_per_process}"
    procs = []
    logs = [self.log_dir / f"generation_{self.generations}_process_{index}.log" for index in range(count)]
    for index in range(count):
      environ = {**self.env, **(env or {}), "JAX_PLATFORMS": "cpu",
                 "XLA_FLAGS": f"{flags} {self.env.get('XLA_FLAGS', '')}".strip()}
      if count > 1:
        environ.update(JAX_COORDINATOR_ADDRESS=address, JAX_PROCESS_COUNT=str(count), JAX_PROCESS_ID=str(index))
      log = open(logs[index], "wb")  # noqa: SIM115
      slice_id = slices[index // self.processes_per_slice]
      argv = host_local_directory([*self.command, *overrides], slice_id, index % self.processes_per_slice)
      procs.append((slice_id, subprocess.Popen(argv, env=environ, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL)))
      log.close()  # the child holds its own descriptor
    self.current = _ProcessGeneration(procs, logs[0])
    return self.current


def host_local_directory(argv: Sequence[str], slice_id: int, host: int) -> list[str]:
  """`argv` with local_checkpoint_directory=D as D/slice_<s>_host_<k>: on one machine, each host's
  own disk, which stays with the host when a resize renumbers the processes."""
  key = "local_checkpoint_directory="
  return [f"{key}{os.path.join(a[len(key):], f'slice_{slice_id}_host_{host}')}" if a.startswith(key) and a != key
          else a for a in argv]


def loopback_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
  """This process's environment without the multi-process variables (each process gets its own)."""
  drop = ("JAX_COORDINATOR_ADDRESS", "JAX_PROCESS_COUNT", "JAX_PROCESS_ID", "XLA_FLAGS")
  return {**{k: v for k, v in os.environ.items() if k not in drop}, **(extra or {})}


# ------------------------------------------------------------------------------ TPU VM launcher
class _SshGeneration:
  """The command on every worker of the chosen slices, one local `gcloud ... ssh` each."""

  def __init__(self, hosts: list[multihost_runner.HostProcess], slice_of: dict[str, int], signal_commands:
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
      multihost_runner.run_parallel(self.signal_commands(signum), f"sending signal {signum} to the workers")
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
    return multihost_runner.kill_script(run_name)
  pid_file = f'"$HOME"/{run_name}/{multihost_runner.PID_FILE}'
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
        multihost_runner.describe_slice(self.gcloud, name, i)
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
                    multihost_runner.describe_slice(self.gcloud, self.names[s], s)]
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
      exports = {**multihost_runner.worker_env(worker, workers[0].ip, len(slices), self.port), **(env or {})}
      script = multihost_runner.remote_script(self.run_name, command, exports, unpack=False)
      argv = multihost_runner.ssh_command(self.gcloud, worker.slice_name, str(worker.index), script, self.internal_ip)
      hosts.append(multihost_runner.start_host(argv, worker, folder, stream=False))
    chosen = [self.names[s] for s in slices]

    def signal_commands(signum: int) -> list[list[str]]:
      return [multihost_runner.ssh_command(self.gcloud, name, "all", signal_script(self.run_name, signum),
                                           self.internal_ip) for name in chosen]

    return _SshGeneration(hosts, {self.names[s]: s for s in slices}, signal_commands)
