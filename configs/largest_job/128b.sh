#!/usr/bin/env bash
# 128b for the largest multislice jobs: many v5e-256 slices on GKE, data parallel across slices.
# Same model and batch as configs/v5e/128b.sh (remat_policy=full everywhere), gRPC keepalive settings for
# thousands of hosts, PLATFORM=gke by default.
#   bash configs/largest_job/128b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs [PLATFORM=gce|gke] [DRY_RUN=1]
#   bash configs/largest_job/128b.sh EXECUTABLE=train_compile NUM_SLICES=2   # compile for 2 x v5e-256 on any machine
source "$(dirname "${BASH_SOURCE[0]}")/../recipe_lib.sh"  # arguments: see recipe_lib.sh
RECIPE_TOPOLOGY=v5e-256 RECIPE_FLAGS="$V5E_LIBTPU_FLAGS"
recipe_use_largest_job_settings
RECIPE_ARGS=(global_parameter_scale=128 per_device_batch_size=1 remat_policy=full ici_fsdp_parallelism=16 ici_tensor_parallelism=16 max_target_length=2048 steps=30 enable_checkpointing=false dataset_type=synthetic)
recipe_run "$@"
