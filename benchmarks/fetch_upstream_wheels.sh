#!/usr/bin/env bash
# Downloads the PyPI maxtext package and the packages it imports that the GPU machine's image lacks
# into .whl/ (ignored by git), for benchmarks/gpu_suite.py's upstream rows. Never a dependency of
# this project: the suite runs them from a `pip install --target` folder in a subprocess.
#   bash benchmarks/fetch_upstream_wheels.sh            # then carry .whl to the GPU machine
#   WHEEL_DIR=/tmp/w bash benchmarks/fetch_upstream_wheels.sh
# The list is what a synthetic-data train run of maxtext 0.2.5 (bf16 and fp8) imported in a Python
# 3.12 venv, less what the GPU image already holds (jax, flax, optax, orbax-checkpoint, chex,
# transformers, protobuf, ...: /work/.library/device/KINDS.md); versions are the ones that ran.
# Each is fetched with --no-deps, so the set is exactly this list.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DIR=${WHEEL_DIR:-.whl}
PYTHON=${PYTHON:-python3}
PACKAGES=(
  maxtext==0.2.5
  # pure Python
  annotated-types==0.8.0 aqtp==0.9.0 drjax==0.2.1 einshape==1.0 fastapi==0.165.0 fire==0.7.1
  google-api-core==2.44.0 google-auth==2.63.0 google-cloud-core==2.8.0 google-cloud-storage==3.17.1
  google-resumable-media==2.11.0 googleapis-common-protos==1.76.0 grpcio-status==1.85.3 httpcore2==2.16.2
  httpx2==2.16.2 immutabledict==4.3.1 ml-collections==1.1.0 omegaconf==2.4.0 opentelemetry-api==1.45.2
  pathwaysutils==0.1.13 portpicker==1.6.0 pydantic==2.14.4 qwix==0.1.8 starlette==1.10.0 tensorboardx==2.6.5
  termcolor==3.3.0 tokamax==0.0.17 truststore==0.10.5 typing-inspection==0.4.5 uvicorn==0.54.0
  # compiled (manylinux x86_64, CPython 3.12)
  array-record==0.8.6 cffi==2.1.1 cryptography==50.0.2 google-crc32c==1.9.0 grain==0.2.18
  pydantic-core==2.50.5 xprof==2.24.2
)
PLATFORMS=()
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 \
         manylinux2014 manylinux1; do
  PLATFORMS+=(--platform "${p}_x86_64")
done
mkdir -p "$DIR"
"$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$DIR" "${PACKAGES[@]}"
# xprof (a profiler that tokamax imports) is half the bytes: it goes in a folder of its own, carried
# by a first device call, since the rest and the working tree together already fill one call's 64 MiB.
mkdir -p "${DIR}_xprof"
mv "$DIR"/xprof-*.whl "${DIR}_xprof/"
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)  # the tracked tree travels too
limit=$((64 * 1024 * 1024))
for part in "$DIR" "${DIR}_xprof"; do
  bytes=$(du -cb "$part"/*.whl | tail -1 | cut -f1)
  echo "$part: $(ls "$part"/*.whl | wc -l) wheels, $bytes bytes; with the tracked tree ($tree bytes):" \
       "$((bytes + tree)) of the $limit bytes (64 MiB) one device call carries"
  if [ $((bytes + tree)) -gt "$limit" ]; then
    echo "too large for one call: split $part further (getting_started/GPU.md)" >&2
    exit 1
  fi
done
