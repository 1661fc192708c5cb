"""The elastic supervisor's GKE launcher (against the fake kubectl of tests/fake_kubectl.py) and its
queued-resource slices (against the fake gcloud): a lost slice shrinks the job, its return (or a
replacement) grows it back; the GKE dry run prints the JobSet; bad input is one line each."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from MaxText import multihost_runner
from MaxText import elastic
from MaxText.configuration.elastic_config import SliceLayout
from MaxText.errors import UserError
from MaxText.platform import gke_launch
from MaxText.platform.gke_launch import GkeJob, GkeLauncher, Kubectl, PodGeneration
from MaxText.platform.queued_slices import QueuedResourceLauncher, QueuedSlices
from tests.fake_kubectl import FakeCluster

_LAYOUT = SliceLayout(num_slices=2, devices_per_slice=8, batch_shards_per_slice=8, global_batch_size=16,
                      gradient_accumulation_steps=1, min_slices=1)
_JOB = GkeJob(cluster="c", run_name="run", image="img", command=("python3", "-m", "MaxText.train", "cfg.yml"),
              hosts_per_slice=2, chips_per_host=4)


def _wait_for(condition, what: str, timeout: float = 60) -> None:
  deadline = time.monotonic() + timeout
  while not condition():
    assert time.monotonic() < deadline, f"timed out waiting for {what}"
    time.sleep(0.05)


def _run_in_thread(supervisor: elastic.Supervisor) -> tuple[threading.Thread, list[object]]:
  outcome: list[object] = []
  thread = threading.Thread(target=lambda: outcome.append(supervisor.run()), daemon=True)
  thread.start()
  return thread, outcome


# ------------------------------------------------------------------------------------------ GKE
def _env(manifest: dict[str, Any], job: int) -> dict[str, str]:
  container = manifest["spec"]["replicatedJobs"][job]["template"]["spec"]["template"]["spec"]["containers"][0]
  return {e["name"]: e["value"] for e in container["env"]}


def _command(manifest: dict[str, Any]) -> list[str]:
  return manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["command"]


def test_a_lost_node_pool_shrinks_the_jobset_and_its_return_grows_it_back(tmp_path, monkeypatch):
  """Two node pools of 2 nodes: a pod of slice 1 fails as its node is lost -> the JobSet is deleted
  and relaunched on slice 0 with doubled accumulation; the pool is ready again -> the shrunk JobSet
  is deleted (SIGTERM) and relaunched on both, renumbered for the multislice variables."""
  cluster = FakeCluster(tmp_path / "cluster", {"c-np-0": 2, "c-np-1": 2})
  monkeypatch.setenv("FAKE_KUBECTL_DIR", str(cluster.root))
  launcher = GkeLauncher(Kubectl(str(cluster.bin / "kubectl")), _JOB, 2)
  launcher.check_cluster()
  run_dir = tmp_path / "run_dir"
  run_dir.mkdir()
  supervisor = elastic.Supervisor(_LAYOUT, launcher, run_dir, poll_s=0.05, stop_grace_s=20, log=lambda m: None)
  thread, outcome = _run_in_thread(supervisor)

  _wait_for(lambda: len(cluster.pods("run-g1")) == 4, "the first JobSet's 4 pods")
  first = cluster.state()["jobsets"]["run-g1"]
  assert _env(first, 1)["MEGASCALE_NUM_SLICES"] == "2" and _env(first, 1)["MEGASCALE_SLICE_ID"] == "1"
  cluster.set_pool("c-np-1", ready=False)

  def lose(state: dict[str, Any]) -> None:
    pod = next(p for p in state["pods"] if p["metadata"]["name"] == "run-g1-slice-1-0-1-x")
    pod["status"] = {"phase": "Failed", "reason": "NodeLost"}
  cluster.update(lose)
  _wait_for(lambda: len(cluster.pods("run-g2")) == 2, "the JobSet on slice 0")
  assert cluster.pods("run-g1") == []  # the old generation was deleted
  shrunk = cluster.state()["jobsets"]["run-g2"]
  assert [j["name"] for j in shrunk["spec"]["replicatedJobs"]] == ["slice-0"]
  assert _command(shrunk)[-4:] == ["num_slices=1", "dcn_data_parallelism=1", "per_device_batch_size=2",
                                   "gradient_accumulation_steps=2"]
  assert "MEGASCALE_NUM_SLICES" not in _env(shrunk, 0)
  assert "MAXTEXT_ELASTIC_RESIZE_DETECTED" in _env(shrunk, 0)
  cluster.update(lambda s: s["logs"].update({"run-g2-slice-0-0-0-x": "state: resumed from step 3 of the persistent "
                                                                    "tier\n"}))
  (run_dir / "metrics.jsonl").write_text('{"step": 4}\n')
  _wait_for(lambda: supervisor.resizes[0].seconds_to_resume is not None, "the resume")

  cluster.set_pool("c-np-1", ready=True)
  _wait_for(lambda: len(cluster.pods("run-g3")) == 4, "the JobSet on both slices again")
  grown = cluster.state()["jobsets"]["run-g3"]
  assert _command(grown)[-1] == "gradient_accumulation_steps=1" and _env(grown, 1)["MEGASCALE_SLICE_ID"] == "1"
  cluster.end_pods("run-g3", 0)
  thread.join(timeout=60)
  assert outcome == [0]
  lost, back = supervisor.resizes
  assert (lost.cause, lost.from_slices, lost.to_slices) == ("process 3 (slice 1) was lost with its pod (NodeLost)", 2, 1)
  assert (lost.resumed_from, lost.resumed_source) == (3, "the persistent tier")
  assert (back.cause, back.from_slices, back.to_slices) == ("slice(s) 1 returned", 1, 2)
  deletes = [c for c in cluster.calls() if c[:2] == ["delete", "jobset"]]
  assert [c[2] for c in deletes] == ["run-g1", "run-g2"]


class _Listed(Kubectl):
  """kubectl's answers from a dict, without a process."""

  def __init__(self, answers: dict[str, Any]):
    super().__init__()
    object.__setattr__(self, "answers", answers)

  def json(self, args, what):
    return self.answers[args[1]]  # type: ignore[attr-defined]


def _node(pool: str, ready: bool = True, **spec: Any) -> dict[str, Any]:
  return {"metadata": {"labels": {gke_launch.NODE_POOL_LABEL: pool}}, "spec": spec,
          "status": {"conditions": [{"type": "Ready", "status": str(ready)}]}}


def test_a_slice_is_down_while_a_node_is_not_ready_cordoned_tainted_or_missing():
  nodes = {"items": [_node("c-np-0"), _node("c-np-0", taints=[{"key": "google.com/tpu", "effect": "NoSchedule"}]),
                     _node("c-np-1"), _node("c-np-1", ready=False),
                     _node("c-np-2"), _node("c-np-2", unschedulable=True),
                     _node("c-np-3"), _node("c-np-3", taints=[{"key": "cloud.google.com/impending-node-termination",
                                                             "effect": "NoSchedule"}]),
                     _node("c-np-4")]}
  launcher = GkeLauncher(_Listed({"nodes": nodes}), _JOB, 5)
  assert launcher.available() == {0}  # the TPU taint is tolerated; pool 4 has 1 node of the 2 hosts


def test_a_pod_that_stays_unschedulable_or_disappears_ends_as_a_lost_process():
  pending = {"metadata": {"name": "g-slice-1-0-0-x", "labels": {gke_launch.SLICE_LABEL: "1"},
                          "annotations": {gke_launch.INDEX_ANNOTATION: "0"}},
             "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
                                                            "reason": "Unschedulable",
                                                            "message": "0/4 nodes are available"}]}}
  running = {"metadata": {"name": "g-slice-0-0-1-x", "labels": {gke_launch.SLICE_LABEL: "0"},
                          "annotations": {gke_launch.INDEX_ANNOTATION: "1"}},
             "status": {"phase": "Running", "containerStatuses": [{"state": {"running": {}}}]}}
  answers: dict[str, Any] = {"pods": {"items": [pending, running]}}
  generation = PodGeneration(_Listed(answers), "g", [0, 1], 2, unschedulable_s=0)
  (unscheduled,) = generation.exits()
  assert unscheduled.describe() == "process 2 (slice 1) could not be scheduled: 0/4 nodes are available"
  assert unscheduled.infrastructure and generation.running() == 3
  answers["pods"] = {"items": [pending]}
  assert generation.exits()[-1].describe() == "process 1 (slice 0) was removed with its pod g-slice-0-0-1-x"
  oom = {**running, "status": {"phase": "Failed", "containerStatuses": [
      {"state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]}}
  (killed,) = PodGeneration(_Listed({"pods": {"items": [oom]}}), "g", [0, 1], 2, unschedulable_s=0).exits()
  assert killed.describe() == "process 1 (slice 0) exited with status 137 (OOMKilled)" and killed.infrastructure
  patient = PodGeneration(_Listed({"pods": {"items": [pending]}}), "g", [0, 1], 2, unschedulable_s=600)
  assert patient.exits() == []  # the scheduler may still place it (a node being added)


def test_the_gke_dry_run_prints_the_first_jobset_and_calls_no_kubectl(capsys, tmp_path, monkeypatch):
  monkeypatch.setenv("PATH", str(tmp_path))  # no kubectl anywhere
  assert elastic.main(["elastic", "configs/base.yml", "run_name=el", "num_slices=2", "elastic_min_slices=1",
                       "dataset_type=synthetic", "cluster=c", "tpu_type=v5litepod-16", "docker_image=img",
                       "dry_run=true"]) == 0
  out = capsys.readouterr().out
  head, _, manifest_text = out.partition("created with `kubectl apply -f -` from:\n")
  assert "generation 1 is the JobSet el-g1 on the node pools c-np-0 .. c-np-1" in head
  manifest = yaml.safe_load(manifest_text)
  assert manifest["kind"] == "JobSet" and manifest["spec"]["failurePolicy"] == {"maxRestarts": 0}
  pod = manifest["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"]
  assert pod["nodeSelector"] == {gke_launch.NODE_POOL_LABEL: "c-np-1"}
  assert pod["containers"][0]["resources"]["limits"] == {"google.com/tpu": 4}  # v5litepod-16: 4 hosts of 4 chips
  assert manifest["spec"]["replicatedJobs"][1]["template"]["spec"]["completions"] == 4


_GKE_RUN = ["configs/base.yml", "run_name=el", "num_slices=2", "elastic_min_slices=1", "dataset_type=synthetic",
            "cluster=c", "tpu_type=v5litepod-16", "docker_image=img"]


@pytest.mark.parametrize("pools,context,message", [
    (None, "ctx", r"^'kubectl' was not found on PATH: install kubectl"),
    ({"c-np-0": 4, "c-np-1": 4}, None, r"^kubectl has no current cluster context: run gcloud container clusters "
                                       r"get-credentials c "),
    ({"c-np-0": 4}, "ctx", r"^num_slices=2 needs the node pools c-np-0 \.\. c-np-1, but c-np-1 is not in the "
                           r"cluster \(node pools found: c-np-0\)"),
])
def test_the_gke_launchers_bad_input_is_one_line(pools, context, message, tmp_path, monkeypatch):
  if pools is None:
    monkeypatch.setenv("PATH", str(tmp_path))
  else:
    cluster = FakeCluster(tmp_path / "cluster", pools, context=context)
    monkeypatch.setenv("FAKE_KUBECTL_DIR", str(cluster.root))
    monkeypatch.setenv("PATH", str(cluster.bin))
  with pytest.raises(UserError, match=message):
    elastic.main(["elastic", *_GKE_RUN, f"base_output_directory={tmp_path}", f"log_dir={tmp_path / 'logs'}"])


@pytest.mark.parametrize("extra,message", [
    (["docker_image="], r"^cluster needs docker_image=IMAGE"),
    (["tpu_prefix=p"], r"^tpu_prefix \(TPU VMs\) and cluster \(GKE\) choose different launchers"),
    (["cluster=", "docker_image=", "tpu_prefix=p", "version=v", "use_existing_folder=true"],
     r"^use_existing_folder applies to existing slices"),
    (["cluster=", "docker_image=", "tpu_prefix=p", "cqr_extra_args=--spot"],
     r"^cqr_extra_args applies to queued resources only: add version=RUNTIME_VERSION$"),
    (["cluster=", "tpu_type="], r"^docker_image applies to GKE only: add cluster=NAME$"),
])
def test_the_launcher_keys_mistakes_are_one_line_each(extra, message):
  with pytest.raises(UserError, match=message):
    elastic.main(["elastic", *_GKE_RUN, *extra, "dry_run=true"])


# ---------------------------------------------------------------------------- queued resources
_WORKER = (Path(__file__).parent / "fake_elastic_worker.py").read_text()  # tests/fake_elastic_worker.py


@pytest.mark.slow  # about 7 s: every fake gcloud call (and the ssh it stands for) is a Python process
def test_a_preempted_queued_slice_is_replaced_and_the_job_grows_back_onto_it(tmp_path, monkeypatch):
  """Two slices asked for as one queued resource: slice 1's node is preempted and its worker killed
  -> the job goes on on slice 0 and a replacement queued resource is requested; once its node is
  READY (and readied) the job grows back onto it."""
  from MaxText.platform.tpu_launch import Gcloud
  from tests.fake_gcloud import FakeCloud

  cloud = FakeCloud(tmp_path / "cloud", {}, qr_workers=1)
  monkeypatch.setenv("FAKE_GCLOUD_DIR", str(cloud.root))
  shared = tmp_path / "shared"
  shared.mkdir()
  gcloud = Gcloud(project="p", zone="z", dry_run=False, executable=str(cloud.root / "bin" / "gcloud"))
  readied: list[str] = []

  def prepare(name: str) -> None:  # stands in for the code's copy and the setup
    (cloud.home(name, 0) / "run").mkdir(parents=True)
    (cloud.home(name, 0) / "run" / "worker.py").write_text(_WORKER)
    readied.append(name)

  queued = QueuedSlices(gcloud, "job", 2, "v5litepod-8", "v2-alpha-tpuv5-lite", ["--spot"], prepare, log=lambda m: None)
  queued.request_all(poll_s=0.1)
  assert readied == ["job-0", "job-1"]
  inner = multihost_runner.TpuVmLauncher(gcloud, queued.names, f"{sys.executable} worker.py {shared}", "run", tmp_path / "logs")
  launcher = QueuedResourceLauncher(inner, queued)
  run_dir = tmp_path / "run_dir"
  run_dir.mkdir()
  supervisor = elastic.Supervisor(_LAYOUT, launcher, run_dir, poll_s=0.2, stop_grace_s=20, log=lambda m: None)
  thread, outcome = _run_in_thread(supervisor)

  _wait_for(lambda: (shared / "args_job-1").exists() and (shared / "args_job-0").exists(), "both workers", 120)
  cloud.configure(qr_state="CREATING", tpus={"job-0": {"workers": 1, "state": "READY"},
                                             "job-1": {"workers": 1, "state": "PREEMPTED"}})
  (shared / "kill_job-1").write_text("")
  _wait_for(lambda: len((shared / "args_job-0").read_text().splitlines()) == 2, "the relaunch on slice 0", 120)
  assert (shared / "args_job-0").read_text().splitlines()[1].endswith("gradient_accumulation_steps=2")
  create = [c for c in cloud.calls() if c[:5] == ["alpha", "compute", "tpus", "queued-resources", "create"]]
  assert [c[5] for c in create] == ["job", "job-1-r1"] and "--node-id=job-1-r1" in create[1] and "--spot" in create[1]
  (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
  _wait_for(lambda: supervisor.resizes[0].seconds_to_resume is not None, "the resume", 60)
  tpus = json.loads((cloud.root / "config.json").read_text())["tpus"]
  cloud.configure(tpus={**tpus, "job-1-r1": {"workers": 1, "state": "READY"}})
  _wait_for(lambda: (shared / "args_job-1-r1").exists(), "the grow-back onto the replacement", 120)
  (shared / "finish").write_text("")
  thread.join(timeout=120)
  assert outcome == [0]
  assert readied[-1] == "job-1-r1" and queued.names == ["job-0", "job-1-r1"]
  lost, grown = supervisor.resizes
  assert (lost.from_slices, lost.to_slices, grown.to_slices) == (2, 1, 2)
  assert grown.cause == "slice(s) 1 returned"
  assert (shared / "args_job-1-r1").read_text().strip().endswith("gradient_accumulation_steps=1")
  assert [c.split(" ")[1:7] for c in queued.delete_commands()] == \
      [["alpha", "compute", "tpus", "queued-resources", "delete", name] for name in ("job", "job-1-r1")]


def test_the_queued_resource_dry_run_prints_the_request(capsys):
  assert elastic.main(["elastic", "configs/base.yml", "run_name=el", "num_slices=2", "elastic_min_slices=1",
                       "dataset_type=synthetic", "tpu_prefix=el", "tpu_type=v5litepod-16",
                       "version=v2-alpha-tpuv5-lite", "dry_run=true"]) == 0
  out = capsys.readouterr().out
  assert ("elastic: the slices are asked for with: gcloud alpha compute tpus queued-resources create el "
          "--accelerator-type=v5litepod-16 --runtime-version=v2-alpha-tpuv5-lite --node-count=2 --node-prefix=el") \
      in out and "runs on every worker of el-0, el-1 in ~/el: " in out


def test_stopping_a_gke_generation_deletes_its_jobset_and_sigkill_its_pods():
  calls: list[list[str]] = []

  class Recording(_Listed):
    def run(self, args, what, stdin=None):
      calls.append(list(args))
      return ""

  generation = PodGeneration(Recording({"pods": {"items": []}}), "g", [0], 1, unschedulable_s=0)
  generation.signal_all(signal.SIGTERM)
  generation.signal_all(signal.SIGKILL)
  assert calls == [["delete", "jobset", "g", "--wait=false"],
                   ["delete", "pods", "-l", f"{gke_launch.JOBSET_LABEL}=g", "--grace-period=0", "--force",
                    "--wait=false"]]
  assert generation.running() == 0


_FAKE_TRAIN = """
import os, pathlib, sys, time
shared, me = pathlib.Path(os.environ["FAKE_SHARED"]), os.environ["FAKE_SLICE"]
print("state: initialised from seed 0", flush=True)
(shared / f"args_{me}").write_text(" ".join(sys.argv[1:]))
while not (shared / "finish").exists():
  time.sleep(0.1)
"""


@pytest.mark.slow  # about 15 s: the supervisor's 5 s looks, and every fake gcloud call is a Python process
def test_the_command_line_asks_for_queued_slices_readies_each_and_runs_the_job(tmp_path):
  """`version=`: one queued resource for both slices, the code copied and `setup_command` run on
  each once READY, the job on both; the last line lists the queued resources to delete."""
  import subprocess

  from tests.conftest import REPO_ROOT
  from tests.fake_gcloud import FakeCloud

  cloud = FakeCloud(tmp_path / "cloud", {}, qr_workers=1)
  code, shared = tmp_path / "code", tmp_path / "shared"
  (code / "MaxText").mkdir(parents=True)
  (code / "MaxText" / "__init__.py").write_text("")
  (code / "MaxText" / "train.py").write_text(_FAKE_TRAIN)
  (code / "setup.sh").write_text("touch set_up\n")
  shared.mkdir()
  command = [sys.executable, "-m", "MaxText.elastic", "configs/base.yml", "run_name=qr", "num_slices=2",
             "elastic_min_slices=1", "dataset_type=synthetic", f"base_output_directory={tmp_path / 'runs'}",
             "tpu_prefix=qr", "tpu_type=v5litepod-8", "version=v2-alpha-tpuv5-lite", f"script_dir={code}",
             f"log_dir={tmp_path / 'logs'}", "zone=z"]
  supervisor = subprocess.Popen(command, cwd=REPO_ROOT, env={**cloud.env, "FAKE_SHARED": str(shared)},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    _wait_for(lambda: (shared / "args_qr-0").exists() and (shared / "args_qr-1").exists(), "both workers", 120)
    (shared / "finish").write_text("")
    out, _ = supervisor.communicate(timeout=120)
  finally:
    if supervisor.poll() is None:
      supervisor.kill()
  assert supervisor.returncode == 0, out
  (create,) = [c for c in cloud.calls() if c[:5] == ["alpha", "compute", "tpus", "queued-resources", "create"]]
  assert create[5] == "qr" and "--node-count=2" in create and "--node-prefix=qr" in create
  assert all((cloud.home(name, 0) / "qr" / "set_up").exists() for name in ("qr-0", "qr-1"))
  assert (shared / "args_qr-1").read_text().endswith("num_slices=2 dcn_data_parallelism=2 per_device_batch_size=12 "
                                                      "gradient_accumulation_steps=1")
  assert "elastic: the queued resources are billed until deleted: gcloud alpha compute tpus queued-resources " \
         "delete qr --force --async --zone=z" in out


@pytest.mark.slow  # about 10 s: the supervisor's 5 s looks, and every fake kubectl call is a Python process
def test_the_command_line_runs_a_gke_job_to_its_end(tmp_path):
  """`cluster=`: the node pools checked, the first JobSet applied with the run's command, and the job
  over once every pod succeeded."""
  import os
  import subprocess

  from tests.conftest import REPO_ROOT

  cluster = FakeCluster(tmp_path / "cluster", {"c-np-0": 4, "c-np-1": 4})
  env = {**os.environ, "PATH": f"{cluster.bin}{os.pathsep}{os.environ['PATH']}", "FAKE_KUBECTL_DIR": str(cluster.root)}
  supervisor = subprocess.Popen([sys.executable, "-m", "MaxText.elastic", *_GKE_RUN,
                                 f"base_output_directory={tmp_path / 'runs'}", f"log_dir={tmp_path / 'logs'}"],
                                cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    _wait_for(lambda: len(cluster.pods("el-g1")) == 8, "the first JobSet's pods", 120)
    cluster.end_pods("el-g1", 0)
    out, _ = supervisor.communicate(timeout=120)
  finally:
    if supervisor.poll() is None:
      supervisor.kill()
  assert supervisor.returncode == 0, out
  assert _command(cluster.state()["jobsets"]["el-g1"])[:4] == ["python3", "-m", "MaxText.train", "configs/base.yml"]
  assert "elastic: 1 generation(s), 0 resize(s)" in out


def test_a_failed_look_at_the_cluster_or_a_tpu_is_tried_again_not_a_lost_slice(tmp_path):
  """kubectl's reads are tried again (an API server restart must not end the supervision); a
  gcloud describe that fails for another reason than NOT_FOUND reads as UNKNOWN (down, not replaced)."""
  from MaxText.platform.tpu_launch import Gcloud

  flaky = tmp_path / "kubectl"
  flaky.write_text(f'#!/bin/sh\nif [ -e {tmp_path}/once ]; then echo \'{{"items": []}}\'; exit 0; fi\n'
                   f'touch {tmp_path}/once; echo "error: the server is currently unable" >&2; exit 1\n')
  flaky.chmod(0o755)
  assert Kubectl(str(flaky), retry_s=0).json(["get", "nodes"], "listing") == {"items": []}
  failing = tmp_path / "gcloud"
  failing.write_text('#!/bin/sh\necho "ERROR: (gcloud) UNAVAILABLE: try again" >&2\nexit 1\n')
  failing.chmod(0o755)
  warnings: list[str] = []
  queued = QueuedSlices(Gcloud(None, None, False, str(failing)), "job", 2, "v5litepod-8", "v", [], print,
                        log=warnings.append)
  assert queued.available() == set() and not queued.replacing and "UNAVAILABLE" in warnings[0]
