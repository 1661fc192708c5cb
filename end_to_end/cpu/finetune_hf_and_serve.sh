#!/usr/bin/env bash
# Path 2 of getting_started/Path_finetune.md on CPU, step for step, with a tiny stand-in for a
# released Hugging Face checkpoint (no hub download):
#   a random Qwen3-architecture model + a tokenizer with a ChatML template, saved as `hf download`
#   would leave them -> hf_to_maxtext -> SFT on "continue this line" conversations from the corpus
#   -> the parameters exported -> maxtext_to_hf -> transformers loads the export and answers
#   -> MaxText.serve with the HF tokenizer -> lm-eval's local-completions scores a local task
#   against the server.
#   bash end_to_end/cpu/finetune_hf_and_serve.sh [OUTPUT_DIR]
# Needs the hf and eval extras (EXTRAS=hf,eval bash setup.sh).
# PORT=...: the server's port; 0 (the default) takes a free one, which the server's start-up line names.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
: "${SFT_STEPS:=150}" "${CORPUS:=../shared/data/tinyshakespeare.txt}" "${PORT:=0}"
OUT="${1:-$(mktemp -d)}"
mkdir -p "$OUT"
if [[ ! -f "$CORPUS" ]]; then
  echo "error: corpus $CORPUS not found (set CORPUS=...)" >&2
  exit 2
fi
export JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

# 0. The stand-in checkpoint, the SFT conversations and a multiple-choice task (which line comes next).
python3 - "$CORPUS" "$OUT" <<'PY'
import json, pathlib, random, sys
import torch, transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

corpus, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
lines = [l.strip() for l in corpus.read_text().splitlines() if l.strip() and not l.strip().endswith(":")][:4000]
hf = out / "Qwen3-tiny"
hf.mkdir(exist_ok=True)
tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tokenizer.decoder = decoders.ByteLevel()
special = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
tokenizer.train_from_iterator(lines + ["continue this line:"] * 50, trainers.BpeTrainer(
    vocab_size=1024, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tokenizer.save(str(hf / "tokenizer.json"))
chatml = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
(hf / "tokenizer_config.json").write_text(json.dumps(
    {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "<unk>", "chat_template": chatml,
     "tokenizer_class": "PreTrainedTokenizerFast"}))
config = transformers.Qwen3Config(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                                  tie_word_embeddings=True, bos_token_id=None, eos_token_id=3)
torch.manual_seed(0)
transformers.Qwen3ForCausalLM(config).save_pretrained(str(hf))

rng = random.Random(0)
pairs = [(lines[i], lines[i + 1]) for i in range(len(lines) - 1)]
cut = int(0.9 * len(pairs))
user = lambda line: {"role": "user", "content": "continue this line: " + line}
for name, part in (("train", pairs[:cut]), ("eval", pairs[cut:])):
  with (out / f"sft_{name}.jsonl").open("w") as f:
    for a, b in part:
      f.write(json.dumps({"messages": [user(a), {"role": "assistant", "content": b}]}) + "\n")
tasks = out / "tasks"
tasks.mkdir(exist_ok=True)
render = lambda line: f"<|im_start|>user\ncontinue this line: {line}<|im_end|>\n<|im_start|>assistant\n"
with (tasks / "next_line.jsonl").open("w") as f:
  for a, b in pairs[:cut][:40]:  # lines it trained on: the task asks whether it learned them
    wrong = rng.choice(lines)
    label = rng.randrange(2)
    f.write(json.dumps({"context": render(a), "choices": [b, wrong] if label == 0 else [wrong, b], "label": label}) + "\n")
(tasks / "next_line.yaml").write_text(f"""task: next_line
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tasks / 'next_line.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
""")
print(f"stand-in checkpoint: {sum(p.numel() for p in transformers.Qwen3ForCausalLM(config).parameters()) / 1e6:.2f}M "
      f"parameters in {hf}; {cut} SFT conversations")
PY

# 1. Convert: a parameters-only checkpoint plus its model_config.yml (no model keys needed later).
python3 -m MaxText.convert.hf_to_maxtext hf_model_path="$OUT/Qwen3-tiny" output_path="$OUT/qwen3-tiny-ckpt" | tail -1

# 2. SFT from the converted weights, loss on the assistant's tokens.
python3 -m MaxText.train configs/sft.yml run_name=sft base_output_directory="$OUT/runs" \
  load_parameters_path="$OUT/qwen3-tiny-ckpt" tokenizer_path="$OUT/Qwen3-tiny" \
  hf_data_files="$OUT/sft_train.jsonl" hf_eval_files="$OUT/sft_eval.jsonl" steps="$SFT_STEPS" \
  per_device_batch_size=8 max_target_length=128 learning_rate=2e-3 eval_interval="$SFT_STEPS" eval_steps=4 \
  log_period=50 checkpoint_period="$SFT_STEPS" print_config=False cpu_peak_tflops=0.1 \
  | grep -E '^(eval|done)'

# 3. Export: the run's parameters, then back to Hugging Face's layout.
python3 -m MaxText.generate_param_only_checkpoint configs/base.yml run_name=sft base_output_directory="$OUT/runs" \
  param_only_checkpoint_path="$OUT/sft-params" | tail -1
python3 -m MaxText.convert.maxtext_to_hf load_parameters_path="$OUT/sft-params" output_path="$OUT/sft-hf" | tail -1
cp "$OUT/Qwen3-tiny/tokenizer.json" "$OUT/Qwen3-tiny/tokenizer_config.json" "$OUT/sft-hf/"
python3 - "$OUT" <<'PY'
import pathlib, sys
import transformers
out = pathlib.Path(sys.argv[1])
tokenizer = transformers.AutoTokenizer.from_pretrained(out / "sft-hf")
model = transformers.AutoModelForCausalLM.from_pretrained(out / "sft-hf")
prompt = tokenizer.apply_chat_template([{"role": "user", "content": "continue this line: Before we proceed any further, hear me speak."}],
                                       tokenize=False, add_generation_prompt=True)
ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
answer = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
print(f"transformers loads the export: {type(model).__name__}; greedy answer {tokenizer.decode(answer)!r}")
PY

# 4. Serve the export with the HF tokenizer, and score the task through lm-eval's own client.
: > "$OUT/serve.log"  # there before the loop below reads it, whenever the server starts writing
python3 -m MaxText.serve configs/base.yml load_parameters_path="$OUT/sft-params" tokenizer_type=huggingface add_bos=False \
  tokenizer_path="$OUT/Qwen3-tiny" max_prefill_predict_length=96 max_target_length=128 port="$PORT" >"$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
# The address from this server's own start-up line (printed once its port is bound), never whatever
# else answers on a port.
URL=""
for _ in $(seq 300); do
  URL=$(sed -n 's|^serve: model .* on \(http://[^ ]*\)/v1 .*|\1|p' "$OUT/serve.log")
  [[ -n "$URL" ]] && break
  kill -0 $SERVER 2>/dev/null || { echo "error: the server exited:" >&2; tail -3 "$OUT/serve.log" >&2; exit 1; }
  sleep 1
done
[[ -n "$URL" ]] || { echo "error: the server named no address in 300 s:" >&2; tail -3 "$OUT/serve.log" >&2; exit 1; }
if ! OPENAI_API_KEY=unused lm_eval --model local-completions --tasks next_line --include_path "$OUT/tasks" \
  --model_args "base_url=$URL/v1/completions,model=default,tokenizer=$OUT/Qwen3-tiny,tokenizer_backend=huggingface,max_length=128" \
  >"$OUT/lm_eval.log" 2>&1; then
  echo "error: lm_eval failed; the end of $OUT/lm_eval.log:" >&2
  tail -20 "$OUT/lm_eval.log" >&2
  exit 1
fi
grep -E '^\|' "$OUT/lm_eval.log"
echo "end_to_end ok: converted, fine-tuned, exported to HF, served and evaluated"
