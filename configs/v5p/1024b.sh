#!/usr/bin/env bash
# 1024B parameters on v5p-2048 (or v5p-4096) slices (FSDP x 8-way tensor parallelism, full remat).
# Published: 249 TFLOP/s/chip, 64.05% MFU on 1 x v5p-2048; 297 TFLOP/s/chip, 64.80% on v5p-4096.
#   bash configs/v5p/1024b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs [PLATFORM=gce|gke] [DRY_RUN=1]
#   bash configs/v5p/1024b.sh EXECUTABLE=train_compile NUM_SLICES=2   # compile for 2 x v5p-2048 on any machine
source "$(dirname "${BASH_SOURCE[0]}")/../recipe_lib.sh"  # arguments: see recipe_lib.sh
RECIPE_TOPOLOGY=v5p-2048 RECIPE_FLAGS="$V5P_LIBTPU_FLAGS"
RECIPE_ARGS=(global_parameter_scale=1024 per_device_batch_size=2 remat_policy=full ici_fsdp_parallelism=-1 ici_tensor_parallelism=8 max_target_length=2048 steps=15 enable_checkpointing=false dataset_type=synthetic)
recipe_run "$@"
