#!/usr/bin/env bash
# The public v5p-12288 script's model: global_parameter_scale=512 on a 6144-wide base embedding
# (1.50T parameters by this project's count), FSDP x 16-way tensor parallelism, full remat.
# The published table lists a 1160B model on v5p-12288 (304 TFLOP/s/chip, 66.23% MFU) and
# v5p-7680 (295, 64.27%); its exact configuration is not public, so this is the closest public one.
#   bash configs/v5p/v5p-12288.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs [PLATFORM=gce|gke] [DRY_RUN=1]
#   bash configs/v5p/v5p-12288.sh EXECUTABLE=train_compile NUM_SLICES=2   # compile for 2 x v5p-12288 on any machine
source "$(dirname "${BASH_SOURCE[0]}")/../recipe_lib.sh"  # arguments: see recipe_lib.sh
RECIPE_TOPOLOGY=v5p-12288 RECIPE_FLAGS="$V5P_LIBTPU_FLAGS"
RECIPE_ARGS=(global_parameter_scale=512 base_emb_dim=6144 per_device_batch_size=2 remat_policy=full ici_fsdp_parallelism=-1 ici_tensor_parallelism=16 max_target_length=2048 steps=15 enable_checkpointing=false dataset_type=synthetic)
recipe_run "$@"
