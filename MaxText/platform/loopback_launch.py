"""Elastic training's CPU launcher (elastic.py's `Launcher` on one machine): a generation of the job's
processes on 127.0.0.1, joined by jax.distributed, each slice a group of processes, a slice down while
its marker file exists. (TPU VMs: multihost_runner.TpuVmLauncher; GKE: gke_launch.GkeLauncher.)
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path
from typing import Mapping, Sequence

from MaxText.platform.generations import Exit, logged_generations
from MaxText.platform.run_progress import ResumedLine


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
