"""A stand-in for `gcloud`, put first on PATH by the launch-tool tests; never touches a network.

State lives in $FAKE_GCLOUD_DIR:
  config.json  {"tpus": {NAME: {"workers": N, "state": "READY"}}, "ssh_exit": {"NAME:W": CODE},
                "create_exit": CODE, "qr_workers": N, "qr_state": STATE,
                "queued_resources": {NAME: {"state": STATE, "message": TEXT}}, "qr_resource_state": STATE,
                "qr_resource_message": TEXT}
               `queued-resources create` adds the queued resource (in qr_resource_state, ACCEPTED
               unless set, with qr_resource_message; `describe` prints them, the message as its
               failure's) and, with
               qr_workers, its nodes to tpus (in qr_state, READY unless set), as the TPU service
               does once the capacity is granted
  calls.jsonl  one JSON list (argv without "gcloud") per call, appended
  homes/NAME/W the "home folder" of worker W of TPU NAME: scp copies into it, and ssh runs the
               command there for real with HOME pointing at it (and FAKE_SLICE / FAKE_WORKER set),
               so the runner's remote scripts, pid files and kill commands are exercised as written
  gcs/...      what `gcloud storage cp` uploaded to gs://...
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path



class FakeCloud:
  """Test side: a folder with the fake's state and a bin/ holding `gcloud`, to put first on PATH."""

  def __init__(self, root: Path, tpus: dict[str, int], **settings: object):
    self.root = root
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "gcloud").write_text(f'#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} "$@"\n')
    (bin_dir / "gcloud").chmod(0o755)
    self.configure(tpus={name: {"workers": n, "state": "READY"} for name, n in tpus.items()}, **settings)
    self.env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_GCLOUD_DIR": str(root)}

  def configure(self, **settings: object) -> None:
    path = self.root / "config.json"
    current = json.loads(path.read_text()) if path.exists() else {}
    write_config(path, {**current, **settings})

  def set_queued_state(self, name: str, state: str, message: str = "") -> None:
    """Queued resource NAME's own state from now on (FAILED, SUSPENDED, ...), with a failure's message."""
    current = json.loads((self.root / "config.json").read_text()).get("queued_resources", {})
    self.configure(queued_resources={**current, name: {"state": state, "message": message}})

  def calls(self) -> list[list[str]]:
    path = self.root / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

  def home(self, name: str, worker: int) -> Path:
    return self.root / "homes" / name / str(worker)


def state() -> Path:
  return Path(os.environ["FAKE_GCLOUD_DIR"])


def write_config(path: Path, settings: dict) -> None:
  """Whole or not at all: a gcloud call reading it mid-write saw an empty file and every TPU as down."""
  partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
  partial.write_text(json.dumps(settings))
  os.replace(partial, path)


def config() -> dict:
  path = state() / "config.json"
  return json.loads(path.read_text()) if path.exists() else {}


def record(argv: list[str]) -> None:
  fd = os.open(state() / "calls.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
  try:
    os.write(fd, (json.dumps(argv) + "\n").encode())
  finally:
    os.close(fd)


def flag(argv: list[str], name: str, default: str | None = None) -> str | None:
  for word in argv:
    if word.startswith(f"--{name}="):
      return word.split("=", 1)[1]
  return default


def positional(argv: list[str]) -> list[str]:
  return [w for w in argv if not w.startswith("--")]


def tpu(name: str) -> dict:
  tpus = config().get("tpus", {})
  if name not in tpus:
    print(f"ERROR: (gcloud.compute.tpus.tpu-vm) NOT_FOUND: TPU {name} was not found", file=sys.stderr)
    sys.exit(1)
  return tpus[name]


def workers(name: str, worker: str) -> list[int]:
  count = tpu(name)["workers"]
  return list(range(count)) if worker == "all" else [int(worker)]


def home(name: str, worker: int) -> Path:
  path = state() / "homes" / name / str(worker)
  path.mkdir(parents=True, exist_ok=True)
  return path


def describe(name: str) -> int:
  info = tpu(name)
  slice_index = sorted(config()["tpus"]).index(name)
  endpoints = [{"ipAddress": f"10.0.{slice_index}.{w + 2}", "port": 8470} for w in range(info["workers"])]
  print(json.dumps({"name": f"projects/p/locations/z/nodes/{name}", "state": info.get("state", "READY"),
                    "networkEndpoints": endpoints}))
  return 0


def scp(args: list[str], worker: str) -> int:
  source, target = args
  name, _, dest = target.partition(":")
  for w in workers(name, worker):
    shutil.copy(source, home(name, w) / dest)
  return 0


def ssh(name: str, worker: str, command: str) -> int:
  forced = config().get("ssh_exit", {})
  codes = []
  for w in workers(name, worker):
    if f"{name}:{w}" in forced:
      print(f"ssh: connect to host {name} worker {w}: Connection refused", file=sys.stderr)
      codes.append(forced[f"{name}:{w}"])
      continue
    env = {**os.environ, "HOME": str(home(name, w)), "FAKE_SLICE": name, "FAKE_WORKER": str(w)}
    codes.append(subprocess.run(["bash", "-c", command], cwd=home(name, w), env=env, check=False).returncode)
  return max(codes, default=0)


def storage_cp(source: str, target: str) -> int:
  """Uploads to and downloads from gs://... as files under gcs/."""
  bucket = state() / "gcs"
  source_path = bucket / source.removeprefix("gs://") if source.startswith("gs://") else Path(source)
  target_path = bucket / target.removeprefix("gs://") if target.startswith("gs://") else Path(target)
  if not source_path.is_file():
    print(f"ERROR: (gcloud.storage.cp) URL not found: {source}", file=sys.stderr)
    return 1
  target_path.parent.mkdir(parents=True, exist_ok=True)
  shutil.copy(source_path, target_path)
  return 0


def describe_queued_resource(name: str) -> int:
  queued = config().get("queued_resources", {})
  if name not in queued:
    print(f"ERROR: (gcloud.alpha.compute.tpus.queued-resources.describe) NOT_FOUND: Resource "
          f"'projects/p/locations/z/queuedResources/{name}' was not found", file=sys.stderr)
    return 1
  state: dict = {"state": queued[name]["state"]}
  if queued[name].get("message"):
    state["failedData"] = {"error": {"code": 9, "message": queued[name]["message"]}}
  print(json.dumps({"name": f"projects/p/locations/z/queuedResources/{name}", "state": state}))
  return 0


def create_queued_resource(argv: list[str]) -> int:
  settings = config()
  code = int(settings.get("create_exit", 0))
  if code:
    return code
  resource = {"state": settings.get("qr_resource_state", "ACCEPTED"), "message": settings.get("qr_resource_message", "")}
  settings = {**settings, "queued_resources": {**settings.get("queued_resources", {}), positional(argv)[5]: resource}}
  if "qr_workers" in settings:
    single = flag(argv, "node-id")
    prefix, count = flag(argv, "node-prefix"), int(flag(argv, "node-count", "1") or 1)
    names = [single] if single else [f"{prefix}-{i}" for i in range(count)]
    node = {"workers": settings["qr_workers"], "state": settings.get("qr_state", "READY")}
    settings["tpus"] = {**settings.get("tpus", {}), **{n: dict(node) for n in names}}
  write_config(state() / "config.json", settings)
  return 0


def main(argv: list[str]) -> int:
  record(argv)
  words = positional(argv)
  if words[:4] == ["compute", "tpus", "tpu-vm", "list"]:
    print("\n".join(sorted(config().get("tpus", {}))))
    return 0
  if words[:4] == ["compute", "tpus", "tpu-vm", "describe"]:
    return describe(words[4])
  if words[:4] == ["compute", "tpus", "tpu-vm", "scp"]:
    return scp(words[4:], flag(argv, "worker", "0"))
  if words[:4] == ["compute", "tpus", "tpu-vm", "ssh"]:
    return ssh(words[4], flag(argv, "worker", "0"), flag(argv, "command", ""))
  if words[:2] == ["storage", "cp"]:
    return storage_cp(*words[2:4])
  if words[:5] == ["alpha", "compute", "tpus", "queued-resources", "create"]:
    return create_queued_resource(argv)
  if words[:5] == ["alpha", "compute", "tpus", "queued-resources", "describe"]:
    return describe_queued_resource(words[5])
  print(f"fake gcloud: unsupported command {argv}", file=sys.stderr)
  return 2


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
