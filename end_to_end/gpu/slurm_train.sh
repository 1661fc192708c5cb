#!/usr/bin/env bash
#SBATCH --job-name=maxtext-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
# Multi-node GPU training under SLURM (getting_started/Run_on_GPU_SLURM.md):
#
#   sbatch end_to_end/gpu/slurm_train.sh [train.py key=value ...]                 # one process per GPU
#   PROCESSES=node sbatch --ntasks-per-node=1 end_to_end/gpu/slurm_train.sh ...   # one process per node
#
# Submit from the repository root (or set REPO_DIR): srun re-runs this file from there on every
# node, because the copy sbatch keeps lives only on the first node. Every process gets
# JAX_COORDINATOR_ADDRESS (first node, port COORDINATOR_PORT), JAX_PROCESS_COUNT and
# JAX_PROCESS_ID, which MaxText/platform/distributed.py reads. Optional environment:
#   RUN_NAME=...          default slurm-<job id>, the same on every process
#   COORDINATOR_PORT=...  default derived from the job id, so jobs sharing a node do not collide
#   CONFIG=...            default configs/base.yml
#   DRY_RUN=1             each task prints its environment and command instead of training
set -euo pipefail

fail() {
  echo "error: slurm_train.sh: $*" >&2
  exit 2
}

# ---- inside one srun task: this process's identity, then train ----------------------------------
if [[ "${SLURM_TRAIN_TASK:-0}" == "1" ]]; then
  export JAX_PROCESS_ID="$SLURM_PROCID"
  if [[ "$PROCESSES" == "node" ]]; then
    # JAX's own SLURM detection would give each process only GPU number SLURM_LOCALID; a
    # process per node must see all of its node's GPUs, so hide that variable from it.
    unset SLURM_LOCALID
  fi
  cd "$REPO_DIR"
  cmd=(python3 -m MaxText.train "${CONFIG:-configs/base.yml}" "run_name=${RUN_NAME:-slurm-$SLURM_JOB_ID}" "$@")
  if [[ "${DRY_RUN:-0}" == "1" ]]; then
    echo "task $JAX_PROCESS_ID/$JAX_PROCESS_COUNT on $(hostname): JAX_COORDINATOR_ADDRESS=$JAX_COORDINATOR_ADDRESS" \
         "SLURM_LOCALID=${SLURM_LOCALID:-unset} $(printf '%q ' "${cmd[@]}")"
    exit 0
  fi
  exec "${cmd[@]}"
fi

# ---- the batch step, on the first node: where the coordinator is, then one task per process ----
[[ -n "${SLURM_JOB_ID:-}" ]] || fail "run it with sbatch (or inside salloc): SLURM_JOB_ID is not set"
export PROCESSES="${PROCESSES:-gpu}"
case "$PROCESSES" in gpu|node) ;; *) fail "PROCESSES must be gpu or node, got '$PROCESSES'" ;; esac
export REPO_DIR="${REPO_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}"
[[ -f "$REPO_DIR/MaxText/train.py" ]] || fail "REPO_DIR=$REPO_DIR is not this repository; submit from its root or set REPO_DIR"

num_nodes="${SLURM_JOB_NUM_NODES:-1}"
num_tasks="${SLURM_NTASKS:-$num_nodes}"
if [[ "$PROCESSES" == "node" && "$num_tasks" != "$num_nodes" ]]; then
  fail "PROCESSES=node needs one task per node (sbatch --ntasks-per-node=1); this job has $num_tasks tasks on $num_nodes nodes"
fi
# sed, not head: head exits early, and under pipefail scontrol's SIGPIPE would fail the script.
head_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"
export JAX_COORDINATOR_ADDRESS="$head_node:${COORDINATOR_PORT:-$((SLURM_JOB_ID % 4096 + 61440))}"
export JAX_PROCESS_COUNT="$num_tasks"
export SLURM_TRAIN_TASK=1
echo "slurm_train.sh: $num_tasks process(es) on $num_nodes node(s), one per $PROCESSES; coordinator $JAX_COORDINATOR_ADDRESS"
# --kill-on-bad-exit: one failed process ends the job instead of leaving the others waiting.
srun --kill-on-bad-exit=1 --export=ALL bash "$REPO_DIR/end_to_end/gpu/slurm_train.sh" "$@"
