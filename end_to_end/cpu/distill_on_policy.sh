#!/usr/bin/env bash
# On-policy distillation on CPU, on grpo.sh's synthetic task ("last word of: w1 w2 w3 w4" -> "#### w4"):
#   grpo.sh's whole run (its 2-layer width-128 model, SFT on noisy answers then GRPO) is the teacher ->
#   a smaller student (2 layers, width 64) SFT-trained on the same noisy answers -> from that student,
#   the same steps twice: GRPO on the exact_match reward alone, and on-policy distillation from the
#   teacher alone (objective=grpo, rl_teacher_kl_weight=1, rl_reward_advantage_weight=0: each sampled
#   token's advantage is log p_teacher - log p_student; the reward is only logged) -> the held-out
#   reward of the teacher, of the student before, and of each run every STEPS/4 steps -> asserts that
#   distillation raised the student's held-out reward by MARGIN.
#   bash end_to_end/cpu/distill_on_policy.sh [OUTPUT_DIR]
# Needs the hf extra (EXTRAS=hf bash setup.sh), as grpo.sh does.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# Knobs (environment): STUDENT_SFT_STEPS, STEPS (of each student run), MARGIN (the least rise of the held-out reward).
: "${STUDENT_SFT_STEPS:=600}" "${STEPS:=120}" "${MARGIN:=0.3}"
OUT="${1:-$(mktemp -d)}"
mkdir -p "$OUT"

# 1. The teacher: grpo.sh end to end (data, tokenizer, SFT, GRPO, its held-out evaluations), once.
if [[ ! -d "$OUT/teacher/grpo" ]]; then
  bash end_to_end/cpu/grpo.sh "$OUT/teacher" | tail -1
fi
DATA="$OUT/teacher/data"
TEACHER="$OUT/teacher/runs/grpo/checkpoints"  # its run's config.yml names its model keys and its tokenizer

STUDENT=(base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=2 head_dim=16 base_mlp_dim=192
         base_num_decoder_layers=2 vocab_size=512 max_target_length=40 print_config=False cpu_peak_tflops=0.1
         tokenizer_type=huggingface tokenizer_path="$OUT/teacher/tokenizer" base_output_directory="$OUT/runs"
         enable_tensorboard=False)
RL=("${STUDENT[@]}" max_prefill_predict_length=32 max_completion_length=8 reward_functions=exact_match)
export JAX_PLATFORMS=cpu
run() {  # run NAME CONFIG KEY=VALUE... : trains, keeps stdout, shows the last step lines
  local name=$1 config=$2
  shift 2
  python3 -m MaxText.train "$config" run_name="$name" "$@" > "$OUT/stdout_$name.txt"
  grep -E '^step' "$OUT/stdout_$name.txt" | tail -2
  grep -q '^done' "$OUT/stdout_$name.txt" || { echo "error: run $name did not finish" >&2; exit 1; }
}
export_params() {  # export_params RUN DIR: the run's newest parameters as a params-only checkpoint
  python3 -m MaxText.generate_param_only_checkpoint configs/base.yml run_name="$1" "${STUDENT[@]}" \
    param_only_checkpoint_path="$2" > /dev/null
}
evaluate() {  # evaluate NAME CHECKPOINT [MODEL KEYS...]: 8 sampled completions of each held-out prompt, scored
  local name=$1 checkpoint=$2
  shift 2
  python3 -m MaxText.rl.evaluate configs/grpo.yml "${RL[@]}" "$@" load_parameters_path="$checkpoint" \
    hf_data_files="$DATA/heldout.jsonl" num_generations=8 > "$OUT/eval_$name.txt"
  echo "$name $(grep -E '^reward ' "$OUT/eval_$name.txt" | tail -1 | awk '{print $2}')" | tee -a "$OUT/rewards.txt"
}
: > "$OUT/rewards.txt"
rm -rf "$OUT/runs" "$OUT/student_sft"  # the students' runs start over (a run of the same name would resume)
evaluate teacher "$OUT/teacher/grpo" base_emb_dim=128 head_dim=32 base_mlp_dim=384

# 2. The student: SFT from scratch on the teacher's noisy answers, as grpo.sh trains its own.
run student_sft configs/sft.yml "${STUDENT[@]}" hf_data_files="$DATA/sft.jsonl" steps="$STUDENT_SFT_STEPS" \
  learning_rate=3e-3 per_device_batch_size=8 packing=False checkpoint_period=100000 log_period=100 eval_interval=-1
export_params student_sft "$OUT/student_sft"
evaluate student_sft "$OUT/student_sft"

# 3. From the student, STEPS steps of 8 prompts x 8 completions on 4 simulated devices: GRPO on the
# reward, then on-policy distillation from the teacher (the teacher runs forward-only on the same mesh).
# Each run's checkpoints (every STEPS/4 steps) are scored on the held-out prompts.
PERIOD=$((STEPS / 4))
STEP_KEYS=(load_parameters_path="$OUT/student_sft" hf_data_files="$DATA/prompts.jsonl" steps="$STEPS" num_generations=8
           per_device_batch_size=16 learning_rate=2e-3 cosine_learning_rate_final_fraction=1.0
           checkpoint_period="$PERIOD" async_checkpointing=False log_period=1)
XLA_FLAGS=--xla_force_host_platform_device_count=4 run student_grpo configs/grpo.yml "${RL[@]}" "${STEP_KEYS[@]}"
XLA_FLAGS=--xla_force_host_platform_device_count=4 run student_distilled configs/grpo.yml "${RL[@]}" "${STEP_KEYS[@]}" \
  distill_teacher_path="$TEACHER" rl_teacher_kl_weight=1.0 rl_reward_advantage_weight=0.0
for name in student_grpo student_distilled; do
  for step in $(seq "$PERIOD" "$PERIOD" "$STEPS"); do
    evaluate "$name@$step" "$OUT/runs/$name/checkpoints/$step"
  done
done

# 4. The held-out rewards and the training curves (the rollouts' reward and the sampled reverse KL to the
# teacher per completion token, per block of STEPS/4 steps); the check: distillation raised the held-out
# reward by MARGIN.
python3 - "$OUT" "$MARGIN" <<'PY'
import json, pathlib, sys

out, margin = pathlib.Path(sys.argv[1]), float(sys.argv[2])
rewards = {k: float(v) for k, v in (line.split() for line in (out / "rewards.txt").read_text().splitlines())}
steps = sorted(int(k.split("@")[1]) for k in rewards if k.startswith("student_distilled@"))
print(f"held-out reward: teacher {rewards['teacher']:.3f}, student after SFT {rewards['student_sft']:.3f}")
print("| step | " + " | ".join(f"{s}" for s in steps) + " |")
for run in ("student_grpo", "student_distilled"):
  print(f"| {run} held-out | " + " | ".join(f"{rewards[f'{run}@{s}']:.3f}" for s in steps) + " |")
  records = [json.loads(l) for l in (out / "runs" / run / "metrics.jsonl").read_text().splitlines()]
  records = [r for r in records if "reward" in r]
  blocks = [[r for r in records if lo < r["step"] <= hi] for lo, hi in zip([0] + steps, steps)]
  print(f"| {run} training reward | " + " | ".join(f"{sum(r['reward'] for r in b) / len(b):.3f}" for b in blocks) + " |")
  if "teacher_kl" in records[0]:
    print(f"| {run} teacher_kl | " + " | ".join(f"{sum(r['teacher_kl'] for r in b) / len(b):.3f}" for b in blocks)
          + " |")
before, after = rewards["student_sft"], rewards[f"student_distilled@{steps[-1]}"]
print(f"held-out reward: teacher {rewards['teacher']:.3f}; student {before:.3f} -> distilled {after:.3f} "
      f"(needs a rise of {margin}; GRPO on the reward: {rewards[f'student_grpo@{steps[-1]}']:.3f})")
sys.exit(0 if after >= before + margin else 1)
PY
