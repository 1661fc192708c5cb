#!/usr/bin/env bash
# grpo.sh's GRPO run in the layouts of RL.md's rollout-mesh section on 8 simulated CPU devices, with
# the held-out reward against training wall-clock time:
#   same    rollouts on the training mesh (8 devices)
#   split   4 devices train, 4 roll out, weights copied every update
#   async1  split, rl_max_staleness=1 (a copy every 2 updates, the batch between made ahead)
#   async2  split, rl_max_staleness=2 (a copy every 3 updates)
# Every mode trains on 64 completions per step (8 prompts x 8) from grpo.sh's SFT model; every EVERY
# steps its parameters are scored on the held-out prompts. Prints one line per checkpoint:
#   curve MODE STEP WALL_S REWARD
# WALL_S: the run's step seconds summed up to STEP (rollouts, copies and updates; compilation in the
# first steps included, process start-up not). Then the proof the script asserts (when the curve
# holds same and an async mode): the target is same's held-out reward at its last step less MARGIN
# (default 0.03); an async mode must reach it at a checkpoint of fewer seconds than same needed to.
#   bash end_to_end/cpu/grpo_async.sh [OUTPUT_DIR]   (runs grpo.sh there first unless its sft/ exists)
# Needs the hf extra (EXTRAS=hf bash setup.sh): the chat template is rendered by transformers.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
: "${GRPO_STEPS:=240}" "${EVERY:=60}" "${MODES:=same split async1 async2}"
OUT="${1:-$(mktemp -d)}"
mkdir -p "$OUT"
[ -d "$OUT/sft" ] || bash end_to_end/cpu/grpo.sh "$OUT"

DATA="$OUT/data"
MODEL=(base_emb_dim=128 base_num_query_heads=4 base_num_kv_heads=2 head_dim=32 base_mlp_dim=384
       base_num_decoder_layers=2 vocab_size=512 max_target_length=40 print_config=False cpu_peak_tflops=0.1
       tokenizer_type=huggingface tokenizer_path="$OUT/tokenizer" base_output_directory="$OUT/runs"
       enable_tensorboard=False)
GRPO=("${MODEL[@]}" max_prefill_predict_length=32 max_completion_length=8 reward_functions=exact_match)
export JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8

for mode in $MODES; do
  case $mode in
    same) keys=(per_device_batch_size=8) ;;
    split) keys=(per_device_batch_size=16 rl_rollout_devices=4) ;;
    async1) keys=(per_device_batch_size=16 rl_rollout_devices=4 rl_max_staleness=1 rl_weight_sync_interval=2) ;;
    async2) keys=(per_device_batch_size=16 rl_rollout_devices=4 rl_max_staleness=2 rl_weight_sync_interval=3) ;;
    *) echo "error: MODES: unknown mode $mode; choose from same split async1 async2" >&2; exit 2 ;;
  esac
  rm -rf "$OUT/runs/async_$mode"
  python3 -m MaxText.train configs/grpo.yml run_name="async_$mode" "${GRPO[@]}" load_parameters_path="$OUT/sft" \
    hf_data_files="$DATA/prompts.jsonl" steps="$GRPO_STEPS" num_generations=8 learning_rate=2e-3 \
    cosine_learning_rate_final_fraction=1.0 checkpoint_period="$EVERY" async_checkpointing=False log_period=1 \
    "${keys[@]}" > "$OUT/stdout_async_$mode.txt"
  grep -q '^done' "$OUT/stdout_async_$mode.txt" || { echo "error: GRPO run $mode did not finish" >&2; exit 1; }
  for step in $(seq "$EVERY" "$EVERY" "$GRPO_STEPS"); do
    params="$OUT/params_async_${mode}_$step"
    rm -rf "$params"
    python3 -m MaxText.generate_param_only_checkpoint configs/base.yml run_name="async_$mode" "${MODEL[@]}" \
      load_full_state_path="$OUT/runs/async_$mode/checkpoints/$step" param_only_checkpoint_path="$params" > /dev/null
    reward=$(python3 -m MaxText.rl.evaluate configs/grpo.yml "${GRPO[@]}" load_parameters_path="$params" \
      hf_data_files="$DATA/heldout.jsonl" num_generations=8 | grep -E '^reward ' | tail -1 | awk '{print $2}')
    wall=$(python3 -c "import json, sys; print(round(sum(r['step_seconds'] for r in map(json.loads, open(sys.argv[1])) \
      if r['step'] <= int(sys.argv[2])), 1))" "$OUT/runs/async_$mode/metrics.jsonl" "$step")
    echo "curve $mode $step $wall $reward" | tee -a "$OUT/curve.txt"
  done
done

python3 - "$OUT/curve.txt" "${MARGIN:-0.03}" <<'EOF'
import sys
curves = {}  # mode -> {step: (wall, reward)}; a later line (a rerun of the mode) replaces an earlier one
for line in open(sys.argv[1]):
  _, mode, step, wall, reward = line.split()
  curves.setdefault(mode, {})[int(step)] = (float(wall), float(reward))
margin, ahead = float(sys.argv[2]), [m for m in ("async1", "async2") if m in curves]
if "same" not in curves or not ahead:
  print("proof: needs same and async1 or async2 in the curve; not checked")
  sys.exit(0)
target = curves["same"][max(curves["same"])][1] - margin


def reached(mode):  # (seconds, step) of the mode's first checkpoint at the target, else (inf, None)
  return next(((w, s) for s, (w, r) in sorted(curves[mode].items()) if r >= target), (float("inf"), None))


for mode in curves:
  seconds, step = reached(mode)
  print(f"proof: {mode} reaches {target:.3f} (same's last reward - {margin})",
        "never" if step is None else f"at step {step}, {seconds:.1f} s")
if not any(reached(m)[0] < reached("same")[0] for m in ahead):
  print(f"error: no asynchronous mode reached held-out reward {target:.3f} in fewer seconds than same",
        file=sys.stderr)
  sys.exit(1)
EOF
