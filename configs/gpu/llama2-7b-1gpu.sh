#!/usr/bin/env bash
# Llama 2 7B on a single 80 GB H100. float32 weights plus AdamW moments would need 16 bytes per
# parameter (~108 GB), so this recipe keeps weights and optimizer state in bfloat16 (~54 GB
# with gradients) and rematerialises every layer.
#   bash configs/gpu/llama2-7b-1gpu.sh RUN_NAME=my_run OUTPUT_PATH=/data/runs [DRY_RUN=1]
source "$(dirname "${BASH_SOURCE[0]}")/../recipe_lib.sh"  # arguments: see recipe_lib.sh
RECIPE_TOPOLOGY=gpu
# One device has no collectives to overlap: what matters is cuBLAS GEMMs and command buffers
# (CUDA graphs) to cut kernel-launch overhead.
RECIPE_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_command_buffer=FUSION,CUBLAS --xla_gpu_enable_triton_gemm=false --xla_gpu_enable_while_loop_double_buffering=true"
RECIPE_ENV=(XLA_PYTHON_CLIENT_MEM_FRACTION=0.9)
RECIPE_ARGS=(hardware=gpu model_name=llama2-7b weight_dtype=bfloat16 per_device_batch_size=2 max_target_length=4096
             remat_policy=full steps=30 enable_checkpointing=false dataset_type=synthetic)
recipe_run "$@"
