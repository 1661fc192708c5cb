#!/usr/bin/env bash
# Builds the dependency image for XPK / GKE workloads from ./Dockerfile (JAX for DEVICE through
# setup.sh, then this project's code).
#   bash docker_build_dependency_image.sh [DEVICE=tpu|gpu|cpu] [MODE=stable|nightly]
#        [LOCAL_IMAGE_NAME=maxtext_base_image] [EXTRAS=test] [BASE_IMAGE=python:3.11-slim-bookworm] [DRY_RUN=1]
# Then run it with `xpk workload create --base-docker-image=LOCAL_IMAGE_NAME ...`
# (getting_started/Run_on_GKE_XPK.md). DRY_RUN=1 prints the docker command instead.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

DEVICE=tpu
MODE=stable
LOCAL_IMAGE_NAME=maxtext_base_image
EXTRAS=""
BASE_IMAGE=""
DRY_RUN=0

fail() {
  echo "error: docker_build_dependency_image.sh: $*" >&2
  exit 2
}

for arg in "$@"; do
  case "$arg" in
    DEVICE=*) DEVICE="${arg#*=}" ;;
    MODE=*) MODE="${arg#*=}" ;;
    LOCAL_IMAGE_NAME=*) LOCAL_IMAGE_NAME="${arg#*=}" ;;
    EXTRAS=*) EXTRAS="${arg#*=}" ;;
    BASE_IMAGE=*) BASE_IMAGE="${arg#*=}" ;;
    DRY_RUN=*) DRY_RUN="${arg#*=}" ;;
    *) fail "unexpected argument '$arg' (expected DEVICE=, MODE=, LOCAL_IMAGE_NAME=, EXTRAS=, BASE_IMAGE= or DRY_RUN=)" ;;
  esac
done
case "$DEVICE" in tpu|gpu|cpu) ;; *) fail "DEVICE must be tpu, gpu or cpu (an image has no device to detect), got '$DEVICE'" ;; esac
case "$MODE" in stable|nightly) ;; *) fail "MODE must be stable or nightly, got '$MODE'" ;; esac
[[ -n "$LOCAL_IMAGE_NAME" ]] || fail "LOCAL_IMAGE_NAME is empty"

cmd=(docker build --file Dockerfile --tag "$LOCAL_IMAGE_NAME"
     --build-arg "DEVICE=$DEVICE" --build-arg "MODE=$MODE" --build-arg "EXTRAS=$EXTRAS")
[[ -n "$BASE_IMAGE" ]] && cmd+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
cmd+=(.)

if [[ "$DRY_RUN" == "1" ]]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
command -v docker >/dev/null 2>&1 || fail "docker is not installed (https://docs.docker.com/engine/install/)"
echo "building $LOCAL_IMAGE_NAME for DEVICE=$DEVICE MODE=$MODE ..."
"${cmd[@]}"
echo "built $LOCAL_IMAGE_NAME; run it with: xpk workload create --base-docker-image=$LOCAL_IMAGE_NAME ..."
