"""Submit a job to fresh TPU capacity through a queued resource: the production counterpart of
multihost_runner.py (which needs slices that already exist and a live ssh session).

  python3 -m MaxText.multihost_job --TPU_TYPE=v5litepod-256 --VERSION=v2-alpha-tpuv5-lite \\
      --BUCKET_NAME=my-bucket --NUM_SLICES=2 \\
      --COMMAND="python3 -m MaxText.train configs/base.yml run_name=big base_output_directory=gs://my-bucket/runs"

Packs SCRIPT_DIR into a tarball and uploads it to gs://BUCKET_NAME/BUCKET_DIR/RUN_NAME/, writes a
startup script, and asks for the slices with `gcloud alpha compute tpus queued-resources create`
(--node-count/--node-prefix for several slices, whose multislice settings the TPU service
provides). When the capacity arrives, every worker runs the startup script: it fetches the code,
runs SETUP_COMMAND and COMMAND, and uploads its log to .../logs/<hostname>.log every
LOG_UPLOAD_SECONDS and at the end. `--dry-run` prints the commands and the startup script.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # `python3 MaxText/multihost_job.py`: import the package, not sibling files.
  sys.path[0] = str(Path(__file__).resolve().parent.parent)

from MaxText import startup
from MaxText.platform import tpu_launch
from MaxText.errors import UserError, run_cli
from MaxText.platform.tpu_launch import Gcloud

QUEUED_RESOURCES = ("alpha", "compute", "tpus", "queued-resources")

STARTUP_TEMPLATE = """#!/bin/bash
# Startup script of job {run_name}, written by MaxText/multihost_job.py. Runs as root on every
# worker when it boots: fetches the code, runs the job, uploads this worker's log.
JOB_DIR="${{MULTIHOST_JOB_ROOT:-/opt/multihost_job}}/{run_name}"
GCS_DIR={gcs_dir}
LOG="$JOB_DIR/$(hostname).log"
export HOME="${{HOME:-/root}}"  # startup scripts get a bare environment; pip and JAX caches need a home

# Startup scripts run again after every reboot: never start the same job twice on one worker.
if [ -e "$JOB_DIR/started" ]; then
  echo "multihost_job: {run_name} already ran on $(hostname); not starting it again"
  exit 0
fi
mkdir -p "$JOB_DIR/code" && touch "$JOB_DIR/started" && cd "$JOB_DIR/code" || exit 1

upload_log() {{
  gcloud storage cp "$LOG" "$GCS_DIR/logs/$(hostname).log" >/dev/null 2>&1 || echo "log upload failed" >&2
}}

run_job() {{
  gcloud storage cp "$GCS_DIR/code.tar.gz" code.tar.gz && tar -xzf code.tar.gz && rm -f code.tar.gz || return
  bash -c {setup} || {{ echo "multihost_job: setup failed"; return 1; }}
  bash -c {command}
}}

echo "multihost_job: {run_name} starting on $(hostname) at $(date -u +%FT%TZ)" > "$LOG"
# The uploader's own sleep is killed with it, so no stray process outlives the job.
( trap 'kill "$nap" 2>/dev/null; exit 0' TERM
  while :; do sleep {upload_seconds} & nap=$!; wait "$nap"; upload_log; done ) &
uploader=$!
run_job >> "$LOG" 2>&1
status=$?
kill "$uploader" 2>/dev/null
echo "multihost_job: {run_name} finished on $(hostname) at $(date -u +%FT%TZ) with exit status $status" >> "$LOG"
upload_log
exit "$status"
"""


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python3 -m MaxText.multihost_job", description=__doc__.split("\n")[0])
  parser.add_argument("--TPU_TYPE", required=True, help="accelerator type of each slice, e.g. v5litepod-256, v5p-128")
  parser.add_argument("--VERSION", required=True,
                      help="TPU VM runtime version, e.g. v2-alpha-tpuv5-lite (v5e), v2-alpha-tpuv5 (v5p), "
                           "tpu-ubuntu2204-base (v4)")
  parser.add_argument("--BUCKET_NAME", required=True, help="GCS bucket for the code and the logs (gs:// optional)")
  parser.add_argument("--BUCKET_DIR", default="multihost_job", help="folder in the bucket (default: multihost_job)")
  tpu_launch.add_common_arguments(parser)
  parser.add_argument("--SETUP_COMMAND", default="bash setup.sh",
                      help="runs on every worker before COMMAND (default: bash setup.sh)")
  parser.add_argument("--CQR_EXTRA_ARGS", default="",
                      help="more queued-resources create flags, e.g. '--spot', '--best-effort' or '--reserved'")
  parser.add_argument("--LOG_UPLOAD_SECONDS", type=int, default=300,
                      help="how often each worker uploads its log while the job runs (default: 300)")
  parser.add_argument("--LOCAL_DIR", default=None,
                      help="where the tarball and startup script are written (default: a temp folder)")
  args = parser.parse_args(argv)
  tpu_launch.check_common_arguments(args)
  if args.LOG_UPLOAD_SECONDS < 1:
    raise UserError(f"--LOG_UPLOAD_SECONDS must be at least 1, got {args.LOG_UPLOAD_SECONDS}")
  bucket = args.BUCKET_NAME.removeprefix("gs://").strip("/")
  if not bucket or "/" in bucket:
    raise UserError(f"--BUCKET_NAME '{args.BUCKET_NAME}' must be a bucket name; put folders in --BUCKET_DIR")
  args.gcs_dir = "/".join(p for p in ("gs:/", bucket, args.BUCKET_DIR.strip("/"), args.RUN_NAME) if p)
  args.LOCAL_DIR = Path(args.LOCAL_DIR or Path(tempfile.gettempdir(), "multihost_job", args.RUN_NAME))
  return args


def startup_script(args: argparse.Namespace) -> str:
  return STARTUP_TEMPLATE.format(run_name=args.RUN_NAME, gcs_dir=shlex.quote(args.gcs_dir),
                                 setup=shlex.quote(args.SETUP_COMMAND), command=shlex.quote(args.COMMAND),
                                 upload_seconds=args.LOG_UPLOAD_SECONDS)


def create_command(gcloud: Gcloud, args: argparse.Namespace, script_path: Path) -> list[str]:
  if args.NUM_SLICES == 1:
    nodes = [f"--node-id={args.RUN_NAME}"]
  else:  # the slices are named RUN_NAME-0 .. RUN_NAME-(N-1), as multihost_runner expects too
    nodes = [f"--node-count={args.NUM_SLICES}", f"--node-prefix={args.RUN_NAME}"]
  return gcloud.command(*QUEUED_RESOURCES, "create", args.RUN_NAME, f"--accelerator-type={args.TPU_TYPE}",
                        f"--runtime-version={args.VERSION}", *nodes,
                        f"--metadata-from-file=startup-script={script_path}",
                        *shlex.split(args.CQR_EXTRA_ARGS))


def follow_up(gcloud: Gcloud, args: argparse.Namespace) -> str:
  status = gcloud.command(*QUEUED_RESOURCES, "describe", args.RUN_NAME)
  logs = gcloud.command("storage", "ls", f"{args.gcs_dir}/logs/", zonal=False)
  delete = gcloud.command(*QUEUED_RESOURCES, "delete", args.RUN_NAME, "--force", "--async")
  return (f"  status: {tpu_launch.quote(status)}\n"
          f"  logs (every {args.LOG_UPLOAD_SECONDS} s and at the end): {tpu_launch.quote(logs)}\n"
          f"  delete the slices when done (they are billed until then): {tpu_launch.quote(delete)}")


TOOL = startup.Tool("multihost_job", builds_config=False)


def main(argv: list[str]) -> int:
  startup.start(TOOL, argv)
  args = parse_args(argv[1:])
  gcloud = Gcloud(args.PROJECT, args.ZONE, args.dry_run)
  tarball = args.LOCAL_DIR / "code.tar.gz"
  script_path = args.LOCAL_DIR / "startup.sh"
  upload = gcloud.command("storage", "cp", str(tarball), f"{args.gcs_dir}/code.tar.gz", zonal=False)
  create = create_command(gcloud, args, script_path)
  script = startup_script(args)
  if args.dry_run:
    print(f"# package {args.SCRIPT_DIR} into {tarball}, then upload it:")
    gcloud.show(upload)
    print(f"# write this startup script to {script_path}:")
    print(script, end="")
    print("# ask for the slices:")
    gcloud.show(create)
    print("# then:\n" + follow_up(gcloud, args))
    return 0
  tpu_launch.package_directory(args.SCRIPT_DIR, tarball)
  script_path.write_text(script)
  tpu_launch.log_to_stderr(f"uploading {args.SCRIPT_DIR} to {args.gcs_dir}/code.tar.gz ...")
  gcloud.act(upload, "uploading the code")
  tpu_launch.log_to_stderr(f"requesting {args.NUM_SLICES} x {args.TPU_TYPE} as queued resource {args.RUN_NAME} ...")
  gcloud.act(create, "creating the queued resource")
  print(f"multihost_job: queued resource {args.RUN_NAME} requested ({args.NUM_SLICES} x {args.TPU_TYPE}); the job "
        "starts on every worker when the capacity is granted.\n" + follow_up(gcloud, args), flush=True)
  return 0


if __name__ == "__main__":
  run_cli(main)
