"""Multi-process start-up (JAX's own multi-controller runtime), and per-process diagnostics.

Every host runs the same program; `initialize(...)` must run before the JAX backend starts.
Where the process topology comes from, first match wins:
  * JAX_COORDINATOR_ADDRESS + JAX_PROCESS_COUNT + JAX_PROCESS_ID (any platform, e.g. CPU tests),
  * SLURM (SLURM_JOB_ID with more than one task): JAX's own SLURM detection,
  * a TPU VM slice with several hosts: JAX's auto-detection from the TPU metadata,
  * otherwise one process: nothing to initialise.
On CPU the cross-process collectives use gloo.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import socket
import time
from typing import Callable, Iterator, Mapping, Sequence, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils

from MaxText import errors
from MaxText.errors import UserError

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class ProcessTopology:
  coordinator_address: str | None  # None: let JAX detect it (TPU, SLURM)
  num_processes: int | None
  process_id: int | None
  source: str


def detect(environ: Mapping[str, str], platform_hint: str) -> ProcessTopology | None:
  """Which multi-process setup this process is part of, or None when it runs alone."""
  address = environ.get("JAX_COORDINATOR_ADDRESS")
  if address:
    missing = [k for k in ("JAX_PROCESS_COUNT", "JAX_PROCESS_ID") if not environ.get(k, "").isdigit()]
    if missing:
      raise UserError(f"JAX_COORDINATOR_ADDRESS={address} is set but {', '.join(missing)} is missing or "
                      "not a number; set all three (or none for a single process)")
    count, index = int(environ["JAX_PROCESS_COUNT"]), int(environ["JAX_PROCESS_ID"])
    if not 0 <= index < count:
      raise UserError(f"JAX_PROCESS_ID={index} must be in [0, JAX_PROCESS_COUNT={count})")
    return None if count == 1 else ProcessTopology(address, count, index, "JAX_* environment variables")
  if environ.get("SLURM_JOB_ID") and int(environ.get("SLURM_NTASKS", "1") or 1) > 1:
    return ProcessTopology(None, None, None, "SLURM")
  worker_hosts = [h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
  if platform_hint == "tpu" and len(worker_hosts) > 1:
    return ProcessTopology(None, None, None, "TPU VM metadata")
  return None


def initialize(platform_hint: str, init_timeout_s: int, heartbeat_timeout_s: int,
               environ: Mapping[str, str] | None = None) -> ProcessTopology | None:
  """Joins the multi-process job if there is one. Fails (never hangs) after `init_timeout_s`."""
  topology = detect(os.environ if environ is None else environ, platform_hint)
  if topology is None:
    return None
  if platform_hint == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  where = topology.coordinator_address or f"the coordinator found via {topology.source}"
  if topology.coordinator_address and topology.process_id != 0:
    # XLA aborts the whole process (no Python exception) when the coordinator never answers,
    # so wait for its port here and fail with a message that names it.
    _wait_for_coordinator(topology.coordinator_address, init_timeout_s, topology.process_id)
  try:
    jax.distributed.initialize(
        coordinator_address=topology.coordinator_address, num_processes=topology.num_processes,
        process_id=topology.process_id, initialization_timeout=init_timeout_s,
        heartbeat_timeout_seconds=heartbeat_timeout_s)
  except Exception as e:  # noqa: BLE001 - XLA raises several types; all mean "could not join"
    first = (str(e).strip().splitlines() or [""])[0][:300]
    raise UserError(f"could not join the multi-process job at {where} within {init_timeout_s} s "
                    f"(process {topology.process_id} of {topology.num_processes}): {first}; check that "
                    "every process was started and that the address is reachable") from None
  errors.set_process_label(f"process {jax.process_index()}/{jax.process_count()}")
  return topology


def _wait_for_coordinator(address: str, timeout_s: int, process_id: int | None) -> None:
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit():
    raise UserError(f"JAX_COORDINATOR_ADDRESS must be host:port, got {address!r}")
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
        return
    except OSError as e:
      if time.monotonic() >= deadline:
        raise UserError(f"could not join the multi-process job at {address} within {timeout_s} s (process "
                        f"{process_id}): {e.strerror or e}; check that process 0 was started and that the "
                        "address is reachable (distributed_init_timeout_seconds sets the wait)") from None
      time.sleep(0.5)


@contextlib.contextmanager
def stack_traces(collect: bool, to_cloud: bool, interval_s: int) -> Iterator[None]:
  """cloud-tpu-diagnostics: on a crash or hang-check signal, dump every Python stack, to the
  console (stack_trace_to_cloud=False) or to the file its Cloud Logging agent uploads."""
  if not collect:
    yield
    return
  from cloud_tpu_diagnostics import diagnostic  # noqa: PLC0415 - only when asked for
  from cloud_tpu_diagnostics.configuration import debug_configuration, diagnostic_configuration
  from cloud_tpu_diagnostics.configuration import stack_trace_configuration

  config = diagnostic_configuration.DiagnosticConfig(debug_config=debug_configuration.DebugConfig(
      stack_trace_config=stack_trace_configuration.StackTraceConfig(
          collect_stack_trace=True, stack_trace_to_cloud=to_cloud, stack_trace_interval_seconds=interval_s)))
  # Entered, never exited: the library's exit joins a daemon thread that sleeps a whole
  # stack_trace_interval_seconds, which would hold every finished run for up to that long.
  # The thread is a daemon, so it ends with the process.
  diagnostic.diagnose(config).__enter__()
  yield


def on_process_0(what: str, action: Callable[[], _T]) -> _T | None:
  """Runs `action` on process 0; a UserError there stops every process (the others exit with a
  line pointing at process 0's message instead of waiting for it in a collective)."""
  failure: UserError | None = None
  result = None
  if jax.process_index() == 0:
    try:
      result = action()
    except UserError as e:
      failure = e
  if jax.process_count() > 1:
    failed = int(multihost_utils.broadcast_one_to_all(np.int32(failure is not None)))
    if failed and failure is None:
      raise UserError(f"{what} failed on process 0; its error line says why")
  if failure is not None:
    raise failure
  return result


CONFIG_KEY = "maxtext_config/"  # + process index: that process's configuration, in the coordination service


def _digest(text: str) -> np.ndarray:
  return np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint32)


def check_same_config(values: Mapping[str, object], per_host: Sequence[str] = (), timeout_s: int = 120) -> None:
  """Every process of the job must have built the same configuration (but for the `per_host` keys): one
  started with another override or M_* variable ran into a collective of another shape, which gloo
  aborts on and a TPU may wait on for good. Raises UserError on every process, naming the keys."""
  if jax.process_count() <= 1:
    return
  from jax._src import distributed as jax_distributed  # the coordination client has no public accessor

  mine = json.dumps({k: repr(v) for k, v in values.items() if k not in per_host}, sort_keys=True)
  me = jax.process_index()
  client = jax_distributed.global_state.client
  assert client is not None  # jax.distributed joined: process_count() > 1
  client.key_value_set(f"{CONFIG_KEY}{me}", mine, allow_overwrite=True)
  # A fixed-size collective: its shape does not depend on the configuration being compared.
  digests = np.asarray(multihost_utils.process_allgather(_digest(mine))).reshape(jax.process_count(), -1)
  differ = [p for p in range(jax.process_count()) if not np.array_equal(digests[p], digests[0])]
  if not differ:
    return
  other = differ[0] if me == 0 else 0
  try:
    theirs = json.loads(client.blocking_key_value_get(f"{CONFIG_KEY}{other}", timeout_s * 1000))
  except Exception:  # noqa: BLE001 - that process is gone already: the keys cannot be named, the stop stands
    theirs = None
  shown = ""
  if theirs is not None:
    ours = json.loads(mine)
    keys = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
    shown = " (" + "; ".join(f"{k}: {theirs.get(k, '(none)')} on process {other}, {ours.get(k, '(none)')} here"
                             for k in keys[:4]) + (f"; and {len(keys) - 4} more" if len(keys) > 4 else "") + ")"
  raise UserError(f"the processes of this job were started with different configurations: process(es) "
                  f"{', '.join(map(str, differ))} differ from process 0{shown}; start every process with "
                  "the same command, config file and M_* variables")


def log(message: str) -> None:
  """Prints on process 0 only (every process runs the same program)."""
  if jax.process_index() == 0:
    print(message, flush=True)
