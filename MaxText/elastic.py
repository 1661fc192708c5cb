"""Elastic training's supervisor: keeps a multi-slice run going when a slice is lost, and grows it
back when the slice returns.

JAX's multi-controller runtime cannot drop a process from a running computation, so elasticity
lives outside it: this supervisor starts the job's processes (one generation), watches them, and
when a process dies stops the rest (a survivor blocked in a collective with the dead one is ended
by JAX's heartbeat abort or the hang watchdog, else by SIGTERM and then SIGKILL), and relaunches
the same command on the surviving slices with the overrides of `elastic_config.resize`: fewer
slices, the same global batch through more gradient accumulation. The relaunched run resumes
from its newest checkpoint, so its data position is the checkpoint's. When a lost slice is up
again the supervisor sends SIGTERM (the run saves at the next step boundary, to its local tier
when it has one, and exits) and relaunches on all slices. Processes that all stop at a SIGTERM it did
not send (a preemption's) are relaunched on the slices up. Every resize is one line and one record
of `<run_dir>/elastic.jsonl`: cause, slices before and after, the step reached, the step resumed from, seconds to resume.

Launchers: platform/loopback_launch.py's `LoopbackLauncher` (CPU processes on 127.0.0.1 joined by
jax.distributed, each slice a group of processes; a slice is "down" while its marker file exists),
multihost_runner's `TpuVmLauncher` (its slices over ssh; a slice is up while its TPU is READY; with `version=` the
slices come from queued resources, platform/queued_slices.py) and platform/gke_launch.py's
`GkeLauncher` (a JobSet per generation on a GKE cluster's node pools). See
getting_started/Fault_tolerance.md, "Elastic training". The command line (`main`) takes the run's
own arguments and builds the layout from its config:

  python3 -m MaxText.elastic configs/base.yml run_name=r num_slices=4 elastic_min_slices=1 \
      devices_per_process=2                                    # CPU processes on this machine
  python3 -m MaxText.elastic configs/base.yml run_name=r num_slices=2 elastic_min_slices=1 \
      tpu_prefix=my-v5e tpu_type=v5litepod-16                 # TPU VMs, as multihost_runner names them
  ... tpu_prefix=r tpu_type=v5litepod-16 version=v2-alpha-tpuv5-lite   # slices from queued resources
  ... cluster=my-cluster tpu_type=v5litepod-16 docker_image=IMAGE      # GKE (XPK's node pools)

No JAX backend here: the supervisor only builds the config (for the layout) and starts processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import re
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

from MaxText import multihost_runner, startup
from MaxText.configuration import config as config_lib, elastic_config, tool_args
from MaxText.configuration.elastic_config import SliceLayout
from MaxText.errors import UserError, run_cli
from MaxText.paths import storage
from MaxText.platform import accelerators, gke_launch, tpu_launch
from MaxText.platform.accelerators import DeviceTarget
from MaxText.platform.loopback_launch import LoopbackLauncher, loopback_env
from MaxText.platform.run_progress import MetricsReader, checkpoint_step
from MaxText.platform.generations import PEER_FAILURES, SIGTERM_EXIT, Generation, Launcher
from MaxText.platform.queued_slices import QueuedResourceEnded, QueuedResourceLauncher, QueuedSlices
from MaxText.platform.tpu_launch import Gcloud
from MaxText.run_dir.preemption import GROW_BACK_MARKER

EVENTS_FILE = "elastic.jsonl"


@dataclasses.dataclass
class Resize:
  """One record of elastic.jsonl."""

  cause: str
  from_slices: int
  to_slices: int
  step_reached: int  # the newest step the run had logged when it stopped
  resumed_from: int  # the checkpoint step the relaunched run starts after (0: the beginning)
  detected: float  # unix time the supervisor saw the cause
  seconds_to_resume: float | None = None  # until the relaunched run logged a step past resumed_from
  resumed_source: str = ""  # the run's own word for it: the persistent or the local tier, or the seed

  def line(self) -> str:
    if self.seconds_to_resume is None:  # where the relaunched run resumes from is known once it says
      return (f"elastic: {self.cause}: {self.from_slices} -> {self.to_slices} slice(s) at step {self.step_reached}; "
              "relaunching")
    resumed = f"{self.seconds_to_resume:.1f} s"
    source = f" of {self.resumed_source}" if self.resumed_source else ""
    return (f"elastic: {self.cause}: {self.from_slices} -> {self.to_slices} slice(s) at step {self.step_reached}, "
            f"resumed from step {self.resumed_from}{source} ({self.step_reached - self.resumed_from} step(s) redone), "
            f"{resumed} to resume")


class Supervisor:
  def __init__(self, layout: SliceLayout, launcher: Launcher, run_dir: str | Path, *, poll_s: float = 0.5,
               stop_grace_s: float = 60.0, log: Callable[[str], None] | None = None):
    """`run_dir`: the run's folder, local or gs:// (there the run's metrics reach it every upload)."""
    self.layout, self.launcher, self.run_dir = layout, launcher, str(run_dir)
    self.poll_s, self.stop_grace_s = poll_s, stop_grace_s
    self.log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    self.resizes: list[Resize] = []
    self.lost: set[int] = set()  # slices whose process died, until they are up again
    self.current: Generation | None = None
    self.metrics = MetricsReader(self.run_dir)  # polled for the whole run: read a piece at a time

  def interrupt(self) -> None:
    """Ends the running generation (Ctrl-C, the scheduler's SIGTERM): the run saves at its step boundary.
    A second Ctrl-C or SIGTERM meanwhile is answered with a line, not obeyed: leaving now would leave
    the processes saving unsupervised (the stop is bounded: SIGKILL after the grace)."""
    if self.current is not None and self.current.running():
      with self._interrupts_answered():
        self._stop(self.current)

  @contextlib.contextmanager
  def _interrupts_answered(self) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():  # only the main thread handles signals
      yield
      return

    def again(signum: int, frame: object) -> None:
      self.log(f"elastic: already stopping: the running generation saves at its step boundary (SIGKILL after "
               f"{self.stop_grace_s:.0f} s at most)")

    previous = {s: signal.signal(s, again) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
      yield
    finally:
      for signum, handler in previous.items():
        signal.signal(signum, handler)

  def run(self) -> int:
    """Runs the job to its end; returns its exit status (0: finished)."""
    try:
      return self._run()
    except Exception:
      # The supervisor cannot go on (a launcher's failed call, a bug): its processes must not train on
      # unsupervised, so they are stopped at a step boundary, which saves, before the error is shown.
      if self.current is not None:
        try:
          if self.current.running():
            self.log("elastic: the supervisor stops on the error below; stopping the running generation first "
                     "(it saves at its step boundary)")
            self._stop(self.current)
        except Exception as e:  # noqa: BLE001 - the original error is the one to show
          self.log(f"warning: stopping the running generation failed too: {type(e).__name__}: {e}")
      raise

  def _run(self) -> int:
    slices = self._usable(self.launcher.available(), "at the start")
    pending: Resize | None = None
    began = time.time()
    for number in itertools.count(1):
      overrides = elastic_config.resize(self.layout, len(slices)).overrides()
      self.log(f"elastic: starting on slice(s) {', '.join(map(str, slices))}: {' '.join(overrides)}")
      launched = time.time()
      stale = self.metrics.snapshot()  # the previous generation has ended: a change is the new one's
      storage.remove_tree(storage.join(self.run_dir, GROW_BACK_MARKER))  # a grow-back stop's, for its generation only
      # A relaunch tells the run when its resize began: its goodput counts the time since as the resize's.
      env = {elastic_config.RESIZE_ENV: repr(pending.detected)} if pending is not None else {}
      generation = self.current = self.launcher.start(slices, overrides, env)
      outcome = self._watch(generation, slices, pending, stale)
      if pending is not None and pending.seconds_to_resume is None:  # ended (or lost) before a new step
        self.log(f"elastic: the generation after '{pending.cause}' ended before its first new step")
        self._record(dataclasses.asdict(pending))
      pending = None
      # Each generation's wall time, which goodput.json misses for a start killed between its writes.
      self._record({"generation": number, "slices": slices, "launched": launched, "ended": time.time(),
                    "exit": outcome if isinstance(outcome, int) else outcome[0]})
      if isinstance(outcome, int):
        self.log(self.summary(number, time.time() - began))
        return outcome
      cause, up, detected = outcome
      new = self._usable(up, f"after {cause}")
      pending = Resize(cause, len(slices), len(new), self.metrics.step(), checkpoint_step(self.run_dir),
                       detected)
      self.resizes.append(pending)
      self.log(pending.line())
      slices = new
    raise AssertionError("unreachable")

  def summary(self, generations: int, wall_s: float) -> str:
    resumed = [r.seconds_to_resume for r in self.resizes if r.seconds_to_resume is not None]
    redone = sum(max(0, r.step_reached - r.resumed_from) for r in self.resizes)
    return (f"elastic: {generations} generation(s), {len(self.resizes)} resize(s) in {wall_s:.0f} s; "
            f"{sum(resumed):.0f} s from the resizes' causes to the resumed runs, {redone} step(s) redone")

  def _usable(self, up: set[int], when: str) -> list[int]:
    count = elastic_config.usable_slices(self.layout, len(up))
    if count is None:
      # Loopback slices are down while a file says so, which outlives this supervisor: name it.
      markers: list[Path] = getattr(self.launcher, "down_markers", list)()
      back = (f"delete {', '.join(map(str, markers))} to bring the slices back, then relaunch" if markers
              else "relaunch when the slices are back")
      raise UserError(f"elastic: {len(up)} slice(s) up {when}, fewer than elastic_min_slices="
                      f"{self.layout.min_slices} can carry the global batch of {self.layout.global_batch_size}; "
                      f"the run stops (its checkpoints are kept: {back})")
    return sorted(up)[:count]

  def _watch(self, generation: Generation, slices: list[int], pending: Resize | None, stale: str
             ) -> int | tuple[str, set[int], float]:
    """Until the generation ends: its exit status, or (cause, the slices up, when the cause was seen) for a
    resize. The generation is stopped before this returns."""
    sigterm_seen: float | None = None  # when a process first exited at a SIGTERM while others ran on
    while True:
      time.sleep(self.poll_s)
      said = generation.resumed_from() if pending is not None else None
      if pending is not None and said is not None:  # newer than the persistent tier's when the local tier had it
        pending.resumed_from, pending.resumed_source = said
      if pending is not None and pending.seconds_to_resume is None and \
          self.metrics.step(stale) > pending.resumed_from:
        pending.seconds_to_resume = time.time() - pending.detected
        self.log(pending.line())
        self._record(dataclasses.asdict(pending))
      exits = generation.exits()
      failed = [e for e in exits if e.code not in (0, SIGTERM_EXIT)]
      if failed:
        seen = time.time()
        culprit = next((e for e in failed if e.code not in PEER_FAILURES), failed[0])
        self._stop(generation)
        if not culprit.infrastructure:
          self.log(f"elastic: {culprit.describe()}: the run's own error, not a lost slice; stopping")
          return culprit.code
        self.launcher.mark_lost(culprit.slice_id)
        self.lost.add(culprit.slice_id)
        return culprit.describe(), self.launcher.available(), seen
      stopped = [e for e in exits if e.code == SIGTERM_EXIT]
      if stopped and generation.running():
        # A preemption's SIGTERM reaches every process (JAX's preemption sync stops them at one step); one
        # that alone stopped at a SIGTERM while the others ran on for the whole grace had its host preempted
        # by itself (before the sync was set up, say), and its peers would wait for it in their next collective.
        sigterm_seen = sigterm_seen or time.time()
        if time.time() - sigterm_seen > self.stop_grace_s:
          self._stop(generation)
          culprit = stopped[0]
          self.launcher.mark_lost(culprit.slice_id)
          self.lost.add(culprit.slice_id)
          return (f"{culprit.describe()} at a SIGTERM while the others ran on", self.launcher.available(),
                  sigterm_seen)
      if generation.running() == 0:
        if exits and all(e.code == SIGTERM_EXIT for e in exits):
          # Every process saved at a SIGTERM this supervisor did not send: a preemption's (JAX's
          # preemption sync makes all of them stop at the same step). The job goes on on the slices up.
          return ("the processes saved and stopped at a SIGTERM (a preemption)", self.launcher.available(),
                  time.time())
        return next((e.code for e in exits if e.code != 0), 0)
      up = self.launcher.available() if len(slices) < self.layout.num_slices else set(slices)
      if len(up) > len(slices):
        grown = elastic_config.usable_slices(self.layout, len(up))
        if grown is not None and grown > len(slices):
          returned = ", ".join(map(str, sorted(self.lost & up))) or ", ".join(map(str, sorted(up - set(slices))))
          self.lost -= up
          seen = time.time()
          self.log(f"elastic: slice(s) {returned} up again; stopping at the next step boundary to grow back")
          # The run then saves that step to its local tier only (when it has one): the processes that stay
          # hand it to the returning ones, so the slower persistent save of a preemption is skipped.
          storage.write_text(storage.join(self.run_dir, GROW_BACK_MARKER), f"{seen}\n")
          self._stop(generation, first=signal.SIGTERM)
          return f"slice(s) {returned} returned", up, seen

  def _stop(self, generation: Generation, first: int = signal.SIGTERM) -> None:
    """Ends every process: `first` (SIGTERM saves at the next step boundary), SIGKILL after the grace."""
    generation.signal_all(first)
    deadline = time.monotonic() + self.stop_grace_s
    while generation.running() and time.monotonic() < deadline:
      time.sleep(0.2)
    if generation.running():
      generation.signal_all(signal.SIGKILL)
      while generation.running():
        time.sleep(0.1)

  def _record(self, record: Mapping[str, object]) -> None:
    """One line of elastic.jsonl: a resize (it has a cause) or a generation's wall time."""
    path = storage.join(self.run_dir, EVENTS_FILE)
    line = json.dumps(record) + "\n"
    if storage.is_remote(path):  # objects cannot be appended to; the file stays small (a line per event)
      storage.write_text(path, (storage.read_text(path) if storage.exists(path) else "") + line)
      return
    with open(path, "a", encoding="utf-8") as f:
      f.write(line)


# ----------------------------------------------------------------------------------- command line
@dataclasses.dataclass
class ElasticArgs:
  """The supervisor's own key=value arguments; every other argument is the run's (MaxText.train's)."""

  processes_per_slice: int = 1  # CPU loopback: processes per slice on this machine
  devices_per_process: int = 1  # CPU loopback: simulated devices per process
  tpu_prefix: str = ""  # TPU VMs named as multihost_runner names them; empty: CPU loopback
  tpu_type: str = ""  # each slice's accelerator type, as multihost_job names it (v5litepod-16)
  project: str = ""
  zone: str = ""
  script_dir: str = ""  # copied to every worker once (default: the current directory)
  use_existing_folder: bool = False  # run in the workers' existing ~/RUN_NAME instead
  internal_ip: bool = False
  megascale_port: int = 8080
  log_dir: str = ""  # every process's log (and, on loopback, the slices' down markers)
  dry_run: bool = False  # print the slice counts, their overrides and the command; start nothing
  version: str = ""  # TPU VMs: ask for the slices as queued resource TPU_PREFIX with this runtime version
  cqr_extra_args: str = ""  # with version: more queued-resources create flags (--spot, --reserved)
  setup_command: str = "bash setup.sh"  # with version: runs once on every new slice after the code's copy
  cluster: str = ""  # GKE: the slices are the cluster's node pools CLUSTER-np-0.. (as XPK names them)
  docker_image: str = ""  # GKE: the image every pod runs, holding the code (XPK's --docker-image)


TOOL_KEYS = tuple(f.name for f in dataclasses.fields(ElasticArgs))
_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # a TPU VM's or a GKE cluster's name
_QUEUED_ONLY = ("version", "cqr_extra_args", "setup_command")
_TPU_ONLY = ("project", "zone", "script_dir", "use_existing_folder", "internal_ip", *_QUEUED_ONLY)
_GKE_ONLY = ("docker_image",)


def tpu_target(tpu_type: str, num_slices: int) -> DeviceTarget:
  """The devices of `num_slices` slices of gcloud's accelerator type `tpu_type`."""
  return _topology(tpu_type).target(num_slices)


def _topology(tpu_type: str) -> accelerators.TpuTopology:
  try:
    return accelerators.tpu_topology(re.sub(r"^v5litepod-", "v5e-", tpu_type))
  except UserError:
    raise UserError(f"tpu_type={tpu_type!r} is not a TPU type; give each slice's accelerator type as gcloud names "
                    "it, e.g. v5litepod-16, v6e-8, v5p-128, v4-16") from None


def plan_lines(layout: SliceLayout) -> list[str]:
  """The slice counts the run can continue on, each with the overrides it is relaunched with."""
  usable = [c for c in elastic_config.keeping_counts(layout) if c >= layout.min_slices][::-1]
  return [f"elastic: the global batch of {layout.global_batch_size} is kept on {', '.join(map(str, usable))} "
          f"slice(s) (elastic_min_slices={layout.min_slices}):",
          *(f"  {c} slice(s): {' '.join(elastic_config.resize(layout, c).overrides())}" for c in usable)]


def _check_keys(args: ElasticArgs, on_tpu: bool, on_gke: bool) -> None:
  """One line for a key that does not belong to the chosen launcher, or one it lacks."""
  def given(keys: Sequence[str]) -> list[str]:
    return [k for k in keys if getattr(args, k) != getattr(ElasticArgs(), k)]

  def apply(keys: list[str]) -> str:
    return f"{', '.join(keys)} {'apply' if len(keys) > 1 else 'applies'}"

  if on_tpu and on_gke:
    raise UserError("tpu_prefix (TPU VMs) and cluster (GKE) choose different launchers: give one of them")
  if not on_tpu and (misplaced := given(_TPU_ONLY)):
    raise UserError(f"{apply(misplaced)} to TPU VMs only: add tpu_prefix=NAME, or leave them out for CPU loopback")
  if not on_gke and (misplaced := given(_GKE_ONLY)):
    raise UserError(f"{apply(misplaced)} to GKE only: add cluster=NAME")
  if not args.version and (misplaced := given(_QUEUED_ONLY)):
    raise UserError(f"{apply(misplaced)} to queued resources only: add version=RUNTIME_VERSION")
  if args.version and args.use_existing_folder:
    raise UserError("use_existing_folder applies to existing slices: a queued resource's new slices get the code "
                    "copied (leave it out, or leave out version= to use slices that exist)")
  if (on_tpu or on_gke) and not args.tpu_type:
    raise UserError(f"{'tpu_prefix' if on_tpu else 'cluster'} needs tpu_type=TYPE (each slice's accelerator type, "
                    "e.g. v5litepod-16): the supervisor computes each slice count's batch settings from it")
  if not (on_tpu or on_gke) and args.tpu_type:
    raise UserError("tpu_type applies to TPU VMs and GKE only: add tpu_prefix=NAME or cluster=NAME")
  if on_gke and not args.docker_image:
    raise UserError("cluster needs docker_image=IMAGE: the image every pod runs, holding the code (see "
                    "getting_started/Run_on_GKE_XPK.md)")
  # They name TPUs, node pools and labels: gcloud and Kubernetes refuse other names, which a run would
  # only show as slices that never come up.
  for key, names in (("tpu_prefix", "TPU_PREFIX-0, TPU_PREFIX-1, ..."), ("cluster", "CLUSTER-np-0, CLUSTER-np-1, ...")):
    if getattr(args, key) and not _NAME.fullmatch(getattr(args, key)):
      raise UserError(f"{key}={getattr(args, key)!r} must be lower-case letters, digits and '-', starting with a "
                      f"letter and not ending with '-' (it names the slices: {names})")
  if (on_tpu or on_gke) and not 1 <= args.megascale_port <= 65535:
    raise UserError(f"megascale_port={args.megascale_port} is not a port: give one in 1..65535 (default 8080)")
  try:
    shlex.split(args.cqr_extra_args)
  except ValueError as e:
    raise UserError(f"cqr_extra_args={args.cqr_extra_args!r} cannot be split into flags ({e}): check its "
                    "quotes") from None


def _check_log_dir(log_dir: Path) -> None:
  """One line when log_dir cannot hold the processes' logs (a file, a folder this user cannot write)."""
  try:
    log_dir.mkdir(parents=True, exist_ok=True)
    probe = log_dir / f".elastic_probe_{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()
  except OSError as e:
    raise UserError(f"log_dir={log_dir} cannot hold the processes' logs ({e.strerror or e}): give log_dir= a "
                    "folder this machine can write") from None


def _gke_job(args: ElasticArgs, run_name: str, train: list[str]) -> gke_launch.GkeJob:
  topology = _topology(args.tpu_type)
  return gke_launch.GkeJob(args.cluster, run_name, args.docker_image, tuple(train), topology.hosts,
                           topology.chips_per_host, args.megascale_port)


def main(argv: list[str]) -> int:
  startup.start(startup.Tool("elastic", builds_config=False), argv)
  args, run_args = tool_args.parse_tool_record(ElasticArgs, argv[1:])
  on_tpu, on_gke = bool(args.tpu_prefix), bool(args.cluster)
  _check_keys(args, on_tpu, on_gke)
  overrides = config_lib.parse_overrides(run_args, environ={})
  if not overrides.peek("run_name"):
    raise UserError("set run_name=NAME: every generation of the job resumes the same run")
  num_slices = int(overrides.peek("num_slices"))
  if num_slices < 1:  # the default -1 (the devices' own count) means nothing before any slice is up
    raise UserError(f"python3 -m MaxText.elastic needs num_slices=N >= 1, the slices the run starts on (got "
                    f"num_slices={num_slices})")
  if on_tpu or on_gke:
    tpu_launch.check_run_name(str(overrides.peek("run_name")))  # it names the workers' folder, the JobSets
    target = tpu_target(args.tpu_type, num_slices)
  else:
    if min(args.processes_per_slice, args.devices_per_process) < 1:
      raise UserError("processes_per_slice and devices_per_process must be at least 1")
    processes = num_slices * args.processes_per_slice
    target = DeviceTarget(platform="cpu", device_kind="cpu", num_devices=processes * args.devices_per_process,
                          num_processes=processes, num_slices=num_slices)
  config = config_lib.build_config(overrides, target)
  min_slices = config.mesh.elastic_min_slices
  if min_slices < 1:
    raise UserError("python3 -m MaxText.elastic supervises an elastic run: set elastic_min_slices=N, the fewest "
                    f"slices it may continue on (1..num_slices={num_slices})")
  run_dir = config.run.run_dir
  layout = elastic_config.layout_of(config.mesh, target.num_devices, config.data.global_batch_size,
                                    config["gradient_accumulation_steps"], min_slices, config.data.batch_axes)
  run_name = str(config["run_name"])
  log_dir = Path(args.log_dir or Path(os.environ.get("TMPDIR", "/tmp"), "elastic", run_name))
  train = ["python3", "-m", "MaxText.train", *run_args]
  first = " ".join(elastic_config.resize(layout, num_slices).overrides())
  if args.dry_run:
    print("\n".join(plan_lines(layout)))
    if on_gke:
      job, name = _gke_job(args, run_name, train), f"{run_name}-g1"
      print(f"elastic: generation 1 is the JobSet {name} on the node pools {job.node_pool(0)} .. "
            f"{job.node_pool(num_slices - 1)}, created with `kubectl apply -f -` from:")
      overrides_1 = elastic_config.resize(layout, num_slices).overrides()
      print(gke_launch.manifest_text(job.manifest(name, list(range(num_slices)), overrides_1, {})), end="")
      return 0
    if args.version:
      gcloud = Gcloud(args.project or None, args.zone or None, dry_run=True)
      print("elastic: the slices are asked for with: " + tpu_launch.quote(tpu_launch.queued_resource_create(
          gcloud, args.tpu_prefix, args.tpu_type, args.version, num_slices, shlex.split(args.cqr_extra_args))))
    where = (f"every worker of {', '.join(tpu_launch.slice_names(args.tpu_prefix, num_slices))} in ~/{run_name}"
             if on_tpu else f"{target.num_processes} process(es) on 127.0.0.1, {args.devices_per_process} "
             "device(s) each")
    print(f"elastic: generation 1 runs on {where}: {tpu_launch.quote(train)} {first}")
    return 0
  if not on_gke:  # GKE's logs stay with its pods
    _check_log_dir(log_dir)
  storage.makedirs(run_dir)  # before anything billed is asked for
  launcher: Launcher
  poll_s, queued = 0.5, None
  if on_gke:
    gke = gke_launch.GkeLauncher(gke_launch.Kubectl(), _gke_job(args, run_name, train), num_slices)
    gke.check_cluster()
    launcher, poll_s = gke, 5.0  # each look is a kubectl call to the cluster's API server
  elif on_tpu:
    gcloud = Gcloud(args.project or None, args.zone or None, dry_run=False)
    names = tpu_launch.slice_names(args.tpu_prefix, num_slices)
    script_dir = Path(args.script_dir or os.getcwd())
    launcher = multihost_runner.TpuVmLauncher(gcloud, names, tpu_launch.quote(train), run_name, log_dir,
                                              args.internal_ip, args.megascale_port)
    if args.version:
      queued = QueuedSlices(gcloud, args.tpu_prefix, num_slices, args.tpu_type, args.version,
                            shlex.split(args.cqr_extra_args), lambda name: multihost_runner.copy_code(
                                gcloud, [name], script_dir, run_name, log_dir, args.internal_ip, args.setup_command))
      # The wait for capacity can be long: an interrupt or an error meanwhile still names what to delete.
      with multihost_runner.sigterm_as_interrupt():
        try:
          queued.request_all()
        except QueuedResourceEnded:
          raise  # its one line names the delete command
        except BaseException:
          if queued.asked:
            print(_delete_line(queued), file=sys.stderr, flush=True)
          raise
      launcher, poll_s = QueuedResourceLauncher(launcher, queued), 5.0  # each look describes every slice
    elif not args.use_existing_folder:
      multihost_runner.copy_code(gcloud, names, script_dir, run_name, log_dir, args.internal_ip)
  else:
    # Each process gets its own simulated device count; the user's other XLA flags stay.
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")).strip()
    launcher = LoopbackLauncher([sys.executable, *train[1:]], num_slices, args.processes_per_slice,
                                args.devices_per_process, log_dir, loopback_env({"XLA_FLAGS": flags} if flags else None),
                                log_dir)
  supervisor = Supervisor(layout, launcher, run_dir, poll_s=poll_s)
  supervisor.log(f"elastic: run {run_dir}, logs in {log_dir}")
  with multihost_runner.sigterm_as_interrupt():
    try:
      return supervisor.run()
    except KeyboardInterrupt:
      supervisor.interrupt()
      supervisor.log("elastic: interrupted; the running generation was stopped at a step boundary")
      return 130
    finally:
      if queued is not None:
        supervisor.log(_delete_line(queued))


def _delete_line(queued: QueuedSlices) -> str:
  return "elastic: the queued resources are billed until deleted: " + "; ".join(queued.delete_commands())


if __name__ == "__main__":
  run_cli(main)
