#!/usr/bin/env bash
# Installs this project and JAX for one kind of device.
#   bash setup.sh                      # auto: tpu if /dev/accel* or /dev/vfio, gpu if nvidia-smi, else cpu
#   DEVICE=tpu|gpu|cpu bash setup.sh   # choose explicitly
#   EXTRAS=test bash setup.sh          # also the test dependencies (pytest, the GCS test server, and hf)
#   EXTRAS=hf bash setup.sh            # also CPU torch + transformers (the logit checker)
#   EXTRAS=eval bash setup.sh          # also lm-eval (eval_tasks: downstream tasks during training)
#   EXTRAS=tracking bash setup.sh      # also wandb (metric_trackers=wandb: Weights & Biases)
#   MODE=stable|nightly bash setup.sh  # stable (default): released JAX in JAX_RANGE; nightly: the
#                                      # newest pre-release jax/jaxlib (+ libtpu, + the CUDA 13 plugin
#                                      # for DEVICE=gpu) from JAX's nightly wheel index, over the
#                                      # stable install (so every other dependency stays pinned)
#   DRY_RUN=1 bash setup.sh            # print the pip commands instead of running them
# Every mode installs libtpu (through jax's `tpu` extra, so its version matches jaxlib):
# ahead-of-time compilation for TPU topologies needs it on CPU too. Training never
# starts a TPU backend on a machine without a TPU (see `hardware` in configs/base.yml).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

PYTHON="${PYTHON:-python3}"
DEVICE="${DEVICE:-auto}"
EXTRAS="${EXTRAS:-}"
MODE="${MODE:-stable}"
DRY_RUN="${DRY_RUN:-0}"
JAX_RANGE=">=0.10,<0.13"
JAX_NIGHTLY_INDEX="https://us-python.pkg.dev/ml-oss-artifacts-published/jax/simple/"
LIBTPU_NIGHTLY_LINKS="https://storage.googleapis.com/jax-releases/libtpu_releases.html"

case "$MODE" in
  stable|nightly) ;;
  *) echo "error: MODE must be stable or nightly; got '$MODE'" >&2; exit 2 ;;
esac
# A misspelt extra would otherwise install nothing for it, silently.
for extra in ${EXTRAS//,/ }; do
  case "$extra" in
    test|hf|eval|tracking) ;;
    *) echo "error: EXTRAS takes test, hf, eval and tracking, comma-separated; got '$extra'" >&2; exit 2 ;;
  esac
done

pip_install() {
  if [[ "$DRY_RUN" == "1" ]]; then
    printf '%q ' "$PYTHON" -m pip install "$@"
    echo
  else
    "$PYTHON" -m pip install "$@"
  fi
}

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

echo "setup.sh: installing for DEVICE=$DEVICE MODE=$MODE with $PYTHON ($($PYTHON --version 2>&1))"
pip_install --quiet "$JAX_SPEC" -r requirements.txt
if [[ ",$EXTRAS," == *",test,"* ]]; then
  pip_install --quiet -r requirements-test.txt -r requirements-hf.txt
else
  if [[ ",$EXTRAS," == *",hf,"* || ",$EXTRAS," == *",eval,"* ]]; then
    pip_install --quiet -r requirements-hf.txt
  fi
  if [[ ",$EXTRAS," == *",eval,"* ]]; then
    pip_install --quiet -r requirements-eval.txt
  fi
  if [[ ",$EXTRAS," == *",tracking,"* ]]; then
    pip_install --quiet -r requirements-tracking.txt
  fi
fi
pip_install --quiet --no-deps -e .
if [[ "$MODE" == "nightly" ]]; then
  # Swap in the pre-release JAX last, without dependencies: pip would otherwise undo it to
  # satisfy requirements.txt's range, and the stable install above already brought every
  # dependency (CUDA libraries included). libtpu nightlies live on a separate links page.
  NIGHTLY_PACKAGES=(jax jaxlib libtpu)
  [[ "$DEVICE" == "gpu" ]] && NIGHTLY_PACKAGES+=(jax-cuda13-plugin jax-cuda13-pjrt)
  pip_install --quiet -U --pre --no-deps "${NIGHTLY_PACKAGES[@]}" -i "$JAX_NIGHTLY_INDEX" -f "$LIBTPU_NIGHTLY_LINKS"
fi
if [[ "$DRY_RUN" == "1" ]]; then
  exit 0
fi
"$PYTHON" - <<'PY'
import jax, flax, optax
print(f"setup.sh: ok: jax {jax.__version__}, flax {flax.__version__}, optax {optax.__version__}")
PY
