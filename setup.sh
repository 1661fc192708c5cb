#!/usr/bin/env bash
# Installs this project and JAX for one kind of device.
#   bash setup.sh                      # auto: tpu if /dev/accel* or /dev/vfio, gpu if nvidia-smi, else cpu
#   DEVICE=tpu|gpu|cpu bash setup.sh   # choose explicitly
#   EXTRAS=test bash setup.sh          # also the test dependencies (pytest, CPU torch, transformers)
# Every mode installs libtpu (through jax's `tpu` extra, so its version matches jaxlib):
# ahead-of-time compilation for TPU topologies needs it on CPU too. Training never
# starts a TPU backend on a machine without a TPU (see `hardware` in configs/base.yml).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

PYTHON="${PYTHON:-python3}"
DEVICE="${DEVICE:-auto}"
EXTRAS="${EXTRAS:-}"
JAX_RANGE=">=0.10,<0.13"

if [[ "$DEVICE" == "auto" ]]; then
  if compgen -G "/dev/accel*" >/dev/null || compgen -G "/dev/vfio/[0-9]*" >/dev/null; then
    DEVICE=tpu
  elif command -v nvidia-smi >/dev/null 2>&1; then
    DEVICE=gpu
  else
    DEVICE=cpu
  fi
fi

case "$DEVICE" in
  tpu|cpu) JAX_SPEC="jax[tpu]${JAX_RANGE}" ;;
  gpu)     JAX_SPEC="jax[cuda13,tpu]${JAX_RANGE}" ;;
  *) echo "error: DEVICE must be tpu, gpu, cpu or auto; got '$DEVICE'" >&2; exit 2 ;;
esac

echo "setup.sh: installing for DEVICE=$DEVICE with $PYTHON ($($PYTHON --version 2>&1))"
"$PYTHON" -m pip install --quiet "$JAX_SPEC" -r requirements.txt
if [[ ",$EXTRAS," == *",test,"* ]]; then
  "$PYTHON" -m pip install --quiet -r requirements-test.txt
fi
"$PYTHON" -m pip install --quiet --no-deps -e .
"$PYTHON" - <<'PY'
import jax, flax, optax
print(f"setup.sh: ok: jax {jax.__version__}, flax {flax.__version__}, optax {optax.__version__}")
PY
