#!/usr/bin/env bash
# 512B parameters on v5p-1024 slices (FSDP x 8-way tensor parallelism, full rematerialisation).
# Published: 294 TFLOP/s/chip, 63.99% MFU on 1 x v5p-1024.
#   bash configs/v5p/512b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs [PLATFORM=gce|gke] [DRY_RUN=1]
#   bash configs/v5p/512b.sh EXECUTABLE=train_compile NUM_SLICES=2   # compile for 2 x v5p-1024 on any machine
source "$(dirname "${BASH_SOURCE[0]}")/../recipe_lib.sh"  # arguments: see recipe_lib.sh
RECIPE_TOPOLOGY=v5p-1024 RECIPE_FLAGS="$V5P_LIBTPU_FLAGS"
RECIPE_ARGS=(global_parameter_scale=512 per_device_batch_size=2 remat_policy=full ici_fsdp_parallelism=-1 ici_tensor_parallelism=8 max_target_length=2048 steps=15 enable_checkpointing=false dataset_type=synthetic)
recipe_run "$@"
