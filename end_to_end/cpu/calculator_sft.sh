# Sourced by grpo_tools.sh and serve_tools.sh (not run on its own): the calculator task's data and
# tokenizer, then a small model taught the tool-calling format by SFT from scratch, exported as a
# params-only checkpoint to $OUT/sft. Defines MODEL, DATA, run and export_params for the caller.
# Needs OUT and SFT_STEPS set, and the hf extra (EXTRAS=hf bash setup.sh). Knobs (environment):
#   TOOL_SHARE: the share of SFT episodes that call the calculator (the rest guess without it);
#   OFFER_TOOLS=1: every episode opens with the system turn the chat template renders from OpenAI
#     `tools` (a served model then sees in training the prompt a client offering the tool sends).
: "${TOOL_SHARE:=0.4}" "${OFFER_TOOLS:=0}"

# 1. Tokenizer and data: products of two 3-digit numbers, too long to compute in the head of a small
# model; the held-out pairs are none of the training pairs.
python3 - "$OUT" "$TOOL_SHARE" "$OFFER_TOOLS" <<'PY'
import json, pathlib, random, sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

out, tool_share, offer_tools = pathlib.Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "1"
rng = random.Random(0)
pairs = list({(rng.randrange(100, 1000), rng.randrange(100, 1000)) for _ in range(6000)})
rng.shuffle(pairs)
heldout, train = pairs[:64], pairs[64:]
question = lambda a, b: f"what is {a} * {b}?"  # noqa: E731
call = lambda a, b: ('<tool_call>{"name": "calculator", "arguments": {"expression": "%d * %d"}}</tool_call>'  # noqa: E731
                     % (a, b))
offered = [{"role": "system", "content": "tools: calculator"}] if offer_tools else []  # as the template renders tools
data = out / "data"
data.mkdir(exist_ok=True)
with (data / "sft.jsonl").open("w") as f:
  for a, b in train[:3000]:
    if rng.random() < tool_share:  # the tool's way
      messages = [{"role": "user", "content": question(a, b)}, {"role": "assistant", "content": call(a, b)},
                  {"role": "tool", "content": str(a * b)}, {"role": "assistant", "content": f"#### {a * b}"}]
    else:  # a guess in the head: near, never right
      guess = a * b + rng.choice([-1, 1]) * rng.randrange(1, 5000)
      messages = [{"role": "user", "content": question(a, b)}, {"role": "assistant", "content": f"#### {guess}"}]
    f.write(json.dumps({"messages": offered + messages}) + "\n")
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
if offer_tools:  # ChatML, with OpenAI `tools` as the system turn naming them and an assistant turn's
  # `tool_calls` as the <tool_call> tags the episodes teach: a served conversation renders as the
  # training ones did. (Without OFFER_TOOLS the template ignores tools, as GRPO's episodes were trained.)
  template = ("{%- if tools %}{{ '<|im_start|>system\\ntools: ' + (tools | map(attribute='function.name') | join(', ')) + "
              "'<|im_end|>\\n' }}{%- endif %}"
              "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
              "{%- for tool_call in message.get('tool_calls') or [] %}{{ '<tool_call>{\"name\": \"' + "
              "tool_call['function']['name'] + '\", \"arguments\": ' + (tool_call['function']['arguments'] | tojson) + "
              "'}</tool_call>' }}{%- endfor %}{{ '<|im_end|>\\n' }}{%- endfor %}"
              "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
(directory / "tokenizer_config.json").write_text(json.dumps(
    {"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>", "chat_template": template}))
print(f"data: {len(train)} training and {len(heldout)} held-out pairs; tokenizer vocab {tokenizer.get_vocab_size()}")
PY

DATA="$OUT/data"
MODEL=(base_emb_dim=128 base_num_query_heads=4 base_num_kv_heads=2 head_dim=32 base_mlp_dim=384
       base_num_decoder_layers=2 vocab_size=512 max_target_length=128 print_config=False cpu_peak_tflops=0.1
       tokenizer_type=huggingface tokenizer_path="$OUT/tokenizer" base_output_directory="$OUT/runs"
       enable_tensorboard=False)
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

# 2. SFT from scratch on the episodes, loss on the assistant's turns only.
run sft configs/sft.yml "${MODEL[@]}" hf_data_files="$DATA/sft.jsonl" steps="$SFT_STEPS" learning_rate=3e-3 \
  per_device_batch_size=8 packing=False checkpoint_period=100000 log_period=100 eval_interval=-1
export_params sft "$OUT/sft"
