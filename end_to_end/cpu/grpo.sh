#!/usr/bin/env bash
# Reinforcement learning end to end on CPU, on a synthetic task with a verifiable answer:
#   "last word of: w1 w2 w3 w4" -> "#### w4".
#   a byte-level BPE tokenizer with a ChatML template -> a small model taught the task's format by
#   SFT on noisy answers (the last word 40% of the time, another word of the prompt otherwise), so its
#   samples are right about 40% of the time -> the mean reward of sampled completions of held-out
#   prompts -> GRPO with the exact_match reward -> the same evaluation -> asserts that the held-out
#   reward rose by a wide margin (see the end).
#   bash end_to_end/cpu/grpo.sh [OUTPUT_DIR]
# Needs the hf extra (EXTRAS=hf bash setup.sh): the chat template is rendered by transformers.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# Knobs (environment): SFT_STEPS, GRPO_STEPS, MARGIN (the least rise of the held-out reward).
: "${SFT_STEPS:=600}" "${GRPO_STEPS:=240}" "${MARGIN:=0.3}"
OUT="${1:-$(mktemp -d)}"
mkdir -p "$OUT"

# 1. Tokenizer and data: 24 words; prompts are 4 distinct words, the answer is the last one. The
# held-out prompts are word sequences none of the training prompts has.
python3 - "$OUT" <<'PY'
import itertools, json, pathlib, random, sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

out = pathlib.Path(sys.argv[1])
rng = random.Random(0)
words = ("apple river stone cloud tiger lemon piano rocket garden silver window candle "
         "forest mirror planet violin harbor meadow lantern castle falcon ocean pepper thunder").split()
sequences = [list(s) for s in itertools.permutations(words, 4)]
rng.shuffle(sequences)
heldout, train = sequences[:64], sequences[64:4064]
question = lambda s: "last word of: " + " ".join(s)  # noqa: E731
data = out / "data"
data.mkdir(exist_ok=True)
with (data / "sft.jsonl").open("w") as f:
  for s in train[:2000]:
    f.write(json.dumps({"messages": [{"role": "user", "content": question(s)},
                                     {"role": "assistant", "content": "#### " + (s[-1] if rng.random() < 0.4
                                                                                  else rng.choice(s[:-1]))}]}) + "\n")
for name, part in (("prompts", train[2000:]), ("heldout", heldout)):
  with (data / f"{name}.jsonl").open("w") as f:
    for s in part:
      f.write(json.dumps({"prompt": question(s), "answer": s[-1]}) + "\n")

special = ["<unk>", "<s>", "<|im_start|>", "<|im_end|>"]
tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tokenizer.decoder = decoders.ByteLevel()
corpus = [f"user\n{question(s)}\nassistant\n#### {s[-1]}" for s in train]
tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
directory = out / "tokenizer"
directory.mkdir(exist_ok=True)
tokenizer.save(str(directory / "tokenizer.json"))
template = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
            "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
(directory / "tokenizer_config.json").write_text(json.dumps(
    {"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>", "chat_template": template}))
print(f"data: {len(train)} training and {len(heldout)} held-out prompts; tokenizer vocab {tokenizer.get_vocab_size()}")
PY

DATA="$OUT/data"
MODEL=(base_emb_dim=128 base_num_query_heads=4 base_num_kv_heads=2 head_dim=32 base_mlp_dim=384
       base_num_decoder_layers=2 vocab_size=512 max_target_length=40 print_config=False cpu_peak_tflops=0.1
       tokenizer_type=huggingface tokenizer_path="$OUT/tokenizer" base_output_directory="$OUT/runs"
       enable_tensorboard=False)
GRPO=("${MODEL[@]}" max_prefill_predict_length=32 max_completion_length=8 reward_functions=exact_match)
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
evaluate() {  # evaluate CHECKPOINT: 8 sampled completions of each held-out prompt, scored
  python3 -m MaxText.rl.evaluate configs/grpo.yml "${GRPO[@]}" load_parameters_path="$1" \
    hf_data_files="$DATA/heldout.jsonl" num_generations=8 | tee -a "$OUT/evaluations.txt"
}

# 2. SFT from scratch on the noisy answers "#### <word>", loss on the answer only.
run sft configs/sft.yml "${MODEL[@]}" hf_data_files="$DATA/sft.jsonl" steps="$SFT_STEPS" learning_rate=3e-3 \
  per_device_batch_size=8 packing=False checkpoint_period=100000 log_period=100 eval_interval=-1
export_params sft "$OUT/sft"
echo "== before GRPO (the SFT model) on held-out prompts"
evaluate "$OUT/sft"
before=$(grep -E '^reward ' "$OUT/evaluations.txt" | tail -1 | awk '{print $2}')

# 3. GRPO from the SFT model: 8 prompts x 8 completions per step on 4 simulated devices.
XLA_FLAGS=--xla_force_host_platform_device_count=4 \
  run grpo configs/grpo.yml "${GRPO[@]}" load_parameters_path="$OUT/sft" hf_data_files="$DATA/prompts.jsonl" \
  steps="$GRPO_STEPS" num_generations=8 per_device_batch_size=16 learning_rate=2e-3 cosine_learning_rate_final_fraction=1.0 \
  checkpoint_period=100000 log_period=1
export_params grpo "$OUT/grpo"
echo "== after GRPO on held-out prompts"
evaluate "$OUT/grpo"
after=$(grep -E '^reward ' "$OUT/evaluations.txt" | tail -1 | awk '{print $2}')

# 4. The held-out reward must rise by MARGIN: the SFT model's samples are right about 40% of the time;
# a policy that learnt the task is right nearly always.
python3 - "$before" "$after" "$MARGIN" <<'PY'
import sys
before, after, margin = map(float, sys.argv[1:])
print(f"held-out reward: {before:.3f} -> {after:.3f} (needs a rise of {margin})")
sys.exit(0 if after >= before + margin else 1)
PY
