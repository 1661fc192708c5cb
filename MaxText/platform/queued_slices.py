"""Elastic training on queued resources: the slices are asked for as multihost_job asks for them, and a
slice that is lost for good is replaced by a queued resource of its own.

The first request is one queued resource PREFIX for every slice (nodes PREFIX-0 .. PREFIX-(N-1)).
A slice whose node is gone (PREEMPTED, TERMINATED, or no longer listed) is replaced by the queued
resource PREFIX-<slice>-r<k> with one node of that name; once the node is READY, `prepare` readies
it (the code copied, the setup run) and the slice is up again, so the supervisor grows the job
back at the next step boundary. A node that repairs itself (REPAIRING, then READY) comes back as
it is. While nodes are awaited, the queued resource's own state is read too: one that FAILED, was
SUSPENDED or is no longer listed (deleted) will bring none, so the first request stops with one line,
and a replacement is asked for again under a new name while the job goes on. The job's processes run
as on TPU VMs: `QueuedResourceLauncher` wraps the TPU VM launcher, whose slice names it updates when a
replacement takes a slice's place.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable, Mapping, Protocol, Sequence

from MaxText.errors import UserError
from MaxText.platform import tpu_launch
from MaxText.platform.generations import Generation
from MaxText.platform.tpu_launch import Gcloud

GONE = frozenset({"PREEMPTED", "TERMINATED", "NOT_FOUND"})  # a node that will not come back by itself
# A queued resource's states (`state.state` of `gcloud alpha compute tpus queued-resources describe`, the TPU
# API's QueuedResourceState: CREATING, ACCEPTED, PROVISIONING, WAITING_FOR_RESOURCES, ACTIVE, FAILED, SUSPENDING,
# SUSPENDED, DELETING) in which it brings no node any more.
ENDED = frozenset({"FAILED", "SUSPENDING", "SUSPENDED", "DELETING"})
# Looks in a row that must find a requested queued resource not listed before it counts as deleted (by hand, or
# by a cleanup script): its nodes went with it. More than one, as a list read right after the create may lag.
UNLISTED_LOOKS = 2


class QueuedResourceEnded(UserError):
  """The first request's queued resource FAILED or was SUSPENDED: its slices will not come."""


class NamedLauncher(Protocol):
  """A launcher whose slice i runs on the TPU named names[i] (multihost_runner.TpuVmLauncher)."""

  names: list[str]

  def start(self, slices: Sequence[int], overrides: Sequence[str], env: Mapping[str, str]) -> Generation:
    ...


class QueuedSlices:
  def __init__(self, gcloud: Gcloud, prefix: str, num_slices: int, tpu_type: str, version: str,
               extra_args: Sequence[str], prepare: Callable[[str], None],
               log: Callable[[str], None] | None = None):
    self.gcloud, self.prefix, self.num_slices = gcloud, prefix, num_slices
    self.tpu_type, self.version, self.extra_args = tpu_type, version, list(extra_args)
    self.prepare = prepare
    self.log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    self.names = tpu_launch.slice_names(prefix, num_slices)
    self.requested = [prefix]  # every queued resource this run asked for (each is billed until deleted)
    self.replacing: dict[int, str] = {}  # slice -> its replacement's name while it is not READY
    self.asked = False  # whether the first request went through (from then on it is billed)
    self._unlisted: dict[str, int] = {}  # queued resource -> looks in a row that did not find it

  def request(self, name: str, num_slices: int) -> list[str]:
    return tpu_launch.queued_resource_create(self.gcloud, name, self.tpu_type, self.version, num_slices,
                                             self.extra_args)

  def state(self, name: str) -> str:
    """The node's state, NOT_FOUND when it is not listed."""
    described = self._describe(self.gcloud.command("compute", "tpus", "tpu-vm", "describe", name, "--format=json"),
                               f"describing TPU '{name}'")
    return described if isinstance(described, str) else str(described.get("state", "UNKNOWN"))

  def queued_state(self, name: str) -> tuple[str, str]:
    """The queued resource's own state (its `state.state`; NOT_FOUND when it is not listed, UNKNOWN when the look
    failed) and, when it failed, the error's message (`state.failedData.error.message`, "" without one)."""
    described = self._describe(self.gcloud.command(*tpu_launch.QUEUED_RESOURCES, "describe", name, "--format=json"),
                               f"describing queued resource '{name}'")
    if isinstance(described, str):
      return described, ""
    state = described.get("state")
    if isinstance(state, str):  # not the API's shape, but plain enough to read
      return state, ""
    if not isinstance(state, dict):
      return "UNKNOWN", ""
    failed = state.get("failedData")
    error = failed.get("error") if isinstance(failed, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return str(state.get("state", "UNKNOWN")), message if isinstance(message, str) else ""

  def _ended(self, name: str) -> tuple[str, str] | None:
    """(state, message) when requested queued resource `name` brings no node any more: ENDED, or not listed
    for UNLISTED_LOOKS looks in a row (deleted); None while it may still bring its nodes."""
    queued, message = self.queued_state(name)
    self._unlisted[name] = self._unlisted.get(name, 0) + 1 if queued == "NOT_FOUND" else 0
    if queued in ENDED:
      return queued, message
    if self._unlisted[name] >= UNLISTED_LOOKS:
      return "no longer listed (deleted)", ""
    return None

  def _describe(self, argv: list[str], what: str) -> dict[str, Any] | str:
    """gcloud's JSON description, or NOT_FOUND (not listed) or UNKNOWN (the look failed: down until the next)."""
    try:
      described = json.loads(self.gcloud.read(argv, what))
      return described if isinstance(described, dict) else "UNKNOWN"
    except UserError as e:
      if "on PATH" in str(e):  # no gcloud at all
        raise
      if "NOT_FOUND" in str(e) or "was not found" in str(e):
        return "NOT_FOUND"
      self.log(f"warning: {e}")
      return "UNKNOWN"  # a failed look is not a lost slice: down until the next look
    except json.JSONDecodeError:
      return "UNKNOWN"

  def _create(self, name: str, num_slices: int, what: str) -> None:
    """Asks for queued resource `name`; one that exists already (this command run before, or a request
    whose answer was lost) is taken as it is."""
    try:
      self.gcloud.act(self.request(name, num_slices), what)
    except UserError as e:
      if "ALREADY_EXISTS" not in str(e) and "already exists" not in str(e):
        raise
      self.log(f"elastic: queued resource {name} exists already; using it")

  def request_all(self, poll_s: float = 30.0) -> None:
    """Asks for every slice and waits until all are READY, then readies each."""
    self._create(self.prefix, self.num_slices, "creating the queued resource")
    self.asked = True
    self.log(f"elastic: queued resource {self.prefix} requested ({self.num_slices} x {self.tpu_type}); waiting for "
             "its slices")
    last = 0.0
    while (states := [self.state(n) for n in self.names]) != ["READY"] * self.num_slices:
      ended = self._ended(self.prefix)
      if ended is not None:
        queued, message = ended
        advice = "run again" if queued.startswith("no longer") else \
            f"delete it with `{self.delete_command(self.prefix)}`, then run again"
        raise QueuedResourceEnded(f"queued resource {self.prefix} is {queued}{f' ({message})' if message else ''}, so "
                                  f"its slices will not come; {advice}")
      if time.monotonic() - last > 60:
        last = time.monotonic()
        self.log("elastic: waiting for " + ", ".join(f"{n} ({s})" for n, s in zip(self.names, states) if s != "READY"))
      time.sleep(poll_s)
    for name in self.names:
      self.prepare(name)

  def available(self) -> set[int]:
    up = set()
    for s, name in enumerate(self.names):
      replacement = self.replacing.get(s)
      if replacement is not None and self.state(replacement) != "READY":
        ended = self._ended(replacement)
        if ended is not None:  # it will bring no node: another one is asked for at the next look
          queued, message = ended
          del self.replacing[s]
          delete = "" if queued.startswith("no longer") else f" (delete it with `{self.delete_command(replacement)}`)"
          self.log(f"warning: queued resource {replacement}, slice {s}'s replacement, is {queued}"
                   f"{f' ({message})' if message else ''}; asking for another at the next look{delete}")
          continue
      elif replacement is not None:
        try:
          self.prepare(replacement)
        except UserError as e:
          self.log(f"warning: readying {replacement} failed, trying again at the next look: {e}")
          continue
        self.names[s] = replacement
        del self.replacing[s]
        self.log(f"elastic: slice {s} runs on {replacement} from now on")
        name = replacement
      state = self.state(name)
      if state == "READY":
        up.add(s)
      elif state in GONE and s not in self.replacing:
        self._replace(s, name, state)
    return up

  def _replace(self, s: int, name: str, state: str) -> None:
    replacement = f"{self.prefix}-{s}-r{len(self.requested)}"
    try:
      self._create(replacement, 1, f"creating the replacement queued resource {replacement}")
    except UserError as e:  # no quota now, say: the job goes on on the survivors meanwhile
      if "on PATH" in str(e):
        raise
      self.log(f"warning: {e}; asking again at the next look")
      return
    self.requested.append(replacement)
    self.replacing[s] = replacement
    self.log(f"elastic: slice {s}'s node {name} is {state}: queued resource {replacement} requested to replace it")

  def delete_commands(self) -> list[str]:
    """What deletes every queued resource this run asked for (they are billed until then)."""
    return [self.delete_command(name) for name in self.requested]

  def delete_command(self, name: str) -> str:
    return tpu_launch.quote(self.gcloud.command(*tpu_launch.QUEUED_RESOURCES, "delete", name, "--force", "--async"))


class QueuedResourceLauncher:
  """The TPU VM launcher on slices that queued resources bring (and bring back)."""

  def __init__(self, inner: NamedLauncher, slices: QueuedSlices):
    self.inner, self.slices = inner, slices

  def start(self, slices: Sequence[int], overrides: Sequence[str], env: Mapping[str, str]) -> Generation:
    self.inner.names[:] = self.slices.names
    return self.inner.start(slices, overrides, env)

  def available(self) -> set[int]:
    return self.slices.available()

  def mark_lost(self, slice_id: int) -> None:
    pass  # its node's state says whether it comes back or is replaced
