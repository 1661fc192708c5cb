"""Cloud endpoints from the environment, before any library opens a gs:// path (imported by
start-up and storage alike, so it imports nothing of the project)."""

from __future__ import annotations

import os
from typing import MutableMapping


def configure_cloud_env(environ: MutableMapping[str, str] | None = None) -> None:
  """Hands `STORAGE_EMULATOR_HOST` on to every library with its own endpoint setting.

  Must run before the first `gs://` access (the entry points call it first thing). The
  Google client (tensorboardX's GCS writer) and gcsfs (etils.epath) read the variable
  themselves; TensorStore (Orbax's array storage) needs its own URL and a token, since
  without one it asks the GCE metadata server for credentials; gcsfs's bucket-layout
  probe speaks the storage-control gRPC API, which emulators do not serve.
  Values the user set are left alone."""
  env = os.environ if environ is None else environ
  host = env.get("STORAGE_EMULATOR_HOST", "")
  if not host or host == "default":
    return
  url = host if "://" in host else f"http://{host}"
  env.setdefault("TENSORSTORE_GCS_HTTP_URL", url)
  env.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
  env.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
