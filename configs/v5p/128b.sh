#!/usr/bin/env bash
# 128B parameters on v5p-256 (or v5p-512) slices (FSDP x 8-way tensor parallelism).
# Published: 315 TFLOP/s/chip, 68.68% MFU on 1 x v5p-256.
#   bash configs/v5p/128b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs [PLATFORM=gce|gke] [DRY_RUN=1]
#   bash configs/v5p/128b.sh EXECUTABLE=train_compile NUM_SLICES=2   # compile for 2 x v5p-256 on any machine
source "$(dirname "${BASH_SOURCE[0]}")/../recipe_lib.sh"  # arguments: see recipe_lib.sh
RECIPE_TOPOLOGY=v5p-256 RECIPE_FLAGS="$V5P_LIBTPU_FLAGS"
RECIPE_ARGS=(global_parameter_scale=128 per_device_batch_size=1 remat_policy=minimal ici_fsdp_parallelism=-1 ici_tensor_parallelism=8 max_target_length=2048 steps=15 enable_checkpointing=false dataset_type=synthetic)
recipe_run "$@"
