#!/usr/bin/env bash
# 32B parameters on any number of v5p-128 slices (FSDP x 4-way tensor parallelism).
# Published: 328 TFLOP/s/chip, 71.47% MFU on 1 x v5p-128 (later listed as 67.76%), with 7 sequences per chip.
# Here 6: at 7 the projections remat_policy=minimal saves (~12 GiB per sequence per chip) put XLA at
# 98.3 GiB of 95.7 usable; at 6 the step compiles to 89.1 GiB (getting_started/AOT.md).
#   bash configs/v5p/32b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs [PLATFORM=gce|gke] [DRY_RUN=1]
#   bash configs/v5p/32b.sh EXECUTABLE=train_compile NUM_SLICES=2   # compile for 2 x v5p-128 on any machine
source "$(dirname "${BASH_SOURCE[0]}")/../recipe_lib.sh"  # arguments: see recipe_lib.sh
RECIPE_TOPOLOGY=v5p-128 RECIPE_FLAGS="$V5P_LIBTPU_FLAGS"
RECIPE_ARGS=(global_parameter_scale=32 per_device_batch_size=6 remat_policy=minimal ici_fsdp_parallelism=-1 ici_tensor_parallelism=4 max_target_length=2048 steps=15 enable_checkpointing=false dataset_type=synthetic)
recipe_run "$@"
