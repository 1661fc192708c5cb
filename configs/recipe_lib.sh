# Sourced by every recipe under configs/{v5e,v5p,largest_job,gpu}/: reads the recipe's
# KEY=VALUE arguments, prints (DRY_RUN=1) or runs the train.py / train_compile.py command.
#
# A recipe sets, then calls `recipe_run "$@"`:
#   RECIPE_TOPOLOGY   the TPU slice type it was tuned for (v5e-256, v5p-1024, ...), or "gpu"
#   RECIPE_ARGS       array of train.py key=value settings
#   RECIPE_FLAGS      LIBTPU_INIT_ARGS (TPU) or XLA_FLAGS (GPU) the recipe needs
#   RECIPE_ENV        optional array of NAME=VALUE exported for the run
#   RECIPE_NUM_SLICES optional: how many slices of RECIPE_TOPOLOGY its dcn_* degrees span (default 1), NUM_SLICES's
#                     default (the planner writes it for a multi-slice plan)
#
# Arguments every recipe takes (any other KEY=value with a lower-case key goes to train.py):
#   RUN_NAME=...       required on GCE (every host must use the same name); on GKE it defaults
#                      to $JOBSET_NAME, which the JobSet controller sets in every pod
#   OUTPUT_PATH=...    base_output_directory (default: outputs)
#   DATASET_PATH=...   passed on as dataset_path; the recipes keep dataset_type=synthetic (as the
#                      published throughput runs did): add dataset_type=tfds dataset_name=... to use it
#   PLATFORM=gce|gke   where the job runs (default gce; largest_job recipes default to gke)
#   EXECUTABLE=train|train_compile   train_compile compiles for RECIPE_TOPOLOGY without TPUs
#   NUM_SLICES=N       with EXECUTABLE=train_compile: how many slices to compile for (default RECIPE_NUM_SLICES)
#   DRY_RUN=1          print the exact command instead of running it

set -euo pipefail
RECIPE_REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RECIPE_PLATFORM_DEFAULT="gce"
RECIPE_ENV=()
RECIPE_FLAGS=""
RECIPE_NUM_SLICES=1

# Published LIBTPU_INIT_ARGS of the v5e and v5p performance configurations: overlap of
# data-parallel all-reduces and of FSDP all-gathers with compute. On v5p the all-gathers go to the
# SparseCores instead of being fused with compute: libtpu 0.0.48 and later refuse that fusion on v5p.
V5E_LIBTPU_FLAGS="--xla_tpu_enable_data_parallel_all_reduce_opt=true --xla_tpu_data_parallel_opt_different_sized_ops=true --xla_tpu_enable_async_collective_fusion=true --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true --xla_tpu_enable_async_collective_fusion_multiple_steps=true --xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true"
V5P_LIBTPU_FLAGS="--xla_tpu_enable_async_collective_fusion_fuse_all_gather=false --xla_tpu_megacore_fusion_allow_ags=false --xla_enable_async_collective_permute=true --xla_tpu_enable_ag_backward_pipelining=true --xla_tpu_enable_data_parallel_all_reduce_opt=true --xla_tpu_data_parallel_opt_different_sized_ops=true --xla_tpu_enable_async_collective_fusion=true --xla_tpu_enable_async_collective_fusion_multiple_steps=true --xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true --xla_sc_disable_megacore_partitioning=true --xla_tpu_use_tc_device_shape_on_sc=true --xla_tpu_enable_sparse_core_collective_offload_all_gather=true"

# Multislice jobs of thousands of hosts on GKE: default PLATFORM=gke, and let the idle gRPC
# connections to the coordinator send keepalive pings without being cut off.
recipe_use_largest_job_settings() {
  RECIPE_PLATFORM_DEFAULT="gke"
  RECIPE_ENV=(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS=1 GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS=0
              GRPC_ARG_HTTP2_MAX_PING_STRIKES=0)
}

_recipe_fail() {
  echo "error: $(basename "$0"): $*" >&2
  exit 2
}

_recipe_quote() {
  local out="" word
  for word in "$@"; do
    out+=" $(printf '%q' "$word")"
  done
  echo "${out# }"
}

recipe_run() {
  local run_name="" output_path="outputs" dataset_path="" platform="$RECIPE_PLATFORM_DEFAULT"
  local executable="train" num_slices="$RECIPE_NUM_SLICES" dry_run=0 arg
  local -a passthrough=()
  for arg in "$@"; do
    case "$arg" in
      RUN_NAME=*) run_name="${arg#*=}" ;;
      OUTPUT_PATH=*) output_path="${arg#*=}" ;;
      DATASET_PATH=*) dataset_path="${arg#*=}" ;;
      PLATFORM=*) platform="${arg#*=}" ;;
      EXECUTABLE=*) executable="${arg#*=}"; executable="${executable%.py}" ;;
      NUM_SLICES=*) num_slices="${arg#*=}" ;;
      DRY_RUN=*) dry_run="${arg#*=}" ;;
      [a-z]*=*) passthrough+=("$arg") ;;
      *) _recipe_fail "unexpected argument '$arg' (expected RUN_NAME=, OUTPUT_PATH=, DATASET_PATH=, PLATFORM=, EXECUTABLE=, NUM_SLICES=, DRY_RUN= or a lower-case train.py key=value)" ;;
    esac
  done
  case "$platform" in gce|gke) ;; *) _recipe_fail "PLATFORM must be gce or gke, got '$platform'" ;; esac
  case "$executable" in train|train_compile) ;; *) _recipe_fail "EXECUTABLE must be train or train_compile, got '$executable'" ;; esac
  [[ "$num_slices" =~ ^[1-9][0-9]*$ ]] || _recipe_fail "NUM_SLICES must be a positive integer, got '$num_slices'"
  if [[ -z "$run_name" && "$platform" == "gke" ]]; then
    run_name="${JOBSET_NAME:-}"
  fi
  if [[ -z "$run_name" && "$executable" == "train" ]]; then
    _recipe_fail "RUN_NAME=... is required (every host of a multi-host job must use the same run name)"
  fi

  local -a cmd=(python3 -m "MaxText.$executable" configs/base.yml)
  [[ -n "$run_name" ]] && cmd+=("run_name=$run_name")
  cmd+=("base_output_directory=$output_path" "${RECIPE_ARGS[@]}")
  [[ -n "$dataset_path" ]] && cmd+=("dataset_path=$dataset_path")
  if [[ "$executable" == "train_compile" ]]; then
    [[ "$RECIPE_TOPOLOGY" == "gpu" ]] && _recipe_fail "EXECUTABLE=train_compile compiles for TPU topologies; GPU recipes compile when they start"
    cmd+=("compile_topology=$RECIPE_TOPOLOGY" "compile_topology_num_slices=$num_slices")
  fi
  cmd+=("${passthrough[@]}")

  # Flags the user exported come last, so they win (absl flag parsing keeps the last value).
  local flag_var="LIBTPU_INIT_ARGS"
  [[ "$RECIPE_TOPOLOGY" == "gpu" ]] && flag_var="XLA_FLAGS"
  local flags="$RECIPE_FLAGS${!flag_var:+ ${!flag_var}}"
  local -a env_assignments=("${RECIPE_ENV[@]}" "$flag_var=$flags")

  if [[ "$dry_run" == "1" ]]; then
    echo "cd $(printf '%q' "$RECIPE_REPO_ROOT") && $(_recipe_quote env "${env_assignments[@]}" "${cmd[@]}")"
    return 0
  fi
  cd "$RECIPE_REPO_ROOT"
  exec env "${env_assignments[@]}" "${cmd[@]}"
}
