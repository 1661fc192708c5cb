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

# 1. Tokenizer and data: products of two 3-digit numbers, too long to compute in the head of a small
# model; the held-out pairs are none of the training pairs.
python3 - "$OUT" <<'PY'
import json, pathlib, random, sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

out = pathlib.Path(sys.argv[1])
rng = random.Random(0)
pairs = list({(rng.randrange(100, 1000), rng.randrange(100, 1000)) for _ in range(6000)})
rng.shuffle(pairs)
heldout, train = pairs[:64], pairs[64:]
question = lambda a, b: f"what is {a} * {b}?"  # noqa: E731
call = lambda a, b: ('<tool_call>{"name": "calculator", "arguments": {"expression": "%d * %d"}}</tool_call>'  # noqa: E731
                     % (a, b))
data = out / "data"
data.mkdir(exist_ok=True)
with (data / "sft.jsonl").open("w") as f:
  for a, b in train[:3000]:
    if rng.random() < 0.4:  # the tool's way
      messages = [{"role": "user", "content": question(a, b)}, {"role": "assistant", "content": call(a, b)},
                  {"role": "tool", "content": str(a * b)}, {"role": "assistant", "content": f"#### {a * b}"}]
    else:  # a guess in the head: near, never right
      guess = a * b + rng.choice([-1, 1]) * rng.randrange(1, 5000)
      messages = [{"role": "user", "content": question(a, b)}, {"role": "assistant", "content": f"#### {guess}"}]
    f.write(json.dumps({"messages": messages}) + "\n")
for name, part in (("prompts", train[3000:]), ("heldout", heldout)):
  with (data / f"{name}.jsonl").open("w") as f:
    for a, b in part:
      f.write(json.dumps({"prompt": question(a, b), "answer": str(a * b)}) + "\n")

special = ["<unk>", "<s>", "<|im_start|>", "<|im_end|>"]
tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                   pre_tokenizers.ByteLevel(add_prefix_space=False)])
tokenizer.decoder = decoders.ByteLevel()
corpus = [f"user\n{question(a, b)}\nassistant\n{call(a, b)}\ntool\n{a * b}\nassistant\n#### {a * b}" for a, b in train]
tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
directory = out / "tokenizer"
directory.mkdir(exist_ok=True)
tokenizer.save(str(directory / "tokenizer.json"))
template = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
            "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
(directory / "tokenizer_config.json").write_text(json.dumps(
    {"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>", "chat_template": template}))
print(f"data: {len(train)} training and {len(heldout)} held-out pairs; tokenizer vocab {tokenizer.get_vocab_size()}")
PY

DATA="$OUT/data"
MODEL=(base_emb_dim=128 base_num_query_heads=4 base_num_kv_heads=2 head_dim=32 base_mlp_dim=384
       base_num_decoder_layers=2 vocab_size=512 max_target_length=128 print_config=False cpu_peak_tflops=0.1
       tokenizer_type=huggingface tokenizer_path="$OUT/tokenizer" base_output_directory="$OUT/runs"
       enable_tensorboard=False)
GRPO=("${MODEL[@]}" max_prefill_predict_length=96 max_completion_length=32 rl_environment=calculator rl_max_turns=2
      reward_functions=[])
export JAX_PLATFORMS=cpu
run() {  # run NAME CONFIG KEY=VALUE... : trains, keeps stdout, shows the last step lines
  local name=$1 config=$2
  shift 2
  python3 -m MaxText.train "$config" run_name="$name" "$@" > "$OUT/stdout_$name.txt"
  grep -E '^step' "$OUT/stdout_$name.txt" | tail -3
  grep -q '^done' "$OUT/stdout_$name.txt" || { echo "error: run $name did not finish" >&2; exit 1; }
}
export_params() {  # export_params RUN DIR: the run's newest parameters as a params-only checkpoint
  python3 -m MaxText.generate_param_only_checkpoint configs/base.yml run_name="$1" "${MODEL[@]}" \
    param_only_checkpoint_path="$2" > /dev/null
}
evaluate() {  # evaluate CHECKPOINT: 4 sampled episodes of each held-out prompt, scored by the calculator
  python3 -m MaxText.rl.evaluate configs/grpo.yml "${GRPO[@]}" load_parameters_path="$1" \
    hf_data_files="$DATA/heldout.jsonl" num_generations=4 | tee -a "$OUT/evaluations.txt"
}

# 2. SFT from scratch on the episodes, loss on the assistant's turns only.
run sft configs/sft.yml "${MODEL[@]}" hf_data_files="$DATA/sft.jsonl" steps="$SFT_STEPS" learning_rate=3e-3 \
  per_device_batch_size=8 packing=False checkpoint_period=100000 log_period=100 eval_interval=-1
export_params sft "$OUT/sft"
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
