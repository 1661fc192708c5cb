# The dependency image XPK/GKE workloads start from: Python, JAX for one DEVICE (installed by
# setup.sh, so the image and a TPU VM get the same pins) and this project. The dependency
# layers depend only on the files setup.sh reads; the code is copied last, so a code change
# rebuilds only the final layer. Build it with docker_build_dependency_image.sh.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG DEVICE=tpu
ARG MODE=stable
ARG EXTRAS=

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

WORKDIR /app
COPY setup.sh pyproject.toml requirements.txt requirements-test.txt requirements-hf.txt requirements-tracking.txt README.md LICENSE ./
# An empty package is enough for setup.sh's editable install; the real one replaces it below
# and the editable install keeps pointing at /app/MaxText.
RUN mkdir -p MaxText && touch MaxText/__init__.py \
    && DEVICE="${DEVICE}" MODE="${MODE}" EXTRAS="${EXTRAS}" bash setup.sh

COPY . .
CMD ["python3", "-m", "MaxText.train", "configs/base.yml"]
