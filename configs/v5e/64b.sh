#!/usr/bin/env bash
# 64B parameters on any number of v5e-256 slices (FSDP within a slice, data parallel across).
# Published: 118 TFLOP/s/chip, 59.90% MFU on 1 x v5e-256.
#   bash configs/v5e/64b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs [PLATFORM=gce|gke] [DRY_RUN=1]
#   bash configs/v5e/64b.sh EXECUTABLE=train_compile NUM_SLICES=2   # compile for 2 x v5e-256 on any machine
source "$(dirname "${BASH_SOURCE[0]}")/../recipe_lib.sh"  # arguments: see recipe_lib.sh
RECIPE_TOPOLOGY=v5e-256 RECIPE_FLAGS="$V5E_LIBTPU_FLAGS"
RECIPE_ARGS=(global_parameter_scale=64 per_device_batch_size=2 remat_policy=full max_target_length=2048 steps=15 enable_checkpointing=false dataset_type=synthetic)
recipe_run "$@"
