"""A stand-in for `kubectl`, put first on PATH by the GKE launcher's tests; never reaches a cluster.

State lives in $FAKE_KUBECTL_DIR/cluster.json:
  {"context": NAME or null, "nodes": [{"name", "pool", "ready", "unschedulable", "taints"}],
   "jobsets": {NAME: manifest}, "pods": [pod objects as `kubectl get pods -o json` lists them],
   "logs": {POD: text}}
`apply -f -` stores a JobSet and creates its pods (Running, one per host of each replicated job);
deleting a JobSet removes its pods, as the API server does once their containers end. calls.jsonl
holds one JSON list (argv without "kubectl") per call. The test edits pods and nodes through
`FakeCluster` to stand in for failures and repairs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml


class FakeCluster:
  """Test side: the fake's state and a bin/ holding `kubectl`, to put first on PATH."""

  def __init__(self, root: Path, pools: dict[str, int], context: str | None = "gke_p_z_c"):
    self.root = root
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "kubectl").write_text(f'#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} "$@"\n')
    (bin_dir / "kubectl").chmod(0o755)
    nodes = [{"name": f"{pool}-node-{i}", "pool": pool, "ready": True} for pool, n in pools.items() for i in range(n)]
    _save(root, {"context": context, "nodes": nodes, "jobsets": {}, "pods": [], "logs": {}})
    self.bin = bin_dir

  def state(self) -> dict[str, Any]:
    return _load(self.root)

  def update(self, change) -> None:  # change(state) edits it in place
    state = _load(self.root)
    change(state)
    _save(self.root, state)

  def set_pool(self, pool: str, **node: object) -> None:
    self.update(lambda s: [n.update(node) for n in s["nodes"] if n["pool"] == pool])

  def pods(self, jobset: str) -> list[dict[str, Any]]:
    return [p for p in self.state()["pods"] if p["metadata"]["labels"]["jobset.sigs.k8s.io/jobset-name"] == jobset]

  def end_pods(self, jobset: str, code: int, slice_id: str | None = None) -> None:
    def change(state: dict[str, Any]) -> None:
      for pod in state["pods"]:
        labels = pod["metadata"]["labels"]
        if labels["jobset.sigs.k8s.io/jobset-name"] == jobset and slice_id in (None, labels["maxtext-elastic-slice"]):
          pod["status"] = {"phase": "Succeeded" if code == 0 else "Failed",
                           "containerStatuses": [{"state": {"terminated": {"exitCode": code}}}]}
    self.update(change)

  def calls(self) -> list[list[str]]:
    path = self.root / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _load(root: Path) -> dict[str, Any]:
  return json.loads((root / "cluster.json").read_text())


def _save(root: Path, state: dict[str, Any]) -> None:
  temporary = root / f"cluster.json.{os.getpid()}"
  temporary.write_text(json.dumps(state))
  os.replace(temporary, root / "cluster.json")


def _node(node: dict[str, Any]) -> dict[str, Any]:
  return {"metadata": {"name": node["name"], "labels": {"cloud.google.com/gke-nodepool": node["pool"]}},
          "spec": {"unschedulable": node.get("unschedulable", False), "taints": node.get("taints", [])},
          "status": {"conditions": [{"type": "Ready", "status": "True" if node.get("ready") else "False"}]}}


def _pods_of(manifest: dict[str, Any]) -> list[dict[str, Any]]:
  name = manifest["metadata"]["name"]
  pods = []
  for job in manifest["spec"]["replicatedJobs"]:
    spec = job["template"]["spec"]
    for host in range(spec["completions"]):
      pods.append({"metadata": {"name": f"{name}-{job['name']}-0-{host}-x",
                                "labels": {**spec["template"]["metadata"]["labels"],
                                           "jobset.sigs.k8s.io/jobset-name": name,
                                           "jobset.sigs.k8s.io/replicatedjob-name": job["name"]},
                                "annotations": {"batch.kubernetes.io/job-completion-index": str(host)}},
                   "status": {"phase": "Running", "containerStatuses": [{"state": {"running": {}}}]}})
  return pods


def _selected(pod: dict[str, Any], selector: str) -> bool:
  key, _, value = selector.partition("=")
  return pod["metadata"]["labels"].get(key) == value


def main(argv: list[str]) -> int:
  root = Path(os.environ["FAKE_KUBECTL_DIR"])
  with open(root / "calls.jsonl", "a", encoding="utf-8") as f:
    f.write(json.dumps(argv) + "\n")
  state = _load(root)
  selector = argv[argv.index("-l") + 1] if "-l" in argv else None
  if argv[:2] == ["config", "current-context"]:
    if not state["context"]:
      print("error: current-context is not set", file=sys.stderr)
      return 1
    print(state["context"])
    return 0
  if not state["context"]:
    print("error: no context is set", file=sys.stderr)
    return 1
  if argv[:3] == ["apply", "-f", "-"]:
    manifest = yaml.safe_load(sys.stdin.read())
    state["jobsets"][manifest["metadata"]["name"]] = manifest
    state["pods"] += _pods_of(manifest)
    _save(root, state)
    print(f"jobset.jobset.x-k8s.io/{manifest['metadata']['name']} created")
    return 0
  if argv[:2] == ["get", "nodes"]:
    print(json.dumps({"items": [_node(n) for n in state["nodes"]]}))
    return 0
  if argv[:2] == ["get", "pods"]:
    print(json.dumps({"items": [p for p in state["pods"] if selector is None or _selected(p, selector)]}))
    return 0
  if argv[:2] == ["delete", "jobset"]:
    state["jobsets"].pop(argv[2], None)
    state["pods"] = [p for p in state["pods"] if not _selected(p, f"jobset.sigs.k8s.io/jobset-name={argv[2]}")]
    _save(root, state)
    return 0
  if argv[:2] == ["delete", "pods"]:
    state["pods"] = [p for p in state["pods"] if selector is None or not _selected(p, selector)]
    _save(root, state)
    return 0
  if argv[:1] == ["logs"]:
    if argv[1] not in state["logs"]:
      print(f'error: pods "{argv[1]}" not found', file=sys.stderr)
      return 1
    print(state["logs"][argv[1]])
    return 0
  print(f"fake kubectl: unsupported command {argv}", file=sys.stderr)
  return 2


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
