#!/usr/bin/env bash
# Llama-3.1-8B shape trained at 131072 tokens per sequence on a v5p-32 slice (16 chips): the sequence
# split 8 ways (ring attention, zig-zag load balancing) x 2-way FSDP, full remat, one sequence per
# FSDP shard. RoPE: Llama 3.1's frequency scaling (rope_type=llama3, factor 8 over 8192 positions,
# from the model file); rope_type=yarn is the other extension style. AOT figures per strategy
# (all_gather / ring / all_to_all, 32k, 128k and 512k): getting_started/Attention.md.
#   bash configs/long_context/llama3.1-8b-128k.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs [DRY_RUN=1]
#   bash configs/long_context/llama3.1-8b-128k.sh EXECUTABLE=train_compile   # compile for v5p-32 on any machine
#   ... context_parallel_strategy=all_to_all   # or all_gather: a later key=value wins
source "$(dirname "${BASH_SOURCE[0]}")/../recipe_lib.sh"  # arguments: see recipe_lib.sh
RECIPE_TOPOLOGY=v5p-32 RECIPE_FLAGS="$V5P_LIBTPU_FLAGS"
RECIPE_ARGS=(model_name=llama3.1-8b per_device_batch_size=0.125 remat_policy=full ici_fsdp_parallelism=-1 ici_sequence_parallelism=8 data_sharding=data,stage,fsdp,fsdp_transpose,tensor,expert,autoregressive max_target_length=131072 attention=flash context_parallel_strategy=ring context_parallel_load_balance=true flash_block_q=1024 flash_block_kv=1024 steps=15 enable_checkpointing=false dataset_type=synthetic)
recipe_run "$@"
