"""Start-up: one entry, `start(tool, argv)`, for every entry point. A `Tool` says what that tool
needs; the order is the same for all of them:

    process (signals, library logs, storage emulator) ─► argv / M_* env ─► Overrides
      ─► gs:// buckets answer (and the tool's own path checks) ─► compile target ─► JAX platform
      ─► XLA / libtpu flags ─► jax.distributed (multi-process) ─► Config
      ─► stack-trace dumps ─► the run directory's lease

The order matters: the platform and the flags must be set before the JAX backend starts, and
`jax.distributed.initialize` must run before anything asks for devices. A tool that builds no
model config (data preparation, launchers) stops after the process step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import types
from typing import Any, Callable, Iterator, Literal, Mapping, Protocol, Sequence

import jax
from jax.experimental import topologies

from MaxText.run_dir import run_lease
from MaxText.platform import accelerators, distributed, xla_flags
from MaxText.paths import cloud_env, storage, storage_retry
from MaxText.configuration import config as config_lib
from MaxText.errors import ConfigError

# What a tool compiles for: the devices this process sees ("local"); a TPU slice that
# compile_topology names, as libtpu describes it, or `local` ("slice or local": train_compile);
# or only a named slice's figures, no devices ("slice figures": the planner, which compiles in
# workers).
CompileTarget = Literal["local", "slice or local", "slice figures"]


@dataclasses.dataclass(frozen=True)
class Tool:
  """What one entry point needs from start-up."""

  name: str
  builds_config: bool = True  # False: no model config and no JAX backend (data preparation, launchers)
  reads_run: bool = False  # reads a run or checkpoint: the model keys saved with it apply (config.resolve_values)
  # False: reads no training data, so the data keys' checks of where data comes from (and GRPO's of
  # its prompts and rewards) do not apply: a model is served with the config it was fine-tuned with.
  reads_data: bool = True
  joins_job: bool = False  # joins a multi-process job (jax.distributed) before anything asks for devices
  hardware: str | None = None  # the platform unless the user sets hardware= (None: the config's own default)
  compiles_for: CompileTarget = "local"
  takes_lease: bool = False  # holds the run directory's lease (process 0) until the with-block ends
  stack_traces: bool = False  # dumps Python stacks when collect_stack_trace asks (cloud-tpu-diagnostics)


class ModelKeys(Protocol):
  """A tool's own layer of model keys below the user's arguments (an HF config.json, a
  checkpoint's saved keys), and its check of the config built with them."""

  def values(self, overrides: config_lib.Overrides) -> tuple[Mapping[str, Any], str]:
    """The values, typed like base.yml, and where they come from (named in errors)."""
    ...

  def check(self, config: config_lib.Config) -> None:
    ...


@dataclasses.dataclass
class Started:
  """What start-up gives a tool. A tool that takes the lease uses it as a context manager: the
  lease is given back when the block ends; one that holds nothing may leave the block out."""

  tool: Tool
  held: contextlib.ExitStack = dataclasses.field(default_factory=contextlib.ExitStack)
  built_config: config_lib.Config | None = None
  read_overrides: config_lib.Overrides | None = None
  topology: accelerators.TpuTopology | None = None  # a slice to compile for; None: the local devices
  num_slices: int = 1
  devices: tuple[jax.Device, ...] = ()  # what a compile targets (none for slice figures)
  lease: run_lease.Lease | None = None

  @property
  def config(self) -> config_lib.Config:
    if self.built_config is None:
      raise ValueError(f"{self.tool.name} builds no config")
    return self.built_config

  @property
  def overrides(self) -> config_lib.Overrides:
    if self.read_overrides is None:
      raise ValueError(f"{self.tool.name} reads no config overrides")
    return self.read_overrides

  def __enter__(self) -> Started:
    return self

  def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
               tb: types.TracebackType | None) -> None:
    self.held.close()


def start(tool: Tool, argv: Sequence[str], *, paths: Mapping[str, str] | None = None,
          check_paths: Callable[[], None] | None = None, model_keys: ModelKeys | None = None) -> Started:
  """The whole start-up of `tool`. `paths`: a tool's own path arguments ({"key": path}), whose
  buckets must answer too; `check_paths`: the tool's checks of them, once they answer and before
  the backend starts; `model_keys`: the tool's own model-key layer (the converters)."""
  prepare_process()
  if not tool.builds_config:
    return Started(tool)
  overrides = read_overrides(list(argv), paths)
  if check_paths is not None:
    check_paths()
  topology, num_slices = _compile_topology(tool, overrides)
  start_backend(overrides, "cpu" if topology else _hardware(tool, overrides))  # a slice compile needs no accelerator
  if tool.compiles_for == "slice or local" and topology is None and num_slices != 1:
    raise ConfigError("compile_topology_num_slices applies to a TPU compile_topology, not to local")
  devices: tuple[jax.Device, ...] = ()
  if tool.compiles_for == "slice or local":
    devices = tuple(describe_topology(topology, num_slices) if topology else jax.devices())
  if tool.joins_job:
    distributed.initialize(accelerators.requested_platform(), int(overrides.peek("distributed_init_timeout_seconds")),
                           int(overrides.peek("distributed_heartbeat_timeout_seconds")))
  target = topology.target(num_slices) if topology else accelerators.local_target()
  if model_keys is not None:
    values, source = model_keys.values(overrides)
    overrides = overrides.below_argv(values, source)
  # A compile writes nothing under a run directory; a fixed name satisfies the multi-host rule
  # that every process of a real run must be given the same run_name.
  config = config_lib.build_config(overrides, target, tool.reads_run,
                                   default_run_name=None if tool.compiles_for == "local" else tool.name,
                                   reads_data=tool.reads_data)
  if model_keys is not None:
    model_keys.check(config)
  if tool.joins_job:  # the local tier's directory is each host's own disk (elastic gives each its own)
    distributed.check_same_config(config.values, per_host=("local_checkpoint_directory",),
                                  timeout_s=int(overrides.peek("distributed_init_timeout_seconds")))
  started = Started(tool, built_config=config, read_overrides=overrides, topology=topology, num_slices=num_slices,
                    devices=devices)
  with contextlib.ExitStack() as held:
    run = config.run
    if tool.stack_traces:
      held.enter_context(distributed.stack_traces(run.collect_stack_trace, run.stack_trace_to_cloud,
                                                  run.stack_trace_interval_seconds))
    if tool.takes_lease:
      started.lease = distributed.on_process_0("taking the run directory's lease", lambda: run_lease.acquire(
          run.run_dir, run.run_name, run.run_lease_timeout_seconds, config.target.num_processes))
      if started.lease is not None:
        held.callback(started.lease.release)
    started.held = held.pop_all()
  return started


def config_main(tool: Tool, run: Callable[[config_lib.Config], object]) -> Callable[[list[str]], int]:
  """The `main` of an entry point whose whole work is `run(config)` once `tool` has started up."""
  def main(argv: list[str]) -> int:
    run(start(tool, argv).config)
    return 0
  return main


def read_overrides(argv: list[str], extra_paths: Mapping[str, str] | None = None) -> config_lib.Overrides:
  """The user's layers (YAML, env, argv), every key checked, and every gs:// bucket a path key
  (or a tool's own path argument in `extra_paths`) names reachable, before any backend starts or
  anything compiles."""
  overrides = config_lib.parse_overrides(argv)
  paths = {key: str(overrides.peek(key)) for key in config_lib.PATH_KEYS}
  if overrides.peek("dataset_type") == "synthetic":  # only tfds reads it; upstream's synthetic recipes name a bucket
    paths.pop("dataset_path")
  storage_retry.configure(float(overrides.peek("storage_retry_seconds")))
  storage.check_buckets({**paths, **(extra_paths or {})}, float(overrides.peek("storage_timeout_seconds")))
  return overrides


def start_backend(overrides: config_lib.Overrides, hardware: str | None = None) -> None:
  """Selects the JAX platform (`hardware=` unless the caller decides) and exports the flags."""
  accelerators.select_jax_platforms(hardware or str(overrides.peek("hardware")))
  xla_flags.export_flags(str(overrides.peek("libtpu_init_args")), str(overrides.peek("xla_flags")))


def _hardware(tool: Tool, overrides: config_lib.Overrides) -> str | None:
  """The tool's own platform unless the user set hardware= (on the command line, in M_*, or in
  their YAML); None: the config's value."""
  given = "hardware" in overrides.explicit_keys() or "hardware" in overrides.file_values
  return None if given else tool.hardware


def _compile_topology(tool: Tool, overrides: config_lib.Overrides) -> tuple[accelerators.TpuTopology | None, int]:
  """The TPU slice a compiling tool targets (None: the local devices) and how many of them."""
  if tool.compiles_for == "local":
    return None, 1
  name = str(overrides.peek("compile_topology")).strip()
  local = name.lower() == "local"  # any case, as a slice type's name (V6E-8) is read
  num_slices = int(overrides.peek("compile_topology_num_slices"))
  if tool.compiles_for == "slice figures" and (not name or local):
    raise ConfigError(f"{tool.name} needs compile_topology=NAME, a TPU slice type (e.g. v5e-256)")
  if not name:
    raise ConfigError(f"{tool.name} needs compile_topology=NAME (e.g. v5e-256), or compile_topology=local "
                      "for this machine's devices")
  if num_slices < 1:
    raise ConfigError(f"compile_topology_num_slices must be >= 1, got {num_slices}")
  if local:
    return None, num_slices
  try:
    return accelerators.tpu_topology(name), num_slices
  except ConfigError as e:
    if tool.compiles_for == "slice figures":
      raise
    raise ConfigError(f"{e}; or local, for this machine's devices") from None


def describe_topology(topology: accelerators.TpuTopology, num_slices: int) -> Sequence[jax.Device]:
  """Compile-only devices of `num_slices` slices of `topology`, described by libtpu."""
  accelerator_type = None
  if not accelerators.has_tpu():
    # Off a TPU VM libtpu cannot discover its workers and logs a multi-line error about it;
    # naming this host as the only worker silences that without changing the compile.
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # libtpu's lock file guards TPU chips; with none attached, several compiles may run at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # Loading, libtpu looks up the host's accelerator type and, finding none, prints "Failed to find host
    # bounds ... please set env var TPU_ACCELERATOR_TYPE" on stderr: a second line before every compile's
    # report and before its one `error:` line. The slice being described is the true answer. Only for this
    # call: has_tpu() reads the same variable, and no TPU is attached.
    accelerator_type = topology.name
  try:
    with _environ_set("TPU_ACCELERATOR_TYPE", accelerator_type):
      description = topologies.get_topology_desc(
          topology_name=topology.topology_name, platform="tpu", chip_config_name=topology.generation.chip_config,
          chips_per_host_bounds=topology.host_bounds, num_slices=num_slices, wrap=topology.wrap)
  except RuntimeError as e:  # a libtpu too old for the generation, or none (JaxRuntimeError is one)
    raise ConfigError(accelerators.cannot_describe_message(topology, str(e))) from None
  devices: Sequence[jax.Device] = description.devices
  return devices


@contextlib.contextmanager
def _environ_set(name: str, value: str | None) -> Iterator[None]:
  """os.environ[name] = value inside the block (None: unchanged), as it was after."""
  before = os.environ.get(name)
  if value is not None:
    os.environ[name] = value
  try:
    yield
  finally:
    if value is not None:
      if before is None:
        os.environ.pop(name, None)
      else:
        os.environ[name] = before


# ------------------------------------------------------------------ the process, before anything else


def prepare_process() -> None:
  """What every entry point's process needs before it reads anything (each step is idempotent)."""
  # A process started in the background by a non-interactive shell inherits SIGINT as ignored,
  # and Python then never raises KeyboardInterrupt: Ctrl-C / SIGINT would be lost on the way
  # to the clean stop (and the checkpoint) the entry points promise.
  if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
  cloud_env.configure_cloud_env()  # before any library opens a gs:// path
  _one_line_library_logs()
  _filter_background_noise()


class _FirstLineOnly(logging.Filter):
  """Library log records (Orbax logs through absl) reach the console as their first line,
  without the traceback: the run's own `error:` line says what failed and what to do."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.exc_info or record.exc_text:
      record.exc_info, record.exc_text = None, None
    message = record.getMessage().strip().splitlines()
    record.msg, record.args = (message[0] if message else ""), None
    return True


class _NoAbandonedFutures(logging.Filter):
  """asyncio's "exception was never retrieved" records: reads a failed restore abandoned (see
  _is_abandoned_async_work); the restore's own line reports the failure."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "exception was never retrieved" not in str(record.msg)


def _one_line_library_logs() -> None:
  logger = logging.getLogger("absl")
  if not any(isinstance(f, _FirstLineOnly) for f in logger.filters):
    logger.addFilter(_FirstLineOnly())
  # gcsfs logs each request it gave up on, with a traceback; storage_retry retries or reports it.
  logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
  asyncio_logger = logging.getLogger("asyncio")
  if not any(isinstance(f, _NoAbandonedFutures) for f in asyncio_logger.filters):
    asyncio_logger.addFilter(_NoAbandonedFutures())


def _is_abandoned_async_work(exc: BaseException | None, obj: object = None) -> bool:
  """Noise of a failed checkpoint read: once its restore gave up, TensorStore's threads still
  call back into the closed asyncio loop, and Orbax's pending read coroutines are collected
  with their errors. The restore's own warning or error line already said what failed."""
  if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
    return True
  code = getattr(obj, "cr_code", None)
  return code is not None and ("orbax" in code.co_filename or "tensorstore" in code.co_filename)


def _filter_background_noise() -> None:
  """Drops `_is_abandoned_async_work` tracebacks from the terminal; every other uncaught or
  unraisable error is printed as before."""
  if getattr(sys.excepthook, "_maxtext_filter", False):
    return
  previous_excepthook, previous_unraisable = sys.excepthook, sys.unraisablehook

  def excepthook(kind: type[BaseException], value: BaseException, tb: types.TracebackType | None) -> None:
    if not _is_abandoned_async_work(value):
      previous_excepthook(kind, value, tb)

  def unraisablehook(unraisable: sys.UnraisableHookArgs) -> None:
    if not _is_abandoned_async_work(unraisable.exc_value, unraisable.object):
      previous_unraisable(unraisable)

  excepthook._maxtext_filter = True  # type: ignore[attr-defined]
  sys.excepthook, sys.unraisablehook = excepthook, unraisablehook
