#!/usr/bin/env bash
# 128B parameters on any number of v5e-256 slices: 16-way FSDP x 16-way tensor parallelism in a
# slice, activations offloaded to host memory. Published: 110 TFLOP/s/chip, 56.06% MFU on 1 x v5e-256.
#   bash configs/v5e/128b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs [PLATFORM=gce|gke] [DRY_RUN=1]
#   bash configs/v5e/128b.sh EXECUTABLE=train_compile NUM_SLICES=2   # compile for 2 x v5e-256 on any machine
source "$(dirname "${BASH_SOURCE[0]}")/../recipe_lib.sh"  # arguments: see recipe_lib.sh
RECIPE_TOPOLOGY=v5e-256 RECIPE_FLAGS="$V5E_LIBTPU_FLAGS"
RECIPE_ARGS=(global_parameter_scale=128 per_device_batch_size=1 remat_policy=minimal_offloaded ici_fsdp_parallelism=16 ici_tensor_parallelism=16 max_target_length=2048 steps=15 enable_checkpointing=false dataset_type=synthetic)
recipe_run "$@"
