#!/usr/bin/env bash
# Multi-turn RL with a tool end to end on CPU, on a task that needs the calculator:
#   "what is 347 * 829?" -> <tool_call>{"name": "calculator", "arguments": {"expression": "347 * 829"}}</tool_call>
#                        <- tool: 287663
#                        -> "#### 287663"
#   a byte-level BPE tokenizer (one token per digit) with a ChatML template -> a small model taught the
#   format by SFT on a mix of episodes (the calculator called 40% of the time, a wrong guess without
#   it otherwise) -> the mean reward of sampled episodes on held-out prompts -> GRPO with
#   rl_environment=calculator (the episode's reward: 1 when its final answer is the product) -> the
#   same evaluation -> asserts that the held-out reward rose by MARGIN (see the end).
#   bash end_to_end/cpu/grpo_tools.sh [OUTPUT_DIR]
# Needs the hf extra (EXTRAS=hf bash setup.sh): the chat template is rendered by transformers.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# Knobs (environment): SFT_STEPS, GRPO_STEPS, MARGIN (the least rise of the held-out reward).
: "${SFT_STEPS:=1000}" "${GRPO_STEPS:=120}" "${MARGIN:=0.3}"
OUT="${1:-$(mktemp -d)}"
mkdir -p "$OUT"

# 1-2. The data, the tokenizer and the SFT model (shared with serve_tools.sh).
source end_to_end/cpu/calculator_sft.sh
GRPO=("${MODEL[@]}" max_prefill_predict_length=96 max_completion_length=32 rl_environment=calculator rl_max_turns=2
      reward_functions=[])
evaluate() {  # evaluate CHECKPOINT: 4 sampled episodes of each held-out prompt, scored by the calculator
  python3 -m MaxText.rl.evaluate configs/grpo.yml "${GRPO[@]}" load_parameters_path="$1" \
    hf_data_files="$DATA/heldout.jsonl" num_generations=4 | tee -a "$OUT/evaluations.txt"
}
echo "== before GRPO (the SFT model) on held-out prompts"
evaluate "$OUT/sft"
before=$(grep -E '^reward ' "$OUT/evaluations.txt" | tail -1 | awk '{print $2}')

# 3. GRPO from the SFT model: 8 prompts x 8 episodes per step on 4 simulated devices.
XLA_FLAGS=--xla_force_host_platform_device_count=4 \
  run grpo configs/grpo.yml "${GRPO[@]}" load_parameters_path="$OUT/sft" hf_data_files="$DATA/prompts.jsonl" \
  steps="$GRPO_STEPS" num_generations=8 per_device_batch_size=16 learning_rate=2e-3 cosine_learning_rate_final_fraction=1.0 \
  checkpoint_period=100000 log_period=1
export_params grpo "$OUT/grpo"
echo "== after GRPO on held-out prompts"
evaluate "$OUT/grpo"
after=$(grep -E '^reward ' "$OUT/evaluations.txt" | tail -1 | awk '{print $2}')

# 4. The held-out reward must rise by MARGIN: the SFT model calls the calculator on about 40% of the
# prompts (only those can be right); a policy that learnt to call it is right as often as it copies
# the numbers correctly.
python3 - "$before" "$after" "$MARGIN" <<'PY'
import sys
before, after, margin = map(float, sys.argv[1:])
print(f"held-out reward: {before:.3f} -> {after:.3f} (needs a rise of {margin})")
sys.exit(0 if after >= before + margin else 1)
PY
