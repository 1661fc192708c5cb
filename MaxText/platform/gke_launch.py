"""Elastic training on GKE: each generation of the job is one JobSet, run through `kubectl`.

The slices are the cluster's TPU node pools as XPK names them (CLUSTER-np-0, CLUSTER-np-1, ...).
Generation G of run R is the JobSet R-gG with one replicated job per chosen slice (slice-<i>, an
Indexed Job of one pod per host, pinned to node pool i), so the supervisor chooses which slices
run. The chosen slices are renumbered 0.. for the multislice variables. JobSet and the Jobs never
retry (failurePolicy.maxRestarts 0, backoffLimit 0): the supervisor decides what a failure means
and relaunches with the resize's overrides.

A slice is up while its node pool has a ready, schedulable node for every host that carries no
taint the pods do not tolerate (GKE cordons and taints nodes under repair, maintenance or
preemption). A pod that fails, whose node is lost, or that stays unschedulable ends its process
as a lost one. Stopping a generation deletes its JobSet: Kubernetes sends SIGTERM (the run saves
at the step boundary), then SIGKILL after the pods' grace period. Every call goes through
`Kubectl`, so tests put a fake `kubectl` first on PATH (tests/fake_kubectl.py).
"""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import subprocess
import sys
import time
from typing import Any, Mapping, Sequence

import yaml

from MaxText.errors import UserError
from MaxText.platform.generations import LOST_EXIT, Exit
from MaxText.platform.tpu_launch import quote

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"  # JobSet's label on every pod it creates
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"  # an Indexed Job's pod: its host index
NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"
TPU_RESOURCE = "google.com/tpu"  # the chips a pod asks for; TPU nodes carry a taint of this key
SLICE_LABEL = "maxtext-elastic-slice"  # the supervisor's slice number on each pod
_RESUMED = re.compile(r"^state: resumed from step (\d+) of (.+)$", re.M)


@dataclasses.dataclass(frozen=True)
class Kubectl:
  """Runs kubectl against its current context (what `gcloud container clusters get-credentials` set)."""

  executable: str = "kubectl"
  retry_s: float = 2.0  # before a failed read is tried again

  def run(self, args: Sequence[str], what: str, stdin: str | None = None) -> str:
    argv = [self.executable, *args]
    try:
      done = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False, timeout=120)
    except FileNotFoundError:
      raise UserError(f"'{self.executable}' was not found on PATH: install kubectl (gcloud components install "
                      "kubectl) or use dry_run=true") from None
    except subprocess.TimeoutExpired:
      raise UserError(f"{what} did not finish within 120 s; command: {quote(argv)}") from None
    if done.returncode != 0:
      last = (done.stderr.strip().splitlines() or ["no error output"])[-1]
      raise UserError(f"{what} failed (exit {done.returncode}): {last}; command: {quote(argv)}")
    return done.stdout

  def json(self, args: Sequence[str], what: str, attempts: int = 3) -> Any:
    """A read: tried again after a failure (the API server restarting must not end the supervision)."""
    for attempt in range(attempts):
      try:
        return self._object(self.run([*args, "-o", "json"], what), what)
      except UserError as e:  # output cut short by a restarting API server is tried again too
        if "not found on PATH" in str(e) or attempt == attempts - 1:
          raise
        time.sleep(self.retry_s)
    raise AssertionError("unreachable")

  @staticmethod
  def _object(text: str, what: str) -> dict[str, Any]:
    try:
      read = json.loads(text)
    except json.JSONDecodeError as e:
      raise UserError(f"{what}: kubectl's output is not JSON ({e})") from None
    if not isinstance(read, dict):  # every `kubectl get -o json` prints an object
      raise UserError(f"{what}: kubectl's output is {type(read).__name__}, not a JSON object")
    return read

  def context(self, cluster: str) -> str:
    """The current context; none is one line naming the command that sets it."""
    try:
      return self.run(["config", "current-context"], "reading kubectl's current context").strip()
    except UserError as e:
      if "not found on PATH" in str(e):
        raise
      raise UserError(f"kubectl has no current cluster context: run gcloud container clusters get-credentials "
                      f"{cluster} --location=LOCATION --project=PROJECT first") from None


@dataclasses.dataclass(frozen=True)
class GkeJob:
  """What every generation's JobSet shares."""

  cluster: str
  run_name: str
  image: str
  command: tuple[str, ...]  # the run's command; each generation appends its overrides
  hosts_per_slice: int
  chips_per_host: int
  megascale_port: int = 8080
  grace_s: int = 300  # SIGTERM to SIGKILL: the run saves at its step boundary in between

  def node_pool(self, slice_id: int) -> str:
    return f"{self.cluster}-np-{slice_id}"

  def manifest(self, name: str, slices: Sequence[int], overrides: Sequence[str], env: Mapping[str, str]
               ) -> dict[str, Any]:
    """The JobSet `name` running the command on `slices` (renumbered 0.. for the multislice variables)."""
    coordinator = f"{name}-slice-{slices[0]}-0-0.{name}:{self.megascale_port}"  # JobSet's pod DNS names
    jobs = []
    for new, s in enumerate(slices):
      variables = dict(env)
      if len(slices) > 1:
        variables.update(MEGASCALE_COORDINATOR_ADDRESS=coordinator, MEGASCALE_PORT=str(self.megascale_port),
                         MEGASCALE_NUM_SLICES=str(len(slices)), MEGASCALE_SLICE_ID=str(new))
      pod = {"restartPolicy": "Never", "terminationGracePeriodSeconds": self.grace_s,
             "nodeSelector": {NODE_POOL_LABEL: self.node_pool(s)},
             "tolerations": [{"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
             "containers": [{"name": "maxtext", "image": self.image, "command": [*self.command, *overrides],
                             "env": [{"name": k, "value": v} for k, v in sorted(variables.items())],
                             "ports": [{"containerPort": self.megascale_port}],
                             "resources": {"limits": {TPU_RESOURCE: self.chips_per_host}}}]}
      jobs.append({"name": f"slice-{s}", "replicas": 1, "template": {"spec": {
          "completionMode": "Indexed", "completions": self.hosts_per_slice, "parallelism": self.hosts_per_slice,
          "backoffLimit": 0,
          "template": {"metadata": {"labels": {SLICE_LABEL: str(s)}}, "spec": pod}}}})
    return {"apiVersion": JOBSET_API, "kind": "JobSet",
            "metadata": {"name": name, "labels": {"maxtext-elastic-run": self.run_name}},
            "spec": {"failurePolicy": {"maxRestarts": 0}, "network": {"enableDNSHostnames": True},
                     "replicatedJobs": jobs}}


def manifest_text(manifest: Mapping[str, Any]) -> str:
  return yaml.safe_dump(dict(manifest), sort_keys=False, width=120)


def _taints_block(node: Mapping[str, Any]) -> bool:
  return any(t.get("effect") in ("NoSchedule", "NoExecute") and t.get("key") != TPU_RESOURCE
             for t in node.get("spec", {}).get("taints") or [])


def _ready(node: Mapping[str, Any]) -> bool:
  conditions = node.get("status", {}).get("conditions") or []
  return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def usable_nodes(nodes: Mapping[str, Any]) -> dict[str, int]:
  """Per node pool: its nodes that can take a pod now (ready, not cordoned, no blocking taint)."""
  count: dict[str, int] = {}
  for node in nodes.get("items") or []:
    pool = node.get("metadata", {}).get("labels", {}).get(NODE_POOL_LABEL)
    if pool is None:
      continue
    count.setdefault(pool, 0)
    if _ready(node) and not node.get("spec", {}).get("unschedulable") and not _taints_block(node):
      count[pool] += 1
  return count


class PodGeneration:
  """One JobSet's pods, as kubectl lists them."""

  def __init__(self, kubectl: Kubectl, name: str, slices: Sequence[int], hosts_per_slice: int,
               unschedulable_s: float):
    self.kubectl, self.name, self.hosts = kubectl, name, hosts_per_slice
    self.position = {s: new for new, s in enumerate(slices)}
    self.unschedulable_s = unschedulable_s
    self.ended: dict[int, Exit] = {}  # by process index
    self.seen: dict[int, str] = {}  # process index -> pod name, once listed
    self.pending_since: dict[int, float] = {}
    self.deleted = False
    self.resumed: tuple[int, str] | None = None

  def _pods(self) -> list[dict[str, Any]]:
    listed = self.kubectl.json(["get", "pods", "-l", f"{JOBSET_LABEL}={self.name}"], f"listing the pods of {self.name}")
    return list(listed.get("items") or [])

  def _identify(self, pod: Mapping[str, Any]) -> tuple[int, int]:
    metadata = pod.get("metadata", {})
    slice_id = int(metadata.get("labels", {}).get(SLICE_LABEL, -1))
    host = int(metadata.get("annotations", {}).get(INDEX_ANNOTATION, 0))
    return slice_id, self.position.get(slice_id, 0) * self.hosts + host

  def exits(self) -> list[Exit]:
    present = set()
    for pod in self._pods():
      slice_id, process = self._identify(pod)
      present.add(process)
      self.seen[process] = pod.get("metadata", {}).get("name", "")
      if process in self.ended:
        continue
      found = self._ended(pod, slice_id, process)
      if found is not None:
        self.ended[process] = found
    for process, pod_name in self.seen.items():  # a pod removed before it ended: its node went away
      if process not in present and process not in self.ended and not self.deleted:
        slice_id = next(s for s, new in self.position.items() if new == process // self.hosts)
        self.ended[process] = Exit(slice_id, process, LOST_EXIT, f"was removed with its pod {pod_name}")
    # A pod the platform removed may be a peer of the one that failed (its Job or JobSet ended it): the
    # supervisor names the first failure in this order its cause.
    return sorted(self.ended.values(), key=lambda e: (e.reason.startswith("was removed"), e.process))

  def _ended(self, pod: Mapping[str, Any], slice_id: int, process: int) -> Exit | None:
    status = pod.get("status", {})
    for container in status.get("containerStatuses") or []:
      terminated = container.get("state", {}).get("terminated")
      if terminated is not None:  # Kubernetes' word for it when it is more than the status (OOMKilled)
        code, why = int(terminated.get("exitCode", LOST_EXIT)), terminated.get("reason", "")
        return Exit(slice_id, process, code, f"exited with status {code} ({why})" if why not in ("", "Error",
                                                                                              "Completed") else "")
    if status.get("phase") == "Failed":  # no status of its own: evicted, or its node was lost
      return Exit(slice_id, process, LOST_EXIT, f"was lost with its pod ({status.get('reason', 'Failed')})")
    blocked = [c for c in status.get("conditions") or []
               if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable"]
    if not blocked:
      self.pending_since.pop(process, None)
      return None
    since = self.pending_since.setdefault(process, time.monotonic())
    if time.monotonic() - since < self.unschedulable_s:
      return None
    message = (blocked[0].get("message") or "").splitlines()[0:1]
    return Exit(slice_id, process, LOST_EXIT, f"could not be scheduled{': ' + message[0] if message else ''}")

  def running(self) -> int:
    if not self.deleted:
      return len(self.position) * self.hosts - len(self.exits())
    # Deleted: what is left are pods still shutting down (each leaves once its container ended).
    return sum(1 for pod in self._pods() if pod.get("status", {}).get("phase") in ("Pending", "Running")
               and not any("terminated" in c.get("state", {}) for c in pod["status"].get("containerStatuses") or []))

  def signal_all(self, signum: int) -> None:
    """SIGTERM: the JobSet's deletion (Kubernetes sends SIGTERM, SIGKILL after the grace); SIGKILL: the pods' too,
    at once."""
    try:
      if not self.deleted:
        self.kubectl.run(["delete", "jobset", self.name, "--wait=false"], f"deleting {self.name}")
      self.deleted = True
      if signum == signal.SIGKILL:
        self.kubectl.run(["delete", "pods", "-l", f"{JOBSET_LABEL}={self.name}", "--grace-period=0", "--force",
                          "--wait=false"], f"deleting the pods of {self.name}")
    except UserError as e:
      print(f"warning: {e}", file=sys.stderr, flush=True)

  def resumed_from(self) -> tuple[int, str] | None:
    """From the first process's `state:` line (train.py), read from its pod's log until it appears."""
    if self.resumed is not None:
      return self.resumed
    if 0 not in self.seen and not self.deleted:
      self.exits()  # lists the pods
    first = self.seen.get(0)
    if not first:
      return None
    try:
      text = self.kubectl.run(["logs", first, "--limit-bytes=1000000"], f"reading the log of {first}")
    except UserError:
      return None  # not started yet, or already gone
    if "state: initialised from seed" in text:
      self.resumed = (0, "a fresh start")
    elif found := _RESUMED.search(text):
      self.resumed = (int(found.group(1)), found.group(2))
    return self.resumed


class GkeLauncher:
  """The supervisor's launcher on GKE: one JobSet per generation, the node pools' state for which slices are up."""

  def __init__(self, kubectl: Kubectl, job: GkeJob, num_slices: int, unschedulable_s: float = 120.0):
    self.kubectl, self.job, self.num_slices = kubectl, job, num_slices
    self.unschedulable_s = unschedulable_s
    self.generations = 0

  def check_cluster(self) -> None:
    """One line when the cluster cannot hold the job: a node pool missing, or fewer nodes than a slice's hosts."""
    self.kubectl.context(self.job.cluster)
    pools = usable_nodes(self._nodes())
    wanted = [self.job.node_pool(s) for s in range(self.num_slices)]
    missing = [p for p in wanted if p not in pools]
    if missing:
      found = ", ".join(sorted(pools)) or "none"
      raise UserError(f"num_slices={self.num_slices} needs the node pools {wanted[0]} .. {wanted[-1]}, but "
                      f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not in the cluster (node pools "
                      f"found: {found}); set num_slices or cluster= to match")

  def _nodes(self) -> Any:
    return self.kubectl.json(["get", "nodes", "-l", NODE_POOL_LABEL], "listing the cluster's nodes")

  def available(self) -> set[int]:
    pools = usable_nodes(self._nodes())
    return {s for s in range(self.num_slices) if pools.get(self.job.node_pool(s), 0) >= self.job.hosts_per_slice}

  def mark_lost(self, slice_id: int) -> None:
    pass  # the node pool's own state says when it is back

  def name(self, generation: int) -> str:
    return f"{self.job.run_name}-g{generation}"

  def start(self, slices: Sequence[int], overrides: Sequence[str], env: Mapping[str, str] | None = None
            ) -> PodGeneration:
    self.generations += 1
    name = self.name(self.generations)
    manifest = self.job.manifest(name, list(slices), list(overrides), dict(env or {}))
    self.kubectl.run(["apply", "-f", "-"], f"creating the JobSet {name}", stdin=json.dumps(manifest))
    return PodGeneration(self.kubectl, name, list(slices), self.job.hosts_per_slice, self.unschedulable_s)
