#!/usr/bin/env bash
# Post-training end to end on CPU, on tinyshakespeare:
#   a byte-level BPE tokenizer with a ChatML chat template -> a small model pre-trained on the plays
#   -> SFT on generated "continue this line" conversations (loss on the assistant's tokens only)
#   -> DPO where the chosen answer is the true next line and the rejected one a line drawn at random
#   -> the same SFT and DPO with LoRA adapters instead of full fine-tuning
#   -> asserts on the held-out curves (thresholds justified at the assertions below).
#   bash end_to_end/cpu/sft_dpo_lora.sh [OUTPUT_DIR]
# Needs the hf extra (EXTRAS=hf bash setup.sh): the chat template is rendered by transformers.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# Knobs (environment): PRE_STEPS, SFT_STEPS, DPO_STEPS, CORPUS.
: "${PRE_STEPS:=400}" "${SFT_STEPS:=300}" "${DPO_STEPS:=300}" "${CORPUS:=../shared/data/tinyshakespeare.txt}"
OUT="${1:-$(mktemp -d)}"
mkdir -p "$OUT"
if [[ ! -f "$CORPUS" ]]; then
  echo "error: corpus $CORPUS not found (set CORPUS=...)" >&2
  exit 2
fi

# 1. Data and tokenizer. Lines are split 90/10 by position (the held-out tenth is the end of the
# corpus), so every eval conversation and pair is about lines the models never trained on.
python3 - "$CORPUS" "$OUT" <<'PY'
import json, pathlib, random, sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

corpus, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
lines = [l.strip() for l in corpus.read_text().splitlines() if l.strip() and not l.strip().endswith(":")]
cut = int(0.9 * len(lines))
splits = {"train": lines[:cut], "eval": lines[cut:]}
data = out / "data"
data.mkdir(exist_ok=True)

def write(name, records):
  with (data / name).open("w") as f:
    for record in records:
      f.write(json.dumps(record) + "\n")

# Pre-training documents: runs of 16 lines of the play text.
for split, part in splits.items():
  write(f"pretrain_{split}.jsonl", [{"text": "\n".join(part[i:i + 16])} for i in range(0, len(part), 16)])

# ChatML as Qwen writes it, with transformers' {% generation %} markers so its own assistant mask
# can be compared with ours below.
template = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
            "{%- if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
            "{% endgeneration %}{{ '\\n' }}{%- else %}{{ message['content'] + '<|im_end|>\\n' }}{%- endif %}"
            "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tokenizer.decoder = decoders.ByteLevel()
special = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
tokenizer.train_from_iterator(splits["train"] + ["continue this line:"] * 100,
                              trainers.BpeTrainer(vocab_size=1024, special_tokens=special,
                                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tok_dir = out / "tokenizer"
tok_dir.mkdir(exist_ok=True)
tokenizer.save(str(tok_dir / "tokenizer.json"))
(tok_dir / "tokenizer_config.json").write_text(json.dumps(
    {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>", "chat_template": template}))

rng = random.Random(0)
for split, part in splits.items():
  pairs = [(part[i], part[i + 1]) for i in range(len(part) - 1)]
  rng.shuffle(pairs)
  user = lambda line: [{"role": "user", "content": "continue this line: " + line}]
  write(f"sft_{split}.jsonl", [{"messages": user(a) + [{"role": "assistant", "content": b}]} for a, b in pairs])
  # Rejected: a line of the same split drawn at random, so only the continuation tells them apart.
  write(f"dpo_{split}.jsonl", [{"prompt": user(a), "chosen": [{"role": "assistant", "content": b}],
                                "rejected": [{"role": "assistant", "content": rng.choice(part)}]} for a, b in pairs])
print(f"data: {len(lines)} lines, {cut} for training; tokenizer vocab {tokenizer.get_vocab_size()}")
PY

DATA="$OUT/data"
# ~0.9M parameters besides the embeddings; 16 x 128 tokens a step.
MODEL=(base_emb_dim=128 base_num_query_heads=4 base_num_kv_heads=2 head_dim=32 base_mlp_dim=384
       base_num_decoder_layers=3 vocab_size=1024 max_target_length=128 per_device_batch_size=16
       print_config=False cpu_peak_tflops=0.1 tokenizer_type=huggingface tokenizer_path="$OUT/tokenizer"
       base_output_directory="$OUT/runs" enable_tensorboard=False ici_data_parallelism=1 grain_worker_count=1)
export JAX_PLATFORMS=cpu
run() {  # run NAME CONFIG KEY=VALUE... : trains, keeps stdout, shows the step/eval lines
  local name=$1 config=$2
  shift 2
  # `|| true` for grep alone (a run may print no such line); pipefail still stops at a failed run.
  python3 -m MaxText.train "$config" run_name="$name" "${MODEL[@]}" "$@" | tee "$OUT/stdout_$name.txt" \
    | { grep -E '^(eval|done|warning)' || true; }
  grep -q '^done' "$OUT/stdout_$name.txt" || { echo "error: run $name did not finish" >&2; exit 1; }
}
export_params() {  # export_params RUN DIR: the run's newest parameters as a params-only checkpoint
  python3 -m MaxText.generate_param_only_checkpoint configs/base.yml run_name="$1" "${MODEL[@]}" \
    param_only_checkpoint_path="$2" | { grep -E '^(wrote|saved|params)' || true; }
}

# 2. Pre-training on the plays (next-token loss on every token).
run pretrain configs/base.yml dataset_type=hf hf_path=json hf_data_files="$DATA/pretrain_train.jsonl" \
  hf_eval_files="$DATA/pretrain_eval.jsonl" steps="$PRE_STEPS" learning_rate=3e-3 warmup_steps_fraction=0.05 \
  eval_interval=100 eval_steps=4 log_period=100 checkpoint_period=1000
export_params pretrain "$OUT/pretrained"

# 3. SFT, full fine-tuning and LoRA, from the pre-trained weights.
SFT=(hf_data_files="$DATA/sft_train.jsonl" hf_eval_files="$DATA/sft_eval.jsonl" load_parameters_path="$OUT/pretrained"
     eval_steps=8 log_period=50 checkpoint_period=1000)
# The pre-trained model's assistant-token loss on the held-out conversations: one step whose update
# (learning rate 1e-20) is below float32's resolution of the weights, then the evaluation.
run sft_start configs/sft.yml "${SFT[@]}" steps=1 eval_interval=1 learning_rate=1e-20
run sft configs/sft.yml "${SFT[@]}" steps="$SFT_STEPS" eval_interval=50 learning_rate=1e-3
run sft_lora configs/sft.yml "${SFT[@]}" steps="$SFT_STEPS" eval_interval=50 learning_rate=3e-3 lora_rank=16 lora_alpha=32 \
  lora_target_modules=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj
export_params sft "$OUT/sft"
export_params sft_lora "$OUT/sft_lora"

# 4. DPO from each SFT model (the reference is the starting weights), full and LoRA.
DPO=(hf_data_files="$DATA/dpo_train.jsonl" hf_eval_files="$DATA/dpo_eval.jsonl" steps="$DPO_STEPS"
     eval_interval=50 eval_steps=32 log_period=50 checkpoint_period=1000 dpo_beta=0.1 per_device_batch_size=8)
run dpo configs/dpo.yml "${DPO[@]}" load_parameters_path="$OUT/sft" learning_rate=3e-4
run dpo_lora configs/dpo.yml "${DPO[@]}" load_parameters_path="$OUT/sft_lora" learning_rate=1e-3 lora_rank=16 \
  lora_alpha=32 lora_target_modules=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj

# 5. The curves, and what they must show.
python3 - "$OUT" <<'PY'
import json, math, pathlib, sys
sys.path.insert(0, ".")
out = pathlib.Path(sys.argv[1])

def evals(name, key):
  rows = [json.loads(l) for l in (out / "runs" / name / "metrics.jsonl").read_text().splitlines()]
  return [(r["step"], r[key]) for r in rows if key in r]

def show(name, key):
  curve = evals(name, key)
  print(f"{name:9s} {key:28s} " + "  ".join(f"{s}:{v:.3f}" for s, v in curve))
  return [v for _, v in curve]

# Prompt tokens carry no weight: our SFT weights equal transformers' own assistant mask.
from transformers import AutoTokenizer
from MaxText.input_pipeline import chat
record = json.loads((out / "data/sft_eval.jsonl").read_text().splitlines()[0])
hf = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
theirs = hf.apply_chat_template(record["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
encoder = chat.SftEncoder(chat.load_chat_tokenizer(str(out / "tokenizer")), 128, True, False, False)
tokens, weights = encoder(record)
assert list(tokens) == list(theirs["input_ids"]), "our chat tokens differ from transformers'"
assert list(weights) == list(theirs["assistant_masks"]), (list(weights), theirs["assistant_masks"])
print(f"sft: {sum(weights)} of {len(weights)} tokens of a held-out conversation are trained (the assistant's), "
      "as transformers' own mask says")

pre = show("pretrain", "eval_loss")
# The pre-trained model must have learnt the plays: below the 6.93 nats of a uniform guess over 1024.
assert pre[-1] < pre[0] and pre[-1] < 5.5, pre
start = show("sft_start", "eval_loss")[0]
for name in ("sft", "sft_lora"):
  curve = show(name, "eval_loss")
  # Every evaluation reads the same held-out batches, so the curve has no sampling noise: the
  # fine-tuned loss must end at least 0.05 nats below the pre-trained model's on them.
  assert curve[-1] < start - 0.05, (name, start, curve)
for name in ("dpo", "dpo_lora"):
  accuracy = show(name, "eval_rewards/accuracies")
  margins = show(name, "eval_rewards/margins")
  # At the start policy = reference, so every reward is 0 and no pair counts as won. 256 held-out
  # pairs per evaluation (32 batches of 8): a policy that could not tell the true next line from a
  # random one would win each pair with probability 0.5 and score above 0.57 with probability
  # about 1.3% (0.57 is 2.24 standard errors of 0.031 above chance). The margin must grow too.
  assert accuracy[-1] > 0.57 and margins[-1] > margins[0] > 0, (name, accuracy, margins)
print("sft_dpo_lora: all checks passed")
PY
