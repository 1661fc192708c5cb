"""Stands in for `MaxText.train` on the fake gcloud's TPU VMs and queued slices (tests of the elastic
launchers): says how it started, records its arguments and the resize time it was given, ends with
143 on SIGTERM (as train.py does after its save), and dies by SIGKILL or ends when a test says so.

    python3 worker.py SHARED ARGS...            (the shared folder first)
    FAKE_SHARED=SHARED python3 -m MaxText.train ARGS...
"""

import os
import pathlib
import signal
import sys
import time

if "FAKE_SHARED" in os.environ:
  shared, args = pathlib.Path(os.environ["FAKE_SHARED"]), sys.argv[1:]
else:
  shared, args = pathlib.Path(sys.argv[1]), sys.argv[2:]
me = os.environ["FAKE_SLICE"]
print("state: resumed from step 3 of the persistent tier" if (shared / "resumed").exists() else
      "state: initialised from seed 0", flush=True)
with (shared / f"args_{me}").open("a") as f:
  f.write(" ".join(args) + "\n")
with (shared / f"env_{me}").open("a") as f:
  f.write(os.environ.get("MAXTEXT_ELASTIC_RESIZE_DETECTED", "-") + "\n")
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
while True:
  if (shared / f"kill_{me}").exists():
    (shared / f"kill_{me}").unlink()
    os.kill(os.getpid(), signal.SIGKILL)
  if (shared / "finish").exists():
    sys.exit(0)
  time.sleep(0.1)
