#!/usr/bin/env bash
# Llama 2 7B on one node of 8 H100 GPUs: 8-way FSDP, float32 master weights and AdamW state.
#   bash configs/gpu/llama2-7b-8gpu.sh RUN_NAME=my_run OUTPUT_PATH=/data/runs [DRY_RUN=1]
source "$(dirname "${BASH_SOURCE[0]}")/../recipe_lib.sh"  # arguments: see recipe_lib.sh
RECIPE_TOPOLOGY=gpu
# Overlap collectives with compute (latency-hiding scheduler, pipelined collectives, loop double
# buffering), combine small collectives into ~one layer's worth, use cuBLAS rather than Triton
# GEMMs, and keep command buffers (CUDA graphs) to fusions and cuBLAS calls.
RECIPE_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_command_buffer=FUSION,CUBLAS --xla_gpu_enable_triton_gemm=false --xla_gpu_enable_highest_priority_async_stream=true --xla_gpu_all_reduce_combine_threshold_bytes=134217728 --xla_gpu_all_gather_combine_threshold_bytes=134217728 --xla_gpu_reduce_scatter_combine_threshold_bytes=67108864 --xla_gpu_enable_pipelined_all_gather=true --xla_gpu_enable_pipelined_reduce_scatter=true --xla_gpu_enable_pipelined_all_reduce=true --xla_gpu_enable_while_loop_double_buffering=true --xla_gpu_enable_all_gather_combine_by_dim=false --xla_gpu_enable_reduce_scatter_combine_by_dim=false --xla_disable_hlo_passes=rematerialization"
RECIPE_ENV=(XLA_PYTHON_CLIENT_MEM_FRACTION=0.85 CUDA_DEVICE_MAX_CONNECTIONS=1)
RECIPE_ARGS=(hardware=gpu model_name=llama2-7b per_device_batch_size=4 max_target_length=4096
             ici_fsdp_parallelism=8 dcn_data_parallelism=1 remat_policy=full steps=30
             enable_checkpointing=false dataset_type=synthetic)
recipe_run "$@"
