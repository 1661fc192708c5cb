#!/usr/bin/env bash
# On the GPU machine (no network): installs the wheels that benchmarks/fetch_upstream_wheels.sh
# fetched, from whichever of .whl/ and .whl_xprof/ this call carried.
# - every wheel into /tmp/site (SITE=...): upstream MaxText's own folder, which gpu_suite.py puts on
#   upstream's PYTHONPATH only;
# - the few of them that this project's serving and logging import and the GPU image lacks (FastAPI
#   and what it imports, tensorboardX, Grain) into the image's python3 as well, for our rows.
# The folders can come in two calls on the same warm machine (getting_started/GPU.md says why).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SITE=${SITE:-/tmp/site}
OURS=(fastapi starlette uvicorn pydantic pydantic_core annotated_types typing_inspection opentelemetry_api
      tensorboardx grain array_record)
# `|| true` for grep alone (nothing left after the filter); pipefail still stops at a failed install.
pip_quiet() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$@" 2>&1 \
  | { grep -v "already exists" || true; }; }
for dir in .whl .whl_xprof; do
  [ -d "$dir" ] || continue
  shopt -s nullglob
  wheels=("$dir"/*.whl)
  [ ${#wheels[@]} -gt 0 ] || continue
  pip_quiet --upgrade --target "$SITE" "${wheels[@]}"
  ours=()
  for name in "${OURS[@]}"; do
    ours+=("$dir"/"$name"-[0-9]*.whl)
  done
  [ ${#ours[@]} -eq 0 ] || pip_quiet "${ours[@]}"
  echo "gpu_install: ${#wheels[@]} wheels from $dir into $SITE; ${#ours[@]} of them into $(command -v python3) too"
done
