"""Submit a job to fresh TPU capacity through a queued resource: the production counterpart of
multihost_runner.py (which needs slices that already exist and a live ssh session).

  python3 -m MaxText.multihost_job tpu_type=v5litepod-256 version=v2-alpha-tpuv5-lite \\
      bucket_name=my-bucket num_slices=2 \\
      command="python3 -m MaxText.train configs/base.yml run_name=big base_output_directory=gs://my-bucket/runs"

Packs SCRIPT_DIR into a tarball and uploads it to gs://BUCKET_NAME/BUCKET_DIR/RUN_NAME/, writes a
startup script, and asks for the slices with `gcloud alpha compute tpus queued-resources create`
(--node-count/--node-prefix for several slices, whose multislice settings the TPU service
provides). When the capacity arrives, every worker runs the startup script: it fetches the code,
runs SETUP_COMMAND and COMMAND, and uploads its log to .../logs/<hostname>.log every
LOG_UPLOAD_SECONDS and at the end. `dry_run=true` prints the commands and the startup script.
An elastic run on queued resources (the job goes on without a lost slice, a replacement queued
resource brings one back) is supervised by MaxText/elastic.py with `version=`, which asks for the
slices with the same request (tpu_launch.queued_resource_create).
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
from MaxText.configuration import tool_args
from MaxText.errors import UserError, run_cli
from MaxText.platform.tpu_launch import Gcloud

QUEUED_RESOURCES = tpu_launch.QUEUED_RESOURCES

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
  parser.add_argument("--tpu_type", required=True, help="accelerator type of each slice, e.g. v5litepod-256, v5p-128")
  parser.add_argument("--version", required=True,
                      help="TPU VM runtime version, e.g. v2-alpha-tpuv5-lite (v5e), v2-alpha-tpuv5 (v5p), "
                           "tpu-ubuntu2204-base (v4)")
  parser.add_argument("--bucket_name", required=True, help="GCS bucket for the code and the logs (gs:// optional)")
  parser.add_argument("--bucket_dir", default="multihost_job", help="folder in the bucket (default: multihost_job)")
  tpu_launch.add_common_arguments(parser)
  parser.add_argument("--setup_command", default="bash setup.sh",
                      help="runs on every worker before COMMAND (default: bash setup.sh)")
  parser.add_argument("--cqr_extra_args", default="",
                      help="more queued-resources create flags, e.g. '--spot', '--best-effort' or '--reserved'")
  parser.add_argument("--log_upload_seconds", type=int, default=300,
                      help="how often each worker uploads its log while the job runs (default: 300)")
  parser.add_argument("--local_dir", default=None,
                      help="where the tarball and startup script are written (default: a temp folder)")
  args = tool_args.parse_args(parser, argv)
  tpu_launch.check_common_arguments(args)
  if args.log_upload_seconds < 1:
    raise UserError(f"log_upload_seconds must be at least 1, got {args.log_upload_seconds}")
  bucket = args.bucket_name.removeprefix("gs://").strip("/")
  if not bucket or "/" in bucket:
    raise UserError(f"bucket_name '{args.bucket_name}' must be a bucket name; put folders in bucket_dir")
  args.gcs_dir = "/".join(p for p in ("gs:/", bucket, args.bucket_dir.strip("/"), args.run_name) if p)
  args.local_dir = Path(args.local_dir or Path(tempfile.gettempdir(), "multihost_job", args.run_name))
  return args


def startup_script(args: argparse.Namespace) -> str:
  return STARTUP_TEMPLATE.format(run_name=args.run_name, gcs_dir=shlex.quote(args.gcs_dir),
                                 setup=shlex.quote(args.setup_command), command=shlex.quote(args.command),
                                 upload_seconds=args.log_upload_seconds)


def create_command(gcloud: Gcloud, args: argparse.Namespace, script_path: Path) -> list[str]:
  return tpu_launch.queued_resource_create(gcloud, args.run_name, args.tpu_type, args.version, args.num_slices,
                                           [f"--metadata-from-file=startup-script={script_path}",
                                            *shlex.split(args.cqr_extra_args)])


def follow_up(gcloud: Gcloud, args: argparse.Namespace) -> str:
  status = gcloud.command(*QUEUED_RESOURCES, "describe", args.run_name)
  logs = gcloud.command("storage", "ls", f"{args.gcs_dir}/logs/", zonal=False)
  delete = gcloud.command(*QUEUED_RESOURCES, "delete", args.run_name, "--force", "--async")
  return (f"  status: {tpu_launch.quote(status)}\n"
          f"  logs (every {args.log_upload_seconds} s and at the end): {tpu_launch.quote(logs)}\n"
          f"  delete the slices when done (they are billed until then): {tpu_launch.quote(delete)}")


TOOL = startup.Tool("multihost_job", builds_config=False)


def main(argv: list[str]) -> int:
  startup.start(TOOL, argv)
  args = parse_args(argv[1:])
  gcloud = Gcloud(args.project, args.zone, args.dry_run)
  tarball = args.local_dir / "code.tar.gz"
  script_path = args.local_dir / "startup.sh"
  upload = gcloud.command("storage", "cp", str(tarball), f"{args.gcs_dir}/code.tar.gz", zonal=False)
  create = create_command(gcloud, args, script_path)
  script = startup_script(args)
  if args.dry_run:
    print(f"# package {args.script_dir} into {tarball}, then upload it:")
    gcloud.show(upload)
    print(f"# write this startup script to {script_path}:")
    print(script, end="")
    print("# ask for the slices:")
    gcloud.show(create)
    print("# then:\n" + follow_up(gcloud, args))
    return 0
  tpu_launch.package_directory(args.script_dir, tarball)
  script_path.write_text(script)
  tpu_launch.log_to_stderr(f"uploading {args.script_dir} to {args.gcs_dir}/code.tar.gz ...")
  gcloud.act(upload, "uploading the code")
  tpu_launch.log_to_stderr(f"requesting {args.num_slices} x {args.tpu_type} as queued resource {args.run_name} ...")
  gcloud.act(create, "creating the queued resource")
  print(f"multihost_job: queued resource {args.run_name} requested ({args.num_slices} x {args.tpu_type}); the job "
        "starts on every worker when the capacity is granted.\n" + follow_up(gcloud, args), flush=True)
  return 0


if __name__ == "__main__":
  run_cli(main)
