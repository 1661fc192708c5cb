#!/usr/bin/env bash
# 32B parameters on any number of v5p-128 slices (pure FSDP).
# Published: 328 TFLOP/s/chip, 71.47% MFU on 1 x v5p-128 (later listed as 67.76%), with 7 sequences per chip,
# remat_policy=minimal and 4-way tensor parallelism, which do not fit here at 7 sequences (getting_started/AOT.md).
# The same 7 sequences per chip with the setting MaxText.plan found (getting_started/Planner.md): pure FSDP,
# saving the attention projections but not the MLP's.
#   bash configs/v5p/32b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs [PLATFORM=gce|gke] [DRY_RUN=1]
#   bash configs/v5p/32b.sh EXECUTABLE=train_compile NUM_SLICES=2   # compile for 2 x v5p-128 on any machine
source "$(dirname "${BASH_SOURCE[0]}")/../recipe_lib.sh"  # arguments: see recipe_lib.sh
RECIPE_TOPOLOGY=v5p-128 RECIPE_FLAGS="$V5P_LIBTPU_FLAGS"
RECIPE_ARGS=(global_parameter_scale=32 per_device_batch_size=7 remat_policy=save_dot_except_mlp ici_fsdp_parallelism=-1 max_target_length=2048 steps=15 enable_checkpointing=false dataset_type=synthetic)
recipe_run "$@"
